"""Bad calls raise ValueError (TypeError for a wrong type) whose message names
the argument, the expected and the actual value; nothing crashes and no
caller memory changes."""

import re

import numpy as np
import pytest
import torch
from torch.nn.attention.bias import causal_lower_right

import qkv
from qkv.torch import scaled_dot_product_attention as sdpa

R = np.random.default_rng(0)
Q = R.standard_normal((2, 5, 4, 8)).astype(np.float32)
K = R.standard_normal((2, 7, 2, 8)).astype(np.float32)
V = K.copy()
Z = np.zeros((1, 2, 1, 4), np.float32)
T = torch.zeros(1, 1, 2, 4)


class MaskSubclass(torch.Tensor):
    """A tensor subclass, which may mean something other than its data."""


def cache(capacity=4):
    return qkv.KvCache(batch=1, kv_heads=1, head_dim=4, capacity=capacity)


BAD = [
    (ValueError, "query heads Hq = 4 must be a multiple of the KV heads Hkv = 3",
     lambda: qkv.attention(Q, np.repeat(K[:, :, :1], 3, 2), np.repeat(V[:, :, :1], 3, 2))),
    (ValueError, "k: expected head dim (dim 3) 8 to match q's, got 4",
     lambda: qkv.attention(Q, K[..., :4], V)),
    (ValueError, "k: expected batch size (dim 0) 2 to match q's batch 2, got 1",
     lambda: qkv.attention(Q, K[:1], V[:1])),
    (ValueError, "q: expected 4 dimensions, got shape [5, 4, 8]", lambda: qkv.attention(Q[0], K, V)),
    (ValueError, "q: expected float32, float64, float16, bfloat16 or bool elements, got int32",
     lambda: qkv.attention(Q.astype(np.int32), K, V)),
    (ValueError, "k: expected dtype f32 (the dtype of q), got f64",
     lambda: qkv.attention(Q, K.astype(np.float64), V)),
    (ValueError, "options.window_left: expected -1 (unbounded) or a size >= 0, got -2",
     lambda: qkv.attention(Q, K, V, window=(-2, 0))),
    (TypeError, "window: expected a pair (left, right), got 3",
     lambda: qkv.attention(Q, K, V, window=3)),
    (ValueError, "options.key_lengths: expected one length per sequence (2), got 1",
     lambda: qkv.attention(Q, K, V, key_lengths=[1])),
    (ValueError, "options.key_lengths[1]: expected a length in [0, 7]",
     lambda: qkv.attention(Q, K, V, key_lengths=[1, 9])),
    (ValueError, "options.key_lengths[0]: expected a length in [0, 7]",
     lambda: qkv.attention(Q, K, V, key_lengths=[-1, 2])),
    (TypeError, "key_lengths: expected integers, got float64",
     lambda: qkv.attention(Q, K, V, key_lengths=[1.5, 2])),
    (ValueError, "options.mask: sizes [5, 6] do not broadcast to [B, Hq, Nq, Nk] = [2, 4, 5, 7]",
     lambda: qkv.attention(Q, K, V, mask=np.ones((5, 6), bool))),
    (ValueError, "mask: expected at most 4 dimensions, got 5",
     lambda: qkv.attention(Q, K, V, mask=np.ones((1, 2, 4, 5, 7), bool))),
    (ValueError, "options.alibi_slopes: expected Hq = 4 or B * Hq = 2 * 4 slopes, got 3",
     lambda: qkv.attention(Q, K, V, alibi_slopes=[1.0, 2.0, 3.0])),
    (ValueError, "options.alibi_slopes[3]: expected a finite slope, got nan",
     lambda: qkv.attention(Q, K, V, alibi_slopes=[1.0, 2.0, 3.0, np.nan])),
    (ValueError, "options.softcap: expected 0 (off) or a value in [2^-126, 2^126]",
     lambda: qkv.attention(Q, K, V, softcap=-1.0)),
    (ValueError, "options.scale: expected a finite number within the f32 range",
     lambda: qkv.attention(Q, K, V, scale=float("inf"))),
    (ValueError, "options.dropout_p: expected a probability in [0, 1), got 1",
     lambda: qkv.attention(Q, K, V, dropout_p=1.0)),
    (ValueError, "score: expected 'scaled_dot', 'dot' or 'additive', got 'cosine'",
     lambda: qkv.attention(Q, K, V, score="cosine")),
    (ValueError, "backend: expected 'automatic', 'reference' or 'fast', got 'gpu'",
     lambda: qkv.attention(Q, K, V, backend="gpu")),
    (ValueError, "align: expected 'bottom_right' or 'top_left', got 'middle'",
     lambda: qkv.attention(Q, K, V, align="middle")),
    (ValueError, "options.cu_seqlens_k: expected the last offset to equal k's packed length 7, "
                 "got 3",
     lambda: qkv.attention(Q[:1], K[:1], V[:1], cu_seqlens_q=[0, 5], cu_seqlens_k=[0, 3])),
    (ValueError, "options.cu_seqlens_k: expected together with cu_seqlens_q",
     lambda: qkv.attention(Q[:1], K[:1], V[:1], cu_seqlens_q=[0, 5])),
    (ValueError, "q: expected non-negative strides, got stride -32 in dimension 1",
     lambda: qkv.attention(Q[:, ::-1], K, V)),
    (TypeError, "q: expected a NumPy array or a PyTorch tensor, got list",
     lambda: qkv.attention([[1.0]], K, V)),
    (ValueError, "q: expected a CPU tensor, got device 'meta'",
     lambda: qkv.attention(torch.zeros(1, 1, 1, 4, device="meta"), torch.zeros(1, 1, 1, 4),
                           torch.zeros(1, 1, 1, 4))),
    (ValueError, "k: expected a strided (dense) tensor, got layout torch.sparse_coo",
     lambda: qkv.attention(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4).to_sparse(),
                           torch.zeros(1, 1, 1, 4))),
    (ValueError, "lse: expected sizes [2, 4, 5], got [2, 4, 4]",
     lambda: qkv.attention_backward(Q, K, V, Q, Q, np.zeros((2, 4, 4), np.float32))),
    (ValueError, "config.head_dim: expected >= 1, got 0",
     lambda: qkv.KvCache(batch=1, kv_heads=1, head_dim=0, capacity=4)),
    (ValueError, "dtype: expected 'float32', 'bfloat16' or 'float16', got 'int8'",
     lambda: qkv.KvCache(batch=1, kv_heads=1, head_dim=4, capacity=4, dtype="int8")),
    (ValueError, "append: sequence 0 would hold 5 tokens, more than capacity 4",
     lambda: cache().append(np.zeros((1, 5, 1, 4), np.float32), np.zeros((1, 5, 1, 4), np.float32))),
    (ValueError, "cache: sequence 0 holds 0 tokens, fewer than the 1 new queries",
     lambda: qkv.decode_attention(np.zeros((1, 1, 1, 4), np.float32), cache())),
    (ValueError, "rope.rotary_dim: 0 rotates the whole head, which needs an even head dim",
     lambda: qkv.apply_rope(np.zeros((1, 2, 1, 5), np.float32), [0])),
    (ValueError, "start_positions: expected one position per sequence (B = 2), got 1",
     lambda: qkv.apply_rope(np.zeros((2, 2, 1, 4), np.float32), [0])),
    (ValueError, "feature_map: expected 'elu_plus_one' or 'relu', got 'softmax'",
     lambda: qkv.linear_attention(Q, K, V, feature_map="softmax")),
    (ValueError, "options.causal: causal linear attention needs as many queries as keys",
     lambda: qkv.linear_attention(Q, K, V, causal=True)),
    (ValueError, "SparsePattern::strided: stride must be >= 1; got 0",
     lambda: qkv.SparsePattern.strided(0)),
    (ValueError, "n: expected a thread count >= 1, got 0", lambda: qkv.set_num_threads(0)),
    (TypeError, "n: expected an int, got float", lambda: qkv.set_num_threads(2.0)),
    (qkv.ArgumentError, "Explicit attn_mask should not be set when is_causal=True",
     lambda: sdpa(T, T, T, attn_mask=torch.ones(2, 2, dtype=torch.bool), is_causal=True)),
    (qkv.ArgumentError, "query has 2 heads and key 1; pass enable_gqa=True",
     lambda: sdpa(torch.zeros(1, 2, 2, 4), T, T)),
    (qkv.ArgumentError, "dropout_p: expected a probability in [0, 1], got 1.5",
     lambda: sdpa(T, T, T, dropout_p=1.5)),
    (qkv.ArgumentError, "value: expected shape [..., 1, 2, Ev], got [1, 1, 3, 4]",
     lambda: sdpa(T, T, torch.zeros(1, 1, 3, 4))),
    (TypeError, "argument 'is_causal' must be bool, not str",
     lambda: sdpa(T, T, T, is_causal="no")),
    (TypeError, "got the tensor subclass test_errors.MaskSubclass, which qkv does not read",
     lambda: sdpa(T, T, T, attn_mask=torch.zeros(2, 2).as_subclass(MaskSubclass))),
    (qkv.ArgumentError, "a causal_lower_right bias of shape (2, 3) does not broadcast",
     lambda: sdpa(T, T, T, attn_mask=causal_lower_right(2, 3))),
    (qkv.ArgumentError, "expected query, key and value of the same rank >= 2, got shapes [4]",
     lambda: sdpa(T[0, 0, 0], T, T)),
]


@pytest.mark.parametrize("error,message,call", BAD, ids=[m[:40] for _, m, _ in BAD])
def test_bad_call_names_the_problem(error, message, call):
    with pytest.raises(error, match=re.escape(message)):
        call()


def test_there_are_at_least_thirty_bad_calls():
    assert len(BAD) >= 30


def test_a_failed_append_changes_nothing():
    c = cache()
    c.append(np.ones((1, 3, 1, 4), np.float32), np.ones((1, 3, 1, 4), np.float32))
    with pytest.raises(ValueError):
        c.append(np.ones((1, 2, 1, 4), np.float32), np.ones((1, 2, 1, 4), np.float32))
    assert c.lengths() == [3]


def test_a_rejected_call_leaves_inputs_alone():
    q = Q.copy()
    with pytest.raises(ValueError):
        qkv.attention(q, K, V, window=(-5, 0))
    assert np.array_equal(q, Q)

"""Reference math and the deterministic sampling of the FlashAttention test port
(test_flash_attn_port.py).

The helpers re-implement, on CPU and without einops or flash_attn, what FlashAttention's
tests/test_flash_attn.py computes with its own helpers (attention_ref, construct_local_mask,
generate_qkv, unpad_input / pad_input, apply_rotary_emb, ...): the same masks, the same
reference math and the same conversions of S_dmask. FlashAttention is BSD-3-Clause,
Copyright (c) 2022 Tri Dao and others; see README.md in this folder.
"""

from __future__ import annotations

import inspect
import itertools
import math
import os
import random
from typing import Callable, Dict, List, Optional, Sequence

import pytest
import torch
import torch.nn.functional as F

# --------------------------------------------------------------------------------------------
# Sampling of the parameter grids
#
# Every test function of the original is parametrized by a cartesian product far too big for
# a CPU (test_flash_attn_kvcache alone has 152,064 combinations). Each grid here is sampled
# deterministically:
#   1. enumerate the product in the original's order and drop the combinations the original
#      skips unconditionally (pytest.skip at the top of the test, e.g. softcap with dropout);
#   2. give every combination a random key log(u) / w (Efraimidis-Spirakis weighted sampling
#      without replacement), u from random.Random(f"{test name}:{QKV_PEER_SEED}") and
#      w = cost ** -COST_EXPONENT, the test's estimated cost (mostly the attention matrix
#      size times the head dimension), so cheap combinations are drawn more often;
#   3. cover every value of every parameter: for each (parameter, value) not yet drawn, take
#      the cheapest combination with that value (the largest key among equally cheap ones);
#   4. fill up with the largest keys to the grid's sample count, within a cost budget of
#      FILL_COST per case (a case costing more than FILL_MAX_COST is left to the coverage).
# A case costing SLOW_COST or more is marked `slow`: about a third of a second or more on a
# 2-core machine, left out by scripts/test.sh --quick (not by the full run).
# The draw depends only on the grid, the test name and QKV_PEER_SEED.
#
# Environment:
#   QKV_PEER_FULL=1       run every combination of every grid (the original's full grids;
#                         days of CPU time) and the original's repeat counts;
#   QKV_PEER_SAMPLES=N    draw N combinations per sampled grid (default: per grid, in the tests);
#   QKV_PEER_SEED=S       draw another sample (default 0);
#   QKV_PEER_REPEATS=R    iterations of the repeated-run loops of the determinism and race
#                         condition tests (default 3 and 1 instead of 50 and 250; full: the
#                         original's).

FULL = os.environ.get("QKV_PEER_FULL", "") not in ("", "0")
SAMPLES = int(os.environ["QKV_PEER_SAMPLES"]) if os.environ.get("QKV_PEER_SAMPLES") else None
SEED = int(os.environ.get("QKV_PEER_SEED", "0"))
REPEATS = int(os.environ["QKV_PEER_REPEATS"]) if os.environ.get("QKV_PEER_REPEATS") else None
COST_EXPONENT = 1.0
FILL_COST = 4e8  # the fill's budget per drawn case, in the tests' cost units (~0.2 ns)
FILL_MAX_COST = 2e9
SLOW_COST = 1e8  # cases from this cost on carry the `slow` marker (scripts/test.sh --quick skips them)


def repeats(original: int, default: int = 3) -> int:
    """Iterations of a repeated-run loop: the original's count when QKV_PEER_FULL is set."""
    if REPEATS is not None:
        return REPEATS
    return original if FULL else min(original, default)


def _id_part(name: str, value) -> str:
    if isinstance(value, torch.dtype):
        return {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[value]
    if isinstance(value, bool):
        return name if value else f"no_{name}"
    if value is None:
        return f"{name}=None"
    if isinstance(value, tuple):
        return f"{name}=" + "x".join(str(x) for x in value)
    return f"{name}={value}"


def sample_grid(
    test: str,
    axes: Dict[str, Sequence],
    count: int,
    *,
    keep: Optional[Callable[..., bool]] = None,
    cost: Optional[Callable[..., float]] = None,
) -> List:
    """pytest.params of a deterministic sample of the product of `axes` (see above).

    `axes` maps a parameter name to its values; a name "a,b" takes tuples of values (the
    original's paired parameters such as "seqlen_q,seqlen_k"). `keep(...)` drops the
    combinations the original skips unconditionally; `cost(...)` estimates a combination's
    cost; both are called with the parameters they name (by keyword). The params come out
    in the product's order, their ids name every parameter.
    """
    names = list(axes)
    values = [list(axes[name]) for name in names]
    axis_of = {part: a for a, name in enumerate(names) for part in name.split(",")}

    def params_of(idx):
        params = {}
        for name, column, i in zip(names, values, idx):
            if "," in name:
                params.update(zip(name.split(","), column[i]))
            else:
                params[name] = column[i]
        return params

    def memoized(fn):
        # fn depends only on the parameters it names: evaluate it once per sub-combination.
        wanted = [p for p in inspect.signature(fn).parameters if p in axis_of]
        used = sorted({axis_of[p] for p in wanted})
        memo = {}

        def call(idx):
            sub = tuple(idx[a] for a in used)
            if sub not in memo:
                params = params_of(idx)
                memo[sub] = fn(**{p: params[p] for p in wanted})
            return memo[sub]

        return call

    keep_fn = memoized(keep) if keep is not None else None
    cost_fn = memoized(cost) if cost is not None else None
    combos = [
        idx
        for idx in itertools.product(*(range(len(column)) for column in values))
        if keep_fn is None or keep_fn(idx)
    ]
    n = len(combos) if FULL else min(len(combos), SAMPLES if SAMPLES is not None else count)
    if n < len(combos):
        rng = random.Random(f"{test}:{SEED}")
        costs = [cost_fn(idx) if cost_fn is not None else 1.0 for idx in combos]
        keys = [math.log(1.0 - rng.random()) * c**COST_EXPONENT for c in costs]
        order = sorted(range(len(combos)), key=lambda i: -keys[i])
        cheapest = sorted(range(len(combos)), key=lambda i: (costs[i], -keys[i]))
        chosen = set()
        covered = set()
        for axis, column in enumerate(values):
            for value in range(len(column)):
                if (axis, value) in covered:
                    continue
                for i in cheapest:
                    if combos[i][axis] == value:
                        chosen.add(i)
                        covered.update(enumerate(combos[i]))
                        break
        # The fill: the largest keys, within a cost budget that grows with the sample size,
        # each case at most FILL_MAX_COST (the coverage above is not budgeted).
        budget = n * FILL_COST
        for i in order:
            if len(chosen) >= n:
                break
            if i in chosen or costs[i] > min(budget, FILL_MAX_COST):
                continue
            chosen.add(i)
            budget -= costs[i]
        picked = [combos[i] for i in sorted(chosen)]
    else:
        picked = combos
    result = []
    for idx in picked:
        params = params_of(idx)
        ident = "-".join(_id_part(k, v) for k, v in params.items())
        slow = cost_fn is not None and cost_fn(idx) >= SLOW_COST
        result.append(pytest.param(*params.values(), id=ident,
                                   marks=[pytest.mark.slow] if slow else []))
    return result


def argnames(axes: Dict[str, Sequence]) -> str:
    return ",".join(axes)


# --------------------------------------------------------------------------------------------
# Low-precision einsum
#
# The original's "PyTorch implementation in the low precision" (attention_ref with
# upcast=False) runs float16 / bfloat16 einsums on CUDA, where a half-precision matmul
# accumulates in float32 and rounds its result once to the low precision. PyTorch's CPU
# matmuls do the same, but at very different speeds by CPU: its float16 kernel runs at about
# 1 GFLOP/s everywhere, its bfloat16 kernel is fast with AVX512-BF16 or AMX and about
# 2 GFLOP/s without (on an AVX2-only EPYC a 2048-token reference took 21 s of a 44 s test).
# The port therefore runs the native low-precision einsum up to NATIVE_LOW_PRECISION_MACS
# multiply-adds and above that computes it as a float32 einsum of the low-precision operands
# rounded once to the low precision: the same rounding points, forward and backward
# (autograd rounds each gradient once through the casts), with float32 sums in another
# order, on every CPU alike. The native kernel is kept where affordable because its
# summation order differs from the float32 reference's, as CUDA's does: in degenerate cases
# (a single key: P = 1 exactly) the emulation would reproduce the float32 reference bit for
# bit and make the yardstick error 0. Elementwise ops (scaling, softcap, softmax) are always
# native low-precision PyTorch ops.

NATIVE_LOW_PRECISION_MACS = 2e6


def einsum(equation: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    dtype = torch.promote_types(a.dtype, b.dtype)
    if dtype in (torch.float16, torch.bfloat16):
        inputs, _ = equation.split("->")
        sizes = {}
        for letters, x in zip(inputs.split(","), (a, b)):
            sizes.update(zip(letters, x.shape))
        if math.prod(sizes.values()) > NATIVE_LOW_PRECISION_MACS:
            return torch.einsum(equation, a.float(), b.float()).to(dtype)
    return torch.einsum(equation, a, b)


def repeat_heads(x: torch.Tensor, groups: int, dim: int = 2) -> torch.Tensor:
    """Each key/value head `groups` times in a row (query heads [g*i, g*(i+1)) read head i)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=dim)


# --------------------------------------------------------------------------------------------
# Masks, padding and ALiBi


def attn_bias_from_alibi_slopes(
    slopes,
    seqlen_q,
    seqlen_k,
    query_padding_mask=None,
    key_padding_mask=None,
    causal=False,
    key_leftpad=None,
):
    """The additive ALiBi bias -slope * |i + sk - sq - j| [b, h, sq, sk] (sk, sq: each
    sequence's lengths with padding masks). With causal, the row-constant-shifted
    slope * (j - seqlen_k + 1), as in the original (softmax does not see the shift)."""
    b, h = slopes.shape
    slopes = slopes.reshape(b, h, 1, 1)
    if causal:
        return torch.arange(-seqlen_k + 1, 1, dtype=torch.float32) * slopes
    row = torch.arange(seqlen_q, dtype=torch.long).reshape(seqlen_q, 1)
    col = torch.arange(seqlen_k, dtype=torch.long)
    if key_leftpad is not None:
        pad = key_leftpad.reshape(-1, 1, 1, 1)
        col = col.expand(key_leftpad.shape[0], 1, 1, seqlen_k)
        col = torch.where(col >= pad, col - pad, 2**32)
    sk = seqlen_k if key_padding_mask is None else key_padding_mask.sum(-1).reshape(-1, 1, 1, 1)
    sq = (
        seqlen_q if query_padding_mask is None else query_padding_mask.sum(-1).reshape(-1, 1, 1, 1)
    )
    distance = (row + sk - sq - col).abs()
    return -slopes * distance.to(dtype=slopes.dtype)


def generate_random_padding_mask(max_seqlen, batch_size, mode="random"):
    """[batch, max_seqlen] bool, True on the first `length` tokens of each row: length
    max_seqlen ("full"), uniform in [max(1, max_seqlen - 20), max_seqlen] ("random") or in
    [max_seqlen // 3, max_seqlen] ("third")."""
    assert mode in ("full", "random", "third")
    if mode == "full":
        lengths = torch.full((batch_size, 1), max_seqlen, dtype=torch.int32)
    elif mode == "random":
        lengths = torch.randint(max(1, max_seqlen - 20), max_seqlen + 1, (batch_size, 1))
    else:
        lengths = torch.randint(max_seqlen // 3, max_seqlen + 1, (batch_size, 1))
    return torch.arange(max_seqlen).expand(batch_size, max_seqlen) < lengths


def unpad_input(x, mask):
    """x [b, s, ...] -> (the tokens where mask [b, s] is True, packed [total, ...]; their flat
    indices; cu_seqlens int32 [b + 1]; the longest length)."""
    lengths = mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten()).flatten()
    cu_seqlens = F.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
    packed = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])[indices]
    return packed, indices, cu_seqlens, int(lengths.max())


def pad_input(x, indices, batch, seqlen):
    """The inverse of unpad_input: packed tokens [total, ...] back to [batch, seqlen, ...],
    zeros on the padding (differentiable)."""
    out = x.new_zeros((batch * seqlen, *x.shape[1:]))
    out = out.index_put((indices,), x)
    return out.reshape(batch, seqlen, *x.shape[1:])


def _merge_batch(x):
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _split_batch(batch):
    return lambda x: x.reshape(batch, -1, *x.shape[1:])


def generate_qkv(
    q, k, v, query_padding_mask=None, key_padding_mask=None, kvpacked=False, qkvpacked=False
):
    """The original's generate_qkv: the packed (unpadded) inputs of the varlen functions,
    fresh leaves of the padded inputs for the references, and the functions that pad the
    varlen outputs and gradients back. Returns the same tuples as the original."""
    assert not (kvpacked and qkvpacked)
    batch, seqlen_q, nheads, d = q.shape
    _, seqlen_k, nheads_k, _ = k.shape
    assert k.shape == (batch, seqlen_k, nheads_k, d)
    assert v.shape == (batch, seqlen_k, nheads_k, d)

    if query_padding_mask is not None:
        q_unpad, indices_q, cu_seqlens_q, max_seqlen_q = unpad_input(q, query_padding_mask)

        def output_pad_fn(x):
            return pad_input(x, indices_q, batch, seqlen_q)

    else:
        q_unpad = _merge_batch(q)
        cu_seqlens_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32)
        max_seqlen_q = seqlen_q
        output_pad_fn = _split_batch(batch)

    if key_padding_mask is not None:
        k_unpad, indices_k, cu_seqlens_k, max_seqlen_k = unpad_input(k, key_padding_mask)
        v_unpad = unpad_input(v, key_padding_mask)[0]
    else:
        k_unpad, v_unpad = _merge_batch(k), _merge_batch(v)
        cu_seqlens_k = torch.arange(0, (batch + 1) * seqlen_k, seqlen_k, dtype=torch.int32)
        max_seqlen_k = seqlen_k

    if qkvpacked:
        assert (query_padding_mask == key_padding_mask).all()
        assert nheads == nheads_k
        qkv_unpad = torch.stack([q_unpad, k_unpad, v_unpad], dim=1)
        qkv = torch.stack([q, k, v], dim=2)
        if query_padding_mask is not None:

            def dqkv_pad_fn(x):
                return pad_input(x, indices_q, batch, seqlen_q)

        else:
            dqkv_pad_fn = _split_batch(batch)
        return (
            qkv_unpad.detach().requires_grad_(),
            cu_seqlens_q,
            max_seqlen_q,
            qkv.detach().requires_grad_(),
            output_pad_fn,
            dqkv_pad_fn,
        )

    if key_padding_mask is not None:

        def dk_pad_fn(x):
            return pad_input(x, indices_k, batch, seqlen_k)

    else:
        dk_pad_fn = _split_batch(batch)
    if kvpacked:
        kv_unpad = torch.stack([k_unpad, v_unpad], dim=1)
        kv = torch.stack([k, v], dim=2)
        return (
            q_unpad.detach().requires_grad_(),
            kv_unpad.detach().requires_grad_(),
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            q.detach().requires_grad_(),
            kv.detach().requires_grad_(),
            output_pad_fn,
            output_pad_fn,
            dk_pad_fn,
        )
    return (
        q_unpad.detach().requires_grad_(),
        k_unpad.detach().requires_grad_(),
        v_unpad.detach().requires_grad_(),
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        q.detach().requires_grad_(),
        k.detach().requires_grad_(),
        v.detach().requires_grad_(),
        output_pad_fn,
        output_pad_fn,
        dk_pad_fn,
    )


def construct_local_mask(
    seqlen_q,
    seqlen_k,
    window_size=(-1, -1),
    query_padding_mask=None,
    key_padding_mask=None,
    key_leftpad=None,
):
    """True where key j is outside query i's window [i + sk - sq - left, i + sk - sq + right]
    (bottom-right aligned; sk, sq per sequence with padding masks; with key_leftpad the key
    positions start at each sequence's left padding). [sq, sk] or [b, 1, sq, sk]."""
    row = torch.arange(seqlen_q, dtype=torch.long).reshape(seqlen_q, 1)
    col = torch.arange(seqlen_k, dtype=torch.long)
    if key_leftpad is not None:
        pad = key_leftpad.reshape(-1, 1, 1, 1)
        col = col.expand(key_leftpad.shape[0], 1, 1, seqlen_k)
        col = torch.where(col >= pad, col - pad, 2**32)
    sk = seqlen_k if key_padding_mask is None else key_padding_mask.sum(-1).reshape(-1, 1, 1, 1)
    sq = (
        seqlen_q if query_padding_mask is None else query_padding_mask.sum(-1).reshape(-1, 1, 1, 1)
    )
    if window_size[0] < 0:
        return col > row + sk - sq + window_size[1]
    sk = torch.full_like(col, seqlen_k) if key_padding_mask is None else sk
    return torch.logical_or(
        col > torch.minimum(row + sk - sq + window_size[1], sk),
        col < row + sk - sq - window_size[0],
    )


# --------------------------------------------------------------------------------------------
# Reference attention


def attention_ref(
    q,
    k,
    v,
    query_padding_mask=None,
    key_padding_mask=None,
    attn_bias=None,
    dropout_p=0.0,
    dropout_mask=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    upcast=True,
    reorder_ops=False,
    key_leftpad=None,
):
    """The original's attention_ref. q [b, sq, h, d], k/v [b, sk, h_k, d]. upcast: compute
    in float32 and round the output to q's dtype (the reference); otherwise in q's dtype
    (the "PyTorch implementation" whose error is the yardstick), with reorder_ops scaling k
    instead of q. dropout_mask [b, h, sq, sk] (True = keep) applies dropout with 1 / (1 - p).
    Returns (out [b, sq, h, d], attention probabilities before dropout [b, h, sq, sk]), both
    in q's dtype."""
    if causal:
        window_size = (window_size[0], 0)
    dtype_og = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    k = repeat_heads(k, q.shape[2] // k.shape[2])
    v = repeat_heads(v, q.shape[2] // v.shape[2])
    d = q.shape[-1]
    if not reorder_ops:
        scores = einsum("bthd,bshd->bhts", q / math.sqrt(d), k)
    else:
        scores = einsum("bthd,bshd->bhts", q, k / math.sqrt(d))
    if softcap > 0:
        scores = scores / softcap
        scores = scores.tanh()
        scores = scores * softcap
    if key_padding_mask is not None:
        scores.masked_fill_(~key_padding_mask[:, None, None, :], float("-inf"))
    local = window_size[0] >= 0 or window_size[1] >= 0
    if local:
        local_mask = construct_local_mask(
            seqlen_q,
            seqlen_k,
            window_size,
            query_padding_mask,
            key_padding_mask,
            key_leftpad=key_leftpad,
        )
        scores.masked_fill_(local_mask, float("-inf"))
    if attn_bias is not None:
        scores = scores + attn_bias
    attention = torch.softmax(scores, dim=-1).to(v.dtype)
    # Rows without any key: zeros instead of NaN.
    if local:
        attention = attention.masked_fill(torch.all(local_mask, dim=-1, keepdim=True), 0.0)
    # Padded queries: zeros, so that dV has no NaN.
    if query_padding_mask is not None:
        attention = attention.masked_fill(~query_padding_mask[:, None, :, None], 0.0)
    scaling = 1.0 / (1 - dropout_p)
    dropped = attention if dropout_mask is None else attention.masked_fill(~dropout_mask, 0.0)
    output = einsum("bhts,bshd->bthd", dropped, v * scaling)
    if query_padding_mask is not None:
        output.masked_fill_(~query_padding_mask[:, :, None, None], 0.0)
    return output.to(dtype=dtype_og), attention.to(dtype=dtype_og)


def attention_kvpacked_ref(q, kv, *args, **kwargs):
    """attention_ref on kv [b, sk, 2, h_k, d]."""
    return attention_ref(q, kv[:, :, 0], kv[:, :, 1], *args, **kwargs)


def attention_qkvpacked_ref(qkv, key_padding_mask=None, *args, **kwargs):
    """attention_ref on qkv [b, s, 3, h, d] with one padding mask for queries and keys."""
    return attention_ref(
        qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], key_padding_mask, key_padding_mask, *args,
        **kwargs,
    )


# --------------------------------------------------------------------------------------------
# S_dmask


def convert_flash_attn_S_to_softmax(
    S,
    seqlen_q,
    seqlen_k,
    query_padding_mask,
    key_padding_mask,
    head_dim,
    is_dropout,
    causal=False,
    window_size=(-1, -1),
):
    """S_dmask [b, h, rows, cols] (FlashAttention pads to multiples of 128; qkv returns
    [b, h, max_seqlen_q, max_seqlen_k]) -> [b, h, seqlen_q, seqlen_k] with zeros outside the
    window and on padded queries and keys, cropped or zero-padded as needed."""
    if causal:
        window_size = (window_size[0], 0)
    rows, cols = S.shape[-2:]
    converted = S
    if window_size[0] >= 0 or window_size[1] >= 0:
        local_mask = construct_local_mask(
            seqlen_q, seqlen_k, window_size, query_padding_mask, key_padding_mask
        )
        local_mask = F.pad(local_mask, (0, cols - seqlen_k, 0, rows - seqlen_q), value=True)
        converted = converted.masked_fill(local_mask, 0.0)
    # Zero what lies outside the padding masks, in case it was never written.
    seqlen_q_og = query_padding_mask.shape[-1] if query_padding_mask is not None else rows
    if query_padding_mask is not None:
        query_padding_mask = F.pad(query_padding_mask, (0, rows - seqlen_q_og))
        converted = converted.masked_fill(~query_padding_mask[:, None, :, None], 0.0)
    seqlen_k_og = key_padding_mask.shape[-1] if key_padding_mask is not None else seqlen_k
    if key_padding_mask is not None:
        key_padding_mask = F.pad(key_padding_mask, (0, cols - seqlen_k_og))
        converted = converted.masked_fill(~key_padding_mask[:, None, None, :], 0.0)
    converted = F.pad(converted, (0, 0, 0, seqlen_q_og - rows))
    converted = F.pad(converted, (0, seqlen_k_og - cols))
    return converted[:, :, :seqlen_q, :seqlen_k]


def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    """The key-block width of FlashAttention's forward kernel, as the original's helper
    gives it for an sm80 device (A100; sm86/sm89 differ at head_dim 128 only): the port
    runs on the CPU and takes that branch."""
    assert head_dim <= 256
    if head_dim <= 32:
        return 128
    if head_dim <= 64:
        return 128 if not is_dropout else 64
    if head_dim <= 96:
        return 64
    if head_dim <= 128:
        return 64 if not is_dropout else 32
    return 64


def normalize_flash_attn_S(
    attn_unnorm,
    q,
    k,
    v,
    query_padding_mask=None,
    key_padding_mask=None,
    attn_bias=None,
    is_dropout=False,
    causal=False,
    window_size=(-1, -1),
):
    """|S_dmask| (exp(s_ij - running max)) -> the probabilities exp(s_ij - lse_i).

    FlashAttention's kernel rescales its running row maximum once per key block of
    _get_block_size_n(device, head_dim, is_dropout, causal) keys, visiting the blocks last
    to first, so the original multiplies block c's entries by exp(m_c - lse) with m_c the
    maximum over key blocks c, c + 1, ... (a reversed cumulative maximum); qkv.flash_attn
    writes S_dmask in that convention at sm80's block widths."""
    if causal:
        window_size = (window_size[0], 0)
    q, k, v = q.float(), k.float(), v.float()
    _, seqlen_q, _, head_dim = q.shape
    seqlen_k = k.shape[1]
    scores = torch.einsum("bthd,bshd->bhts", q / math.sqrt(head_dim), k)
    if key_padding_mask is not None:
        scores.masked_fill_(~key_padding_mask[:, None, None, :], float("-inf"))
    if window_size[0] >= 0 or window_size[1] >= 0:
        local_mask = construct_local_mask(
            seqlen_q, seqlen_k, window_size, query_padding_mask, key_padding_mask
        )
        scores.masked_fill_(local_mask, float("-inf"))
    if attn_bias is not None:
        scores = scores + attn_bias.to(dtype=scores.dtype)
    block_size_n = _get_block_size_n(scores.device, head_dim, is_dropout, causal)
    blocks = scores.split(block_size_n, dim=-1)
    lse = torch.logsumexp(torch.stack([torch.logsumexp(s, dim=-1) for s in blocks], -1), -1)
    # Rows without keys: lse = +inf, so that exp(m - lse) is 0 rather than NaN.
    lse[lse == float("-inf")] = float("inf")
    block_max = torch.stack([torch.amax(s, dim=-1) for s in blocks], dim=-1)
    running_max = torch.cummax(block_max.flip(-1), dim=-1).values.flip(-1).unbind(dim=-1)
    attn_norm = torch.cat(
        [
            a * torch.exp(m - lse)[..., None]
            for a, m in zip(attn_unnorm.split(block_size_n, dim=-1), running_max)
        ],
        dim=-1,
    )
    if query_padding_mask is not None:
        attn_norm.masked_fill_(~query_padding_mask[:, None, :, None], 0.0)
    return attn_norm.to(dtype=attn_unnorm.dtype)


def get_dropout_fraction(
    dropout_mask,
    query_padding_mask=None,
    key_padding_mask=None,
    causal=False,
    window_size=(-1, -1),
):
    """The fraction of dropped entries (dropout_mask False) among the valid ones (inside the
    padding masks and the window), and the number of valid entries."""
    if causal:
        window_size = (window_size[0], 0)
    _, _, seqlen_q, seqlen_k = dropout_mask.shape
    dropped = ~dropout_mask
    valid = torch.ones_like(dropout_mask)
    if query_padding_mask is not None:
        dropped.masked_fill_(~query_padding_mask[:, None, :, None], False)
        valid.masked_fill_(~query_padding_mask[:, None, :, None], False)
    if key_padding_mask is not None:
        dropped.masked_fill_(~key_padding_mask[:, None, None, :], False)
        valid.masked_fill_(~key_padding_mask[:, None, None, :], False)
    if window_size[0] >= 0 or window_size[1] >= 0:
        local_mask = construct_local_mask(
            seqlen_q, seqlen_k, window_size, query_padding_mask, key_padding_mask
        )
        dropped.masked_fill_(local_mask, False)
        valid.masked_fill_(local_mask, False)
    count = int(valid.sum())
    return int(dropped.sum()) / count, count


# --------------------------------------------------------------------------------------------
# Paged KV cache and rotary embedding


def generate_block_kvcache(seqlen_k, paged_kv_block_size, batch_size, nheads_k, d, dtype):
    """A paged cache of 3 * ceil(seqlen_k / page) pages per sequence, its block table (a random
    permutation of the pages) and the contiguous view [b, seqlen_k, h_k, d] of each
    sequence's first seqlen_k tokens."""
    num_blocks = math.ceil(seqlen_k / paged_kv_block_size) * batch_size * 3
    shape = (num_blocks, paged_kv_block_size, nheads_k, d)
    k_cache_paged = torch.randn(*shape, dtype=dtype)
    v_cache_paged = torch.randn(*shape, dtype=dtype)
    block_table = torch.randperm(num_blocks, dtype=torch.int32).reshape(batch_size, -1)
    k_cache = gather_pages(k_cache_paged, block_table)[:, :seqlen_k]
    v_cache = gather_pages(v_cache_paged, block_table)[:, :seqlen_k]
    return k_cache, v_cache, block_table, k_cache_paged, v_cache_paged, num_blocks


def gather_pages(cache_paged, block_table):
    """[num_blocks, page, ...] -> [b, pages_per_seq * page, ...] along each row's pages."""
    b = block_table.shape[0]
    pages = cache_paged[block_table.to(torch.long).flatten()]
    return pages.reshape(b, -1, *cache_paged.shape[2:])


def apply_rotary_emb(x, cos, sin, interleaved=False, seqlen_offsets=0):
    """Rotary embedding as FlashAttention's kernel computes it: x [b, s, h, d]; row s of
    sequence b at position s + seqlen_offsets[b] (int or [b] tensor); cos/sin
    [seqlen_ro, rotary_dim / 2]; pairs (2i, 2i + 1) if interleaved else (i, i + rotary_dim / 2)
    rotated in float32, positions past seqlen_ro unrotated (cos 1, sin 0), the result rounded
    once to x's dtype; dimensions past rotary_dim unchanged."""
    b, s = x.shape[:2]
    seqlen_ro, half = cos.shape
    assert sin.shape == cos.shape and 2 * half <= x.shape[-1]
    offsets = torch.as_tensor(seqlen_offsets, dtype=torch.long).reshape(-1, 1)
    positions = (torch.arange(s)[None, :] + offsets).expand(b, s)
    inside = positions < seqlen_ro
    at = positions.clamp(max=seqlen_ro - 1)
    c = torch.where(inside[..., None], cos.float()[at], 1.0)[:, :, None, :]
    sn = torch.where(inside[..., None], sin.float()[at], 0.0)[:, :, None, :]
    xr = x[..., : 2 * half].float()
    if interleaved:
        x0, x1 = xr[..., 0::2], xr[..., 1::2]
    else:
        x0, x1 = xr[..., :half], xr[..., half:]
    o0, o1 = x0 * c - x1 * sn, x0 * sn + x1 * c
    rotated = torch.stack((o0, o1), -1).flatten(-2) if interleaved else torch.cat((o0, o1), -1)
    return torch.cat((rotated.to(x.dtype), x[..., 2 * half :]), dim=-1)

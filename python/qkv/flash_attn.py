"""FlashAttention 2.8's Python API (`flash_attn.flash_attn_interface`) on qkv's
CPU kernels.

    import qkv.flash_attn as flash_attn
    out = flash_attn.flash_attn_func(q, k, v, causal=True)   # CPU torch tensors

The functions keep FlashAttention 2.8's names, parameters, order, defaults,
layouts and return values: `flash_attn_func`, `flash_attn_qkvpacked_func`,
`flash_attn_kvpacked_func`, `flash_attn_varlen_func`,
`flash_attn_varlen_qkvpacked_func`, `flash_attn_varlen_kvpacked_func` and
`flash_attn_with_kvcache`. Causal masks, sliding windows and ALiBi are aligned
to the bottom-right corner of the attention matrix, per sequence, as in
FlashAttention; rows without any key give out = 0 and softmax_lse = +inf, as
FlashAttention's kernels write them. Everything but `flash_attn_with_kvcache`
is differentiable (autograd to q, k, v and the packed tensors) through
qkv's fused backward; packed tensors are split into views, never copied.

Differences from FlashAttention 2.8:

* Tensors are CPU tensors; float32 and float64 are accepted besides float16
  and bfloat16. softmax_lse is float32, or float64 for float64 inputs. v may
  have a head dimension different from q and k's, and any head dimension is
  accepted.
* `return_attn_probs=True`: S_dmask is [batch, nheads, seqlen_q, seqlen_k]
  (varlen: [batch, nheads, max_seqlen_q, max_seqlen_k], zero past each
  sequence's lengths) in the dtype of q, computed by a second forward pass.
  As in FlashAttention it holds the softmax's numerators, negated where
  dropout dropped the weight (the sign carries the dropout pattern, so
  `S_dmask >= 0` is the kept mask), scaled as FlashAttention's kernel on sm80
  (A100) writes them: the keys in blocks of its key-block width for the head
  dimension and dropout flag (128, 64 or 32; `_get_block_size_n` of its
  tests), block c's entries exp(s_ij - m_c) with m_c row i's largest score
  over blocks c, c + 1, ..., so its tests' `normalize_flash_attn_S` recovers
  the probabilities before dropout. It is returned for every dropout_p
  (FlashAttention 2.8 returns an empty tensor when dropout_p == 0) and is not
  padded to multiples of 128.
* Invalid arguments raise qkv.ArgumentError, a RuntimeError as FlashAttention's
  checks raise and a ValueError as qkv's.
* softmax_lse is returned detached from autograd (FlashAttention returns it
  attached but its backward ignores the gradient it receives).
* Dropout uses qkv's counter-based generator, seeded from torch's default
  CPU generator (`torch.manual_seed` makes it reproducible); the kept entries
  differ from FlashAttention's for the same seed.
* `deterministic` is accepted and ignored: qkv's backward is always
  deterministic. `num_splits` is accepted and ignored.
* `max_seqlen_q` / `max_seqlen_k` only size S_dmask; the sequence lengths are
  read from cu_seqlens_q / cu_seqlens_k.
* `flash_attn_varlen_func(..., block_table=...)` gathers each sequence's pages
  into a packed copy of k and v before attending (gradients flow back to the
  paged k and v through the gather).
* `flash_attn_with_kvcache` attends to a view of a contiguous cache; with
  `cache_batch_idx` it gathers the selected cache rows (a copy), and with a
  paged cache (`block_table`) it gathers each sequence's pages (a copy). The
  new keys and values are still written into k_cache / v_cache in place.
  `page_block_size` may be any positive size (FlashAttention's kernels need
  a multiple of 16, its docstring asks for 256), `rotary_dim` any even size
  up to headdim (FlashAttention requires a multiple of 16), and
  `cache_leftpad` may be combined with a paged cache (FlashAttention refuses
  that combination). Rotary embedding is computed in float32 (float64 for
  float64 inputs) and rounded once to the dtype of q.
* Rotary cos/sin tables may have any floating dtype (FlashAttention requires
  that of q).
* The private entry points that tests and libraries import from
  `flash_attn.flash_attn_interface` are here too, with its argument order and
  return tuples: `_flash_attn_forward` and `_flash_attn_varlen_forward` return
  (out, softmax_lse, S_dmask, rng_state), rng_state an int64 (seed, 0) of
  qkv's dropout generator; `_flash_attn_backward` and
  `_flash_attn_varlen_backward` write dq, dk and dv in place and return
  softmax_d. They are not differentiable. The varlen forward reads
  `seqused_k` and `leftpad_k` (gathering the keys used, a copy) and, as
  FlashAttention, refuses `num_splits > 1` with `block_table`.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import _api, _ops
from ._errors import ArgumentError

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]


# --------------------------------------------------------------------------------------------
# Argument checks


def _raises_like_flash_attn(fn):
    """Makes the errors of qkv's native calls inside `fn` (ValueError) those
    FlashAttention raises for the same input (RuntimeError, from its C++
    checks): qkv.ArgumentError is both."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ValueError as e:
            if isinstance(e, ArgumentError):
                raise
            raise ArgumentError(str(e)).with_traceback(e.__traceback__) from None

    return wrapper


def _tensor(x, name: str, rank: int, layout: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor {layout}, got {type(x).__name__}")
    if x.dim() != rank:
        raise ArgumentError(
            f"{name}: expected {rank} dimensions {layout}, got shape {list(x.shape)}"
        )
    return x


def _packed(x, name: str, rank: int, axis: int, count: int, layout: str) -> Tensor:
    _tensor(x, name, rank, layout)
    if x.shape[axis] != count:
        raise ArgumentError(
            f"{name}: expected size {count} in dimension {axis} {layout}, "
            f"got shape {list(x.shape)}"
        )
    return x


def _window(window_size) -> Tuple[int, int]:
    try:
        left, right = window_size
        return int(left), int(right)
    except (TypeError, ValueError):
        raise TypeError(
            f"window_size: expected a pair (left, right) of ints, got {window_size!r}"
        ) from None


def _int_vector(x, name: str, size: Optional[int] = None) -> Tensor:
    """Integer metadata as a 1-D int64 CPU tensor (a conversion, not the data)."""
    if not isinstance(x, Tensor):
        x = torch.as_tensor(x)
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer tensor, got {x.dtype}")
    if x.dim() != 1:
        raise ArgumentError(f"{name}: expected 1 dimension, got shape {list(x.shape)}")
    if size is not None and x.shape[0] != size:
        raise ArgumentError(f"{name}: expected shape [{size}], got shape {list(x.shape)}")
    return x.to("cpu", torch.int64)


def _cu_seqlens(x, name: str) -> Tensor:
    if not isinstance(x, Tensor):
        x = torch.as_tensor(x, dtype=torch.int32)
    if x.dim() != 1 or x.shape[0] < 1:
        raise ArgumentError(
            f"{name}: expected shape [batch_size + 1] (cumulative lengths), "
            f"got shape {list(x.shape)}"
        )
    return x


def _block_table(x, batch: int) -> Tensor:
    _tensor(x, "block_table", 2, "(batch_size, max_num_blocks_per_seq)")
    if x.is_floating_point() or x.dtype == torch.bool:
        raise TypeError(f"block_table: expected an integer tensor, got {x.dtype}")
    if x.shape[0] != batch:
        raise ArgumentError(
            f"block_table: expected {batch} rows (one per sequence), got shape {list(x.shape)}"
        )
    return x.to("cpu", torch.int64)


# --------------------------------------------------------------------------------------------
# Shared pieces


def _fa_lse(lse: Tensor) -> Tensor:
    """softmax_lse as FlashAttention returns it: detached, +inf for rows without keys
    (qkv writes -inf there)."""
    lse = lse.detach()
    return torch.where(lse == -math.inf, math.inf, lse)


def _options(softmax_scale, causal, window: Tuple[int, int], softcap, alibi_slopes,
             dropout_p=0.0, dropout_seed=0, learnable_sink=None) -> dict:
    """qkv's options (the keywords of its option rows) for FlashAttention's
    arguments of the same meaning: the one place that maps the two."""
    return dict(scale=softmax_scale, causal=causal, window=window, softcap=softcap,
                alibi_slopes=alibi_slopes, dropout_p=dropout_p, dropout_seed=dropout_seed,
                sinks=learnable_sink)


def _probs(q, k, v, options: dict, cu_seqlens_q=None, cu_seqlens_k=None) -> Tensor:
    """The attention probabilities [B, Hq, Nq, Nk] of a call with `options`
    (_options) before dropout and without the sinks, which cancel in S_dmask's
    ratios to running maxima; float32 (float64 for float64 inputs)."""
    scores_only = {**options, "dropout_p": 0.0, "sinks": None}
    with torch.no_grad():
        r = _api.attention(q.detach(), k.detach(), v.detach(), cu_seqlens_q=cu_seqlens_q,
                           cu_seqlens_k=cu_seqlens_k, return_probs=True, **scores_only)
    return r.probs


def _block_size_n(head_dim: int, is_dropout: bool) -> int:
    """The key-block width of FlashAttention's forward kernel on sm80 (A100) for a
    head dimension (its tests' _get_block_size_n; 64 past its limit of 256)."""
    if head_dim <= 32:
        return 128
    if head_dim <= 64:
        return 64 if is_dropout else 128
    if head_dim <= 96:
        return 64
    if head_dim <= 128:
        return 32 if is_dropout else 64
    return 64


def _s_dmask(probs: Tensor, dropout_p: float, seed: int, dtype: torch.dtype,
             head_dim: int) -> Tensor:
    """FlashAttention's S_dmask from the probabilities [B, Hq, Nq, Nk] (varlen:
    [batch, Hq, max_seqlen_q, max_seqlen_k], sequence b's at the top left), in its
    kernel's block convention: the keys in blocks of _block_size_n, block c holding
    exp(s_ij - m_c) with m_c row i's largest score over blocks c, c + 1, ... (the
    kernel visits the blocks last to first and writes each with its running
    maximum), i.e. P_ij / max(P_i over those blocks); negated where dropout dropped
    the weight; 0 where row i has no key from block c on."""
    n = probs.shape[-1]
    width = _block_size_n(head_dim, dropout_p > 0)
    blocks = -(-n // width)
    padded = torch.nn.functional.pad(probs, (0, blocks * width - n))
    padded = padded.unflatten(-1, (blocks, width))
    peak = padded.amax(-1) if blocks else padded.new_zeros(padded.shape[:-1])
    running = torch.cummax(peak.flip(-1), -1).values.flip(-1)[..., None]
    s = torch.where(running > 0, padded / torch.where(running > 0, running, 1), 0)
    s = s.flatten(-2)[..., :n]
    if dropout_p > 0:
        keep = torch.empty(probs.shape, dtype=torch.bool)
        _api._qkv.dropout_keep_into(keep, seed, 0, dropout_p)
        s = torch.where(keep, s, -s)
    return s.to(dtype)


def _seed(dropout_p: float) -> int:
    """The dropout seed of a call (drawn from torch's generator), shared by the
    forward and S_dmask."""
    return _ops.dropout_seed_from_torch() if dropout_p > 0 else 0


def _attend(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
            return_attn_probs, learnable_sink=None):
    """flash_attn_func's body: q [B, Nq, Hq, D], k/v [B, Nk, Hkv, D]."""
    out, lse, s_dmask = _forward(q, k, v, dropout_p, softmax_scale, causal, window_size,
                                 softcap, alibi_slopes, return_attn_probs, learnable_sink,
                                 _seed(dropout_p))
    return (out, lse, s_dmask) if return_attn_probs else out


def _forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
             with_s_dmask, learnable_sink, seed):
    """(out, softmax_lse, S_dmask or None) of q [B, Nq, Hq, D], k/v [B, Nk, Hkv, D]
    with dropout seed `seed`."""
    options = _options(softmax_scale, causal, _window(window_size), softcap, alibi_slopes,
                       dropout_p, seed, learnable_sink)
    out, lse = _ops.attention(q, k, v, **options)
    if not with_s_dmask:
        return out, _fa_lse(lse), None
    probs = _probs(q, k, v, options)
    return out, _fa_lse(lse), _s_dmask(probs, dropout_p, seed, q.dtype, q.shape[-1])


def _varlen_probs(q, k, v, cu_q: Tensor, cu_k: Tensor, max_seqlen_q, max_seqlen_k,
                  options: dict) -> Tensor:
    """The probabilities of a packed batch as [batch, Hq, max_seqlen_q,
    max_seqlen_k], each sequence's in the top-left corner, zeros elsewhere."""
    packed = _probs(q, k, v, options, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)[0]
    cq, ck = cu_q.tolist(), cu_k.tolist()
    lq = [b - a for a, b in zip(cq, cq[1:])]
    lk = [b - a for a, b in zip(ck, ck[1:])]
    for name, lengths, bound in (("max_seqlen_q", lq, max_seqlen_q),
                                 ("max_seqlen_k", lk, max_seqlen_k)):
        if lengths and max(lengths) > int(bound):
            raise ArgumentError(
                f"{name}: a sequence has {max(lengths)} tokens, more than {name} = {bound}"
            )
    probs = packed.new_zeros((len(lq), packed.shape[0], int(max_seqlen_q), int(max_seqlen_k)))
    for s in range(len(lq)):
        probs[s, :, :lq[s], :lk[s]] = packed[:, cq[s]:cq[s + 1], ck[s]:ck[s + 1]]
    return probs


def _gather_varlen_pages(cache: Tensor, name: str, block_table: Tensor,
                         cu_k: Tensor) -> Tensor:
    """Packs the pages of a paged cache [num_blocks, page_block_size, Hkv, D] into
    [total_k, Hkv, D]: sequence s owns tokens [0, cu_k[s+1] - cu_k[s]) of its pages
    block_table[s]."""
    num_blocks, page = cache.shape[0], cache.shape[1]
    cu = cu_k.to("cpu", torch.int64)
    lengths = cu[1:] - cu[:-1]
    total = int(cu[-1] - cu[0])
    seq = torch.repeat_interleave(torch.arange(lengths.shape[0]), lengths)
    t = torch.arange(total) - (cu[:-1] - cu[0])[seq]
    if total and int((t // page).max()) >= block_table.shape[1]:
        raise ArgumentError(
            f"block_table: {block_table.shape[1]} blocks per sequence of {page} tokens "
            f"cannot hold a sequence of {int(lengths.max())} tokens"
        )
    blocks = block_table[seq, t // page]
    if total and (int(blocks.min()) < 0 or int(blocks.max()) >= num_blocks):
        raise ArgumentError(
            f"block_table: block indices must lie in [0, {num_blocks}) for {name} with "
            f"{num_blocks} blocks, got [{int(blocks.min())}, {int(blocks.max())}]"
        )
    return cache[blocks, t % page]


def _attend_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                   return_attn_probs, block_table=None, learnable_sink=None):
    """flash_attn_varlen_func's body: q [total_q, Hq, D], k/v [total_k, Hkv, D]
    (or paged with block_table)."""
    out, lse, s_dmask = _forward_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
        softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
        block_table, learnable_sink, _seed(dropout_p))
    return (out, lse, s_dmask) if return_attn_probs else out


def _forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                    with_s_dmask, block_table, learnable_sink, seed):
    """(out, softmax_lse, S_dmask or None) of packed sequences, as _attend_varlen's,
    with dropout seed `seed`."""
    options = _options(softmax_scale, causal, _window(window_size), softcap, alibi_slopes,
                       dropout_p, seed, learnable_sink)
    cu_q = _cu_seqlens(cu_seqlens_q, "cu_seqlens_q")
    cu_k = _cu_seqlens(cu_seqlens_k, "cu_seqlens_k")
    if cu_q.shape[0] != cu_k.shape[0]:
        raise ArgumentError(
            f"cu_seqlens_q and cu_seqlens_k: expected the same number of sequences, got "
            f"shapes {list(cu_q.shape)} and {list(cu_k.shape)}"
        )
    if block_table is not None:
        table = _block_table(block_table, cu_k.shape[0] - 1)
        k = _gather_varlen_pages(k, "k", table, cu_k)
        v = _gather_varlen_pages(v, "v", table, cu_k)
        cu_k = cu_k - cu_k[0]  # the gathered keys start at row 0
    q4, k4, v4 = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    out, lse = _ops.attention(q4, k4, v4, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **options)
    out = out[0]
    if not with_s_dmask:
        return out, _fa_lse(lse[0]), None
    probs = _varlen_probs(q4, k4, v4, cu_q, cu_k, max_seqlen_q, max_seqlen_k, options)
    return out, _fa_lse(lse[0]), _s_dmask(probs, dropout_p, seed, q.dtype, q.shape[-1])


# --------------------------------------------------------------------------------------------
# Fixed-length batches


@_raises_like_flash_attn
def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    learnable_sink=None,
):
    """softmax(q k^T * softmax_scale (+ softcap, ALiBi, masks)) v, differentiable.

    Supports multi-query and grouped-query attention: nheads must be a multiple of
    nheads_k, and query heads [g * i, g * (i + 1)) read key/value head i
    (g = nheads / nheads_k).

    causal=True aligns the causal mask to the bottom-right corner: with seqlen_q = 2
    and seqlen_k = 5 query 0 sees keys 0..3 and query 1 keys 0..4; with seqlen_q = 5
    and seqlen_k = 2 queries 0..2 see no key (output 0). window_size=(left, right)
    restricts query i to keys [i + seqlen_k - seqlen_q - left,
    i + seqlen_k - seqlen_q + right] (-1: unbounded side).

    Arguments:
        q: (batch_size, seqlen_q, nheads, headdim)
        k: (batch_size, seqlen_k, nheads_k, headdim)
        v: (batch_size, seqlen_k, nheads_k, headdim_v)
        dropout_p: float, the dropout probability (set 0.0 for evaluation).
        softmax_scale: float, the scaling of q k^T; default 1 / sqrt(headdim).
        causal: bool, causal mask aligned bottom-right.
        window_size: (left, right), sliding window local attention; (-1, -1) is off.
        softcap: float; > 0 replaces each score s by softcap * tanh(s / softcap).
        alibi_slopes: (nheads,) or (batch_size, nheads), float32; adds
            -alibi_slope * |i + seqlen_k - seqlen_q - j| to the score of query i, key j.
        deterministic: bool, accepted and ignored (the backward is always deterministic).
        return_attn_probs: bool, also return softmax_lse and S_dmask.
        learnable_sink: (nheads,), a learned logit per head that joins each row's
            softmax denominator and adds nothing to the output (gpt-oss); differentiable.

    Return:
        out: (batch_size, seqlen_q, nheads, headdim_v).
        softmax_lse [if return_attn_probs]: (batch_size, nheads, seqlen_q), float32
            (float64 for float64 inputs), the logsumexp of each row of the scaled scores;
            +inf for rows without keys.
        S_dmask [if return_attn_probs]: (batch_size, nheads, seqlen_q, seqlen_k), in the
            dtype of q: exp(s_ij - m), m the row's running maximum in FlashAttention's
            key blocks (see the module's docstring), negated where dropout dropped the
            weight.
    """
    _tensor(q, "q", 4, "(batch_size, seqlen_q, nheads, headdim)")
    _tensor(k, "k", 4, "(batch_size, seqlen_k, nheads_k, headdim)")
    _tensor(v, "v", 4, "(batch_size, seqlen_k, nheads_k, headdim)")
    return _attend(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                   alibi_slopes, return_attn_probs, learnable_sink)


@_raises_like_flash_attn
def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # <=0.0 means deactivate
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash_attn_func on q, k, v stacked in one tensor (read through views, no copy;
    the gradient arrives as one tensor shaped like qkv).

    Arguments:
        qkv: (batch_size, seqlen, 3, nheads, headdim)
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        deterministic, return_attn_probs: as flash_attn_func; with seqlen_q == seqlen_k
        the window is [i - window_size[0], i + window_size[1]].

    Return:
        out: (batch_size, seqlen, nheads, headdim).
        softmax_lse [if return_attn_probs]: (batch_size, nheads, seqlen).
        S_dmask [if return_attn_probs]: (batch_size, nheads, seqlen, seqlen).
    """
    _packed(qkv, "qkv", 5, 2, 3, "(batch_size, seqlen, 3, nheads, headdim)")
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    return _attend(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                   alibi_slopes, return_attn_probs)


@_raises_like_flash_attn
def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash_attn_func with k and v stacked in one tensor (read through views, no
    copy; the gradient arrives as one tensor shaped like kv). Supports MQA/GQA.

    Arguments:
        q: (batch_size, seqlen_q, nheads, headdim)
        kv: (batch_size, seqlen_k, 2, nheads_k, headdim)
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        deterministic, return_attn_probs: as flash_attn_func.

    Return:
        out: (batch_size, seqlen_q, nheads, headdim).
        softmax_lse [if return_attn_probs]: (batch_size, nheads, seqlen_q).
        S_dmask [if return_attn_probs]: (batch_size, nheads, seqlen_q, seqlen_k).
    """
    _tensor(q, "q", 4, "(batch_size, seqlen_q, nheads, headdim)")
    _packed(kv, "kv", 5, 2, 2, "(batch_size, seqlen_k, 2, nheads_k, headdim)")
    k, v = kv[:, :, 0], kv[:, :, 1]
    return _attend(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                   alibi_slopes, return_attn_probs)


# --------------------------------------------------------------------------------------------
# Packed variable-length batches


@_raises_like_flash_attn
def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
    learnable_sink=None,
):
    """flash_attn_func on sequences of different lengths packed back to back.

    Sequence s owns query rows [cu_seqlens_q[s], cu_seqlens_q[s + 1]) and key rows
    [cu_seqlens_k[s], cu_seqlens_k[s + 1]); positions restart at 0 in each sequence,
    and causal masks, windows and ALiBi are aligned bottom-right per sequence.

    Arguments:
        q: (total_q, nheads, headdim), total_q = the number of query tokens in the batch.
        k: (total_k, nheads_k, headdim), or (num_blocks, page_block_size, nheads_k,
            headdim) with block_table.
        v: (total_k, nheads_k, headdim_v), or paged like k.
        cu_seqlens_q: (batch_size + 1,), int32, the cumulative query lengths.
        cu_seqlens_k: (batch_size + 1,), int32, the cumulative key lengths.
        max_seqlen_q: int, the longest query sequence (sizes S_dmask).
        max_seqlen_k: int, the longest key sequence (sizes S_dmask).
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        deterministic, return_attn_probs, learnable_sink: as flash_attn_func, per
            sequence.
        block_table [optional]: (batch_size, max_num_blocks_per_seq), int32: sequence s
            reads its keys and values from pages block_table[s] of k and v (gathered
            into a packed copy).

    Return:
        out: (total_q, nheads, headdim_v).
        softmax_lse [if return_attn_probs]: (nheads, total_q).
        S_dmask [if return_attn_probs]: (batch_size, nheads, max_seqlen_q, max_seqlen_k).
    """
    _tensor(q, "q", 3, "(total_q, nheads, headdim)")
    if block_table is None:
        _tensor(k, "k", 3, "(total_k, nheads_k, headdim)")
        _tensor(v, "v", 3, "(total_k, nheads_k, headdim)")
    else:
        _tensor(k, "k", 4, "(num_blocks, page_block_size, nheads_k, headdim) with block_table")
        _tensor(v, "v", 4, "(num_blocks, page_block_size, nheads_k, headdim) with block_table")
    return _attend_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          dropout_p, softmax_scale, causal, window_size, softcap,
                          alibi_slopes, return_attn_probs, block_table, learnable_sink)


@_raises_like_flash_attn
def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash_attn_varlen_func with q, k, v stacked in one tensor (views, no copy).

    Arguments:
        qkv: (total, 3, nheads, headdim), total = the number of tokens in the batch.
        cu_seqlens: (batch_size + 1,), int32, the cumulative sequence lengths.
        max_seqlen: int, the longest sequence.
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        deterministic, return_attn_probs: as flash_attn_func, per sequence.

    Return:
        out: (total, nheads, headdim).
        softmax_lse [if return_attn_probs]: (nheads, total).
        S_dmask [if return_attn_probs]: (batch_size, nheads, max_seqlen, max_seqlen).
    """
    _packed(qkv, "qkv", 4, 1, 3, "(total, 3, nheads, headdim)")
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    return _attend_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                          dropout_p, softmax_scale, causal, window_size, softcap,
                          alibi_slopes, return_attn_probs)


@_raises_like_flash_attn
def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash_attn_varlen_func with k and v stacked in one tensor (views, no copy).
    Supports MQA/GQA.

    Arguments:
        q: (total_q, nheads, headdim)
        kv: (total_k, 2, nheads_k, headdim)
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
        causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs:
        as flash_attn_varlen_func.

    Return:
        out: (total_q, nheads, headdim).
        softmax_lse [if return_attn_probs]: (nheads, total_q).
        S_dmask [if return_attn_probs]: (batch_size, nheads, max_seqlen_q, max_seqlen_k).
    """
    _tensor(q, "q", 3, "(total_q, nheads, headdim)")
    _packed(kv, "kv", 4, 1, 2, "(total_k, 2, nheads_k, headdim)")
    k, v = kv[:, 0], kv[:, 1]
    return _attend_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          dropout_p, softmax_scale, causal, window_size, softcap,
                          alibi_slopes, return_attn_probs)


# --------------------------------------------------------------------------------------------
# Decoding against a KV cache


def _rotary(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor,
            interleaved: bool) -> Tensor:
    """x [B, n, H, D] rotated at positions [B, n] by the tables [seqlen_ro, rotary_dim / 2]:
    pairs (2i, 2i + 1) when interleaved, else (i, i + rotary_dim / 2); dimensions past
    rotary_dim unchanged. A new tensor."""
    half = cos.shape[1]
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    c = cos.to(ct)[positions][:, :, None, :]  # [B, n, 1, half]
    s = sin.to(ct)[positions][:, :, None, :]
    xr = x[..., : 2 * half].to(ct)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
    r1, r2 = x1 * c - x2 * s, x2 * c + x1 * s
    rotated = torch.stack((r1, r2), dim=-1).flatten(-2) if interleaved else torch.cat(
        (r1, r2), dim=-1
    )
    return torch.cat((rotated.to(x.dtype), x[..., 2 * half:]), dim=-1)


def _rotary_tables(rotary_cos, rotary_sin, headdim: int, needed: int) -> None:
    _tensor(rotary_cos, "rotary_cos", 2, "(seqlen_ro, rotary_dim / 2)")
    _tensor(rotary_sin, "rotary_sin", 2, "(seqlen_ro, rotary_dim / 2)")
    if rotary_sin.shape != rotary_cos.shape:
        raise ArgumentError(
            f"rotary_sin: expected the shape of rotary_cos {list(rotary_cos.shape)}, "
            f"got {list(rotary_sin.shape)}"
        )
    if not 0 < 2 * rotary_cos.shape[1] <= headdim:
        raise ArgumentError(
            f"rotary_cos: rotary_dim = 2 * {rotary_cos.shape[1]} must lie in [2, headdim = "
            f"{headdim}]"
        )
    if rotary_cos.shape[0] < needed:
        raise ArgumentError(
            f"rotary_cos: {rotary_cos.shape[0]} positions (seqlen_ro), but the cache "
            f"reaches position {needed - 1}"
        )


@_raises_like_flash_attn
def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens: Optional[Union[int, Tensor]] = None,
    cache_batch_idx: Optional[Tensor] = None,
    cache_leftpad: Optional[Tensor] = None,
    block_table: Optional[Tensor] = None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    """Attention of q against a KV cache, after appending new keys and values to it.

    If k and v are given, they are written into k_cache and v_cache *in place* at
    positions cache_seqlens[b], cache_seqlens[b] + 1, ... of sequence b, and q
    attends to the first cache_seqlens[b] + seqlen_new keys (from cache_leftpad[b]
    on, when given). The cache must have room for them.

    With rotary_cos and rotary_sin (only together with k and v), k is rotated at
    positions cache_seqlens[b], cache_seqlens[b] + 1, ... before it is stored. If
    causal or local (window_size != (-1, -1)), q is rotated at the same positions;
    otherwise every row of q is rotated at position cache_seqlens[b].

    Supports MQA/GQA. causal=True and window_size are aligned bottom-right: query i of
    seqlen_q sees keys up to i + seqlen_k - seqlen_q, seqlen_k being the sequence's
    number of keys. Not differentiable (no autograd graph is recorded).

    Arguments:
        q: (batch_size, seqlen_q, nheads, headdim)
        k_cache: (batch_size_cache, seqlen_cache, nheads_k, headdim) without block_table,
            or (num_blocks, page_block_size, nheads_k, headdim) with block_table.
        v_cache: like k_cache, with headdim_v.
        k [optional]: (batch_size, seqlen_new, nheads_k, headdim), the new keys.
        v [optional]: (batch_size, seqlen_new, nheads_k, headdim_v), the new values.
        rotary_cos [optional]: (seqlen_ro, rotary_dim / 2), cos of the rotary angles.
        rotary_sin [optional]: (seqlen_ro, rotary_dim / 2), sin of the rotary angles.
        cache_seqlens: int, or (batch_size,) int32: the cache's current lengths (the end
            of the valid keys). None means the whole cache (only without k and v).
        cache_batch_idx [optional]: (batch_size,) int32, the cache row of each sequence;
            default 0, 1, ..., batch_size - 1. Not with block_table.
        cache_leftpad [optional]: (batch_size,) int32, where each sequence's keys start
            in the cache (default 0); positions stay the cache's indices.
        block_table [optional]: (batch_size, max_num_blocks_per_seq) int32, the pages of
            each sequence in a paged cache.
        softmax_scale: float, default 1 / sqrt(headdim).
        causal, window_size, softcap, alibi_slopes: as flash_attn_func.
        rotary_interleaved: bool; True rotates pairs (0, 1), (2, 3), ... (GPT-J); False
            pairs (0, rotary_dim / 2), (1, rotary_dim / 2 + 1), ... (GPT-NeoX).
        num_splits: int, accepted and ignored.
        return_softmax_lse: bool, also return softmax_lse.

    Return:
        out: (batch_size, seqlen_q, nheads, headdim_v).
        softmax_lse [if return_softmax_lse]: (batch_size, nheads, seqlen_q).
    """
    _tensor(q, "q", 4, "(batch_size, seqlen_q, nheads, headdim)")
    cache_layout = ("(num_blocks, page_block_size, nheads_k, headdim) with block_table"
                    if block_table is not None else
                    "(batch_size_cache, seqlen_cache, nheads_k, headdim)")
    _tensor(k_cache, "k_cache", 4, cache_layout)
    _tensor(v_cache, "v_cache", 4, cache_layout)
    if v_cache.shape[:3] != k_cache.shape[:3]:
        raise ArgumentError(
            f"v_cache: expected the first three dimensions of k_cache "
            f"{list(k_cache.shape[:3])}, got shape {list(v_cache.shape)}"
        )
    batch, seqlen_q = q.shape[0], q.shape[1]
    window = _window(window_size)

    paged = block_table is not None
    if paged:
        if cache_batch_idx is not None:
            raise ArgumentError(
                "cache_batch_idx: not supported with a paged cache (block_table); the "
                "block table already says where each sequence lives"
            )
        table = _block_table(block_table, batch)
        page = k_cache.shape[1]
        capacity = table.shape[1] * page
    else:
        capacity = k_cache.shape[1]
        if cache_batch_idx is None:
            if k_cache.shape[0] != batch:
                raise ArgumentError(
                    f"k_cache: expected {batch} cache rows (the batch size of q) without "
                    f"cache_batch_idx, got shape {list(k_cache.shape)}"
                )
            rows = None
        else:
            rows = _int_vector(cache_batch_idx, "cache_batch_idx", batch)
            if batch and (int(rows.min()) < 0 or int(rows.max()) >= k_cache.shape[0]):
                raise ArgumentError(
                    f"cache_batch_idx: indices must lie in [0, {k_cache.shape[0]}), got "
                    f"{rows.tolist()}"
                )

    if (k is None) != (v is None):
        raise ArgumentError("k and v: pass both (new keys and values to append) or neither")
    seqlen_new = 0
    if k is not None:
        _tensor(k, "k", 4, "(batch_size, seqlen_new, nheads_k, headdim)")
        _tensor(v, "v", 4, "(batch_size, seqlen_new, nheads_k, headdim)")
        seqlen_new = k.shape[1]
        for name, new, cache in (("k", k, k_cache), ("v", v, v_cache)):
            expected = [batch, seqlen_new, cache.shape[2], cache.shape[3]]
            if list(new.shape) != expected:
                raise ArgumentError(f"{name}: expected shape {expected}, got {list(new.shape)}")
        if cache_seqlens is None:
            raise ArgumentError(
                "cache_seqlens: required with k and v (where the new tokens are written)"
            )

    if cache_seqlens is None:
        seqlens = torch.full((batch,), capacity, dtype=torch.int64)
    elif isinstance(cache_seqlens, numbers.Integral):
        seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int64)
    else:
        seqlens = _int_vector(cache_seqlens, "cache_seqlens", batch)
    lengths = seqlens + seqlen_new
    if batch and (int(seqlens.min()) < 0 or int(lengths.max()) > capacity):
        holds = (f"the {table.shape[1]} blocks of {page} tokens block_table gives each "
                 "sequence" if paged else "the cache's capacity")
        raise ArgumentError(
            f"cache_seqlens: each length plus seqlen_new = {seqlen_new} must lie in "
            f"[0, {capacity}] ({holds}), got {seqlens.tolist()}"
        )
    leftpad = None
    if cache_leftpad is not None:
        leftpad = _int_vector(cache_leftpad, "cache_leftpad", batch)
        if bool(((leftpad < 0) | (leftpad > seqlens)).any()):
            raise ArgumentError(
                f"cache_leftpad: expected 0 <= cache_leftpad[b] <= cache_seqlens[b], got "
                f"{leftpad.tolist()} and {seqlens.tolist()}"
            )

    positions = seqlens[:, None] + torch.arange(seqlen_new)  # [B, seqlen_new]
    if rotary_cos is not None or rotary_sin is not None:
        if rotary_cos is None or rotary_sin is None:
            raise ArgumentError("rotary_cos and rotary_sin: pass both or neither")
        if k is None:
            raise ArgumentError(
                "rotary_cos: rotary embedding needs the new keys k and values v"
            )
        # FlashAttention drops a window side that covers the whole cache.
        left = window[0] if window[0] < capacity else -1
        right = window[1] if window[1] < capacity else -1
        if causal or left >= 0 or right >= 0:
            q_positions = seqlens[:, None] + torch.arange(seqlen_q)
        else:
            q_positions = seqlens[:, None].expand(batch, seqlen_q)
        needed = max(int(lengths.max()), int(q_positions.max()) + 1) if batch else 0
        _rotary_tables(rotary_cos, rotary_sin, q.shape[3], needed)
        k = _rotary(k, rotary_cos, rotary_sin, positions, rotary_interleaved)
        q = _rotary(q, rotary_cos, rotary_sin, q_positions, rotary_interleaved)

    nk = int(lengths.max()) if batch else 0
    if paged:
        nblocks = -(-nk // page)
        # Blocks past a sequence's length may hold anything: read block 0 there.
        in_use = torch.arange(nblocks)[None, :] * page < lengths[:, None]
        used = torch.where(in_use, table[:, :nblocks], 0)
        if bool(((used < 0) | (used >= k_cache.shape[0])).any()):
            raise ArgumentError(
                f"block_table: block indices must lie in [0, {k_cache.shape[0]}) (the "
                f"blocks of k_cache), got {table[:, :nblocks].tolist()}"
            )

    with torch.no_grad():
        if paged:
            if k is not None:
                blocks = table.gather(1, positions // page)
                k_cache[blocks, positions % page] = k.to(k_cache.dtype)
                v_cache[blocks, positions % page] = v.to(v_cache.dtype)
            shape = (batch, nblocks * page) + tuple(k_cache.shape[2:])
            keys = k_cache[used].reshape(shape)[:, :nk]
            values = v_cache[used].reshape(shape[:3] + (v_cache.shape[3],))[:, :nk]
        else:
            if k is not None:
                at = (torch.arange(batch) if rows is None else rows)[:, None]
                k_cache[at, positions] = k.to(k_cache.dtype)
                v_cache[at, positions] = v.to(v_cache.dtype)
            if rows is None:
                keys, values = k_cache[:, :nk], v_cache[:, :nk]
            else:
                keys, values = k_cache[rows, :nk], v_cache[rows, :nk]
        mask = None
        if leftpad is not None:
            mask = (torch.arange(nk)[None, :] >= leftpad[:, None]).view(batch, 1, 1, nk)
        out, lse = _ops.attention(
            q, keys, values, mask=mask, key_lengths=lengths.to(torch.int32),
            **_options(softmax_scale, causal, window, softcap, alibi_slopes))
    return (out, _fa_lse(lse)) if return_softmax_lse else out


# --------------------------------------------------------------------------------------------
# FlashAttention's private entry points (flash_attn.flash_attn_interface), which tests and
# libraries call directly: the same arguments, order and return tuples, no autograd.


def _rng_state(seed: int) -> Tensor:
    """The dropout state a forward returns and a backward reads: (seed, offset 0), int64
    (FlashAttention's philox seed and offset; qkv's counter-based generator needs the
    seed only)."""
    return torch.tensor([seed, 0], dtype=torch.int64)


def _seed_of(rng_state, dropout_p: float) -> int:
    if rng_state is None:
        return _seed(dropout_p)
    _tensor(rng_state, "rng_state", 1, "(2,) int64, as a forward returned it")
    return int(rng_state[0])


@_raises_like_flash_attn
def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left,
                        window_size_right, softcap, alibi_slopes, return_softmax):
    """FlashAttention's private forward: q (batch_size, seqlen_q, nheads, headdim), k and
    v (batch_size, seqlen_k, nheads_k, headdim), the options of flash_attn_func with the
    window as two ints. Returns (out, softmax_lse, S_dmask, rng_state): S_dmask as
    flash_attn_func's with return_softmax, else an empty tensor; rng_state the dropout
    state for _flash_attn_backward. Not differentiable (the outputs are detached)."""
    _tensor(q, "q", 4, "(batch_size, seqlen_q, nheads, headdim)")
    _tensor(k, "k", 4, "(batch_size, seqlen_k, nheads_k, headdim)")
    _tensor(v, "v", 4, "(batch_size, seqlen_k, nheads_k, headdim)")
    seed = _seed(dropout_p)
    with torch.no_grad():
        out, lse, s_dmask = _forward(q, k, v, dropout_p, softmax_scale, causal,
                                     (window_size_left, window_size_right), softcap,
                                     alibi_slopes, bool(return_softmax), None, seed)
    return out, lse, q.new_empty((0,)) if s_dmask is None else s_dmask, _rng_state(seed)


def _used_keys(k: Tensor, v: Tensor, cu_k: Tensor, leftpad_k, seqused_k):
    """Packed keys and values of sequences whose keys start at cu_k[b] + leftpad_k[b] and
    number seqused_k[b] - leftpad_k[b] (or cu_k[b + 1] - cu_k[b] - leftpad_k[b]):
    gathered into (k, v, cu_seqlens_k) of qkv's packing (a copy)."""
    batch = cu_k.shape[0] - 1
    cu = cu_k.to(torch.int64)
    pad = torch.zeros(batch, dtype=torch.int64) if leftpad_k is None else \
        _int_vector(leftpad_k, "leftpad_k", batch)
    used = cu[1:] - cu[:-1] if seqused_k is None else _int_vector(seqused_k, "seqused_k", batch)
    lengths = used - pad
    if batch and (int(pad.min()) < 0 or int(lengths.min()) < 0):
        raise ArgumentError(
            f"leftpad_k: expected 0 <= leftpad_k <= the keys of each sequence, got leftpad_k "
            f"{pad.tolist()} for {used.tolist()} keys"
        )
    starts = cu[:-1] + pad
    if batch and int((starts + lengths).max()) > k.shape[0]:
        raise ArgumentError(
            f"seqused_k: sequences end past k's {k.shape[0]} rows: starts {starts.tolist()}, "
            f"lengths {lengths.tolist()}"
        )
    rows = torch.cat([torch.arange(int(a), int(a) + int(n)) for a, n in zip(starts, lengths)]
                     + [torch.zeros(0, dtype=torch.int64)])
    cu_used = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32)
    return k[rows], v[rows], cu_used


@_raises_like_flash_attn
def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p, softmax_scale, causal, window_size_left=-1,
                               window_size_right=-1, softcap=0.0, alibi_slopes=None,
                               return_softmax=False, block_table=None, leftpad_k=None,
                               seqused_k=None, zero_tensors=False, num_splits=0):
    """FlashAttention's private varlen forward: q (total_q, nheads, headdim), k and v
    (total_k, nheads_k, headdim), or pages (num_blocks, page_block_size, nheads_k,
    headdim) with block_table; seqused_k (batch_size,) the keys each sequence uses (from
    cu_seqlens_k[b], or from its first page), leftpad_k (batch_size,) keys skipped at
    each sequence's start (not with block_table). zero_tensors changes nothing here;
    num_splits is ignored, except that num_splits > 1 with block_table is refused as
    FlashAttention refuses it. Returns (out, softmax_lse, S_dmask, rng_state) as
    _flash_attn_forward."""
    _tensor(q, "q", 3, "(total_q, nheads, headdim)")
    rank = 3 if block_table is None else 4
    layout = "(total_k, nheads_k, headdim)" if block_table is None else \
        "(num_blocks, page_block_size, nheads_k, headdim) with block_table"
    _tensor(k, "k", rank, layout)
    _tensor(v, "v", rank, layout)
    if block_table is not None and int(num_splits) > 1:
        raise ArgumentError("num_splits > 1 is not supported for varlen paged KV")
    if block_table is not None and leftpad_k is not None:
        raise ArgumentError("leftpad_k: not supported together with block_table (paged KV)")
    cu_k = _cu_seqlens(cu_seqlens_k, "cu_seqlens_k")
    if block_table is not None and seqused_k is not None:
        used = _int_vector(seqused_k, "seqused_k", cu_k.shape[0] - 1)
        cu_k = torch.nn.functional.pad(torch.cumsum(used, 0), (1, 0)).to(torch.int32)
    elif seqused_k is not None or leftpad_k is not None:
        k, v, cu_k = _used_keys(k, v, cu_k, leftpad_k, seqused_k)
    seed = _seed(dropout_p)
    with torch.no_grad():
        out, lse, s_dmask = _forward_varlen(
            q, k, v, cu_seqlens_q, cu_k, max_seqlen_q, max_seqlen_k, dropout_p,
            softmax_scale, causal, (window_size_left, window_size_right), softcap,
            alibi_slopes, bool(return_softmax), block_table, None, seed)
    return out, lse, q.new_empty((0,)) if s_dmask is None else s_dmask, _rng_state(seed)


def _gradients_into(gradients, dq, dk, dv):
    """Copies the (dq, dk, dv) computed into the tensors given for them (None: skipped)."""
    for name, target, value in zip(("dq", "dk", "dv"), (dq, dk, dv), gradients):
        if target is not None:
            if target.shape != value.shape:
                raise ArgumentError(
                    f"{name}: expected shape {list(value.shape)}, got {list(target.shape)}"
                )
            target.copy_(value)


@_raises_like_flash_attn
def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p,
                         softmax_scale, causal, window_size_left, window_size_right, softcap,
                         alibi_slopes, deterministic, rng_state=None):
    """FlashAttention's private backward: the gradients of _flash_attn_forward's call with
    the same options, given its out, softmax_lse and rng_state (the dropout pattern),
    written into dq, dk and dv (each may be None: not written). Returns softmax_d
    (batch_size, nheads, seqlen_q), float32: the row sums of dout * out."""
    _tensor(q, "q", 4, "(batch_size, seqlen_q, nheads, headdim)")
    seed = _seed_of(rng_state, dropout_p)
    lse = torch.where(softmax_lse == math.inf, -math.inf, softmax_lse)  # qkv's empty rows
    with torch.no_grad():
        g = _api.attention_backward(q, k, v, out, dout, lse, **_options(
            softmax_scale, bool(causal), _window((window_size_left, window_size_right)),
            float(softcap), alibi_slopes, float(dropout_p), seed))
        _gradients_into((g.dq, g.dk, g.dv), dq, dk, dv)
        return (dout.float() * out.float()).sum(-1).transpose(1, 2).contiguous()


@_raises_like_flash_attn
def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
                                cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                softmax_scale, causal, window_size_left, window_size_right,
                                softcap, alibi_slopes, deterministic, rng_state=None,
                                zero_tensors=False):
    """FlashAttention's private varlen backward: as _flash_attn_backward for packed
    sequences (q (total_q, nheads, headdim), softmax_lse (nheads, total_q)). Returns
    softmax_d (nheads, total_q), float32."""
    _tensor(q, "q", 3, "(total_q, nheads, headdim)")
    seed = _seed_of(rng_state, dropout_p)
    lse = torch.where(softmax_lse == math.inf, -math.inf, softmax_lse)
    with torch.no_grad():
        g = _api.attention_backward(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), out.unsqueeze(0),
            dout.unsqueeze(0), lse.unsqueeze(0),
            cu_seqlens_q=_cu_seqlens(cu_seqlens_q, "cu_seqlens_q"),
            cu_seqlens_k=_cu_seqlens(cu_seqlens_k, "cu_seqlens_k"), **_options(
                softmax_scale, bool(causal), _window((window_size_left, window_size_right)),
                float(softcap), alibi_slopes, float(dropout_p), seed))
        _gradients_into((g.dq[0], g.dk[0], g.dv[0]), dq, dk, dv)
        return (dout.float() * out.float()).sum(-1).transpose(0, 1).contiguous()

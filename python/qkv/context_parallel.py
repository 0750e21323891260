"""qkv.context_parallel: attention over one long sequence split by its
sequence axis across the ranks of a torch.distributed process group
(context parallelism on CPU: the gloo backend), as qkv.distributed does
over MPI, with the same functions, layouts and shapes.

    import torch.distributed as dist
    import qkv.context_parallel as cp

    dist.init_process_group("gloo")          # torchrun sets the rendezvous
    out = cp.ring_attention(q, k, v, causal=True, layout="zigzag")
    out.sum().backward()                     # collective as well

Run the program under torchrun (``torchrun --nproc-per-node 2 train.py``);
every rank passes its own shard, with the same shapes and options on every
rank:

    q    [B, nq, Hq,  Dk]    this rank's rows of the query sequence
    k    [B, nk, Hkv, Dk]    this rank's rows of the key sequence
    v    [B, nk, Hkv, Dv]
    out  [B, nq, Hq,  Dv]    this rank's rows of the output, dtype of q
    lse  [B, Hq, nq]         float32 (float64 for float64 q), with return_lse

float32, float64, bfloat16 or float16 CPU tensors; Hq a multiple of Hkv
(GQA/MQA). The whole problem has R * nq query rows and R * nk keys; the
layout says which rows a rank holds:

    "contiguous"  rank r holds rows [r * n, (r + 1) * n)
    "zigzag"      the sequence in 2R chunks of n / 2 rows (n even); rank r
                  holds chunks r and 2R - 1 - r, back to back (the same
                  causal work on every rank)

causal=True masks the whole sequence causally (nq == nk); scale defaults to
Dk^-1/2. The gathered outputs equal one qkv.attention call on the gathered
inputs within the merge's rounding (docs/distributed.md has the error
model).

* ring_attention: each rank keeps its queries and passes the keys and values
  around the ring (R - 1 steps, each sent while the previous block is
  attended); the partial results merge by their log-sum-exp in float32.
  The backward passes the blocks around again with their key/value
  gradients, which arrive home after R steps. Causal blocks above the
  diagonal are skipped (the zigzag layout gives every rank the same work).
* ulysses_attention: two all-to-alls trade the sequence split for a head
  split, each rank attends a group of heads over the whole sequence in one
  call, and trades back. Hq must be a multiple of R; key/value heads are
  repeated when R does not divide Hkv.

Tensors that require grad are differentiable (torch autograd); the
backward is collective too, so every rank must run it. Every call checks
its arguments collectively: when any rank's are bad or differ from the
others', every rank raises ValueError (TypeError for a non-tensor) naming
the rank and the argument, and nobody waits forever.
"""

from __future__ import annotations

import struct
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from . import _api
from ._api import AttentionResult

__all__ = ["AttentionResult", "LAYOUTS", "ring_attention", "ulysses_attention"]

LAYOUTS = ("contiguous", "zigzag")
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


# ---------------------------------------------------------------- shards

def _chunks(layout: str, rank: int, ranks: int, n: int) -> List[Tuple[int, int, int]]:
    """(global first row, local first row, rows) of each piece of the
    sequence that `rank` holds, in shard order."""
    if layout == "contiguous":
        return [(rank * n, 0, n)]
    c = n // 2
    return [(rank * c, 0, c), ((2 * ranks - 1 - rank) * c, c, c)]


def _relation(q_chunk, k_chunk, causal: bool) -> Optional[bool]:
    """How a query chunk sees a key chunk of the same grid: None (not at
    all: above the causal diagonal), False (every key), True (causally: the
    diagonal chunk)."""
    if not causal:
        return False
    (qg, _, qn), (kg, _, kn) = q_chunk, k_chunk
    if kg + kn <= qg:
        return False
    if kg >= qg + qn:
        return None
    return True


# ---------------------------------------------------------------- checks

def _problem(q, k, v, group, layout, causal, scale, kind: str) -> str:
    """This rank's complaint about its arguments, or ''."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            return f"{name} must be a torch.Tensor, got {type(x).__name__}"
    if layout not in LAYOUTS:
        return f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            return f"{name} must be 4-D [B, n, H, D], got shape {tuple(x.shape)}"
        if x.device.type != "cpu":
            return f"{name} must be on the CPU, got {x.device}"
        if x.dtype != q.dtype:
            return f"{name} must have q's dtype {q.dtype}, got {x.dtype}"
    if q.dtype not in _DTYPES:
        return f"q must be float32, float64, bfloat16 or float16, got {q.dtype}"
    (b, nq, hq, dk), (bk, nk, hkv, dkk), (bv, nv, hv, _) = q.shape, k.shape, v.shape
    if (bk, bv) != (b, b) or nv != nk or hv != hkv or dkk != dk:
        return (f"k [B, nk, Hkv, Dk] and v [B, nk, Hkv, Dv] must match q [B, nq, Hq, Dk] "
                f"{tuple(q.shape)}; got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if hkv == 0 or hq % hkv:
        return f"Hq ({hq}) must be a multiple of Hkv ({hkv})"
    if causal and nq != nk:
        return f"causal attention needs as many query rows as keys per rank, got {nq} and {nk}"
    if layout == "zigzag" and (nq % 2 or nk % 2):
        return f"the zigzag layout needs an even number of rows per rank, got {nq} and {nk}"
    if kind == "ulysses_attention" and hq % dist.get_world_size(group):
        return (f"ulysses_attention splits the Hq = {hq} query heads over "
                f"{dist.get_world_size(group)} ranks: Hq must be a multiple of it")
    if scale is not None and not (isinstance(scale, (int, float)) and scale == scale):
        return f"scale must be a number or None, got {scale!r}"
    return ""


def _scale_bits(scale) -> int:
    """scale as an integer that every rank computes alike (-1: None)."""
    if scale is None:
        return -1
    return int.from_bytes(struct.pack("<d", float(scale)), "little") >> 1


def _check(q, k, v, group, layout, causal, scale, kind: str) -> None:
    """Raises on every rank when any rank's arguments are bad or differ: the
    rank whose argument is not a tensor a TypeError, the others ValueError."""
    problem = _problem(q, k, v, group, layout, causal, scale, kind)
    facts = [0 if problem else 1]
    if not problem:
        facts += [*q.shape, *k.shape, v.shape[3], _DTYPES.index(q.dtype),
                  LAYOUTS.index(layout), int(causal), _scale_bits(scale)]
    facts += [0] * (15 - len(facts))
    t = torch.tensor(facts, dtype=torch.int64)
    low, high = t.clone(), t.clone()
    dist.all_reduce(low, dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, dist.ReduceOp.MAX, group=group)
    if torch.equal(low, high) and facts[0] == 1:
        return
    said = [None] * dist.get_world_size(group)
    dist.all_gather_object(said, problem, group=group)
    if "must be a torch.Tensor" in problem:
        raise TypeError(f"{kind}: {problem}")
    for rank, message in enumerate(said):
        if message:
            raise ValueError(f"{kind}: rank {rank}: {message}")
    raise ValueError(f"{kind}: the ranks disagree on the shapes, dtype, layout, causal or "
                     f"scale (every rank must pass the same)")


# ---------------------------------------------------------------- transport

def _peer(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _bytes(*xs: torch.Tensor) -> torch.Tensor:
    """The tensors' contents as one uint8 buffer (gloo moves any dtype so)."""
    return torch.cat([x.contiguous().view(torch.uint8).reshape(-1) for x in xs])


def _unbytes(buf: torch.Tensor, *likes: torch.Tensor) -> List[torch.Tensor]:
    out, at = [], 0
    for like in likes:
        n = like.numel() * like.element_size()
        out.append(buf[at:at + n].view(like.dtype).view(like.shape))
        at += n
    return out


KEYS_TAG, GRADIENTS_TAG = 1, 2  # the two streams around the ring


def _shift(buf: torch.Tensor, group, rank: int, ranks: int, tag: int):
    """Posts the send of buf to the next rank and the receive of the
    previous rank's; returns (the receive buffer, the requests)."""
    into = torch.empty_like(buf)
    requests = [dist.isend(buf, _peer(group, (rank + 1) % ranks), group=group, tag=tag),
                dist.irecv(into, _peer(group, (rank - 1) % ranks), group=group, tag=tag)]
    return into, requests


def _wait(requests) -> None:
    for request in requests:
        request.wait()


# ---------------------------------------------------------------- ring

def _work(x: torch.Tensor) -> torch.Tensor:
    """float64 stays, the rest computes in float32 (qkv widens 16-bit
    inputs to float32 inside its kernels, so this rounds nothing more)."""
    return x if x.dtype == torch.float64 else x.float()


def _around_the_ring(k, v, group, rank: int, ranks: int):
    """Yields (source rank, its keys, its values) for each of the R steps,
    as working tensors; the next block travels while the caller works on
    this one."""
    kv = _bytes(k, v)
    for step in range(ranks):
        requests = []
        if step + 1 < ranks:
            incoming, requests = _shift(kv, group, rank, ranks, KEYS_TAG)
        ks, vs = (_work(x) for x in _unbytes(kv, k, v))
        yield (rank - step) % ranks, ks, vs
        _wait(requests)
        if step + 1 < ranks:
            kv = incoming


def _pieces(layout: str, rank: int, source: int, ranks: int, nq: int, nk: int, causal: bool):
    """(query rows, key rows, causal) of each piece this rank computes
    against the block of `source`; pieces above the causal diagonal skipped."""
    for qc in _chunks(layout, rank, ranks, nq):
        for kc in _chunks(layout, source, ranks, nk):
            seen = _relation(qc, kc, causal)
            if seen is not None:
                yield slice(qc[1], qc[1] + qc[2]), slice(kc[1], kc[1] + kc[2]), seen


def _ring_forward(q, k, v, group, layout, causal, scale):
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    b, nq, hq, _ = q.shape
    nk, dv = k.shape[1], v.shape[3]
    wq = _work(q)
    out = torch.zeros(b, nq, hq, dv, dtype=wq.dtype)
    lse = torch.full((b, hq, nq), float("-inf"), dtype=wq.dtype)
    for source, ks, vs in _around_the_ring(k, v, group, rank, ranks):
        for rows, keys, seen in _pieces(layout, rank, source, ranks, nq, nk, causal):
            part = _api.attention(wq[:, rows], ks[:, keys], vs[:, keys], causal=seen,
                                  scale=scale, return_lse=True)
            _merge(out[:, rows], lse[:, :, rows], part.out, part.lse)
    return out, lse


def _merge(out, lse, part_out, part_lse) -> None:
    """(out, lse) <- the softmax merge of (out, lse) and a partial result
    over other keys, in place: out = sum_i e^(lse_i - lse) out_i."""
    merged = torch.logaddexp(lse, part_lse)
    finite = torch.where(torch.isfinite(merged), merged, torch.zeros_like(merged))
    keep = torch.exp(lse - finite).transpose(1, 2).unsqueeze(-1)
    take = torch.exp(part_lse - finite).transpose(1, 2).unsqueeze(-1)
    out.mul_(keep).add_(part_out * take)
    lse.copy_(merged)


def _ring_backward(q, k, v, out, dout, lse, group, layout, causal, scale):
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    nq, nk = q.shape[1], k.shape[1]
    wq, wout, wdout = _work(q), _work(out), _work(dout)
    dq = torch.zeros_like(wq)
    grads = None  # the arriving block's key/value gradients so far, with its receive
    pending: list = []
    for source, ks, vs in _around_the_ring(k, v, group, rank, ranks):
        dk, dv = torch.zeros_like(ks), torch.zeros_like(vs)
        for rows, keys, seen in _pieces(layout, rank, source, ranks, nq, nk, causal):
            g = _api.attention_backward(wq[:, rows], ks[:, keys], vs[:, keys], wout[:, rows],
                                        wdout[:, rows], lse[:, :, rows].contiguous(),
                                        causal=seen, scale=scale)
            dq[:, rows] += g.dq
            dk[:, keys] += g.dk
            dv[:, keys] += g.dv
        if grads is not None:  # the gradients of this block from the ranks before
            _wait(grads[1])
            dk_in, dv_in = _unbytes(grads[0], dk, dv)
            dk += dk_in
            dv += dv_in
        if ranks > 1:  # pass them on; after the last step they reach the block's home
            outgoing = _bytes(dk, dv)
            arriving, sent = _shift(outgoing, group, rank, ranks, GRADIENTS_TAG)
            pending += [(sent[0], outgoing)]  # the buffer lives until its send is done
            grads = (arriving, sent[1:])
    if ranks > 1:
        _wait(grads[1])
        dk, dv = _unbytes(grads[0], dk, dv)
        _wait(request for request, _ in pending)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---------------------------------------------------------------- ulysses

def _to_heads(x: torch.Tensor, group, layout: str) -> torch.Tensor:
    """[B, n, H, D] sequence shards -> [B, R n, H / R, D]: all rows of this
    rank's group of heads, in sequence order."""
    ranks = dist.get_world_size(group)
    b, n, h, d = x.shape
    send = x.reshape(b, n, ranks, h // ranks, d).permute(2, 0, 1, 3, 4).contiguous()
    got = torch.empty_like(send)  # [R (source rank), B, n, H / R, D]
    dist.all_to_all_single(got.view(torch.uint8).view(ranks, -1),
                           send.view(torch.uint8).view(ranks, -1), group=group)
    whole = torch.empty(b, ranks * n, h // ranks, d, dtype=x.dtype)
    for source in range(ranks):
        for g, local, rows in _chunks(layout, source, ranks, n):
            whole[:, g:g + rows] = got[source, :, local:local + rows]
    return whole


def _to_rows(x: torch.Tensor, group, layout: str) -> torch.Tensor:
    """The inverse of _to_heads: [B, R n, H / R, D] -> [B, n, H, D]."""
    ranks = dist.get_world_size(group)
    b, total, hr, d = x.shape
    n = total // ranks
    send = torch.empty(ranks, b, n, hr, d, dtype=x.dtype)
    for dest in range(ranks):
        for g, local, rows in _chunks(layout, dest, ranks, n):
            send[dest, :, local:local + rows] = x[:, g:g + rows]
    got = torch.empty_like(send)  # [R (source rank: head group), B, n, H / R, D]
    dist.all_to_all_single(got.view(torch.uint8).view(ranks, -1),
                           send.view(torch.uint8).view(ranks, -1), group=group)
    return got.permute(1, 2, 0, 3, 4).reshape(b, n, ranks * hr, d)


def _kv_heads(x: torch.Tensor, hq: int, ranks: int) -> torch.Tensor:
    """Keys or values with their heads repeated (GQA) until the ranks divide them."""
    hkv = x.shape[2]
    if hkv % ranks == 0:
        return x
    return x.repeat_interleave(hq // hkv, dim=2)


def _kv_heads_grad(g: torch.Tensor, hkv: int) -> torch.Tensor:
    if g.shape[2] == hkv:
        return g
    b, n, h, d = g.shape
    return g.view(b, n, hkv, h // hkv, d).sum(3)


# ---------------------------------------------------------------- autograd

class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, layout, causal, scale):
        out, lse = _ring_forward(q, k, v, group, layout, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, layout, causal, scale)
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(q, k, v, out, dout, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None


class _Ulysses(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, layout, causal, scale):
        ranks = dist.get_world_size(group)
        hq = q.shape[2]
        qh = _to_heads(q, group, layout)
        kh = _to_heads(_kv_heads(k, hq, ranks), group, layout)
        vh = _to_heads(_kv_heads(v, hq, ranks), group, layout)
        r = _api.attention(qh, kh, vh, causal=causal, scale=scale, return_lse=True)
        ctx.save_for_backward(qh, kh, vh, r.out, r.lse)
        ctx.args = (group, layout, causal, scale, k.shape[2])
        out = _to_rows(r.out, group, layout)
        # lse [B, Hq / R, R n] -> rows: through the same exchange as [B, R n, Hq / R, 1]
        lse = _to_rows(r.lse.transpose(1, 2).unsqueeze(-1), group, layout)
        lse = lse.squeeze(-1).transpose(1, 2).contiguous()
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        qh, kh, vh, out, lse = ctx.saved_tensors
        group, layout, causal, scale, hkv = ctx.args
        doh = _to_heads(dout.to(out.dtype), group, layout)
        g = _api.attention_backward(qh, kh, vh, out, doh, lse, causal=causal, scale=scale)
        dq = _to_rows(g.dq, group, layout)
        dk = _kv_heads_grad(_to_rows(g.dk, group, layout), hkv)
        dv = _kv_heads_grad(_to_rows(g.dv, group, layout), hkv)
        return dq, dk, dv, None, None, None, None


def _attend(function, kind, q, k, v, group, layout, causal, scale, return_lse):
    _check(q, k, v, group, layout, causal, scale, kind)
    out, lse = function.apply(q, k, v, group, layout, causal, scale)
    return AttentionResult(out, lse, None) if return_lse else out


def ring_attention(q, k, v, group=None, *, layout: str = "contiguous", causal: bool = False,
                   scale: Optional[float] = None, return_lse: bool = False):
    """Ring attention over the process group (None: the default group).
    Shapes and layouts in the module docstring. Returns out, or
    AttentionResult(out, lse, None) with return_lse."""
    return _attend(_Ring, "ring_attention", q, k, v, group, layout, causal, scale, return_lse)


def ulysses_attention(q, k, v, group=None, *, layout: str = "contiguous",
                      causal: bool = False, scale: Optional[float] = None,
                      return_lse: bool = False):
    """All-to-all (Ulysses) attention over the process group (None: the
    default group). Shapes and layouts in the module docstring. Returns out,
    or AttentionResult(out, lse, None) with return_lse."""
    return _attend(_Ulysses, "ulysses_attention", q, k, v, group, layout, causal, scale,
                   return_lse)

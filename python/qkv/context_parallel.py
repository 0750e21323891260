"""qkv.context_parallel: attention over one long sequence split by its
sequence axis across the ranks of a torch.distributed process group
(context parallelism on CPU: the gloo backend), as qkv.distributed does
over MPI: the same functions, layouts, shapes and options, and the same
native pieces between the messages (which piece a mask admits, its
options, the log-sum-exp merge).

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

Options are qkv.attention's keywords and speak of the whole problem, as
qkv.distributed's: scale, score="dot", causal with align, window=(left,
right), key_lengths [B] (each <= R nk: padded sequences), alibi_slopes [Hq]
or [B, Hq], sinks [Hq] (counted once per row; differentiable),
score_scale [Hq] with score_scale_log_n (differentiable), softcap,
dropout_p with dropout_seed / dropout_offset (the mask of one qkv.attention
call on the gathered inputs) and backend; the others (masks, packed
sequences, relative bias, additive scores, sparse patterns) are refused by
name. The gathered outputs equal one qkv.attention call on the gathered
inputs within the merge's rounding (docs/distributed.md has the error
model).

* ring_attention: each rank keeps its queries and passes the keys and values
  around the ring (R - 1 steps, each sent while the previous block is
  attended); pieces no query can attend are skipped, and the partial
  results merge by their log-sum-exp into float32 accumulators. The
  backward passes the blocks around again with their key/value gradients,
  which arrive home after R steps.
* ulysses_attention: two all-to-alls trade the sequence split for a head
  split, each rank attends a group of heads over the whole sequence in one
  call, and trades back. Hq must be a multiple of R; key/value heads are
  repeated when R does not divide Hkv.

Tensors that require grad are differentiable (torch autograd); the
backward is collective too, so every rank must run it (the collective check
makes sure that every rank's output requires grad, or none's). q, k and v
get the gradients of their shards; the learned parameters (sinks,
score_scale), replicated on every rank, get this rank's share of theirs, so
that summing their .grad over the ranks (as data parallelism does for any
replicated parameter) gives the whole problem's. Every call checks
its arguments collectively: when any rank's are bad or differ from the
others', every rank raises ValueError (TypeError for a non-tensor) naming
the rank and the argument, and nobody waits forever.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import _api, _arrays, _collective, _qkv
from ._api import AttentionResult

__all__ = ["AttentionResult", "LAYOUTS", "ring_attention", "ulysses_attention"]

LAYOUTS = ("contiguous", "zigzag")


# ---------------------------------------------------------------- checks

def _problem(q, k, v, group, layout, kind: str) -> str:
    """What the native check cannot say about this rank's arguments, or ''."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            return f"{name} must be a torch.Tensor, got {type(x).__name__}"
    if layout not in LAYOUTS:
        return f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.device.type != "cpu":
            return f"{name} must be on the CPU, got {x.device}"
    ranks = dist.get_world_size(group)
    if kind == "ulysses_attention" and q.dim() == 4 and q.shape[2] % ranks:
        return (f"ulysses_attention splits the Hq = {q.shape[2]} query heads over "
                f"{ranks} ranks: Hq must be a multiple of it")
    return ""


def _prepare(q, k, v, group, layout, kind: str, options: dict) -> "_qkv.Options":
    """The native options of the call, after the collective check: raises on
    every rank when any rank's arguments are bad or differ (the rank whose
    argument is not a tensor a TypeError, the others ValueError)."""
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    problem, o, values, names, whole = _problem(q, k, v, group, layout, kind), None, [], [], []
    error_type = TypeError if "must be a torch.Tensor" in problem else ValueError
    if not problem:
        try:
            o = _api._options(**options)
            reasons, whole, names, values = _qkv.shard_check(
                kind, *(_arrays.native(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"))),
                None, None, None, o, layout, rank, ranks, False)
            problem = "; ".join(reasons)
        except Exception as error:  # noqa: BLE001 (any failure here is this rank's to tell)
            problem = " ".join(str(error).split()) or type(error).__name__
            error_type = TypeError if isinstance(error, TypeError) else ValueError
    fine = torch.tensor([0 if problem else 1], dtype=torch.int64)
    dist.all_reduce(fine, dist.ReduceOp.MIN, group=group)
    if not fine.item():
        said = [None] * ranks
        dist.all_gather_object(said, problem, group=group)
        if problem and error_type is TypeError:  # this rank's argument has the wrong type
            raise TypeError(f"{kind}: {problem}")
        first = next(r for r, message in enumerate(said) if message)
        raise ValueError(f"{kind}: rank {first} of {ranks}: {said[first]}")

    def maximum(xs: List[int]) -> List[int]:  # elementwise, over the ranks
        reduced = torch.tensor(xs, dtype=torch.int64)
        dist.all_reduce(reduced, dist.ReduceOp.MAX, group=group)
        return reduced.tolist()

    # Every rank passed the local checks, so every rank has the same names;
    # and every rank must run the backward if any does (it is collective).
    named = [*zip(names, values), _collective.requires_grad(q, k, v, options)]
    _collective.agree(kind, rank, named, maximum)
    if whole:  # the same on every rank: they agree
        raise ValueError(f"{kind}: " + "; ".join(whole))
    return o


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

def _around_the_ring(k, v, group, rank: int, ranks: int):
    """Yields (source rank, its keys, its values) for each of the R steps;
    the next block travels while the caller works on this one."""
    kv = _bytes(k, v)
    for step in range(ranks):
        requests = []
        if step + 1 < ranks:
            incoming, requests = _shift(kv, group, rank, ranks, KEYS_TAG)
        yield (rank - step) % ranks, *_unbytes(kv, k, v)
        _wait(requests)
        if step + 1 < ranks:
            kv = incoming


def _real(x: torch.Tensor) -> torch.dtype:
    """The accumulators' dtype: float64 for float64 inputs, else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _native(*xs: torch.Tensor):
    return tuple(_arrays.native(x, "input") for x in xs)


def _ring_forward(q, k, v, o, group, layout):
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    b, nq, hq, _ = q.shape
    acc = torch.zeros(b, nq, hq, v.shape[3], dtype=_real(q))
    acc_lse = torch.full((b, hq, nq), float("-inf"), dtype=_real(q))
    for source, ks, vs in _around_the_ring(k, v, group, rank, ranks):
        _api._run(_qkv.ring_forward_step, *_native(q, ks, vs, acc, acc_lse), o, layout, rank,
                  source, ranks)
    _api._run(_qkv.ring_add_sinks, *_native(q, k, v, acc, acc_lse), o, layout, rank, ranks)
    return acc.to(q.dtype), acc_lse


def _ring_backward(q, k, v, out, dout, lse, o, group, layout):
    """(dq, dk, dv) of this rank's shards and {gradient: this rank's share}
    of the parameters that the steps' accumulators give (the maps of the
    queries')."""
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    dq = torch.zeros(q.shape, dtype=_real(q))
    grads = None  # the arriving block's key/value gradients so far, with its receive
    pending: list = []
    for source, ks, vs in _around_the_ring(k, v, group, rank, ranks):
        dk, dv = torch.zeros(k.shape, dtype=dq.dtype), torch.zeros(v.shape, dtype=dq.dtype)
        _api._run(_qkv.ring_backward_step, *_native(q, ks, vs, out, dout, lse, dq, dk, dv), o,
                  layout, rank, source, ranks)
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
    # With maps of the queries the steps accumulated the mapped queries' gradient.
    shares = {name: torch.from_dlpack(share) for name, share in _api._run(
        _qkv.shard_query_map_gradients, *_native(q, k, v, dq), o, layout, rank, ranks).items()}
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), shares


def _sink_gradients(q, k, v, out, dout, lse, o, group, layout):
    """This rank's share of d_sinks [Hq]: its rows' part (the shares sum to
    the whole problem's)."""
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    return torch.from_dlpack(_api._run(_qkv.shard_sink_gradients,
                                       *_native(q, k, v, out, dout, lse), o, layout, rank, ranks))


# ---------------------------------------------------------------- ulysses

def _chunks(layout: str, rank: int, ranks: int, n: int) -> List[Tuple[int, int, int]]:
    """(global first row, local first row, rows) of each piece of the
    sequence that `rank` holds, in shard order."""
    if layout == "contiguous":
        return [(rank * n, 0, n)]
    c = n // 2
    return [(rank * c, 0, c), ((2 * ranks - 1 - rank) * c, c, c)]


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
    return g.view(b, n, hkv, h // hkv, d).sum(3, dtype=_real(g)).to(g.dtype)


def _ulysses_forward(q, k, v, o, group, layout):
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    hq = q.shape[2]
    qh = _to_heads(q, group, layout)
    kh = _to_heads(_kv_heads(k, hq, ranks), group, layout)
    vh = _to_heads(_kv_heads(v, hq, ranks), group, layout)
    b, total, hl, _ = qh.shape
    out = torch.empty(b, total, hl, vh.shape[3], dtype=q.dtype)
    lse = torch.empty(b, hl, total, dtype=_real(q))
    _api._run(_qkv.heads_attention, *_native(qh, kh, vh, out, lse), o, rank, ranks)
    return (qh, kh, vh, out, lse), out, lse


def _ulysses_rows(out, lse, group, layout):
    """The heads' out and lse back to this rank's rows."""
    rows = _to_rows(out, group, layout)
    # lse [B, Hq / R, R n] -> rows: through the same exchange as [B, R n, Hq / R, 1]
    lse = _to_rows(lse.transpose(1, 2).unsqueeze(-1), group, layout)
    return rows, lse.squeeze(-1).transpose(1, 2).contiguous()


def _ulysses_backward(saved, dout, o, group, layout, hkv):
    """(dq, dk, dv) of this rank's rows and {gradient: this rank's share} of
    the parameters the options use: its heads' gradients, 0 for the others'
    (qkv::dist's parameters are per head)."""
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    qh, kh, vh, out, lse = saved
    doh = _to_heads(dout.to(out.dtype), group, layout)
    dq, dk, dv = torch.empty_like(qh), torch.empty_like(kh), torch.empty_like(vh)
    mine = _api._run(_qkv.heads_attention_backward,
                     *_native(qh, kh, vh, out, doh, lse, dq, dk, dv), o, rank, ranks)
    shares = {}
    for name, g in mine.items():
        g = torch.from_dlpack(g)
        share = g.new_zeros((g.shape[0] * ranks,) + tuple(g.shape[1:]))
        share[rank * g.shape[0]:(rank + 1) * g.shape[0]] = g
        shares[name] = share
    return (_to_rows(dq, group, layout), _kv_heads_grad(_to_rows(dk, group, layout), hkv),
            _kv_heads_grad(_to_rows(dv, group, layout), hkv), shares)


# ---------------------------------------------------------------- calls
# What qkv._collective's autograd Function runs for each method.


class _RingCall:
    def __init__(self, o, group, layout):
        self.o, self.group, self.layout = o, group, layout
        self.rank = dist.get_rank(group)

    def forward(self, q, k, v):
        out, lse = _ring_forward(q, k, v, self.o, self.group, self.layout)
        return out, lse, (q, k, v, out, lse)

    def backward(self, saved, dout, wanted):
        q, k, v, out, lse = saved
        dq, dk, dv, shares = _ring_backward(q, k, v, out, dout, lse, self.o, self.group,
                                            self.layout)
        if "d_sinks" in wanted:
            shares["d_sinks"] = _sink_gradients(q, k, v, out, dout, lse, self.o, self.group,
                                                self.layout)
        return dq, dk, dv, shares


class _UlyssesCall:
    def __init__(self, o, group, layout):
        self.o, self.group, self.layout = o, group, layout
        self.rank = dist.get_rank(group)
        self.hkv = 0  # the KV heads of this rank's k, set by the forward

    def forward(self, q, k, v):
        self.hkv = k.shape[2]
        saved, out, lse = _ulysses_forward(q, k, v, self.o, self.group, self.layout)
        out, lse = _ulysses_rows(out, lse, self.group, self.layout)
        return out, lse, saved

    def backward(self, saved, dout, wanted):
        return _ulysses_backward(saved, dout, self.o, self.group, self.layout, self.hkv)


def _attend(method, kind, q, k, v, group, layout, return_lse, options):
    o = _prepare(q, k, v, group, layout, kind, options)
    out, lse = _collective.attend(method(o, group, layout), q, k, v, options)
    return AttentionResult(out, lse, None) if return_lse else out


def ring_attention(q, k, v, group=None, *, layout: str = "contiguous", return_lse: bool = False,
                   **options):
    """Ring attention over the process group (None: the default group), as
    qkv.distributed.ring_attention over MPI. Shapes, layouts and options in
    the module docstring. Returns out, or AttentionResult(out, lse, None)
    with return_lse."""
    return _attend(_RingCall, "ring_attention", q, k, v, group, layout, return_lse, options)


def ulysses_attention(q, k, v, group=None, *, layout: str = "contiguous",
                      return_lse: bool = False, **options):
    """All-to-all (Ulysses) attention over the process group (None: the
    default group). Shapes, layouts and options in the module docstring.
    Returns out, or AttentionResult(out, lse, None) with return_lse."""
    return _attend(_UlyssesCall, "ulysses_attention", q, k, v, group, layout, return_lse, options)

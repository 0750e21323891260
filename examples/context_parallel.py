"""Context parallelism on torch.distributed (qkv.context_parallel, gloo on
CPU), checked against one process.

    torchrun --nproc-per-node 2 examples/context_parallel.py [--bench N]

Every rank builds the whole problem from one seed (B = 1, 128 rows per
rank, Hkv = 2 key/value heads and Hq = 2 Hkv, or the rank count when
larger, D = 32), takes its shard, and checks, in float32 and bfloat16:

* causal ring attention (contiguous and zigzag layouts) and all-to-all
  (Ulysses) attention, forward and backward through torch autograd with
  loss = (out * dout).sum(): out, lse, dq, dk, dv against the same rows of
  one single-process qkv.attention call; then ring (zigzag) and Ulysses
  (contiguous) again with a window, a padded sequence (key_lengths), ALiBi,
  a softcap, dropout, learned sinks and a learned logit scale per head
  times ln of each row's keys (their gradients d_sinks and d_score_scale
  too), all of the whole problem. The error model
  (docs/distributed.md): the distance to the exact (float64) result is at
  most twice the single call's plus 4 R u max|exact| (u = 2^-24: the
  merges run in float32; R = 1 for the all-to-all);
* one training step of a small transformer (2 layers, causal) whose
  attention runs context-parallel: the loss and every parameter's gradient
  (summed over the ranks, as data parallelism would) against the same step
  in one process, with the same error model on the float64 step.

Rank 0 prints one line per check and "all N checks passed on R ranks"; the
exit status is 1 when a check fails. With --bench N it then times a causal
forward + backward at N total rows (Hq = Hkv = 8, D = 64, float32) on the
ranks against one process doing the whole sequence alone.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

import torch
import torch.distributed as dist
from torch import nn

import qkv
import qkv.context_parallel as cp
import qkv.flash_attn
from shard_checks import check, shard_rows, summary

ROWS, BATCH, HEAD_DIM, SEED = 128, 1, 32, 2024


def whole_options(hq: int, n_total: int) -> dict:
    """The position-based options of the whole problem that the "options"
    runs add to causal attention: a window, a padded sequence, ALiBi, a
    softcap, dropout (the same mask as one call), learned sinks and learned
    logit scales (Scalable-Softmax: times ln of each row's keys)."""
    g = torch.Generator().manual_seed(SEED + 1)
    return dict(window=(96, 0), key_lengths=[n_total - 37], alibi_slopes=qkv.alibi_slopes(hq),
                softcap=20.0, dropout_p=0.1, dropout_seed=7,
                sinks=torch.randn(hq, generator=g),
                score_scale=0.25 + 0.25 * torch.rand(hq, generator=g), score_scale_log_n=True)


LEARNED = ("sinks", "score_scale")  # the learned parameters among the options


def attention_checks(rank: int, ranks: int, dtype: torch.dtype) -> list:
    hkv = ranks * -(-2 // ranks)
    hq, n_total = 2 * hkv, ROWS * ranks
    g = torch.Generator().manual_seed(SEED)
    q, k, v, dout = (torch.randn(BATCH, n_total, h, HEAD_DIM, generator=g).to(dtype)
                     for h in (hq, hkv, hkv, hq))
    extra = whole_options(hq, n_total)

    def run(q, k, v, dout, backend, options):
        r = qkv.attention(q, k, v, causal=True, return_lse=True, backend=backend, **options)
        gr = qkv.attention_backward(q, k, v, r.out, dout, r.lse, causal=True, backend=backend,
                                    **options)
        return {"out": r.out, "lse": r.lse, "dq": gr.dq, "dk": gr.dk, "dv": gr.dv,
                **{"d_" + name: getattr(gr, "d_" + name) for name in LEARNED}}

    results = []
    for name, function, layout, options in (
            ("ring contiguous", cp.ring_attention, "contiguous", {}),
            ("ring zigzag", cp.ring_attention, "zigzag", {}),
            ("ulysses zigzag", cp.ulysses_attention, "zigzag", {}),
            ("ring zigzag options", cp.ring_attention, "zigzag", extra),
            ("ulysses contiguous options", cp.ulysses_attention, "contiguous", extra)):
        single = run(q, k, v, dout, "automatic", options)
        exact = run(q.double(), k.double(), v.double(), dout.double(), "reference", options)
        rows = shard_rows(layout, rank, ranks, ROWS)
        qs, ks, vs = (x[:, rows].clone().requires_grad_(True) for x in (q, k, v))
        mine = dict(options)
        for learned in LEARNED:
            if learned in options:
                mine[learned] = options[learned].clone().requires_grad_(True)
        r = function(qs, ks, vs, layout=layout, causal=True, return_lse=True, **mine)
        (r.out.float() * dout[:, rows].float()).sum().backward()
        got = {"out": r.out.detach(), "lse": r.lse, "dq": qs.grad, "dk": ks.grad, "dv": vs.grad}
        merges = ranks if name.startswith("ring") else 1
        for what, dim in (("out", 1), ("lse", 2), ("dq", 1), ("dk", 1), ("dv", 1)):
            results.append(check(f"{name} {str(dtype)[6:]} {what}", got[what],
                                 single[what].index_select(dim, rows),
                                 exact[what].index_select(dim, rows), merges))
        for learned in LEARNED:  # each rank's share, summed as data parallelism would
            if learned in options:
                grad = mine[learned].grad.clone()
                dist.all_reduce(grad)
                results.append(check(f"{name} {str(dtype)[6:]} d_{learned}", grad,
                                     single["d_" + learned], exact["d_" + learned], ranks))
    return results


class Layer(nn.Module):
    """A pre-LN causal transformer layer whose attention is `attend`."""

    def __init__(self, width: int = 64, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.ff = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                nn.Linear(4 * width, width))

    def forward(self, x, attend):
        b, n, e = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, e // self.heads).unbind(2)
        x = x + self.out(attend(q, k, v).reshape(b, n, e))
        return x + self.ff(self.norm2(x))


def training_checks(rank: int, ranks: int) -> list:
    """One step of a 2-layer model: context-parallel (ring, zigzag) against
    one process, loss and gradients."""
    torch.manual_seed(SEED)
    layers = nn.ModuleList(Layer() for _ in range(2))
    head = nn.Linear(64, 1)
    x = torch.randn(1, ROWS * ranks, 64)
    target = torch.randn(1, ROWS * ranks, 1)
    params = list(layers.parameters()) + list(head.parameters())

    def step(x, target, attend, dtype):  # mean squared error over all R n rows
        for p in params:
            p.grad = None
        h = x.to(dtype)
        for layer in layers.to(dtype):
            h = layer(h, attend)
        loss = ((head.to(dtype)(h) - target.to(dtype)) ** 2).sum() / (ROWS * ranks)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in params]

    full = lambda q, k, v: qkv.flash_attn.flash_attn_func(q, k, v, causal=True)  # noqa: E731
    exact = step(x, target, full, torch.float64)
    single = step(x, target, full, torch.float32)
    rows = shard_rows("zigzag", rank, ranks, ROWS)
    ring = lambda q, k, v: cp.ring_attention(q, k, v, layout="zigzag", causal=True)  # noqa: E731
    loss, grads = step(x[:, rows], target[:, rows], ring, torch.float32)
    dist.all_reduce(loss)
    for g in grads:
        dist.all_reduce(g)
    results = [check("training step loss", loss, single[0], exact[0], ranks)]
    per_parameter = [check("", g, s, e, ranks) for g, s, e in zip(grads, single[1], exact[1])]
    worst = max(range(len(params)), key=lambda i: per_parameter[i][1] /
                max(per_parameter[i][2], 1e-300))
    results.append((f"training step gradients (worst: parameter {worst})",
                    *per_parameter[worst][1:]))
    return results


def bench(n: int, rank: int, ranks: int) -> None:
    g = torch.Generator().manual_seed(SEED)
    q, k, v = (torch.randn(1, n // ranks, 8, 64, generator=g, requires_grad=True)
               for _ in range(3))
    lines = []
    for name, function in (("ring", cp.ring_attention), ("ulysses", cp.ulysses_attention)):
        dist.barrier()
        start = time.perf_counter()
        function(q, k, v, layout="zigzag", causal=True).sum().backward()
        dist.barrier()
        lines.append(f"{name}: {time.perf_counter() - start:.2f} s")
    if rank == 0:
        qf, kf, vf = (torch.randn(1, n, 8, 64, generator=g, requires_grad=True)
                      for _ in range(3))
        start = time.perf_counter()
        threads = torch.get_num_threads()
        torch.set_num_threads(threads * ranks)  # the cores the ranks use together
        qkv.flash_attn.flash_attn_func(qf, kf, vf, causal=True).sum().backward()
        torch.set_num_threads(threads)
        lines.append(f"one process: {time.perf_counter() - start:.2f} s")
        print(f"causal forward + backward, N = {n}, Hq = Hkv = 8, D = 64, float32, "
              f"{ranks} ranks of {torch.get_num_threads()} threads: " + ", ".join(lines))
    dist.barrier()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bench", type=int, default=0, metavar="N",
                        help="also time N total rows against one process")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        results += attention_checks(rank, ranks, dtype)
    results += training_checks(rank, ranks)
    everyone = [None] * ranks
    dist.all_gather_object(everyone, results)
    failed = sum(not ok for r in everyone for *_, ok in r)
    if rank == 0:
        print("\n".join(summary(everyone, ranks)))
    sys.stdout.flush()
    if args.bench and not failed:
        bench(args.bench, rank, ranks)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        status = main()
    except BaseException:  # one rank's exception must not leave the others waiting
        traceback.print_exc()
        sys.stderr.flush()
        sys.exit(2)
    sys.exit(status)

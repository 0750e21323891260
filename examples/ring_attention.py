"""Ring and all-to-all attention across MPI ranks (qkv.distributed), checked
against one process.

    mpiexec -n 2 python examples/ring_attention.py

Every rank builds the whole problem from one seed (torch, float32: B = 1,
256 rows per rank, Hkv = 2 KV heads, or the rank count when larger, so
that the heads divide over the ranks for the all-to-all; Hq = 2 Hkv, D =
32), takes its shard of q, k and v (the contiguous and the zigzag layout),
runs causal ring attention (both layouts) and all-to-all (Ulysses)
attention on it, then the backward through torch autograd with loss =
(out * dout).sum(), and compares out, lse, dq, dk and dv with the same rows
of one single-process qkv.attention call.

The error model (tests/dist/dist_test.cpp, docs/distributed.md): a
distributed result merges R partial results, each from one float32 call,
and every merge step rounds a few times, so its distance to the exact
(float64) result is at most twice the single call's plus 4 R u max|exact|,
u = 2^-24 (R = 1 for the all-to-all, whose every head is one call).

Rank 0 prints one line per check, the worst rank's numbers:

    ring contiguous out: max error 5.96e-08, bound 5.48e-07 (worst on rank 1 of 2): ok

then "all 15 checks passed on 2 ranks"; the exit status is 1 when a check
fails on any rank.
"""

from __future__ import annotations

import sys
import traceback

import torch
from mpi4py import MPI

import qkv
import qkv.distributed
from shard_checks import check, shard_rows, summary

ROWS, BATCH, HEAD_DIM, SEED = 256, 1, 32, 2024


class Reference:
    """The whole problem's single-process results: float32 (`single`) and
    float64 on the reference backend (`exact`), forward and gradients."""

    def __init__(self, q, k, v, dout):
        self.single = self._run(q, k, v, dout, "automatic")
        self.exact = self._run(q.double(), k.double(), v.double(), dout.double(), "reference")

    @staticmethod
    def _run(q, k, v, dout, backend):
        r = qkv.attention(q, k, v, causal=True, return_lse=True, backend=backend)
        g = qkv.attention_backward(q, k, v, r.out, dout, r.lse, causal=True, backend=backend)
        return {"out": r.out, "lse": r.lse, "dq": g.dq, "dk": g.dk, "dv": g.dv}


def main() -> int:
    comm = MPI.COMM_WORLD
    rank, ranks = comm.Get_rank(), comm.Get_size()
    hkv = ranks * -(-2 // ranks)  # 2, or the smallest multiple of the rank count above it
    hq = 2 * hkv
    n_total = ROWS * ranks
    g = torch.Generator().manual_seed(SEED)
    q = torch.randn(BATCH, n_total, hq, HEAD_DIM, generator=g)
    k = torch.randn(BATCH, n_total, hkv, HEAD_DIM, generator=g)
    v = torch.randn(BATCH, n_total, hkv, HEAD_DIM, generator=g)
    dout = torch.randn(BATCH, n_total, hq, HEAD_DIM, generator=g)
    ref = Reference(q, k, v, dout)

    results = []  # (name, error, bound, ok) on this rank
    runs = [("ring contiguous", "contiguous"), ("ring zigzag", "zigzag"),
            ("ulysses", "contiguous")]
    for name, layout in runs:
        rows = shard_rows(layout, rank, ranks, ROWS)
        qs, ks, vs = (x[:, rows].clone().requires_grad_(True) for x in (q, k, v))
        if name.startswith("ring"):
            r = qkv.distributed.ring_attention(qs, ks, vs, comm, layout=layout, causal=True,
                                               return_lse=True)
            merges = ranks
        else:
            r = qkv.distributed.ulysses_attention(qs, ks, vs, comm, causal=True, return_lse=True)
            merges = 1
        (r.out * dout[:, rows]).sum().backward()
        got = {"out": r.out.detach(), "lse": r.lse, "dq": qs.grad, "dk": ks.grad, "dv": vs.grad}
        for what, dim in (("out", 1), ("lse", 2), ("dq", 1), ("dk", 1), ("dv", 1)):
            single = ref.single[what].index_select(dim, rows)
            exact = ref.exact[what].index_select(dim, rows)
            results.append(check(f"{name} {what}", got[what], single, exact, merges))

    everyone = comm.gather(results, root=0)
    failed = comm.allreduce(sum(not ok for *_, ok in results), op=MPI.SUM)
    if rank == 0:
        print("\n".join(summary(everyone, ranks)))
    sys.stdout.flush()
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        status = main()
    except BaseException:  # one rank's exception must not leave the others waiting
        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
    sys.exit(status)

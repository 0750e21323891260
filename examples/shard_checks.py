"""What examples/ring_attention.py (MPI) and examples/context_parallel.py
(torch.distributed) share: which rows a rank holds, and the checks of a
distributed result against one process with the error model of
docs/distributed.md."""

from __future__ import annotations

import torch

U = 2.0**-24  # float32's unit roundoff: the merges run in float32


def shard_rows(layout: str, rank: int, ranks: int, n: int) -> torch.Tensor:
    """The global rows `rank` holds, in shard order (from the layouts'
    definition in qkv/distributed.hpp)."""
    if layout == "contiguous":
        return torch.arange(rank * n, (rank + 1) * n)
    c = n // 2  # 2R chunks of n / 2 rows: rank r holds chunks r and 2R - 1 - r
    return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                      torch.arange((2 * ranks - 1 - rank) * c, (2 * ranks - rank) * c)])


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    d = (a.double() - b.double()).abs()
    return float(torch.nan_to_num(d, nan=float("inf")).max())


def max_finite(a: torch.Tensor) -> float:
    a = a.double().abs()
    return float(a[torch.isfinite(a)].max())


def check(name: str, got, single, exact, merges: int) -> tuple:
    """(name, error, bound, ok): the distance of `got` to the exact result
    is at most twice the single call's plus 4 merges u max|exact|."""
    bound = 2 * max_diff(single, exact) + 4 * merges * U * max_finite(exact)
    error = max_diff(got, exact)
    return (name, error, bound, error <= bound)


def summary(everyone: list, ranks: int) -> list:
    """Rank 0's lines: per check the worst rank's numbers, then the verdict.
    everyone: each rank's list of check() tuples, in rank order."""
    lines = []
    for i, (name, *_) in enumerate(everyone[0]):
        per_rank = [(r[i][1] / r[i][2] if r[i][2] > 0 else float("inf"), j, r[i])
                    for j, r in enumerate(everyone)]
        _, worst, (_, error, bound, _) = max(per_rank, key=lambda t: t[0])
        ok = all(r[i][3] for r in everyone)
        lines.append(f"{name}: max error {error:.3g}, bound {bound:.3g} "
                     f"(worst on rank {worst} of {ranks}): {'ok' if ok else 'FAIL'}")
    failed = sum(not r[i][3] for r in everyone for i in range(len(r)))
    lines.append(f"{failed} check(s) failed on {ranks} rank(s)" if failed else
                 f"all {len(everyone[0])} checks passed on {ranks} rank{'s' if ranks > 1 else ''}")
    return lines

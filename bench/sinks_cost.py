"""The cost of learned attention sinks in the forward: qkv.attention with
and without `sinks`, calls alternating, on the same inputs.

    .venv/bin/python bench/sinks_cost.py [--n 2048] [--d 128] [--heads 16] [--rounds 7]

Prints one line per (dtype, mask): the median time of each and their
ratio (with / without), and the range of the per-round ratios."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import qkv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    sinks = torch.randn(a.heads, generator=g)
    print(f"n={a.n} d={a.d} heads={a.heads} threads={qkv.get_num_threads()}")
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(1, a.n, a.heads, a.d, generator=g).to(dtype) for _ in range(3))
        for causal in (False, True):
            times = {False: [], True: []}
            for _ in range(a.rounds):
                for with_sinks in (False, True):
                    extra = {"sinks": sinks} if with_sinks else {}
                    start = time.perf_counter()
                    qkv.attention(q, k, v, causal=causal, **extra)
                    times[with_sinks].append(time.perf_counter() - start)
            ratios = [s / p for p, s in zip(times[False], times[True])]
            plain, sunk = statistics.median(times[False]), statistics.median(times[True])
            print(f"{str(dtype).removeprefix('torch.'):9s} {'causal' if causal else 'full':6s} "
                  f"without {plain * 1e3:8.2f} ms  with {sunk * 1e3:8.2f} ms  "
                  f"ratio {sunk / plain:.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()

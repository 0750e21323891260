#!/usr/bin/env python3
"""Per-call time of qkv's Python entry points on a small shape, against PyTorch's SDPA.

On a shape small enough that the kernel takes a few microseconds (default
B=1, H=8, N=16, D=64, float32, no mask), the time of one call is mostly what
Python, the argument checks and the dispatch cost. Timed, each on the same
values:

  torch_sdpa           torch.nn.functional.scaled_dot_product_attention(q, k, v)
                       on [B, H, N, D] tensors
  torch_sdpa_causal    the same with is_causal=True
  torch_sdpa_grad      the same (not causal) with inputs that require grad
                       (autograd records the graph; no backward runs)
  torch_sdpa_compiled  torch.compile(fullgraph=True) of a function calling it
  qkv_native           the native function under qkv.torch's fast path,
                       _qkv.sdpa_exchange, on the same [B, H, N, D] tensors:
                       it reads them and allocates the output through DLPack's
                       C exchange API, then runs the C++ call
  qkv_torch            qkv.torch.scaled_dot_product_attention(q, k, v) on
                       [B, H, N, D]: the drop-in (its fast path)
  qkv_torch_causal     the same with is_causal=True
  qkv_torch_grad       the same (not causal) with inputs that require grad
                       (its torch.autograd.Function)
  qkv_torch_compiled   torch.compile(fullgraph=True) of a function calling it
                       (the registered op torch.ops.qkv.attention)
  qkv_attention        qkv.attention(q, k, v) on [B, N, H, D] tensors: qkv's
                       own API
  qkv_op               qkv._ops.attention(q, k, v) on [B, N, H, D]: the call of
                       the registered op torch.ops.qkv.attention, which
                       torch.compile and float masks that require grad use
  empty                a function that returns None: the cost of the timing
                       loop itself, included in every other line

Each call is timed alone with time.perf_counter_ns. The implementations take
turns in --rounds rounds of --calls calls each (the order rotates from one
round to the next), so a change of machine speed during the run hits all of
them alike; every implementation first runs --warmup calls (torch.compile
compiles there). Reported per implementation, over all rounds * calls calls:
the minimum and the median in microseconds, the median's ratio to
torch_sdpa's (torch_sdpa_causal's for the _causal lines, torch_sdpa_grad's
for the _grad lines, torch_sdpa_compiled's for the _compiled lines, in the
last column), and the spread of the per-round medians. Then the differences
of medians that isolate the costs: the drop-in's Python (qkv_torch -
qkv_native), autograd recording (qkv_torch_grad - qkv_torch), the registered
op's dispatch (qkv_op - qkv_attention).

--backend picks torch.compile's backend: inductor (the default; it needs a
C++ compiler) or aot_eager; "auto" tries inductor and falls back to
aot_eager. The backend used is printed. Threads: torch's default (qkv
follows torch.get_num_threads()); --threads N calls torch.set_num_threads(N)
and qkv.set_num_threads(N) first. Calling torch.set_num_threads, even with
the count torch already uses, makes torch's own small SDPA call slower on
some machines (on the 2-core test VM: 13 us -> 24 us), so compare within
one setting.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable

BACKENDS = ("inductor", "aot_eager", "auto")
# Each line's reference for the ratio column.
REFERENCE = {"_causal": "torch_sdpa_causal", "_grad": "torch_sdpa_grad",
             "_compiled": "torch_sdpa_compiled"}


def reference_of(name: str) -> str:
    for suffix, ref in REFERENCE.items():
        if name.endswith(suffix):
            return ref
    return "torch_sdpa"


def compile_fn(torch: Any, fn: Callable, backend: str, args: tuple) -> tuple[Callable, str]:
    """torch.compile(fn, fullgraph=True) on `backend`, called once on args (it compiles
    there); with "auto", inductor if that compiles and runs, else aot_eager."""
    for name in ("inductor", "aot_eager") if backend == "auto" else (backend,):
        compiled = torch.compile(fn, fullgraph=True, backend=name)
        try:
            compiled(*args)
        except Exception as e:  # inductor without a working C++ compiler, for one
            if backend != "auto" or name == "aot_eager":
                raise
            print(f"python_overhead: torch.compile backend {name} failed ({type(e).__name__}:"
                  f" {e}); using aot_eager", file=sys.stderr)
            continue
        return compiled, name
    raise AssertionError("unreachable")


def make_impls(torch: Any, qkv: Any, b: int, h: int, n: int, d: int,
               backend: str) -> tuple[dict[str, Callable[[], Any]], str]:
    """The implementations to time, as argument-free callables, and the compile backend."""
    from qkv import _ops, _qkv
    from qkv.torch import scaled_dot_product_attention as qkv_sdpa

    sdpa = torch.nn.functional.scaled_dot_product_attention
    gen = torch.Generator().manual_seed(20240501)
    # [B, N, H, D] tensors (qkv's layout) and contiguous [B, H, N, D] copies (PyTorch's).
    q, k, v = ((torch.rand(b, n, h, d, generator=gen) * 2 - 1) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    qg, kg, vg = (x.clone().requires_grad_() for x in (qt, kt, vt))

    want = sdpa(qt, kt, vt)
    want_causal = sdpa(qt, kt, vt, is_causal=True)
    outputs = (qkv.attention(q, k, v).transpose(1, 2), _ops.attention(q, k, v)[0].transpose(1, 2),
               qkv_sdpa(qt, kt, vt), qkv_sdpa(qg, kg, vg).detach())
    for got in outputs:
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    got = qkv_sdpa(qt, kt, vt, is_causal=True)
    assert torch.allclose(got, want_causal, atol=1e-5), (got - want_causal).abs().max()

    def torch_fn(a: Any, b_: Any, c: Any) -> Any:
        return sdpa(a, b_, c)

    def qkv_fn(a: Any, b_: Any, c: Any) -> Any:
        return qkv_sdpa(a, b_, c)

    torch_compiled, used = compile_fn(torch, torch_fn, backend, (qt, kt, vt))
    qkv_compiled, used_qkv = compile_fn(torch, qkv_fn, used, (qt, kt, vt))
    assert used == used_qkv
    got = qkv_compiled(qt, kt, vt)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()

    threads = qkv.get_num_threads()
    native = _qkv.sdpa_exchange
    assert torch.equal(native(qt, kt, vt, None, None, False, False, 0.0, 0, threads, False),
                       qkv_sdpa(qt, kt, vt))

    impls = {
        "empty": lambda: None,
        "torch_sdpa": lambda: sdpa(qt, kt, vt),
        "torch_sdpa_causal": lambda: sdpa(qt, kt, vt, is_causal=True),
        "torch_sdpa_grad": lambda: sdpa(qg, kg, vg),
        "torch_sdpa_compiled": lambda: torch_compiled(qt, kt, vt),
        "qkv_native": lambda: native(qt, kt, vt, None, None, False, False, 0.0, 0, threads,
                                     False),
        "qkv_torch": lambda: qkv_sdpa(qt, kt, vt),
        "qkv_torch_causal": lambda: qkv_sdpa(qt, kt, vt, is_causal=True),
        "qkv_torch_grad": lambda: qkv_sdpa(qg, kg, vg),
        "qkv_torch_compiled": lambda: qkv_compiled(qt, kt, vt),
        "qkv_attention": lambda: qkv.attention(q, k, v),
        "qkv_op": lambda: _ops.attention(q, k, v),
    }
    return impls, used


def time_calls(fn: Callable[[], Any], calls: int, out: list[int]) -> None:
    """Appends the nanoseconds of `calls` single calls of fn() to out."""
    clock = time.perf_counter_ns
    for _ in range(calls):
        start = clock()
        fn()
        out.append(clock() - start)


def measure(impls: dict[str, Callable[[], Any]], rounds: int, calls: int,
            warmup: int) -> dict[str, list[list[int]]]:
    """Per implementation, per round, the nanoseconds of each call; the implementations
    take turns within each round, starting one later each round."""
    for fn in impls.values():
        time_calls(fn, warmup, [])
    names = list(impls)
    samples: dict[str, list[list[int]]] = {name: [] for name in names}
    for r in range(rounds):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            times: list[int] = []
            time_calls(impls[name], calls, times)
            samples[name].append(times)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1, help="B (default: 1)")
    parser.add_argument("--heads", type=int, default=8, help="H (default: 8)")
    parser.add_argument("--seq", type=int, default=16, help="N, queries and keys (default: 16)")
    parser.add_argument("--dim", type=int, default=64, help="D (default: 64)")
    parser.add_argument("--rounds", type=int, default=10, help="rounds (default: 10)")
    parser.add_argument("--calls", type=int, default=1000,
                        help="timed calls per implementation and round (default: 1000)")
    parser.add_argument("--warmup", type=int, default=1000,
                        help="untimed calls per implementation first (default: 1000)")
    parser.add_argument("--threads", type=int, default=None,
                        help="set this many threads for both qkv and torch (default: torch's "
                        "default, untouched)")
    parser.add_argument("--backend", choices=BACKENDS, default="inductor",
                        help="torch.compile backend (default: inductor)")
    parser.add_argument("--json", action="store_true", help="one JSON object per implementation")
    args = parser.parse_args()
    if min(args.batch, args.heads, args.seq, args.dim, args.rounds, args.calls,
           1 if args.threads is None else args.threads) < 1 or args.warmup < 0:
        parser.error("sizes, --rounds, --calls and --threads must be positive")

    try:
        import torch

        import qkv
    except ImportError as e:
        sys.exit(f"python_overhead: needs torch and qkv's package ({e}): "
                 "python3 -m pip install -r bench/requirements.txt && python3 -m pip install -e .")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
        qkv.set_num_threads(args.threads)
    threads = f"{torch.get_num_threads()} threads" + (
        " (set)" if args.threads is not None else " (torch's default)")
    impls, backend = make_impls(torch, qkv, args.batch, args.heads, args.seq, args.dim,
                                args.backend)
    samples = measure(impls, args.rounds, args.calls, args.warmup)

    stats: dict[str, dict[str, float]] = {}
    for name, per_round in samples.items():
        every = [t for times in per_round for t in times]
        round_medians = [statistics.median(times) / 1e3 for times in per_round]
        stats[name] = {"min_us": min(every) / 1e3, "median_us": statistics.median(every) / 1e3,
                       "round_median_min_us": min(round_medians),
                       "round_median_max_us": max(round_medians)}
    for name, s in stats.items():
        s["ratio_to_torch_sdpa"] = s["median_us"] / stats["torch_sdpa"]["median_us"]
        s["ratio_to_reference"] = s["median_us"] / stats[reference_of(name)]["median_us"]
    med = {name: s["median_us"] for name, s in stats.items()}
    costs = {
        "drop_in_python_us": med["qkv_torch"] - med["qkv_native"],
        "autograd_recording_us": med["qkv_torch_grad"] - med["qkv_torch"],
        "op_dispatch_us": med["qkv_op"] - med["qkv_attention"],
    }
    shape = f"B={args.batch} H={args.heads} N={args.seq} D={args.dim} float32"
    if args.json:
        common = {"shape": [args.batch, args.heads, args.seq, args.dim],
                  "threads": torch.get_num_threads(), "threads_set": args.threads is not None,
                  "rounds": args.rounds, "calls": args.calls, "compile_backend": backend,
                  "torch_version": torch.__version__}
        for name, s in stats.items():
            print(json.dumps({"name": name} | s | common))
        print(json.dumps({"name": "differences"} | costs | common))
        return
    print(f"torch {torch.__version__}, qkv {qkv.__version__}, {shape}, {threads}, "
          f"{args.rounds} rounds x {args.calls} calls, torch.compile backend {backend}")
    width = max(len(name) for name in stats)
    print(f"{'name':<{width}}  {'min us':>8}  {'median us':>9}  {'/ torch_sdpa':>12}  "
          f"{'/ reference':>11}  round medians us")
    for name, s in stats.items():
        ref = reference_of(name)
        ratio = f"{s['ratio_to_reference']:10.2f}x" if ref != "torch_sdpa" else f"{'':>11}"
        print(f"{name:<{width}}  {s['min_us']:8.2f}  {s['median_us']:9.2f}  "
              f"{s['ratio_to_torch_sdpa']:11.2f}x  {ratio}  "
              f"{s['round_median_min_us']:.2f} .. {s['round_median_max_us']:.2f}")
    print("differences of medians (us):")
    print(f"  qkv.torch's own Python  qkv_torch - qkv_native       "
          f"{costs['drop_in_python_us']:8.2f}")
    print(f"  autograd recording      qkv_torch_grad - qkv_torch   "
          f"{costs['autograd_recording_us']:8.2f}")
    print(f"  registered op dispatch  qkv_op - qkv_attention       "
          f"{costs['op_dispatch_us']:8.2f}")

if __name__ == "__main__":
    main()

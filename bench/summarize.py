#!/usr/bin/env python3
"""Markdown tables from `qkv bench --json` output (files, or stdin).

One row per case: qkv and naive side by side, GFLOP/s, fraction of the FMA
peak probed around the case in the same run, and extra resident memory. Output of
`--suite all` gives one table per suite (forward, backward, decode), each
under its own heading; backward GFLOP/s count 2.5 times the forward's flops.

Decode rows (one new query per sequence against a KV cache) get their own
columns: milliseconds per step, GB/s of cached keys and values read, that
the read bandwidth probed around the case (`qkv bench` probes again after a
case once 2 s have passed and reads it against the larger of the probes
before and after it), that rate as a fraction of it, and tokens per
second. Output of `bench/compare_torch.py --json` among the inputs adds
PyTorch's time and the speedup (torch / qkv, both from that script's own run)
to the decode rows of the same names.

    build/release/qkv bench --json > forward.jsonl
    python3 bench/summarize.py forward.jsonl
    build/release/qkv bench --suite backward --json > backward.jsonl
    python3 bench/summarize.py backward.jsonl
    build/release/qkv bench --suite decode --json > decode.jsonl
    python3 bench/compare_torch.py --suite decode --json > decode_torch.jsonl
    python3 bench/summarize.py decode.jsonl decode_torch.jsonl
"""

from __future__ import annotations

import json
import sys
from typing import Any, Iterable

HEADER = ("| case | qkv ms | qkv GFLOP/s | qkv % peak | naive ms | naive % peak | qkv / naive "
          "| qkv extra MB | naive extra MB |")
ALIGN = "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
DECODE_HEADER = ("| case | cache | ms | GB/s | probe GB/s | % of bandwidth | best run, % "
                 "| tokens/s | extra MB |")
DECODE_ALIGN = "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
TORCH_HEADER = " torch ms | speedup vs torch |"
TORCH_ALIGN = " ---: | ---: |"


def row(name: str, impls: dict[str, dict[str, Any]]) -> str:
    """One table row from a case's records by impl; empty cells for a missing impl."""
    q, n = impls.get("qkv"), impls.get("naive")
    cells = [name]
    if q:
        cells += [f"{q['seconds'] * 1e3:.1f}", f"{q['gflops']:.1f}",
                  f"{100 * q['fraction_of_peak']:.1f}"]
    else:
        cells += ["", "", ""]
    cells += [f"{n['seconds'] * 1e3:.1f}", f"{100 * n['fraction_of_peak']:.1f}"] if n else ["", ""]
    cells.append(f"{n['seconds'] / q['seconds']:.2f}x" if q and n else "")
    cells.append(f"{q['extra_bytes'] / 2**20:.1f}" if q else "")
    cells.append(f"{n['extra_bytes'] / 2**20:.1f}" if n else "")
    return "| " + " | ".join(cells) + " |"


def decode_row(name: str, q: dict[str, Any], torch: dict[str, Any] | None,
               with_torch: bool) -> str:
    """One decode table row; the torch cells (empty without a comparison) if with_torch."""
    cells = [name, q["cache_dtype"], f"{q['seconds'] * 1e3:.2f}",
             f"{q['bytes_per_second'] / 1e9:.2f}", f"{q['probe_bytes_per_second'] / 1e9:.1f}",
             f"{100 * q['fraction_of_bandwidth']:.1f}",
             f"{100 * q['best_fraction_of_bandwidth']:.1f}" if "best_fraction_of_bandwidth" in q
             else "",
             f"{q['tokens_per_second']:.1f}", f"{q['extra_bytes'] / 2**20:.1f}"]
    if with_torch:
        cells += ([f"{torch['torch_seconds'] * 1e3:.2f}", f"{torch['speedup']:.2f}x"]
                  if torch else ["", ""])
    return "| " + " | ".join(cells) + " |"


def lines_of(paths: list[str]) -> Iterable[str]:
    if not paths:
        yield from sys.stdin
    for path in paths:
        with open(path) as source:
            yield from source


def main() -> None:
    # suite -> case name -> impl -> record, in the order of the input.
    suites: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    torch: dict[str, dict[str, Any]] = {}  # compare_torch.py records by case name
    probe = None
    for line in lines_of(sys.argv[1:]):
        line = line.strip()
        if not line.startswith("{"):
            continue
        record = json.loads(line)
        if "torch_seconds" in record:
            torch[record["name"]] = record
        elif record.get("suite") == "probe":
            probe = record
        else:
            suites.setdefault(record["suite"], {}).setdefault(record["name"], {})[
                record["impl"]] = record
    if probe:
        text = f"At the start: FMA peak {probe['peak_gflops']:.1f} GFLOP/s"
        if "probe_bytes_per_second" in probe:
            text += (f", read bandwidth {probe['probe_bytes_per_second'] / 1e9:.1f} GB/s"
                     f" ({probe['probe_buffer_bytes'] / 2**20:.0f} MiB buffer)")
            if probe.get("probe_widen_bytes_per_second"):
                text += (f", {probe['probe_widen_bytes_per_second'] / 1e9:.1f} GB/s widening"
                         " f16 with 4 FMAs per value")
        print(f"{text} on {probe['threads']} threads\n")
    for index, (suite, cases) in enumerate(suites.items()):
        if index > 0:
            print()
        if len(suites) > 1:
            print(f"### {suite.capitalize()}\n")
        if suite == "decode":
            with_torch = any(name in torch for name in cases)
            print(DECODE_HEADER + (TORCH_HEADER if with_torch else ""))
            print(DECODE_ALIGN + (TORCH_ALIGN if with_torch else ""))
            for name, impls in cases.items():
                print(decode_row(name, impls["qkv"], torch.get(name), with_torch))
            continue
        print(HEADER)
        print(ALIGN)
        for name, impls in cases.items():
            print(row(name, impls))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Markdown tables from `qkv bench --json` output (stdin or a file).

One row per case: qkv and naive side by side, GFLOP/s, fraction of the FMA
peak measured in the same run, and extra resident memory. Output of
`--suite all` gives one table per suite (forward, then backward), each under
its own heading; backward GFLOP/s count 2.5 times the forward's flops.

    build/release/qkv bench --json > forward.jsonl
    python3 bench/summarize.py forward.jsonl
    build/release/qkv bench --suite backward --json > backward.jsonl
    python3 bench/summarize.py backward.jsonl
"""

from __future__ import annotations

import json
import sys
from typing import Any

HEADER = ("| case | qkv ms | qkv GFLOP/s | qkv % peak | naive ms | naive % peak | qkv / naive "
          "| qkv extra MB | naive extra MB |")
ALIGN = "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"


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


def main() -> None:
    source = open(sys.argv[1]) if len(sys.argv) > 1 else sys.stdin
    # suite -> case name -> impl -> record, in the order of the input.
    suites: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    probe = None
    for line in source:
        line = line.strip()
        if not line.startswith("{"):
            continue
        record = json.loads(line)
        if record.get("suite") == "probe":
            probe = record
            continue
        suites.setdefault(record["suite"], {}).setdefault(record["name"], {})[record["impl"]] = record
    if probe:
        print(f"FMA peak {probe['peak_gflops']:.1f} GFLOP/s on {probe['threads']} threads\n")
    for index, (suite, cases) in enumerate(suites.items()):
        if index > 0:
            print()
        if len(suites) > 1:
            print(f"### {suite.capitalize()}\n")
        print(HEADER)
        print(ALIGN)
        for name, impls in cases.items():
            print(row(name, impls))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Markdown tables from `qkv bench --json` output (stdin or a file).

One row per case: qkv and naive side by side, GFLOP/s, fraction of the FMA
peak measured in the same run, and extra resident memory.

    build/release/qkv bench --json > forward.jsonl
    python3 bench/summarize.py forward.jsonl
"""

from __future__ import annotations

import json
import sys
from collections import OrderedDict


def main() -> None:
    source = open(sys.argv[1]) if len(sys.argv) > 1 else sys.stdin
    cases: OrderedDict[str, dict[str, dict]] = OrderedDict()
    probe = None
    for line in source:
        line = line.strip()
        if not line.startswith("{"):
            continue
        record = json.loads(line)
        if record.get("suite") == "probe":
            probe = record
            continue
        cases.setdefault(record["name"], {})[record["impl"]] = record
    if probe:
        print(f"FMA peak {probe['peak_gflops']:.1f} GFLOP/s on {probe['threads']} threads\n")
    print("| case | qkv ms | qkv GFLOP/s | qkv % peak | naive ms | naive % peak | qkv / naive | qkv extra MB | naive extra MB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, impls in cases.items():
        q, n = impls.get("qkv"), impls.get("naive")
        cells = [name]
        cells += [f"{q['seconds'] * 1e3:.1f}", f"{q['gflops']:.1f}", f"{100 * q['fraction_of_peak']:.1f}"] if q else ["", "", ""]
        cells += [f"{n['seconds'] * 1e3:.1f}", f"{100 * n['fraction_of_peak']:.1f}"] if n else ["", ""]
        cells.append(f"{n['seconds'] / q['seconds']:.2f}x" if q and n else "")
        cells.append(f"{q['extra_bytes'] / 2**20:.1f}" if q else "")
        cells.append(f"{n['extra_bytes'] / 2**20:.1f}" if n else "")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

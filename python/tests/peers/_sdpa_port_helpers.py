"""Shared pieces of the port of PyTorch's SDPA tests (test_sdpa_port.py).

What the original (PyTorch's test/test_transformers.py, BSD-3-Clause, Copyright (c) Meta
Platforms, Inc. and affiliates; see README.md in this folder) takes from its own helpers and
from torch.testing._internal, re-done here without expecttest (which common_utils imports and
this environment lacks): the implementation switch, the deterministic sampling of the
parameter grids, the original's tensor makers and tolerance formulas, TestCase.assertEqual's
comparison and the testing gradcheck's defaults.

Environment:
  QKV_PEER_IMPL=qkv|torch  the function under test: qkv.torch.scaled_dot_product_attention
                           (default) or torch.nn.functional.scaled_dot_product_attention;
  QKV_PEER_FULL=1          run every combination of every grid;
  QKV_PEER_SAMPLES=N       draw N combinations per sampled grid (default: per grid);
  QKV_PEER_SEED=S          draw another sample (default 0).
The last three are the names the FlashAttention port in this folder reads too.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import random
from collections import namedtuple
from typing import Callable, Dict, List, Optional, Sequence

import pytest
import torch
import torch.nn.functional as F
from torch.testing._utils import freeze_rng_state, wrapper_set_seed  # noqa: F401 (re-export)

IMPL = os.environ.get("QKV_PEER_IMPL", "qkv").strip().lower() or "qkv"
if IMPL not in ("qkv", "torch"):
    raise RuntimeError(f"QKV_PEER_IMPL must be 'qkv' or 'torch', got {IMPL!r}")
FULL = os.environ.get("QKV_PEER_FULL", "") not in ("", "0")
SAMPLES = int(os.environ["QKV_PEER_SAMPLES"]) if os.environ.get("QKV_PEER_SAMPLES") else None
SEED = int(os.environ.get("QKV_PEER_SEED", "0"))

if IMPL == "torch":
    sdpa = F.scaled_dot_product_attention
else:
    from qkv.torch import scaled_dot_product_attention as sdpa  # noqa: F401

# Whether dropout draws from torch's RNG stream the way torch's own kernels do, so that a
# reference built with torch.nn.functional.dropout under the same RNG state keeps the same
# weights. qkv draws only a seed from torch's generator and keeps other weights.
SAME_DROPOUT_STREAM = IMPL == "torch"

SdpaShape = namedtuple("Sdpa_Shape", ["batch", "num_heads", "seq_len", "head_dim"])
Tolerances = namedtuple("Tolerances", ["atol", "rtol"])

# torch/testing/_comparison.py's defaults, as the original lists them.
default_atol = {torch.float16: 1e-3, torch.bfloat16: 1e-3, torch.float32: 1e-5}
default_rtol = {torch.float16: 1e-3, torch.bfloat16: 1.6e-2, torch.float32: 1.3e-6}


# --------------------------------------------------------------------------------------------
# Known expectations that torch 2.15 itself does not meet
#
# test name (as in test_sdpa_port.py, without the parameter id) -> id -> (reason, how qkv
# fails it). The id "*" covers every parametrization. When QKV_PEER_IMPL=torch the entry is
# an xfail(strict=True). When it is qkv: xfail(strict=True) where qkv fails the same way
# (qkv_same=True), else skip with the reason. Filled from runs against torch 2.15; see
# README.md.

KNOWN_TORCH_FAILURES: Dict[str, Dict[str, tuple]] = {}


def _known(test: str, ident: str):
    table = KNOWN_TORCH_FAILURES.get(test, {})
    entry = table.get(ident) or table.get("*")
    if entry is None:
        return []
    reason, qkv_same = entry
    reason = f"torch 2.15 fails this expectation itself: {reason}"
    if IMPL == "torch" or qkv_same:
        return [pytest.mark.xfail(strict=True, reason=reason)]
    return [pytest.mark.skip(reason=reason)]


def known(fn):
    """Decorator for a test without parameters: its marks in KNOWN_TORCH_FAILURES."""
    for mark in _known(fn.__name__, "*"):
        fn = mark(fn)
    return fn


# --------------------------------------------------------------------------------------------
# Sampling of the parameter grids
#
# A grid is the cartesian product of the original's @parametrize lists. Grids too big to run
# whole on a 2-core CPU are sampled deterministically:
#   1. enumerate the product in the original's order, dropping what `keep` rejects;
#   2. key every combination by log(u) / w (weighted sampling without replacement), u from
#      random.Random(f"{test}:{QKV_PEER_SEED}"), w = cost ** -0.5, so cheap combinations come
#      first more often;
#   3. take, for every value of every parameter not yet drawn, the best-keyed combination
#      that has it (every value is covered);
#   4. fill up with the best keys to the grid's count.
# The draw depends only on the grid, the test name and QKV_PEER_SEED.


def _id_part(name: str, value) -> str:
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    if isinstance(value, bool):
        return f"{name}={'T' if value else 'F'}"
    if isinstance(value, (list, tuple)):
        return f"{name}=" + "x".join(str(x) for x in value)
    if hasattr(value, "name") and not isinstance(value, str):  # enums
        return f"{name}={value.name}"
    return f"{name}={value}"


def grid(
    test: str,
    axes: Dict[str, Sequence],
    count: Optional[int] = None,
    *,
    keep: Optional[Callable[[dict], bool]] = None,
    cost: Optional[Callable[[dict], float]] = None,
) -> List:
    """pytest.params of the product of `axes` (every combination when `count` is None or
    QKV_PEER_FULL is set, else a sample as above), with ids naming every parameter and the
    marks of KNOWN_TORCH_FAILURES."""
    names = list(axes)
    columns = [list(axes[n]) for n in names]
    combos = [
        idx
        for idx in itertools.product(*(range(len(c)) for c in columns))
        if keep is None or keep({n: c[i] for n, c, i in zip(names, columns, idx)})
    ]
    wanted = len(combos)
    if count is not None and not FULL:
        wanted = min(len(combos), SAMPLES if SAMPLES is not None else count)
    if wanted < len(combos):
        rng = random.Random(f"{test}:{SEED}")
        keys = []
        for idx in combos:
            params = {n: c[i] for n, c, i in zip(names, columns, idx)}
            weight = max(cost(params), 1e-9) ** -0.5 if cost is not None else 1.0
            keys.append(math.log(1.0 - rng.random()) / weight)
        order = sorted(range(len(combos)), key=lambda i: -keys[i])
        chosen, covered = set(), set()
        for axis, column in enumerate(columns):
            for value in range(len(column)):
                if (axis, value) in covered:
                    continue
                for i in order:
                    if combos[i][axis] == value:
                        chosen.add(i)
                        covered.update(enumerate(combos[i]))
                        break
        for i in order:
            if len(chosen) >= wanted:
                break
            chosen.add(i)
        picked = [combos[i] for i in sorted(chosen)]
    else:
        picked = combos
    result = []
    for idx in picked:
        values = [c[i] for c, i in zip(columns, idx)]
        ident = "-".join(_id_part(n, v) for n, v in zip(names, values))
        result.append(pytest.param(*values, id=ident, marks=_known(test, ident)))
    return result


# --------------------------------------------------------------------------------------------
# The original's helpers


def rand_sdpa_tensor(shape: SdpaShape, dtype: torch.dtype, requires_grad: bool = False,
                     packed: bool = False) -> torch.Tensor:
    """A dense random tensor in the original's layout: [batch, seq_len, num_heads, head_dim],
    or [batch, seq_len, 3 * num_heads * head_dim] for packed q, k, v (CPU only; the nested
    variant is not ported)."""
    if packed:
        size = (shape.batch, shape.seq_len, 3 * shape.num_heads * shape.head_dim)
    else:
        size = (shape.batch, shape.seq_len, shape.num_heads, shape.head_dim)
    return torch.randn(size, dtype=dtype, requires_grad=requires_grad)


def query_key_value_clones(query, key, value, dtype=None):
    """Detached copies, cast to `dtype`, requiring grad as the originals do."""
    dtype = query.dtype if dtype is None else dtype
    return tuple(t.detach().clone().to(dtype).requires_grad_(t.requires_grad)
                 for t in (query, key, value))


def get_rtol(true_value: torch.Tensor, computed_value: torch.Tensor) -> float:
    deviation = torch.abs((true_value - computed_value) / true_value)
    torch.nan_to_num_(deviation, nan=default_rtol[computed_value.dtype])
    return deviation.max().item()


def get_atol(true_value: torch.Tensor, computed_value: torch.Tensor) -> float:
    return torch.abs(true_value - computed_value).max().item()


def get_tolerances(true_value, computed_value, fudge_factor=None):
    """The original's tolerance of a low-precision result: the error of the low-precision
    math reference against the high-precision one (at least the dtype's default), times a
    fudge factor."""
    fudge_factor = 1.0 if fudge_factor is None else fudge_factor
    atol = fudge_factor * max(get_atol(true_value, computed_value),
                              default_atol[computed_value.dtype])
    rtol = fudge_factor * max(get_rtol(true_value, computed_value),
                              default_rtol[computed_value.dtype])
    if rtol > 1e30:  # torch.isclose misbehaves past this (pytorch/pytorch#102400)
        rtol = default_rtol[computed_value.dtype]
    return atol, rtol


def assert_equal(actual, expected, atol=None, rtol=None, msg=None):
    """TestCase.assertEqual on two tensors: torch.testing.assert_close with NaN == NaN, exact
    dtype, the dtype's default tolerances unless both atol and rtol are given."""
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, equal_nan=True, msg=msg)


def gradcheck(fn, inputs, **kwargs):
    """torch.testing._internal.common_utils.gradcheck: torch.autograd.gradcheck with the
    testing defaults check_batched_grad=True and fast_mode=True."""
    for key, value in (("check_batched_grad", True), ("fast_mode", True)):
        if kwargs.get(key) is None:
            kwargs[key] = value
    return torch.autograd.gradcheck(fn, inputs, **kwargs)


@contextlib.contextmanager
def seeded(seed: int = 1234):
    """The per-test seed of PyTorch's TestCase.setUp (SEED = 1234)."""
    with freeze_rng_state():
        torch.manual_seed(seed)
        random.seed(seed)
        yield

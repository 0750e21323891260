"""Property-based tests (hypothesis): random shapes, layouts (transposed and
sliced views), dtypes and option combinations against the float64
reference, within the worst-case error model (reference.tolerance)."""

import ml_dtypes
import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qkv
import reference

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, np.float64]


def layout(a, how):
    """The same values as `a` in another memory layout (a view)."""
    if how == "transposed":  # stored [B, H, N, D]
        return np.ascontiguousarray(a.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    if how == "sliced":  # inside a wider buffer
        wide = np.zeros(a.shape[:-1] + (a.shape[-1] + 5,), a.dtype)
        wide[..., 2:2 + a.shape[-1]] = a
        return wide[..., 2:2 + a.shape[-1]]
    if how == "torch":
        return torch.from_numpy(np.ascontiguousarray(a).view(np.uint16)).view(torch.bfloat16) \
            if a.dtype == ml_dtypes.bfloat16 else torch.from_numpy(np.ascontiguousarray(a))
    return a


@st.composite
def problems(draw):
    b = draw(st.integers(1, 3))
    hkv = draw(st.integers(1, 2))
    hq = hkv * draw(st.integers(1, 3))
    nq = draw(st.integers(1, 9))
    nk = draw(st.integers(1, 11))
    d = draw(st.sampled_from([1, 3, 8, 16, 17]))
    dv = draw(st.sampled_from([1, 4, 8, 9]))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, nq, hq, d))
    k = rng.standard_normal((b, nk, hkv, d))
    v = rng.standard_normal((b, nk, hkv, dv))
    opts = {}
    if draw(st.booleans()):
        opts["causal"] = True
        opts["align"] = draw(st.sampled_from(["bottom_right", "top_left"]))
    if draw(st.booleans()):
        opts["window"] = (draw(st.integers(-1, 6)), draw(st.integers(-1, 6)))
    if draw(st.booleans()):
        opts["key_lengths"] = [int(x) for x in rng.integers(0, nk + 1, b)]
    mask_kind = draw(st.sampled_from(["none", "bool", "float"]))
    if mask_kind == "bool":
        opts["mask"] = rng.random((b, 1, nq, nk)) > 0.3
    elif mask_kind == "float":
        opts["mask"] = rng.standard_normal((nq, nk)).astype(np.float32)
    if draw(st.booleans()):
        opts["softcap"] = draw(st.sampled_from([1.0, 5.0]))
    how = draw(st.sampled_from(["contiguous", "transposed", "sliced", "torch"]))
    return q, k, v, dtype, opts, how


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_random_problems_match_the_reference(p):
    q, k, v, dtype, opts, how = p
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    out = qkv.attention(*(layout(x, how) for x in (q, k, v)), **opts)
    if isinstance(out, torch.Tensor):
        out = out.double().numpy()
    got = np.asarray(out).astype(np.float64)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    ref, _, _ = reference.attention(q64, k64, v64, **opts)
    bias = float(np.abs(opts["mask"]).max()) if "mask" in opts and opts["mask"].dtype != bool else 0
    tol = 1e-12 if dtype == np.float64 else reference.tolerance(q64, k64, v64, dtype, bias=bias)
    assert np.abs(got - ref).max(initial=0) <= tol


@st.composite
def garbage(draw):
    """Arrays of random rank, dtype, shape and layout, and random options."""

    def array():
        kind = draw(st.sampled_from(["f32", "f64", "f16", "i32", "bool", "u8", "list"]))
        shape = tuple(draw(st.lists(st.integers(0, 4), min_size=0, max_size=5)))
        if kind == "list":
            return [1.0] * (shape[0] if shape else 1)
        dtype = {"f32": np.float32, "f64": np.float64, "f16": np.float16, "i32": np.int32,
                 "bool": np.bool_, "u8": np.uint8}[kind]
        a = np.zeros(shape, dtype)
        if a.ndim >= 2 and draw(st.booleans()):
            a = a.swapaxes(0, 1)
        if a.ndim >= 1 and a.shape[0] > 1 and draw(st.booleans()):
            a = a[::-1]
        return torch.from_numpy(np.ascontiguousarray(a)) if draw(st.booleans()) and kind != "u8" \
            else a

    opts = draw(st.fixed_dictionaries({}, optional={
        "causal": st.booleans(),
        "window": st.tuples(st.integers(-3, 3), st.integers(-3, 3)),
        "key_lengths": st.lists(st.integers(-2, 6), max_size=3),
        "scale": st.floats(allow_nan=True, allow_infinity=True),
        "softcap": st.floats(allow_nan=True, allow_infinity=True),
        "dropout_p": st.floats(-1, 2),
        "align": st.sampled_from(["top_left", "bottom_right", "x"]),
        "backend": st.sampled_from(["fast", "reference", "automatic", ""]),
        "alibi_slopes": st.lists(st.floats(allow_nan=True), max_size=4),
    }))
    return array(), array(), array(), opts


@settings(max_examples=300, deadline=None)
@given(garbage())
def test_bad_input_raises_value_or_type_errors_only(case):
    q, k, v, opts = case
    try:
        qkv.attention(q, k, v, **opts)
    except (ValueError, TypeError):
        pass

"""Attention in float64 NumPy, written from the definitions in
docs/semantics.md and independent of qkv: the yardstick of the Python tests.

Layout: q [B, Nq, Hq, D], k [B, Nk, Hkv, D], v [B, Nk, Hkv, Dv]."""

from __future__ import annotations

import numpy as np


def attention(q, k, v, *, scale=None, causal=False, align="bottom_right", window=(-1, -1),
              key_lengths=None, mask=None, alibi_slopes=None, softcap=0.0, score="scaled_dot",
              sinks=None):
    """Returns (out [B, Nq, Hq, Dv], lse [B, Hq, Nq], probs [B, Hq, Nq, Nk]) in
    float64; rows without any admitted key give out 0, lse -inf, probs 0.
    sinks [Hq]: each head's logit joins its rows' denominators (such rows
    then have lse = the sink)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    b, nq, hq, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    if scale is None:
        scale = 1.0 / np.sqrt(d) if score == "scaled_dot" else 1.0
    kk = np.repeat(k, group, axis=2)
    vv = np.repeat(v, group, axis=2)
    s = np.einsum("bihd,bjhd->bhij", q, kk) * scale
    if softcap > 0:
        s = softcap * np.tanh(s / softcap)
    admit = np.ones((b, hq, nq, nk), dtype=bool)
    lengths = np.full(b, nk) if key_lengths is None else np.asarray(key_lengths)
    for bb in range(b):
        nkb = int(lengths[bb])
        offset = nkb - nq if align == "bottom_right" else 0
        i = np.arange(nq)[:, None] + offset  # query positions on the key axis
        j = np.arange(nk)[None, :]
        keep = np.broadcast_to(j < nkb, (nq, nk)).copy()
        if causal:
            keep &= j <= i
        left, right = window
        if left >= 0:
            keep &= j >= i - left
        if right >= 0:
            keep &= j <= i + right
        admit[bb] &= keep[None]
        if alibi_slopes is not None:
            slopes = np.asarray(alibi_slopes, dtype=np.float64).reshape(-1, hq)
            row = slopes[bb if slopes.shape[0] > 1 else 0]
            s[bb] -= row[:, None, None] * np.abs(i - j)[None]
    if mask is not None:
        m = np.asarray(mask)
        if m.dtype == bool:
            admit &= np.broadcast_to(m, admit.shape)
        else:
            s = s + np.broadcast_to(m.astype(np.float64), s.shape)
    s = np.where(admit, s, -np.inf)
    if sinks is not None:  # one more column, always admitted, dropped from the weights
        column = np.broadcast_to(np.asarray(sinks, np.float64).reshape(1, hq, 1, 1),
                                 (b, hq, nq, 1))
        top = np.maximum(s.max(axis=-1, keepdims=True), column)
        top = np.where(np.isfinite(top), top, 0.0)  # no key and a -inf sink: z = 0
        e = np.where(admit, np.exp(s - top), 0.0)
        z = e.sum(axis=-1, keepdims=True) + np.exp(column - top)
        probs = np.where(z > 0, e / np.where(z > 0, z, 1.0), 0.0)
        with np.errstate(divide="ignore"):
            lse = (top + np.log(z))[..., 0]
        return np.einsum("bhij,bjhd->bihd", probs, vv), lse, probs
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.where(admit, np.exp(s - m), 0.0)
    z = e.sum(axis=-1, keepdims=True)
    probs = np.where(z > 0, e / np.where(z > 0, z, 1.0), 0.0)
    lse = np.where(z[..., 0] > 0, m[..., 0] + np.log(np.where(z[..., 0] > 0, z[..., 0], 1.0)),
                   -np.inf)
    out = np.einsum("bhij,bjhd->bihd", probs, vv)
    return out, lse, probs


def ulp_tolerance(dtype) -> float:
    """Unit roundoff of a result format."""
    return {np.dtype(np.float32): 2.0**-24, np.dtype(np.float16): 2.0**-11,
            np.dtype(np.float64): 2.0**-53}.get(np.dtype(dtype), 2.0**-8)


def tolerance(q, k, v, out_dtype, *, scale=None, bias=0.0) -> float:
    """The worst-case error of the fused f32 forward (docs/numerics.md,
    "Worst-case bounds"): scores off by g(D + 2) M (M bounds |score|, `bias`
    the largest added bias), weights relative to each other by e^{2d} - 1
    and by (4u + 2u M) per exponential and rescale (at most Nk + 1), sums by
    g(2 Nk + 2), then the output's rounding."""
    u = 2.0**-24
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    d, nk = q.shape[-1], k.shape[1]
    scale = 1.0 / np.sqrt(d) if scale is None else abs(scale)
    m = scale * d * np.abs(q).max(initial=0) * np.abs(k).max(initial=0) + bias
    g = lambda n: n * u / (1 - n * u)  # noqa: E731
    score = g(d + 2) * m + 2 * u * (m + bias)
    rel = np.expm1(2 * score) + 2 * ((1 + 4 * u + 2 * u * m) ** (nk + 1) - 1) + 2 * g(2 * nk + 2)
    vmax = np.abs(v).max(initial=0)
    return float(rel * vmax + ulp_tolerance(out_dtype) * 2 * vmax)

"""qkv.flash_attn against FlashAttention 2.8's documented semantics.

The expected values come from a float64 PyTorch implementation written here from
FlashAttention's docstrings (bottom-right causal alignment, windows, ALiBi, softcap,
GQA, varlen packing, the KV-cache update and rotary rules); qkv never computes an
expectation. Gradients are those of torch autograd through that implementation.

Tolerances. float64 inputs run through qkv's float64 reference path: every result is
a short sum of double products rounded once, so it matches to ~1e-12 relative to the
largest value compared. float32 results come from float32 kernels: a score is a dot
product of D <= 16 terms (relative error <= D * u, u = 2^-24), an absolute score error
d changes the probabilities by a factor exp(+-d), and the output sums Nk <= 16 terms,
so with scores of magnitude <= ~10 the error stays below ~(16 * 10 + 16) u, about 100
float32 ulps (2^-23) of max|value|. The backward chains three more such sums
(dP = dout v, D = dout . out, dq = dS k), doubling the budget. We allow 256 ulps for
forward values and 512 for gradients, relative to max|value| of the tensor compared.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

import qkv
import qkv.flash_attn as fa

F32_ULP = 2.0**-23


# --------------------------------------------------------------------------------------------
# The reference: FlashAttention's semantics in float64


def ref_attention(q, k, v, *, scale=None, causal=False, window=(-1, -1), softcap=0.0,
                  alibi=None, key_mask=None, sinks=None):
    """Attention as FlashAttention documents it, for one fixed-length batch.

    q [B, Nq, Hq, D], k [B, Nk, Hkv, D], v [B, Nk, Hkv, Dv]; query heads
    [g*i, g*(i+1)) read KV head i. Query i sits at key position i + Nk - Nq
    (bottom-right); causal keeps j <= that, the window [pos - left, pos + right],
    ALiBi adds -slope * |i + Nk - Nq - j|. key_mask [B, Nk] (True = keep) drops keys.
    sinks [Hq] (learnable_sink): one more softmax column per head, dropped from the
    weights (rows without keys then have out 0 and lse = the sink).
    Returns out [B, Nq, Hq, Dv], lse [B, Hq, Nq] (+inf for rows without keys, as
    FlashAttention writes them) and probs [B, Hq, Nq, Nk], in float64.
    """
    q, k, v = q.double(), k.double(), v.double()
    b, nq, hq, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    kk = k.repeat_interleave(hq // hkv, dim=2)
    vv = v.repeat_interleave(hq // hkv, dim=2)
    scale = d**-0.5 if scale is None else scale
    s = torch.einsum("bihd,bjhd->bhij", q, kk) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    pos = torch.arange(nq)[:, None] + nk - nq
    j = torch.arange(nk)[None, :]
    if alibi is not None:
        slopes = alibi.double().reshape(-1, hq)[:, :, None, None]
        s = s - slopes * (pos - j).abs()
    keep = torch.ones(nq, nk, dtype=torch.bool)
    if causal:
        keep &= j <= pos
    if window[0] >= 0:
        keep &= j >= pos - window[0]
    if window[1] >= 0:
        keep &= j <= pos + window[1]
    keep = keep.expand(b, hq, nq, nk)
    if key_mask is not None:
        keep = keep & key_mask[:, None, None, :]
    s = s.masked_fill(~keep, -math.inf)
    if sinks is not None:
        column = sinks.double().reshape(1, hq, 1, 1).expand(b, hq, nq, 1)
        lse = torch.logsumexp(torch.cat([s, column], -1), dim=-1)
        probs = torch.exp(s - lse[..., None])
        return torch.einsum("bhij,bjhd->bihd", probs, vv), lse, probs
    empty = ~keep.any(-1)
    # logsumexp of rows with keys; rows without keys get lse +inf and probs 0.
    lse = torch.logsumexp(torch.where(empty[..., None], 0.0, s), dim=-1)
    probs = torch.exp(s - lse[..., None])
    out = torch.einsum("bhij,bjhd->bihd", probs, vv)
    lse = torch.where(empty, math.inf, lse)
    return out, lse, probs


def fa_block_width(head_dim, dropout):
    """FlashAttention's sm80 key-block width (its tests' _get_block_size_n)."""
    if head_dim <= 32:
        return 128
    if head_dim <= 64:
        return 64 if dropout else 128
    if head_dim <= 96:
        return 64
    if head_dim <= 128:
        return 32 if dropout else 64
    return 64


def ref_numerators(probs, head_dim, dropout=False):
    """|S_dmask| as FlashAttention's kernel writes it: the keys in blocks of its width,
    visited last to first, each written as exp(s_ij - m) with m the running maximum
    so far, i.e. P_ij / (row i's largest P over this block and the later ones); 0
    where that is 0 (no key)."""
    width = fa_block_width(head_dim, dropout)
    out = torch.zeros_like(probs)
    running = torch.zeros_like(probs[..., :1])
    for start in reversed(range(0, probs.shape[-1], width)):
        block = probs[..., start:start + width]
        running = torch.maximum(running, block.amax(-1, keepdim=True))
        out[..., start:start + width] = torch.where(
            running > 0, block / torch.where(running > 0, running, 1.0), 0.0)
    return out


def ref_varlen(q, k, v, cu_q, cu_k, *, alibi=None, **options):
    """Packed sequences [total, H, D], each one attended on its own."""
    outs, lses, probs = [], [], []
    for s in range(len(cu_q) - 1):
        qs = q[cu_q[s]:cu_q[s + 1]][None]
        ks, vs = k[cu_k[s]:cu_k[s + 1]][None], v[cu_k[s]:cu_k[s + 1]][None]
        slopes = None if alibi is None else (alibi if alibi.dim() == 1 else alibi[s])
        o, lse, p = ref_attention(qs, ks, vs, alibi=slopes, **options)
        outs.append(o[0])
        lses.append(lse[0])
        probs.append(p[0])
    return torch.cat(outs), torch.cat(lses, dim=1), probs


def ref_rotary(x, cos, sin, positions, interleaved):
    """FlashAttention's rotary embedding: x [n, H, D] at positions [n]; pairs (2i, 2i+1)
    when interleaved, else (i, i + rotary_dim / 2), rotated by the angle whose cos and
    sin are cos[p, i], sin[p, i]; dimensions past rotary_dim unchanged."""
    half = cos.shape[1]
    x = x.double()
    c = cos.double()[positions][:, None, :]
    s = sin.double()[positions][:, None, :]
    first = torch.arange(0, 2 * half, 2) if interleaved else torch.arange(half)
    second = first + 1 if interleaved else first + half
    y = x.clone()
    y[..., first] = x[..., first] * c - x[..., second] * s
    y[..., second] = x[..., first] * s + x[..., second] * c
    return y


def rotary_tables(seqlen, rotary_dim, dtype=torch.float64):
    inv_freq = 10000.0 ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = torch.arange(seqlen, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


# --------------------------------------------------------------------------------------------
# Comparisons


def tolerance(expected, dtype, ulps=256):
    finite = expected[torch.isfinite(expected)]
    magnitude = max(float(finite.abs().max()), 1e-300) if finite.numel() else 1.0
    if dtype == torch.float64:
        return 1e-12 * max(magnitude, 1.0)
    if dtype == torch.bfloat16:
        # One rounding of the output to bfloat16 (<= 2^-9 relative) plus float32 work.
        return 2.0**-8 * magnitude
    return ulps * F32_ULP * magnitude


def assert_close(actual, expected, dtype, ulps=256, what=""):
    actual = actual.detach().double()
    expected = expected.detach().double()
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    inf_a, inf_e = torch.isinf(actual), torch.isinf(expected)
    assert torch.equal(inf_a, inf_e) and torch.equal(actual[inf_a], expected[inf_e]), what
    error = (actual[~inf_a] - expected[~inf_e]).abs().max() if (~inf_a).any() else 0.0
    tol = tolerance(expected, dtype, ulps)
    assert float(error) <= tol, f"{what}: error {float(error):.3g} > tolerance {tol:.3g}"


def randn(*shape, dtype=torch.float64, generator=None):
    return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


# --------------------------------------------------------------------------------------------
# flash_attn_func


CASES = {
    "plain": dict(nq=6, nk=6),
    "causal": dict(nq=6, nk=6, causal=True),
    "causal_nq_lt_nk": dict(nq=3, nk=7, causal=True),
    "causal_nq_gt_nk": dict(nq=7, nk=3, causal=True),  # rows 0..3 see no key
    "mqa": dict(nq=5, nk=8, hkv=1),
    "window": dict(nq=6, nk=9, window=(2, 1)),
    "window_left_causal": dict(nq=6, nk=9, window=(3, -1), causal=True),
    "window_right_0": dict(nq=6, nk=6, window=(-1, 0)),
    "softcap_scale": dict(nq=5, nk=7, softcap=2.0, scale=0.7),
    "alibi_heads_causal": dict(nq=5, nk=7, alibi="heads", causal=True),
    "alibi_batch": dict(nq=5, nk=7, alibi="batch"),
}


def make_alibi(kind, b, hq, gen):
    if kind is None:
        return None
    shape = (hq,) if kind == "heads" else (b, hq)
    return torch.rand(shape, generator=gen, dtype=torch.float64).float() * 0.5 + 0.1


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", list(CASES))
def test_func_matches_reference(case, dtype, gen):
    c = CASES[case]
    b, hq, hkv, d = 2, 4, c.get("hkv", 2), 16
    q = randn(b, c["nq"], hq, d, dtype=dtype, generator=gen)
    k = randn(b, c["nk"], hkv, d, dtype=dtype, generator=gen)
    v = randn(b, c["nk"], hkv, d, dtype=dtype, generator=gen)
    alibi = make_alibi(c.get("alibi"), b, hq, gen)
    kwargs = dict(softmax_scale=c.get("scale"), causal=c.get("causal", False),
                  window_size=c.get("window", (-1, -1)), softcap=c.get("softcap", 0.0),
                  alibi_slopes=alibi)
    out, lse, s_dmask = fa.flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
    ref_out, ref_lse, ref_probs = ref_attention(
        q, k, v, scale=kwargs["softmax_scale"], causal=kwargs["causal"],
        window=kwargs["window_size"], softcap=kwargs["softcap"], alibi=alibi,
    )
    assert out.dtype == dtype and s_dmask.dtype == dtype
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_close(out, ref_out, dtype, what="out")
    assert_close(lse, ref_lse, dtype, what="softmax_lse")
    assert_close(s_dmask, ref_numerators(ref_probs, d), dtype, what="S_dmask")
    plain = fa.flash_attn_func(q, k, v, **kwargs)
    assert isinstance(plain, torch.Tensor) and torch.equal(plain, out)


def test_func_bfloat16(gen):
    q, k, v = (randn(2, 5, 2, 16, generator=gen).bfloat16() for _ in range(3))
    out = fa.flash_attn_func(q, k, v, causal=True)
    assert out.dtype == torch.bfloat16
    assert_close(out, ref_attention(q, k, v, causal=True)[0], torch.bfloat16, what="out")


def test_fully_masked_rows_are_zero_with_infinite_lse(gen):
    q, k, v = (randn(1, n, 2, 8, generator=gen) for n in (5, 2, 2))
    out, lse, s_dmask = fa.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    # seqlen_q = 5, seqlen_k = 2: rows 0..2 are masked out entirely (FlashAttention's
    # docstring example); their output is 0 and the kernels write lse = +inf.
    assert torch.equal(out[:, :3], torch.zeros_like(out[:, :3]))
    assert torch.isposinf(lse[:, :, :3]).all() and torch.isfinite(lse[:, :, 3:]).all()
    assert torch.equal(s_dmask[:, :, :3], torch.zeros_like(s_dmask[:, :, :3]))


@pytest.mark.parametrize("d, dropout_p, nk", [(64, 0.0, 203), (64, 0.17, 203), (128, 0.0, 130),
                                             (128, 0.2, 113), (96, 0.0, 70), (256, 0.1, 129)])
def test_s_dmask_in_flash_attentions_key_blocks(d, dropout_p, nk, gen):
    """S_dmask over several of FlashAttention's key blocks (sm80's widths: 128, 64 or 32
    keys by head dim and dropout): block c scaled by the row's running maximum over
    blocks c, c + 1, ..., as its tests' normalize_flash_attn_S reads it; the sign is
    the dropout pattern, and the output is the same with and without the mask."""
    b, nq, hq, hkv = 1, 37, 2, 1
    q = randn(b, nq, hq, d, generator=gen)
    k, v = (randn(b, nk, hkv, d, generator=gen) for _ in range(2))
    torch.manual_seed(11)
    out, lse, s_dmask = fa.flash_attn_func(q, k, v, dropout_p, causal=True,
                                           return_attn_probs=True)
    torch.manual_seed(11)
    assert torch.equal(fa.flash_attn_func(q, k, v, dropout_p, causal=True), out)
    _, ref_lse, probs = ref_attention(q, k, v, causal=True)
    assert_close(s_dmask.abs(), ref_numerators(probs, d, dropout_p > 0), torch.float64,
                 what="|S_dmask|")
    # normalize_flash_attn_S: block c times exp(m_c - lse), m_c from the scores.
    width = fa_block_width(d, dropout_p > 0)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.expand(-1, -1, hq, -1)) / math.sqrt(d)
    scores = scores.masked_fill(~(probs > 0), -math.inf)
    block_max = torch.stack([x.amax(-1) for x in scores.split(width, -1)], -1)
    running = torch.cummax(block_max.flip(-1), -1).values.flip(-1)
    normalized = torch.cat([a * torch.exp(m - ref_lse)[..., None] for a, m in
                            zip(s_dmask.abs().split(width, -1), running.unbind(-1))], -1)
    assert_close(normalized, probs, torch.float64, what="normalized S_dmask")
    if dropout_p > 0:
        dropped = (torch.signbit(s_dmask) & (probs > 0)).sum().item() / (probs > 0).sum().item()
        assert abs(dropped - dropout_p) < 0.05, dropped


@pytest.mark.parametrize("varlen", [False, True], ids=["func", "varlen"])
def test_s_dmask_carries_the_dropout_pattern(varlen, gen):
    """With dropout, S_dmask's sign is the kept mask (negative = dropped), as
    FlashAttention's tests read it: the output and gradients are the reference's
    with that mask, the dropped fraction is dropout_p, and |S_dmask| normalized
    per row is the probabilities before dropout."""
    p, b, n, hq, hkv, d = 0.3, 2, 40, 4, 2, 16
    q = randn(b, n, hq, d, generator=gen)
    k, v = (randn(b, n + 3, hkv, d, generator=gen) for _ in range(2))
    w = randn(b, n, hq, d, generator=gen)
    torch.manual_seed(7)
    if varlen:
        cu_q, cu_k = cumulative([n] * b), cumulative([n + 3] * b)
        out, _, s_dmask = fa.flash_attn_varlen_func(
            q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, n, n + 3, p,
            causal=True, return_attn_probs=True)
        out = out.unflatten(0, (b, n))
    else:
        out, _, s_dmask = fa.flash_attn_func(q, k, v, p, causal=True, return_attn_probs=True)
    keep = ~torch.signbit(s_dmask)
    _, _, probs = ref_attention(q, k, v, causal=True)
    admitted = probs > 0
    dropped = (~keep & admitted).sum().item() / admitted.sum().item()
    # 2 * 4 * 40 * 41.5 admitted weights: the fraction's standard deviation is 0.004.
    assert abs(dropped - p) < 0.03, dropped
    rows = s_dmask.abs().sum(-1, keepdim=True)
    assert_close(s_dmask.abs() / torch.where(rows > 0, rows, 1.0), probs, torch.float64,
                 what="|S_dmask| normalized")

    def dropped_ref(q, k, v):
        vv = v.repeat_interleave(hq // hkv, dim=2)
        pp = ref_attention(q, k, v, causal=True)[2] * keep / (1 - p)
        return torch.einsum("bhij,bjhd->bihd", pp, vv)

    assert_close(out, dropped_ref(q, k, v), torch.float64, what="out")
    torch.manual_seed(7)
    if varlen:
        def fn(q, k, v):
            return fa.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                                             cu_q, cu_k, n, n + 3, p,
                                             causal=True).unflatten(0, (b, n))
    else:
        def fn(q, k, v):
            return fa.flash_attn_func(q, k, v, p, causal=True)
    _, grads = training_step(fn, (q, k, v), w)
    _, ref_grads = training_step(dropped_ref, (q, k, v), w)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(g, r, torch.float64, what=name)


# --------------------------------------------------------------------------------------------
# Gradients of a training step


def training_step(fn, inputs, w):
    """loss = (out * w).sum(); returns the gradients of the inputs."""
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*leaves)
    (out * w).sum().backward()
    return out, [x.grad for x in leaves]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("options", [
    dict(causal=True),
    dict(window_size=(3, 1), softcap=3.0, alibi=True),
])
def test_func_training_step_gradients(options, dtype, gen):
    b, nq, nk, hq, hkv, d = 2, 5, 7, 4, 2, 16
    q = randn(b, nq, hq, d, dtype=dtype, generator=gen)
    k = randn(b, nk, hkv, d, dtype=dtype, generator=gen)
    v = randn(b, nk, hkv, d, dtype=dtype, generator=gen)
    w = randn(b, nq, hq, d, dtype=dtype, generator=gen)
    alibi = make_alibi("heads", b, hq, gen) if options.get("alibi") else None
    causal = options.get("causal", False)
    window = options.get("window_size", (-1, -1))
    softcap = options.get("softcap", 0.0)

    out, grads = training_step(
        lambda q, k, v: fa.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                           softcap=softcap, alibi_slopes=alibi),
        (q, k, v), w)
    ref_out, ref_grads = training_step(
        lambda q, k, v: ref_attention(q, k, v, causal=causal, window=window, softcap=softcap,
                                      alibi=alibi)[0],
        (q.double(), k.double(), v.double()), w.double())
    assert_close(out, ref_out, dtype, what="out")
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert g.dtype == dtype
        assert_close(g, r, dtype, ulps=512, what=name)


def test_dropout_is_reproducible_and_differentiable(gen):
    q, k, v = (randn(2, 6, 2, 8, dtype=torch.float32, generator=gen) for _ in range(3))
    q.requires_grad_(True)
    torch.manual_seed(7)
    a = fa.flash_attn_func(q, k, v, dropout_p=0.5, deterministic=True)
    torch.manual_seed(7)
    b = fa.flash_attn_func(q, k, v, dropout_p=0.5)
    assert torch.equal(a, b)
    assert not torch.allclose(a, fa.flash_attn_func(q, k, v))
    a.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


# --------------------------------------------------------------------------------------------
# Packed q/k/v


def test_qkvpacked_forward_gradient_and_views(gen, monkeypatch):
    b, n, h, d = 2, 6, 2, 8
    qkv = randn(b, n, 3, h, d, generator=gen)
    w = randn(b, n, h, d, generator=gen)
    seen = []
    real = fa._ops.attention

    def spy(q, k, v, **kw):
        seen.append((q, k, v))
        return real(q, k, v, **kw)

    monkeypatch.setattr(fa._ops, "attention", spy)
    out, (g,) = training_step(
        lambda x: fa.flash_attn_qkvpacked_func(x, causal=True, window_size=(2, -1)), (qkv,), w)
    # q, k, v reach the kernels as views of the packed tensor, not copies.
    q_seen = seen[0][0]
    assert all(x.data_ptr() == q_seen.data_ptr() + i * h * d * 8 for i, x in enumerate(seen[0]))
    ref_out, (rq, rk, rv) = training_step(
        lambda q, k, v: ref_attention(q, k, v, causal=True, window=(2, -1))[0],
        (qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]), w)
    assert_close(out, ref_out, torch.float64, what="out")
    assert g.shape == qkv.shape
    assert_close(g, torch.stack((rq, rk, rv), dim=2), torch.float64, what="dqkv")

    o, lse, s = fa.flash_attn_qkvpacked_func(qkv, return_attn_probs=True)
    assert lse.shape == (b, h, n) and s.shape == (b, h, n, n)


def test_kvpacked_forward_and_gradient(gen):
    b, nq, nk, hq, hkv, d = 2, 4, 6, 4, 2, 8
    q = randn(b, nq, hq, d, generator=gen)
    kv = randn(b, nk, 2, hkv, d, generator=gen)
    w = randn(b, nq, hq, d, generator=gen)
    out, (gq, gkv) = training_step(
        lambda q, kv: fa.flash_attn_kvpacked_func(q, kv, causal=True, softcap=4.0), (q, kv), w)
    ref_out, (rq, rk, rv) = training_step(
        lambda q, k, v: ref_attention(q, k, v, causal=True, softcap=4.0)[0],
        (q, kv[:, :, 0], kv[:, :, 1]), w)
    assert_close(out, ref_out, torch.float64, what="out")
    assert_close(gq, rq, torch.float64, what="dq")
    assert gkv.shape == kv.shape
    assert_close(gkv, torch.stack((rk, rv), dim=2), torch.float64, what="dkv")


# --------------------------------------------------------------------------------------------
# Packed variable-length batches

LENS_Q = [3, 5, 1]
LENS_K = [4, 2, 6]  # sequence 1 has more queries than keys: its first rows are empty


def cumulative(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("options", [
    dict(causal=True),
    dict(window_size=(1, 2), alibi=True),
    dict(softcap=2.5, softmax_scale=0.4),
])
def test_varlen_matches_reference(options, dtype, gen):
    hq, hkv, d = 4, 2, 16
    cu_q, cu_k = cumulative(LENS_Q), cumulative(LENS_K)
    q = randn(sum(LENS_Q), hq, d, dtype=dtype, generator=gen)
    k = randn(sum(LENS_K), hkv, d, dtype=dtype, generator=gen)
    v = randn(sum(LENS_K), hkv, d, dtype=dtype, generator=gen)
    alibi = make_alibi("batch", len(LENS_Q), hq, gen) if options.get("alibi") else None
    kw = dict(causal=options.get("causal", False), window_size=options.get("window_size",
              (-1, -1)), softcap=options.get("softcap", 0.0),
              softmax_scale=options.get("softmax_scale"), alibi_slopes=alibi)
    out, lse, s_dmask = fa.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), return_attn_probs=True, **kw)
    ref_out, ref_lse, ref_probs = ref_varlen(
        q, k, v, cu_q.tolist(), cu_k.tolist(), alibi=alibi, causal=kw["causal"],
        window=kw["window_size"], softcap=kw["softcap"], scale=kw["softmax_scale"])
    assert out.shape == (sum(LENS_Q), hq, d) and lse.shape == (hq, sum(LENS_Q))
    assert_close(out, ref_out, dtype, what="out")
    assert_close(lse, ref_lse, dtype, what="softmax_lse")
    assert s_dmask.shape == (len(LENS_Q), hq, max(LENS_Q), max(LENS_K))
    for s, p in enumerate(ref_probs):
        nq, nk = LENS_Q[s], LENS_K[s]
        assert_close(s_dmask[s, :, :nq, :nk], ref_numerators(p, d), dtype,
                     what=f"S_dmask[{s}]")
        assert not s_dmask[s, :, nq:].any() and not s_dmask[s, :, :, nk:].any()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_varlen_training_step_gradients(dtype, gen):
    hq, hkv, d = 4, 2, 16
    cu_q, cu_k = cumulative(LENS_Q), cumulative(LENS_K)
    q = randn(sum(LENS_Q), hq, d, dtype=dtype, generator=gen)
    k = randn(sum(LENS_K), hkv, d, dtype=dtype, generator=gen)
    v = randn(sum(LENS_K), hkv, d, dtype=dtype, generator=gen)
    w = randn(sum(LENS_Q), hq, d, dtype=dtype, generator=gen)
    out, grads = training_step(
        lambda q, k, v: fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 6, causal=True,
                                                  window_size=(3, -1)),
        (q, k, v), w)
    ref_out, ref_grads = training_step(
        lambda q, k, v: ref_varlen(q, k, v, cu_q.tolist(), cu_k.tolist(), causal=True,
                                   window=(3, -1))[0],
        (q.double(), k.double(), v.double()), w.double())
    assert_close(out, ref_out, dtype, what="out")
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(g, r, dtype, ulps=512, what=name)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_learnable_sink_forward_and_gradients(dtype, gen):
    b, nq, nk, hq, hkv, d = 2, 5, 7, 4, 2, 16
    q = randn(b, nq, hq, d, dtype=dtype, generator=gen)
    k = randn(b, nk, hkv, d, dtype=dtype, generator=gen)
    v = randn(b, nk, hkv, d, dtype=dtype, generator=gen)
    w = randn(b, nq, hq, d, dtype=dtype, generator=gen)
    sinks = torch.tensor([1.5, -0.75, 0.0, 3.0], dtype=dtype)  # exact in float32
    out, grads = training_step(
        lambda q, k, v, s: fa.flash_attn_func(q, k, v, causal=True, window_size=(3, 0),
                                              learnable_sink=s),
        (q, k, v, sinks), w)
    ref_out, ref_grads = training_step(
        lambda q, k, v, s: ref_attention(q, k, v, causal=True, window=(3, 0), sinks=s)[0],
        (q.double(), k.double(), v.double(), sinks.double()), w.double())
    assert_close(out, ref_out, dtype, what="out")
    for name, g, r in zip(("dq", "dk", "dv", "d_sink"), grads, ref_grads):
        assert g.dtype == dtype
        assert_close(g, r, dtype, ulps=512, what=name)


def test_learnable_sink_varlen(gen):
    hq, hkv, d = 4, 2, 16
    cu_q, cu_k = cumulative(LENS_Q), cumulative(LENS_K)
    q = randn(sum(LENS_Q), hq, d, dtype=torch.float32, generator=gen)
    k = randn(sum(LENS_K), hkv, d, dtype=torch.float32, generator=gen)
    v = randn(sum(LENS_K), hkv, d, dtype=torch.float32, generator=gen)
    sinks = torch.tensor([0.5, 2.0, -1.0, 0.25])
    out, lse, _ = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K),
                                            causal=True, learnable_sink=sinks,
                                            return_attn_probs=True)
    for s in range(len(LENS_Q)):
        rows = slice(int(cu_q[s]), int(cu_q[s + 1]))
        keys = slice(int(cu_k[s]), int(cu_k[s + 1]))
        ref_out, ref_lse, _ = ref_attention(q[rows][None], k[keys][None], v[keys][None],
                                            causal=True, sinks=sinks)
        assert_close(out[rows], ref_out[0], torch.float32, what=f"out[{s}]")
        # Rows without keys (sequence 1's first) have lse = the sink, finite.
        assert_close(lse[:, rows], ref_lse[0], torch.float32, what=f"softmax_lse[{s}]")


def test_varlen_qkvpacked_and_kvpacked(gen):
    lens = [4, 2, 5]
    cu = cumulative(lens)
    h, d = 2, 8
    qkv = randn(sum(lens), 3, h, d, generator=gen)
    w = randn(sum(lens), h, d, generator=gen)
    out, (g,) = training_step(
        lambda x: fa.flash_attn_varlen_qkvpacked_func(x, cu, max(lens), causal=True),
        (qkv,), w)
    ref_out, (rq, rk, rv) = training_step(
        lambda q, k, v: ref_varlen(q, k, v, cu.tolist(), cu.tolist(), causal=True)[0],
        (qkv[:, 0], qkv[:, 1], qkv[:, 2]), w)
    assert_close(out, ref_out, torch.float64, what="out")
    assert_close(g, torch.stack((rq, rk, rv), dim=1), torch.float64, what="dqkv")
    _, lse, s = fa.flash_attn_varlen_qkvpacked_func(qkv, cu, 6, return_attn_probs=True)
    assert lse.shape == (h, sum(lens)) and s.shape == (3, h, 6, 6)

    cu_q, cu_k = cumulative(LENS_Q), cumulative(LENS_K)
    q = randn(sum(LENS_Q), 4, d, generator=gen)
    kv = randn(sum(LENS_K), 2, 2, d, generator=gen)
    w = randn(sum(LENS_Q), 4, d, generator=gen)
    out, (gq, gkv) = training_step(
        lambda q, kv: fa.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, 5, 6, causal=True),
        (q, kv), w)
    ref_out, (rq, rk, rv) = training_step(
        lambda q, k, v: ref_varlen(q, k, v, cu_q.tolist(), cu_k.tolist(), causal=True)[0],
        (q, kv[:, 0], kv[:, 1]), w)
    assert_close(out, ref_out, torch.float64, what="out")
    assert_close(gq, rq, torch.float64, what="dq")
    assert_close(gkv, torch.stack((rk, rv), dim=1), torch.float64, what="dkv")


def test_varlen_paged_block_table(gen):
    page, hq, hkv, d = 4, 4, 2, 8
    lens_q, lens_k = [2, 3], [6, 3]
    k_pages = randn(5, page, hkv, d, generator=gen)
    v_pages = randn(5, page, hkv, d, generator=gen)
    block_table = torch.tensor([[3, 0], [4, 2]], dtype=torch.int32)  # second page unused
    cu_q, cu_k = cumulative(lens_q), cumulative(lens_k)
    q = randn(sum(lens_q), hq, d, generator=gen)
    w = randn(sum(lens_q), hq, d, generator=gen)

    def packed(pages):
        rows = [pages[block_table[s]].reshape(-1, hkv, d)[:n] for s, n in enumerate(lens_k)]
        return torch.cat(rows)

    out, (gq, gk, gv) = training_step(
        lambda q, k, v: fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 6, causal=True,
                                                  block_table=block_table),
        (q, k_pages, v_pages), w)
    ref_out, (rq, rk, rv) = training_step(
        lambda q, k, v: ref_varlen(q, packed(k), packed(v), cu_q.tolist(), cu_k.tolist(),
                                   causal=True)[0],
        (q, k_pages, v_pages), w)
    assert_close(out, ref_out, torch.float64, what="out")
    for name, g, r in (("dq", gq, rq), ("dk", gk, rk), ("dv", gv, rv)):
        assert_close(g, r, torch.float64, what=name)


# --------------------------------------------------------------------------------------------
# flash_attn_with_kvcache


def ref_kvcache(q, k_before, v_before, k_new, v_new, seqlens, *, leftpad=None, rotary=None,
                causal=False, window=(-1, -1), **options):
    """FlashAttention's decoding step, one sequence at a time: cache rows
    [leftpad, seqlens) followed by the new keys; k rotated at positions
    seqlens + t, q at seqlens + t if causal or local, else at seqlens.
    k_before [B, capacity, Hkv, D] holds each sequence's keys in order."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        start = 0 if leftpad is None else int(leftpad[b])
        end = int(seqlens[b])
        kn, vn, qb = k_new[b], v_new[b], q[b]
        if rotary is not None:
            cos, sin, interleaved = rotary
            pos_k = torch.arange(kn.shape[0]) + end
            kn = ref_rotary(kn, cos, sin, pos_k, interleaved)
            local = window != (-1, -1)
            pos_q = end + (torch.arange(qb.shape[0]) if causal or local else 0 * torch.arange(
                qb.shape[0]))
            qb = ref_rotary(qb, cos, sin, pos_q, interleaved)
        keys = torch.cat((k_before[b, start:end].double(), kn.double()))
        values = torch.cat((v_before[b, start:end].double(), vn.double()))
        o, lse, _ = ref_attention(qb[None], keys[None], values[None], causal=causal,
                                  window=window, **options)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def check_append(k_cache, before, rows, starts, new):
    """The cache equals `before` except rows[b] positions starts[b] + t, which hold new[b]."""
    expected = before.clone()
    for b, (r, s) in enumerate(zip(rows, starts)):
        expected[r, s:s + new.shape[1]] = new[b].to(before.dtype)
    assert torch.equal(k_cache, expected)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_kvcache_contiguous_append_in_place(dtype, gen):
    b, cap, hq, hkv, d, n = 2, 10, 4, 2, 16, 2
    k_cache = randn(b, cap, hkv, d, dtype=dtype, generator=gen)
    v_cache = randn(b, cap, hkv, d, dtype=dtype, generator=gen)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    q = randn(b, n, hq, d, dtype=dtype, generator=gen)
    k = randn(b, n, hkv, d, dtype=dtype, generator=gen)
    v = randn(b, n, hkv, d, dtype=dtype, generator=gen)
    seqlens = torch.tensor([3, 7], dtype=torch.int32)
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                          causal=True, return_softmax_lse=True)
    check_append(k_cache, k_before, [0, 1], seqlens.tolist(), k)
    check_append(v_cache, v_before, [0, 1], seqlens.tolist(), v)
    ref_out, ref_lse = ref_kvcache(q, k_before, v_before, k, v, seqlens, causal=True)
    assert out.shape == (b, n, hq, d) and lse.shape == (b, hq, n)
    assert_close(out, ref_out, dtype, what="out")
    assert_close(lse, ref_lse, dtype, what="softmax_lse")


def test_kvcache_cache_batch_idx(gen):
    b, rows_cache, cap, hq, hkv, d, n = 2, 4, 8, 2, 1, 8, 1
    k_cache = randn(rows_cache, cap, hkv, d, generator=gen)
    v_cache = randn(rows_cache, cap, hkv, d, generator=gen)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    q = randn(b, n, hq, d, generator=gen)
    k, v = randn(b, n, hkv, d, generator=gen), randn(b, n, hkv, d, generator=gen)
    idx = torch.tensor([3, 1], dtype=torch.int32)
    seqlens = torch.tensor([5, 2], dtype=torch.int32)
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                     cache_batch_idx=idx, softcap=3.0)
    check_append(k_cache, k_before, [3, 1], seqlens.tolist(), k)
    check_append(v_cache, v_before, [3, 1], seqlens.tolist(), v)
    ref_out, _ = ref_kvcache(q, k_before[idx.long()], v_before[idx.long()], k, v, seqlens,
                             softcap=3.0)
    assert_close(out, ref_out, torch.float64, what="out")


def test_kvcache_paged_block_table(gen):
    b, page, blocks, hq, hkv, d, n = 2, 4, 8, 4, 2, 8, 2
    k_cache = randn(blocks, page, hkv, d, generator=gen)
    v_cache = randn(blocks, page, hkv, d, generator=gen)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    block_table = torch.tensor([[5, 2, 7], [0, 3, 6]], dtype=torch.int32)
    seqlens = torch.tensor([5, 9], dtype=torch.int32)
    q = randn(b, n, hq, d, generator=gen)
    k, v = randn(b, n, hkv, d, generator=gen), randn(b, n, hkv, d, generator=gen)
    alibi = make_alibi("heads", b, hq, gen)
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                     block_table=block_table, causal=True, alibi_slopes=alibi)
    # The new tokens land at logical positions seqlens[b] + t, i.e. block
    # block_table[b, pos // page], slot pos % page.
    expected_k, expected_v = k_before.clone(), v_before.clone()
    for bb in range(b):
        for t in range(n):
            pos = int(seqlens[bb]) + t
            blk = int(block_table[bb, pos // page])
            expected_k[blk, pos % page] = k[bb, t]
            expected_v[blk, pos % page] = v[bb, t]
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)

    def logical(pages):
        return torch.stack([pages[block_table[bb].long()].reshape(-1, hkv, d)
                            for bb in range(b)])

    ref_out, _ = ref_kvcache(q, logical(k_before), logical(v_before), k, v, seqlens,
                             causal=True, alibi=alibi)
    assert_close(out, ref_out, torch.float64, what="out")


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("mode", ["causal", "local", "full"])
def test_kvcache_rotary(interleaved, mode, gen):
    b, cap, hq, hkv, d, rotary_dim = 2, 12, 2, 2, 16, 8
    nq = n = 3
    causal = mode == "causal"
    window = (4, 0) if mode == "local" else (-1, -1)
    k_cache = randn(b, cap, hkv, d, generator=gen)
    v_cache = randn(b, cap, hkv, d, generator=gen)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    q = randn(b, nq, hq, d, generator=gen)
    k, v = randn(b, n, hkv, d, generator=gen), randn(b, n, hkv, d, generator=gen)
    cos, sin = rotary_tables(cap, rotary_dim)
    seqlens = torch.tensor([2, 6], dtype=torch.int32)
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cos, sin, cache_seqlens=seqlens,
                                     causal=causal, window_size=window,
                                     rotary_interleaved=interleaved)
    for bb in range(b):
        s = int(seqlens[bb])
        rotated = ref_rotary(k[bb], cos, sin, torch.arange(n) + s, interleaved)
        assert_close(k_cache[bb, s:s + n], rotated, torch.float64, what="rotated k in cache")
        assert torch.equal(k_cache[bb, :s], k_before[bb, :s])
        assert torch.equal(v_cache[bb, s:s + n], v[bb])
    ref_out, _ = ref_kvcache(q, k_before, v_before, k, v, seqlens,
                             rotary=(cos, sin, interleaved), causal=causal, window=window)
    assert_close(out, ref_out, torch.float64, what="out")


def test_kvcache_leftpad_int_seqlens_and_no_new_tokens(gen):
    b, cap, hq, hkv, d = 2, 8, 2, 1, 8
    k_cache = randn(b, cap, hkv, d, generator=gen)
    v_cache = randn(b, cap, hkv, d, generator=gen)
    q = randn(b, 2, hq, d, generator=gen)
    leftpad = torch.tensor([0, 3], dtype=torch.int32)
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=6,
                                          cache_leftpad=leftpad, causal=True,
                                          return_softmax_lse=True)
    empty = torch.empty(b, 0, hkv, d, dtype=torch.float64)
    seqlens = torch.tensor([6, 6])
    ref_out, ref_lse = ref_kvcache(q, k_cache, v_cache, empty, empty, seqlens, leftpad=leftpad,
                                   causal=True)
    assert_close(out, ref_out, torch.float64, what="out")
    assert_close(lse, ref_lse, torch.float64, what="softmax_lse")

    # cache_seqlens=None: the whole cache, with a window.
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, window_size=(2, 0), num_splits=3)
    ref_out, _ = ref_kvcache(q, k_cache, v_cache, empty, empty, [cap, cap], window=(2, 0))
    assert_close(out, ref_out, torch.float64, what="out (whole cache)")


def test_kvcache_is_not_differentiable(gen):
    q = randn(1, 1, 2, 8, generator=gen).requires_grad_(True)
    k_cache, v_cache = randn(1, 4, 2, 8, generator=gen), randn(1, 4, 2, 8, generator=gen)
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=4)
    assert out.grad_fn is None


# --------------------------------------------------------------------------------------------
# The API's shape: signatures and errors


SIGNATURES = {
    "flash_attn_func": "q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, "
    "window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False, "
    "return_attn_probs=False, learnable_sink=None",
    "flash_attn_qkvpacked_func": "qkv, dropout_p=0.0, softmax_scale=None, causal=False, "
    "window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False, "
    "return_attn_probs=False",
    "flash_attn_kvpacked_func": "q, kv, dropout_p=0.0, softmax_scale=None, causal=False, "
    "window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False, "
    "return_attn_probs=False",
    "flash_attn_varlen_func": "q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, "
    "max_seqlen_k, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), "
    "softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, "
    "block_table=None, learnable_sink=None",
    "flash_attn_varlen_qkvpacked_func": "qkv, cu_seqlens, max_seqlen, dropout_p=0.0, "
    "softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, "
    "alibi_slopes=None, deterministic=False, return_attn_probs=False",
    "flash_attn_varlen_kvpacked_func": "q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, "
    "max_seqlen_k, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), "
    "softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False",
    "flash_attn_with_kvcache": "q, k_cache, v_cache, k=None, v=None, rotary_cos=None, "
    "rotary_sin=None, cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, "
    "block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1), "
    "softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0, "
    "return_softmax_lse=False",
}


# learnable_sink is FlashAttention 3's argument, added after 2.8's.
@pytest.mark.parametrize("name", list(SIGNATURES))
def test_signatures_are_flash_attention_2_8(name):
    params = inspect.signature(getattr(fa, name)).parameters.values()
    text = ", ".join(p.name if p.default is inspect.Parameter.empty else
                     f"{p.name}={p.default!r}" for p in params)
    assert text == SIGNATURES[name]
    assert name in fa.__all__


def test_bad_arguments(gen):
    """FlashAttention raises RuntimeError for these (its C++ checks); qkv.ArgumentError
    is a RuntimeError and a ValueError, naming the argument."""
    assert issubclass(qkv.ArgumentError, RuntimeError)
    q, k, v = (randn(1, 4, 2, 8, generator=gen) for _ in range(3))
    with pytest.raises(qkv.ArgumentError,
                       match=r"q: expected 4 dimensions .*got shape \[4, 2, 8\]"):
        fa.flash_attn_func(q[0], k, v)
    with pytest.raises(TypeError, match=r"k: expected a torch.Tensor .*got ndarray"):
        fa.flash_attn_func(q, k.numpy(), v)
    with pytest.raises(qkv.ArgumentError, match=r"qkv: expected size 3 in dimension 2"):
        fa.flash_attn_qkvpacked_func(randn(1, 4, 2, 2, 8, generator=gen))
    with pytest.raises(qkv.ArgumentError, match=r"kv: expected 5 dimensions"):
        fa.flash_attn_kvpacked_func(q, k)
    with pytest.raises(TypeError, match=r"window_size: expected a pair"):
        fa.flash_attn_func(q, k, v, window_size=3)
    # Refused by qkv's native checks: the same error type.
    with pytest.raises(qkv.ArgumentError, match=r"options.scale: expected a finite number"):
        fa.flash_attn_func(q, k, v, softmax_scale=math.nan)

    cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    with pytest.raises(qkv.ArgumentError,
                       match=r"cu_seqlens_q: expected shape \[batch_size \+ 1\]"):
        fa.flash_attn_varlen_func(q[0], k[0], v[0], cu[None], cu, 2, 2)
    with pytest.raises(qkv.ArgumentError, match=r"max_seqlen_q: a sequence has 2 tokens"):
        fa.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 1, 2, return_attn_probs=True)

    k_cache, v_cache = randn(1, 4, 2, 8, generator=gen), randn(1, 4, 2, 8, generator=gen)
    new = randn(1, 1, 2, 8, generator=gen)
    with pytest.raises(qkv.ArgumentError, match=r"cache_seqlens: required with k and v"):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, new, new)
    with pytest.raises(qkv.ArgumentError, match=r"cache_seqlens: .*capacity"):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=4)
    with pytest.raises(qkv.ArgumentError, match=r"cache_seqlens: .*\(the 1 blocks of 4 tokens "
                                                r"block_table gives each sequence"):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=5,
                                   block_table=torch.tensor([[0]]))
    with pytest.raises(qkv.ArgumentError, match=r"k and v: pass both"):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, new, cache_seqlens=1)
    with pytest.raises(qkv.ArgumentError,
                       match=r"cache_batch_idx: not supported with a paged cache"):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=1,
                                   cache_batch_idx=torch.tensor([0]),
                                   block_table=torch.tensor([[0]]))
    cos, sin = rotary_tables(4, 8)
    with pytest.raises(qkv.ArgumentError, match=r"rotary_cos: rotary embedding needs the new keys"):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, rotary_cos=cos, rotary_sin=sin,
                                   cache_seqlens=1)
    before = k_cache.clone()
    with pytest.raises(qkv.ArgumentError, match=r"block_table: block indices must lie in \[0, 1\)"):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=1,
                                   block_table=torch.tensor([[2]]))
    assert torch.equal(k_cache, before)  # nothing written when the call is refused


# --------------------------------------------------------------------------------------------
# FlashAttention's private entry points (flash_attn_interface's _flash_attn_*)


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_private_forward_and_backward_are_the_public_functions(dropout_p, gen):
    """_flash_attn_forward returns (out, softmax_lse, S_dmask, rng_state) as
    flash_attn_func's call with the same seed; _flash_attn_backward with that rng_state
    writes the autograd gradients into the tensors given (views of a packed dqkv here)
    and returns softmax_d = rowsum(dout * out)."""
    b, n, h, d = 2, 9, 2, 16
    q, k, v = (randn(b, n, h, d, generator=gen) for _ in range(3))
    w = randn(b, n, h, d, generator=gen)
    torch.manual_seed(5)
    out, lse, s_dmask, rng_state = fa._flash_attn_forward(
        q, k, v, dropout_p, None, True, -1, -1, 0.0, None, True)
    assert rng_state.dtype == torch.int64 and rng_state.shape == (2,)
    assert not out.requires_grad
    torch.manual_seed(5)
    ref_out, ref_lse, ref_s = fa.flash_attn_func(q, k, v, dropout_p, causal=True,
                                                 return_attn_probs=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert torch.equal(s_dmask, ref_s)
    torch.manual_seed(5)
    assert fa._flash_attn_forward(q, k, v, dropout_p, None, True, -1, -1, 0.0, None,
                                  False)[2].numel() == 0
    torch.manual_seed(5)
    _, grads = training_step(
        lambda q, k, v: fa.flash_attn_func(q, k, v, dropout_p, causal=True), (q, k, v), w)
    dqkv = torch.full((b, n, 3, h, d), math.nan, dtype=q.dtype)
    torch.manual_seed(99)  # the pattern comes from rng_state, not from torch's generator
    softmax_d = fa._flash_attn_backward(
        w, q, k, v, out, lse, dqkv[:, :, 0], dqkv[:, :, 1], dqkv[:, :, 2], dropout_p, None,
        True, -1, -1, 0.0, None, False, rng_state)
    for i, name in enumerate(("dq", "dk", "dv")):
        assert_close(dqkv[:, :, i], grads[i], torch.float64, what=name)
    assert softmax_d.dtype == torch.float32  # as FlashAttention's, summed in float32
    assert_close(softmax_d, (w * out).sum(-1).transpose(1, 2), torch.float32,
                 what="softmax_d")


def test_private_varlen_forward_and_backward(gen):
    """_flash_attn_varlen_forward/_backward: flash_attn_varlen_func's results for the
    same seed; seqused_k and leftpad_k read a part of each sequence's keys, as the
    packed keys of just that part do."""
    hq, hkv, d = 4, 2, 8
    cu_q, cu_k = cumulative(LENS_Q), cumulative(LENS_K)
    q = randn(sum(LENS_Q), hq, d, generator=gen)
    k, v = (randn(sum(LENS_K), hkv, d, generator=gen) for _ in range(2))
    w = randn(sum(LENS_Q), hq, d, generator=gen)
    args = (cu_q, cu_k, max(LENS_Q), max(LENS_K), 0.2, None, True)
    torch.manual_seed(3)
    out, lse, _, rng_state = fa._flash_attn_varlen_forward(q, k, v, *args)
    torch.manual_seed(3)
    ref_out, ref_lse, _ = fa.flash_attn_varlen_func(
        q, k, v, *args[:5], causal=True, return_attn_probs=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    torch.manual_seed(3)
    _, grads = training_step(
        lambda q, k, v: fa.flash_attn_varlen_func(q, k, v, *args[:5], causal=True),
        (q, k, v), w)
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    softmax_d = fa._flash_attn_varlen_backward(
        w, q, k, v, out, lse, dq, dk, dv, *args, -1, -1, 0.0, None, False, rng_state)
    for got, ref, name in zip((dq, dk, dv), grads, ("dq", "dk", "dv")):
        assert_close(got, ref, torch.float64, what=name)
    assert softmax_d.shape == (hq, sum(LENS_Q))
    # Keys 1.. of sequence 0, 0..1 of sequence 1 and 2..5 of sequence 2.
    pad, used = torch.tensor([1, 0, 2]), torch.tensor([4, 2, 6])
    part = [torch.arange(cu_k[s] + pad[s], cu_k[s] + used[s]) for s in range(3)]
    rows = torch.cat(part)
    cu_part = cumulative([len(p) for p in part])
    got = fa._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), 0.0,
                                        None, True, leftpad_k=pad, seqused_k=used)[0]
    ref = fa.flash_attn_varlen_func(q, k[rows], v[rows], cu_q, cu_part, max(LENS_Q),
                                    max(LENS_K), causal=True)
    assert torch.equal(got, ref)
    with pytest.raises(RuntimeError, match="leftpad_k"):
        fa._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), 0.0,
                                      None, True, leftpad_k=torch.tensor([5, 0, 0]))


def test_private_entry_points_name_bad_arguments(gen):
    q, k, v = (randn(1, 4, 2, 8, generator=gen) for _ in range(3))
    out, lse, _, rng_state = fa._flash_attn_forward(q, k, v, 0.0, None, False, -1, -1, 0.0,
                                                    None, False)
    bad = r"dq: expected shape \[1, 4, 2, 8\], got \[1, 4, 2, 4\]"
    with pytest.raises(RuntimeError, match=bad):
        fa._flash_attn_backward(q, q, k, v, out, lse, q[..., :4].clone(), None, None, 0.0, None,
                                False, -1, -1, 0.0, None, False, rng_state)
    with pytest.raises(RuntimeError, match="rng_state"):
        fa._flash_attn_backward(q, q, k, v, out, lse, None, None, None, 0.0, None, False, -1,
                                -1, 0.0, None, False, rng_state[None])
    with pytest.raises(RuntimeError, match="q: expected"):
        fa._flash_attn_forward(q[0], k, v, 0.0, None, False, -1, -1, 0.0, None, False)

"""qkv.torch.scaled_dot_product_attention against PyTorch's function (the
pinned torch), and torch.ops.qkv.attention under autograd, gradcheck,
opcheck and torch.compile."""

import math

import pytest
import torch
import torch.nn.functional as F

from qkv import _ops
from qkv.torch import scaled_dot_product_attention as sdpa

torch.manual_seed(0)


def f64(x):
    return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def tolerance(q, k, v):
    """The worst-case model of docs/numerics.md, dominant terms, for f32:
    scores off by (D + 2) u M, weights by (Nk + 1)(4u + 2uM) twice, sums by
    2(2 Nk + 2) u; times max|v|."""
    u = 2.0**-24
    d, nk = q.shape[-1], k.shape[-2]
    m = d**-0.5 * d * q.abs().max().item() * k.abs().max().item()
    rel = 2 * (d + 2) * u * m + 2 * (nk + 1) * (4 * u + 2 * u * m) + 2 * (2 * nk + 2) * u
    return rel * v.abs().max().item() + 2 * u * v.abs().max().item()


CASES = {
    "plain": {},
    "causal": {"is_causal": True},
    "bool mask": {"attn_mask": torch.rand(5, 7) > 0.3},
    "float mask": {"attn_mask": torch.randn(2, 1, 5, 7)},
    "scale": {"scale": 0.3},
    "fully masked row": {"attn_mask": torch.ones(5, 7, dtype=torch.bool).index_fill(0, torch.tensor([2]), False)},
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_sdpa_matches_pytorch(case):
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 7, 8), torch.randn(2, 4, 7, 6)
    kw = CASES[case]
    out = sdpa(q, k, v, **kw)
    ref = F.scaled_dot_product_attention(f64(q), f64(k), f64(v), **{n: f64(x) for n, x in kw.items()})
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert (out.double() - ref).abs().max().item() <= tolerance(q, k, v)


def test_sdpa_fully_masked_row_is_zero_like_pytorch():
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1] = False
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ours = sdpa(q, k, v, attn_mask=mask)
    assert torch.equal(theirs[:, :, 1], torch.zeros(1, 2, 4))  # the pinned torch: 0
    assert torch.equal(ours[:, :, 1], theirs[:, :, 1])


@pytest.mark.parametrize("shape", [(5, 8), (3, 5, 8), (2, 3, 4, 5, 8)], ids=["2d", "3d", "5d"])
def test_sdpa_ranks_and_broadcast_masks(shape):
    q = torch.randn(*shape)
    k = torch.randn(*shape[:-2], 7, 8)
    v = torch.randn(*shape[:-2], 7, 8)
    mask = torch.randn(5, 7)
    out = sdpa(q, k, v, attn_mask=mask)
    ref = F.scaled_dot_product_attention(f64(q), f64(k), f64(v), attn_mask=f64(mask))
    assert (out.double() - ref).abs().max().item() <= tolerance(q, k, v)


def test_sdpa_gqa_and_causal_top_left():
    q, k, v = torch.randn(1, 8, 9, 16), torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16)
    out = sdpa(q, k, v, is_causal=True, enable_gqa=True)
    ref = F.scaled_dot_product_attention(f64(q), f64(k), f64(v), is_causal=True, enable_gqa=True)
    assert (out.double() - ref).abs().max().item() <= tolerance(q, k, v)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        sdpa(q, k, v)


def test_sdpa_gradients_match_pytorch_including_the_float_mask():
    args = [torch.randn(2, 3, 5, 8, dtype=torch.float64, requires_grad=True),
            torch.randn(2, 3, 6, 8, dtype=torch.float64, requires_grad=True),
            torch.randn(2, 3, 6, 4, dtype=torch.float64, requires_grad=True),
            torch.randn(2, 1, 5, 6, dtype=torch.float64, requires_grad=True)]
    w = torch.randn(2, 3, 5, 4, dtype=torch.float64)
    (sdpa(*args[:3], attn_mask=args[3]) * w).sum().backward()
    ours = [a.grad.clone() for a in args]
    for a in args:
        a.grad = None
    (F.scaled_dot_product_attention(*args[:3], attn_mask=args[3]) * w).sum().backward()
    for mine, theirs in zip(ours, [a.grad for a in args]):
        assert (mine - theirs).abs().max().item() < 1e-12


def test_gradcheck_in_float64():
    q = torch.randn(1, 4, 2, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 5, 1, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 5, 1, 3, dtype=torch.float64, requires_grad=True)
    m = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v, m: _ops.attention(q, k, v, mask=m, causal=True, softcap=3.0)[0],
        (q, k, v, m))


def test_gradcheck_float_mask_with_dropout_sinks_and_score_scale():
    """The mask's gradient is dS summed where it broadcasts, computed by the
    backward itself, with dropout (a fixed seed makes the function
    deterministic), sinks and score_scale. (Sinks and scales are float32
    values inside qkv: float64 differences cannot check their gradients.)"""
    q = torch.randn(2, 4, 2, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 5, 1, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 5, 1, 3, dtype=torch.float64, requires_grad=True)
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float64)
    scale = torch.tensor([1.5, 0.75], dtype=torch.float64)
    for shape in ((2, 2, 4, 5), (1, 4, 1), (5,)):
        m = torch.randn(shape, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(
            lambda q, k, v, m: _ops.attention(q, k, v, mask=m, sinks=sinks, score_scale=scale,
                                              dropout_p=0.3, dropout_seed=5)[0],
            (q, k, v, m))


def test_float_mask_without_requires_grad_gets_no_gradient():
    q, k, v = (torch.randn(1, 3, 1, 4, requires_grad=True) for _ in range(3))
    m = torch.randn(3, 3)
    _ops.attention(q, k, v, mask=m)[0].sum().backward()
    assert m.grad is None and q.grad is not None


def test_opcheck_with_a_float_mask_that_requires_grad():
    """The backward operator's fake kernel gives d_mask's shape when asked
    (lse is not differentiable, so the whole-graph test is left out)."""
    q, k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 6, 1, 8), torch.randn(1, 6, 1, 8)
    mask = torch.randn(4, 6, requires_grad=True)
    torch.library.opcheck(torch.ops.qkv.attention.default, (q, k, v),
                          {"mask": mask, "causal": True},
                          test_utils=("test_schema", "test_autograd_registration",
                                      "test_faketensor"))
    out, lse = torch.ops.qkv.attention(q, k, v, mask=mask.detach(), causal=True)
    for wanted in (True, False):
        torch.library.opcheck(torch.ops.qkv.attention_backward.default,
                              (torch.randn_like(out), q, k, v, out, lse),
                              {"mask": mask.detach(), "causal": True,
                               "mask_requires_grad": wanted},
                              test_utils=("test_schema", "test_faketensor"))


def test_lse_is_not_differentiable():
    q, k, v = (torch.randn(1, 3, 1, 4, requires_grad=True) for _ in range(3))
    _, lse = _ops.attention(q, k, v)
    with pytest.raises(NotImplementedError, match="lse is not differentiable"):
        lse.sum().backward()


def test_opcheck():
    q, k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 6, 1, 8), torch.randn(1, 6, 1, 8)
    torch.library.opcheck(
        torch.ops.qkv.attention.default,
        (q, k, v), {"causal": True, "window_left": 3, "softcap": 2.0})


def test_compiles_without_graph_breaks():
    q, k, v = (torch.randn(1, 2, 6, 8, requires_grad=True) for _ in range(3))
    f = torch.compile(lambda q, k, v: sdpa(q, k, v, is_causal=True).square().sum(),
                      fullgraph=True, backend="aot_eager")
    f(q, k, v).backward()
    ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*ref, is_causal=True).square().sum().backward()
    for a, b in zip((q, k, v), ref):
        assert (a.grad - b.grad).abs().max().item() < 1e-4


def test_dropout_is_reproducible_under_manual_seed():
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    torch.manual_seed(7)
    a = sdpa(q, k, v, dropout_p=0.5)
    torch.manual_seed(7)
    b = sdpa(q, k, v, dropout_p=0.5)
    assert torch.equal(a, b) and not torch.equal(a, sdpa(q, k, v))


# --------------------------------------------------------------------------------------------
# What PyTorch's function accepts, qkv's takes with the same result


@pytest.mark.parametrize("variant", ["upper_left", "lower_right"])
@pytest.mark.parametrize("lengths", [(5, 5), (3, 7), (7, 3)], ids=["square", "wide", "tall"])
def test_causal_bias_objects_match_pytorch(variant, lengths):
    """torch.nn.attention.bias's causal biases mean causal masks aligned to the top
    left or the bottom right, never data; forward and gradients as PyTorch's."""
    import warnings

    from torch.nn.attention import bias

    nq, nk = lengths
    with warnings.catch_warnings():  # lower_right with nq > nk warns of NaN: rows are 0 here
        warnings.simplefilter("ignore")
        mask = getattr(bias, f"causal_{variant}")(nq, nk)
    args = [torch.randn(2, 3, n, 8, dtype=torch.float64, requires_grad=True)
            for n in (nq, nk, nk)]
    w = torch.randn(2, 3, nq, 8, dtype=torch.float64)
    (sdpa(*args, attn_mask=mask) * w).sum().backward()
    ours = [a.grad.clone() for a in args]
    for a in args:
        a.grad = None
    (F.scaled_dot_product_attention(*args, attn_mask=mask) * w).sum().backward()
    for mine, theirs in zip(ours, [a.grad for a in args]):
        assert (mine - theirs).abs().max().item() < 1e-12
    with torch.no_grad():
        got = sdpa(*args, attn_mask=mask)
        want = F.scaled_dot_product_attention(*args, attn_mask=mask)
    assert (got - want).abs().max().item() < 1e-12
    with pytest.raises(ValueError, match="CausalBias should not be used with causal=True"):
        sdpa(*args, attn_mask=mask, is_causal=True)


def test_outputs_are_contiguous_and_errors_are_runtime_errors():
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 7, 8), torch.randn(2, 4, 7, 6)
    for grad in (False, True):
        out = sdpa(*(t.clone().requires_grad_(grad) for t in (q, k, v)))
        assert out.is_contiguous() and out.view(2, 4 * 5 * 6).shape == (2, 120)
    with pytest.raises(RuntimeError, match="pass enable_gqa=True"):
        sdpa(q, k[:, :2], v[:, :2])
    with pytest.raises(RuntimeError, match="options.scale: expected a finite number"):
        sdpa(q, k, v, scale=math.inf)  # refused by the native checks: the same type
    with pytest.raises(TypeError, match="argument 'is_causal' must be bool, not str"):
        sdpa(q, k, v, is_causal="no")
    with pytest.raises(TypeError, match="argument 'enable_gqa' must be bool, not int"):
        sdpa(q, k, v, enable_gqa=1)


def test_dropout_one_gives_zeros_and_zero_gradients():
    args = [torch.randn(2, 3, n, 8, requires_grad=True) for n in (5, 7, 7)]
    out = sdpa(*args, dropout_p=1.0, is_causal=True)
    assert torch.equal(out, torch.zeros(2, 3, 5, 8))
    assert torch.equal(out, F.scaled_dot_product_attention(*args, dropout_p=1.0, is_causal=True))
    out.sum().backward()
    for a in args:
        assert torch.equal(a.grad, torch.zeros_like(a))


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_fast_path_and_operator_agree_bitwise(grad):
    """The native fast path and the registered operator (torch.compile's, and
    the float mask's gradient) compute the same numbers, dropout included."""
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 6)
    mask = torch.rand(2, 1, 5, 7) > 0.2
    for kwargs in (dict(is_causal=True), dict(attn_mask=mask), dict(dropout_p=0.3)):
        inputs = [t.clone().requires_grad_(grad) for t in (q, k, v)]
        torch.manual_seed(3)
        fast = sdpa(*inputs, enable_gqa=True, **kwargs)
        torch.manual_seed(3)
        layout = [t.transpose(1, 2) for t in inputs]
        op, _ = _ops.attention(*layout, mask=None if "attn_mask" not in kwargs else mask,
                               causal=kwargs.get("is_causal", False), align="top_left",
                               dropout_p=kwargs.get("dropout_p", 0.0))
        assert torch.equal(fast, op.transpose(1, 2))
        if grad:
            fast_grads = torch.autograd.grad(fast.square().sum(), inputs)
            op_grads = torch.autograd.grad(op.square().sum(), inputs)
            for a, b in zip(fast_grads, op_grads):
                assert torch.equal(a, b)


def test_gradients_with_batch_dimensions_no_view_merges():
    """Rank-5 inputs whose output's gradient arrives with permuted batch dimensions
    (no single stride walks them): the backward copies it once and matches PyTorch."""
    args = [torch.randn(2, 3, 2, n, 8, dtype=torch.float64, requires_grad=True)
            for n in (5, 6, 6)]
    w = torch.randn(3, 2, 2, 5, 8, dtype=torch.float64)
    (sdpa(*args, is_causal=True).transpose(0, 1) * w).sum().backward()
    ours = [a.grad.clone() for a in args]
    for a in args:
        a.grad = None
    (F.scaled_dot_product_attention(*args, is_causal=True).transpose(0, 1) * w).sum().backward()
    for mine, theirs in zip(ours, [a.grad for a in args]):
        assert (mine - theirs).abs().max().item() < 1e-12


@pytest.mark.parametrize("shape", [(0, 2, 4, 8), (2, 0, 4, 8), (2, 2, 0, 8), (2, 2, 4, 0)],
                         ids=["batch", "heads", "queries", "head_dim"])
def test_empty_dimensions_as_pytorch(shape):
    """Zero-size inputs give PyTorch's results (E = 0: every score is 0, so the
    output is the mean of the values), and a 0-dim tensor is a float argument."""
    q = torch.randn(*shape)
    k, v = torch.randn(*shape[:2], 5, shape[3]), torch.randn(*shape[:2], 5, 6)
    for kwargs in ({}, dict(is_causal=True), dict(scale=torch.tensor(0.5),
                                                  dropout_p=torch.tensor(0.0))):
        got, want = sdpa(q, k, v, **kwargs), F.scaled_dot_product_attention(q, k, v, **kwargs)
        assert got.shape == want.shape and got.is_contiguous()
        if got.numel():
            assert (got - want).abs().max().item() <= 1e-6


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # vmap's per-sample loop
def test_batched_gradients_under_vmap():
    """gradcheck's check_batched_grad runs the backward under vmap: the batched
    gradient goes through the registered operator."""
    args = [torch.randn(2, 4, n, 8, dtype=torch.float64, requires_grad=True) for n in (3, 5, 5)]
    mask = torch.rand(3, 5) > 0.3
    assert torch.autograd.gradcheck(lambda q, k, v: sdpa(q, k, v, attn_mask=mask), args,
                                    check_batched_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v: sdpa(q, k, v, is_causal=True), args,
                                    check_batched_grad=True)


def _eager_with_sinks(q, k, v, sinks, causal):
    """gpt-oss's eager attention in qkv's layout: the sink logit as one more
    softmax column, dropped from the weights."""
    group = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    s = torch.einsum("bihd,bjhd->bhij", q, kk) * q.shape[-1] ** -0.5
    if causal:
        nq, nk = s.shape[-2:]
        keep = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
        s = s.masked_fill(~keep, float("-inf"))
    column = sinks.reshape(1, -1, 1, 1).expand(*s.shape[:-1], 1)
    p = torch.softmax(torch.cat([s, column], -1), -1)[..., :-1]
    return torch.einsum("bhij,bjhd->bihd", p, vv)


def _check_against_definition(seed, parameter, got_fn, want_fn):
    """qkv's operator and autograd against the definition's eager autograd,
    float64 on both sides (a few ulps of the sums' magnitudes): q [2, 5, 4,
    8], k [2, 6, 2, 8], v [2, 6, 2, 3] and a learned [Hq] parameter whose
    values float32 holds exactly (qkv keeps them as float32)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 5, 4, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(2, 6, 2, 8, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(2, 6, 2, 3, dtype=torch.float64, generator=g, requires_grad=True)
    p = torch.tensor(parameter, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(2, 5, 4, 3, dtype=torch.float64, generator=g)
    got, want = got_fn(q, k, v, p), want_fn(q, k, v, p)
    got_grads = torch.autograd.grad(got, (q, k, v, p), dout)
    want_grads = torch.autograd.grad(want, (q, k, v, p), dout)
    assert (got - want).abs().max().item() < 1e-12
    for a, b in zip(got_grads, want_grads):
        assert (a - b).abs().max().item() < 1e-12


@pytest.mark.parametrize("causal", [False, True])
def test_sink_gradients_match_autograd_of_the_definition(causal):
    _check_against_definition(
        5, [0.5, -1.25, 2.0, 0.0],
        lambda q, k, v, sinks: _ops.attention(q, k, v, sinks=sinks, causal=causal)[0],
        lambda q, k, v, sinks: _eager_with_sinks(q, k, v, sinks, causal))


def _eager_with_score_scale(q, k, v, scales, causal, log_n):
    """Scaled dot-product attention whose head h's logits are multiplied by
    scales[h] (and by ln of the keys row i admits, Scalable-Softmax)."""
    group = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    s = torch.einsum("bihd,bjhd->bhij", q, kk) * q.shape[-1] ** -0.5
    nq, nk = s.shape[-2:]
    keep = torch.ones(nq, nk, dtype=torch.bool)
    if causal:
        keep = keep.tril(nk - nq)
    factor = scales.reshape(1, -1, 1, 1)
    if log_n:
        factor = factor * keep.sum(-1).double().log().reshape(1, 1, -1, 1)
    s = (s * factor).masked_fill(~keep, float("-inf"))
    return torch.einsum("bhij,bjhd->bihd", torch.softmax(s, -1), vv)


@pytest.mark.parametrize("causal, log_n", [(False, False), (True, False), (True, True)])
def test_score_scale_gradients_match_autograd_of_the_definition(causal, log_n):
    # The learned per-head logit scale: an operator tensor by its row, so
    # autograd gives it its gradient (d_score_scale) with no code of its own.
    _check_against_definition(
        7, [0.5, -1.25, 2.0, 0.75],
        lambda q, k, v, c: _ops.attention(q, k, v, score_scale=c, score_scale_log_n=log_n,
                                          causal=causal)[0],
        lambda q, k, v, c: _eager_with_score_scale(q, k, v, c, causal, log_n))


def test_sinks_in_bfloat16_are_differentiable():
    q, k, v = (torch.randn(1, 4, 2, 8, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    sinks = torch.zeros(2, dtype=torch.bfloat16, requires_grad=True)
    _ops.attention(q, k, v, sinks=sinks)[0].float().sum().backward()
    assert sinks.grad is not None and sinks.grad.dtype == torch.bfloat16
    assert torch.isfinite(sinks.grad).all() and (sinks.grad != 0).any()

"""qkv.torch.scaled_dot_product_attention against PyTorch's function (the
pinned torch), and torch.ops.qkv.attention under autograd, gradcheck,
opcheck and torch.compile."""

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
    if len(shape) < 3:
        with pytest.raises(ValueError, match="rank >= 3"):
            sdpa(q, k, v)
        return
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


def test_lse_is_not_differentiable():
    q, k, v = (torch.randn(1, 3, 1, 4, requires_grad=True) for _ in range(3))
    _, lse = _ops.attention(q, k, v)
    with pytest.raises(NotImplementedError, match="lse is not differentiable"):
        lse.sum().backward()


def test_opcheck():
    q, k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 6, 1, 8), torch.randn(1, 6, 1, 8)
    torch.library.opcheck(
        torch.ops.qkv.attention.default,
        (q, k, v, None, None, None, None, None, None, True, False, -1, -1, 0.0, 0.0, 0))


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

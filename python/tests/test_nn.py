"""qkv.nn against the modules it replaces: torch.nn.MultiheadAttention itself,
and plain-torch re-statements of timm's SEModule and CbamModule and of the
seq2seq tutorials' additive attention (timm is not a test dependency), plus
the golden files tests/data/make_golden_vision.py wrote with timm."""

from __future__ import annotations

import copy
import json
import math
import os

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import qkv.nn as qnn

# torch's own module warns when key_padding_mask and attn_mask differ in type.
pytestmark = pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data")
U32 = 2.0**-24  # unit roundoff of float32


def load_safetensors(path):
    """The tensors of a safetensors file: an 8-byte little-endian header
    length, a JSON header, then each tensor's row-major bytes."""
    with open(path, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    kinds = {"F64": np.float64, "F32": np.float32, "I64": np.int64}
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        a = np.frombuffer(data[begin:end], dtype=kinds[info["dtype"]]).reshape(info["shape"])
        out[name] = torch.from_numpy(a.copy())
    return out


def assert_close(actual, expected, tol, what=""):
    assert actual.shape == expected.shape, what
    err = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    assert err <= tol, f"{what}: max error {err:.3g} > {tol:.3g}"


# ---------------------------------------------------------------------------
# MultiheadAttention

E, H = 16, 4


def make_pair(dtype=torch.float64, **kwargs):
    """(torch's module, qkv's with torch's state dict loaded)."""
    ref = nn.MultiheadAttention(E, H, dtype=dtype, **kwargs)
    with torch.no_grad():  # non-zero biases, so that loading them is checked too
        for p in ref.parameters():
            p.add_(0.1 * torch.randn_like(p))
    ours = qnn.MultiheadAttention(E, H, dtype=dtype, **kwargs)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def inputs(batch_first, cross, kdim=E, vdim=E, b=3, lq=5, lk=7, dtype=torch.float64):
    def seq(n, d):
        shape = (b, n, d) if batch_first else (n, b, d)
        return torch.randn(shape, dtype=dtype, requires_grad=True)

    query = seq(lq, E)
    if not cross:
        return query, query, query
    key = seq(lk, kdim)
    value = key if kdim == vdim and cross == "shared" else seq(lk, vdim)
    return query, key, value


def run(module, query, key, value, grad_seed=1, **kwargs):
    """Output, weights and the gradients of a fixed loss of the output with
    respect to the inputs and every parameter."""
    out, weights = module(query, key, value, **kwargs)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed),
                    dtype=out.dtype)
    leaves = list({id(t): t for t in (query, key, value)}.values())  # each input once
    params = list(module.parameters())
    grads = torch.autograd.grad((out * g).sum(), leaves + params)
    return out, weights, grads


def masks(kind, b=3, lq=5, lk=7, dtype=torch.float64, seed=0):
    """(key_padding_mask, attn_mask) of a kind, leaving every query at least one key."""
    gen = torch.Generator().manual_seed(seed)
    kpm = attn = None
    padding = torch.zeros(b, lk, dtype=torch.bool)
    padding[1, 4:] = True
    padding[2, :2] = True
    blocked = torch.rand(lq, lk, generator=gen) < 0.3
    blocked[:, 2] = False
    if "kpm_bool" in kind:
        kpm = padding
    if "kpm_float" in kind:
        kpm = torch.randn(b, lk, generator=gen, dtype=dtype).masked_fill(padding, -math.inf)
    if "attn_bool2" in kind:
        attn = blocked
    if "attn_float2" in kind:
        attn = torch.randn(lq, lk, generator=gen, dtype=dtype)
    if "attn_bool3" in kind:
        attn = torch.rand(b * H, lq, lk, generator=gen) < 0.3
        attn[..., 2:4] = False
    if "attn_float3" in kind:
        attn = torch.randn(b * H, lq, lk, generator=gen, dtype=dtype).masked_fill(blocked, -1e4)
    return kpm, attn


MASK_KINDS = ["none", "kpm_bool", "kpm_float", "attn_bool2", "attn_float2", "attn_bool3",
              "attn_float3", "kpm_bool+attn_bool2", "kpm_bool+attn_float3",
              "kpm_float+attn_bool3"]


@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("cross", [False, "shared", "separate"])
def test_mha_matches_torch_float64(mask_kind, batch_first, cross):
    torch.manual_seed(0)
    ref, ours = make_pair(batch_first=batch_first)
    q, k, v = inputs(batch_first, cross)
    kpm, attn = masks(mask_kind, lk=7 if cross else 5)
    for need_weights, average in ((False, True), (True, True), (True, False)):
        kw = dict(key_padding_mask=kpm, attn_mask=attn, need_weights=need_weights,
                  average_attn_weights=average)
        o1, w1, g1 = run(ours, q, k, v, **kw)
        o2, w2, g2 = run(ref, q, k, v, **kw)
        assert_close(o1, o2, 1e-12, "out")
        assert (w1 is None) == (w2 is None)
        if w1 is not None:
            assert w1.dtype == w2.dtype
            assert_close(w1, w2, 1e-13, "weights")
        for a, b in zip(g1, g2):
            assert_close(a, b, 1e-12, "gradient")


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(kdim=6, vdim=10),
        dict(kdim=6, vdim=6, bias=False),
        dict(bias=False),
        dict(add_bias_kv=True),
        dict(add_zero_attn=True),
        dict(add_bias_kv=True, add_zero_attn=True, kdim=6, vdim=10),
    ],
)
@pytest.mark.parametrize("batch_first", [False, True])
def test_mha_options_match_torch(kwargs, batch_first):
    torch.manual_seed(1)
    ref, ours = make_pair(batch_first=batch_first, **kwargs)
    assert list(ours.state_dict()) == list(ref.state_dict())
    kdim, vdim = kwargs.get("kdim", E), kwargs.get("vdim", E)
    q, k, v = inputs(batch_first, "separate", kdim, vdim)
    for kind in ("none", "kpm_bool+attn_float3", "attn_bool2"):
        kpm, attn = masks(kind)
        kw = dict(key_padding_mask=kpm, attn_mask=attn, need_weights=True,
                  average_attn_weights=False)
        o1, w1, g1 = run(ours, q, k, v, **kw)
        o2, w2, g2 = run(ref, q, k, v, **kw)
        assert_close(o1, o2, 1e-12, "out")
        assert_close(w1, w2, 1e-13, "weights")
        for a, b in zip(g1, g2):
            assert_close(a, b, 1e-12, "gradient")


def test_mha_state_dict_round_trip():
    torch.manual_seed(2)
    for kwargs in (dict(), dict(kdim=3, vdim=5, bias=False, add_bias_kv=True)):
        ref = nn.MultiheadAttention(E, H, **kwargs)
        ours = qnn.MultiheadAttention(E, H, **kwargs)
        assert isinstance(ours, nn.MultiheadAttention)
        assert {k: v.shape for k, v in ours.state_dict().items()} == {
            k: v.shape for k, v in ref.state_dict().items()
        }
        ours.load_state_dict(ref.state_dict())
        ref2 = nn.MultiheadAttention(E, H, **kwargs)
        ref2.load_state_dict(ours.state_dict())
        for (n1, a), (n2, b) in zip(ref.state_dict().items(), ref2.state_dict().items()):
            assert n1 == n2 and torch.equal(a, b)
    # Same seed, same initialization as torch's.
    torch.manual_seed(3)
    ref = nn.MultiheadAttention(E, H, add_bias_kv=True)
    torch.manual_seed(3)
    ours = qnn.MultiheadAttention(E, H, add_bias_kv=True)
    for a, b in zip(ref.state_dict().values(), ours.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("batch_first", [False, True])
def test_mha_unbatched(batch_first):
    torch.manual_seed(4)
    ref, ours = make_pair(batch_first=batch_first, kdim=6, vdim=6)
    q = torch.randn(5, E, dtype=torch.float64, requires_grad=True)
    k = torch.randn(7, 6, dtype=torch.float64, requires_grad=True)
    kpm = torch.zeros(7, dtype=torch.bool)
    kpm[5:] = True
    attn = torch.randn(H, 5, 7, dtype=torch.float64)
    for kw in (dict(), dict(key_padding_mask=kpm, attn_mask=attn, average_attn_weights=False)):
        o1, w1, g1 = run(ours, q, k, k, **kw)
        o2, w2, g2 = run(ref, q, k, k, **kw)
        assert o1.shape == (5, E)
        assert_close(o1, o2, 1e-12, "out")
        assert_close(w1, w2, 1e-13, "weights")
        for a, b in zip(g1, g2):
            assert_close(a, b, 1e-12, "gradient")


@pytest.mark.parametrize("with_kpm", [False, True])
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("mask_type", [torch.bool, torch.float64])
def test_mha_is_causal(with_kpm, need_weights, mask_type):
    torch.manual_seed(5)
    ref, ours = make_pair(batch_first=True)
    q, _, _ = inputs(True, False, lq=6)
    if mask_type == torch.bool:
        causal = torch.ones(6, 6, dtype=torch.bool).triu(1)
    else:
        causal = nn.Transformer.generate_square_subsequent_mask(6, dtype=torch.float64)
    kpm = torch.tensor([[False] * 5 + [True]] * 3) if with_kpm else None
    kw = dict(attn_mask=causal, is_causal=True, key_padding_mask=kpm, need_weights=need_weights)
    o1, w1, g1 = run(ours, q, q, q, **kw)
    o2, w2, g2 = run(ref, q, q, q, **kw)
    assert_close(o1, o2, 1e-12, "out")
    if need_weights:
        assert_close(w1, w2, 1e-13, "weights")
    for a, b in zip(g1, g2):
        assert_close(a, b, 1e-12, "gradient")


def test_mha_float_mask_gradient():
    torch.manual_seed(6)
    ref, ours = make_pair(batch_first=True)
    q, k, v = inputs(True, "separate")
    for shape in ((5, 7), (3 * H, 5, 7)):
        attn = torch.randn(shape, dtype=torch.float64, requires_grad=True)
        kpm = torch.zeros(3, 7, dtype=torch.bool)
        kpm[0, 6] = True
        grads = []
        for module in (ours, ref):
            out, _ = module(q, k, v, attn_mask=attn, key_padding_mask=kpm, need_weights=False)
            g = torch.randn(out.shape, generator=torch.Generator().manual_seed(0),
                            dtype=out.dtype)
            grads.append(torch.autograd.grad((out * g).sum(), attn)[0])
        assert_close(grads[0], grads[1], 1e-12, "d attn_mask")


def test_mha_fully_masked_query_gives_zeros_not_nan():
    """A query whose keys are all masked: torch gives NaN, qkv an attention
    output of zeros (so attn_output = out_proj.bias) and weights of zeros."""
    torch.manual_seed(7)
    ref, ours = make_pair(batch_first=True)
    q, k, v = inputs(True, "separate")
    kpm = torch.zeros(3, 7, dtype=torch.bool)
    kpm[1] = True  # batch entry 1 sees no key
    o1, w1 = ours(q, k, v, key_padding_mask=kpm)
    o2, w2 = ref(q, k, v, key_padding_mask=kpm)
    assert torch.isnan(o2[1]).all() and torch.isnan(w2[1]).all()
    assert torch.equal(o1[1], ours.out_proj.bias.detach().expand(5, E))
    assert torch.equal(w1[1], torch.zeros(5, 7, dtype=torch.float64))
    keep = [0, 2]
    assert_close(o1[keep], o2[keep], 1e-12, "out")
    assert_close(w1[keep], w2[keep], 1e-13, "weights")
    # The gradients stay finite.
    o1.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in ours.parameters())
    assert torch.isfinite(q.grad).all()


def test_mha_float32_within_error_model():
    """float32 against float64 on the same (widened) weights and inputs, by
    docs/numerics.md's policy: qkv's float32 error may be at most twice
    torch's own float32 error (the same math in float32, here torch's module
    itself) plus one rounding of the output, u * max|exact|. Both differ from
    the exact result by the rounding of the projections (dot products of
    length E), of the scores and the softmax (length S) and of the weighted
    sums, only in different orders; a faulty kernel is off by far more."""
    torch.manual_seed(8)
    ref32, ours32 = make_pair(dtype=torch.float32, batch_first=True)
    ref64 = copy.deepcopy(ref32).double()
    q, k, v = (x.detach().float().requires_grad_() for x in inputs(True, "separate", lk=33))
    kpm, attn = masks("kpm_bool+attn_float2", lk=33, dtype=torch.float32)
    kw = dict(key_padding_mask=kpm, attn_mask=attn, average_attn_weights=False)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    kw64 = dict(kw, attn_mask=attn.double())
    exact = run(ref64, q64, k64, v64, **kw64)
    naive = run(ref32, q, k, v, **kw)
    fast = run(ours32, q, k, v, **kw)
    pairs = [(fast[0], naive[0], exact[0], "out"), (fast[1], naive[1], exact[1], "weights")]
    pairs += [(a, b, c, "gradient") for a, b, c in zip(fast[2], naive[2], exact[2])]
    for a, b, c, what in pairs:
        assert a.dtype == torch.float32, what
        naive_err = (b.double() - c).abs().max().item()
        tol = 2 * naive_err + U32 * c.abs().max().item()
        assert_close(a, c, tol, what)


def test_mha_dropout():
    torch.manual_seed(9)
    ref, ours = make_pair(batch_first=True, dropout=0.5)
    q, _, _ = inputs(True, False)
    ref.eval()
    ours.eval()  # no dropout: torch's results
    assert_close(ours(q, q, q)[0], ref(q, q, q)[0], 1e-12, "eval")
    ours.train()
    torch.manual_seed(10)
    a, wa = ours(q, q, q)
    torch.manual_seed(10)
    b, _ = ours(q, q, q)
    c, _ = ours(q, q, q)
    assert torch.equal(a, b)  # reproducible under torch.manual_seed
    assert not torch.equal(a, c)
    assert_close(wa, ref(q, q, q)[1], 1e-13, "weights before dropout")
    a.sum().backward()
    assert torch.isfinite(q.grad).all()


def test_mha_errors():
    m = qnn.MultiheadAttention(E, H, batch_first=True)
    x = torch.randn(2, 5, E)
    with pytest.raises(ValueError, match="embed_dim"):
        qnn.MultiheadAttention(10, 4)
    with pytest.raises(ValueError, match="dropout"):
        qnn.MultiheadAttention(E, H, dropout=1.0)
    with pytest.raises(ValueError, match="device"):
        qnn.MultiheadAttention(E, H, device="meta")
    with pytest.raises(ValueError, match="query"):
        m(x[0, 0], x[0, 0], x[0, 0])
    with pytest.raises(ValueError, match=r"key: expected 3 dimensions"):
        m(x, x[0], x)
    with pytest.raises(ValueError, match="embed_dim=16"):
        m(x[..., :8], x, x)
    with pytest.raises(ValueError, match=r"key_padding_mask: expected shape \[2, 5\]"):
        m(x, x, x, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"attn_mask: expected shape \[5, 5\] or \[8, 5, 5\]"):
        m(x, x, x, attn_mask=torch.zeros(4, 5, 5))
    with pytest.raises(TypeError, match="key_padding_mask: expected a bool or floating"):
        m(x, x, x, key_padding_mask=torch.zeros(2, 5, dtype=torch.int64))
    with pytest.raises(TypeError, match="query: expected a torch.Tensor"):
        m(x.numpy(), x, x)
    with pytest.raises(ValueError, match="attn_mask: is_causal=True needs"):
        m(x, x, x, is_causal=True)


# ---------------------------------------------------------------------------
# Squeeze-and-excitation and CBAM: timm's modules restated in plain torch


class RefSE(nn.Module):
    """timm.layers.SEModule with its defaults."""

    def __init__(self, channels, rd_channels, bias=True):
        super().__init__()
        self.fc1 = nn.Conv2d(channels, rd_channels, kernel_size=1, bias=bias)
        self.bn = nn.Identity()
        self.act = nn.ReLU(inplace=True)
        self.fc2 = nn.Conv2d(rd_channels, channels, kernel_size=1, bias=bias)

    def forward(self, x):
        x_se = x.mean((2, 3), keepdim=True)
        x_se = self.fc1(x_se)
        x_se = self.act(self.bn(x_se))
        x_se = self.fc2(x_se)
        return x * x_se.sigmoid()


class RefChannelAttn(nn.Module):
    def __init__(self, channels, rd_channels, mlp_bias=False):
        super().__init__()
        self.fc1 = nn.Conv2d(channels, rd_channels, 1, bias=mlp_bias)
        self.act = nn.ReLU(inplace=True)
        self.fc2 = nn.Conv2d(rd_channels, channels, 1, bias=mlp_bias)

    def forward(self, x):
        x_avg = self.fc2(self.act(self.fc1(x.mean((2, 3), keepdim=True))))
        x_max = self.fc2(self.act(self.fc1(x.amax((2, 3), keepdim=True))))
        return x * (x_avg + x_max).sigmoid()


class RefConvNormAct(nn.Module):
    def __init__(self, kernel_size):
        super().__init__()
        self.conv = nn.Conv2d(2, 1, kernel_size, padding=kernel_size // 2, bias=False)
        self.bn = nn.BatchNorm2d(1)

    def forward(self, x):
        return self.bn(self.conv(x))


class RefSpatialAttn(nn.Module):
    def __init__(self, kernel_size=7):
        super().__init__()
        self.conv = RefConvNormAct(kernel_size)

    def forward(self, x):
        x_attn = torch.cat([x.mean(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)], dim=1)
        return x * self.conv(x_attn).sigmoid()


class RefCbam(nn.Module):
    """timm.layers.cbam.CbamModule with its defaults."""

    def __init__(self, channels, rd_channels, spatial_kernel_size=7, mlp_bias=False):
        super().__init__()
        self.channel = RefChannelAttn(channels, rd_channels, mlp_bias)
        self.spatial = RefSpatialAttn(spatial_kernel_size)

    def forward(self, x):
        return self.spatial(self.channel(x))


def randomize(module, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.rand(p.shape, generator=gen, dtype=p.dtype) - 0.5)
        for name, b in module.named_buffers():
            if name.endswith("running_mean"):
                b.fill_(0.1)
            if name.endswith("running_var"):
                b.fill_(0.8)


def compare_with_reference(ours, ref, x, tol):
    """ref's state dict loaded into ours; outputs and the gradients of x and
    of every parameter (by name) of a fixed loss."""
    ours.load_state_dict(ref.state_dict())
    outs, grads = [], []
    for module in (ours, ref):
        xx = x.detach().clone().requires_grad_()
        y = module(xx)
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(0), dtype=y.dtype)
        names, params = zip(*module.named_parameters())
        gs = torch.autograd.grad((y * g).sum(), (xx,) + params)
        outs.append(y)
        grads.append(dict(zip(("x",) + names, gs)))
    assert_close(outs[0], outs[1], tol, "y")
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert grads[0][name].dtype == grads[1][name].dtype
        assert_close(grads[0][name], grads[1][name], tol, f"grad {name}")


@pytest.mark.parametrize("bias", [True, False])
def test_se_matches_reference(bias):
    torch.manual_seed(11)
    ours = qnn.SqueezeExcitation(64, bias=bias, dtype=torch.float64)
    assert ours.rd_channels == 8
    ref = RefSE(64, 8, bias=bias).double()
    randomize(ref, 0)
    assert list(ours.state_dict()) == list(ref.state_dict())
    compare_with_reference(ours, ref, torch.randn(2, 64, 3, 5, dtype=torch.float64), 1e-13)


@pytest.mark.parametrize("mlp_bias", [False, True])
def test_cbam_matches_reference(mlp_bias):
    torch.manual_seed(12)
    ours = qnn.CBAM(32, mlp_bias=mlp_bias, spatial_kernel_size=5, dtype=torch.float64)
    assert ours.rd_channels == 2
    ref = RefCbam(32, 2, spatial_kernel_size=5, mlp_bias=mlp_bias).double().eval()
    randomize(ref, 1)
    assert list(ours.state_dict()) == list(ref.state_dict())
    compare_with_reference(ours, ref, torch.randn(2, 32, 4, 6, dtype=torch.float64), 1e-13)


def test_vision_float32_and_channels_last():
    torch.manual_seed(13)
    for ours, ref in ((qnn.SqueezeExcitation(32), RefSE(32, 8)), (qnn.CBAM(32), RefCbam(32, 2))):
        ref.eval()
        randomize(ref, 2)
        ours.load_state_dict(ref.state_dict())
        x = torch.randn(2, 32, 5, 4)
        y = ours(x)
        # float32 against float64: sums of at most C + H W + 2 k^2 terms of
        # size O(1) per output, each rounding once; 64 u covers that with a margin.
        exact = copy.deepcopy(ref).double()(x.double())
        assert_close(y, exact, 64 * U32 * (32 + 20 + 2 * 49), type(ours).__name__)
        xc = x.contiguous(memory_format=torch.channels_last).requires_grad_()
        yc = ours(xc)
        assert yc.is_contiguous(memory_format=torch.channels_last)
        assert_close(yc, y, 1e-6, "channels_last")
        yc.sum().backward()
        assert xc.grad.shape == x.shape


@pytest.mark.parametrize("name", ["se", "cbam"])
def test_vision_golden_files_from_timm(name):
    tensors = load_safetensors(os.path.join(DATA, f"{name}_golden.safetensors"))
    x, y = tensors.pop("input.x"), tensors.pop("output.y")
    module = (qnn.SqueezeExcitation if name == "se" else qnn.CBAM)(64, dtype=torch.float64)
    missing, unexpected = module.load_state_dict(tensors, strict=False)
    assert unexpected == []
    assert missing == []  # BatchNorm fills in a missing num_batches_tracked
    assert_close(module(x), y, 1e-13, name)


def test_parameters_share_the_cpp_memory():
    torch.manual_seed(14)
    ref = RefCbam(16, 1).eval()
    randomize(ref, 3)
    ours = qnn.CBAM(16)
    ours.load_state_dict(ref.state_dict())
    native = dict(ours._native.parameters())
    for name, t in list(ours.named_parameters()) + list(ours.named_buffers()):
        if name.endswith("num_batches_tracked"):
            continue
        view = torch.from_dlpack(native[name])
        assert view.data_ptr() == t.data_ptr(), name
        assert torch.equal(view, ref.state_dict()[name]), name
    # An optimizer's in-place step reaches the C++ module.
    x = torch.randn(2, 16, 3, 3)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for module, o in ((ours, opt), (ref, opt_ref)):
        module(x).square().sum().backward()
        o.step()
    assert_close(ours(x), ref(x), 1e-5, "after a step")
    # dtype conversions, deep copies and assign=True rebuild the C++ module.
    double = copy.deepcopy(ours).double()
    ref.load_state_dict(ours.state_dict())
    assert_close(double(x.double()), ref.double()(x.double()), 1e-12, "double")
    assert_close(ours(x), ref(x.double()), 1e-5, "the original after the copy")
    fresh = qnn.CBAM(16)
    fresh.load_state_dict(ref.float().state_dict(), assign=True)
    assert_close(fresh(x), ref(x), 1e-6, "assign=True")
    assert torch.equal(fresh.state_dict()["channel.fc2.weight"], ref.channel.fc2.weight)
    view = torch.from_dlpack(dict(fresh._native.parameters())["channel.fc1.weight"])
    assert view.data_ptr() == fresh.channel.fc1.weight.data_ptr()


def test_same_initialization_as_the_originals():
    for make_ours, make_ref in (
        (lambda: qnn.SqueezeExcitation(48), lambda: RefSE(48, 8)),
        (lambda: qnn.CBAM(48, mlp_bias=True), lambda: RefCbam(48, 3, mlp_bias=True)),
        (lambda: qnn.AdditiveAttention(6), lambda: RefAdditive(6)),
    ):
        torch.manual_seed(15)
        ours = make_ours()
        torch.manual_seed(15)
        ref = make_ref()
        assert list(ours.state_dict()) == list(ref.state_dict())
        for a, b in zip(ours.state_dict().values(), ref.state_dict().values()):
            assert torch.equal(a, b)


def test_vision_errors():
    with pytest.raises(NotImplementedError, match="add_maxpool"):
        qnn.SqueezeExcitation(16, add_maxpool=True)
    with pytest.raises(NotImplementedError, match="act_layer"):
        qnn.CBAM(16, act_layer=nn.GELU)
    with pytest.raises(ValueError, match="spatial_kernel_size"):
        qnn.CBAM(16, spatial_kernel_size=4)
    with pytest.raises(TypeError, match="dtype"):
        qnn.CBAM(16, dtype=torch.int32)
    m = qnn.SqueezeExcitation(16)
    with pytest.raises(ValueError, match=r"x: expected 4 dimensions"):
        m(torch.randn(16, 3, 3))
    with pytest.raises(ValueError, match="channels"):
        m(torch.randn(1, 8, 3, 3))


# ---------------------------------------------------------------------------
# Additive attention


class RefAdditive(nn.Module):
    """The seq2seq tutorials' decoder-step attention, with source lengths
    applied as masked_fill(-1e10) (exact zeros in float64 when a row has a
    valid position)."""

    def __init__(self, hidden_size):
        super().__init__()
        self.attn = nn.Linear(hidden_size * 2, hidden_size)
        self.v = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, decoder_hidden, encoder_outputs, lengths=None):
        src_len = encoder_outputs.shape[1]
        repeated = decoder_hidden.unsqueeze(1).repeat(1, src_len, 1)
        energy = torch.tanh(self.attn(torch.cat((encoder_outputs, repeated), dim=2)))
        scores = self.v(energy).squeeze(2)
        if lengths is not None:
            mask = torch.arange(src_len).unsqueeze(0) < torch.as_tensor(lengths).unsqueeze(1)
            scores = scores.masked_fill(mask == 0, -1e10)
        weights = F.softmax(scores, dim=1)
        context = torch.bmm(weights.unsqueeze(1), encoder_outputs).squeeze(1)
        return context, weights


@pytest.mark.parametrize("lengths", [None, [5, 3, 1]])
def test_additive_matches_reference(lengths):
    torch.manual_seed(16)
    ref = RefAdditive(8).double()
    ours = qnn.AdditiveAttention(8, dtype=torch.float64)
    assert list(ours.state_dict()) == list(ref.state_dict())
    ours.load_state_dict(ref.state_dict())
    hidden = torch.randn(3, 8, dtype=torch.float64)
    enc = torch.randn(3, 5, 8, dtype=torch.float64)
    gc = torch.randn(3, 8, dtype=torch.float64)
    gw = torch.randn(3, 5, dtype=torch.float64)
    results = []
    for module in (ours, ref):
        h, e = hidden.clone().requires_grad_(), enc.clone().requires_grad_()
        context, weights = module(h, e, lengths)
        params = tuple(module.parameters())
        loss = (context * gc).sum() + (weights * gw).sum()
        results.append((context, weights) + torch.autograd.grad(loss, (h, e) + params))
    for what, a, b in zip(["context", "weights", "d hidden", "d encoder", "d attn.weight",
                           "d attn.bias", "d v.weight"], *results):
        assert_close(a, b, 1e-13, what)
    # Only one of the two outputs in the loss.
    context, _ = ours(hidden.clone().requires_grad_(), enc, lengths)
    context.sum().backward()
    assert ours.attn.weight.grad is not None


def test_additive_golden_file_and_empty_rows():
    t = load_safetensors(os.path.join(DATA, "additive_golden.safetensors"))
    ours = qnn.AdditiveAttention(8, dtype=torch.float64)
    ours.load_state_dict({k: t[k] for k in ("attn.weight", "attn.bias", "v.weight")})
    hidden = t["input.hidden"].clone().requires_grad_()
    enc = t["input.encoder_outputs"].clone().requires_grad_()
    lengths = t["input.lengths"].long()
    context, weights = ours(hidden, enc, lengths)
    assert_close(context, t["output.context"], 1e-13, "context")
    assert_close(weights, t["output.weights"], 1e-13, "weights")
    loss = (context * t["grad.d_context"]).sum() + (weights * t["grad.d_weights"]).sum()
    loss.backward()
    for name, got in (("hidden", hidden.grad), ("encoder_outputs", enc.grad),
                      ("attn.weight", ours.attn.weight.grad), ("attn.bias", ours.attn.bias.grad),
                      ("v.weight", ours.v.weight.grad)):
        assert_close(got, t["grad." + name], 1e-12, name)
    # A row of length 0: weights and context of zeros (the reference would
    # spread the weights evenly).
    context, weights = ours(t["input.hidden"], t["input.encoder_outputs"], [0, 2])
    assert torch.equal(weights[0], torch.zeros(5, dtype=torch.float64))
    assert torch.equal(context[0], torch.zeros(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="encoder_outputs: expected 3 dimensions"):
        ours(t["input.hidden"], t["input.hidden"])

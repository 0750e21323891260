"""qkv's own Python API against the float64 NumPy reference (reference.py):
every option, every dtype, NumPy and PyTorch, strided views without copies,
the GIL released during kernels, decoding, RoPE, linear attention, sparse
patterns."""

import ast
import pathlib
import threading
import time
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
import torch

import qkv
import reference

RNG = np.random.default_rng(1234)


def rand(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def problem(b=2, nq=5, nk=7, hq=4, hkv=2, d=8, dv=6):
    return rand(b, nq, hq, d), rand(b, nk, hkv, d), rand(b, nk, hkv, dv)


def as_float(x):
    if isinstance(x, torch.Tensor):
        return x.float().numpy().astype(np.float64)
    return np.asarray(x).astype(np.float64)


OPTIONS = [
    {},
    {"causal": True},
    {"causal": True, "align": "top_left"},
    {"window": (2, 1)},
    {"causal": True, "window": (3, -1)},
    {"key_lengths": [4, 7]},
    {"key_lengths": [3, 6], "causal": True},
    {"mask": RNG.random((5, 7)) > 0.3},
    {"mask": rand(2, 1, 5, 7)},
    {"alibi_slopes": [0.5, 0.25, 0.125, 0.0625]},
    {"softcap": 2.0},
    {"scale": 0.7},
    {"sinks": [0.5, -1.0, 2.0, 0.0]},
    {"sinks": [3.0, -np.inf, 0.25, -2.0], "key_lengths": [0, 5], "causal": True},
]


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(o) or "plain")
def test_matches_reference(opts):
    q, k, v = problem()
    out = qkv.attention(q, k, v, **opts)
    ref, _, _ = reference.attention(q, k, v, **opts)
    bias = 0.0
    if "mask" in opts and opts["mask"].dtype != bool:
        bias = float(np.abs(opts["mask"]).max())
    if "alibi_slopes" in opts:
        bias = 0.5 * 2 * (5 + 7)
    tol = reference.tolerance(q, k, v, np.float32, scale=opts.get("scale"), bias=bias)
    assert np.abs(out - ref).max() <= tol


@pytest.mark.parametrize("dtype", [np.float64, np.float16, ml_dtypes.bfloat16])
def test_dtypes(dtype):
    q, k, v = (x.astype(dtype) for x in problem())
    out = qkv.attention(q, k, v, causal=True)
    assert out.dtype == np.dtype(dtype)
    ref, _, _ = reference.attention(*(x.astype(np.float64) for x in (q, k, v)), causal=True)
    if dtype == np.float64:  # the reference backend, in double
        assert np.abs(out - ref).max() < 1e-12
    else:  # exact conversions in, f32 inside, one rounding out
        tol = reference.tolerance(q.astype(np.float64), k.astype(np.float64),
                                  v.astype(np.float64), dtype)
        assert np.abs(out.astype(np.float64) - ref).max() <= tol


def test_returns_the_callers_kind_and_lse_probs():
    q, k, v = problem()
    r = qkv.attention(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v),
                      causal=True, return_lse=True, return_probs=True)
    assert isinstance(r.out, torch.Tensor) and r.out.dtype == torch.float32
    assert r.lse.shape == (2, 4, 5) and r.probs.shape == (2, 4, 5, 7)
    ref, lse, probs = reference.attention(q, k, v, causal=True)
    assert np.abs(r.lse.numpy() - lse).max() < 1e-5
    assert np.abs(r.probs.numpy() - probs).max() < 1e-6
    t = torch.from_numpy(q).to(torch.bfloat16)
    out = qkv.attention(t, torch.from_numpy(k).bfloat16(), torch.from_numpy(v).bfloat16())
    assert out.dtype == torch.bfloat16
    n = qkv.attention(q, k, v, return_lse=True)
    assert isinstance(n.out, np.ndarray) and n.probs is None


def test_strided_views_match_contiguous():
    q, k, v = problem()
    base = qkv.attention(q, k, v, causal=True)
    # q laid out [B, H, N, D] and viewed as [B, N, H, D]; k a slice of a
    # wider buffer; v from a Fortran-ordered copy; torch transposes.
    qt = np.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    wide = np.zeros((2, 7, 2, 20), np.float32)
    wide[..., 3:11] = k
    vf = np.asfortranarray(v)
    out = qkv.attention(qt, wide[..., 3:11], vf, causal=True)
    assert np.array_equal(out, base)
    tq = torch.from_numpy(np.ascontiguousarray(q.transpose(0, 2, 1, 3))).transpose(1, 2)
    assert np.array_equal(qkv.attention(tq, torch.from_numpy(k), torch.from_numpy(v),
                                        causal=True).numpy(), base)
    assert np.array_equal(qt, q)  # inputs untouched


def test_tensor_views_are_read_as_torch_reads_them():
    # A lazily negated view (torch._neg_view, as autograd makes for some
    # formulas) shares memory with un-negated data; a tensor that requires
    # grad is read like its detach().
    q, k, v = (torch.from_numpy(x) for x in problem())
    expected = qkv.attention(-q, k, v, causal=True)
    negated = torch._neg_view(q)
    assert negated.is_neg()
    assert torch.equal(qkv.attention(negated, k, v, causal=True), expected)
    leaf = (-q).requires_grad_()
    assert torch.equal(qkv.attention(leaf, k, v, causal=True), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_tensors_through_the_exchange_api_match_the_capsule_path(dtype):
    # qkv.attention on plain tensors goes through DLPack's C exchange API
    # (qkv._qkv.attention_exchange); return_lse=True takes the capsule path,
    # the same kernel: the outputs are bitwise equal.
    q, k, v = (torch.from_numpy(x).to(dtype) for x in problem(nq=9, nk=11, d=16, dv=16))
    views = (q, k, v), (q.transpose(1, 2).contiguous().transpose(1, 2), k[:, :, :, :], v)
    for tq, tk, tv in views:
        for opts in ({}, {"causal": True}, {"window": (2, 0), "softcap": 3.0}):
            out = qkv.attention(tq, tk, tv, **opts)
            assert type(out) is torch.Tensor and out.dtype == dtype and out.is_contiguous()
            assert out.shape == (2, 9, 4, 16) and not out.requires_grad
            assert torch.equal(out, qkv.attention(tq, tk, tv, return_lse=True, **opts).out)
    native = qkv._qkv.attention_exchange(q, k, v, qkv._api._DEFAULT_OPTIONS)
    assert torch.equal(native, qkv.attention(q, k, v))


def test_exchange_api_declines_what_it_does_not_take():
    # None: the caller takes the general path, which reports any error.
    q, k, v = (torch.from_numpy(x) for x in problem())
    o = qkv._api._DEFAULT_OPTIONS
    native = qkv._qkv.attention_exchange
    assert native(q.numpy(), k.numpy(), v.numpy(), o) is None  # no exchange API
    assert native(q, k.numpy(), v, o) is None  # mixed types
    assert native(q[0], k, v, o) is None  # not 4-D
    assert native(q.int(), k.int(), v.int(), o) is None  # a dtype qkv does not take
    assert native(q.to("meta"), k.to("meta"), v.to("meta"), o) is None  # not in CPU memory
    # A subclass (an nn.Parameter) goes through the capsule path, unchanged.
    param = torch.nn.Parameter(q.clone())
    assert torch.equal(qkv.attention(param, k, v), qkv.attention(q, k, v))
    with pytest.raises(ValueError, match="head dim"):
        native(q, k[..., :4], v, o)  # the attention call's own checks


def test_inputs_are_not_copied():
    # q of 8 MiB in a transposed layout; the call may allocate its output
    # (B Nq Hq Dv floats, 256 KiB here) and small metadata, not a copy of q.
    q = rand(1, 4096, 8, 64).transpose(0, 1, 2, 3)
    k, v = rand(1, 64, 8, 64), rand(1, 64, 8, 2)
    qkv.attention(q[:, :8], k, v)  # warm up (first-call allocations)
    tracemalloc.start()
    qkv.attention(q, k, v)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < q.nbytes // 4


def test_gil_is_released_while_a_kernel_runs():
    q, k, v = rand(1, 2048, 8, 64), rand(1, 2048, 8, 64), rand(1, 2048, 8, 64)
    stamps = []
    stop = threading.Event()

    def tick():
        while not stop.is_set():
            stamps.append(time.perf_counter())
            time.sleep(0.001)

    t = threading.Thread(target=tick)
    t.start()
    time.sleep(0.01)
    start = time.perf_counter()
    qkv.attention(q, k, v, backend="fast")
    end = time.perf_counter()
    stop.set()
    t.join()
    assert end - start > 0.02, "the call was too fast to tell"
    inside = [s for s in stamps if start + 0.005 < s < end - 0.005]
    assert inside, "no Python thread ran while the kernel did"


def test_threads_follow_torch_until_set():
    torch.set_num_threads(1)
    assert qkv.get_num_threads() == 1
    torch.set_num_threads(2)
    assert qkv.get_num_threads() == 2
    try:
        qkv.set_num_threads(1)
        assert qkv.get_num_threads() == 1
        q, k, v = problem()
        qkv.attention(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v))
        assert torch.get_num_threads() == 2  # qkv's choice does not leak into torch
        with pytest.raises(ValueError, match="n: expected a thread count >= 1, got 0"):
            qkv.set_num_threads(0)
    finally:
        qkv._api._threads = None


def torch_reference(q, k, v, causal):
    """Differentiable float64 attention in torch, for gradients."""
    group = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    s = torch.einsum("bihd,bjhd->bhij", q, kk) / q.shape[-1] ** 0.5
    if causal:
        nq, nk = q.shape[1], k.shape[1]
        i = torch.arange(nq)[:, None] + (nk - nq)
        s = s.masked_fill(torch.arange(nk)[None, :] > i, float("-inf"))
    return torch.einsum("bhij,bjhd->bihd", s.softmax(-1), vv)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_backward_matches_autograd(dtype):
    q, k, v = (x.astype(dtype) for x in problem())
    dout = rand(2, 5, 4, 6).astype(dtype)
    r = qkv.attention(q, k, v, causal=True, return_lse=True)
    g = qkv.attention_backward(q, k, v, r.out, dout, r.lse, causal=True)
    tq, tk, tv = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))
    torch_reference(tq, tk, tv, True).backward(torch.tensor(dout, dtype=torch.float64))
    # f32: each gradient within a few hundred f32 ulps of its size (a sum of
    # Nk + D products of order-1 factors, rounded in f32); f64: double.
    rel = 1e-12 if dtype == np.float64 else 2e-5
    for got, want in ((g.dq, tq.grad), (g.dk, tk.grad), (g.dv, tv.grad)):
        want = want.numpy()
        assert np.abs(got - want).max() <= rel * (1 + np.abs(want).max())


def test_backward_without_out_and_lse_runs_the_forward():
    q, k, v = problem()
    dout = rand(2, 5, 4, 6)
    r = qkv.attention(q, k, v, causal=True, return_lse=True)
    given = qkv.attention_backward(q, k, v, r.out, dout, r.lse, causal=True)
    recomputed = qkv.attention_backward(q, k, v, None, dout, None, causal=True)
    for a, b in zip(given[:3], recomputed[:3]):
        np.testing.assert_array_equal(a, b)  # the same forward, the same backward
    with pytest.raises(ValueError, match="out: required tensor is undefined"):
        qkv.attention_backward(q, k, v, None, dout, r.lse, causal=True)


def test_parameter_gradients_take_the_rows_names():
    # AttentionGradients' fields are dq, dk, dv and then C++'s parameter rows,
    # under C++'s names; each is there exactly when the options use it.
    assert qkv.AttentionGradients._fields == ("dq", "dk", "dv") + qkv.PARAMETER_GRADIENTS
    assert qkv.PARAMETER_GRADIENTS[0] == "d_relative_bias" and "d_sinks" in qkv.PARAMETER_GRADIENTS
    q, k, v = (x.astype(np.float64) for x in problem())
    dout = rand(2, 5, 4, 6).astype(np.float64)
    table = rand(4, 8).astype(np.float64)
    sinks = rand(4).astype(np.float64)
    options = dict(rel_bias=qkv.RelativeBias(table, 16, True), sinks=sinks, causal=True)
    r = qkv.attention(q, k, v, return_lse=True, **options)
    g = qkv.attention_backward(q, k, v, r.out, dout, r.lse, **options)
    assert g.d_relative_bias.shape == (4, 8) and g.d_sinks.shape == (4,)
    assert g.d_additive_w_q is None and g.d_additive_bias is None

    # d_relative_bias by central differences of L = <out, dout> (float64:
    # the step 1e-6 leaves a truncation and rounding error near 1e-9).
    def loss(t):
        out = qkv.attention(q, k, v, **{**options, "rel_bias": qkv.RelativeBias(t, 16, True)})
        return float((out * dout).sum())

    for h, bucket in ((0, 0), (3, 5), (2, 7)):
        step = np.zeros_like(table)
        step[h, bucket] = 1e-6
        numeric = (loss(table + step) - loss(table - step)) / 2e-6
        assert abs(g.d_relative_bias[h, bucket] - numeric) <= 1e-7 * (1 + abs(numeric))


def test_float_mask_gradient_when_asked():
    # d_mask is None unless mask_requires_grad; then the mask's shape, equal
    # to central differences of L = <out, dout> (float64, as above).
    q, k, v = (x.astype(np.float64) for x in problem())
    dout = rand(2, 5, 4, 6).astype(np.float64)
    mask = rand(1, 4, 1, 7).astype(np.float64)
    r = qkv.attention(q, k, v, return_lse=True, mask=mask, causal=True)
    assert qkv.attention_backward(q, k, v, r.out, dout, r.lse, mask=mask, causal=True).d_mask is None
    g = qkv.attention_backward(q, k, v, r.out, dout, r.lse, mask=mask, causal=True,
                               mask_requires_grad=True)
    assert g.d_mask.shape == mask.shape and g.d_mask.dtype == np.float64

    def loss(m):
        return float((qkv.attention(q, k, v, mask=m, causal=True) * dout).sum())

    for index in ((0, 0, 0, 0), (0, 3, 0, 6), (0, 2, 0, 4)):
        step = np.zeros_like(mask)
        step[index] = 1e-6
        numeric = (loss(mask + step) - loss(mask - step)) / 2e-6
        assert abs(g.d_mask[index] - numeric) <= 1e-7 * (1 + abs(numeric))
    with pytest.raises(ValueError, match="mask_requires_grad: expected a float options.mask"):
        qkv.attention_backward(q, k, v, r.out, dout, r.lse, mask_requires_grad=True)


def test_parameter_gradient_outputs_are_named_by_the_rows():
    from qkv import _qkv

    q, k, v = problem()
    o = _qkv.Options()
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    with pytest.raises(ValueError, match="parameter_grads: expected names among d_relative_bias"):
        _qkv.attention_backward_into(q, k, v, None, rand(2, 5, 4, 6), None, dq, dk, dv,
                                     {"d_rel_bias": np.empty((4, 8), np.float32)}, o)
    assert _qkv.parameter_gradients(q, k, v, o) == []


@pytest.mark.parametrize("paged", [False, True])
def test_kv_cache_decode_matches_causal_attention(paged):
    b, hkv, d, n = 2, 2, 8, 9
    cache = qkv.KvCache(batch=b, kv_heads=hkv, head_dim=d, capacity=16,
                        page_size=4 if paged else 0)
    k, v = rand(b, n, hkv, d), rand(b, n, hkv, d)
    cache.append(k, v, counts=[n, n - 3])
    assert cache.lengths() == [n, n - 3]
    q = rand(b, 1, 4, d)
    for sinks in (None, [0.5, -1.0, 2.0, -np.inf]):
        out = qkv.decode_attention(q, cache, sinks=sinks)
        for bb, length in enumerate((n, n - 3)):
            ref, _, _ = reference.attention(q[bb:bb + 1], k[bb:bb + 1, :length],
                                            v[bb:bb + 1, :length], causal=True, sinks=sinks)
            assert np.abs(out[bb:bb + 1] - ref).max() <= reference.tolerance(q, k, v, np.float32)


def test_decode_matmul_precision_medium_within_bf16_rounding():
    # A bf16 cache under matmul_precision="medium": bf16 dot products where
    # the CPU has them (AVX512-BF16), with the queries and the weights
    # rounded to bf16 (docs/numerics.md); elsewhere the highest-precision
    # decode, bit for bit. An f32 cache always decodes at highest.
    b, hkv, hq, d, n = 1, 2, 8, 64, 300
    k, v = rand(b, n, hkv, d), rand(b, n, hkv, d)
    q = rand(b, 1, hq, d)
    bf16 = qkv.KvCache(batch=b, kv_heads=hkv, head_dim=d, capacity=n, dtype="bfloat16")
    bf16.append(k, v)
    highest = qkv.decode_attention(q, bf16)
    medium = qkv.decode_attention(q, bf16, matmul_precision="medium")
    u = 2.0 ** -8
    delta = u * np.abs(q).sum(axis=-1).max() / np.sqrt(d) * np.abs(k).max() * (1 + u)
    bound = (u + np.expm1(2 * delta)) * np.abs(v).max() * 1.1
    assert np.abs(medium - highest).max() <= bound
    f32 = qkv.KvCache(batch=b, kv_heads=hkv, head_dim=d, capacity=n)
    f32.append(k, v)
    np.testing.assert_array_equal(qkv.decode_attention(q, f32, matmul_precision="medium"),
                                  qkv.decode_attention(q, f32))
    with pytest.raises(ValueError, match="matmul_precision: expected 'highest', 'medium' or "
                                         "'int8', got 'high'"):
        qkv.decode_attention(q, bf16, matmul_precision="high")


def test_streaming_kv_cache_decodes_its_sinks_and_window():
    # Page size 2, 2 sinks, a window of 3: of 11 tokens it keeps 0, 1 and
    # 8..10 (pages 2-3, 4-5, 6-7 dropped; dropping 8-9 would leave 1 < 3).
    b, hkv, d, n = 1, 2, 8, 11
    cache = qkv.KvCache(batch=b, kv_heads=hkv, head_dim=d, page_size=2, sink_tokens=2,
                        window_tokens=3)
    assert (cache.sink_tokens, cache.window_tokens, cache.capacity) == (2, 3, 0)
    k, v = rand(b, n, hkv, d), rand(b, n, hkv, d)
    cache.append(k[:, :4], v[:, :4])
    cache.append(k[:, 4:], v[:, 4:])
    assert (cache.length(0), cache.position(0)) == (5, 11)
    kept = [0, 1, 8, 9, 10]
    q = rand(b, 1, 4, d)
    ref, _, _ = reference.attention(q, k[:, kept], v[:, kept], causal=True)
    out = qkv.decode_attention(q, cache)
    assert np.abs(out - ref).max() <= reference.tolerance(q, k, v, np.float32)
    with pytest.raises(ValueError, match="config.capacity: expected 0 with window_tokens > 0"):
        qkv.KvCache(batch=1, kv_heads=1, head_dim=8, capacity=8, page_size=2, window_tokens=3)
    with pytest.raises(ValueError, match="config.sink_tokens: expected a multiple of page_size"):
        qkv.KvCache(batch=1, kv_heads=1, head_dim=8, page_size=2, sink_tokens=1,
                    window_tokens=3)


def test_latent_kv_cache_decodes_with_values_from_the_keys():
    # MLA's latent cache: one row of Dk per token, its first Dv the value.
    b, dk, dv, n = 2, 96, 64, 13
    cache = qkv.KvCache(batch=b, kv_heads=1, head_dim=dk, value_dim=dv, capacity=16,
                        page_size=4, values_in_keys=True)
    assert cache.values_in_keys and cache.value_token_bytes == cache.key_token_bytes == dk * 4
    rows = rand(b, n, 1, dk)
    cache.append(rows, None, counts=[n, n - 5])
    q = rand(b, 2, 8, dk)
    out = qkv.decode_attention(q, cache, scale=0.1)
    assert out.shape == (b, 2, 8, dv)
    for bb, length in enumerate((n, n - 5)):
        k = rows[bb:bb + 1, :length]
        ref, _, _ = reference.attention(q[bb:bb + 1], k, k[..., :dv].copy(), causal=True,
                                        scale=0.1)
        assert np.abs(out[bb:bb + 1] - ref).max() <= reference.tolerance(q, k, k, np.float32)
    with pytest.raises(ValueError, match="v_new: the cache takes its values from the keys"):
        cache.append(rows, rows[..., :dv].copy())
    with pytest.raises(ValueError, match="config.values_in_keys: expected kv_heads 1 .one latent row per token., got 2"):
        qkv.KvCache(batch=1, kv_heads=2, head_dim=dk, capacity=4, values_in_keys=True)


def test_latent_cache_keeps_an_unquantized_rope_tail():
    # A q8_0 latent row whose last tail_dim values stay in bfloat16.
    dk, dv, tail, n = 96, 64, 32, 6
    cache = qkv.KvCache(batch=1, kv_heads=1, head_dim=dk, value_dim=dv, capacity=8,
                        k_dtype="q8_0", values_in_keys=True, tail_dim=tail)
    assert (cache.tail_dim, cache.tail_dtype) == (tail, "bfloat16")
    assert cache.key_token_bytes == (dk - tail) // 32 * 34 + tail * 2
    rows = rand(1, n, 1, dk)
    cache.append(rows, None)
    stored = np.frombuffer(cache.key_page(0, 0), np.uint8).reshape(8, cache.key_token_bytes)
    tail_bits = stored[:n, (dk - tail) // 32 * 34:].copy().view(np.uint16)
    bits = rows[0, :, 0, dk - tail:].astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # to bf16, RNE
    np.testing.assert_array_equal(tail_bits, rounded)
    out = qkv.decode_attention(rand(1, 1, 4, dk), cache, scale=0.1)
    assert out.shape == (1, 1, 4, dv) and np.isfinite(out).all()
    with pytest.raises(ValueError, match="tail_dtype: expected 'bfloat16' or 'float16', got 'float32'"):
        qkv.KvCache(batch=1, kv_heads=1, head_dim=dk, value_dim=dv, capacity=8, k_dtype="q8_0",
                    values_in_keys=True, tail_dim=tail, tail_dtype="float32")
    with pytest.raises(ValueError, match="config.tail_dim: an unquantized tail is for latent caches"):
        qkv.KvCache(batch=1, kv_heads=1, head_dim=dk, value_dim=dv, capacity=8,
                    values_in_keys=True, tail_dim=tail)


def test_rope_backward_undoes_rope():
    x = rand(2, 5, 3, 8).astype(np.float64)
    y = qkv.apply_rope(x.copy(), [0, 3])
    assert not np.allclose(y, x)
    assert np.abs(qkv.apply_rope_backward(y, [0, 3]) - x).max() < 1e-12


def test_linear_attention_matches_definition():
    q, k, v = problem(hq=2, hkv=2)
    out = qkv.linear_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))
    phi = lambda x: np.where(x > 0, x + 1, np.exp(x))  # noqa: E731
    fq, fk = phi(q.astype(np.float64)), phi(k.astype(np.float64))
    s = np.einsum("bjhm,bjhd->bhmd", fk, v)
    z = fk.sum(1)  # [B, H, M]
    ref = np.einsum("bihm,bhmd->bihd", fq, s) / (np.einsum("bihm,bhm->bih", fq, z)[..., None] + 1e-6)
    assert np.abs(out - ref).max() < 1e-12


def test_sparse_window_equals_the_window_option():
    q, k, v = problem(nq=12, nk=12)
    pattern = qkv.SparsePattern.window(3, 0)
    a = qkv.attention(q, k, v, sparse=pattern)
    b = qkv.attention(q, k, v, window=(3, 0))
    ref, _, _ = reference.attention(q, k, v, window=(3, 0))
    assert np.abs(a - ref).max() <= reference.tolerance(q, k, v, np.float32)
    assert np.abs(a - b).max() <= reference.tolerance(q, k, v, np.float32)
    assert "window" in repr(pattern | qkv.SparsePattern.global_tokens([0]))


def test_prefix_lm_pattern_is_its_bool_mask():
    # Bidirectional over the first 5 keys, causal after them (T5's prefix LM).
    q, k, v = (torch.from_numpy(x) for x in problem(nq=12, nk=14))
    n, prefix = q.shape[1], 5
    i, j = np.arange(n)[:, None], np.arange(k.shape[1])[None, :]
    offset = k.shape[1] - n  # qkv's default bottom-right alignment
    mask = torch.from_numpy((j < prefix) | (j <= i + offset))
    pattern = qkv.SparsePattern.prefix_lm(prefix)
    assert repr(pattern) == "SparsePattern((prefix(5) | window(-1, 0)))"
    got = qkv.attention(q, k, v, sparse=pattern)
    assert torch.equal(got, qkv.attention(q, k, v, mask=mask))


def test_decode_takes_patterns_of_positions():
    # Token by token with a window + global-token pattern equals one causal
    # pass with the same pattern.
    q, k, v = problem(b=1, nq=9, nk=9)
    pattern = qkv.SparsePattern.window(2, 0) | qkv.SparsePattern.global_tokens([0])
    cache = qkv.KvCache(batch=1, kv_heads=2, head_dim=8, value_dim=6, capacity=9)
    steps = []
    for t in range(9):
        cache.append(k[:, t:t + 1], v[:, t:t + 1])
        steps.append(qkv.decode_attention(q[:, t:t + 1], cache, sparse=pattern))
    want = qkv.attention(q, k, v, causal=True, sparse=pattern)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), want, rtol=1e-5, atol=1e-6)


def test_linear_attention_step_continues_a_causal_prefill():
    q, k, v = (x.astype(np.float64) for x in problem(nq=9, nk=9, hq=2, hkv=2))
    full = qkv.linear_attention(q, k, v, causal=True)
    out, state = qkv.linear_attention(q[:, :6], k[:, :6], v[:, :6], causal=True,
                                      return_state=True)
    assert np.asarray(state.z).shape == (2, 2, 8)
    rest = qkv.linear_attention_step(q[:, 6:], k[:, 6:], v[:, 6:], state)
    assert np.abs(np.concatenate([out, rest], axis=1) - full).max() < 1e-12
    empty = qkv.linear_attention_state(2, 2, 8, 6, dtype="float64")
    again = qkv.linear_attention_step(q, k, v, empty)
    assert np.abs(again - full).max() < 1e-12


def test_the_package_modules_import_without_a_loop():
    # Every import between qkv's own modules, the lazy ones inside functions
    # too, runs one way: the graph of modules has no cycle.
    package = pathlib.Path(qkv.__file__).parent
    modules = {p.stem for p in package.glob("*.py")}
    edges = {}
    for name in modules:
        tree = ast.parse((package / f"{name}.py").read_text())
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level == 1 or base == "qkv" or base.startswith("qkv."):
                    base = base.removeprefix("qkv").lstrip(".")
                    if base:
                        targets.add(base.split(".")[0])
                    else:
                        targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.Import):
                targets.update(alias.name.split(".")[1] for alias in node.names
                               if alias.name.startswith("qkv."))
        edges[name] = (targets & modules) - {name, "__init__"}
    state = {}

    def visit(name, path):
        if state.get(name) == "done":
            return
        assert state.get(name) != "open", "import loop: " + " -> ".join(path + [name])
        state[name] = "open"
        for target in sorted(edges[name]):
            visit(target, path + [name])
        state[name] = "done"

    for name in sorted(modules):
        visit(name, [])


def test_type_stubs_are_valid_python():
    # The stubs nanobind's stubgen writes from the native signatures ship
    # beside the module; a type checker reads them as Python source.
    from qkv import _qkv

    stub = pathlib.Path(_qkv.__file__).with_name("_qkv.pyi")
    assert stub.is_file(), f"{stub} is missing"
    tree = ast.parse(stub.read_text(), filename=str(stub))
    names = {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    assert {"KvCache", "Options", "attention_into"} <= names

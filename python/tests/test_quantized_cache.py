"""Quantized KV caches from Python: the stored blocks are bit for bit those of
ggml's reference quantizers (the gguf package's numpy ports, which llama.cpp
tests against its C code), decoding a quantized cache equals decoding a
float32 cache that holds the dequantized values, and bad arguments raise
ValueError naming them."""

import gguf
import numpy as np
import pytest

import qkv
import reference

RNG = np.random.default_rng(77)
QTYPES = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}


def rand(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def pages(cache, b, n, which):
    """The stored bytes of sequence b's first n tokens, [n, Hkv, bytes per head]."""
    page = cache.key_page if which == "k" else cache.value_page
    data = b"".join(page(b, i) for i in range(-(-n // cache.page_size)))
    per_token = len(page(b, 0)) // cache.page_size
    return np.frombuffer(data, np.uint8)[:n * per_token].reshape(n, cache.kv_heads, -1)


@pytest.mark.parametrize("k_dtype,v_dtype", [("q8_0", "q4_0"), ("q4_0", "q8_0"),
                                             ("q8_0", "float16")])
@pytest.mark.parametrize("input_dtype", [np.float32, np.float64])
def test_stored_blocks_are_ggml_reference_quantization(k_dtype, v_dtype, input_dtype):
    b, n, hkv, d = 2, 7, 3, 64
    k = rand(b, n, hkv, d, scale=2.0)
    v = rand(b, n, hkv, d)
    k[:, :, :, 5] *= 30  # an outlier channel
    cache = qkv.KvCache(b, hkv, d, capacity=16, page_size=4, k_dtype=k_dtype, v_dtype=v_dtype)
    assert (cache.k_dtype, cache.v_dtype) == (k_dtype, v_dtype)
    cache.append(k.astype(input_dtype), v.astype(input_dtype))
    for bb in range(b):
        want = gguf.quants.quantize(k[bb].astype(np.float32), QTYPES[k_dtype])
        np.testing.assert_array_equal(pages(cache, bb, n, "k"), want)
        if v_dtype in QTYPES:
            want = gguf.quants.quantize(v[bb].astype(np.float32), QTYPES[v_dtype])
            np.testing.assert_array_equal(pages(cache, bb, n, "v"), want)


@pytest.mark.parametrize("k_dtype,v_dtype", [("q8_0", "q8_0"), ("q4_0", "q4_0"),
                                             ("q4_0", "float32")])
def test_decoding_reads_the_dequantized_values(k_dtype, v_dtype):
    b, n, hq, hkv, d = 2, 40, 8, 2, 32
    k, v, q = rand(b, n, hkv, d), rand(b, n, hkv, d), rand(b, 1, hq, d)
    cache = qkv.KvCache(b, hkv, d, capacity=n, k_dtype=k_dtype, v_dtype=v_dtype)
    cache.append(k, v)

    def round_trip(x, name):
        if name not in QTYPES:
            return x
        blocks = gguf.quants.quantize(x, QTYPES[name])
        return gguf.quants.dequantize(blocks, QTYPES[name]).reshape(x.shape)

    exact = qkv.KvCache(b, hkv, d, capacity=n)
    kd, vd = round_trip(k, k_dtype), round_trip(v, v_dtype)
    exact.append(kd, vd)
    np.testing.assert_array_equal(qkv.decode_attention(q, cache), qkv.decode_attention(q, exact))
    ref, _, _ = reference.attention(q, kd, vd, causal=True)
    got = qkv.decode_attention(q, cache)
    assert np.abs(got - ref).max() <= reference.tolerance(q, kd, vd, np.float32)


def test_bad_arguments_raise_value_error_naming_them():
    with pytest.raises(ValueError, match="k_dtype: expected one of float32, bfloat16, float16, "
                                         "q8_0, q4_0 or None"):
        qkv.KvCache(1, 1, 32, capacity=4, k_dtype="q5_0")
    with pytest.raises(ValueError, match="config.value_storage: q4_0 stores blocks of 32 values: "
                                         "expected value_dim a multiple of 32, got 40"):
        qkv.KvCache(1, 1, 32, value_dim=40, capacity=4, v_dtype="q4_0")
    cache = qkv.KvCache(1, 1, 32, capacity=4, k_dtype="q8_0")
    k = rand(1, 1, 1, 32)
    k[0, 0, 0, 3] = np.inf
    with pytest.raises(ValueError, match=r"k_new: q8_0 storage holds finite values .* got inf "
                                         r"at \[0, 0, 0, 3\]"):
        cache.append(k, rand(1, 1, 1, 32))
    assert cache.lengths() == [0]


def test_rotation_spreads_an_outlier_channel():
    # rotate=True: keys and values stored rotated by the Hadamard transform;
    # decoding turns the result back. Float32 storage gives the plain result;
    # q4_0 with an outlier channel moves less from it than without rotation.
    b, n, hq, hkv, d = 1, 64, 4, 1, 64
    k, v, q = rand(b, n, hkv, d), rand(b, n, hkv, d), rand(b, 1, hq, d)
    k[..., 7] *= 25
    v[..., 2] *= 25

    def decode(**kwargs):
        cache = qkv.KvCache(b, hkv, d, capacity=n, **kwargs)
        cache.append(k, v)
        return qkv.decode_attention(q, cache)

    plain = decode()
    ref, _, _ = reference.attention(q, k, v, causal=True)
    tol = reference.tolerance(q, k, v, np.float32)
    assert np.abs(decode(rotate=True) - ref).max() <= 64 * tol
    assert qkv.KvCache(1, 1, 32, capacity=1, rotate=True).rotate
    flat = np.abs(decode(k_dtype="q4_0", v_dtype="q4_0") - plain).max()
    turned = np.abs(decode(k_dtype="q4_0", v_dtype="q4_0", rotate=True) - plain).max()
    assert turned < flat / 2, (turned, flat)
    with pytest.raises(ValueError, match="config.rotate: the Hadamard transform needs head_dim a "
                                         "power of two, got 48"):
        qkv.KvCache(1, 1, 48, capacity=4, rotate=True)

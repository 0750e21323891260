"""qkv's own API in Python: the C++ functions with the C++ names, layouts and
defaults (see include/qkv/*.hpp and docs/semantics.md). Arrays are NumPy
arrays or PyTorch CPU tensors with any strides; results come back as the
same kind of array, written by the kernels in place (no copies)."""

from __future__ import annotations

import collections
from typing import Any, NamedTuple, Optional, Tuple

from . import _arrays
from . import _qkv
from ._arrays import empty, floats, ints, native, optional_native

SparsePattern = _qkv.SparsePattern

_threads: Optional[int] = None  # set_num_threads' choice


def set_num_threads(n: int) -> None:
    """Sets the number of threads qkv's kernels use (from then on, whatever
    torch.set_num_threads says)."""
    global _threads
    if not isinstance(n, int) or isinstance(n, bool):
        raise TypeError(f"n: expected an int, got {type(n).__name__}")
    if n < 1:
        raise ValueError(f"n: expected a thread count >= 1, got {n}")
    _threads = n


def get_num_threads() -> int:
    """The number of threads the next call uses: what set_num_threads chose,
    else torch.get_num_threads() once torch is imported, else OpenMP's
    default (the number of cores)."""
    n = _wanted_threads()
    return _qkv.get_num_threads() if n is None else n


def _wanted_threads() -> Optional[int]:
    if _threads is not None:
        return _threads
    torch = _arrays.torch_module()
    return None if torch is None else torch.get_num_threads()


def _run(fn, *args) -> Any:
    """Calls a native function on get_num_threads() threads and returns its
    result. PyTorch and qkv may share one OpenMP runtime: the count is set
    for the call and put back, so neither changes the other's."""
    n = _wanted_threads()
    before = _qkv.get_num_threads()
    if n is None or n == before:
        return fn(*args)
    _qkv.set_num_threads(n)
    try:
        return fn(*args)
    finally:
        _qkv.set_num_threads(before)


def alibi_slopes(num_heads: int) -> list:
    """ALiBi's head slopes (Press et al. 2022), as a list of floats."""
    return _qkv.alibi_slopes(num_heads)


class Additive(NamedTuple):
    """Parameters of score="additive": s = v^T tanh(W_q q + W_k k + bias)."""

    w_q: Any  # [A, Dq]
    w_k: Any  # [A, Dk]
    v: Any  # [A]
    bias: Any = None  # [A] or None


class RelativeBias(NamedTuple):
    """T5's learned bias table[h, bucket(j - p_i)]."""

    table: Any  # [Hq, num_buckets]
    max_distance: int = 128
    bidirectional: bool = True


class AttentionResult(NamedTuple):
    out: Any  # [B, Nq, Hq, Dv], dtype of q
    lse: Any  # [B, Hq, Nq] float32 (float64 for float64 q), or None
    probs: Any  # [B, Hq, Nq, Nk] float32 (float64), or None


# The learnable parameters' gradients, named and ordered by qkv's rows
# (QKV_ATTENTION_PARAMETERS in qkv/backward.hpp): d_relative_bias,
# d_additive_w_q, d_additive_w_k, d_additive_v, d_additive_bias, d_sinks.
PARAMETER_GRADIENTS: Tuple[str, ...] = tuple(_qkv.parameter_gradient_names)


def parameter_option(gradient: str) -> str:
    """The keyword whose gradient `gradient` is: d_X is X's (d_sinks: sinks).
    Only a parameter passed as one tensor keyword (sinks) is one of them."""
    return gradient[2:]

AttentionGradients = collections.namedtuple(
    "AttentionGradients", ("dq", "dk", "dv") + PARAMETER_GRADIENTS,
    defaults=(None,) * len(PARAMETER_GRADIENTS))
AttentionGradients.__doc__ = (
    "Gradients of attention: dq [B, Nq, Hq, Dq], dk [B, Nk, Hkv, Dk] and dv [B, Nk, Hkv, Dv] "
    "in the dtype of q, then one field per learnable parameter (PARAMETER_GRADIENTS), float32 "
    "(float64 for float64 q) and shaped like the parameter, or None when the options do not "
    "use it.")


def _window(window) -> dict:
    if window is None:
        return {}
    try:
        left, right = window
    except (TypeError, ValueError):
        raise TypeError(f"window: expected a pair (left, right), got {window!r}") from None
    return {"window_left": int(left), "window_right": int(right)}


def _rel_bias(rel_bias) -> dict:
    if rel_bias is None:
        return {}
    if not isinstance(rel_bias, RelativeBias):
        rel_bias = RelativeBias(rel_bias)
    return {"relative_bias": RelativeBias(native(rel_bias.table, "rel_bias.table"),
                                          int(rel_bias.max_distance), rel_bias.bidirectional)}


# Python's spellings of two options: window=(left, right) sets window_left
# and window_right, rel_bias sets relative_bias. Every other keyword is the
# C++ option's own name (_qkv.Options.names).
_SPELLINGS = {"window": _window, "rel_bias": _rel_bias}


def _additive(value, name):
    if value is None:
        return None
    if not isinstance(value, Additive):
        value = Additive(*value)
    return Additive(native(value.w_q, name + ".w_q"), native(value.w_k, name + ".w_k"),
                    native(value.v, name + ".v"), optional_native(value.bias, name + ".bias"))


# How a value of each kind of option crosses into the native Options (the
# kinds of _qkv.Options.kinds): arrays as native arrays, integer and float
# metadata as contiguous int64 and float32.
_CROSSING = {
    "array": optional_native,
    "ints": ints,
    "floats": floats,
    "additive": _additive,
    "relative_bias": lambda value, name: _rel_bias(value).get("relative_bias"),
}


def _options(**options) -> _qkv.Options:
    """The native Options of qkv.attention's keywords (checked by name and
    type there: an unknown keyword raises TypeError)."""
    named = {}
    for name, value in options.items():
        spelling = _SPELLINGS.get(name)
        if spelling is not None:
            named.update(spelling(value))
            continue
        crossing = _CROSSING.get(_KINDS.get(name))
        named[name] = value if crossing is None else crossing(value, name)
    return _qkv.Options(**named)


_KINDS = _qkv.Options.kinds

# Options are never changed once built: calls with every option at its
# default share this one.
_DEFAULT_OPTIONS = _qkv.Options()


def _shape(x: Any, name: str, rank: int) -> Tuple[int, ...]:
    shape = tuple(x.shape)
    if len(shape) != rank:
        raise ValueError(f"{name}: expected {rank} dimensions, got shape {list(shape)}")
    return shape


def attention(q, k, v, *, return_lse: bool = False, return_probs: bool = False, **options):
    """softmax(f(q, k) + biases, masked) v, as qkv::attention (qkv/attention.hpp).

    Shapes (qkv's layout, FlashAttention's):
        q    [B, Nq, Hq, Dq]    float32, float64, float16 or bfloat16
        k    [B, Nk, Hkv, Dk]   Hq a multiple of Hkv (GQA/MQA)
        v    [B, Nk, Hkv, Dv]
        out  [B, Nq, Hq, Dv]    dtype of q
        lse  [B, Hq, Nq]        float32 (float64 for float64 q), with return_lse
        probs [B, Hq, Nq, Nk]   float32 (float64), with return_probs

    Options are keywords named as the fields of qkv::AttentionOptions, every
    default meaning "off" (the list below). Python spells two of them its
    own way: window=(left, right) for window_left and window_right (-1:
    unbounded), rel_bias for relative_bias (a [Hq, buckets] table or
    RelativeBias(table, max_distance, bidirectional)). Enumerations are
    strings ("scaled_dot", "dot", "additive"; "bottom_right", "top_left";
    "automatic", "fast", "reference"); additive=Additive(w_q, w_k, v, bias)
    with score="additive".

    Returns out, or AttentionResult(out, lse, probs) when return_lse or
    return_probs (the one not asked for is None).
    """
    o = _options(**options) if options else _DEFAULT_OPTIONS
    return attention_with(q, k, v, o, return_lse=return_lse, return_probs=return_probs)


def _option_list() -> str:
    """The options' documentation, from qkv::AttentionOptions' rows."""
    lines = []
    for name in _qkv.Options.names:
        doc = getattr(_qkv.Options, name).__doc__ or ""
        lines.append(f"        {name}: {doc.strip()}")
    return "\n".join(lines)


attention.__doc__ += "\n    Options:\n" + _option_list() + "\n"


def attention_with(q, k, v, o: _qkv.Options, *, return_lse=False, return_probs=False, out=None):
    """attention() with prepared options (the drop-in modules' fast path);
    `out`, when given, receives the result."""
    if out is None and not (return_lse or return_probs) and _arrays.exchangeable(q, k, v):
        # PyTorch tensors in and out through DLPack's C exchange API: no
        # capsules, the output allocated from C. None: not applicable here.
        result = _run(_qkv.attention_exchange, q, k, v, o)
        if result is not None:
            return result
    qn, kn, vn = native(q, "q"), native(k, "k"), native(v, "v")
    try:  # one read of each shape; the messages only when one is not 4-D
        (b, nq, hq, _), (_, nk, _, _), (_, _, _, dv) = q.shape, k.shape, v.shape
    except ValueError:
        _shape(q, "q", 4), _shape(k, "k", 4), _shape(v, "v", 4)
        raise
    if out is None:
        out = empty(q, (b, nq, hq, dv))
    lse = empty(q, (b, hq, nq), "stat") if return_lse else None
    probs = empty(q, (b, hq, nq, nk), "stat") if return_probs else None
    _run(
        _qkv.attention_into,
        qn, kn, vn, native(out, "out"), optional_native(lse, "lse"),
        optional_native(probs, "probs"), o,
    )
    if return_lse or return_probs:
        return AttentionResult(out, lse, probs)
    return out


def attention_backward(q, k, v, out, dout, lse, **options) -> AttentionGradients:
    """Gradients of attention(q, k, v, **options) given its out and lse and
    dout = dLoss/dout, as qkv::attention_backward (qkv/backward.hpp). The
    options must be the forward's. out and lse may both be None: the
    backward then computes them (without a forward pass for score="additive"
    with key_lengths as the one mask). Returns AttentionGradients: dq, dk, dv
    and one gradient per learnable parameter (qkv.PARAMETER_GRADIENTS, C++'s
    names), None unless the options use the parameter."""
    return attention_backward_with(q, k, v, out, dout, lse, _options(**options))


def attention_backward_with(q, k, v, out, dout, lse, o, *, grads=None) -> AttentionGradients:
    """attention_backward() with prepared options; `grads`, when given, is a
    (dq, dk, dv) triple that receives the gradients."""
    if grads is None:
        dq, dk, dv = empty(q, q.shape), empty(q, k.shape), empty(q, v.shape)
    else:
        dq, dk, dv = grads
    shapes = _run(_qkv.parameter_gradients, native(q, "q"), native(k, "k"), native(v, "v"), o)
    parameters = {name: empty(q, shape, "stat") for name, shape in shapes}
    _run(
        _qkv.attention_backward_into,
        native(q, "q"), native(k, "k"), native(v, "v"), optional_native(out, "out"),
        native(dout, "dout"), optional_native(lse, "lse"), native(dq, "dq"), native(dk, "dk"),
        native(dv, "dv"), {name: native(t, name) for name, t in parameters.items()}, o,
    )
    return AttentionGradients(dq, dk, dv, **parameters)


class KvCache(_qkv.KvCache):
    """A key/value cache for decoding (qkv/kv_cache.hpp).

    KvCache(batch, kv_heads, head_dim, *, value_dim=0, capacity=0, dtype="float32",
    page_size=0, num_pages=0, k_dtype=None, v_dtype=None, rotate=False,
    sink_tokens=0, window_tokens=0, values_in_keys=False, tail_dim=0,
    tail_dtype="bfloat16"): contiguous
    (page_size 0: each sequence owns `capacity` slots) or paged (a pool of
    num_pages pages of page_size tokens; 0 pages = enough for every sequence
    at capacity). Storage dtype "float32", "bfloat16" or "float16";
    k_dtype and v_dtype store keys and values in their own: one of those or
    ggml's block formats "q8_0" (8.5 bits per value) and "q4_0" (4.5 bits),
    bit-compatible with llama.cpp's --cache-type-k/-v, quantized on append
    (head_dim, value_dim multiples of 32; see docs/numerics.md for the error).
    rotate=True stores keys and values rotated by the normalized Hadamard
    transform of the head dim (powers of two), which decoding undoes: it
    spreads outlier channels before quantizing, as llama.cpp's rotation.
    Properties k_dtype, v_dtype and rotate show the storage; key_page(b, i) and
    value_page(b, i) return a page's stored bytes.
    Streaming (StreamingLLM; paged, capacity 0): window_tokens > 0 keeps each
    sequence's first sink_tokens tokens (a multiple of page_size) and drops
    whole pages of the oldest others while window_tokens recent ones remain;
    length(b) counts the tokens held, position(b) those ever appended (the
    RoPE position of the next one).
    values_in_keys=True makes a latent cache (DeepSeek's MLA): kv_heads 1, one
    row of head_dim values per token, whose first value_dim values are its
    value (stored once); append(k, None) then, rows already rotated. A
    latent cache in "q8_0" or "q4_0" may keep the last tail_dim values of
    each row (its RoPE part past the value, DeepSeek's 64) unquantized in
    tail_dtype ("bfloat16" or "float16"), as FlashMLA does; head_dim -
    tail_dim a multiple of 32, tail_dim <= head_dim - value_dim.

    append(k, v, counts=None, rope=False, rope_base=10000.0,
    rope_interleaved=False, rotary_dim=0): k [B, n, Hkv, Dk], v [B, n, Hkv,
    Dv], the first counts[b] rows to sequence b; with rope, keys are rotated
    at their positions on the way in. Nothing changes when it raises.
    """

    def append(self, k, v, counts=None, rope=False, rope_base=10000.0,
               rope_interleaved=False, rotary_dim=0):
        super().append(native(k, "k"), optional_native(v, "v"), ints(counts, "counts"), rope,
                       rope_base, rope_interleaved, rotary_dim)

    def append_to(self, b, k, v, rope=False, rope_base=10000.0, rope_interleaved=False,
                  rotary_dim=0):
        super().append_to(b, native(k, "k"), optional_native(v, "v"), rope, rope_base,
                          rope_interleaved, rotary_dim)


def decode_attention(q, cache: KvCache, *, return_lse: bool = False, **options):
    """The newest n tokens' queries q [B, n, Hq, Dk] (1 <= n <= 16) against
    everything `cache` holds, causally (qkv/decode.hpp). Options as
    qkv.attention's; decoding takes scale, score="dot", softcap,
    alibi_slopes, window=(left, -1), sparse patterns of positions (windows,
    global tokens, prefix_lm; not block layouts), backend and
    matmul_precision ("medium": a bf16 cache on bf16 dot products where the
    CPU has AVX512-BF16, queries and weights rounded to bf16), and refuses
    the others by name. Returns out [B, n, Hq, Dv], or (out, lse [B, Hq, n])
    with return_lse."""
    o = _options(**options)
    b, n, hq, _ = _shape(q, "q", 4)
    out = empty(q, (b, n, hq, cache.value_dim))
    lse = empty(q, (b, hq, n), "stat") if return_lse else None
    _run(_qkv.decode_attention_into, native(q, "q"), cache, native(out, "out"),
         optional_native(lse, "lse"), o)
    return (out, lse) if return_lse else out


def apply_rope(x, start_positions, *, base=10000.0, interleaved=False, rotary_dim=0):
    """Rotates x [B, n, H, D] in place (RoPE): row t of sequence b at position
    start_positions[b] + t; half-split pairs (Llama) unless interleaved
    (GPT-J). Returns x."""
    _qkv.apply_rope(native(x, "x"), ints(start_positions, "start_positions"), base,
                    interleaved, rotary_dim)
    return x


def apply_rope_backward(grad, start_positions, *, base=10000.0, interleaved=False,
                        rotary_dim=0):
    """The gradient of apply_rope, in place (the inverse rotation). Returns grad."""
    _qkv.apply_rope_backward(native(grad, "grad"), ints(start_positions, "start_positions"),
                             base, interleaved, rotary_dim)
    return grad


LinearAttentionState = _qkv.LinearAttentionState


def linear_attention_state(batch, kv_heads, features, value_dim, dtype="float32"):
    """The state of an empty prefix (zeros): `.s` [B, Hkv, M, Dv] and `.z`
    [B, Hkv, M], arrays over the state's own memory (np.asarray or
    torch.from_dlpack read them without a copy); dtype "float32" or
    "float64"."""
    return _qkv.LinearAttentionState(batch, kv_heads, features, value_dim, dtype)


def linear_attention(q, k, v, *, feature_map="elu_plus_one", causal=False, normalize=True,
                     eps=1e-6, chunk=64, return_state=False, backend="automatic"):
    """Linear attention (Katharopoulos et al. 2020), qkv/linear.hpp:
    out_i = phi(q_i)^T S / (phi(q_i)^T z + eps), S = sum_j phi(k_j) v_j^T,
    z = sum_j phi(k_j) over all keys (causal: keys j <= i). q [B, Nq, Hq, D],
    k [B, Nk, Hkv, D], v [B, Nk, Hkv, Dv]; returns out [B, Nq, Hq, Dv], or
    (out, state) with return_state (causal only): the state after the last
    key, for linear_attention_step."""
    b, nq, hq, _ = _shape(q, "q", 4)
    out = empty(q, (b, nq, hq, _shape(v, "v", 4)[3]))
    state = None
    if return_state:
        if not causal:
            raise ValueError("return_state: expected causal=True (a state continues a causal "
                             "pass), got causal=False")
        features = _shape(k, "k", 4)[3]
        dtype = "float64" if str(getattr(q, "dtype", "")).endswith("float64") else "float32"
        state = _qkv.LinearAttentionState(b, k.shape[2], features, v.shape[3], dtype)
    _run(_qkv.linear_attention_into, native(q, "q"), native(k, "k"), native(v, "v"),
         native(out, "out"), feature_map, causal, normalize, eps, chunk, backend, state)
    return (out, state) if return_state else out


def linear_attention_step(q, k, v, state, *, feature_map="elu_plus_one", normalize=True,
                          eps=1e-6, chunk=64, backend="automatic"):
    """Continues a causal linear attention from `state` with n new tokens: q
    [B, n, Hq, D], k [B, n, Hkv, D], v [B, n, Hkv, Dv] -> out [B, n, Hq, Dv];
    `state` advances past the new keys (n = 1 decodes a token)."""
    b, n, hq, _ = _shape(q, "q", 4)
    out = empty(q, (b, n, hq, _shape(v, "v", 4)[3]))
    _run(_qkv.linear_attention_step_into, native(q, "q"), native(k, "k"), native(v, "v"), state,
         native(out, "out"), feature_map, normalize, eps, chunk, backend)
    return out


def linear_attention_backward(q, k, v, dout, *, feature_map="elu_plus_one", causal=False,
                              normalize=True, eps=1e-6, chunk=64, backend="automatic"):
    """Gradients (dq, dk, dv) of linear_attention with the same options."""
    dq, dk, dv = empty(q, q.shape), empty(q, k.shape), empty(q, v.shape)
    _run(_qkv.linear_attention_backward_into, native(q, "q"), native(k, "k"), native(v, "v"),
                                        native(dout, "dout"), native(dq, "dq"),
                                        native(dk, "dk"), native(dv, "dv"), feature_map,
                                        causal, normalize, eps, chunk, backend)
    return dq, dk, dv

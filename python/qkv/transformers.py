"""qkv as an attention implementation of Hugging Face Transformers.

    import qkv.transformers
    qkv.transformers.register()                       # once per process
    model = AutoModel.from_pretrained(path, attn_implementation="qkv")

register() adds an attention function named "qkv" to Transformers'
AttentionInterface, and to its AttentionMaskInterface the mask builder that
Transformers uses for its own "sdpa" implementation (boolean masks, True =
attend, and None where PyTorch's SDPA would rely on its is_causal flag). The
attention function computes exactly what "sdpa" computes for the same call
(scaled dot products, the model's scaling, softcap where the model passes
one, grouped K/V heads without repeating them), on qkv's kernels:

* no mask: causal where the module is causal and more than one query is
  given (top-left, PyTorch's convention), else full attention;
* a boolean mask that is a causal and/or sliding-window band cut by key
  lengths (right padding) becomes qkv's causal flag, window and
  key_lengths, so fully masked tiles are skipped and no mask is read; any
  other mask (left padding, packed sequences, images among text) is passed
  as an explicit mask. The mapping is checked element by element against
  the mask once per mask tensor, so it never changes a result;
* float masks and position biases are added to the scores, as "sdpa" does.

`output_attentions=True` returns the probabilities from the same fused call.
In training (a tensor that requires grad) the call goes through qkv's
registered operator, whose backward is qkv's fused backward; weights asked
for there come from a second call, without gradient and before dropout
("eager" returns them after dropout, differentiable).

QkvCache(config, max_cache_len, k_dtype=...) is a Transformers Cache whose
keys and values live in qkv.KvCache objects (float32, bfloat16, float16,
q8_0, q4_0); with it, the attention function decodes from them in place.
See docs/models.md.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Optional, Tuple

import torch

from . import _api, _ops

try:  # the cache classes need Transformers; the attention function does not
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError:  # pragma: no cover - Transformers absent
    Cache, CacheLayerMixin = object, object

NAME = "qkv"


def register(name: str = NAME) -> str:
    """Registers qkv's attention (and the matching mask builder) with
    Transformers under `name`; returns the name to pass as
    `attn_implementation`. Calling it again is harmless."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


class _Structure:
    """qkv options equivalent to a boolean mask: key_lengths [B] (None: all
    keys), causal with its alignment, and the window's left size (-1:
    none)."""

    __slots__ = ("key_lengths", "causal", "top_left", "window_left")

    def __init__(self, key_lengths, causal, top_left, window_left):
        self.key_lengths = key_lengths
        self.causal = causal
        self.top_left = top_left
        self.window_left = window_left


def _band(lengths: torch.Tensor, nq: int, nk: int, causal: bool, top_left: bool,
          window_left: int) -> torch.Tensor:
    """The mask qkv applies for these options, [Bm, Nq, Nk] (True = attend),
    per docs/semantics.md: j < length; with causal j <= p_i, with a window
    j >= p_i - left, where p_i = i (top-left) or i + length - nq."""
    j = torch.arange(nk)
    lengths = lengths.view(-1, 1, 1)
    admit = j < lengths
    if causal:
        i = torch.arange(nq).view(1, nq, 1)
        p = i if top_left else i + lengths - nq
        admit = admit & (j <= p)
        if window_left >= 0:
            admit = admit & (j >= p - window_left)
    return admit.expand(-1, nq, nk)


def _find_structure(mask: torch.Tensor, causal: bool,
                    sliding_window: Optional[int]) -> Optional[_Structure]:
    """The qkv options that admit exactly the keys of boolean `mask`
    [Bm, 1, Nq, Nk], among those a model of this kind produces (its causal
    flag, its sliding window, right padding), or None."""
    if mask.dim() != 4 or mask.shape[1] != 1:
        return None
    m = mask[:, 0]
    nq, nk = m.shape[-2], m.shape[-1]
    seen = m.any(dim=1)  # [Bm, Nk]: the keys some query admits
    lengths = (seen * torch.arange(1, nk + 1)).amax(dim=1) if nk > 0 else seen.sum(1)
    window_left = sliding_window - 1 if causal and sliding_window else -1
    candidates = [(True, True), (True, False)] if causal else [(False, True)]
    for is_causal, top_left in candidates:
        if torch.equal(_band(lengths, nq, nk, is_causal, top_left, window_left), m):
            full = bool((lengths == nk).all())
            return _Structure(None if full else lengths.to(torch.int64), is_causal, top_left,
                              window_left)
    return None


# The structures of recently seen masks: a model passes one mask tensor (or
# two, for alternating sliding and full layers) to every layer of a forward.
_SEEN: list = []
_SEEN_SIZE = 4


def _structure(mask: torch.Tensor, causal: bool,
               sliding_window: Optional[int]) -> Optional[_Structure]:
    # Inference tensors (torch.inference_mode, as sentence-transformers'
    # encode uses) have no version counter: they are remembered by identity.
    key = (-1 if mask.is_inference() else mask._version, causal, sliding_window)
    for ref, k, found in _SEEN:
        if ref() is mask and k == key:
            return found
    found = _find_structure(mask, causal, sliding_window)
    _SEEN.insert(0, (weakref.ref(mask), key, found))
    del _SEEN[_SEEN_SIZE:]
    return found


@functools.lru_cache(maxsize=1)
def _collector():
    """Transformers' record of the outputs a forward collects (None where
    this version has none)."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # pragma: no cover - older Transformers pass the flag
        return None
    return _active_collector


def _wants_weights(kwargs: dict) -> bool:
    """Whether the caller records attention weights (output_attentions)."""
    if kwargs.get("output_attentions"):
        return True
    collector = _collector()  # Transformers records them with hooks
    collected = None if collector is None else collector.get()
    return isinstance(collected, dict) and "attentions" in collected


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    softcap: Optional[float] = None,
    sliding_window: Optional[int] = None,
    position_bias: Optional[torch.Tensor] = None,
    **kwargs: Any,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Transformers' attention-function interface on qkv.

    Shapes (Transformers'): query [B, Hq, Nq, D], key [B, Hkv, Nk, D],
    value [B, Hkv, Nk, Dv] (Hq a multiple of Hkv), attention_mask None,
    bool [B or 1, 1, Nq, Nk] (True = attend) or float (added). Returns
    (out [B, Nq, Hq, Dv] contiguous, weights [B, Hq, Nq, Nk] or None).
    Learned attention sinks (gpt-oss passes them as s_aux, [Hq]) join each
    row's softmax denominator."""
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    layer = getattr(key, "_qkv_cache_layer", None)
    if layer is not None:  # the keys and values wait in a QkvCache layer
        return layer.attend(query, attention_mask, scaling, softcap, sliding_window, sinks,
                            _wants_weights(kwargs))
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    nq = query.shape[2]
    mask = attention_mask
    if position_bias is not None:  # as "sdpa": the bias as a float mask
        from transformers.integrations.sdpa_attention import create_position_bias_mask

        mask = create_position_bias_mask(position_bias, mask, causal and nq > 1 and mask is None,
                                          query, key)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    # qkv's options, by the rows' names: one dict for every call below.
    options = dict(scale=None if scaling is None else float(scaling), causal=False,
                   align="top_left", window_left=-1, window_right=-1, key_lengths=None,
                   mask=None, softcap=float(softcap) if softcap else 0.0, sinks=sinks)
    if mask is None:
        options["causal"] = bool(causal and nq > 1)
    elif mask.dtype == torch.bool:
        found = _structure(mask, bool(causal), sliding_window)
        if found is None:
            options["mask"] = mask
        else:
            options.update(causal=found.causal,
                           align="top_left" if found.top_left else "bottom_right",
                           window_left=found.window_left,
                           window_right=-1 if found.window_left < 0 else 0,
                           key_lengths=found.key_lengths)
    else:
        options["mask"] = mask

    weights = None
    wants_weights = _wants_weights(kwargs)
    trains = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (query, key, value, options["mask"], sinks))
    if trains or dropout > 0:
        out, _ = _ops.attention(q, k, v, dropout_p=float(dropout), **options)
        if wants_weights:
            with torch.no_grad():
                weights = _plain(q, k, v, options, True)[1]
    else:
        out, weights = _plain(q, k, v, options, wants_weights)
    if weights is not None:
        weights = weights.to(query.dtype)
    return out, weights


@functools.lru_cache(maxsize=64)
def _scalar_options(**options):
    """Prepared options of a call without tensors among them (no mask, key
    lengths or sinks): every layer of a model, and every decoding step,
    reuses them instead of building them again."""
    return _api._options(**options)


_TENSOR_OPTIONS = ("mask", "key_lengths", "sinks")


def _plain(q, k, v, options: dict, probs: bool):
    """One call of qkv.attention (no autograd) with options by the rows'
    names: (out, probs or None)."""
    scalars = {name: value for name, value in options.items() if name not in _TENSOR_OPTIONS}
    if all(options[name] is None for name in _TENSOR_OPTIONS):
        o = _scalar_options(**scalars)
    else:
        sinks, mask = options["sinks"], options["mask"]
        o = _api._options(**scalars, key_lengths=options["key_lengths"],
                          mask=None if mask is None else mask.detach(),
                          sinks=None if sinks is None else sinks.detach().float())
    r = _api.attention_with(q.detach(), k.detach(), v.detach(), o, return_probs=probs)
    return (r.out, r.probs) if probs else (r, None)


# Queries per decode_attention call (its limit): longer inputs (the prompt)
# are appended and attended in chunks of this many tokens.
_DECODE_CHUNK = 16


class QkvCacheLayer(CacheLayerMixin):
    """One attention layer's keys and values in a qkv.KvCache (made at the
    first update, from the states' shapes). update() keeps the new states
    aside and returns them marked; qkv's attention function then appends
    them and decodes from the cache, up to 16 queries per call."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, max_cache_len: int, storage: dict):
        super().__init__()
        self.max_cache_len = max_cache_len  # 0: streaming, unbounded
        # KvCache keyword arguments: k_dtype, v_dtype, page_size, rotate,
        # sink_tokens, window_tokens
        self.storage = storage
        self.cache: Optional[_api.KvCache] = None
        self.pending: Optional[Tuple[torch.Tensor, torch.Tensor]] = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.cache = _api.KvCache(b, h, d, value_dim=value_states.shape[-1],
                                  capacity=self.max_cache_len, **self.storage)
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> Tuple[torch.Tensor, torch.Tensor]:
        """Keeps key_states [B, Hkv, n, Dk] and value_states [B, Hkv, n, Dv]
        for the attention call that follows; returns them, marked."""
        if self.pending is not None:
            raise ValueError(
                "QkvCache: the previous keys and values of this layer were never attended; "
                "a QkvCache is read by qkv's attention only (attn_implementation=\"qkv\")")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, h, n, d = key_states.shape
        expected = (self.cache.batch, self.cache.kv_heads, self.cache.head_dim)
        if (b, h, d) != expected:
            raise ValueError(f"QkvCache: key_states [B, Hkv, n, Dk] expected B, Hkv, Dk = "
                             f"{expected}, got {(b, h, d)}")
        if self.max_cache_len and self.get_seq_length() + n > self.max_cache_len:
            raise ValueError(f"QkvCache: max_cache_len {self.max_cache_len} exceeded: "
                             f"{self.get_seq_length()} tokens held, {n} more given")
        self.pending = (key_states, value_states)
        key_states._qkv_cache_layer = self
        return key_states, value_states

    def attend(self, query: torch.Tensor, mask: Optional[torch.Tensor], scaling, softcap,
               sliding_window: Optional[int], sinks, wants_weights: bool) -> Tuple[torch.Tensor, None]:
        """Appends the pending states and decodes query [B, Hq, n, Dk]
        against the cache (the queries are the n newest tokens, causal);
        returns (out [B, n, Hq, Dv], None)."""
        k, v = self.pending
        n = query.shape[2]
        if k.shape[2] != n:
            raise ValueError(f"QkvCache: query has {n} tokens, the keys given to the cache "
                             f"{k.shape[2]}")
        if wants_weights:
            raise ValueError("QkvCache: output_attentions is not supported (decoding returns no "
                             "probabilities); use Transformers' DynamicCache for them")
        if torch.is_grad_enabled() and any(t.requires_grad for t in (query, k, v)):
            raise ValueError("QkvCache: decoding only (no gradient); train without a cache")
        window = _cache_window(mask, self.get_seq_length(), n, sliding_window)
        if window >= 0 and self.cache.window_tokens:
            raise ValueError("QkvCache: a streaming cache (window_tokens > 0) does not take "
                             f"sliding-window layers, got a window of {window + 1} tokens")
        self.pending = None
        options = dict(scale=None if scaling is None else float(scaling),
                       softcap=float(softcap) if softcap else 0.0,
                       sinks=None if sinks is None else sinks.detach().float())
        if window >= 0:
            options["window_left"] = window
        q = query.detach().transpose(1, 2)
        k, v = k.detach().transpose(1, 2), v.detach().transpose(1, 2)
        # A streaming cache drops tokens as it goes: one query at a time then,
        # so that each sees what the cache held when its token came.
        chunk = 1 if self.cache.window_tokens else _DECODE_CHUNK
        outs = []
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            self.cache.append(k[:, s:e].contiguous(), v[:, s:e].contiguous())
            outs.append(_api.decode_attention(q[:, s:e].contiguous(), self.cache, **options))
        return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), None

    def get_mask_sizes(self, query_length: int) -> Tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        """Tokens seen (streaming: more than the cache holds), the next
        token's position."""
        seen = 0 if self.cache is None else self.cache.position(0)
        return seen + (0 if self.pending is None else self.pending[0].shape[2])

    def get_max_length(self) -> int:
        return self.max_cache_len or -1

    def reset(self) -> None:
        self.cache, self.pending, self.is_initialized = None, None, False

    def offload(self):  # the cache is in host memory already
        pass

    def prefetch(self):
        pass

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise ValueError("QkvCache: beam search (reorder_cache) is not supported")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            raise ValueError("QkvCache: batch_repeat_interleave on a filled cache is not supported")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            raise ValueError("QkvCache: batch_select_indices on a filled cache is not supported")


def _cache_window(mask: Optional[torch.Tensor], nk: int, nq: int,
                  sliding_window: Optional[int]) -> int:
    """The left window size (-1: none) of the mask a cached call gets, which
    must be the causal band of the n newest queries over all nk keys of
    every sequence (no padding); anything else is refused."""
    if mask is None:
        return -1
    found = None
    if mask.dtype == torch.bool and mask.shape[-1] == nk:
        found = _structure(mask, True, sliding_window)
    if found is None or found.key_lengths is not None or (found.top_left and nq != nk):
        raise ValueError(
            "QkvCache: attention_mask must be causal over every cached token (no padding); "
            f"got a {mask.dtype} mask of shape {list(mask.shape)} that is not")
    return found.window_left


class QkvCache(Cache):
    """A Transformers cache whose keys and values live in qkv.KvCache
    objects, one per layer, in any of their storages, e.g. ggml's q8_0 and
    q4_0 blocks; qkv's attention (attn_implementation="qkv") decodes from
    them directly, nothing is dequantized in between.

        cache = QkvCache(model.config, max_cache_len=1024, k_dtype="q8_0", v_dtype="q8_0")
        model.generate(**inputs, past_key_values=cache)

    max_cache_len: the most tokens a sequence may hold (prompt included).
    k_dtype, v_dtype: "float32", "bfloat16", "float16", "q8_0" or "q4_0"
    (v_dtype None: k_dtype). page_size, rotate: as qkv.KvCache's.
    sink_tokens, window_tokens: streaming (StreamingLLM), as qkv.KvCache's:
    with window_tokens > 0 (page_size > 0, max_cache_len 0) each layer keeps
    the first sink_tokens tokens and the window_tokens or more recent ones,
    and generation goes on without bound; keys keep their positions. Every
    attention reads the cache, the prompt's included (appended 16 tokens at a
    time), as llama.cpp's caches do. The batch's sequences must be equally
    long (no padding mask); greedy or sampled decoding, not beam search;
    decoder layers with full or sliding-window attention (the window is
    applied, all tokens are kept)."""

    def __init__(self, config, max_cache_len: int = 0, *, k_dtype: str = "float32",
                 v_dtype: Optional[str] = None, page_size: int = 0, rotate: bool = False,
                 sink_tokens: int = 0, window_tokens: int = 0):
        if Cache is object:
            raise ImportError("QkvCache needs the transformers package")
        text = config.get_text_config(decoder=True)
        kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
        if not kinds <= {"full_attention", "sliding_attention"}:
            raise ValueError("QkvCache: layer_types expected full_attention or "
                             f"sliding_attention, got {sorted(kinds)}")
        streaming = isinstance(window_tokens, int) and window_tokens > 0
        if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) \
                or (max_cache_len != 0 if streaming else max_cache_len < 1):
            expected = "0 with window_tokens > 0 (streaming is unbounded)" if streaming \
                else "an int >= 1"
            raise ValueError(f"QkvCache: max_cache_len expected {expected}, got {max_cache_len!r}")
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        storage = dict(k_dtype=k_dtype, v_dtype=v_dtype or k_dtype, page_size=page_size,
                       rotate=rotate, sink_tokens=sink_tokens, window_tokens=window_tokens)
        # A one-sequence cache of the model's shape checks the settings now.
        _api.KvCache(1, getattr(text, "num_key_value_heads", None) or heads, head_dim,
                     capacity=0 if streaming else 1, **storage)
        super().__init__(layers=[QkvCacheLayer(max_cache_len, storage)
                                 for _ in range(text.num_hidden_layers)])

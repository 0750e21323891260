"""A drop-in for torch.nn.functional.scaled_dot_product_attention on qkv.

    from qkv.torch import scaled_dot_product_attention
    out = scaled_dot_product_attention(q, k, v, is_causal=True)  # [..., Hq, L, Ev]

Same arguments, defaults, layout and results as PyTorch's function (checked
against torch 2.15 in python/tests/test_torch.py), differentiable (through
the registered operator torch.ops.qkv.attention, so torch.autograd and
torch.compile see one op) with gradients to query, key, value and a float
attn_mask. Differences:

* Tensors not on the CPU are passed to PyTorch's own function.
* A query row whose keys are all masked gives 0 and a zero gradient, as
  PyTorch 2.15 does on CPU (older PyTorch returned NaN there).
* Dropout draws its seed from torch's generator (torch.manual_seed makes it
  reproducible), but the kept weights differ from PyTorch's.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from . import _ops

__all__ = ["scaled_dot_product_attention"]


def _fail(message: str) -> None:
    raise ValueError(f"scaled_dot_product_attention: {message}")


def _mask_4d(mask: Tensor, batch_shape, heads: int, length: int, source: int) -> Tensor:
    """attn_mask broadcast (NumPy rules) to [*batch_shape, H, L, S], as a
    rank-4 [B, H or 1, L or 1, S or 1] tensor (a view unless batch dims
    must merge)."""
    full_rank = len(batch_shape) + 3
    if mask.dim() > full_rank:
        _fail(f"attn_mask: expected at most {full_rank} dimensions, got {mask.dim()}")
    mask = mask.reshape((1,) * (full_rank - mask.dim()) + tuple(mask.shape))
    if len(batch_shape) == 1:
        return mask
    b = math.prod(batch_shape)
    tail = tuple(mask.shape[-3:])
    return mask.expand(*batch_shape, *tail).reshape(b, *tail)


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
) -> Tensor:
    """softmax(query key^T * scale + attn_mask) value, as PyTorch's function.

    Shapes: query [..., Hq, L, E], key [..., Hkv, S, E], value [..., Hkv, S,
    Ev], result [..., Hq, L, Ev] (dtype of query). The leading dimensions
    `...` of all three are equal; Hq == Hkv unless enable_gqa, where Hkv
    divides Hq. attn_mask broadcasts to [..., Hq, L, S]: bool (True = take
    part in attention) or float (added to the scores). is_causal keeps key j
    for query i when j <= i (top-left alignment) and excludes attn_mask.
    scale defaults to 1 / sqrt(E). dropout_p drops weights on every call.
    """
    if not (query.is_cpu and key.is_cpu and value.is_cpu):
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
            scale=scale, enable_gqa=enable_gqa)
    # Messages are formatted only for a failed check: this runs on every call.
    rank = query.dim()
    if rank < 3 or key.dim() != rank or value.dim() != rank:
        _fail(f"expected query, key and value of the same rank >= 3, got shapes "
              f"{list(query.shape)}, {list(key.shape)}, {list(value.shape)}")
    batch_shape = query.shape[:-3]
    if key.shape[:-3] != batch_shape or value.shape[:-3] != batch_shape:
        _fail(f"expected equal leading dimensions, got shapes {list(query.shape)}, "
              f"{list(key.shape)}, {list(value.shape)}")
    hq, length, _ = query.shape[-3:]
    hkv, source, _ = key.shape[-3:]
    if value.shape[-3] != hkv or value.shape[-2] != source:
        _fail(f"value: expected shape [..., {hkv}, {source}, Ev], got {list(value.shape)}")
    if enable_gqa:
        if hkv <= 0 or hq % hkv != 0:
            _fail(f"enable_gqa: the key/value heads ({hkv}) must divide the query heads ({hq})")
    elif hq != hkv:
        _fail(f"query has {hq} heads and key {hkv}; pass enable_gqa=True for grouped-query "
              "attention")
    if is_causal and attn_mask is not None:
        _fail("attn_mask must not be given with is_causal=True")
    if not 0.0 <= dropout_p < 1.0:
        _fail(f"dropout_p: expected a value in [0, 1), got {dropout_p}")

    # [..., H, N, D] -> qkv's [B, N, H, D]: a view (leading dims merge by a
    # view too unless the caller's strides forbid it).
    b = math.prod(batch_shape)

    def to_qkv(t: Tensor) -> Tensor:
        return t.reshape(b, *t.shape[-3:]).transpose(1, 2)

    mask = None
    if attn_mask is not None:
        mask = _mask_4d(attn_mask, batch_shape, hq, length, source)
    out, _ = _ops.attention(to_qkv(query), to_qkv(key), to_qkv(value), mask=mask, scale=scale,
                            causal=is_causal, top_left=True, dropout_p=dropout_p)
    return out.transpose(1, 2).reshape(*batch_shape, hq, length, value.shape[-1])

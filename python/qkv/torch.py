"""A drop-in for torch.nn.functional.scaled_dot_product_attention on qkv.

    from qkv.torch import scaled_dot_product_attention
    out = scaled_dot_product_attention(q, k, v, is_causal=True)  # [..., Hq, L, Ev]

Same arguments, defaults, layouts, accepted inputs, results and error types as
PyTorch's function (checked against torch 2.15 by python/tests/test_torch.py
and by the port of PyTorch's own tests in python/tests/peers), differentiable
with gradients to query, key, value and a float attn_mask. Differences:

* Tensors not on the CPU are passed to PyTorch's own function.
* A query row whose keys are all masked gives 0 and a zero gradient, as
  PyTorch 2.15 does on CPU (older PyTorch returned NaN there).
* Dropout draws its seed from torch's generator (torch.manual_seed makes it
  reproducible), but the kept weights differ from PyTorch's.
* attn_mask takes plain tensors and PyTorch's causal biases
  (torch.nn.attention.bias.causal_upper_left / causal_lower_right); another
  tensor subclass raises TypeError instead of being read as data.

Invalid arguments raise qkv.ArgumentError, a RuntimeError like PyTorch's
errors and a ValueError like qkv's; wrong argument types raise TypeError.

Calls go straight to the native kernels, the tensors read and the outputs
allocated through DLPack's C exchange API, so that a small call costs about
what PyTorch's own does; when an input requires grad, a
torch.autograd.Function records the native backward. Calls traced by
torch.compile, and float masks that require grad, run the registered
operator torch.ops.qkv.attention instead (one op for the compiler; the
mask's gradient).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor
from torch.nn.attention.bias import CausalBias, CausalVariant

from . import _api, _ops
from ._errors import ArgumentError

__all__ = ["scaled_dot_product_attention"]

_native = _api._qkv.sdpa_exchange
_native_backward = _api._qkv.sdpa_backward_exchange
_is_compiling = torch.compiler.is_compiling
_functorch_active = torch._C._are_functorch_transforms_active
_NUMBERS = (float, int, bool)  # what PyTorch takes for a float argument
_PLAIN = (Tensor, torch.nn.Parameter)  # tensor types read as data


def _fail(message: str) -> None:
    raise ArgumentError(f"scaled_dot_product_attention: {message}")


def _type_error(name: str, expected: str, value) -> None:
    raise TypeError(f"scaled_dot_product_attention(): argument '{name}' must be {expected}, "
                    f"not {type(value).__name__}")


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
    Ev], result [..., Hq, L, Ev] (dtype of query, contiguous); the leading
    dimensions `...` of all three are equal (none for 2-D inputs [L, E]);
    Hq == Hkv unless enable_gqa, where Hkv divides Hq. attn_mask broadcasts
    to [..., Hq, L, S]: bool (True = take part in attention), float (added to
    the scores; float32 or the dtype of query), or a CausalBias from
    torch.nn.attention.bias. is_causal keeps key j for query i when j <= i
    (top-left alignment) and excludes attn_mask. scale defaults to
    1 / sqrt(E). dropout_p in [0, 1] drops weights on every call (1: the
    result is zero).
    """
    # The fast path: plain tensors, well-typed options, not traced, no
    # gradient to a float mask. None from the native call, or _NotApplicable,
    # means that path does not apply; the general one then checks and runs.
    seed = None
    if (
        type(query) is Tensor and type(key) is Tensor and type(value) is Tensor
        and (attn_mask is None or type(attn_mask) is Tensor)
        and type(is_causal) is bool and type(enable_gqa) is bool
        and type(dropout_p) in _NUMBERS and (scale is None or type(scale) in _NUMBERS)
        and not _is_compiling()
        and not (query.is_neg() or key.is_neg() or value.is_neg()
                 or (attn_mask is not None and attn_mask.is_neg()))
    ):
        grad = torch.is_grad_enabled()
        seed = _ops.dropout_seed_from_torch() if dropout_p > 0 else 0
        threads = _api._wanted_threads() or 0
        out = None
        try:
            if not (grad and (query.requires_grad or key.requires_grad or value.requires_grad)):
                if not (grad and attn_mask is not None and attn_mask.requires_grad):
                    out = _native(query, key, value, attn_mask, scale, is_causal, enable_gqa,
                                  dropout_p, seed, threads, False)
            elif (attn_mask is None or not attn_mask.requires_grad) and not _functorch_active():
                out = _Attention.apply(query, key, value, attn_mask, scale, is_causal,
                                       enable_gqa, dropout_p, seed, threads)[0]
        except ValueError as e:
            raise ArgumentError(f"scaled_dot_product_attention: {e}") from None
        except _NotApplicable:
            pass
        if out is not None:
            return out
    return _general(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, seed)


class _NotApplicable(Exception):
    """The native path does not take these inputs (sdpa_exchange said None)."""


class _Attention(torch.autograd.Function):
    """The fast path's autograd: the native forward (out and lse) and backward
    on tensors in PyTorch's layout, with no registered operator between. (The
    forward takes ctx: the setup_context form binds every call's arguments
    through inspect.signature, which costs more than a small call's kernel.
    torch.func transforms therefore take the registered operator.)"""

    @staticmethod
    def forward(ctx, query, key, value, mask, scale, is_causal, enable_gqa, dropout_p, seed,
                threads):
        result = _native(query, key, value, mask, scale, is_causal, enable_gqa, dropout_p, seed,
                         threads, True)
        if result is None:
            raise _NotApplicable
        out, lse = result
        ctx.save_for_backward(query, key, value, mask, out, lse)
        ctx.options = (scale, is_causal, enable_gqa, dropout_p, seed)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, _grad_lse):
        if grad_out is None:
            return (None,) * 10
        query, key, value, mask, out, lse = ctx.saved_tensors
        grads = None
        if not _functorch_active():
            if type(grad_out) is not Tensor or grad_out.is_neg():
                grad_out = grad_out.resolve_neg().as_subclass(Tensor)
            grads = _native_backward(grad_out, query, key, value, out, lse, mask, *ctx.options,
                                     _api._wanted_threads() or 0)
        if grads is None:  # a batched (vmap) gradient, or strides no single view walks
            grads = _operator_backward(grad_out, query, key, value, mask, out, lse, *ctx.options)
        dq, dk, dv = grads
        needs = ctx.needs_input_grad
        return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None,
                None, None, None, None, None, None, None)


def _operator_backward(grad_out, query, key, value, mask, out, lse, scale, is_causal,
                       enable_gqa, dropout_p, seed):
    """_Attention's backward through the registered operator, on views in qkv's
    layout: for gradients the native exchange does not take, batched ones under
    vmap (the operator has vmap's per-sample fallback) or ones whose batch
    dimensions no single stride walks (reshape copies them)."""
    batch = query.shape[:-3]
    b, hq, length = math.prod(batch), query.shape[-3] if query.dim() > 2 else 1, query.shape[-2]

    def to_qkv(t: Tensor) -> Tensor:  # [*batch, H, N, D] or [N, D] -> [B, N, H, D]
        return t.reshape(b, -1, *t.shape[-2:]).transpose(1, 2)

    if mask is not None:
        mask = _mask_4d(mask, batch, hq, length, key.shape[-2])
    grads = torch.ops.qkv.attention_backward(
        to_qkv(grad_out), to_qkv(query), to_qkv(key), to_qkv(value), to_qkv(out),
        lse.reshape(b, hq, length), mask=mask, scale=scale, causal=is_causal, align="top_left",
        dropout_p=dropout_p, dropout_seed=seed)
    return tuple(g.transpose(1, 2).reshape(t.shape) for g, t in zip(grads, (query, key, value)))


def _check_types(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            _type_error(name, "Tensor", t)
    if attn_mask is not None and not isinstance(attn_mask, Tensor):
        _type_error("attn_mask", "Tensor", attn_mask)
    if type(dropout_p) not in _NUMBERS and not _scalar_tensor(dropout_p):
        _type_error("dropout_p", "float", dropout_p)
    if type(is_causal) is not bool:
        _type_error("is_causal", "bool", is_causal)
    if scale is not None and type(scale) not in _NUMBERS and not _scalar_tensor(scale):
        _type_error("scale", "float", scale)

    if type(enable_gqa) is not bool:
        _type_error("enable_gqa", "bool", enable_gqa)


def _scalar_tensor(x) -> bool:
    """A 0-dim real tensor, which PyTorch takes for a float argument."""
    return isinstance(x, Tensor) and x.dim() == 0 and not x.is_complex()


def _causal_bias(bias: CausalBias, length: int, source: int) -> bool:
    """Whether PyTorch's causal bias object means bottom-right alignment (else
    top-left, which is what is_causal=True means)."""
    if bias.seq_len_q == bias.seq_len_kv or bias.variant == CausalVariant.UPPER_LEFT:
        return False
    if bias.variant != CausalVariant.LOWER_RIGHT:
        _fail(f"attn_mask: expected a CausalBias variant of torch.nn.attention.bias."
              f"CausalVariant, got {bias.variant!r}")
    if (bias.seq_len_q, bias.seq_len_kv) != (length, source):
        _fail(f"attn_mask: a causal_lower_right bias of shape ({bias.seq_len_q}, "
              f"{bias.seq_len_kv}) does not broadcast to the scores' (L, S) = ({length}, "
              f"{source})")
    return True


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
    try:
        return mask.expand(*batch_shape, *tail).reshape(b, *tail)
    except RuntimeError:
        _fail(f"attn_mask: shape {list(mask.shape)} does not broadcast to "
              f"{[*batch_shape, heads, length, source]}")


class _Zeros(torch.autograd.Function):
    """dropout_p = 1: a zero result, whose gradient to every input is zero."""

    @staticmethod
    def forward(ctx, shape, query, key, value, mask):
        ctx.shapes = [None if t is None else (t.shape, t.dtype) for t in (query, key, value, mask)]
        return query.new_zeros(shape)

    @staticmethod
    def backward(ctx, grad):
        return (None,) + tuple(
            None if s is None else grad.new_zeros(s[0], dtype=s[1]) for s in ctx.shapes)


def _general(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
             seed=None) -> Tensor:
    """Every call the fast path does not take: checks with PyTorch's rules and
    errors, tensors elsewhere than the CPU, causal bias objects, autograd and
    torch.compile (through the registered operator)."""
    _check_types(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    dropout_p = float(dropout_p)
    scale = None if scale is None else float(scale)
    if not (query.is_cpu and key.is_cpu and value.is_cpu):
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
            scale=scale, enable_gqa=enable_gqa)
    causal_bias = isinstance(attn_mask, CausalBias)
    if attn_mask is not None and not causal_bias and type(attn_mask) not in _PLAIN:
        raise TypeError(
            f"scaled_dot_product_attention(): attn_mask: expected a torch.Tensor or a "
            f"torch.nn.attention.bias.CausalBias, got the tensor subclass "
            f"{type(attn_mask).__module__}.{type(attn_mask).__qualname__}, which qkv does not "
            "read")
    rank = query.dim()
    if rank < 2 or key.dim() != rank or value.dim() != rank:
        _fail(f"expected query, key and value of the same rank >= 2, got shapes "
              f"{list(query.shape)}, {list(key.shape)}, {list(value.shape)}")
    if rank == 2:  # [L, E]: one head, no batch
        out = _general(query[None], key[None], value[None], attn_mask, dropout_p, is_causal,
                       scale, enable_gqa, seed)
        return out[0]
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
    if is_causal and attn_mask is not None:  # PyTorch's words, which its tests match
        if causal_bias:
            _fail("CausalBias should not be used with causal=True")
        _fail("Explicit attn_mask should not be set when is_causal=True")
    if not 0.0 <= dropout_p <= 1.0:
        _fail(f"dropout_p: expected a probability in [0, 1], got {dropout_p}")
    if attn_mask is not None and not causal_bias and attn_mask.dtype not in (
            torch.bool, torch.float32, query.dtype):
        _fail(f"attn_mask: expected dtype bool, float32 or the dtype of query ({query.dtype}), "
              f"got {attn_mask.dtype}")

    top_left = True
    if causal_bias:
        top_left = not _causal_bias(attn_mask, length, source)
        attn_mask, is_causal = None, True
    shape = (*batch_shape, hq, length, value.shape[-1])
    if dropout_p == 1.0:
        return _Zeros.apply(shape, query, key, value, attn_mask)

    # [..., H, N, D] -> qkv's [B, N, H, D]: a view (leading dims merge by a
    # view too unless the caller's strides forbid it).
    b = math.prod(batch_shape)

    def to_qkv(t: Tensor) -> Tensor:
        return t.reshape(b, *t.shape[-3:]).transpose(1, 2)

    mask = None
    if attn_mask is not None:
        mask = _mask_4d(attn_mask, batch_shape, hq, length, source)
    if scale is None and query.shape[-1] == 0:
        scale = 1.0  # empty dot products score 0 for any scale (sdpa_exchange does the same)
    try:
        out, _ = _ops.attention(to_qkv(query), to_qkv(key), to_qkv(value), mask=mask,
                                scale=scale, causal=is_causal,
                                align="top_left" if top_left else "bottom_right",
                                dropout_p=dropout_p, dropout_seed=seed)
    except ValueError as e:
        if isinstance(e, ArgumentError):
            raise
        raise ArgumentError(f"scaled_dot_product_attention: {e}") from None
    return out.transpose(1, 2).reshape(shape).contiguous()

"""qkv's attention as PyTorch operators: `torch.ops.qkv.attention` and
`torch.ops.qkv.attention_backward`, registered with torch.library.custom_op,
with autograd (the fused backward) and fake kernels (shapes for
torch.compile). The drop-in modules (qkv.torch, qkv.flash_attn, qkv.nn) call
`attention` below. Tensors are in qkv's layout [B, N, H, D]."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _api

_STAT = {torch.float64: torch.float64}


def _options(mask, alibi_slopes, key_lengths, cu_seqlens_q, cu_seqlens_k, scale, causal,
             top_left, window_left, window_right, softcap, dropout_p, dropout_seed):
    return _api._options(
        scale=scale, causal=causal, align="top_left" if top_left else "bottom_right",
        window=(window_left, window_right), key_lengths=key_lengths,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, mask=mask,
        alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p,
        dropout_seed=dropout_seed,
    )


@torch.library.custom_op("qkv::attention", mutates_args=(), device_types="cpu")
def _attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], alibi_slopes: Optional[Tensor],
    key_lengths: Optional[Tensor], cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor], scale: Optional[float], causal: bool, top_left: bool,
    window_left: int, window_right: int, softcap: float, dropout_p: float, dropout_seed: int,
) -> Tuple[Tensor, Tensor]:
    o = _options(mask, alibi_slopes, key_lengths, cu_seqlens_q, cu_seqlens_k, scale, causal,
                 top_left, window_left, window_right, softcap, dropout_p, dropout_seed)
    r = _api.attention_with(q, k, v, o, return_lse=True)
    return r.out, r.lse


@_attention.register_fake
def _(q, k, v, mask, alibi_slopes, key_lengths, cu_seqlens_q, cu_seqlens_k, scale, causal,
      top_left, window_left, window_right, softcap, dropout_p, dropout_seed):
    b, nq, hq, _ = q.shape
    out = q.new_empty((b, nq, hq, v.shape[3]))
    lse = q.new_empty((b, hq, nq), dtype=_STAT.get(q.dtype, torch.float32))
    return out, lse


@torch.library.custom_op("qkv::attention_backward", mutates_args=(), device_types="cpu")
def _attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    mask: Optional[Tensor], alibi_slopes: Optional[Tensor], key_lengths: Optional[Tensor],
    cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], scale: Optional[float],
    causal: bool, top_left: bool, window_left: int, window_right: int, softcap: float,
    dropout_p: float, dropout_seed: int,
) -> Tuple[Tensor, Tensor, Tensor]:
    o = _options(mask, alibi_slopes, key_lengths, cu_seqlens_q, cu_seqlens_k, scale, causal,
                 top_left, window_left, window_right, softcap, dropout_p, dropout_seed)
    g = _api.attention_backward_with(q, k, v, out, dout, lse, o)
    return g.dq, g.dk, g.dv


@_attention_backward.register_fake
def _(dout, q, k, v, out, lse, *args):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_OPTION_NAMES = ("scale", "causal", "top_left", "window_left", "window_right", "softcap",
                 "dropout_p", "dropout_seed")


def _setup_context(ctx, inputs, output):
    (q, k, v, mask, alibi_slopes, key_lengths, cu_seqlens_q, cu_seqlens_k, *options) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, mask, alibi_slopes, key_lengths, cu_seqlens_q,
                          cu_seqlens_k)
    ctx.options = tuple(options)
    ctx.set_materialize_grads(False)


def _mask_gradient(ctx, dout, q, k, v, out, mask, tensors):
    """dLoss/dmask for a float mask: dS = P (dP - D) summed over the
    dimensions the mask broadcasts along."""
    scale, causal, top_left, wl, wr, softcap, dropout_p, seed = ctx.options
    if dropout_p > 0:
        raise NotImplementedError("qkv: the gradient of a float mask with dropout is not supported")
    o = _options(*tensors, scale, causal, top_left, wl, wr, softcap, 0.0, seed)
    probs = _api.attention_with(q.detach(), k.detach(), v.detach(), o, return_probs=True).probs
    group = q.shape[2] // k.shape[2]
    dt = probs.dtype  # float32, float64 for float64 inputs
    vv = v.detach().repeat_interleave(group, dim=2).to(dt)
    dp = torch.einsum("bihd,bjhd->bhij", dout.to(dt), vv)
    d = (dout.to(dt) * out.to(dt)).sum(-1).transpose(1, 2)  # [B, Hq, Nq]
    ds = probs * (dp - d.unsqueeze(-1))
    # Sum over the dimensions the mask broadcasts along (NumPy rules).
    while ds.dim() > mask.dim():
        ds = ds.sum(0)
    for axis, size in enumerate(mask.shape):
        if size == 1 and ds.shape[axis] != 1:
            ds = ds.sum(axis, keepdim=True)
    return ds.to(mask.dtype)


def _backward(ctx, dout, dlse):
    if dlse is not None:
        raise NotImplementedError(
            "qkv: attention's lse is not differentiable; detach it before using it in a loss"
        )
    q, k, v, out, lse, mask, alibi_slopes, key_lengths, cu_q, cu_k = ctx.saved_tensors
    n = 8 + len(_OPTION_NAMES)
    if dout is None:
        return (None,) * n
    tensors = (mask, alibi_slopes, key_lengths, cu_q, cu_k)
    dq, dk, dv = torch.ops.qkv.attention_backward(dout.contiguous(), q, k, v, out, lse,
                                                  *tensors, *ctx.options)
    dmask = None
    if mask is not None and ctx.needs_input_grad[3]:
        dmask = _mask_gradient(ctx, dout, q, k, v, out, mask, tensors)
    return (dq, dk, dv, dmask) + (None,) * (n - 4)


_attention.register_autograd(_backward, setup_context=_setup_context)


def dropout_seed_from_torch() -> int:
    """A dropout seed drawn from torch's default CPU generator (so
    torch.manual_seed makes dropout reproducible)."""
    return int(torch.randint(0, 2**62, (), dtype=torch.int64))


def attention(
    q: Tensor, k: Tensor, v: Tensor, *, mask: Optional[Tensor] = None,
    alibi_slopes: Optional[Tensor] = None, key_lengths: Optional[Tensor] = None,
    cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
    scale: Optional[float] = None, causal: bool = False, top_left: bool = False,
    window: Tuple[int, int] = (-1, -1), softcap: float = 0.0, dropout_p: float = 0.0,
    dropout_seed: Optional[int] = None,
) -> Tuple[Tensor, Tensor]:
    """Differentiable attention on torch tensors in qkv's layout: q [B, Nq,
    Hq, D], k [B, Nk, Hkv, D], v [B, Nk, Hkv, Dv] -> (out [B, Nq, Hq, Dv],
    lse [B, Hq, Nq]). Gradients flow to q, k, v and a float mask. Without a
    dropout_seed, dropout draws one from torch's generator (so
    torch.manual_seed makes it reproducible)."""
    if dropout_p > 0 and dropout_seed is None:
        dropout_seed = dropout_seed_from_torch()
    if alibi_slopes is not None and alibi_slopes.dtype != torch.float32:
        alibi_slopes = alibi_slopes.float()
    return torch.ops.qkv.attention(
        q, k, v, mask, alibi_slopes, key_lengths, cu_seqlens_q, cu_seqlens_k,
        None if scale is None else float(scale), bool(causal), bool(top_left), int(window[0]),
        int(window[1]), float(softcap), float(dropout_p), int(dropout_seed or 0),
    )

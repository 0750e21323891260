"""PyTorch modules on qkv's kernels and modules.

    import qkv.nn
    mha = qkv.nn.MultiheadAttention(512, 8, batch_first=True)
    mha.load_state_dict(torch_mha.state_dict())      # torch.nn.MultiheadAttention's
    out, weights = mha(x, x, x, key_padding_mask=padding)

Each module has the constructor, the parameters (state-dict names and shapes)
and the forward signature of the module it replaces, so state dicts move
between the two unchanged:

=========================  ===========================================================
``MultiheadAttention``     ``torch.nn.MultiheadAttention`` (a subclass of it); the
                           attention runs on qkv's fused kernels (``qkv._ops``)
``AdditiveAttention``      the Bahdanau decoder step of the seq2seq tutorials
                           (``attn: Linear(2H, H)``, ``v: Linear(H, 1, bias=False)``),
                           on ``qkv::nn::AdditiveAttention``
``SqueezeExcitation``      timm's ``SEModule``, on ``qkv::nn::SqueezeExcitation``
``CBAM``                   timm's ``CbamModule``, on ``qkv::nn::Cbam``
=========================  ===========================================================

``SEModule`` and ``CbamModule`` are aliases under timm's names. The last three
keep their parameters in the memory of the C++ module: the registered
``torch.nn.Parameter``s are views of it, so ``load_state_dict`` and optimizers
write straight into the C++ module, and forward and backward run its C++
code. Every module runs on the CPU only. Each class docstring lists where it
differs from the original.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from . import _api, _arrays, _ops, _qkv

__all__ = [
    "AdditiveAttention",
    "CBAM",
    "CbamModule",
    "MultiheadAttention",
    "SEModule",
    "SqueezeExcitation",
]

_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
}


def _check_device(device: Any, name: str = "device") -> None:
    if device is not None and torch.device(device).type != "cpu":
        raise ValueError(f"{name}: expected None or a CPU device, got '{torch.device(device)}'")


def _check_tensor(x: Any, name: str) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.device.type != "cpu":
        raise ValueError(f"{name}: expected a CPU tensor, got device '{x.device}'")
    if not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {x.dtype}")


def _shape(x: Tensor) -> List[int]:
    return list(x.shape)


# ---------------------------------------------------------------------------
# MultiheadAttention


def _check_mask_dtype(mask: Optional[Tensor], name: str) -> None:
    if mask is None:
        return
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name}: expected None or a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"{name}: expected a bool or floating-point tensor, got {mask.dtype}")


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A torch-convention mask as an additive float mask: bool True -> -inf."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype).masked_fill_(mask, float("-inf"))
    return mask.to(dtype)


class MultiheadAttention(nn.MultiheadAttention):
    r"""``torch.nn.MultiheadAttention`` with the attention on qkv's kernels.

    A subclass of ``torch.nn.MultiheadAttention``: the same constructor, the
    same parameters initialized the same way (``in_proj_weight [3E, E]`` or
    ``q_proj_weight [E, E]``, ``k_proj_weight [E, kdim]``, ``v_proj_weight
    [E, vdim]`` when kdim or vdim differ from E; ``in_proj_bias [3E]``,
    ``out_proj.weight [E, E]``, ``out_proj.bias [E]``; ``bias_k``, ``bias_v
    [1, 1, E]`` with add_bias_kv), so state dicts load both ways. The
    projections are ``F.linear`` with these parameters; the attention of the
    heads is ``qkv._ops.attention`` (differentiable with respect to the
    projections and a float mask).

    Shapes (E = embed_dim, H = num_heads, L target and S source length, B batch):
        query             [L, B, E] ([B, L, E] with batch_first) or [L, E] unbatched
        key               [S, B, kdim] ([B, S, kdim]) or [S, kdim]
        value             [S, B, vdim] ([B, S, vdim]) or [S, vdim]
        key_padding_mask  [B, S] or [S]: bool (True = ignore the key) or float (added)
        attn_mask         [L, S] or [B * H, L, S] ([H, L, S] unbatched): bool
                          (True = not allowed to attend) or float (added)
        attn_output       the shape of query, its dtype
        attn_weights      [B, L, S] (averaged over heads) or [B, H, L, S]
                          ([L, S] or [H, L, S] unbatched), with need_weights
    add_bias_kv and add_zero_attn each append one key (and value) column, as
    in torch: S + 1 (or S + 2) columns in the weights.

    is_causal is torch's hint: it needs attn_mask too (the causal mask); with
    no key_padding_mask and need_weights=False the mask is not read and the
    kernel applies the causal (top-left) mask itself, otherwise attn_mask is
    applied as given.

    Differences from torch.nn.MultiheadAttention:

    * A query whose keys are all masked gets an attention output of zeros
      before out_proj (so attn_output is out_proj.bias there) and weights of
      zeros, where torch gives NaN.
    * The attention weights (need_weights=True, torch's default) are computed
      by a second pass (``qkv.attention(..., return_probs=True)``) and are
      not differentiable (they are returned detached); in training with
      dropout they are the softmax before dropout (torch returns them after
      dropout). Pass need_weights=False when the weights are not needed.
    * Dropout draws its mask from qkv's generator (Philox keyed by a seed
      drawn from torch's generator, so ``torch.manual_seed`` makes it
      reproducible): the same distribution as torch's, other masks.
      dropout must be below 1.
    * Float masks are converted to the query's dtype; bool masks are passed
      to the kernel as bool (masked keys are never read).
    * CPU tensors only; torch's inference fast path (and NestedTensor
      inputs) is never taken: the result is always a dense tensor.
    * Bad arguments raise ValueError or TypeError (torch: AssertionError or
      RuntimeError).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: Optional[int] = None,
        vdim: Optional[int] = None,
        batch_first: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        _check_device(device)
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(
                "embed_dim, num_heads: expected both > 0, got "
                f"embed_dim={embed_dim} and num_heads={num_heads}"
            )
        if embed_dim % num_heads != 0:
            raise ValueError(
                f"embed_dim: expected a multiple of num_heads={num_heads}, got {embed_dim}"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout: expected a probability in [0, 1), got {dropout}")
        super().__init__(
            embed_dim, num_heads, dropout=dropout, bias=bias, add_bias_kv=add_bias_kv,
            add_zero_attn=add_zero_attn, kdim=kdim, vdim=vdim, batch_first=batch_first,
            device=device, dtype=dtype,
        )

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Optional[Tensor] = None,
        need_weights: bool = True,
        attn_mask: Optional[Tensor] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """Multi-head attention of query over key/value (shapes in the class
        docstring). Returns (attn_output, attn_weights or None)."""
        batched = self._check_inputs(query, key, value, key_padding_mask, attn_mask)
        if is_causal and attn_mask is None:
            raise ValueError(
                "attn_mask: is_causal=True needs the causal mask as attn_mask too, as "
                "torch.nn.MultiheadAttention does (nn.Transformer."
                "generate_square_subsequent_mask makes one), got None"
            )
        self_attention = query is key and key is value
        shared_kv = key is value
        if not batched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
            seq_first = False
        else:
            seq_first = not self.batch_first
        bdim, sdim = (1, 0) if seq_first else (0, 1)
        batch, src_len = query.shape[bdim], key.shape[sdim]
        heads, head_dim = self.num_heads, self.head_dim

        q, k, v = self._project(query, key, value, self_attention, shared_kv)
        if self.bias_k is not None and self.bias_v is not None:
            shape = (1, batch, self.embed_dim) if seq_first else (batch, 1, self.embed_dim)
            k = torch.cat([k, self.bias_k.expand(shape)], dim=sdim)
            v = torch.cat([v, self.bias_v.expand(shape)], dim=sdim)
        q, k, v = (t.unflatten(-1, (heads, head_dim)) for t in (q, k, v))
        if seq_first:  # [B, N, H, Dh], qkv's layout, as views
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        if self.add_zero_attn:
            zeros = k.new_zeros((batch, 1, heads, head_dim))
            k = torch.cat([k, zeros], dim=1)
            v = torch.cat([v, zeros], dim=1)
        extra = k.shape[1] - src_len

        causal = is_causal and key_padding_mask is None and not need_weights
        mask = None
        if not causal:
            mask = self._qkv_mask(attn_mask, key_padding_mask, batch, batched, extra, q.dtype)
        dropout_p = self.dropout if self.training else 0.0
        out, _ = _ops.attention(
            q, k, v, mask=mask, causal=causal, align="top_left", dropout_p=dropout_p
        )
        if seq_first:
            out = out.transpose(0, 1)
        out = F.linear(out.reshape(out.shape[0], out.shape[1], self.embed_dim),
                       self.out_proj.weight, self.out_proj.bias)

        weights = None
        if need_weights:
            probs = _api.attention(
                q.detach(), k.detach(), v.detach(),
                mask=None if mask is None else mask.detach(), causal=causal, align="top_left",
                return_probs=True,
            ).probs
            weights = probs.to(out.dtype)
            if average_attn_weights:
                weights = weights.mean(dim=1)
        if not batched:
            out = out.squeeze(0)
            if weights is not None:
                weights = weights.squeeze(0)
        return out, weights

    def _check_inputs(self, query, key, value, key_padding_mask, attn_mask) -> bool:
        """Checks as torch's _mha_shape_check and the functional form do;
        returns whether the inputs are batched."""
        for x, name in ((query, "query"), (key, "key"), (value, "value")):
            _check_tensor(x, name)
        _check_mask_dtype(key_padding_mask, "key_padding_mask")
        _check_mask_dtype(attn_mask, "attn_mask")
        if query.dim() not in (2, 3):
            raise ValueError(
                "query: expected a 2-D (unbatched) or 3-D (batched) tensor, got shape "
                f"{_shape(query)}"
            )
        batched = query.dim() == 3
        rank = query.dim()
        for x, name in ((key, "key"), (value, "value")):
            if x.dim() != rank:
                raise ValueError(
                    f"{name}: expected {rank} dimensions as query, got shape {_shape(x)}"
                )
        features = (("query", query, self.embed_dim, "embed_dim"),
                    ("key", key, self.kdim, "kdim"), ("value", value, self.vdim, "vdim"))
        for name, x, want, what in features:
            if x.shape[-1] != want:
                raise ValueError(
                    f"{name}: expected {what}={want} features in the last dimension, got "
                    f"shape {_shape(x)}"
                )
        if key.shape[:-1] != value.shape[:-1]:
            raise ValueError(
                f"value: expected the sequence and batch sizes of key {_shape(key)[:-1]}, got "
                f"shape {_shape(value)}"
            )
        seq_first = batched and not self.batch_first
        if batched:
            bdim, sdim = (1, 0) if seq_first else (0, 1)
            batch, tgt_len, src_len = query.shape[bdim], query.shape[sdim], key.shape[sdim]
            if key.shape[bdim] != batch:
                raise ValueError(
                    f"key: expected the batch size of query ({batch}), got shape {_shape(key)}"
                )
            kpm_shape = [batch, src_len]
        else:
            batch, tgt_len, src_len = 1, query.shape[0], key.shape[0]
            kpm_shape = [src_len]
        if key_padding_mask is not None and _shape(key_padding_mask) != kpm_shape:
            raise ValueError(
                f"key_padding_mask: expected shape {kpm_shape}, got {_shape(key_padding_mask)}"
            )
        if attn_mask is not None:
            heads = self.num_heads * batch if batched else self.num_heads
            allowed = ([tgt_len, src_len], [heads, tgt_len, src_len])
            if _shape(attn_mask) not in allowed:
                raise ValueError(
                    f"attn_mask: expected shape {allowed[0]} or {allowed[1]}, got "
                    f"{_shape(attn_mask)}"
                )
        return batched

    def _project(self, query, key, value, self_attention, shared_kv):
        """q, k, v = the input projections, as torch computes them."""
        e = self.embed_dim
        b = self.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else b.chunk(3)
        if not self._qkv_same_embed_dim:
            return (F.linear(query, self.q_proj_weight, bq),
                    F.linear(key, self.k_proj_weight, bk),
                    F.linear(value, self.v_proj_weight, bv))
        w = self.in_proj_weight
        if self_attention:
            return F.linear(query, w, b).chunk(3, dim=-1)
        if shared_kv:
            w_q, w_kv = w.split([e, 2 * e])
            b_kv = None if b is None else b[e:]
            k, v = F.linear(key, w_kv, b_kv).chunk(2, dim=-1)
            return F.linear(query, w_q, bq), k, v
        w_q, w_k, w_v = w.chunk(3)
        return F.linear(query, w_q, bq), F.linear(key, w_k, bk), F.linear(value, w_v, bv)

    def _qkv_mask(self, attn_mask, key_padding_mask, batch, batched, extra, dtype):
        """attn_mask and key_padding_mask (torch's conventions) as one qkv mask
        broadcasting to [B, H, L, S + extra]: bool with True = attend when both
        are bool, else float (added). None without masks."""
        masks = []
        if attn_mask is not None:
            if attn_mask.dim() == 3 and batched:
                attn_mask = attn_mask.view(batch, self.num_heads, *attn_mask.shape[1:])
            masks.append(attn_mask)
        if key_padding_mask is not None:
            masks.append(key_padding_mask.view(batch, 1, 1, key_padding_mask.shape[-1]))
        if not masks:
            return None
        if all(m.dtype == torch.bool for m in masks):
            keep = ~masks[0] if len(masks) == 1 else ~(masks[0] | masks[1])
            return F.pad(keep, (0, extra), value=True) if extra else keep
        added = _additive(masks[0], dtype)
        if len(masks) == 2:
            added = added + _additive(masks[1], dtype)
        return F.pad(added, (0, extra), value=0.0) if extra else added


# ---------------------------------------------------------------------------
# Modules whose parameters live in a C++ module


def _from_native(a: Any) -> Tensor:
    return torch.from_dlpack(a)


def _call(fn, *args):
    """fn(*args) on qkv's thread count (torch's unless qkv.set_num_threads chose one)."""
    result = []
    _api._run(lambda: result.append(fn(*args)))
    return result[0]


def _parameter_grads(native, names, params, needs) -> List[Optional[Tensor]]:
    """The gradients the native backward accumulated, in the parameters' dtypes."""
    grads = dict(native.grads())
    out: List[Optional[Tensor]] = []
    for name, p, need in zip(names, params, needs):
        g = grads.get(name)
        out.append(None if not need or g is None else _from_native(g).to(p.dtype))
    return out


class _NativeBacked(nn.Module):
    """A module whose parameters (and running statistics) are views of a C++
    module's memory. Subclasses build the torch containers of the original
    module (which initialize the parameters as the original does) and
    implement `_native_names()` (the C++ module's parameter names, in its
    order), `_new_native(dtype)` and, when the C++ module depends on more than
    the tensors, `_native_config()`.

    The registered tensors are the source of truth: before each call the C++
    module is checked to hold exactly them (same memory, dtype and shape).
    After anything that replaces a tensor (``.double()``, ``.to(dtype)``,
    ``load_state_dict(assign=True)``, ``copy.deepcopy``) the next call builds
    a C++ module of the tensors' dtype, copies their values into it and
    points them at its memory again."""

    def __init__(self) -> None:
        super().__init__()
        self._native = None
        self._native_views: List[Tensor] = []
        self._native_key = None
        self._lock = threading.Lock()

    # Subclass interface.
    def _new_native(self, dtype: str):
        raise NotImplementedError

    def _native_config(self) -> tuple:
        return ()

    def _native_names(self) -> List[str]:
        raise NotImplementedError

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_native"] = None
        state["_native_views"] = []
        state["_native_key"] = None
        state["_lock"] = None
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._lock = threading.Lock()

    def _tensor_slots(self) -> List[Tuple[str, nn.Module, str, bool]]:
        slots = []
        for name in self._native_names():
            prefix, _, attr = name.rpartition(".")
            owner = self.get_submodule(prefix) if prefix else self
            slots.append((name, owner, attr, attr in owner._buffers))
        return slots

    def _tensors(self) -> List[Tuple[str, Optional[Tensor], bool]]:
        out = []
        for name, owner, attr, is_buffer in self._tensor_slots():
            store = owner._buffers if is_buffer else owner._parameters
            out.append((name, store.get(attr), is_buffer))
        return out

    def _synced_native(self):
        """The C++ module, holding exactly the registered tensors."""
        tensors = self._tensors()
        key = self._native_config()
        if (
            self._native is not None
            and key == self._native_key
            and all(
                t is not None
                and t.data_ptr() == v.data_ptr()
                and t.dtype == v.dtype
                and t.shape == v.shape
                and t.stride() == v.stride()
                for (_, t, _), v in zip(tensors, self._native_views)
            )
        ):
            return self._native
        return self._rebuild_native(tensors, key)

    def _rebuild_native(self, tensors, key):
        for name, t, _ in tensors:
            if t is None:
                raise ValueError(f"{name}: expected a tensor, got None")
            if t.device.type != "cpu":
                raise ValueError(f"{name}: expected a CPU tensor, got device '{t.device}'")
        dtypes = sorted({str(t.dtype) for _, t, _ in tensors})
        if len(dtypes) != 1:
            raise TypeError(
                f"parameters: expected one dtype for all of them, got {', '.join(dtypes)}"
            )
        dtype = tensors[0][1].dtype
        if dtype not in _DTYPE_NAMES:
            raise TypeError(
                f"parameters: expected float32, float64, float16 or bfloat16, got {dtype}"
            )
        native = self._new_native(_DTYPE_NAMES[dtype])
        with torch.inference_mode(False):  # the parameters must stay normal tensors
            views = self._adopt(native, tensors)
        self._native, self._native_views, self._native_key = native, views, key
        return native

    @staticmethod
    def _adopt(native, tensors) -> List[Tensor]:
        """Copies the tensors' values into the C++ module and points the tensors
        at its memory; returns the views of that memory."""
        named = native.parameters()
        if [n for n, _ in named] != [n for n, _, _ in tensors]:  # pragma: no cover
            raise RuntimeError("qkv.nn: the C++ module lists other parameters than expected")
        views = [_from_native(a) for _, a in named]
        for (name, t, _), view in zip(tensors, views):
            if t.shape != view.shape:
                raise ValueError(f"{name}: expected shape {_shape(view)}, got {_shape(t)}")
        with torch.no_grad():
            for (_, t, _), view in zip(tensors, views):
                view.copy_(t)
                t.data = view
        return views

    def _learned(self) -> Tuple[List[str], List[Tensor]]:
        """Names and tensors of the learned parameters (not the buffers)."""
        names, params = [], []
        for name, t, is_buffer in self._tensors():
            if not is_buffer:
                names.append(name)
                params.append(t)
        return names, params


class _ImageFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, native, lock, names, channels_last, x, *params):
        xin = x.detach().permute(0, 2, 3, 1) if channels_last else x.detach()
        y = _from_native(_call(native.forward, xin, "nhwc" if channels_last else "nchw"))
        if channels_last:
            y = y.permute(0, 3, 1, 2)
        ctx.save_for_backward(x, *params)
        ctx.native, ctx.lock, ctx.names, ctx.channels_last = native, lock, names, channels_last
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, *params = ctx.saved_tensors
        cl = ctx.channels_last
        layout = "nhwc" if cl else "nchw"
        xin = x.permute(0, 2, 3, 1) if cl else x
        dyin = dy.permute(0, 2, 3, 1) if cl else dy
        with ctx.lock:
            ctx.native.zero_grad()
            dx = _from_native(_call(ctx.native.backward, xin, dyin, layout))
            grads = _parameter_grads(ctx.native, ctx.names, params, ctx.needs_input_grad[5:])
        if cl:
            dx = dx.permute(0, 3, 1, 2)
        return (None, None, None, None, dx if ctx.needs_input_grad[4] else None, *grads)


class _ImageModule(_NativeBacked):
    """Shared forward of the feature-map modules."""

    def forward(self, x: Tensor) -> Tensor:
        """y = the module applied to x [B, C, H, W] (shapes in the class docstring)."""
        _check_tensor(x, "x")
        if x.dim() != 4:
            raise ValueError(f"x: expected 4 dimensions [B, C, H, W], got shape {_shape(x)}")
        native = self._synced_native()
        names, params = self._learned()
        channels_last = (
            not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
        )
        return _ImageFunction.apply(native, self._lock, names, channels_last, x, *params)


def _check_choice(value: Any, allowed: tuple, name: str, default: str) -> None:
    if not any(value is a or (isinstance(a, str) and value == a) for a in allowed):
        raise NotImplementedError(f"{name}: only {default} is supported, got {value!r}")


def _factory(device, dtype) -> Dict[str, Any]:
    _check_device(device)
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if dtype not in _DTYPE_NAMES:
        raise TypeError(f"dtype: expected float32, float64, float16 or bfloat16, got {dtype}")
    return {"device": "cpu", "dtype": dtype}


def _rd_channels(channels, rd_ratio, rd_channels, rd_divisor) -> int:
    if rd_channels:
        return int(rd_channels)
    return _qkv.make_divisible(channels * rd_ratio, rd_divisor, 0, 0.0)


class SqueezeExcitation(_ImageModule):
    r"""Squeeze-and-excitation, timm's ``SEModule`` (``timm.layers.SEModule``),
    on qkv's C++ module (``qkv::nn::SqueezeExcitation``)::

        g = sigmoid(fc2(relu(fc1(mean over H, W of x))))      [B, C, 1, 1]
        y = x * g

    Constructor as timm's; rd_channels defaults to make_divisible(channels *
    rd_ratio, rd_divisor, round_limit=0). Parameters under timm's names:
    ``fc1.weight [rd, C, 1, 1]``, ``fc1.bias [rd]``, ``fc2.weight [C, rd, 1,
    1]``, ``fc2.bias [C]`` (biases with bias=True), initialized as timm's
    (``nn.Conv2d``'s defaults; ``fc1`` and ``fc2`` are ``nn.Conv2d``
    containers whose tensors are views of the C++ module's memory).

    Shapes: x [B, C, H, W] -> y [B, C, H, W], x's dtype. A channels-last x
    runs the C++ module's NHWC layout and gives a channels-last y.

    Differences from timm's SEModule:

    * Only timm's defaults for add_maxpool (False), act_layer (ReLU),
      norm_layer (None) and gate_layer ("sigmoid"): others raise
      NotImplementedError.
    * CPU only. The parameters share one dtype (float32, float64, float16 or
      bfloat16); x may have another (timm requires the same): the module
      computes in float64 for float64 inputs, else in float32, and returns
      x's dtype.
    * No double backward (gradients of gradients).
    """

    def __init__(
        self,
        channels: int,
        rd_ratio: float = 1.0 / 16,
        rd_channels: Optional[int] = None,
        rd_divisor: int = 8,
        add_maxpool: bool = False,
        bias: bool = True,
        act_layer: Any = nn.ReLU,
        norm_layer: Any = None,
        gate_layer: Any = "sigmoid",
        *,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if add_maxpool:
            raise NotImplementedError("add_maxpool: only False is supported, got True")
        _check_choice(act_layer, (nn.ReLU, "relu"), "act_layer", "nn.ReLU")
        _check_choice(norm_layer, (None,), "norm_layer", "None")
        _check_choice(gate_layer, ("sigmoid", nn.Sigmoid), "gate_layer", "'sigmoid'")
        if channels < 1:
            raise ValueError(f"channels: expected >= 1, got {channels}")
        kw = _factory(device, dtype)
        rd = _rd_channels(channels, rd_ratio, rd_channels, rd_divisor)
        self.channels, self.rd_channels, self.bias = int(channels), rd, bool(bias)
        self.fc1 = nn.Conv2d(channels, rd, kernel_size=1, bias=bias, **kw)
        self.fc2 = nn.Conv2d(rd, channels, kernel_size=1, bias=bias, **kw)
        self._synced_native()

    def _native_names(self) -> List[str]:
        names = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
        return names if self.bias else [n for n in names if n.endswith("weight")]

    def _new_native(self, dtype: str):
        return _qkv.SqueezeExcitation(self.channels, rd_channels=self.rd_channels,
                                      bias=self.bias, dtype=dtype)

    def extra_repr(self) -> str:
        return f"channels={self.channels}, rd_channels={self.rd_channels}, bias={self.bias}"


class CBAM(_ImageModule):
    r"""CBAM, timm's ``CbamModule`` (``timm.layers.cbam.CbamModule``), on qkv's
    C++ module (``qkv::nn::Cbam``)::

        s  = sigmoid(mlp(mean_hw x) + mlp(max_hw x)),  mlp = fc2(relu(fc1(.)))
        x1 = x * s                                       (channel attention)
        a  = [mean over C of x1, max over C of x1]       [B, 2, H, W]
        z  = bn(conv(a)),  conv k x k, zero padding k // 2, no bias
        y  = x1 * sigmoid(z)                             (spatial attention)

    Constructor as timm's; rd_channels defaults to make_divisible(channels *
    rd_ratio, rd_divisor, round_limit=0). Parameters and buffers under timm's
    names: ``channel.fc1.weight [rd, C, 1, 1]``, ``channel.fc2.weight [C, rd,
    1, 1]`` (and ``channel.fc1.bias``, ``channel.fc2.bias`` with mlp_bias),
    ``spatial.conv.conv.weight [1, 2, k, k]``, ``spatial.conv.bn.weight``,
    ``.bias``, ``.running_mean``, ``.running_var`` ``[1]`` and
    ``spatial.conv.bn.num_batches_tracked`` (kept for the state dict, unused),
    initialized as timm's (``nn.Conv2d`` and ``nn.BatchNorm2d`` containers
    whose tensors are views of the C++ module's memory).

    Shapes: x [B, C, H, W] -> y [B, C, H, W], x's dtype. A channels-last x
    runs the C++ module's NHWC layout and gives a channels-last y.

    Differences from timm's CbamModule:

    * BatchNorm always applies its running statistics, in training too (timm
      in train() mode normalizes by the batch's statistics and updates the
      running ones): the module computes timm's eval() forward and its
      gradient; running_mean and running_var are never updated.
    * Where a maximum (over H, W or over channels) is attained more than
      once, its gradient goes to the first maximal element; torch's amax
      spreads it evenly over the ties.
    * Only timm's defaults for act_layer (ReLU) and gate_layer ("sigmoid"),
      and an odd spatial_kernel_size: others raise NotImplementedError or
      ValueError.
    * CPU only; the parameters share one dtype, x may have another (see
      SqueezeExcitation). No double backward.
    """

    def __init__(
        self,
        channels: int,
        rd_ratio: float = 1.0 / 16,
        rd_channels: Optional[int] = None,
        rd_divisor: int = 1,
        spatial_kernel_size: int = 7,
        act_layer: Any = nn.ReLU,
        gate_layer: Any = "sigmoid",
        mlp_bias: bool = False,
        *,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        _check_choice(act_layer, (nn.ReLU, "relu"), "act_layer", "nn.ReLU")
        _check_choice(gate_layer, ("sigmoid", nn.Sigmoid), "gate_layer", "'sigmoid'")
        if channels < 1:
            raise ValueError(f"channels: expected >= 1, got {channels}")
        if spatial_kernel_size < 1 or spatial_kernel_size % 2 == 0:
            raise ValueError(
                f"spatial_kernel_size: expected an odd size >= 1, got {spatial_kernel_size}"
            )
        kw = _factory(device, dtype)
        rd = _rd_channels(channels, rd_ratio, rd_channels, rd_divisor)
        self.channels, self.rd_channels, self.mlp_bias = int(channels), rd, bool(mlp_bias)
        self.kernel_size = int(spatial_kernel_size)
        self.channel = nn.Module()
        self.channel.fc1 = nn.Conv2d(channels, rd, kernel_size=1, bias=mlp_bias, **kw)
        self.channel.fc2 = nn.Conv2d(rd, channels, kernel_size=1, bias=mlp_bias, **kw)
        self.spatial = nn.Module()
        self.spatial.conv = nn.Module()
        k = self.kernel_size
        self.spatial.conv.conv = nn.Conv2d(2, 1, k, padding=k // 2, bias=False, **kw)
        self.spatial.conv.bn = nn.BatchNorm2d(1, **kw)
        self._synced_native()

    def _native_names(self) -> List[str]:
        names = ["channel.fc1.weight", "channel.fc1.bias", "channel.fc2.weight",
                 "channel.fc2.bias"]
        if not self.mlp_bias:
            names = [n for n in names if n.endswith("weight")]
        return names + ["spatial.conv.conv.weight", "spatial.conv.bn.weight",
                        "spatial.conv.bn.bias", "spatial.conv.bn.running_mean",
                        "spatial.conv.bn.running_var"]

    def _native_config(self) -> tuple:
        return (float(self.spatial.conv.bn.eps),)

    def _new_native(self, dtype: str):
        return _qkv.Cbam(self.channels, rd_channels=self.rd_channels, mlp_bias=self.mlp_bias,
                         spatial_kernel_size=self.kernel_size,
                         bn_eps=float(self.spatial.conv.bn.eps), dtype=dtype)

    def extra_repr(self) -> str:
        return (f"channels={self.channels}, rd_channels={self.rd_channels}, "
                f"spatial_kernel_size={self.kernel_size}, mlp_bias={self.mlp_bias}")


SEModule = SqueezeExcitation
CbamModule = CBAM


class _AdditiveFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, native, lock, names, lengths, hidden, encoder, *params):
        context, weights = _call(native.forward, hidden.detach(), encoder.detach(), lengths)
        ctx.save_for_backward(hidden, encoder, *params)
        ctx.native, ctx.lock, ctx.names, ctx.lengths = native, lock, names, lengths
        ctx.set_materialize_grads(False)
        return _from_native(context), _from_native(weights)

    @staticmethod
    @once_differentiable
    def backward(ctx, d_context, d_weights):
        hidden, encoder, *params = ctx.saved_tensors
        n = len(params)
        if d_context is None and d_weights is None:
            return (None,) * (6 + n)
        with ctx.lock:
            ctx.native.zero_grad()
            dh, de = _call(ctx.native.backward, hidden, encoder, ctx.lengths, d_context,
                           d_weights)
            grads = _parameter_grads(ctx.native, ctx.names, params, ctx.needs_input_grad[6:])
        dh = _from_native(dh) if ctx.needs_input_grad[4] else None
        de = _from_native(de) if ctx.needs_input_grad[5] else None
        return (None, None, None, None, dh, de, *grads)


class AdditiveAttention(_NativeBacked):
    r"""One decoder step of additive (Bahdanau) attention, the seq2seq
    tutorials' ``Attention(hidden_size)`` module, on qkv's C++ module
    (``qkv::nn::AdditiveAttention``)::

        energy[b, s]  = tanh(attn([encoder_outputs[b, s], decoder_hidden[b]]))   [H]
        scores[b, s]  = v(energy[b, s])
        weights[b]    = softmax over s of scores[b]
        context[b]    = sum_s weights[b, s] encoder_outputs[b, s]

    The concatenation puts the encoder output first: columns [0, H) of
    ``attn.weight`` act on encoder_outputs, [H, 2H) on decoder_hidden.

    Parameters under the original's names, initialized as its ``nn.Linear``
    layers (containers whose tensors are views of the C++ module's memory):
    ``attn.weight [H, 2H]``, ``attn.bias [H]``, ``v.weight [1, H]``.

    Shapes:
        decoder_hidden   [B, H]
        encoder_outputs  [B, S, H], dtype of decoder_hidden
        source_lengths   [B] ints in [0, S] (optional): positions s >= length
                         get weight exactly 0
        context          [B, H], weights [B, S]: dtype of the inputs

    Differences from the original module:

    * The optional source_lengths argument (the original has no mask); a row
      of length 0 has weights and context of zeros. Without it the results
      are the original's.
    * The [B, S, 2H] concatenation is never built (the two halves of
      attn.weight are applied separately), which rounds differently.
    * CPU only; the parameters share one dtype, the inputs may have another:
      the module computes in float64 for float64 inputs, else in float32.
      No double backward.
    """

    def __init__(self, hidden_size: int, *, device=None, dtype=None) -> None:
        super().__init__()
        if hidden_size < 1:
            raise ValueError(f"hidden_size: expected >= 1, got {hidden_size}")
        kw = _factory(device, dtype)
        self.hidden_size = int(hidden_size)
        self.attn = nn.Linear(hidden_size * 2, hidden_size, **kw)
        self.v = nn.Linear(hidden_size, 1, bias=False, **kw)
        self._synced_native()

    def _native_names(self) -> List[str]:
        return ["attn.weight", "attn.bias", "v.weight"]

    def _new_native(self, dtype: str):
        return _qkv.AdditiveAttention(self.hidden_size, dtype=dtype)

    def forward(
        self, decoder_hidden: Tensor, encoder_outputs: Tensor, source_lengths: Any = None
    ) -> Tuple[Tensor, Tensor]:
        """(context [B, H], weights [B, S]) of decoder_hidden [B, H] over
        encoder_outputs [B, S, H]; source_lengths [B] optional."""
        _check_tensor(decoder_hidden, "decoder_hidden")
        _check_tensor(encoder_outputs, "encoder_outputs")
        if decoder_hidden.dim() != 2:
            raise ValueError(
                f"decoder_hidden: expected 2 dimensions [B, H], got shape "
                f"{_shape(decoder_hidden)}"
            )
        if encoder_outputs.dim() != 3:
            raise ValueError(
                f"encoder_outputs: expected 3 dimensions [B, S, H], got shape "
                f"{_shape(encoder_outputs)}"
            )
        lengths = _arrays.ints(source_lengths, "source_lengths")
        native = self._synced_native()
        names, params = self._learned()
        return _AdditiveFunction.apply(native, self._lock, names, lengths, decoder_hidden,
                                       encoder_outputs, *params)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}"

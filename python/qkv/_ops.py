"""qkv's attention as PyTorch operators: `torch.ops.qkv.attention` and
`torch.ops.qkv.attention_backward`, defined with torch.library from the options' rows,
with autograd (the fused backward) and fake kernels (shapes for
torch.compile). The drop-in modules (qkv.torch, qkv.flash_attn, qkv.nn) call
`attention` below. Tensors are in qkv's layout [B, N, H, D]."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _api
from . import _qkv

_STAT = {torch.float64: torch.float64}

# The operators' option arguments: every option of qkv::AttentionOptions
# that PyTorch's schema language can carry, with the C++ defaults
# (_qkv.Options.schema): tensors after q, k, v (positional, so that autograd
# sees them: a float mask has a gradient), the rest keyword-only.
_SCHEMA = _qkv.Options.schema
_TENSORS = tuple(name for name, kind, _ in _SCHEMA if kind == "Tensor?")
_SCALARS = tuple(name for name, kind, _ in _SCHEMA if kind != "Tensor?")


def _arguments() -> str:
    tensors = "".join(f", Tensor? {name}=None" for name in _TENSORS)
    scalars = ", ".join(f"{kind} {name}={default}" for name, kind, default in _SCHEMA
                        if name in _SCALARS)
    return f"{tensors}, *, {scalars}"


torch.library.define("qkv::attention",
                     f"(Tensor q, Tensor k, Tensor v{_arguments()}) -> (Tensor, Tensor)")
torch.library.define(
    "qkv::attention_backward",
    f"(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse{_arguments()}) "
    f"-> (Tensor, Tensor, Tensor{', Tensor' * len(_api.PARAMETER_GRADIENTS)})")

# The operator tensor each parameter gradient belongs to: d_X is X's (d_sinks: sinks); the
# parameters the operator cannot carry (relative_bias, additive) have none.
_PARAMETER_TENSORS = {name: _api.parameter_option(name) for name in _api.PARAMETER_GRADIENTS
                      if _api.parameter_option(name) in _TENSORS}


@torch.library.impl("qkv::attention", "cpu")
def _attention(q: Tensor, k: Tensor, v: Tensor, *tensors, **options) -> Tuple[Tensor, Tensor]:
    o = _api._options(**dict(zip(_TENSORS, tensors)), **options)
    r = _api.attention_with(q, k, v, o, return_lse=True)
    return r.out, r.lse


@torch.library.register_fake("qkv::attention")
def _(q, k, v, *tensors, **options):
    b, nq, hq, _ = q.shape
    out = q.new_empty((b, nq, hq, v.shape[3]))
    lse = q.new_empty((b, hq, nq), dtype=_STAT.get(q.dtype, torch.float32))
    return out, lse


@torch.library.impl("qkv::attention_backward", "cpu")
def _attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                        *tensors, **options) -> Tuple[Tensor, ...]:
    """(dq, dk, dv, then one gradient per qkv.PARAMETER_GRADIENTS); a parameter the options
    do not use has an empty gradient (an operator's outputs cannot be None; each output is a
    Tensor, not a list, so that vmap's per-sample fallback applies)."""
    o = _api._options(**dict(zip(_TENSORS, tensors)), **options)
    g = _api.attention_backward_with(q, k, v, out, dout, lse, o)
    parameters = [lse.new_empty((0,)) if getattr(g, name) is None else getattr(g, name)
                  for name in _api.PARAMETER_GRADIENTS]  # outputs never alias
    return (g.dq, g.dk, g.dv, *parameters)


@torch.library.register_fake("qkv::attention_backward")
def _(dout, q, k, v, out, lse, *tensors, **options):
    named = dict(zip(_TENSORS, tensors))
    parameters = []
    for name in _api.PARAMETER_GRADIENTS:
        tensor = _PARAMETER_TENSORS.get(name)
        parameter = named.get(tensor)
        # A tensor X with an option X_requires_grad (mask) has a gradient when asked.
        flag = f"{tensor}_requires_grad"
        used = parameter is not None and (flag not in _SCALARS or options.get(flag, False))
        parameters.append(lse.new_empty(parameter.shape if used else (0,)))
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), *parameters)


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    q, k, v, *tensors = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, *tensors)
    ctx.options = dict(keyword_only_inputs)
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    if dlse is not None:
        raise NotImplementedError(
            "qkv: attention's lse is not differentiable; detach it before using it in a loss"
        )
    q, k, v, out, lse, *saved = ctx.saved_tensors
    tensors = dict(zip(_TENSORS, saved))
    if dout is None:
        return (None,) * (3 + len(_TENSORS))
    given = ctx.needs_input_grad[3:]  # the tensors passed, in _TENSORS' order
    wanted = {n: i < len(given) and given[i] for i, n in enumerate(_TENSORS)}
    # A float mask is data unless it requires grad; the options say which.
    options = {**ctx.options, "mask_requires_grad": wanted["mask"]}
    dq, dk, dv, *parameters = torch.ops.qkv.attention_backward(dout.contiguous(), q, k, v, out,
                                                               lse, **tensors, **options)
    grads = {}
    for name, gradient in zip(_api.PARAMETER_GRADIENTS, parameters):
        tensor = _PARAMETER_TENSORS.get(name)
        parameter = tensors.get(tensor)
        if parameter is not None and wanted[tensor]:
            grads[tensor] = gradient.to(parameter.dtype)
    return (dq, dk, dv) + tuple(grads.get(n) for n in _TENSORS)


torch.library.register_autograd("qkv::attention", _backward, setup_context=_setup_context)


def dropout_seed_from_torch() -> int:
    """A dropout seed drawn from torch's default CPU generator (so
    torch.manual_seed makes dropout reproducible)."""
    return int(torch.randint(0, 2**62, (), dtype=torch.int64))


def attention(q: Tensor, k: Tensor, v: Tensor, *, window: Optional[Tuple[int, int]] = None,
              dropout_seed: Optional[int] = None, **options) -> Tuple[Tensor, Tensor]:
    """Differentiable attention on torch tensors in qkv's layout: q [B, Nq,
    Hq, D], k [B, Nk, Hkv, D], v [B, Nk, Hkv, Dv] -> (out [B, Nq, Hq, Dv],
    lse [B, Hq, Nq]). Options as qkv.attention's, those the operator
    carries (tensors, numbers and strings; window=(left, right) too).
    Gradients flow to q, k, v, a float mask, sinks and score_scale. Without a dropout_seed,
    dropout draws one from torch's generator (so torch.manual_seed makes it
    reproducible)."""
    if options.get("dropout_p", 0.0) > 0 and dropout_seed is None:
        dropout_seed = dropout_seed_from_torch()
    if window is not None:
        options["window_left"], options["window_right"] = int(window[0]), int(window[1])
    for name in _TENSORS:
        x = options.get(name)
        if x is not None and not isinstance(x, Tensor):
            options[name] = torch.as_tensor(x)
    return torch.ops.qkv.attention(q, k, v, dropout_seed=int(dropout_seed or 0), **options)

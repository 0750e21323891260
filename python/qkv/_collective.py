"""The autograd Function of distributed attention, shared by qkv.distributed
(MPI) and qkv.context_parallel (torch.distributed): one forward and one
backward through a transport's call, and the learnable parameters'
gradients wired from qkv's rows (qkv.PARAMETER_GRADIENTS).

A transport's call has
    rank                        this rank in its group
    forward(q, k, v)            -> (out, lse, saved): saved, the tensors its
                                   backward reads
    backward(saved, dout, wanted) -> (dq, dk, dv, shares): shares maps each
                                   gradient name in `wanted` (the
                                   parameters whose gradient autograd needs)
                                   to this rank's share of it

A parameter's share: the parameters are replicated on every rank, like any
parameter under data parallelism, so each rank's gradient is its share and
the shares sum to the whole problem's gradient.

Both transports check with agree() that the ranks pass the same values
(qkv.context_parallel every value the native check compares, qkv.distributed
only whether the output requires grad: its native calls compare the rest),
each through its own all-reduce.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from . import _api, _arrays


def parameters(options: dict) -> List[Tuple[str, Any]]:
    """(gradient name, tensor) of each learnable parameter among the options,
    in the rows' order: the option X of gradient d_X, when it is a torch
    tensor (the inputs autograd differentiates)."""
    found = []
    for gradient in _api.PARAMETER_GRADIENTS:
        value = options.get(_api.parameter_option(gradient))
        if _arrays.is_torch(value):
            found.append((gradient, value))
    return found


def differentiable(q, k, v, options: dict) -> bool:
    """Whether the output requires grad: grad mode is on and q, k, v or a
    parameter is a tensor that requires it."""
    torch = _arrays.torch_module()
    tensors = [q, k, v] + [t for _, t in parameters(options)]
    return (torch is not None and torch.is_grad_enabled()
            and any(_arrays.is_torch(x) and x.requires_grad for x in tensors))


def requires_grad(q, k, v, options: dict) -> Tuple[str, int]:
    """(name, 1 or 0) of whether the output requires grad, for agree(): the
    backward is collective, so every rank runs it or none does."""
    return ("whether the output requires grad (q, k, v or a learned parameter do; the backward "
            "is collective)", int(differentiable(q, k, v, options)))


def agree(prefix: str, rank: int, named: Sequence[Tuple[str, int]],
          maximum: Callable[[List[int]], List[int]]) -> None:
    """Raises ValueError on every rank unless the ranks pass the same values
    (int64 each, named by the argument). Collective: one
    call of the transport's `maximum`, which all-reduces an int64 vector with
    MAX over the ranks; it carries each value and its bitwise complement, whose
    maximum is the complement of the minimum. The message names every value
    that differs, '; ' between them:

        {prefix}: {name}: expected the same value on every rank, but the ranks
        differ (rank {rank}: {value}, range over ranks: {low} to {high})
    """
    values = [int(value) for _, value in named]
    reduced = maximum(values + [~value for value in values])
    highs, lows = reduced[:len(values)], [~x for x in reduced[len(values):]]
    differ = [f"{name}: expected the same value on every rank, but the ranks differ "
              f"(rank {rank}: {value}, range over ranks: {low} to {high})"
              for (name, _), value, low, high in zip(named, values, lows, highs) if low != high]
    if differ:
        raise ValueError(f"{prefix}: " + "; ".join(differ))


_function: Any = None  # made once torch is used (qkv.distributed runs without it)


def attend(call, q, k, v, options: dict) -> Tuple[Any, Any]:
    """(out, lse) of the call: through autograd when the output requires grad
    (lse is not differentiable), else the call's forward alone."""
    if not differentiable(q, k, v, options):
        out, lse, _ = call.forward(q, k, v)
        return out, lse
    named = parameters(options)
    return _autograd_function().apply(call, [name for name, _ in named], q, k, v,
                                      *(t for _, t in named))


def _autograd_function() -> Any:
    global _function
    if _function is None:
        torch = _arrays.torch_module()
        from torch.autograd.function import once_differentiable

        class DistributedAttention(torch.autograd.Function):
            @staticmethod
            def forward(ctx, call, names, q, k, v, *params):
                # The parameters (in call's options already) are inputs for their gradients.
                out, lse, saved = call.forward(q, k, v)
                ctx.save_for_backward(*saved)
                ctx.call, ctx.names = call, names
                ctx.dtypes = [p.dtype for p in params]
                ctx.mark_non_differentiable(lse)
                return out, lse

            @staticmethod
            @once_differentiable
            def backward(ctx, dout, _dlse):
                # Collective: computed on every rank, whichever inputs need it.
                needs = ctx.needs_input_grad
                wanted = [name for i, name in enumerate(ctx.names) if needs[5 + i]]
                dq, dk, dv, shares = ctx.call.backward(ctx.saved_tensors, dout, wanted)
                params: List[Optional[Any]] = [
                    shares[name].to(dtype) if name in wanted else None
                    for name, dtype in zip(ctx.names, ctx.dtypes)]
                return (None, None, dq if needs[2] else None, dk if needs[3] else None,
                        dv if needs[4] else None, *params)

        _function = DistributedAttention
    return _function


def whole_as_share(whole: Dict[str, Any], rank: int) -> Dict[str, Any]:
    """Shares of gradients that every rank holds whole: rank 0's share is the
    whole gradient, the others' zero."""
    torch = _arrays.torch_module()
    return {name: g if rank == 0 else torch.zeros_like(g) for name, g in whole.items()}

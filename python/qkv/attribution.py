"""Model-free attribution math shared by qkv.explain and qkv.explorer:
attention rollout (Abnar & Zuidema 2020) and integrated gradients
(Sundararajan et al. 2017) of any scalar function along the straight path.
qkv.explain re-exports both; see docs/explain.md."""

from __future__ import annotations

import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["rollout", "integrated_gradients_fn"]


def rollout(maps: torch.Tensor, mask: Optional[torch.Tensor] = None,
            residual: float = 0.5) -> torch.Tensor:
    """Attention rollout (Abnar & Zuidema 2020).

    maps [L, H, N, N] (or [L, N, N], already averaged over heads), layer 0
    first; mask [N] (True/1 = real token) or None (all real). Per layer
    A = mean over heads, restricted to the real tokens and its rows
    renormalized, then A' = (1 - residual) A + residual I (residual 0.5 as in
    the paper), rows renormalized; the result is A'_{L-1} ... A'_1 A'_0.

    Returns [N, N] float64: row i, how much of position i's last-layer
    state comes from each input position under linear mixing; rows and
    columns of padding are zero."""
    maps = torch.as_tensor(maps)
    if maps.dim() == 4:
        maps = maps.mean(dim=1)
    if maps.dim() != 3 or maps.shape[-1] != maps.shape[-2]:
        raise ValueError(f"maps must be [L, H, N, N] or [L, N, N], got {tuple(maps.shape)}")
    n = maps.shape[-1]
    real = torch.ones(n, dtype=torch.bool) if mask is None else torch.as_tensor(mask).bool()
    if real.shape != (n,):
        raise ValueError(f"mask must be [{n}], got {tuple(real.shape)}")
    idx = real.nonzero().flatten()
    a = maps.to(torch.float64)[:, idx][:, :, idx]  # [L, n, n]
    a = a / a.sum(-1, keepdim=True).clamp_min(1e-300)
    eye = torch.eye(len(idx), dtype=torch.float64)
    result = eye
    for layer in a:
        step = (1.0 - residual) * layer + residual * eye
        step = step / step.sum(-1, keepdim=True)
        result = step @ result
    full = torch.zeros(n, n, dtype=torch.float64)
    full[idx.view(-1, 1), idx.view(1, -1)] = result
    return full


def _weights(rule: str, steps: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(alphas, weights) of a quadrature rule on [0, 1] with `steps` intervals."""
    if rule == "trapezoid":
        # i / steps is correctly rounded, so a point of n steps is bit for bit
        # the same point of 2n steps and is not computed again
        alphas = torch.tensor([i / steps for i in range(steps + 1)], dtype=torch.float64)
        w = torch.full((steps + 1,), 1.0 / steps, dtype=torch.float64)
        w[0] = w[-1] = 0.5 / steps
        return alphas, w
    if rule == "midpoint":
        alphas = torch.tensor([(i + 0.5) / steps for i in range(steps)], dtype=torch.float64)
        return alphas, torch.full((steps,), 1.0 / steps, dtype=torch.float64)
    raise ValueError(f"rule must be 'trapezoid' or 'midpoint', got {rule!r}")


def integrated_gradients_fn(
    f: Callable[..., torch.Tensor],
    inputs: Sequence[torch.Tensor],
    baselines: Sequence[torch.Tensor],
    steps: int = 64,
    max_steps: int = 512,
    tolerance: float = 0.01,
    rule: str = "trapezoid",
    batch_size: int = 32,
    progress: bool = False,
) -> Tuple[List[torch.Tensor], dict]:
    """Integrated gradients of a scalar function along the straight path.

    f takes tensors shaped [S, *x.shape] (one per input, a batch of S path
    points) and returns [S] scalars. inputs and baselines: tensors of
    matching shapes. The path integral of the gradient is approximated with
    `rule` ("trapezoid" or "midpoint") on `steps` intervals; while the
    completeness error |sum(attributions) - (f(x) - f(baseline))| /
    |f(x) - f(baseline)| exceeds `tolerance` the step count is doubled, up to
    `max_steps` (the trapezoid rule reuses the points already computed).

    Returns (attributions, info): attributions, one tensor per input with its
    shape, (x - baseline) * the averaged gradient, float64; info: dict with
    steps, rule, f_input, f_baseline, delta (= f_input - f_baseline),
    attribution_sum, relative_error, converged (bool), evaluations."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    xs = [x.detach().to(torch.float32) for x in inputs]
    bs = [b.detach().to(torch.float32) for b in baselines]
    for x, b in zip(xs, bs):
        if x.shape != b.shape:
            raise ValueError(f"input {tuple(x.shape)} and baseline {tuple(b.shape)} differ")
    cache: Dict[float, Tuple[float, List[torch.Tensor]]] = {}

    def evaluate(alphas: List[float], bar) -> None:
        todo = [a for a in alphas if a not in cache]
        if bar is not None:
            bar.total = len(cache) + len(todo)
            bar.refresh()
        for start in range(0, len(todo), batch_size):
            chunk = todo[start:start + batch_size]
            al = torch.tensor(chunk, dtype=torch.float32)
            points = []
            for x, b in zip(xs, bs):
                shape = (-1,) + (1,) * x.dim()
                p = (b.unsqueeze(0) + al.view(shape) * (x - b).unsqueeze(0))
                points.append(p.requires_grad_(True))
            with torch.enable_grad():
                values = f(*points)
                grads = torch.autograd.grad(values.sum(), points)
            for k, a in enumerate(chunk):
                cache[a] = (float(values[k].detach()), [g[k].to(torch.float64) for g in grads])
            if bar is not None:
                bar.update(len(chunk))

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(desc="integrated gradients", unit="step", file=sys.stderr)
    try:
        evaluate([0.0, 1.0], bar)
        f0, f1 = cache[0.0][0], cache[1.0][0]
        delta = f1 - f0
        n = steps
        while True:
            alphas, weights = _weights(rule, n)
            evaluate([float(a) for a in alphas], bar)
            avg = [torch.zeros(x.shape, dtype=torch.float64) for x in xs]
            for a, w in zip(alphas.tolist(), weights.tolist()):
                for acc, g in zip(avg, cache[a][1]):
                    acc += w * g
            attributions = [(x.double() - b.double()) * g for x, b, g in zip(xs, bs, avg)]
            total = float(sum(t.sum() for t in attributions))
            err = abs(total - delta) / max(abs(delta), 1e-12)
            if err <= tolerance or n * 2 > max_steps:
                break
            n *= 2
    finally:
        if bar is not None:
            bar.close()
    info = dict(steps=n, rule=rule, f_input=f1, f_baseline=f0, delta=delta,
                attribution_sum=total, relative_error=err, converged=err <= tolerance,
                tolerance=tolerance, evaluations=len(cache))
    return attributions, info

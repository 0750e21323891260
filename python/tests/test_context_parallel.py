"""qkv.context_parallel: examples/context_parallel.py under torchrun with 2
ranks and 4 (more ranks than cores): ring and all-to-all attention forward
and backward in float32 and bfloat16, and a training step, against one
process; a rank's bad argument raising on every rank; and in this process
(a gloo group of one rank) the arguments and the one-rank results."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import torch.distributed as dist

import launch
import qkv
import qkv.context_parallel as cp

ROOT = pathlib.Path(__file__).resolve().parents[2]


def torchrun(ranks: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node ranks args`; a run past `timeout` (a
    deadlock) is killed with its processes and fails the test."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
               "--standalone", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return launch.run(command, env, timeout, ROOT)


@pytest.mark.parametrize("ranks", [2, 4])
def test_example_under_torchrun(ranks):
    done = torchrun(ranks, "examples/context_parallel.py")
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    lines = done.stdout.splitlines()
    checks = [f"{run} {dtype} {what}" for dtype in ("float32", "bfloat16")
              for run in ("ring contiguous", "ring zigzag", "ulysses zigzag")
              for what in ("out", "lse", "dq", "dk", "dv")]
    checks += ["training step loss", "training step gradients"]
    assert len(lines) == len(checks) + 1, done.stdout
    for check, line in zip(checks, lines):
        assert line.startswith(check), line
        assert line.endswith(f" of {ranks}): ok"), line
    assert lines[-1] == f"all {len(checks)} checks passed on {ranks} ranks"


BAD_ON_ONE_RANK = """
    import os
    import torch, torch.distributed as dist
    import qkv.context_parallel as cp

    def say(line):  # one write per line: the ranks share the pipe
        os.write(1, (line + "\\n").encode())

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    q = torch.ones(1, 8 if rank == 0 else 6, 4, 16)
    for function in (cp.ring_attention, cp.ulysses_attention):
        try:
            function(q, q, q, causal=True)
            say("no error")
        except ValueError as e:
            say(f"{type(e).__name__} {e}")
    bad = torch.ones(1, 8, 4) if rank == 1 else torch.ones(1, 8, 4, 16)
    try:
        cp.ring_attention(bad, bad, bad)
    except ValueError as e:
        say(f"{type(e).__name__} {e}")
    q = [1.0] if rank == 1 else torch.ones(1, 8, 4, 16)
    try:
        cp.ulysses_attention(q, torch.ones(1, 8, 4, 16), torch.ones(1, 8, 4, 16))
    except (TypeError, ValueError) as e:
        say(f"{type(e).__name__} {e}")
    dist.destroy_process_group()
"""


def test_bad_arguments_on_one_rank_raise_everywhere(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text(textwrap.dedent(BAD_ON_ONE_RANK))
    done = torchrun(2, str(script), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    lines = sorted(done.stdout.splitlines())
    disagree = ("ValueError {}: the ranks disagree on the shapes, dtype, layout, causal or "
                "scale (every rank must pass the same)")
    assert lines == sorted(2 * [disagree.format("ring_attention"),
                                disagree.format("ulysses_attention"),
                                "ValueError ring_attention: rank 1: q must be 4-D [B, n, H, D], "
                                "got shape (1, 8, 4)"]
                                + ["TypeError ulysses_attention: q must be a torch.Tensor, got list",
                                   "ValueError ulysses_attention: rank 1: q must be a "
                                   "torch.Tensor, got list"]), done.stdout


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    if not dist.is_initialized():
        store = tmp_path_factory.mktemp("store") / "rendezvous"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield dist.group.WORLD


def inputs(dtype=torch.float32, n=16, hq=4, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, n, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))


@pytest.mark.parametrize("function", [cp.ring_attention, cp.ulysses_attention])
@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_one_rank_equals_attention(group, function, layout, causal):
    # One rank holds every row (the zigzag layout in its two halves, in
    # order): the result is one qkv.attention call's, to the merge's rounding.
    q, k, v = (x.requires_grad_(True) for x in inputs())
    r = function(q, k, v, group, layout=layout, causal=causal, scale=0.3, return_lse=True)
    want = qkv.attention(q.detach(), k.detach(), v.detach(), causal=causal, scale=0.3,
                         return_lse=True)
    torch.testing.assert_close(r.out, want.out, rtol=0, atol=4 * 2.0**-24 * 4)
    torch.testing.assert_close(r.lse, want.lse, rtol=0, atol=4 * 2.0**-24 * 8)
    dout = torch.randn_like(r.out)
    (r.out * dout).sum().backward()
    g = qkv.attention_backward(q.detach(), k.detach(), v.detach(), want.out, dout, want.lse,
                               causal=causal, scale=0.3)
    for got, expected in ((q.grad, g.dq), (k.grad, g.dk), (v.grad, g.dv)):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_dtypes(group, dtype):
    q, k, v = inputs(dtype)
    out = cp.ring_attention(q, k, v, group, causal=True)
    assert out.dtype == dtype
    torch.testing.assert_close(out, qkv.attention(q, k, v, causal=True))


def test_no_grad_and_default_group(group):
    q, k, v = (x.requires_grad_(True) for x in inputs())
    with torch.no_grad():
        out = cp.ring_attention(q, k, v)
    assert not out.requires_grad
    torch.testing.assert_close(out, qkv.attention(q.detach(), k.detach(), v.detach()))


@pytest.mark.parametrize("call, error, says", [
    (lambda q, k, v: cp.ring_attention(q, k, v, layout="striped"), ValueError,
     "ring_attention: rank 0: layout must be one of contiguous, zigzag, got 'striped'"),
    (lambda q, k, v: cp.ring_attention(q[0], k, v), ValueError,
     "q must be 4-D [B, n, H, D], got shape (16, 4, 16)"),
    (lambda q, k, v: cp.ring_attention(q.numpy(), k, v), TypeError,
     "ring_attention: q must be a torch.Tensor, got ndarray"),
    (lambda q, k, v: cp.ring_attention(q, k.double(), v), ValueError,
     "k must have q's dtype torch.float32, got torch.float64"),
    (lambda q, k, v: cp.ring_attention(q, k[:, :8], v[:, :8], causal=True), ValueError,
     "causal attention needs as many query rows as keys per rank, got 16 and 8"),
    (lambda q, k, v: cp.ring_attention(q[:, :15], k[:, :15], v[:, :15], layout="zigzag"),
     ValueError, "the zigzag layout needs an even number of rows per rank, got 15 and 15"),
    (lambda q, k, v: cp.ring_attention(q[:, :, :3], k, v), ValueError,
     "Hq (3) must be a multiple of Hkv (2)"),
    (lambda q, k, v: cp.ring_attention(q, k[..., :8], v), ValueError,
     "k [B, nk, Hkv, Dk] and v [B, nk, Hkv, Dv] must match q"),
    (lambda q, k, v: cp.ring_attention(q, k, v, scale="big"), ValueError,
     "scale must be a number or None, got 'big'"),
    (lambda q, k, v: cp.ring_attention(q.int(), k.int(), v.int()), ValueError,
     "q must be float32, float64, bfloat16 or float16, got torch.int32"),
])
def test_bad_arguments(group, call, error, says):
    with pytest.raises(error) as raised:
        call(*inputs())
    assert says in str(raised.value)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(st.sampled_from([cp.ring_attention, cp.ulysses_attention]), st.sampled_from(cp.LAYOUTS),
       st.booleans(), st.integers(1, 12), st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3)]),
       st.sampled_from([8, 16, 24]), st.integers(0, 2**31))
def test_one_rank_any_shape(group, function, layout, causal, half, heads, d, seed):
    # Any shape the checks accept gives qkv.attention's result on one rank.
    n = 2 * half
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, n, h, d, generator=g) for h in (heads[0], heads[1], heads[1]))
    out = function(q, k, v, group, layout=layout, causal=causal)
    torch.testing.assert_close(out, qkv.attention(q, k, v, causal=causal), rtol=0,
                               atol=8 * 2.0**-24 * float(v.abs().max()))

"""qkv.context_parallel: examples/context_parallel.py under torchrun with 2
ranks and 4 (more ranks than cores): ring and all-to-all attention forward
and backward in float32 and bfloat16, and a training step, against one
process; a rank's bad argument raising on every rank; and in this process
the agreement check (two ranks simulated), and (a gloo group of one rank)
the arguments and the one-rank results."""

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
from qkv import _collective

ROOT = pathlib.Path(__file__).resolve().parents[2]


def torchrun(ranks: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node ranks args`; a run past `timeout` (a
    deadlock) is killed with its processes and fails the test."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
               "--standalone", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return launch.run(command, env, timeout, ROOT)


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 4])
def test_example_under_torchrun(ranks):
    done = torchrun(ranks, "examples/context_parallel.py")
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    lines = done.stdout.splitlines()
    checks = [f"{run} {dtype} {what}" for dtype in ("float32", "bfloat16")
              for run in ("ring contiguous", "ring zigzag", "ulysses zigzag",
                          "ring zigzag options", "ulysses contiguous options")
              for what in ("out", "lse", "dq", "dk", "dv", "d_sinks", "d_score_scale")
              if not what.startswith("d_s") or run.endswith("options")]
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
    q = torch.ones(1, 8, 4, 16, requires_grad=rank == 0)  # the backward would wait for rank 1
    try:
        cp.ring_attention(q, q, q)
    except ValueError as e:
        say(f"{type(e).__name__} {e}")
    dist.destroy_process_group()
"""


@pytest.mark.slow
def test_bad_arguments_on_one_rank_raise_everywhere(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text(textwrap.dedent(BAD_ON_ONE_RANK))
    done = torchrun(2, str(script), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    lines = sorted(done.stdout.splitlines())
    rows = ("{}'s rows (dim 1): expected the same value on every rank, but the ranks differ "
            "(rank {}: {}, range over ranks: 6 to 8)")
    disagree = "ValueError {}: " + rows + "; " + rows
    rank3 = "expected rank 4, got rank 3 with sizes [1, 8, 4]"
    grad = ("ValueError ring_attention: whether the output requires grad (q, k, v or a learned "
            "parameter do; the backward is collective): expected the same value on every rank, "
            "but the ranks differ (rank {}: {}, range over ranks: 0 to 1)")
    assert lines == sorted([disagree.format(kind, "q", rank, n, "k", rank, n)
                            for kind in ("ring_attention", "ulysses_attention")
                            for rank, n in ((0, 8), (1, 6))]
                           + 2 * [f"ValueError ring_attention: rank 1 of 2: q: {rank3}; "
                                  f"k: {rank3}; v: {rank3}"]
                           + ["TypeError ulysses_attention: q must be a torch.Tensor, got list",
                              "ValueError ulysses_attention: rank 1 of 2: q must be a "
                              "torch.Tensor, got list"]
                           + [grad.format(rank, 1 - rank) for rank in (0, 1)]), done.stdout


def test_agreement_names_every_value_that_differs_at_the_int64_extremes():
    # Two ranks in this process: each rank's `maximum` takes the other's vector in.
    low, high = -2**63, 2**63 - 1
    named = {0: [("a", 3), ("b", low), ("c", high)], 1: [("a", 4), ("b", high), ("c", high)]}
    for rank in (0, 1):
        other = [value for _, value in named[1 - rank]]
        theirs = torch.tensor(other + [~value for value in other])
        with pytest.raises(ValueError) as raised:
            _collective.agree("kind", rank, named[rank],
                              lambda xs: torch.maximum(torch.tensor(xs), theirs).tolist())
        assert str(raised.value) == (
            f"kind: a: expected the same value on every rank, but the ranks differ (rank {rank}: "
            f"{3 + rank}, range over ranks: 3 to 4); b: expected the same value on every rank, "
            f"but the ranks differ (rank {rank}: {named[rank][1][1]}, range over ranks: {low} to "
            f"{high})")
    _collective.agree("kind", 0, named[0], lambda xs: xs)  # one rank agrees with itself


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
     "ring_attention: rank 0 of 1: layout must be one of contiguous, zigzag, got 'striped'"),
    (lambda q, k, v: cp.ring_attention(q[0], k, v), ValueError,
     "ring_attention: rank 0 of 1: q: expected rank 4, got rank 3 with sizes [16, 4, 16]"),
    (lambda q, k, v: cp.ring_attention(q.numpy(), k, v), TypeError,
     "ring_attention: q must be a torch.Tensor, got ndarray"),
    (lambda q, k, v: cp.ring_attention(q, k.double(), v), ValueError,
     "k: expected dtype f32 (the dtype of q), got f64"),
    (lambda q, k, v: cp.ring_attention(q[:, :15], k[:, :15], v[:, :15], layout="zigzag"),
     ValueError, "ring_attention: q, k: Layout::zigzag expects an even number of rows per rank "
     "(two chunks), got 15 query and 15 key rows"),
    (lambda q, k, v: cp.ring_attention(q[:, :, :3], k, v), ValueError,
     "q: query heads Hq = 3 must be a multiple of the KV heads Hkv = 2"),
    (lambda q, k, v: cp.ring_attention(q, k[..., :8], v), ValueError,
     "k: expected head dim (dim 3) 16 to match q's, got 8"),
    (lambda q, k, v: cp.ring_attention(q, k, v, scale="big"), TypeError,
     "ring_attention: scale: expected a float or None, got str"),
    (lambda q, k, v: cp.ring_attention(q, k, v, bogus=1), TypeError,
     "ring_attention: Options() got an unexpected keyword argument 'bogus'"),
    (lambda q, k, v: cp.ring_attention(q.int(), k.int(), v.int()), ValueError,
     "expected float32, float64, float16, bfloat16 or bool elements, got int32"),
    (lambda q, k, v: cp.ring_attention(q, k, v, mask=torch.ones(16, 16, dtype=torch.bool)),
     ValueError, "options.mask: not supported by qkv::dist::ring_attention"),
    (lambda q, k, v: cp.ring_attention(q, k, v, key_lengths=[3, 40]), ValueError,
     "options.key_lengths[1]: expected a length in [0, Nk = 16] (keys of the whole sequence), "
     "got 40"),
    (lambda q, k, v: cp.ulysses_attention(q, k, v, return_probs=True), ValueError,
     "options.return_probs: not supported by qkv::dist::ulysses_attention"),
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


@pytest.mark.parametrize("function", [cp.ring_attention, cp.ulysses_attention])
@pytest.mark.parametrize("layout", cp.LAYOUTS)
def test_one_rank_with_options(group, function, layout):
    # The options of the whole problem reach every piece: one rank gives
    # one qkv.attention call's result and gradients, the learned
    # parameters' included (and dropout's mask).
    q, k, v = (x.requires_grad_(True) for x in inputs())
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], requires_grad=True)
    scales = torch.tensor([0.75, -0.5, 1.25, 0.25], requires_grad=True)
    options = dict(causal=True, window=(5, 0), key_lengths=[16, 11], softcap=8.0,
                   alibi_slopes=qkv.alibi_slopes(4), dropout_p=0.2, dropout_seed=3,
                   score_scale_log_n=True)
    r = function(q, k, v, group, layout=layout, return_lse=True, sinks=sinks,
                 score_scale=scales, **options)
    plain = dict(options, sinks=sinks.detach(), score_scale=scales.detach())
    want = qkv.attention(q.detach(), k.detach(), v.detach(), return_lse=True, **plain)
    torch.testing.assert_close(r.out, want.out, rtol=0, atol=1e-6)
    torch.testing.assert_close(r.lse, want.lse, rtol=0, atol=1e-6)
    dout = torch.randn_like(r.out)
    (r.out * dout).sum().backward()
    g = qkv.attention_backward(q.detach(), k.detach(), v.detach(), want.out, dout, want.lse,
                               **plain)
    for got, expected in ((q.grad, g.dq), (k.grad, g.dk), (v.grad, g.dv), (sinks.grad, g.d_sinks),
                          (scales.grad, g.d_score_scale)):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)

"""qkv.distributed: examples/ring_attention.py under mpiexec with 2 and 3
ranks (ring and all-to-all attention, forward and autograd backward,
against single-process qkv.attention), collective errors under mpiexec, and
in this process (mpi4py's COMM_WORLD of one rank; importing mpi4py.MPI
initializes MPI as a singleton) the arguments, the array kinds and the
one-rank results."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import launch

pytest.importorskip("mpi4py")
# ImportError (not only ModuleNotFoundError) when qkv was built without MPI
distributed = pytest.importorskip("qkv.distributed", exc_type=ImportError)

import qkv  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
U = 2.0**-24
MPIEXEC = shutil.which("mpiexec")


def mpiexec(ranks: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs `python args` on `ranks` ranks; a run past `timeout` (a deadlock)
    is killed, with all its processes, and fails the test."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_btl_vader_single_copy_mechanism="none", OMP_NUM_THREADS="1")
    command = [MPIEXEC, "-n", str(ranks), "--oversubscribe", sys.executable, *args]
    return launch.run(command, env, timeout, ROOT)


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 3])
def test_example_under_mpiexec(ranks):
    done = mpiexec(ranks, "examples/ring_attention.py")
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    lines = done.stdout.splitlines()
    checks = [f"{run} {what}" for run in ("ring contiguous", "ring zigzag", "ulysses")
              for what in ("out", "lse", "dq", "dk", "dv")]
    assert len(lines) == len(checks) + 1, done.stdout
    for check, line in zip(checks, lines):
        assert line.startswith(check + ": max error "), line
        assert line.endswith(f" of {ranks}): ok"), line
    assert lines[-1] == f"all {len(checks)} checks passed on {ranks} ranks"


BAD_ARGUMENTS = """
    import numpy as np
    import qkv.distributed as d
    import torch
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, last = comm.Get_rank(), comm.Get_size() - 1
    q = np.ones((1, 8, 4, 16), np.float32)
    k = np.ones((1, 8, 2, 16), np.float32)

    def outcome(call):
        try:
            call()
        except Exception as e:
            return type(e).__name__, " ".join(str(e).split())
        return "no-error", ""

    # Each bad only on the last rank: every rank raises, nobody waits.
    bad = rank == last
    cases = {
        "dtype": lambda: d.ring_attention(q.astype(np.int32) if bad else q, k, k, comm),
        "layout": lambda: d.ring_attention(q, k, k, comm, layout="x" if bad else "zigzag"),
        "type": lambda: d.ulysses_attention([1] if bad else q, k, k, comm),
        "shape": lambda: d.ring_attention(q[:, :6] if bad else q, k, k, comm),
        "option": lambda: d.ring_attention(q, k, k, comm, causal=bad),
        "grad": lambda: d.ring_attention(torch.ones(q.shape, requires_grad=bad),
                                         torch.ones(k.shape), torch.ones(k.shape), comm),
    }
    lines = [f"{rank} {name} {' '.join(outcome(call))}" for name, call in cases.items()]
    out = d.ring_attention(q, k, k, comm)  # the ranks still agree
    lines.append(f"{rank} after {out.shape}")
    lines = comm.gather(lines)  # printed by rank 0 alone: the ranks' lines would interleave
    if rank == 0:
        print("\\n".join(line for per_rank in lines for line in per_rank))
"""


@pytest.mark.slow
def test_bad_arguments_on_one_rank_raise_everywhere(tmp_path):
    pytest.importorskip("torch")
    script = tmp_path / "bad_arguments.py"
    script.write_text(textwrap.dedent(BAD_ARGUMENTS))
    done = mpiexec(2, str(script), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    got = {}
    for line in done.stdout.splitlines():
        rank, name, rest = line.split(" ", 2)
        got[int(rank), name] = rest
    prefix = "qkv: qkv::dist::ring_attention, rank 1 of 2: "
    for rank in (0, 1):
        assert got[rank, "dtype"].startswith("ValueError " + prefix + "q: expected float32")
        assert got[rank, "layout"] == (
            "ValueError " + prefix + "layout: expected 'contiguous' or 'zigzag', got 'x'")
        assert "options.causal: expected the same value on every rank" in got[rank, "option"]
        assert "q's rows (dim 1): expected the same value on every rank" in got[rank, "shape"]
        assert got[rank, "grad"] == (
            "ValueError qkv: qkv::dist::ring_attention: whether the output requires grad (q, k, "
            "v or a learned parameter do; the backward is collective): expected the same value "
            f"on every rank, but the ranks differ (rank {rank}: {rank}, range over ranks: 0 to 1)")
        assert got[rank, "after"] == "(1, 8, 4, 16)"
    # The rank whose argument had the wrong type raises its TypeError; the
    # others its message.
    assert got[1, "type"] == "TypeError q: expected a NumPy array or a PyTorch tensor, got list"
    assert got[0, "type"] == ("ValueError qkv: qkv::dist::ulysses_attention, rank 1 of 2: "
                              "q: expected a NumPy array or a PyTorch tensor, got list")


EVERY_OPTION = """
    import numpy as np
    import qkv
    import qkv.distributed as d
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, ranks = comm.Get_rank(), comm.Get_size()
    n, rng = 8, np.random.default_rng(7)
    q, dout = (rng.standard_normal((2, n * ranks, 4, 8)) for _ in range(2))
    k, v = (rng.standard_normal((2, n * ranks, 2, 8)) for _ in range(2))
    c = n // 2
    layouts = {
        "contiguous": np.arange(rank * n, (rank + 1) * n),
        "zigzag": np.r_[rank * c:(rank + 1) * c, (2 * ranks - 1 - rank) * c:(2 * ranks - rank) * c],
    }
    options = [
        {},
        dict(causal=True),
        dict(causal=True, align="top_left", window=(5, 0)),
        dict(window=(3, 2), alibi_slopes=[0.5, 0.25, 0.125, 0.0625], softcap=3.0),
        dict(causal=True, key_lengths=[n * ranks - 3, 5]),
        dict(causal=True, dropout_p=0.25, dropout_seed=99, dropout_offset=3),
        dict(causal=True, key_lengths=[0, 5], sinks=[1.5, -0.5, 0.25, -3.0]),
        dict(causal=True, window=(6, 0), key_lengths=[n * ranks - 2, 7],
             score_scale=[0.75, -0.5, 1.5, 0.25], score_scale_log_n=True,
             sinks=[1.5, -0.5, 0.25, -3.0]),
    ]
    worst = 0.0
    for o in options:
        whole = qkv.attention(q, k, v, return_lse=True, **o)
        g = qkv.attention_backward(q, k, v, whole.out, dout, whole.lse, **o)
        for how, rows in [*layouts.items(), ("ulysses", layouts["contiguous"])]:
            qs, ks, vs, ds = (x[:, rows] for x in (q, k, v, dout))
            if how == "ulysses":
                r = d.ulysses_attention(qs, ks, vs, comm, return_lse=True, **o)
                gs = d.ulysses_attention_backward(qs, ks, vs, r.out, ds, r.lse, comm, **o)
            else:
                r = d.ring_attention(qs, ks, vs, comm, layout=how, return_lse=True, **o)
                gs = d.ring_attention_backward(qs, ks, vs, r.out, ds, r.lse, comm, layout=how,
                                               **o)
            pairs = [(r.out, whole.out[:, rows]), (r.lse, whole.lse[:, :, rows]),
                     (gs.dq, g.dq[:, rows]), (gs.dk, g.dk[:, rows]), (gs.dv, g.dv[:, rows])]
            for name in ("sinks", "score_scale"):  # the learned parameters qkv::dist takes
                assert (getattr(gs, "d_" + name) is None) == (name not in o), (how, o)
                if name in o:
                    pairs.append((getattr(gs, "d_" + name), getattr(g, "d_" + name)))
            for got, want in pairs:
                finite = np.isfinite(want)
                assert np.array_equal(np.isfinite(got), finite), (how, o)
                error = np.abs(got[finite] - want[finite]).max(initial=0.0)
                assert error < 1e-12, (how, o, error)
                worst = max(worst, error)
    # Autograd: each rank's sinks.grad and score_scale.grad are its shares;
    # the shares sum to d_sinks and d_score_scale.
    import torch

    o = options[-1]
    whole = qkv.attention(q, k, v, return_lse=True, **o)
    g = qkv.attention_backward(q, k, v, whole.out, dout, whole.lse, **o)
    for how, rows in [*layouts.items(), ("ulysses", layouts["contiguous"])]:
        params = {name: torch.tensor(o[name], dtype=torch.float64, requires_grad=True)
                  for name in ("sinks", "score_scale")}
        qs, ks, vs, ds = (torch.from_numpy(x[:, rows]) for x in (q, k, v, dout))
        kw = dict(o, **params)
        if how == "ulysses":
            out = d.ulysses_attention(qs.requires_grad_(), ks, vs, comm, **kw)
        else:
            out = d.ring_attention(qs.requires_grad_(), ks, vs, comm, layout=how, **kw)
        (out * ds).sum().backward()
        for name, p in params.items():
            error = np.abs(comm.allreduce(p.grad.numpy()) - getattr(g, "d_" + name)).max()
            assert error < 1e-12, (how, name, error)
            worst = max(worst, error)
    worst = comm.gather(worst)  # printed by rank 0 alone: the ranks' lines would interleave
    if rank == 0:
        print("worst", *worst)
"""


@pytest.mark.slow
def test_float64_every_option_on_two_ranks(tmp_path):
    """float64 (the reference backend on every piece) with each supported
    option, the forward and the explicit backward functions on NumPy
    arrays, against one process."""
    script = tmp_path / "every_option.py"
    script.write_text(textwrap.dedent(EVERY_OPTION))
    done = mpiexec(2, str(script), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    words = done.stdout.split()
    assert len(words) == 3 and words[0] == "worst", done.stdout
    assert all(float(w) < 1e-12 for w in words[1:]), done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("missing, says", [
    ("import qkv._qkv as native; del native.ring_attention",
     "this qkv was built without MPI"),
    ("sys.modules['mpi4py'] = None", "qkv.distributed needs mpi4py"),
])
def test_import_error_names_what_is_missing(missing, says):
    code = f"import sys\n{missing}\nimport qkv.distributed\n"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0
    assert "ImportError" in done.stderr and says in done.stderr, done.stderr[-2000:]
    if "MPI" in says:
        assert "libopenmpi-dev" in done.stderr and "mpi4py" in done.stderr


# In this process: one rank.


@pytest.fixture(scope="module")
def comm():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def problem(dtype=np.float32, b=2, n=16, hq=4, hkv=2, d=16, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, n, hq, d)).astype(dtype)
    k = rng.standard_normal((b, n, hkv, d)).astype(dtype)
    v = rng.standard_normal((b, n, hkv, d)).astype(dtype)
    return q, k, v


def test_comm_of_one_rank(comm):
    assert comm.Get_size() == 1


def test_unknown_layout(comm):
    q, k, v = problem()
    expected = "layout: expected 'contiguous' or 'zigzag', got 'diagonal'"
    with pytest.raises(ValueError, match=expected):
        distributed.ring_attention(q, k, v, comm, layout="diagonal")
    with pytest.raises(TypeError, match="layout: expected 'contiguous' or 'zigzag', got 2"):
        distributed.ring_attention(q, k, v, comm, layout=2)


def test_errors_carry_the_cpp_message(comm):
    q, k, v = problem()
    with pytest.raises(ValueError, match=r"qkv::dist::ring_attention, rank 0 of 1: k: expected "
                                         r"head dim \(dim 3\) 16 to match q's, got 8"):
        distributed.ring_attention(q, k[..., :8], v, comm)
    with pytest.raises(ValueError, match="Layout::zigzag expects an even number of rows per rank"):
        distributed.ring_attention(q[:, :7], k[:, :7], v[:, :7], comm, layout="zigzag")
    with pytest.raises(ValueError, match="align: "
                                         "expected 'bottom_right' or 'top_left', got 'x'"):
        distributed.ulysses_attention(q, k, v, comm, align="x")
    with pytest.raises(ValueError, match=r"options.key_lengths\[0\]: expected a length in "
                                         r"\[0, Nk = 16\]"):
        distributed.ring_attention(q, k, v, comm, key_lengths=[17, 3])
    with pytest.raises(ValueError, match="q: expected float32, float64, float16, bfloat16"):
        distributed.ring_attention(q.astype(np.int32), k, v, comm)
    out = np.zeros_like(q)
    lse = np.zeros((2, 4, 16), np.float64)  # float32 q: float32 lse
    with pytest.raises(ValueError, match="qkv::dist::ring_attention_backward, rank 0 of 1: lse"):
        distributed.ring_attention_backward(q, k, v, out, out, lse, comm)


def test_bad_communicators(comm):
    from mpi4py import MPI

    q, k, v = problem()
    with pytest.raises(TypeError, match="comm: expected an mpi4py communicator"):
        distributed.ring_attention(q, k, v, 0)
    with pytest.raises(ValueError, match="comm: expected a communicator, got MPI.COMM_NULL"):
        distributed.ring_attention(q, k, v, MPI.COMM_NULL)


def test_not_every_option_is_taken(comm):
    q, k, v = problem()
    refused = {
        "mask": np.ones((1, 1, 16, 16), bool),
        "cu_seqlens_q": [0, 16],
        "sparse": qkv.SparsePattern.window(2, 0),
        "rel_bias": np.zeros((4, 8), np.float32),
        "return_probs": True,
    }
    for name, value in refused.items():
        option = "relative_bias" if name == "rel_bias" else name
        with pytest.raises(ValueError, match=f"options.{option}: not supported by "
                                             "qkv::dist::ring_attention"):
            distributed.ring_attention(q, k, v, comm, **{name: value})
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        distributed.ring_attention(q, k, v, comm, bogus=1)


def error_bound(single, exact, merges):
    """The model of tests/dist/dist_test.cpp: twice the single call's error
    plus 4 R u max|exact|."""
    single, exact = np.asarray(single, np.float64), np.asarray(exact, np.float64)
    return 2 * np.abs(single - exact).max() + 4 * merges * U * np.abs(exact).max()


OPTIONS = [
    dict(causal=True),
    dict(causal=True, align="top_left", window=(5, 0)),
    dict(window=(3, 2), alibi_slopes=[0.5, 0.25, 0.125, 0.0625], softcap=3.0),
    dict(causal=True, key_lengths=[13, 16]),
    dict(causal=True, dropout_p=0.25, dropout_seed=1234, dropout_offset=7),
    dict(causal=True, sinks=[0.5, -1.0, 2.0, 0.0]),
]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o))
@pytest.mark.parametrize("how", ["contiguous", "zigzag", "ulysses"])
def test_one_rank_equals_attention(comm, how, options):
    q, k, v = problem()
    if how == "ulysses":
        got = distributed.ulysses_attention(q, k, v, comm, return_lse=True, **options)
    else:
        got = distributed.ring_attention(q, k, v, comm, layout=how, return_lse=True, **options)
    single = qkv.attention(q, k, v, return_lse=True, **options)
    exact = qkv.attention(*(x.astype(np.float64) for x in (q, k, v)), return_lse=True,
                          backend="reference", **options)
    assert isinstance(got.out, np.ndarray) and got.out.dtype == np.float32
    assert got.out.shape == q.shape and got.lse.shape == (2, 4, 16) and got.probs is None
    for what in ("out", "lse"):
        g, s, e = getattr(got, what), getattr(single, what), getattr(exact, what)
        finite = np.isfinite(e)
        assert np.array_equal(np.isfinite(g), finite)
        assert np.abs(g[finite] - e[finite]).max() <= error_bound(s[finite], e[finite], 1), what
    dout = np.random.default_rng(1).standard_normal(q.shape).astype(np.float32)
    if how == "ulysses":
        grads = distributed.ulysses_attention_backward(q, k, v, got.out, dout, got.lse, comm,
                                                       **options)
    else:
        grads = distributed.ring_attention_backward(q, k, v, got.out, dout, got.lse, comm,
                                                    layout=how, **options)
    gs = qkv.attention_backward(q, k, v, single.out, dout, single.lse, **options)
    ge = qkv.attention_backward(*(x.astype(np.float64) for x in (q, k, v, exact.out, dout)),
                                exact.lse, backend="reference", **options)
    for what in ("dq", "dk", "dv", "d_sinks"):
        g, s, e = getattr(grads, what), getattr(gs, what), getattr(ge, what)
        if "sinks" not in options and what == "d_sinks":
            assert g is None
            continue
        assert np.abs(g - e).max() <= error_bound(s, e, 1), what


def test_array_kinds_and_dtypes(comm):
    q, k, v = problem()
    assert isinstance(distributed.ring_attention(q, k, v, comm), np.ndarray)
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf = [x.astype(ml_dtypes.bfloat16) for x in (q, k, v)]
    out = distributed.ulysses_attention(*bf, comm)
    assert out.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(out.view(np.uint16),
                                  qkv.attention(*bf).view(np.uint16))
    torch = pytest.importorskip("torch")
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        t = [torch.from_numpy(x).to(dtype) for x in (q, k, v)]
        r = distributed.ring_attention(*t, comm, layout="zigzag", causal=True, return_lse=True)
        assert isinstance(r.out, torch.Tensor) and r.out.dtype == dtype
        assert r.lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        expected = qkv.attention(*t, causal=True)
        atol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 2e-3}.get(dtype, 2e-2)
        torch.testing.assert_close(r.out, expected, atol=atol, rtol=0)


def test_strided_inputs(comm):
    torch = pytest.importorskip("torch")
    q, k, v = (torch.from_numpy(x) for x in problem())
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # [B, N, H, D] over [B, H, N, D]
    kt = torch.cat([k, k], -1)[..., :16]  # rows of 32 columns, the first 16
    assert not qt.is_contiguous() and not kt.is_contiguous()
    for f in (distributed.ring_attention, distributed.ulysses_attention):
        out = f(qt, kt, v, comm, causal=True)
        torch.testing.assert_close(out, qkv.attention(q, k, v, causal=True), atol=1e-6, rtol=0)


@pytest.mark.parametrize("how", ["contiguous", "zigzag", "ulysses"])
def test_autograd(comm, how):
    torch = pytest.importorskip("torch")

    def attend(q, k, v, sinks=None):
        options = dict(causal=True, window=(6, 0), softcap=4.0, sinks=sinks)
        if how == "ulysses":
            return distributed.ulysses_attention(q, k, v, comm, **options)
        return distributed.ring_attention(q, k, v, comm, layout=how, **options)

    q, k, v = (torch.from_numpy(x).double().requires_grad_() for x in problem(n=8, d=8))
    assert torch.autograd.gradcheck(attend, (q, k, v))
    # The sinks' gradient against autograd through qkv.attention's (float64
    # on both sides; the logits exact in float32, as C++ holds them).
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64, requires_grad=True)
    w = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    got = torch.autograd.grad((attend(q, k, v, sinks) * w).sum(), sinks)[0]
    from qkv import _ops

    want = torch.autograd.grad((_ops.attention(q, k, v, causal=True, window=(6, 0), softcap=4.0,
                                               sinks=sinks)[0] * w).sum(), sinks)[0]
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    # float32, against the single-process backward; gradients only where asked.
    q, k, v = (torch.from_numpy(x) for x in problem())
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    vg = v.clone().requires_grad_()
    out = attend(q, k, vg)
    assert out.requires_grad and out.grad_fn is not None
    (out * dout).sum().backward()
    r = qkv.attention(q, k, v, causal=True, window=(6, 0), softcap=4.0, return_lse=True)
    g = qkv.attention_backward(q, k, v, r.out, dout, r.lse, causal=True, window=(6, 0),
                               softcap=4.0)
    torch.testing.assert_close(vg.grad, g.dv, atol=1e-5, rtol=0)
    with torch.no_grad():
        assert not attend(q, k, vg).requires_grad
    lse = distributed.ring_attention(q, k, vg, comm, return_lse=True).lse
    assert not lse.requires_grad

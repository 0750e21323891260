"""qkv.distributed: attention over one long sequence split by its sequence
axis across the R ranks of an MPI communicator (context parallelism), as
qkv::dist (include/qkv/distributed.hpp; docs/distributed.md has the message
schedule and the error model).

    from mpi4py import MPI
    import qkv.distributed

    out = qkv.distributed.ring_attention(q, k, v, MPI.COMM_WORLD, causal=True)

Run the program under mpiexec (``mpiexec -n 4 python train.py``); every
rank passes its own shard of q, k and v, with the same shapes and options
on every rank:

    q    [B, nq, Hq,  Dk]    this rank's rows of the query sequence
    k    [B, nk, Hkv, Dk]    this rank's rows of the key sequence
    v    [B, nk, Hkv, Dv]
    out  [B, nq, Hq,  Dv]    this rank's rows of the output, dtype of q
    lse  [B, Hq, nq]         float32 (float64 for float64 q), with return_lse

The whole problem has Nq = R * nq query rows and Nk = R * nk keys. Which
rows a rank holds is the layout:

    "contiguous"  rank r holds rows [r * n, (r + 1) * n)
    "zigzag"      the sequence in 2R chunks of n / 2 rows (n even); rank r
                  holds chunks r and 2R - 1 - r, back to back (the same
                  causal work on every rank)

Options speak of the whole problem (positions, causal alignment, windows,
key_lengths [B] up to Nk, ALiBi, the dropout mask), so the gathered outputs
equal one qkv.attention call on the gathered inputs, within the merge's
rounding. Masks, packed sequences, relative bias, additive scores, sparse
patterns and probabilities are not supported.

Arrays are NumPy arrays or PyTorch CPU tensors (any strides), returned as
the kind q is. Torch tensors that require grad are differentiable: the
backward runs ring_attention_backward / ulysses_attention_backward, which
are collective too, so every rank must run backward through the output.

Every call is collective: all ranks call the same functions in the same
order. Errors are collective as well: when any rank's arguments are bad,
every rank raises ValueError with that rank's message (the rank whose
argument had the wrong type raises its TypeError), and nobody waits forever.

Needs a qkv built with MPI (the build finds it when its headers are
installed, Debian's libopenmpi-dev) and mpi4py built for the same MPI.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Callable, Dict, List, NoReturn, Optional, Tuple

from . import _api, _arrays, _collective, _qkv
from ._api import AttentionGradients, AttentionResult

if not hasattr(_qkv, "ring_attention"):
    raise ImportError(
        "qkv.distributed: this qkv was built without MPI, so it has no distributed attention. "
        "Install an MPI with its development files (Debian/Ubuntu: apt-get install "
        "libopenmpi-dev openmpi-bin), rebuild qkv (pip install . finds MPI and builds "
        "qkv::dist), and install mpi4py (pip install mpi4py), which passes the communicator."
    )

try:
    import mpi4py  # noqa: F401  (the package only; importing mpi4py.MPI initializes MPI)
except ImportError as error:
    raise ImportError(
        "qkv.distributed needs mpi4py, which passes the MPI communicator to qkv "
        "(pip install mpi4py, built for the MPI qkv was built with)"
    ) from error

if TYPE_CHECKING:
    from mpi4py.MPI import Intracomm

__all__ = [
    "AttentionGradients",
    "AttentionResult",
    "ring_attention",
    "ring_attention_backward",
    "ulysses_attention",
    "ulysses_attention_backward",
]

_checked_library = False


def _check_library() -> None:
    """Raises RuntimeError when mpi4py runs on another MPI library than the
    one qkv was built with (their communicator handles would not mix)."""
    global _checked_library
    if _checked_library:
        return
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None:
        theirs = mpi.Get_library_version().strip().rstrip("\0").strip()
        ours = _qkv.mpi_library_version().strip().rstrip("\0").strip()
        if theirs != ours:
            raise RuntimeError(
                "qkv.distributed: qkv was built with the MPI library\n  " + ours
                + "\nbut mpi4py runs on\n  " + theirs + "\nand a communicator of one cannot "
                "be used by the other. Build mpi4py for qkv's MPI (pip install --no-binary "
                "mpi4py mpi4py) or rebuild qkv with mpi4py's."
            )
    _checked_library = True


def _handle(comm: Any) -> int:
    """The Fortran handle of an mpi4py communicator (the one form in which a
    communicator crosses between two extension modules)."""
    try:
        py2f = comm.py2f
    except AttributeError:
        raise TypeError(
            f"comm: expected an mpi4py communicator (mpi4py.MPI.Intracomm), got "
            f"{type(comm).__name__}"
        ) from None
    _check_library()
    return int(py2f())


def _fail(handle: int, function: str, error: BaseException) -> NoReturn:
    """Raises `error`, found on this rank before any message was sent, after
    telling the other ranks, which raise ValueError with its message (they
    are waiting in the same collective check inside the native call)."""
    try:
        message = " ".join(str(error).split()) or type(error).__name__  # one line
        _qkv.dist_agree(handle, function, message)
    except ValueError:
        pass
    raise error


def _result(a: Any, like: Any, bf16_as_bits: bool) -> Any:
    """An array the native side allocated, as the kind of `like` (no copy)."""
    if _arrays.is_torch(like):
        return _arrays.torch_module().from_dlpack(a)
    import numpy as np

    out = np.from_dlpack(a)
    return out.view(_arrays.BFLOAT16) if bf16_as_bits else out


def _call(fn: Callable, *args) -> Any:
    """fn(*args) on qkv's thread count (qkv.set_num_threads, else torch's)."""
    result = []
    _api._run(lambda: result.append(fn(*args)))
    return result[0]


class _Call:
    """One distributed call: the function, the communicator, the options and
    the layout, shared by the forward and (under autograd) the backward."""

    def __init__(self, function: str, handle: int, options: Any, layout: Optional[str],
                 bf16_as_bits: bool):
        self.function, self.handle, self.options = function, handle, options
        self.layout, self.bf16_as_bits = layout, bf16_as_bits
        self.rank = 0  # this rank in the communicator

    def forward(self, q, k, v) -> Tuple[Any, Any, Tuple]:
        """(out, lse, saved) as the shared autograd Function takes them."""
        n = _arrays.native
        args = (self.handle, n(q, "q"), n(k, "k"), n(v, "v"), self.options)
        if self.layout is None:
            out, lse = _call(_qkv.ulysses_attention, *args, True, self.bf16_as_bits)
        else:
            out, lse = _call(_qkv.ring_attention, *args, self.layout, True, self.bf16_as_bits)
        out, lse = _result(out, q, self.bf16_as_bits), _result(lse, q, False)
        return out, lse, (q, k, v, out, lse)

    def gradients(self, q, k, v, out, dout, lse) -> Tuple[Any, Any, Any, Dict[str, Any]]:
        """(dq, dk, dv, parameters): this rank's shards, and {gradient: the
        whole problem's (the same on every rank)} of the parameters the
        options use."""
        n = _arrays.native
        args = (self.handle, n(q, "q"), n(k, "k"), n(v, "v"), n(out, "out"), n(dout, "dout"),
                n(lse, "lse"), self.options)
        if self.layout is None:
            grads = _call(_qkv.ulysses_attention_backward, *args, self.bf16_as_bits)
        else:
            grads = _call(_qkv.ring_attention_backward, *args, self.layout, self.bf16_as_bits)
        dq, dk, dv, parameters = grads
        return (*(_result(g, q, self.bf16_as_bits) for g in (dq, dk, dv)),
                {name: _result(g, q, False) for name, g in parameters.items()})

    def backward(self, saved, dout, wanted) -> Tuple[Any, Any, Any, dict]:
        """The shared autograd Function's backward: the parameters' shares."""
        q, k, v, out, lse = saved
        dq, dk, dv, whole = self.gradients(q, k, v, out, dout, lse)
        return dq, dk, dv, _collective.whole_as_share(whole, self.rank)


def _prepare(handle: int, function: str, arrays, layout: Optional[str], options: dict) -> _Call:
    """The call, or (collectively) the error of an argument that fails here,
    before the native call's own collective check."""
    try:
        if layout is not None and not isinstance(layout, str):
            raise TypeError(f"layout: expected 'contiguous' or 'zigzag', got {layout!r}")
        o = _api._options(**options)
        for x, name in arrays:
            _arrays.native(x, name)
        q = arrays[0][0]
        bits = (_arrays.BFLOAT16 is not None and not _arrays.is_torch(q)
                and getattr(q, "dtype", None) == _arrays.BFLOAT16)
    except Exception as error:
        _fail(handle, function, error)
    return _Call(function, handle, o, layout, bits)


def _agree_on_grad(comm, function: str, q, k, v, options: dict) -> None:
    """Raises ValueError on every rank unless all of them agree on whether
    the output requires grad: the backward is collective, so every rank runs
    it or none does. One allreduce (_collective.agree), before any other
    message of the call (a null or inter-communicator is left to the native
    check, which refuses it on every rank)."""
    import numpy as np
    from mpi4py import MPI

    if comm == MPI.COMM_NULL or comm.Is_inter():
        return

    def maximum(xs: List[int]) -> List[int]:  # elementwise, over the ranks
        reduced = np.array(xs, dtype=np.int64)
        comm.Allreduce(MPI.IN_PLACE, reduced, op=MPI.MAX)
        return reduced.tolist()

    _collective.agree(f"qkv: qkv::dist::{function}", comm.Get_rank(),
                      [_collective.requires_grad(q, k, v, options)], maximum)


def _attend(function: str, q, k, v, comm, layout: Optional[str], return_lse: bool,
            options: dict):
    handle = _handle(comm)
    _agree_on_grad(comm, function, q, k, v, options)
    call = _prepare(handle, function, ((q, "q"), (k, "k"), (v, "v")), layout, options)
    try:
        out, lse = _collective.attend(call, q, k, v, options)
        call.rank = comm.Get_rank()  # for the backward; comm passed the checks
    except TypeError as error:  # an argument nanobind could not convert: nothing was sent
        _fail(handle, function, error)
    return AttentionResult(out, lse, None) if return_lse else out


def _gradients(function: str, q, k, v, out, dout, lse, comm, layout: Optional[str],
               options: dict) -> AttentionGradients:
    handle = _handle(comm)
    arrays = ((q, "q"), (k, "k"), (v, "v"), (out, "out"), (dout, "dout"), (lse, "lse"))
    call = _prepare(handle, function, arrays, layout, options)
    try:
        dq, dk, dv, parameters = call.gradients(q, k, v, out, dout, lse)
    except TypeError as error:
        _fail(handle, function, error)
    return AttentionGradients(dq, dk, dv, **parameters)


def ring_attention(
    q,
    k,
    v,
    comm: "Intracomm",
    *,
    layout: str = "contiguous",
    return_lse: bool = False,
    **options,
):
    """Ring attention (Liu et al., 2023) over the ranks of `comm`, an mpi4py
    intracommunicator, as qkv::dist::ring_attention. Collective.

    Shapes (this rank's shards, the same on every rank):
        q    [B, nq, Hq, Dk]    float32, float64, float16 or bfloat16
        k    [B, nk, Hkv, Dk]   Hq a multiple of Hkv (GQA/MQA)
        v    [B, nk, Hkv, Dv]
        out  [B, nq, Hq, Dv]    dtype of q
        lse  [B, Hq, nq]        float32 (float64 for float64 q), with return_lse

    layout "contiguous" (rank r holds rows [r n, (r + 1) n)) or "zigzag"
    (2R chunks of n / 2 rows, rank r holding chunks r and 2R - 1 - r; n
    even): how q, k, v and out are divided among the R ranks. K/V shards
    travel around the ring, each transfer overlapped with the kernel on the
    previous shard; a rank computes only the pieces its masks admit.

    Options as qkv.attention's keywords, of the whole problem; qkv::dist
    takes scale, score="dot", causal with align, window=(left, right),
    key_lengths [B] (each <= Nk = R nk), alibi_slopes [Hq] or [B, Hq],
    sinks [Hq] (counted once per row, not per piece), score_scale [Hq] with
    score_scale_log_n (ln of each row's keys in the whole problem), softcap,
    dropout_p with dropout_seed / dropout_offset (the same mask as one
    qkv.attention call) and backend, and refuses the others by name.

    Returns out, or AttentionResult(out, lse, None) with return_lse; the kind
    of array q is. With torch tensors that require grad, out is
    differentiable (lse is not): every rank must then run backward through it,
    and the ranks must agree on it (where they differ, every rank raises
    ValueError before any other message).
    A learned parameter's gradient (sinks.grad, score_scale.grad) is each
    rank's share of the whole problem's (rank 0 holds it, the others zeros),
    so that summing it over the ranks, as data parallelism does for
    replicated parameters, gives it.
    """
    return _attend(
        "ring_attention", q, k, v, comm, layout, return_lse,
        options,
    )


def ulysses_attention(
    q,
    k,
    v,
    comm: "Intracomm",
    *,
    return_lse: bool = False,
    **options,
):
    """All-to-all attention (DeepSpeed-Ulysses) over the ranks of `comm`, as
    qkv::dist::ulysses_attention. Collective.

    Shards in the contiguous layout (rank r holds rows [r n, (r + 1) n)),
    shapes as ring_attention's: q [B, nq, Hq, Dk], k [B, nk, Hkv, Dk], v [B,
    nk, Hkv, Dv] -> out [B, nq, Hq, Dv] (and lse [B, Hq, nq]). Hq and Hkv must
    be multiples of R: an all-to-all turns the sequence shards into head
    shards, each rank attends over the whole sequence for Hq / R query heads,
    and a second all-to-all brings the output back to sequence shards.

    Options, return value and autograd as ring_attention's.
    """
    return _attend(
        "ulysses_attention", q, k, v, comm, None, return_lse,
        options,
    )


def ring_attention_backward(
    q,
    k,
    v,
    out,
    dout,
    lse,
    comm: "Intracomm",
    *,
    layout: str = "contiguous",
    **options,
) -> AttentionGradients:
    """Gradients of ring_attention, as qkv::dist::ring_attention_backward
    (what autograd runs; for NumPy arrays). Collective. Takes this rank's
    shards of q, k, v, the forward's out and lse (return_lse=True) and dout =
    dLoss/dout [B, nq, Hq, Dv], with the forward's layout and options.
    Returns AttentionGradients(dq, dk, dv, ...): this rank's shards, dtype
    of q, and the gradients of the parameters the options use (d_sinks,
    d_score_scale [Hq]) of the whole problem (every rank's rows; the same on
    every rank). Bitwise deterministic for a given rank count, layout and
    thread count."""
    return _gradients(
        "ring_attention_backward", q, k, v, out, dout, lse, comm, layout,
        options,
    )


def ulysses_attention_backward(
    q,
    k,
    v,
    out,
    dout,
    lse,
    comm: "Intracomm",
    **options,
) -> AttentionGradients:
    """Gradients of ulysses_attention, as
    qkv::dist::ulysses_attention_backward; arguments and result as
    ring_attention_backward's (contiguous shards). Collective."""
    return _gradients(
        "ulysses_attention_backward", q, k, v, out, dout, lse, comm, None,
        options,
    )

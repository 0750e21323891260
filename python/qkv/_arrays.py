"""Arrays in and out of the native module: NumPy arrays and PyTorch CPU tensors
are handed over as they are (any strides, no copy); outputs are allocated as
the caller's kind of array. Only integer metadata (lengths, offsets, block
tables) and per-head floats are converted, to contiguous int64 and float32."""

from __future__ import annotations

import sys
from typing import Any, Optional, Sequence

import numpy as np

try:  # bfloat16 for NumPy
    import ml_dtypes

    BFLOAT16: Optional[np.dtype] = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is optional
    BFLOAT16 = None

_FLOATING = (np.float32, np.float64, np.float16)


def torch_module():
    """The torch module when it has been imported, else None."""
    return sys.modules.get("torch")


def is_torch(x: Any) -> bool:
    torch = torch_module()
    return torch is not None and isinstance(x, torch.Tensor)


# torch.utils.dlpack.to_dlpack, torch.strided and torch.Tensor, once a tensor
# has come by.
_to_dlpack: Any = None
_strided: Any = None
_tensor_type: Any = None


def _torch_capsule(x: Any, name: str) -> Any:
    """A DLPack capsule of CPU tensor x: the same memory, any strides. (The
    capsule, not x itself: Tensor.__dlpack__ costs microseconds of Python
    checks per call, which a small attention call would mostly spend there.)"""
    global _to_dlpack, _strided, _tensor_type
    if _to_dlpack is None:
        from torch.utils.dlpack import to_dlpack

        torch = torch_module()
        _to_dlpack, _strided, _tensor_type = to_dlpack, torch.strided, torch.Tensor
    if not x.is_cpu:
        raise ValueError(f"{name}: expected a CPU tensor, got device '{x.device}'")
    if x.is_neg():  # a lazily negated view: DLPack would hand over the un-negated memory
        x = x.resolve_neg()
    try:
        return _to_dlpack(x)  # autograd's graph is not involved: like x.detach()
    except RuntimeError:  # a sparse or other non-strided layout (checked only then)
        if x.layout is not _strided:
            raise ValueError(
                f"{name}: expected a strided (dense) tensor, got layout {x.layout}"
            ) from None
        raise


def exchangeable(q: Any, k: Any, v: Any) -> bool:
    """Whether q, k and v can go through DLPack's C exchange API (the native
    attention_exchange): plain torch.Tensor objects (no subclass, which may
    override how it is read), none a lazily negated view (DLPack hands over
    the memory without the negation)."""
    global _tensor_type
    if _tensor_type is None:
        torch = torch_module()
        if torch is None:
            return False
        _tensor_type = torch.Tensor
    t = _tensor_type
    return (
        type(q) is t and type(k) is t and type(v) is t
        and not (q.is_neg() or k.is_neg() or v.is_neg())
    )


def native(x: Any, name: str) -> Any:
    """x as the native module takes it: a NumPy array, or a DLPack capsule of
    a CPU tensor (the same memory). Raises TypeError for anything else."""
    if type(x) is _tensor_type:  # the common case first: a plain torch.Tensor
        return _torch_capsule(x, name)
    if isinstance(x, np.ndarray):
        if BFLOAT16 is not None and x.dtype == BFLOAT16:
            return x.view(np.uint16)  # the bits; the native side reads them as bfloat16
        if x.dtype == np.uint16:
            raise TypeError(
                f"{name}: expected float32, float64, float16, bfloat16 or bool elements, "
                "got uint16"
            )
        return x
    if is_torch(x):
        return _torch_capsule(x, name)
    raise TypeError(
        f"{name}: expected a NumPy array or a PyTorch tensor, got {type(x).__name__}"
    )


def optional_native(x: Any, name: str) -> Any:
    return None if x is None else native(x, name)


def _torch_dtype(like: Any, kind: str):
    torch = torch_module()
    if kind == "same":
        return like.dtype
    return torch.float64 if like.dtype == torch.float64 else torch.float32


def _numpy_dtype(like: np.ndarray, kind: str):
    if kind == "same":
        return like.dtype
    return np.float64 if like.dtype == np.float64 else np.float32


def empty(like: Any, shape: Sequence[int], kind: str = "same") -> Any:
    """An uninitialized array of the same kind as `like` (on the CPU): `kind`
    "same" takes its dtype, "stat" float32 (float64 for float64 inputs), the
    dtype of lse and probabilities."""
    if is_torch(like):
        if kind == "same" and like.is_cpu:
            return like.new_empty(tuple(shape))
        return torch_module().empty(tuple(shape), dtype=_torch_dtype(like, kind))
    return np.empty(tuple(shape), dtype=_numpy_dtype(like, kind))


def ints(x: Any, name: str) -> Optional[np.ndarray]:
    """1-D integer metadata as contiguous int64 (None stays None)."""
    if x is None:
        return None
    if is_torch(x):
        torch = torch_module()
        if x.is_floating_point() or x.dtype == torch.bool:
            raise TypeError(f"{name}: expected integers, got a tensor of {x.dtype}")
        x = x.detach().to("cpu", torch.int64).numpy()
    elif isinstance(x, (int, np.integer)):
        x = [x]
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        if a.size == 0:
            a = a.astype(np.int64)
        else:
            raise TypeError(f"{name}: expected integers, got {a.dtype}")
    if a.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence, got {a.ndim} dimensions")
    return np.ascontiguousarray(a, dtype=np.int64)


def floats(x: Any, name: str) -> Optional[np.ndarray]:
    """1-D float metadata (ALiBi slopes) as contiguous float32; [B, H] tables
    are flattened row-major (qkv's [B * Hq] layout)."""
    if x is None:
        return None
    if is_torch(x):
        x = x.detach().to("cpu").float().numpy()
    a = np.asarray(x)
    if a.dtype.kind not in "fiu":
        raise TypeError(f"{name}: expected numbers, got {a.dtype}")
    with np.errstate(over="ignore"):  # out of float32's range: inf, which qkv rejects
        return np.ascontiguousarray(a.reshape(-1), dtype=np.float32)

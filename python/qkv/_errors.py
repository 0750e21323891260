"""The exception the drop-ins raise for invalid arguments."""

from __future__ import annotations


class ArgumentError(ValueError, RuntimeError):
    """An invalid argument to a drop-in (qkv.torch, qkv.flash_attn).

    A ValueError, as qkv's own functions raise for bad values, and a
    RuntimeError, as PyTorch's scaled_dot_product_attention and
    FlashAttention raise for the same inputs: code written against either
    catches it unchanged. The message names the argument, the expected and
    the actual value."""

"""qkv: attention for CPUs, from Python.

    import qkv
    out = qkv.attention(q, k, v, causal=True)        # NumPy arrays or torch tensors

qkv's own API mirrors the C++ one (include/qkv); `qkv.torch` holds a drop-in
for torch.nn.functional.scaled_dot_product_attention and `qkv.flash_attn`
FlashAttention 2's functions, both differentiable. See docs/python.md.
"""

from ._api import (
    Additive,
    AttentionGradients,
    PARAMETER_GRADIENTS,
    AttentionResult,
    KvCache,
    LinearAttentionState,
    RelativeBias,
    SparsePattern,
    alibi_slopes,
    apply_rope,
    apply_rope_backward,
    attention,
    attention_backward,
    decode_attention,
    get_num_threads,
    linear_attention,
    linear_attention_backward,
    linear_attention_state,
    linear_attention_step,
    set_num_threads,
)
from ._errors import ArgumentError

__version__ = "0.1.0"

__all__ = [
    "Additive",
    "ArgumentError",
    "AttentionGradients",
    "PARAMETER_GRADIENTS",
    "AttentionResult",
    "KvCache",
    "LinearAttentionState",
    "RelativeBias",
    "SparsePattern",
    "alibi_slopes",
    "apply_rope",
    "apply_rope_backward",
    "attention",
    "attention_backward",
    "decode_attention",
    "get_num_threads",
    "linear_attention",
    "linear_attention_backward",
    "linear_attention_state",
    "linear_attention_step",
    "set_num_threads",
]

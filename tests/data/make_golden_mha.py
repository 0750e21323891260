#!/usr/bin/env python3
"""Writes the golden data of the multi-head attention module tests.

    python3 tests/data/make_golden_mha.py        # from the repository root

Needs torch and safetensors (bench/requirements.txt). torch.nn.MultiheadAttention
runs in float64 from fixed seeds (batch_first=True), so the file is
reproducible. mha_golden.safetensors holds, for each case, the module's state
dict under "<case>.param.", its inputs under "<case>.input." and its outputs
under "<case>.output.":

  self   MultiheadAttention(16, 4): x [2, 6, 16] as query, key and value, a
         bool causal attn_mask [6, 6] (True = masked) and a bool
         key_padding_mask [2, 6] (the last two keys of sequence 1 padded);
         output.out [2, 6, 16] and output.weights [2, 6, 6] (head average).
         grad.dout [2, 6, 16] and autograd's gradients of sum(dout * out):
         grad.x (through query, key and value) and grad.<parameter name>.
  cross  MultiheadAttention(12, 3, kdim=5, vdim=7): query [2, 4, 12], key
         [2, 7, 5], value [2, 7, 7] and a float attn_mask [4, 7];
         output.out [2, 4, 12] and output.weights [2, 3, 4, 7] (per head).
Masks are stored as f64 0/1 (bool) or as their values (float).
"""
import os

import torch
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    torch.manual_seed(20240504)
    f64 = torch.float64
    tensors = {}

    m = torch.nn.MultiheadAttention(16, 4, batch_first=True, dtype=f64)
    x = torch.randn(2, 6, 16, dtype=f64, requires_grad=True)
    attn_mask = torch.ones(6, 6, dtype=torch.bool).triu(1)
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[1, 4:] = True
    out, weights = m(x, x, x, attn_mask=attn_mask, key_padding_mask=padding, need_weights=True)
    dout = torch.randn_like(out)
    params = dict(m.named_parameters())
    grads = torch.autograd.grad(out, [x, *params.values()], dout)
    for name, p in params.items():
        tensors[f"self.param.{name}"] = p.detach()
    tensors["self.input.x"] = x.detach()
    tensors["self.input.attn_mask"] = attn_mask.to(f64)
    tensors["self.input.key_padding_mask"] = padding.to(f64)
    tensors["self.output.out"] = out.detach()
    tensors["self.output.weights"] = weights.detach()
    tensors["self.grad.dout"] = dout
    tensors["self.grad.x"] = grads[0]
    for name, g in zip(params, grads[1:]):
        tensors[f"self.grad.{name}"] = g

    m = torch.nn.MultiheadAttention(12, 3, kdim=5, vdim=7, batch_first=True, dtype=f64)
    q = torch.randn(2, 4, 12, dtype=f64)
    k = torch.randn(2, 7, 5, dtype=f64)
    v = torch.randn(2, 7, 7, dtype=f64)
    float_mask = torch.randn(4, 7, dtype=f64)
    with torch.no_grad():
        out, weights = m(q, k, v, attn_mask=float_mask, need_weights=True,
                         average_attn_weights=False)
    for name, p in m.named_parameters():
        tensors[f"cross.param.{name}"] = p.detach()
    tensors["cross.input.query"] = q
    tensors["cross.input.key"] = k
    tensors["cross.input.value"] = v
    tensors["cross.input.attn_mask"] = float_mask
    tensors["cross.output.out"] = out
    tensors["cross.output.weights"] = weights

    tensors = {name: t.contiguous() for name, t in tensors.items()}
    save_file(tensors, os.path.join(HERE, "mha_golden.safetensors"),
              metadata={"generator": "tests/data/make_golden_mha.py",
                        "torch": torch.__version__})
    print(f"wrote mha_golden.safetensors ({len(tensors)} tensors)")


if __name__ == "__main__":
    main()

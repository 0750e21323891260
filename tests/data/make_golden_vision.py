#!/usr/bin/env python3
"""Writes the golden data of the vision and additive-attention module tests.

    python3 tests/data/make_golden_vision.py        # from the repository root

Needs torch, safetensors and timm (bench/requirements.txt). Everything runs in
float64 from fixed seeds, so the files are reproducible:

  se_golden.safetensors        timm.layers.SEModule(64): its state dict,
                               "input.x" [2, 64, 3, 5] (NCHW), "output.y"
  cbam_golden.safetensors      timm.layers.cbam.CbamModule(64) in eval() mode
                               (BatchNorm applies its running statistics, set
                               to non-trivial values here): its state dict
                               without the int64 "num_batches_tracked" buffer,
                               "input.x" [2, 64, 3, 5], "output.y"
  additive_golden.safetensors  the essay's Attention(8) decoder step with
                               source lengths: its state dict, "input.hidden"
                               [2, 8], "input.encoder_outputs" [2, 5, 8],
                               "input.lengths" [2] (f64, exact integers),
                               "output.context" [2, 8], "output.weights" [2, 5],
                               and autograd's gradients for "grad.d_context",
                               "grad.d_weights": "grad.hidden",
                               "grad.encoder_outputs", "grad.attn.weight",
                               "grad.attn.bias", "grad.v.weight"
"""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file
from timm.layers import SEModule
from timm.layers.cbam import CbamModule

HERE = os.path.dirname(os.path.abspath(__file__))


class Attention(nn.Module):
    """The reference essay's additive attention (a seq2seq decoder step), with
    its concatenation order (encoder output first, then the repeated decoder
    hidden state). The essay's module has no mask; the source lengths are
    applied as the usual masked_fill(-1e10) before the softmax, which in
    float64 gives padded positions a weight of exactly 0 whenever a row has a
    valid position (rows of length 0 are left to the C++ tests: PyTorch would
    spread them uniformly)."""

    def __init__(self, hidden_size):
        super().__init__()
        self.hidden_size = hidden_size
        self.attn = nn.Linear(self.hidden_size * 2, hidden_size)
        self.v = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, decoder_hidden, encoder_outputs, lengths):
        src_len = encoder_outputs.shape[1]
        decoder_hidden_repeated = decoder_hidden.unsqueeze(1).repeat(1, src_len, 1)
        concat = torch.cat((encoder_outputs, decoder_hidden_repeated), dim=2)
        energy = torch.tanh(self.attn(concat))
        attention_scores = self.v(energy).squeeze(2)
        mask = torch.arange(src_len).unsqueeze(0) < lengths.unsqueeze(1)
        attention_scores = attention_scores.masked_fill(mask == 0, -1e10)
        attn_weights = F.softmax(attention_scores, dim=1)
        context_vector = torch.bmm(attn_weights.unsqueeze(1), encoder_outputs).squeeze(1)
        return context_vector, attn_weights


def state(module):
    return {k: v.detach().clone().contiguous() for k, v in module.state_dict().items()
            if not k.endswith("num_batches_tracked")}


def save(name, tensors, what):
    path = os.path.join(HERE, name)
    # One metadata entry: safetensors writes several in no fixed order.
    save_file(tensors, path, metadata={"generator": f"tests/data/make_golden_vision.py: {what}"})
    print(f"{path}: {os.path.getsize(path)} bytes")


@torch.no_grad()
def vision():
    torch.manual_seed(2024)
    se = SEModule(64).double().eval()
    for p in se.parameters():
        nn.init.uniform_(p, -0.5, 0.5)
    x = torch.randn(2, 64, 3, 5, dtype=torch.float64)
    save("se_golden.safetensors", {**state(se), "input.x": x, "output.y": se(x)},
         "timm.layers.SEModule(64)")

    torch.manual_seed(2025)
    cbam = CbamModule(64).double().eval()
    for p in cbam.parameters():
        nn.init.uniform_(p, -0.5, 0.5)
    bn = cbam.spatial.conv.bn
    bn.weight.fill_(1.25)
    bn.bias.fill_(-0.125)
    bn.running_mean.fill_(0.1)
    bn.running_var.fill_(0.8)
    x = torch.randn(2, 64, 3, 5, dtype=torch.float64)
    save("cbam_golden.safetensors", {**state(cbam), "input.x": x, "output.y": cbam(x)},
         "timm.layers.cbam.CbamModule(64), eval()")


def additive():
    torch.manual_seed(7)
    att = Attention(8).double()
    hidden = torch.randn(2, 8, dtype=torch.float64, requires_grad=True)
    enc = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor([5, 3])
    context, weights = att(hidden, enc, lengths)
    d_context = torch.randn(2, 8, dtype=torch.float64)
    d_weights = torch.randn(2, 5, dtype=torch.float64)
    (context * d_context).sum().add((weights * d_weights).sum()).backward()
    tensors = {
        **state(att),
        "input.hidden": hidden.detach(),
        "input.encoder_outputs": enc.detach(),
        "input.lengths": lengths.double(),
        "output.context": context.detach(),
        "output.weights": weights.detach(),
        "grad.d_context": d_context,
        "grad.d_weights": d_weights,
        "grad.hidden": hidden.grad,
        "grad.encoder_outputs": enc.grad,
        "grad.attn.weight": att.attn.weight.grad,
        "grad.attn.bias": att.attn.bias.grad,
        "grad.v.weight": att.v.weight.grad,
    }
    save("additive_golden.safetensors", tensors, "essay Attention(8), lengths [5, 3]")


if __name__ == "__main__":
    vision()
    additive()

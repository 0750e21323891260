"""Translation decoder: dates in many surface forms -> YYYY-MM-DD (dates.py),
learned twice, every attention on qkv:

* Bahdanau: a GRU encoder and a GRU decoder that attends with additive
  attention (qkv.nn.AdditiveAttention, the module of the seq2seq tutorials:
  energy = tanh(W [h_s; s_t-1]), score = v . energy), one target character
  at a time;
* Transformer: a 2-layer encoder and a 2-layer decoder (pre-LN, 4 heads of
  32) whose self- and cross-attention are qkv.nn.MultiheadAttention in
  training and qkv.torch.scaled_dot_product_attention when decoding one
  character at a time against cached keys and values.

It reports held-out exact-match accuracy (dates never seen in training, in
any form), draws the cross-attention of a few held-out examples (PNG: one
row per generated character, one column per source character), and times
the decoder's steps against the essay's claim that cross-attention with one
target word (M = 1) against N = 60 source states is 15x faster than the
encoder's self-attention over the 60: the attention calls alone, the whole
layers, and the incremental decoder step against recomputing the prefix.

    python examples/applications/translation.py [--quick] [--out DIR]

Deterministic for a seed on a given machine and thread count.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import random
import statistics
import sys
import time
from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import dates  # noqa: E402
import qkv.nn as qnn  # noqa: E402
import qkv.torch as qtorch  # noqa: E402

D_MODEL, HEADS, LAYERS, HIDDEN = 128, 4, 2, 128


# ---------------------------------------------------------------- data

def batch(pairs: List[Tuple[str, str]], src: dates.Vocab, tgt: dates.Vocab):
    """Padded tensors of (source text, ISO text) pairs: src [B, S], lengths
    [B], target input (BOS + chars) and output (chars + EOS) [B, T + 1]."""
    lengths = torch.tensor([len(s) for s, _ in pairs])
    x = torch.zeros(len(pairs), int(lengths.max()), dtype=torch.long)
    for i, (s, _) in enumerate(pairs):
        x[i, :len(s)] = torch.tensor(src.encode(s))
    y = torch.tensor([tgt.encode(t) for _, t in pairs])
    bos = torch.full((len(pairs), 1), dates.BOS)
    eos = torch.full((len(pairs), 1), dates.EOS)
    return x, lengths, torch.cat([bos, y], 1), torch.cat([y, eos], 1)


def sample(days: List, n: int, rng: random.Random) -> List[Tuple[str, str]]:
    picked = [rng.choice(days) for _ in range(n)]
    return [(dates.write(d, rng), dates.iso(d)) for d in picked]


# ---------------------------------------------------------------- models

class Bahdanau(nn.Module):
    """GRU encoder, GRU decoder with additive attention over its states."""

    def __init__(self, src_vocab: int, tgt_vocab: int, hidden: int = HIDDEN):
        super().__init__()
        self.src_embed = nn.Embedding(src_vocab, 64, padding_idx=dates.PAD)
        self.encoder = nn.GRU(64, hidden, batch_first=True)
        self.tgt_embed = nn.Embedding(tgt_vocab, 32)
        self.attention = qnn.AdditiveAttention(hidden)
        self.cell = nn.GRUCell(32 + hidden, hidden)
        self.out = nn.Linear(2 * hidden, tgt_vocab)

    def encode(self, x, lengths):
        states, _ = self.encoder(self.src_embed(x))  # [B, S, H]; padding after the text
        first = states[torch.arange(len(x)), lengths - 1]  # the last real state
        return states, first

    def step(self, y_prev, hidden, states, lengths):
        """One target character: (logits [B, V], new hidden, weights [B, S])."""
        context, weights = self.attention(hidden, states, lengths)
        hidden = self.cell(torch.cat([self.tgt_embed(y_prev), context], -1), hidden)
        return self.out(torch.cat([hidden, context], -1)), hidden, weights

    def forward(self, x, lengths, y_in):
        states, hidden = self.encode(x, lengths)
        logits = []
        for t in range(y_in.shape[1]):
            step_logits, hidden, _ = self.step(y_in[:, t], hidden, states, lengths)
            logits.append(step_logits)
        return torch.stack(logits, 1)

    @torch.no_grad()
    def generate(self, x, lengths, steps: int):
        """Greedy characters [B, steps] and the attention weights [B, steps, S]."""
        states, hidden = self.encode(x, lengths)
        y = torch.full((len(x),), dates.BOS)
        out, maps = [], []
        for _ in range(steps):
            logits, hidden, weights = self.step(y, hidden, states, lengths)
            y = logits.argmax(-1)
            out.append(y)
            maps.append(weights)
        return torch.stack(out, 1), torch.stack(maps, 1)


class GroupedAttention(nn.Module):
    """Multi-head attention whose kv_heads key and value heads each serve a
    group of the query heads (kv_heads = 1: one key and one value projection
    shared by every head, the sharing of essay 002 §3.2), on
    qkv.torch.scaled_dot_product_attention; called as nn.MultiheadAttention
    with batch_first=True (bool masks True = masked out)."""

    def __init__(self, embed_dim: int, num_heads: int, kv_heads: int):
        super().__init__()
        if num_heads % kv_heads:
            raise ValueError(f"kv_heads must divide num_heads ({num_heads}), got {kv_heads}")
        self.embed_dim, self.num_heads, self.kv_heads = embed_dim, num_heads, kv_heads
        kv_dim = kv_heads * (embed_dim // num_heads)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, kv_dim)
        self.v_proj = nn.Linear(embed_dim, kv_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def project(self, x, part: int):
        """The query (0), key (1) or value (2) projection of x, split in heads."""
        if part == 0:
            return heads(self.q_proj(x), self.num_heads)
        return heads((self.k_proj, self.v_proj)[part - 1](x), self.kv_heads)

    def forward(self, query, key, value, key_padding_mask=None, attn_mask=None,
                is_causal=False, need_weights=False):
        keep = None  # [B, 1, Lq | 1, Lk]: True = attend
        if key_padding_mask is not None:
            keep = ~key_padding_mask[:, None, None, :]
        if attn_mask is not None:
            keep = ~attn_mask if keep is None else keep & ~attn_mask
        o = qtorch.scaled_dot_product_attention(self.project(query, 0), self.project(key, 1),
                                                self.project(value, 2), attn_mask=keep,
                                                enable_gqa=True)
        return self.out_proj(merge(o)), None


def attention_module(kv_heads: int) -> nn.Module:
    if kv_heads == HEADS:
        return qnn.MultiheadAttention(D_MODEL, HEADS, batch_first=True)
    return GroupedAttention(D_MODEL, HEADS, kv_heads)


class Block(nn.Module):
    """Pre-LN transformer layer: self-attention, cross-attention (decoder
    only), feed-forward; kv_heads < HEADS shares key/value heads."""

    def __init__(self, cross: bool, kv_heads: int = HEADS):
        super().__init__()
        self.norm1 = nn.LayerNorm(D_MODEL)
        self.self_attn = attention_module(kv_heads)
        self.cross = cross
        if cross:
            self.norm2 = nn.LayerNorm(D_MODEL)
            self.cross_attn = attention_module(kv_heads)
        self.norm3 = nn.LayerNorm(D_MODEL)
        self.ff = nn.Sequential(nn.Linear(D_MODEL, 4 * D_MODEL), nn.GELU(),
                                nn.Linear(4 * D_MODEL, D_MODEL))

    def forward(self, x, pad=None, memory=None, memory_pad=None, causal=False):
        h = self.norm1(x)
        mask = None
        if causal:
            n = x.shape[1]
            mask = torch.ones(n, n, dtype=torch.bool).triu(1)
        x = x + self.self_attn(h, h, h, key_padding_mask=pad, attn_mask=mask, is_causal=causal,
                               need_weights=False)[0]
        if self.cross:
            h = self.norm2(x)
            x = x + self.cross_attn(h, memory, memory, key_padding_mask=memory_pad,
                                    need_weights=False)[0]
        return x + self.ff(self.norm3(x))


def heads(x, h: int = HEADS):  # [B, L, E] -> [B, H, L, E / H]
    b, n, e = x.shape
    return x.view(b, n, h, e // h).transpose(1, 2)


def merge(x):  # [B, H, L, E / H] -> [B, L, E]
    b, h, n, d = x.shape
    return x.transpose(1, 2).reshape(b, n, h * d)


def project(mha, x, part: int):
    """The query (0), key (1) or value (2) projection of mha, split in heads."""
    if isinstance(mha, GroupedAttention):
        return mha.project(x, part)
    e = mha.embed_dim
    w = mha.in_proj_weight[part * e:(part + 1) * e]
    b = mha.in_proj_bias[part * e:(part + 1) * e]
    return heads(F.linear(x, w, b), mha.num_heads)


class Transformer(nn.Module):
    def __init__(self, src_vocab: int, tgt_vocab: int, max_len: int = 64,
                 kv_heads: int = HEADS):
        super().__init__()
        self.src_embed = nn.Embedding(src_vocab, D_MODEL, padding_idx=dates.PAD)
        self.tgt_embed = nn.Embedding(tgt_vocab, D_MODEL)
        self.src_pos = nn.Parameter(torch.randn(max_len, D_MODEL) * 0.02)
        self.tgt_pos = nn.Parameter(torch.randn(max_len, D_MODEL) * 0.02)
        self.encoder = nn.ModuleList(Block(False, kv_heads) for _ in range(LAYERS))
        self.decoder = nn.ModuleList(Block(True, kv_heads) for _ in range(LAYERS))
        self.enc_norm = nn.LayerNorm(D_MODEL)
        self.dec_norm = nn.LayerNorm(D_MODEL)
        self.out = nn.Linear(D_MODEL, tgt_vocab)

    def encode(self, x, pad):
        h = self.src_embed(x) + self.src_pos[:x.shape[1]]
        for block in self.encoder:
            h = block(h, pad=pad)
        return self.enc_norm(h)

    def decode(self, y_in, memory, memory_pad):
        h = self.tgt_embed(y_in) + self.tgt_pos[:y_in.shape[1]]
        for block in self.decoder:
            h = block(h, memory=memory, memory_pad=memory_pad, causal=True)
        return self.out(self.dec_norm(h))

    def forward(self, x, lengths, y_in):
        pad = torch.arange(x.shape[1])[None] >= lengths[:, None]
        return self.decode(y_in, self.encode(x, pad), pad)

    # Incremental decoding: per layer, the self-attention's keys and values
    # so far and the cross-attention's keys and values of the memory,
    # projected once.
    def start(self, memory):
        return [{"k": None, "v": None,
                 "mk": project(block.cross_attn, memory, 1),
                 "mv": project(block.cross_attn, memory, 2)} for block in self.decoder]

    def step(self, y_t, t: int, cache, memory_mask=None, want_weights=False):
        """Logits [B, V] of the next character after y_t [B] at position t;
        with want_weights also the last layer's cross-attention weights
        [B, S] (mean over heads)."""
        h = (self.tgt_embed(y_t) + self.tgt_pos[t])[:, None]  # [B, 1, E]
        weights = None
        for block, c in zip(self.decoder, cache):
            a = block.norm1(h)
            k, v = project(block.self_attn, a, 1), project(block.self_attn, a, 2)
            c["k"] = k if c["k"] is None else torch.cat([c["k"], k], 2)
            c["v"] = v if c["v"] is None else torch.cat([c["v"], v], 2)
            q = project(block.self_attn, a, 0)
            o = qtorch.scaled_dot_product_attention(q, c["k"], c["v"],  # all keys so far
                                                    enable_gqa=True)
            h = h + block.self_attn.out_proj(merge(o))
            a = block.norm2(h)
            q = project(block.cross_attn, a, 0)
            o = qtorch.scaled_dot_product_attention(q, c["mk"], c["mv"], attn_mask=memory_mask,
                                                    enable_gqa=True)
            h = h + block.cross_attn.out_proj(merge(o))
            h = h + block.ff(block.norm3(h))
            if want_weights and block is self.decoder[-1]:
                s = q @ c["mk"].transpose(-1, -2) / math.sqrt(D_MODEL // HEADS)
                if memory_mask is not None:
                    s = s.masked_fill(~memory_mask, float("-inf"))
                weights = s.softmax(-1).mean(1)[:, 0]
        return self.out(self.dec_norm(h))[:, 0], weights

    @torch.no_grad()
    def generate(self, x, lengths, steps: int):
        pad = torch.arange(x.shape[1])[None] >= lengths[:, None]
        memory = self.encode(x, pad)
        cache = self.start(memory)
        keep = (~pad)[:, None, None, :]  # [B, 1, 1, S]: True = attend
        y = torch.full((len(x),), dates.BOS)
        out, maps = [], []
        for t in range(steps):
            logits, weights = self.step(y, t, cache, keep, want_weights=True)
            y = logits.argmax(-1)
            out.append(y)
            maps.append(weights)
        return torch.stack(out, 1), torch.stack(maps, 1)

    @torch.no_grad()
    def generate_by_recomputing(self, x, lengths, steps: int):
        """Greedy decoding that runs the whole decoder on the prefix each step."""
        pad = torch.arange(x.shape[1])[None] >= lengths[:, None]
        memory = self.encode(x, pad)
        y = torch.full((len(x), 1), dates.BOS)
        for _ in range(steps):
            y = torch.cat([y, self.decode(y, memory, pad)[:, -1].argmax(-1, keepdim=True)], 1)
        return y[:, 1:]


# ---------------------------------------------------------------- training

def train(model, name: str, train_days, steps: int, batch_size: int, seed: int,
          src, tgt, log) -> Dict[str, float]:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps,
                                                pct_start=0.1)
    start = time.perf_counter()
    first = last = None
    for step in range(1, steps + 1):
        x, lengths, y_in, y_out = batch(sample(train_days, batch_size, rng), src, tgt)
        logits = model(x, lengths, y_in)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y_out.reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        first = loss.item() if first is None else first
        last = loss.item()
        if step % max(1, steps // 10) == 0 or step == steps:
            log(f"  {name}: step {step}/{steps}, loss {last:.4f}, "
                f"{time.perf_counter() - start:.0f} s")
    return {"first_loss": first, "last_loss": last, "train_s": time.perf_counter() - start}


@torch.no_grad()
def evaluate(model, test_days, n: int, seed: int, src, tgt):
    """Exact-match accuracy over n held-out (text, ISO) pairs, and the pairs
    with the model's answers and attention maps."""
    rng = random.Random(seed + 1)
    pairs = sample(test_days, n, rng)
    model.eval()
    right, results = 0, []
    for i in range(0, n, 256):
        chunk = pairs[i:i + 256]
        x, lengths, _, _ = batch(chunk, src, tgt)
        ids, maps = model.generate(x, lengths, dates.TARGET_LENGTH + 1)
        for j, (text, want) in enumerate(chunk):
            got = tgt.decode(ids[j].tolist())
            right += got == want
            results.append((text, want, got, maps[j, :, :len(text)]))
    model.train()
    return right / n, results


# ---------------------------------------------------------------- pictures

def draw_alignment(results, name: str, path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.4))
    for ax, (text, want, got, weights) in zip(axes, results):
        rows = list(got[:dates.TARGET_LENGTH]) + ["</s>"]
        ax.imshow(weights[:len(rows)].numpy(), cmap="viridis", vmin=0, aspect="auto")
        ax.set_xticks(range(len(text)), list(text), fontsize=7, family="monospace")
        ax.set_yticks(range(len(rows)), rows, fontsize=7, family="monospace")
        ax.set_title(f"{text!r} -> {got}" + ("" if got == want else f" (want {want})"),
                     fontsize=8)
    fig.suptitle(f"{name}: attention of each generated character over the source", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- timing

def median_time(fn, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.no_grad()
def decode_costs(model: Transformer, repeats: int, n_source: int = 60) -> Dict[str, float]:
    """Seconds per call, B = 1, the model's widths (4 heads of 32):
    attention alone, whole layers, and decoder steps."""
    torch.manual_seed(0)
    x = torch.randn(1, n_source, D_MODEL)
    q1, k, v = heads(torch.randn(1, 1, D_MODEL)), heads(x), heads(x)
    enc, dec = model.encoder[0], model.decoder[0]
    costs = {
        # the attention call: N x N scores against 1 x N
        "attn_self_60": median_time(lambda: qtorch.scaled_dot_product_attention(k, k, v),
                                    repeats),
        "attn_cross_1": median_time(lambda: qtorch.scaled_dot_product_attention(q1, k, v),
                                    repeats),
        # the same calls on torch's own kernel, for the fixed cost of a call
        "torch_self_60": median_time(lambda: F.scaled_dot_product_attention(k, k, v), repeats),
        "torch_cross_1": median_time(lambda: F.scaled_dot_product_attention(q1, k, v), repeats),
        # whole layers: projections, attention, output projection
        "layer_self_60": median_time(
            lambda: enc.self_attn(x, x, x, need_weights=False), repeats),
        "layer_cross_1": median_time(
            lambda: dec.cross_attn.out_proj(merge(qtorch.scaled_dot_product_attention(
                project(dec.cross_attn, x[:, :1], 0), k, v))), repeats),
    }
    # The same two layers at a larger width (random weights): E = 1024, 16
    # heads of 64.
    wide = qnn.MultiheadAttention(1024, 16, batch_first=True)
    xw = torch.randn(1, n_source, 1024)
    kw, vw = project(wide, xw, 1), project(wide, xw, 2)
    costs["wide_self_60"] = median_time(lambda: wide(xw, xw, xw, need_weights=False), repeats)
    costs["wide_cross_1"] = median_time(
        lambda: wide.out_proj(merge(qtorch.scaled_dot_product_attention(
            project(wide, xw[:, :1], 0), kw, vw))), repeats)
    # One more character after a prefix of t: the incremental step (cached
    # keys and values) against the whole decoder on the prefix.
    memory = torch.randn(1, n_source, D_MODEL)
    pad = torch.zeros(1, n_source, dtype=torch.bool)
    for t in (dates.TARGET_LENGTH, 60):
        prefix = torch.randint(3, 10, (1, t))
        cache = model.start(memory)
        for i in range(t - 1):
            model.step(prefix[:, i], i, cache)
        saved = [(c["k"], c["v"]) for c in cache]

        def incremental():
            for c, (ck, cv) in zip(cache, saved):
                c["k"], c["v"] = ck, cv
            model.step(prefix[:, t - 1], t - 1, cache)

        costs[f"step_incremental_{t}"] = median_time(incremental, repeats)
        costs[f"step_recompute_{t}"] = median_time(lambda: model.decode(prefix, memory, pad),
                                                   repeats)
    return costs


# ---------------------------------------------------------------- main

def settings(quick: bool) -> Dict[str, int]:
    """Training steps, batch size and held-out dates of the two settings."""
    return {"steps": 300 if quick else 2000, "batch": 32 if quick else 64,
            "test": 256 if quick else 2000}


def fit(name: str, make, quick: bool, seed: int, log=print):
    """Trains make() (seeded) in the setting; returns the model, its results
    (losses, time, held-out accuracy, parameters) and the evaluated examples."""
    src, tgt = dates.source_vocab(), dates.target_vocab()
    train_days, test_days = dates.split_dates(seed)
    s = settings(quick)
    torch.manual_seed(seed)
    model = make()
    parameters = sum(p.numel() for p in model.parameters())
    log(f"{name}: {parameters:,} parameters")
    r = train(model, name, train_days, s["steps"], s["batch"], seed, src, tgt, log)
    r["accuracy"], examples = evaluate(model, test_days, s["test"], seed, src, tgt)
    r["parameters"] = parameters
    log(f"{name}: held-out exact match {r['accuracy']:.1%} ({s['test']} dates never seen)")
    return model, r, examples


def run(quick: bool, out: pathlib.Path, seed: int = 0, log=print) -> Dict:
    """Trains and measures both models; writes PNGs into out; returns the results."""
    out.mkdir(parents=True, exist_ok=True)
    src, tgt = dates.source_vocab(), dates.target_vocab()
    test_days = dates.split_dates(seed)[1]
    results: Dict = {"quick": quick, **settings(quick), "models": {}}
    for name, make in (("Bahdanau", lambda: Bahdanau(len(src), len(tgt))),
                       ("Transformer", lambda: Transformer(len(src), len(tgt)))):
        model, r, examples = fit(name, make, quick, seed, log)
        picture = out / f"translation_{name.lower()}.png"
        draw_alignment(examples[:3], name, picture)
        r["picture"] = picture.name
        r["examples"] = [(t, w, g) for t, w, g, _ in examples[:3]]
        if isinstance(model, Transformer):
            x, lengths, _, _ = batch(sample(test_days, 64, random.Random(seed + 2)), src, tgt)
            same = torch.equal(model.generate(x, lengths, dates.TARGET_LENGTH + 1)[0],
                               model.generate_by_recomputing(x, lengths,
                                                             dates.TARGET_LENGTH + 1))
            r["incremental_equals_recompute"] = same
            log(f"{name}: incremental decoding gives the recomputed tokens: {same}")
            r["costs"] = decode_costs(model, repeats=50 if quick else 300)
        results["models"][name] = r
    return results


def report(results: Dict) -> List[str]:
    """Markdown lines of the results."""
    lines = ["| model | parameters | steps x batch | training | held-out exact match |",
             "| --- | --- | --- | --- | --- |"]
    for name, r in results["models"].items():
        lines.append(f"| {name} | {r['parameters']:,} | {results['steps']} x {results['batch']}"
                     f" | {r['train_s']:.0f} s | {r['accuracy']:.1%} of {results['test']} |")
    costs = results["models"]["Transformer"]["costs"]
    us = lambda key: costs[key] * 1e6  # noqa: E731
    lines += [
        "",
        "| per decoder step (B = 1, 4 heads of 32) | microseconds | ratio |",
        "| --- | --- | --- |",
        f"| encoder self-attention call, N = 60 | {us('attn_self_60'):.1f} | |",
        f"| cross-attention call, M = 1 against N = 60 | {us('attn_cross_1'):.1f} | "
        f"{costs['attn_self_60'] / costs['attn_cross_1']:.1f}x |",
        f"| the same two calls on torch's SDPA | {us('torch_self_60'):.1f} / "
        f"{us('torch_cross_1'):.1f} | {costs['torch_self_60'] / costs['torch_cross_1']:.1f}x |",
        f"| encoder self-attention layer, N = 60 (projections included) | "
        f"{us('layer_self_60'):.1f} | |",
        f"| cross-attention layer, M = 1, keys and values cached | {us('layer_cross_1'):.1f} | "
        f"{costs['layer_self_60'] / costs['layer_cross_1']:.1f}x |",
        f"| the same two layers at E = 1024, 16 heads of 64 (random weights) | "
        f"{us('wide_self_60'):.1f} / {us('wide_cross_1'):.1f} | "
        f"{costs['wide_self_60'] / costs['wide_cross_1']:.1f}x |",
    ]
    for t in (dates.TARGET_LENGTH, 60):
        lines.append(
            f"| decoder step after {t} characters: incremental / whole prefix | "
            f"{us(f'step_incremental_{t}'):.0f} / {us(f'step_recompute_{t}'):.0f} | "
            f"{costs[f'step_recompute_{t}'] / costs[f'step_incremental_{t}']:.1f}x |")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small setting (tests)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("."),
                        help="folder for the PNG pictures")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    results = run(args.quick, args.out, args.seed)
    print("\n".join(report(results)))


if __name__ == "__main__":
    main()

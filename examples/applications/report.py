"""Image-to-report: a patch encoder with self-attention and a text decoder
whose cross-attention finds, word by word, what it describes; every
attention on qkv (qkv.nn.MultiheadAttention).

The images are generated: a 48 x 48 canvas with one or two shapes (circle,
square, triangle), each with a colour (red, green, blue, yellow) and a size
(small, large) in a cell of a 3 x 3 grid; the report names them in reading
order, e.g. "large red circle upper-left , small blue square centre". The
encoder cuts the image into 36 patches of 8 x 8; the decoder writes the
report one word at a time.

It reports held-out exact-match accuracy (images are random; the held-out
ones use a seed never used in training), and grounding: for each generated
shape word (circle, square, triangle), how often the peak of the last
decoder layer's cross-attention (mean over heads) falls on a patch of the
shape it names; and it draws each word's attention over the image (PNG).

    python examples/applications/report.py [--quick] [--out DIR]

Deterministic for a seed on a given machine and thread count.
"""

from __future__ import annotations

import argparse
import pathlib
import random
import sys
import time
from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import translation  # noqa: E402  (the transformer layer, on qkv)

SIZE, PATCH, CELL = 48, 8, 16
SHAPES = ["circle", "square", "triangle"]
COLOURS = {"red": (0.9, 0.1, 0.1), "green": (0.1, 0.8, 0.2), "blue": (0.15, 0.3, 0.95),
           "yellow": (0.95, 0.85, 0.1)}
SIZES = {"small": 3.5, "large": 6.5}
PLACES = ["upper-left", "upper-centre", "upper-right", "centre-left", "centre",
          "centre-right", "lower-left", "lower-centre", "lower-right"]
WORDS = ["<pad>", "<s>", "</s>", ","] + list(SIZES) + list(COLOURS) + SHAPES + PLACES
INDEX = {w: i for i, w in enumerate(WORDS)}
PAD, BOS, EOS = 0, 1, 2
MAX_WORDS = 2 * 5  # two shapes of 4 words and a comma, and </s>
PATCHES = (SIZE // PATCH) ** 2


# ---------------------------------------------------------------- data

def draw(shapes: List[Tuple[str, str, str, int]], noise: torch.Tensor) -> Tuple[torch.Tensor,
                                                                               List[torch.Tensor]]:
    """The image [3, SIZE, SIZE] of (size, colour, shape, cell) tuples and
    each shape's pixel mask [SIZE, SIZE]."""
    y, x = torch.meshgrid(torch.arange(SIZE) + 0.5, torch.arange(SIZE) + 0.5, indexing="ij")
    image = 0.1 * noise
    masks = []
    for size, colour, shape, cell in shapes:
        cy, cx = (cell // 3 + 0.5) * CELL, (cell % 3 + 0.5) * CELL
        r = SIZES[size]
        if shape == "circle":
            mask = (x - cx) ** 2 + (y - cy) ** 2 <= r * r
        elif shape == "square":
            mask = ((x - cx).abs() <= r * 0.85) & ((y - cy).abs() <= r * 0.85)
        else:  # a triangle pointing up
            mask = (y >= cy - r) & (y <= cy + r) & ((x - cx).abs() <= (y - (cy - r)) / 2)
        image = torch.where(mask, torch.tensor(COLOURS[colour])[:, None, None], image)
        masks.append(mask)
    return image, masks


def example(rng: random.Random, g: torch.Generator):
    """(image, report words, shape masks) of a random scene."""
    cells = sorted(rng.sample(range(9), rng.choice([1, 2])))
    shapes = [(rng.choice(list(SIZES)), rng.choice(list(COLOURS)), rng.choice(SHAPES), c)
              for c in cells]
    image, masks = draw(shapes, torch.rand(3, SIZE, SIZE, generator=g))
    words: List[str] = []
    for i, (size, colour, shape, cell) in enumerate(shapes):
        words += ([","] if i else []) + [size, colour, shape, PLACES[cell]]
    return image, words, masks


def batch(n: int, rng: random.Random, g: torch.Generator):
    images, reports, masks = zip(*(example(rng, g) for _ in range(n)))
    y = torch.full((n, MAX_WORDS), PAD)
    for i, words in enumerate(reports):
        ids = [INDEX[w] for w in words] + [EOS]
        y[i, :len(ids)] = torch.tensor(ids)
    y_in = torch.cat([torch.full((n, 1), BOS), y[:, :-1]], 1)
    return torch.stack(images), y_in, y, list(reports), list(masks)


def patches(images: torch.Tensor) -> torch.Tensor:
    """[B, 3, SIZE, SIZE] -> [B, PATCHES, 3 * PATCH * PATCH], rows of patches."""
    b = images.shape[0]
    p = images.unfold(2, PATCH, PATCH).unfold(3, PATCH, PATCH)  # [B, 3, 6, 6, 8, 8]
    return p.permute(0, 2, 3, 1, 4, 5).reshape(b, PATCHES, -1)


def patch_of_mask(mask: torch.Tensor) -> torch.Tensor:
    """Which patches a pixel mask touches: [PATCHES] bool."""
    return mask.unfold(0, PATCH, PATCH).unfold(1, PATCH, PATCH).reshape(PATCHES, -1).any(1)


# ---------------------------------------------------------------- model

D = translation.D_MODEL


class Reporter(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch = nn.Linear(3 * PATCH * PATCH, D)
        self.patch_pos = nn.Parameter(torch.randn(PATCHES, D) * 0.02)
        self.word = nn.Embedding(len(WORDS), D)
        self.word_pos = nn.Parameter(torch.randn(MAX_WORDS, D) * 0.02)
        self.encoder = nn.ModuleList(translation.Block(False) for _ in range(2))
        self.decoder = nn.ModuleList(translation.Block(True) for _ in range(2))
        self.enc_norm = nn.LayerNorm(D)
        self.dec_norm = nn.LayerNorm(D)
        self.out = nn.Linear(D, len(WORDS))

    def encode(self, images):
        h = self.patch(patches(images)) + self.patch_pos
        for block in self.encoder:
            h = block(h)
        return self.enc_norm(h)

    def decode(self, y_in, memory):
        h = self.word(y_in) + self.word_pos[:y_in.shape[1]]
        for block in self.decoder:
            h = block(h, memory=memory, causal=True)
        return self.out(self.dec_norm(h))

    def forward(self, images, y_in):
        return self.decode(y_in, self.encode(images))

    @torch.no_grad()
    def generate(self, images):
        """Greedy words [B, MAX_WORDS] and the last layer's cross-attention
        of each step over the patches [B, MAX_WORDS, PATCHES]."""
        memory = self.encode(images)
        y = torch.full((len(images), 1), BOS)
        for _ in range(MAX_WORDS):
            y = torch.cat([y, self.decode(y, memory)[:, -1].argmax(-1, keepdim=True)], 1)
        # The weights of the last decoder layer's cross-attention, one more
        # pass over the generated words.
        h = self.word(y[:, :-1]) + self.word_pos[:MAX_WORDS]
        for block in self.decoder[:-1]:
            h = block(h, memory=memory, causal=True)
        last = self.decoder[-1]
        a = last.norm1(h)
        n = a.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool).triu(1)
        h = h + last.self_attn(a, a, a, attn_mask=causal, is_causal=True, need_weights=False)[0]
        _, weights = last.cross_attn(last.norm2(h), memory, memory, need_weights=True)
        return y[:, 1:], weights


# ---------------------------------------------------------------- run

def words_of(ids: List[int]) -> List[str]:
    out = []
    for i in ids:
        if i == EOS:
            break
        out.append(WORDS[i])
    return out


def draw_overlays(images, reports, weights, path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    side = SIZE // PATCH
    rows = len(images)
    cols = 1 + max(len(r) for r in reports)
    fig, axes = plt.subplots(rows, cols, figsize=(1.5 * cols, 1.6 * rows))
    for i, (image, words) in enumerate(zip(images, reports)):
        axes[i, 0].imshow(image.permute(1, 2, 0).clamp(0, 1).numpy())
        axes[i, 0].set_title("image", fontsize=7)
        for j in range(cols - 1):
            ax = axes[i, j + 1]
            ax.axis("off")
            if j >= len(words):
                continue
            heat = weights[i, j].reshape(1, 1, side, side)
            heat = F.interpolate(heat, size=(SIZE, SIZE), mode="nearest")[0, 0]
            ax.imshow(image.permute(1, 2, 0).clamp(0, 1).numpy())
            ax.imshow(heat.numpy(), cmap="magma", alpha=0.6)
            ax.set_title(words[j], fontsize=7)
        axes[i, 0].axis("off")
    fig.suptitle("each generated word's cross-attention over the image's patches", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(quick: bool, out: pathlib.Path, seed: int = 0, log=print) -> Dict:
    out.mkdir(parents=True, exist_ok=True)
    steps, batch_size, n_test = (300, 32, 256) if quick else (2500, 64, 1000)
    torch.manual_seed(seed)
    model = Reporter()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=steps,
                                                pct_start=0.1)
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        images, y_in, y, _, _ = batch(batch_size, rng, g)
        logits = model(images, y_in)
        loss = F.cross_entropy(logits.reshape(-1, len(WORDS)), y.reshape(-1), ignore_index=PAD)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % max(1, steps // 10) == 0 or step == steps:
            log(f"  report: step {step}/{steps}, loss {loss.item():.4f}, "
                f"{time.perf_counter() - start:.0f} s")
    seconds = time.perf_counter() - start
    # Held out: scenes from another seed.
    model.eval()
    rng, g = random.Random(seed + 1000), torch.Generator().manual_seed(seed + 1000)
    right = grounded = shape_words = 0
    shown = None
    for i in range(0, n_test, 250):
        images, _, _, reports, masks = batch(min(250, n_test - i), rng, g)
        ids, weights = model.generate(images)
        for b, (want, shape_masks) in enumerate(zip(reports, masks)):
            got = words_of(ids[b].tolist())
            right += got == want
            # The k-th shape word names the k-th shape (reading order).
            k = 0
            for j, w in enumerate(got):
                if w in SHAPES and k < len(shape_masks):
                    peak = int(weights[b, j].argmax())
                    grounded += bool(patch_of_mask(shape_masks[k])[peak])
                    shape_words += 1
                    k += 1
        if shown is None:
            shown = (images[:4], [words_of(ids[b].tolist()) for b in range(4)], weights[:4])
    picture = out / "report_attention.png"
    draw_overlays(*shown, picture)
    result = {"quick": quick, "steps": steps, "batch": batch_size, "test": n_test,
              "train_s": seconds, "accuracy": right / n_test,
              "grounding": grounded / max(1, shape_words), "shape_words": shape_words,
              "parameters": sum(p.numel() for p in model.parameters()),
              "picture": picture.name}
    log(f"report: exact match {result['accuracy']:.1%}, grounding {result['grounding']:.1%}")
    return result


def report(r: Dict) -> List[str]:
    return ["| parameters | steps x batch | training | held-out exact match | "
            "shape words whose attention peak is on their shape |",
            "| --- | --- | --- | --- | --- |",
            f"| {r['parameters']:,} | {r['steps']} x {r['batch']} | {r['train_s']:.0f} s | "
            f"{r['accuracy']:.1%} of {r['test']} | {r['grounding']:.1%} of {r['shape_words']} |"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small setting (tests)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("."),
                        help="folder for the PNG picture")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print("\n".join(report(run(args.quick, args.out, args.seed))))


if __name__ == "__main__":
    main()

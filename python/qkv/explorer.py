"""qkv.explorer: an interactive attention explorer in one self-contained
HTML file (scripts and data inlined: it opens offline, from disk).

    import qkv.explain, qkv.explorer

    model, tokenizer = qkv.explain.load_model()
    tokens, maps = qkv.explain.attention_maps(model, tokenizer, "A man plays a guitar.")
    qkv.explorer.write_html("out.html", [qkv.explorer.page(tokens, maps)])

or `python -m qkv.explain --html out.html "sentence a" "sentence b"`.

A page holds one text's attention: maps [L, H, N, N] (maps[l, h, i, j], the
weight with which position i reads position j), optionally its rollout
[N, N] and per-token attributions (integrated gradients) [N]. The file
shows, per page:

* a head view: the tokens twice, queries on the left and keys on the right,
  a line from each query to its top_k keys of the chosen layer and head,
  as opaque as its weight; hovering a token keeps its lines only;
* a model view: every layer x head as a thumbnail (the map pooled to at
  most `thumbnail` x `thumbnail` cells); clicking one selects it;
* rollout and integrated gradients side by side, one bar per token (rollout:
  the mean over query rows; attributions signed), the attention caveat
  beside them: attention weights show where information is mixed, not why
  the output is what it is.

Decoders: decoder_page() generates tokens greedily and marks them; their
rows are causal like the prompt's. Everything draws on canvases with only
the top_k edges per row, so 512 tokens open in well under two seconds.
"""

from __future__ import annotations

import base64
import html
import json
import os
from typing import List, Optional, Sequence

import torch

from .attribution import integrated_gradients_fn, rollout

__all__ = ["page", "decoder_page", "write_html"]


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.contiguous().numpy().tobytes()).decode("ascii")


def _checked_maps(maps, n: int) -> torch.Tensor:
    maps = torch.as_tensor(maps)
    if maps.dim() != 4 or maps.shape[2] != n or maps.shape[3] != n:
        raise ValueError(f"maps must be [L, H, N, N] with N = {n} tokens, got "
                         f"{tuple(maps.shape)}")
    if maps.shape[0] < 1 or maps.shape[1] < 1:
        raise ValueError(f"maps must have at least one layer and head, got {tuple(maps.shape)}")
    return maps.float()


def _top_edges(m: torch.Tensor, k: int):
    """Each row's k largest weights of m [..., N, N]: key indices (int16)
    and weights quantized to 0..255 of the row's largest (uint8)."""
    values, index = m.topk(min(k, m.shape[-1]), dim=-1)
    peak = values[..., :1].clamp_min(1e-30)
    return index.to(torch.int16), (values / peak * 255).round().clamp(0, 255).to(torch.uint8)


def _pooled(maps: torch.Tensor, cells: int) -> torch.Tensor:
    """[L, H, c, c] uint8 thumbnails, c = min(N, cells), each cell the mean
    weight of its block, scaled to the thumbnail's largest."""
    n = maps.shape[-1]
    c = min(n, cells)
    pooled = torch.nn.functional.adaptive_avg_pool2d(maps.flatten(0, 1), c)
    peak = pooled.flatten(1).max(1).values.clamp_min(1e-30).view(-1, 1, 1)
    return (pooled / peak * 255).round().to(torch.uint8).view(*maps.shape[:2], c, c)


def page(tokens: Sequence[str], maps, *, rollout=None, attributions=None, title: str = "",
         generated_from: Optional[int] = None, top_k: int = 8, thumbnail: int = 48) -> dict:
    """One text's data for write_html: tokens (N strings), maps [L, H, N, N],
    rollout [N, N] or None, attributions [N] or None (signed), title,
    generated_from (the index of the first generated token, or None),
    top_k edges per row drawn in the head view, thumbnail cells per side."""
    tokens = [str(t) for t in tokens]
    n = len(tokens)
    if n < 1 or n > 32767:
        raise ValueError(f"tokens must hold 1 to 32767 strings, got {n}")
    maps = _checked_maps(maps, n)
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive int, got {top_k!r}")
    if not isinstance(thumbnail, int) or thumbnail < 1:
        raise ValueError(f"thumbnail must be a positive int, got {thumbnail!r}")
    if generated_from is not None and not 0 < generated_from <= n:
        raise ValueError(f"generated_from must be in 1..{n} (the tokens), got {generated_from}")
    index, weight = _top_edges(maps, top_k)
    thumbs = _pooled(maps, thumbnail)
    data = {"title": str(title), "tokens": tokens, "layers": maps.shape[0],
            "heads": maps.shape[1], "k": index.shape[-1], "index": _b64(index),
            "weight": _b64(weight), "thumb": thumbs.shape[-1], "thumbs": _b64(thumbs),
            "generated_from": generated_from}
    if rollout is not None:
        roll = torch.as_tensor(rollout).double()
        if roll.shape != (n, n):
            raise ValueError(f"rollout must be [{n}, {n}], got {tuple(roll.shape)}")
        data["rollout"] = [float(x) for x in roll.mean(0)]
    if attributions is not None:
        attr = torch.as_tensor(attributions).double().flatten()
        if attr.shape != (n,):
            raise ValueError(f"attributions must be [{n}], got {tuple(attr.shape)}")
        data["attributions"] = [float(x) for x in attr]
    return data


def decoder_page(model, tokenizer, prompt_ids, max_new_tokens: int = 16, *,
                 title: str = "", top_k: int = 8, ig_steps: int = 32) -> dict:
    """Generates up to max_new_tokens greedily after prompt_ids ([N] ints)
    with a Transformers causal LM, then takes the attention of the whole
    sequence (output_attentions; load the model with
    attn_implementation="qkv" for qkv's weights and gradients) and its
    rollout; the generated tokens are marked. Attributions: integrated
    gradients (ig_steps to start with, doubled up to 8x until complete
    within 1%; 0: none) of the last token's log-probability with respect
    to the word embeddings of the tokens before it, from a baseline of
    zeros that keeps the first token's (the last token's own is 0).
    tokenizer may be None (tokens shown as ids)."""
    ids = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()
    if ids.numel() < 1:
        raise ValueError("prompt_ids is empty")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if not isinstance(ig_steps, int) or ig_steps < 0:
        raise ValueError(f"ig_steps must be an int >= 0, got {ig_steps!r}")
    with torch.no_grad():
        whole = ids[None]
        if max_new_tokens:
            whole = model.generate(whole, attention_mask=torch.ones_like(whole),
                                   do_sample=False, max_new_tokens=max_new_tokens,
                                   pad_token_id=0)
        out = model(whole, output_attentions=True)
    if not out.attentions:
        raise ValueError("the model returned no attention weights")
    maps = torch.stack([a[0] for a in out.attentions]).float()
    seq = whole[0].tolist()
    attributions = None
    if ig_steps and len(seq) > 1:
        with torch.no_grad():
            x = model.get_input_embeddings()(whole[0, :-1])
        base = torch.zeros_like(x)
        base[0] = x[0]
        target = seq[-1]

        def log_prob(e: torch.Tensor) -> torch.Tensor:
            logits = model(inputs_embeds=e).logits[:, -1]
            return torch.log_softmax(logits.float(), -1)[:, target]

        (attr,), _ = integrated_gradients_fn(log_prob, (x,), (base,), steps=ig_steps,
                                             max_steps=8 * ig_steps)
        attributions = torch.cat([attr.sum(-1), torch.zeros(1, dtype=attr.dtype)])
    tokens = ([str(t) for t in tokenizer.convert_ids_to_tokens(seq)] if tokenizer is not None
              else [str(t) for t in seq])
    generated = ids.numel() if len(seq) > ids.numel() else None
    return page(tokens, maps, rollout=rollout(maps), attributions=attributions, title=title,
                generated_from=generated, top_k=top_k)


def write_html(path: str, pages: Sequence[dict], title: str = "qkv attention explorer") -> str:
    """Writes the explorer of `pages` (page() results) to path, a
    self-contained HTML file; returns the path. Nothing is written when an
    argument is bad."""
    if not pages:
        raise ValueError("pages is empty: pass at least one page()")
    for i, p in enumerate(pages):
        if not isinstance(p, dict) or "tokens" not in p or "index" not in p:
            raise ValueError(f"pages[{i}] is not a page() result")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"path: the folder {folder} does not exist")
    payload = json.dumps(list(pages), separators=(",", ":")).replace("</", "<\\/")
    text = (_TEMPLATE.replace("__TITLE__", html.escape(title))
            .replace("__DATA__", payload))
    tmp = path + ".part"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
    return path


_TEMPLATE = r"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body{font:13px system-ui,sans-serif;margin:12px;color:#222}
header{display:flex;gap:12px;align-items:center;flex-wrap:wrap;margin-bottom:8px}
#main{display:flex;gap:16px;align-items:flex-start;flex-wrap:wrap}
.panel{border:1px solid #ddd;padding:6px;flex:none}
#thumbs{display:grid;gap:2px}
#thumbs canvas{cursor:pointer;border:2px solid transparent;image-rendering:pixelated}
#thumbs canvas.on{border-color:#d33}
.note{color:#666;max-width:420px}
#headwrap{max-height:85vh;overflow:auto}
</style></head><body>
<header><b>__TITLE__</b>
<label>text <select id="page"></select></label>
<label>layer <select id="layer"></select></label>
<label>head <select id="head"></select></label>
<span class="note">Attention weights show where information is mixed, not why the output
is what it is: attention is not attribution. Generated tokens are in orange.</span></header>
<div id="main">
<div class="panel" id="headwrap"><div>head view (top edges per query; hover a token)</div>
<canvas id="headview"></canvas></div>
<div class="panel"><div>model view (layers x heads; click one)</div><div id="thumbs"></div></div>
<div class="panel" id="scorewrap"><div>rollout | integrated gradients</div>
<canvas id="scores"></canvas></div>
</div>
<script>
"use strict";
const PAGES = __DATA__;
const ROW = 14, TOKW = 110, GAP = 160;
const state = {page: 0, layer: 0, head: 0, focus: -1};
function bytes(b64) {
  const s = atob(b64), out = new Uint8Array(s.length);
  for (let i = 0; i < s.length; i++) out[i] = s.charCodeAt(i);
  return out;
}
for (const p of PAGES) {
  p.idx = new Int16Array(bytes(p.index).buffer);
  p.w = bytes(p.weight);
  p.th = bytes(p.thumbs);
}
function fill(select, n, label) {
  select.innerHTML = "";
  for (let i = 0; i < n; i++) select.add(new Option(label(i), i));
}
function sized(canvas, w, h) {
  const r = window.devicePixelRatio || 1;
  canvas.width = Math.round(w * r); canvas.height = Math.round(h * r);
  canvas.style.width = w + "px"; canvas.style.height = h + "px";
  const g = canvas.getContext("2d"); g.setTransform(r, 0, 0, r, 0, 0); return g;
}
function tokenColor(p, i) {
  return p.generated_from !== null && i >= p.generated_from ? "#d60" : "#222";
}
function label(t) { return t.length > 14 ? t.slice(0, 13) + "\u2026" : t; }
function drawHead() {
  const p = PAGES[state.page], n = p.tokens.length, k = p.k;
  const g = sized(document.getElementById("headview"), 2 * TOKW + GAP, n * ROW + 8);
  g.font = "12px monospace"; g.textBaseline = "middle";
  for (let i = 0; i < n; i++) {
    g.fillStyle = tokenColor(p, i);
    g.textAlign = "right"; g.fillText(label(p.tokens[i]), TOKW - 4, 4 + i * ROW + ROW / 2);
    g.textAlign = "left"; g.fillText(label(p.tokens[i]), TOKW + GAP + 4, 4 + i * ROW + ROW / 2);
  }
  const base = ((state.layer * p.heads + state.head) * n) * k;
  g.lineWidth = 1.5;
  for (let i = 0; i < n; i++) {
    if (state.focus >= 0 && i !== state.focus) continue;
    for (let e = 0; e < k; e++) {
      const a = p.w[base + i * k + e] / 255;
      if (a <= 0.02) continue;
      const j = p.idx[base + i * k + e];
      g.strokeStyle = "rgba(30,90,200," + a.toFixed(3) + ")";
      g.beginPath(); g.moveTo(TOKW, 4 + i * ROW + ROW / 2);
      g.lineTo(TOKW + GAP, 4 + j * ROW + ROW / 2); g.stroke();
    }
  }
}
function drawThumbs() {
  const p = PAGES[state.page], box = document.getElementById("thumbs"), c = p.thumb;
  const side = Math.max(16, Math.min(48, Math.floor(480 / p.heads)));
  box.innerHTML = "";
  box.style.gridTemplateColumns = "repeat(" + p.heads + "," + side + "px)";
  for (let l = 0; l < p.layers; l++) for (let h = 0; h < p.heads; h++) {
    const cv = document.createElement("canvas");
    cv.width = c; cv.height = c; cv.style.width = side + "px"; cv.style.height = side + "px";
    cv.title = "layer " + l + ", head " + h;
    if (l === state.layer && h === state.head) cv.className = "on";
    const g = cv.getContext("2d"), img = g.createImageData(c, c);
    const off = (l * p.heads + h) * c * c;
    for (let i = 0; i < c * c; i++) {
      const v = 255 - p.th[off + i];
      img.data[4 * i] = v; img.data[4 * i + 1] = v; img.data[4 * i + 2] = 255;
      img.data[4 * i + 3] = 255;
    }
    g.putImageData(img, 0, 0);
    cv.onclick = () => select(l, h);
    box.appendChild(cv);
  }
}
function drawScores() {
  const p = PAGES[state.page], n = p.tokens.length, W = 120;
  const g = sized(document.getElementById("scores"), TOKW + 2 * W + 24, n * ROW + 8);
  g.font = "12px monospace"; g.textBaseline = "middle";
  const cols = [["rollout", p.rollout], ["integrated gradients", p.attributions]];
  cols.forEach(([name, v], c) => {
    const x0 = TOKW + 8 + c * (W + 12);
    if (!v) { g.fillStyle = "#999"; g.fillText("(none)", x0, 10); return; }
    const peak = Math.max(...v.map(Math.abs)) || 1;
    for (let i = 0; i < n; i++) {
      const len = (W / 2) * v[i] / peak, y = 4 + i * ROW + 2;
      g.fillStyle = v[i] < 0 ? "#c33" : "#36a";
      if (c === 0) g.fillRect(x0, y, 2 * Math.abs(len), ROW - 4);
      else g.fillRect(x0 + W / 2 + Math.min(0, len), y, Math.abs(len), ROW - 4);
    }
  });
  for (let i = 0; i < n; i++) {
    g.fillStyle = tokenColor(p, i); g.textAlign = "right";
    g.fillText(label(p.tokens[i]), TOKW, 4 + i * ROW + ROW / 2);
  }
}
function select(l, h) {
  state.layer = l; state.head = h;
  document.getElementById("layer").value = l; document.getElementById("head").value = h;
  drawHead(); drawThumbs();
}
function showPage(i) {
  state.page = i; state.focus = -1;
  const p = PAGES[i];
  fill(document.getElementById("layer"), p.layers, l => "" + l);
  fill(document.getElementById("head"), p.heads, h => "" + h);
  select(Math.min(state.layer, p.layers - 1), Math.min(state.head, p.heads - 1));
  drawScores();
}
fill(document.getElementById("page"), PAGES.length, i => PAGES[i].title || "text " + i);
document.getElementById("page").onchange = e => showPage(+e.target.value);
document.getElementById("layer").onchange = e => select(+e.target.value, state.head);
document.getElementById("head").onchange = e => select(state.layer, +e.target.value);
const hv = document.getElementById("headview");
hv.onmousemove = e => {
  const r = hv.getBoundingClientRect(), n = PAGES[state.page].tokens.length;
  const i = Math.floor((e.clientY - r.top - 4) / ROW);
  const f = i >= 0 && i < n ? i : -1;
  if (f !== state.focus) { state.focus = f; drawHead(); }
};
hv.onmouseleave = () => { state.focus = -1; drawHead(); };
const t0 = performance.now();
showPage(0);
window.qkvExplorer = {drawnMs: performance.now() - t0, select: select, state: state};
</script></body></html>
"""

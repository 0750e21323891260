"""Transformers models on qkv (qkv.transformers): every model family the
integration maps (BERT padding, Llama GQA, Mistral sliding window, Gemma 2
softcap and alternating windows, gpt-oss learned sinks) against the stock
"eager" implementation, with small configs and seeded random weights.

Error model (FlashAttention's): the same model run in float64 with the
plain attention below is the reference; qkv's float32 (bfloat16) result may
differ from it by at most twice what the stock float32 (bfloat16) "eager"
implementation does, plus a floor of a few ulps of the output's magnitude
for outputs where the stock error happens to be near zero. ("eager" itself
cannot be the float64 reference: it takes the softmax in float32, where the
float64 mask value finfo(float64).min becomes -inf and a fully masked row,
as padding makes, turns into NaN that reaches every token.)"""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import qkv.transformers as qt  # noqa: E402

qt.register()

VOCAB = 128


def _reference_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                         softcap=None, is_causal=None, **kwargs):
    """softmax(softcap(q k^T scaling) + mask) v in float64, as written in the
    models' eager code, with gpt-oss's sink logits (s_aux, [Hq]) as one more
    column of the softmax that is dropped afterwards; a row without any key
    gives 0 (qkv's convention; such rows are padding, and no valid token
    reads them)."""
    group = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(group, dim=1)
    value = value.repeat_interleave(group, dim=1)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    s = query @ key.transpose(2, 3) * scaling
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if attention_mask is None and causal and query.shape[2] > 1:
        attention_mask = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            s = s.masked_fill(~attention_mask, float("-inf"))
        else:
            s = s + attention_mask
    sinks = kwargs.get("s_aux")
    if sinks is not None:
        column = sinks.to(s.dtype).reshape(1, -1, 1, 1).expand(*s.shape[:-1], 1)
        s = torch.cat([s, column], dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    if sinks is not None:
        p = p[..., :-1]
    return (p @ value).transpose(1, 2).contiguous(), p


def _register_reference():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("float64_reference", _reference_attention)
    AttentionMaskInterface.register("float64_reference", sdpa_mask)


_register_reference()


def _model(cls, config, impl, dtype=torch.float32):
    torch.manual_seed(0)
    m = cls._from_config(config, attn_implementation=impl)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(".sinks"):  # gpt-oss initialises them near 0; make them matter
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 2)
    return m.to(dtype).eval()


def _bert():
    return transformers.BertModel, transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128)


def _llama():
    return transformers.LlamaForCausalLM, transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128)


def _mistral():
    return transformers.MistralForCausalLM, transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, sliding_window=8)


def _gemma2():
    return transformers.Gemma2ForCausalLM, transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=128, sliding_window=8)


def _gpt_oss():
    return transformers.GptOssForCausalLM, transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=64, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=8, experts_implementation="eager")


FAMILIES = {"bert": _bert, "llama": _llama, "mistral": _mistral, "gemma2": _gemma2,
            "gpt_oss": _gpt_oss}


def _inputs(padding):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, VOCAB, (3, 24), generator=g)
    am = torch.ones(3, 24, dtype=torch.long)
    if padding == "right":
        am[1, 17:] = 0
        am[2, 6:] = 0
    elif padding == "left":
        am[1, :7] = 0
        am[2, :18] = 0
    return ids, am


def _output(model, ids, am, **kw):
    out = model(input_ids=ids, attention_mask=am, **kw)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _within_error_model(got, stock, ref, valid, ulps=4):
    """|got - ref| <= 2 |stock - ref| + ulps of max|ref|, on valid tokens."""
    ref = ref[valid].double()
    err = (got[valid].double() - ref).abs().max().item()
    stock_err = (stock[valid].double() - ref).abs().max().item()
    eps = torch.finfo(got.dtype).eps * ulps * ref.abs().max().item()
    assert err <= 2 * stock_err + eps, (err, stock_err, eps)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("padding", ["none", "right", "left"])
def test_forward_matches_eager(family, padding, monkeypatch):
    cls, config = FAMILIES[family]()
    ids, am = _inputs(padding)
    calls = []
    plain = qt._plain
    monkeypatch.setattr(qt, "_plain", lambda *a: calls.append(1) or plain(*a))
    with torch.no_grad():
        ref = _output(_model(cls, config, "float64_reference", torch.float64), ids, am)
        stock = _output(_model(cls, config, "eager"), ids, am)
        got = _output(_model(cls, config, "qkv"), ids, am)
    assert len(calls) == config.num_hidden_layers  # every layer ran on qkv
    _within_error_model(got, stock, ref, am.bool())


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss"])
def test_bfloat16_within_its_error_model(family):
    cls, config = FAMILIES[family]()
    ids, am = _inputs("right")
    with torch.no_grad():
        ref = _output(_model(cls, config, "float64_reference", torch.float64), ids, am)
        stock = _output(_model(cls, config, "eager", torch.bfloat16), ids, am)
        got = _output(_model(cls, config, "qkv", torch.bfloat16), ids, am)
    assert got.dtype == torch.bfloat16
    _within_error_model(got, stock, ref, am.bool())


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2", "gpt_oss"])
@pytest.mark.parametrize("padding", ["none", "left"])
def test_greedy_generation_equals_eager(family, padding):
    cls, config = FAMILIES[family]()
    ids, am = _inputs(padding)
    tokens = {}
    for impl in ("eager", "qkv"):
        model = _model(cls, config, impl)
        with torch.no_grad():
            tokens[impl] = model.generate(
                input_ids=ids, attention_mask=am, max_new_tokens=64, do_sample=False,
                min_new_tokens=64, pad_token_id=0)
    assert tokens["qkv"].shape[1] == ids.shape[1] + 64
    assert torch.equal(tokens["qkv"], tokens["eager"])


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_training_step_gradients_match_eager(family):
    cls, config = FAMILIES[family]()
    ids, am = _inputs("right")
    labels = ids.masked_fill(am == 0, -100)
    grads = {}
    for impl, dtype in (("float64_reference", torch.float64), ("eager", torch.float32),
                        ("qkv", torch.float32)):
        model = _model(cls, config, impl, dtype).train()
        model(input_ids=ids, attention_mask=am, labels=labels).loss.backward()
        grads[impl] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads["qkv"].keys() == grads["float64_reference"].keys()
    for name, ref in grads["float64_reference"].items():
        everything = torch.ones_like(ref, dtype=torch.bool)
        _within_error_model(grads["qkv"][name], grads["eager"][name], ref, everything, ulps=16)


@pytest.mark.parametrize("family", ["bert", "llama", "gemma2", "gpt_oss"])
def test_output_attentions_are_the_probabilities(family):
    cls, config = FAMILIES[family]()
    ids, am = _inputs("right")
    with torch.no_grad():
        stock = _model(cls, config, "eager")(input_ids=ids, attention_mask=am,
                                              output_attentions=True).attentions
        got = _model(cls, config, "qkv")(input_ids=ids, attention_mask=am,
                                          output_attentions=True).attentions
    assert len(got) == len(stock) == config.num_hidden_layers
    valid = am.bool()
    for g, s in zip(got, stock):
        assert g.shape == s.shape and g.dtype == s.dtype
        # Probabilities of valid query rows: float32 softmax of the same
        # scores, |error| a few ulps of 1; padded keys get exactly 0 in qkv
        # (eager adds finfo.min, which underflows to 0 as well).
        rows = valid[:, None, :, None].expand_as(g)
        assert (g[rows] - s[rows]).abs().max().item() < 1e-5


def _mask(impl_kind, config_fn, padding):
    """The 4-D mask Transformers builds for layer 0 under "qkv"."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    _, config = config_fn()
    config._attn_implementation = "qkv"
    ids, am = _inputs(padding)
    embeds = torch.zeros(ids.shape[0], ids.shape[1], config.hidden_size)
    position_ids = torch.arange(ids.shape[1]).unsqueeze(0)
    make = create_sliding_window_causal_mask if impl_kind == "sliding" else create_causal_mask
    return make(config=config, inputs_embeds=embeds, attention_mask=am, cache=None,
                position_ids=position_ids)


def test_masks_of_band_form_become_options():
    right = _mask("causal", _llama, "right")
    found = qt._structure(right, True, None)
    assert found is not None and found.causal and found.top_left and found.window_left == -1
    assert found.key_lengths.tolist() == [24, 17, 6]
    sliding = _mask("sliding", _mistral, "none")
    found = qt._structure(sliding, True, 8)
    assert found is not None and found.window_left == 7 and found.key_lengths is None
    # Left padding is not a band: it stays an explicit mask.
    assert qt._structure(_mask("causal", _llama, "left"), True, None) is None


def test_structure_is_remembered_per_mask_and_version():
    mask = _mask("causal", _llama, "right")
    first = qt._structure(mask, True, None)
    assert qt._structure(mask, True, None) is first
    mask[2, 0, 0, 10] = True  # the tensor changed: found again, and no longer a band
    assert qt._structure(mask, True, None) is None


def test_masks_made_in_inference_mode():
    # sentence-transformers encodes under torch.inference_mode(): its masks
    # are inference tensors, without a version counter.
    cls, config = FAMILIES["bert"]()
    ids, am = _inputs("right")
    with torch.no_grad():
        want = _output(_model(cls, config, "qkv"), ids, am)
    with torch.inference_mode():
        got = _output(_model(cls, config, "qkv"), ids, am)
    assert torch.equal(got, want)


def test_register_returns_the_name_and_is_idempotent():
    assert qt.register() == "qkv"
    assert qt.register() == "qkv"
    from transformers import AttentionInterface

    assert AttentionInterface()["qkv"] is qt.attention_forward


def test_sinks_change_the_result_and_are_checked():
    q = torch.randn(1, 2, 3, 8, generator=torch.Generator().manual_seed(3))
    module = torch.nn.Module()
    plain, _ = qt.attention_forward(module, q, q, q, None)
    sunk, _ = qt.attention_forward(module, q, q, q, None, s_aux=torch.tensor([0.0, 1.0]))
    assert not torch.allclose(plain, sunk)
    with pytest.raises(ValueError, match="sinks"):
        qt.attention_forward(module, q, q, q, None, s_aux=torch.zeros(3))


# QkvCache: a Transformers cache held in qkv.KvCache objects, decoded by
# qkv's attention function.

def _llama32(layers=2):
    """A Llama whose head dim (32) quantized caches take."""
    return transformers.LlamaForCausalLM, transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128)


def _cached_logits(model, ids, cache, step):
    """Logits of ids fed through `cache` `step` tokens at a time."""
    return torch.cat([model(input_ids=ids[:, s:s + step], cache=cache).logits
                      for s in range(0, ids.shape[1], step)], dim=1)


@pytest.mark.parametrize("family", ["llama", "mistral", "gpt_oss"])
@pytest.mark.parametrize("step", [24, 5, 1])
def test_qkv_cache_forward_within_error_model(family, step):
    # 24 tokens at once: appended and decoded in chunks of 16 queries; 5 and
    # 1: decoding proper, across Mistral's window of 8 and with gpt-oss's sinks.
    cls, config = FAMILIES[family]()
    ids, am = _inputs("none")
    with torch.no_grad():
        ref = _output(_model(cls, config, "float64_reference", torch.float64), ids, am)
        stock = _output(_model(cls, config, "eager"), ids, am)
        model = _model(cls, config, "qkv")  # last: the models share their config
        cache = qt.QkvCache(model.config, max_cache_len=ids.shape[1])
        got = _cached_logits(model, ids, cache, step)
    assert cache.get_seq_length() == ids.shape[1] == cache.layers[1].cache.length(0)
    _within_error_model(got, stock, ref, am.bool())


@pytest.mark.parametrize("family", ["llama", "mistral", "gpt_oss"])
def test_qkv_cache_greedy_generation_equals_eager(family):
    cls, config = FAMILIES[family]()
    ids, am = _inputs("none")
    kw = dict(input_ids=ids, attention_mask=am, max_new_tokens=40, min_new_tokens=40,
              do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = _model(cls, config, "eager").generate(**kw)
        model = _model(cls, config, "qkv")
        cache = qt.QkvCache(model.config, max_cache_len=64)
        got = model.generate(**kw, cache=cache)
    assert torch.equal(got, want)
    assert cache.get_seq_length() == ids.shape[1] + 40 - 1  # the last token is not fed back


@pytest.mark.parametrize("storage", ["q8_0", "q4_0"])
def test_qkv_cache_stores_ggml_blocks(storage):
    # Layer 0's keys and values do not depend on any attention: the quantized
    # cache must hold exactly ggml's quantization of what the float32 cache holds.
    quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    np = pytest.importorskip("numpy")
    cls, config = _llama32()
    ids, _ = _inputs("none")
    model = _model(cls, config, "qkv")
    layers = {}
    with torch.no_grad():
        for kind in ("float32", storage):
            cache = qt.QkvCache(model.config, max_cache_len=32, k_dtype=kind)
            _cached_logits(model, ids[:1], cache, 7)
            layers[kind] = cache.layers[0].cache
    n, hkv, d = ids.shape[1], config.num_key_value_heads, 32
    kind = getattr(GGMLQuantizationType, storage.upper())
    for page in ("key_page", "value_page"):
        f32 = np.frombuffer(getattr(layers["float32"], page)(0, 0), np.float32)
        want = quants.quantize(f32[:n * hkv * d].reshape(n * hkv, d), kind).tobytes()
        got = getattr(layers[storage], page)(0, 0)[:len(want)]
        assert got == want, page
    assert layers[storage].k_dtype == layers[storage].v_dtype == storage


def test_qkv_cache_refuses_what_it_cannot_do():
    cls, config = _llama32()
    ids, am = _inputs("left")
    model = _model(cls, config, "qkv")
    with pytest.raises(ValueError, match="k_dtype"):
        qt.QkvCache(model.config, 32, k_dtype="int8")
    with pytest.raises(ValueError, match="head_dim"):
        qt.QkvCache(FAMILIES["llama"]()[1], 32, k_dtype="q8_0")  # head dim 16
    with pytest.raises(ValueError, match="max_cache_len"):
        qt.QkvCache(model.config, 0)
    with torch.no_grad():
        with pytest.raises(ValueError, match="attention_mask"):  # left padding
            model(input_ids=ids, attention_mask=am, cache=qt.QkvCache(model.config, 32))
        with pytest.raises(ValueError, match="max_cache_len 20"):
            model(input_ids=ids, cache=qt.QkvCache(model.config, 20))
        with pytest.raises(ValueError, match="output_attentions"):
            model(input_ids=ids, cache=qt.QkvCache(model.config, 32), output_attentions=True)
        # Another attention implementation never reads the cache: refused
        # at the next update instead of attending to the new tokens alone.
        cache = qt.QkvCache(model.config, 32)
        model.set_attn_implementation("sdpa")
        model(input_ids=ids[:, :4], cache=cache)
        with pytest.raises(ValueError, match="attn_implementation"):
            model(input_ids=ids[:, 4:5], cache=cache)
        with pytest.raises(ValueError, match="beam search"):
            cache.reorder_cache(torch.tensor([0, 1, 2]))


@pytest.mark.parametrize("page_size, sinks, window", [(1, 2, 6), (4, 4, 7)])
@pytest.mark.parametrize("step", [1, 24])
def test_streaming_qkv_cache_attends_to_sinks_and_window(page_size, sinks, window, step):
    # Fed one token at a time or all at once, query i sees the first `sinks` tokens and the
    # recent ones the cache keeps: from the first whole page after the sinks
    # whose dropping would leave fewer than `window` (page size 1: exactly
    # the last `window`); keys keep their positions. The reference is the
    # whole sequence at once with that mask.
    cls, config = FAMILIES["llama"]()
    ids, am = _inputs("none")
    n = ids.shape[1]
    first = torch.full((n,), sinks)
    for i in range(n):
        while i + 1 - int(first[i]) - page_size >= window:
            first[i] += page_size
    j = torch.arange(n)
    admit = (j[None, :] <= j[:, None]) & ((j[None, :] < sinks) | (j[None, :] >= first[:, None]))
    mask = admit.expand(ids.shape[0], 1, n, n)
    with torch.no_grad():
        ref = _output(_model(cls, config, "float64_reference", torch.float64), ids, mask)
        stock = _output(_model(cls, config, "eager"), ids, mask)
        model = _model(cls, config, "qkv")
        cache = qt.QkvCache(model.config, page_size=page_size, sink_tokens=sinks,
                            window_tokens=window)
        got = _cached_logits(model, ids, cache, step)
    layer = cache.layers[0].cache
    assert cache.get_seq_length() == layer.position(0) == n
    assert layer.length(0) == sinks + n - int(first[-1]) < n
    assert not torch.equal(admit, torch.ones(n, n, dtype=torch.bool).tril())
    _within_error_model(got, stock, ref, am.bool())
    with pytest.raises(ValueError, match="max_cache_len expected 0 with window_tokens"):
        qt.QkvCache(model.config, 64, page_size=page_size, window_tokens=window)

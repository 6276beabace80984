"""Tests for stepquant.integrations.hf_cache: the compressed-state transformers cache (shipped models)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from stepquant.accounting import int_rowwise_bytes, plan_bytes
from stepquant.codecs import MixedCodec, make_codec
from stepquant.codecs.base import PIVOT_BITS
from stepquant.families import shape_from_config
from stepquant.integrations.hf_cache import (
    CompressedStateCache,
    check_transformers_version,
    resolve_layer_codecs,
)
from stepquant.models import load, resolve
from stepquant.recurrence import prepare_qk, step

MODELS = ("gdn", "kda")


@pytest.fixture(scope="module", params=MODELS)
def shipped(request):
    torch.set_num_threads(1)
    model, _ = load(request.param)
    return request.param, model


def tokens(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 8000, (batch, length), generator=torch.Generator().manual_seed(seed))


def run(model, cache, ids: torch.Tensor, prefill: int) -> list[torch.Tensor]:
    """Logits of a prefill of ids[:, :prefill] then one cached token at a time."""
    with torch.inference_mode():
        out = [model(input_ids=ids[:, :prefill], past_key_values=cache, use_cache=True).logits[:, -1]]
        for t in range(prefill, ids.shape[1]):
            out.append(model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits[:, -1])
    return out


def linear_layers(model) -> list[int]:
    return [i for i, t in enumerate(model.config.layer_types) if t == "linear_attention"]


def test_fp32_codec_equals_the_model_cache_path(shipped):
    _, model = shipped
    ids = tokens(2, 14)
    reference = run(model, DynamicCache(config=model.config), ids, prefill=8)
    ours = run(model, CompressedStateCache(model.config, "fp32"), ids, prefill=8)
    for step_logits, ref_logits in zip(ours, reference, strict=True):
        assert torch.equal(step_logits, ref_logits)


def test_decode_reads_the_decoded_state_and_stores_the_requantized_update(shipped):
    """One decode step from the stored int4 state equals the float path started from the decoded state;
    stored after is int4(X_t), X_t the float update (y is read from X_t first)."""
    _, model = shipped
    codec = make_codec("int4")
    ids = tokens(2, 9, seed=1)
    ours, float_cache = CompressedStateCache(model.config, codec), DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=ids[:, :8], past_key_values=ours, use_cache=True)
        model(input_ids=ids[:, :8], past_key_values=float_cache, use_cache=True)
        for i in linear_layers(model):
            boundary = float_cache.layers[i].recurrent_states[0]
            assert torch.equal(ours.get_recurrent_state(i), codec.roundtrip(boundary)), "boundary pack"
            float_cache.layers[i].recurrent_states[0].copy_(codec.roundtrip(boundary))
        a = model(input_ids=ids[:, 8:], past_key_values=ours, use_cache=True).logits
        b = model(input_ids=ids[:, 8:], past_key_values=float_cache, use_cache=True).logits
        assert torch.equal(a, b)
        for i in linear_layers(model):
            updated = float_cache.layers[i].recurrent_states[0]
            assert torch.equal(ours.get_recurrent_state(i), codec.roundtrip(updated))


def test_per_row_codecs_match_single_codec_runs(shipped):
    """Row group m of one batch computes exactly what a whole batch in codec m computes for those rows.

    (Same batch shape on both sides: a different batch size changes float rounding, which INT4 then
    amplifies by flipping codes.)"""
    _, model = shipped
    ids = tokens(2, 12, seed=2).repeat(2, 1)
    both = run(model, CompressedStateCache(model.config, row_codecs=["fp32", "int4"]), ids, 8)
    fp32 = run(model, DynamicCache(config=model.config), ids, 8)
    int4 = run(model, CompressedStateCache(model.config, "int4"), ids, 8)
    for mixed, ref, low in zip(both, fp32, int4, strict=True):
        assert torch.equal(mixed[:2], ref[:2])
        assert torch.equal(mixed[2:], low[2:])
    assert not torch.allclose(both[-1][:2], both[-1][2:]), "INT4 rows should differ from FP32 rows"


def test_memory_held_equals_accounting(shipped):
    name, model = shipped
    shape = shape_from_config(resolve(name))
    layers = linear_layers(model)
    heads = shape.heads
    bits = torch.full((heads, 128), 5, dtype=torch.int8)
    bits[0] = PIVOT_BITS  # one FP16 pivot head
    bits[1, :64] = 7
    mixed = MixedCodec(bits=bits, w=torch.rand(heads, 128, generator=torch.Generator().manual_seed(0)) + 0.5)
    cache = CompressedStateCache(model.config, row_codecs=["fp32", "bf16", "int4", mixed])
    with torch.inference_mode():
        model(input_ids=tokens(4, 6).repeat(1, 1), past_key_values=cache, use_cache=True)
    held = cache.state_bytes()
    assert held["group_sizes"] == [1, 1, 1, 1]
    assert held["bytes_per_request"][0] == shape.fp32_bytes
    assert held["bytes_per_request"][1] == shape.fp32_bytes // 2
    assert held["bytes_per_request"][2] == int_rowwise_bytes(shape, 4).serving_bytes
    assert held["bytes_per_request"][3] == plan_bytes([bits] * len(layers), shape).serving_bytes
    assert held["bytes_per_request"] == held["serving_bytes_per_request"]
    dims = (shape.heads, shape.key_dim, shape.value_dim)
    assert held["bytes_per_request"][3] * 8 == mixed.storage_bits(*dims) * len(layers)

    unpacked = CompressedStateCache(model.config, "int4", packed=False)
    with torch.inference_mode():
        model(input_ids=tokens(1, 6), past_key_values=unpacked, use_cache=True)
    loose = unpacked.state_bytes()
    assert loose["bytes_per_request"][0] > loose["serving_bytes_per_request"][0]  # one byte per 4-bit code
    assert loose["serving_bytes_per_request"][0] == int_rowwise_bytes(shape, 4).serving_bytes


def test_packed_and_unpacked_storage_give_identical_logits():
    model, _ = load("kda")
    ids = tokens(1, 10, seed=3)
    spec = ["int6", "dsq4"]
    packed = run(model, CompressedStateCache(model.config, row_codecs=spec), ids.repeat(2, 1), 6)
    loose = run(model, CompressedStateCache(model.config, row_codecs=spec, packed=False), ids.repeat(2, 1), 6)
    for a, b in zip(packed, loose, strict=True):
        assert torch.equal(a, b)


def test_reset_forgets_the_state(shipped):
    _, model = shipped
    ids = tokens(1, 10, seed=4)
    cache = CompressedStateCache(model.config, "int8")
    first = run(model, cache, ids, 6)
    with torch.inference_mode():  # the cached tensors are inference tensors
        cache.reset()
    assert cache.state_bytes()["held_bytes"] == 0
    assert cache.get_seq_length() == 0
    assert all(cache.get_recurrent_state(i) is None for i in cache.linear_layers)
    again = run(model, cache, ids, 6)
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)


def test_reorder_keeps_codes_within_a_group_and_reencodes_across_groups():
    model, _ = load("gdn")
    cache = CompressedStateCache(model.config, row_codecs=["int8", "int4"])
    with torch.inference_mode():
        model(input_ids=tokens(4, 6, seed=5), past_key_values=cache, use_cache=True)
        layer = cache.linear_layers[0]
        before = cache.get_recurrent_state(layer)  # [4, H, K, V]: rows 0-1 int8, rows 2-3 int4
        cache.reorder_cache(torch.tensor([1, 1, 3, 2]))  # beams stay inside their group
        after = cache.get_recurrent_state(layer)
        assert torch.equal(after, before[[1, 1, 3, 2]])
        cache.reorder_cache(torch.tensor([2, 0, 1, 3]))  # group 0 now mixes rows of both groups
        crossed = cache.get_recurrent_state(layer)
        int8, int4 = make_codec("int8"), make_codec("int4")
        assert torch.equal(crossed[:2], int8.roundtrip(after[[2, 0]]))
        assert torch.equal(crossed[2:], int4.roundtrip(after[[1, 3]]))
        cache.reorder_cache(torch.tensor([2, 3, 0, 1]))  # whole groups swap: each re-encoded by its new codec
        swapped = cache.get_recurrent_state(layer)
        assert torch.equal(swapped[:2], int8.roundtrip(crossed[2:]))
        assert torch.equal(swapped[2:], int4.roundtrip(crossed[:2]))


def test_generate_with_a_batch_greedy_and_beam_search(shipped):
    _, model = shipped
    prompts = tokens(2, 8, seed=6)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompts))
    with torch.inference_mode():
        reference = model.generate(prompts, **kwargs)
        ours = model.generate(prompts, past_key_values=CompressedStateCache(model.config, "fp32"), **kwargs)
        assert torch.equal(ours, reference)
        grouped = CompressedStateCache(model.config, row_codecs=["fp32", "int4"])
        mask = torch.ones(4, 8, dtype=torch.long)
        mixed = model.generate(prompts.repeat(2, 1), past_key_values=grouped, max_new_tokens=6,
                               do_sample=False, pad_token_id=0, attention_mask=mask)
        assert torch.equal(mixed[:2], reference)
        assert grouped.state_bytes()["bytes_per_request"][1] < grouped.state_bytes()["bytes_per_request"][0]
        beams = dict(max_new_tokens=5, num_beams=3, do_sample=False, pad_token_id=0)
        beam_reference = model.generate(prompts, **beams)
        beam_ours = model.generate(prompts, past_key_values=CompressedStateCache(model.config), **beams)
        assert torch.equal(beam_ours, beam_reference)
        int8_cache = CompressedStateCache(model.config, "int8")
        beam_int8 = model.generate(prompts, past_key_values=int8_cache, **beams)
        assert beam_int8.shape == beam_reference.shape


def test_decode_step_seam_matches_the_reference_step():
    model, _ = load("kda")
    cache = CompressedStateCache(model.config, "int6")
    with torch.inference_mode():
        model(input_ids=tokens(2, 5, seed=7), past_key_values=cache, use_cache=True)
    layer = cache.layers[cache.linear_layers[0]]
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 128, generator=gen), torch.randn(2, 4, 128, generator=gen)
    v, g = torch.randn(2, 4, 128, generator=gen), -torch.rand(2, 4, 128, generator=gen)
    beta = torch.rand(2, 4, generator=gen)
    state = layer.load()
    y = layer.decode_step(q, k, v, g, beta)
    b_q, b_k = prepare_qk(q, k, use_qk_l2norm=True, mode="kda")
    x, y_ref = step(state, b_q, b_k, v, g, beta)
    assert torch.equal(y, y_ref)
    assert torch.equal(layer.load(), make_codec("int6").roundtrip(x))


def test_codec_specs_and_errors():
    model, _ = load("gdn")
    layers = linear_layers(model)
    int4 = make_codec("int4")
    assert resolve_layer_codecs("int4", layers)[layers[0]].name == "int4"
    per_layer = resolve_layer_codecs([int4] * len(layers), layers)
    assert list(per_layer) == layers
    with pytest.raises(ValueError, match="one codec per linear-attention layer"):
        resolve_layer_codecs([int4], layers)
    with pytest.raises(ValueError, match="one entry per linear-attention layer"):
        resolve_layer_codecs({0: int4}, layers)
    with pytest.raises(TypeError, match="codec spec"):
        resolve_layer_codecs(3.5, layers)
    with pytest.raises(ValueError, match="unknown codec name"):
        CompressedStateCache(model.config, "int9")
    with pytest.raises(TypeError, match="not both"):
        CompressedStateCache(model.config, "int4", row_codecs=["fp32"])
    with pytest.raises(ValueError, match="group_sizes"):
        CompressedStateCache(model.config, row_codecs=["fp32", "int4"], group_sizes=[1])
    cache = CompressedStateCache(model.config, row_codecs=["fp32", "int4"])
    with pytest.raises(ValueError, match="cannot be split equally"), torch.inference_mode():
        model(input_ids=tokens(3, 4), past_key_values=cache, use_cache=True)


def test_version_and_model_type_checks():
    assert check_transformers_version("5.23.0") == "5.23.0"
    for bad in ("5.22.1", "5.24.0", "4.57.0", "6.0"):
        with pytest.raises(ImportError, match=">=5.23,<5.24"):
            check_transformers_version(bad)
    from transformers import LlamaConfig

    with pytest.raises(ValueError, match="not supported"):
        CompressedStateCache(LlamaConfig(num_hidden_layers=2), "int4")

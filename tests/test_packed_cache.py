"""Tests for stepquant.integrations.packed_cache: transformers generation served from a packed state pool
(shipped models, calibrated plans, the torch reference of decode_step_packed on CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from stepquant import assets
from stepquant.accounting import plan_bytes
from stepquant.calibrate import Plan
from stepquant.codecs import DeferredCodec
from stepquant.families import KDA, shape_from_config
from stepquant.integrations import packed_cache
from stepquant.integrations.hf_cache import CompressedStateCache
from stepquant.integrations.packed_cache import (
    PackedSlots,
    PackedStateCache,
    route_recurrences,
    unroute_recurrences,
)
from stepquant.models import load

PLANS = assets.PLANS
MODELS = ("gdn", "kda")


@pytest.fixture(scope="module", params=MODELS)
def shipped(request):
    torch.set_num_threads(1)
    model, _ = load(request.param)
    return request.param, model, Plan.load(PLANS / request.param / "stepquant-6", model_config=model.config)


def tokens(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 8000, (batch, length), generator=torch.Generator().manual_seed(seed))


def forward(model, cache, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return ((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def both_caches(model, plan, max_batch: int = 2) -> tuple[PackedStateCache, CompressedStateCache]:
    """(the pool-backed cache, the existing compressed cache) for the same plan."""
    return PackedStateCache(model.config, plan, max_batch=max_batch), CompressedStateCache(model.config, plan)


def step_error(model, ours, reference, ids: torch.Tensor) -> float:
    """Relative RMS of the last-position logits of one forward on each cache."""
    return rel_rms(forward(model, ours, ids), forward(model, reference, ids))


def stored(cache: PackedStateCache, layer: int):
    """The packed states of the cache's rows in one model layer (a copy)."""
    return cache.layers[layer].pool_layer.gather(torch.tensor(cache.slots))


def test_each_step_computes_what_the_compressed_cache_computes(shipped):
    """Same stored state in, same logits out (float summation order aside), same state stored.

    The compressed cache runs transformers' own recurrent step on the decoded state; the pool path runs
    decode_step_packed (torch reference: recurrence.step). Both requantize with the plan's codec, so the
    only difference is FP32 summation order, which moves a code or an FP16 scale sitting on a rounding
    boundary now and then. To compare the math rather than those flips, the compressed cache continues
    each step from the pool's stored state."""
    name, model, plan = shipped
    ids = tokens(2, 11)
    ours, reference = both_caches(model, plan)
    assert torch.equal(forward(model, ours, ids[:, :6]), forward(model, reference, ids[:, :6]))
    for i in ours.linear_layers:  # the boundary pack is the plan's codec on the same float state
        ref = reference.layers[i].encoded[0][0]
        assert torch.equal(stored(ours, i).codes, ref.codes) and torch.equal(stored(ours, i).col_scale,
                                                                               ref.col_scale)
    errors = []
    for t in range(6, ids.shape[1]):
        errors.append(step_error(model, ours, reference, ids[:, t:t + 1]))
        for i in ours.linear_layers:
            words_equal = (stored(ours, i).codes == reference.layers[i].encoded[0][0].codes).float().mean()
            assert words_equal > 0.999, f"layer {i}: only {words_equal:.5f} of the code words agree"
            reference.layers[i].encoded[0] = [stored(ours, i)]  # continue from the same state
    assert max(errors) < 1e-5, errors  # measured 1.2e-7 .. 2.2e-7 on both models


def test_free_running_logits_stay_close_to_the_compressed_cache(shipped):
    """Prefill + 5 decode tokens, each cache on its own states: the rounding-boundary flips of the test
    above accumulate. Measured (one torch thread, the shipped stepquant-6 plans: reciprocal, no refit):
    GDN 0, 1.9e-7, 2.0e-7, 2.6e-6, 1.8e-5, 2.2e-5; KDA 0, 1.2e-7, 1.2e-7, 1.2e-7, 1.6e-6, 1.1e-6 (with their
    first quantizer, exact/2: up to 1.0e-4 and 3.2e-6). Other prompts reached 3.8e-4 (GDN, exact/2) by the
    6th token, hence the looser bound here; the test above holds the math itself to 1e-5."""
    _, model, plan = shipped
    ids = tokens(2, 11)
    ours, reference = both_caches(model, plan)
    errors = [step_error(model, ours, reference, ids[:, :6])]
    for t in range(6, ids.shape[1]):
        errors.append(step_error(model, ours, reference, ids[:, t:t + 1]))
    assert errors[0] == 0.0 and errors[1] < 1e-5, errors
    assert max(errors) < 1e-3, errors


def test_decode_runs_on_the_packed_slots(shipped, monkeypatch):
    """Every decode token of every linear layer goes through decode_step_packed; no FP32 state is kept."""
    _, model, plan = shipped
    calls = []
    original = packed_cache.decode_step_packed

    def counting(layer, slots, *args, **kwargs):
        calls.append(slots.tolist())
        return original(layer, slots, *args, **kwargs)

    monkeypatch.setattr(packed_cache, "decode_step_packed", counting)
    cache = PackedStateCache(model.config, plan, max_batch=3)
    ids = tokens(2, 9, seed=1)
    forward(model, cache, ids[:, :6])
    assert calls == []  # the prefill runs the model's float path and packs once
    for t in range(6, 9):
        forward(model, cache, ids[:, t:t + 1])
    assert calls == [[0, 1]] * (3 * len(cache.linear_layers))
    for i in cache.linear_layers:
        layer = cache.layers[i]
        assert layer.recurrent_states[0] is None  # nothing float stored between steps
        assert isinstance(cache.get_recurrent_state(i), PackedSlots)


def test_pool_bytes_equal_the_compressed_cache_and_accounting(shipped):
    name, model, _ = shipped
    shape = shape_from_config(model.config.to_dict())
    for variant in ("stepquant-6", "temporal-6"):  # dual-axis (row + column scales) and rowwise absmax
        plan = Plan.load(PLANS / name / variant, model_config=model.config)
        ours, reference = both_caches(model, plan, max_batch=3)
        ids = tokens(2, 7, seed=2)
        for cache in (ours, reference):
            forward(model, cache, ids[:, :6])
            forward(model, cache, ids[:, 6:])
        held = ours.state_bytes()
        per_request = plan_bytes(list(plan.bits), shape, has_col_scale=plan.has_col_scale).serving_bytes
        assert held["bytes_per_request"] == ours.pool.bytes_per_slot == per_request
        assert per_request == reference.state_bytes()["bytes_per_request"][0]
        assert per_request == plan.accounting()["serving_bytes"]
        assert held["held_bytes"] == 2 * per_request and held["pool_bytes"] == 3 * per_request
        assert held["slots"] == [0, 1]


def test_a_prompt_continued_on_a_cached_state_equals_the_compressed_cache(shipped):
    """Several tokens on an existing state: the model's own chunked path from the decoded state, packed
    again; the compressed cache does exactly the same."""
    _, model, plan = shipped
    ids = tokens(2, 10, seed=3)
    ours, reference = both_caches(model, plan)
    for chunk in (slice(0, 6), slice(6, 9)):
        assert torch.equal(forward(model, ours, ids[:, chunk]), forward(model, reference, ids[:, chunk]))
    for i in ours.linear_layers:
        assert torch.equal(stored(ours, i).codes, reference.layers[i].encoded[0][0].codes)
    assert step_error(model, ours, reference, ids[:, 9:]) < 1e-5


def test_generate_greedy_batch_reset_and_beam_search(shipped):
    _, model, plan = shipped
    prompts = tokens(2, 6, seed=4)
    greedy = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompts))
    cache = PackedStateCache(model.config, plan, max_batch=4)
    with torch.inference_mode():
        compressed = CompressedStateCache(model.config, plan)
        reference = model.generate(prompts, past_key_values=compressed, **greedy)
        ours = model.generate(prompts, past_key_values=cache, **greedy)
        assert torch.equal(ours, reference)
        assert cache.slots == [0, 1] and cache.pool.num_free == 2
        cache.reset()
        assert cache.slots is None and cache.pool.num_free == 4 and cache.state_bytes()["held_bytes"] == 0
        assert all(cache.get_recurrent_state(i) is None for i in cache.linear_layers)
        again = model.generate(prompts, past_key_values=cache, **greedy)  # the cache serves a new batch
        assert torch.equal(again, reference)
        cache.reset()
        beams = dict(max_new_tokens=3, num_beams=2, do_sample=False, pad_token_id=0)
        beam = model.generate(prompts, past_key_values=cache, **beams)
        assert cache.slots == [0, 1, 2, 3]  # batch x num_beams rows
        compressed = CompressedStateCache(model.config, plan)
        beam_reference = model.generate(prompts, past_key_values=compressed, **beams)
        assert beam.shape == (2, 9) and torch.equal(beam, beam_reference)


def test_deferred_cache_follows_the_deferred_codec(shipped):
    """defer=R: the CUDA kernel's deferred path (its emulation build on this CPU) against the compressed cache
    with the plan's codecs deferred alike (DeferredCodec: the float state between fits). Then a prompt
    continued on a state with held updates, beam search's reorder, and the buffers' bytes."""
    name, model, plan = shipped
    every, ids = 3, tokens(2, 13, seed=6)
    ours = PackedStateCache(model.config, plan, max_batch=2, defer=every)
    codecs = {layer: DeferredCodec(plan.codec(i), every) for i, layer in enumerate(ours.linear_layers)}
    reference = CompressedStateCache(model.config, codecs)
    assert torch.equal(forward(model, ours, ids[:, :6]), forward(model, reference, ids[:, :6]))
    first = ours.layers[ours.linear_layers[0]].deferred
    errors, ages = [], []
    for t in range(6, 11):  # five tokens: fits at the third and sixth after the prefill's
        errors.append(step_error(model, ours, reference, ids[:, t:t + 1]))
        ages.append(first.age)
    assert ages == [1, 2, 0, 1, 2]
    print(f"{name}: deferred R={every} logits per decode step {', '.join(f'{e:.1e}' for e in errors)}")
    # measured: 1e-7 before the first fit, then up to 3.3e-4 (gdn) and 1.5e-4 (kda): the FP16 updates and
    # the codes that flip on a rounding boundary at the fit
    assert errors[0] < 1e-5 and max(errors) < 2e-3, errors
    # a prompt continued on a state that holds two updates: the model's chunked path from the whole state
    assert step_error(model, ours, reference, ids[:, 11:13]) < 2e-3
    assert first.age == 0 and not first.g_sum.any()
    shape = shape_from_config(model.config.to_dict())
    # KDA sums a gate per key row and holds k_j per head; GDN one gate per head, k_j per q/k head
    gate, key_heads = (shape.key_dim, shape.heads) if name == "kda" else (1, shape.key_heads)
    assert name == "kda" or key_heads < shape.heads  # the shipped gdn model shares its k_j
    held = (shape.heads * (4 * gate + (every - 1) * shape.value_dim * 2)
            + key_heads * (every - 1) * shape.key_dim * 2)
    layers = len(ours.linear_layers)
    assert ours.state_bytes()["deferred_bytes_per_request"] == held * layers
    inner, dims = plan.codec(0), (shape.heads, shape.key_dim, shape.value_dim)
    counted = DeferredCodec(inner, every).for_shape(shape)
    assert counted.storage_bits(*dims) - inner.storage_bits(*dims) == 8 * held  # one count: the codec's
    forward(model, ours, ids[:, 6:7])
    before = [t.clone() for t in (first.g_sum, first.pend_k, first.pend_u)]
    ours.reorder_cache(torch.tensor([1, 1]))
    assert all(torch.equal(t, b[[1, 1]]) for t, b in zip((first.g_sum, first.pend_k, first.pend_u), before,
                                                         strict=True))
    ours.reset()
    assert ours.layers[ours.linear_layers[0]].deferred is None


def test_reorder_copies_slot_contents_for_beam_search():
    model, _ = load("gdn")
    plan = Plan.load(PLANS / "gdn" / "stepquant-6", model_config=model.config)
    cache = PackedStateCache(model.config, plan, max_batch=4)
    forward(model, cache, tokens(3, 5, seed=5))
    layer = cache.linear_layers[1]
    before = stored(cache, layer)
    cache.reorder_cache(torch.tensor([2, 0, 0]))
    after = stored(cache, layer)
    assert cache.slots == [0, 1, 2]  # rows keep their slots, the contents move
    for name in ("codes", "row_scale", "col_scale"):
        assert torch.equal(getattr(after, name), getattr(before, name)[[2, 0, 0]]), name


def test_routing_changes_nothing_for_other_caches():
    model, _ = load("kda")
    plan = Plan.load(PLANS / "kda" / "stepquant-6", model_config=model.config)
    module = KDA.modeling_module("kimi_linear")
    names = KDA.recurrence_functions
    ids = tokens(1, 8, seed=6)

    def plain_run():
        cache = DynamicCache(config=model.config)
        return [forward(model, cache, ids[:, chunk]) for chunk in (slice(0, 6), slice(6, 7), slice(7, 8))]

    routed = lambda fn: getattr(fn, "_stepquant_packed_route", None) is fn
    unroute_recurrences("kimi_linear")
    assert not any(routed(getattr(module, n)) for n in names)
    before = plain_run()
    PackedStateCache(model.config, plan, max_batch=1)
    assert all(routed(getattr(module, n)) for n in names)
    route_recurrences("kimi_linear")  # idempotent: no second wrapper
    assert not any(routed(getattr(module, n).__wrapped__) for n in names)
    for a, b in zip(plain_run(), before, strict=True):
        assert torch.equal(a, b)


def test_errors_name_the_argument_and_the_fix():
    model, _ = load("gdn")
    plan = Plan.load(PLANS / "gdn" / "stepquant-6", model_config=model.config)
    with pytest.raises(ValueError, match="max_batch must be a positive int"):
        PackedStateCache(model.config, plan, max_batch=0)
    with pytest.raises(ValueError, match="max_batch >= 3"):
        forward(model, PackedStateCache(model.config, plan, max_batch=2), tokens(3, 4))
    with pytest.raises(ValueError, match="build the cache with device='cpu'"):
        forward(model, PackedStateCache(model.config, plan, max_batch=1, device="meta"), tokens(1, 4))
    with pytest.raises(TypeError, match="calibration plan"):
        PackedStateCache(model.config, "int4", max_batch=1)
    with pytest.raises(ValueError, match="split=True .* needs device='cuda'"):
        PackedStateCache(model.config, plan, max_batch=1, split=True)
    for defer in (1, 17, True, 2.0):
        with pytest.raises(ValueError, match="defer is R, a fit every 2..16"):
            PackedStateCache(model.config, plan, max_batch=1, defer=defer)
    kda_plan = Plan.load(PLANS / "kda" / "stepquant-6")
    with pytest.raises(ValueError, match=r"the plan was calibrated for 'kda' \(kimi_linear, 6 KDA layers"):
        PackedStateCache(model.config, kda_plan, max_batch=1)
    from transformers import LlamaConfig

    with pytest.raises(ValueError, match="not supported"):
        PackedStateCache(LlamaConfig(num_hidden_layers=2), plan, max_batch=1)


@pytest.mark.parametrize("cache", ["compressed", "packed"])
def test_a_plan_of_another_model_is_refused_naming_its_model(cache):
    # the GDN and KDA models have the same linear-attention layers: the plan's model check tells them apart
    model, _ = load("kda")
    plan = Plan.load(PLANS / "gdn" / "stepquant-6")
    message = (r"the plan was calibrated for 'gdn' \(qwen3_5_text, 6 GDN layers x 8 heads of 128x128\), not "
               r"for .*: model_type 'qwen3_5_text' \(GDN\) in the plan, 'kimi_linear' \(KDA\) in the model")
    with pytest.raises(ValueError, match=message):
        if cache == "compressed":
            CompressedStateCache(model.config, plan)
        else:
            PackedStateCache(model.config, plan, max_batch=1)

"""Production-shape random models, plan-shaped formats, the float-state cache and the capacity search (CPU).

What benchmarks/bench_generate.py runs on the H200 at full size, checked here at the presets' full shapes
where nothing is allocated (configs, parameter counts on the meta device, byte counts) and with tiny widths
where a model must run.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from stepquant.accounting import (
    GIB,
    capacity,
    float_bytes,
    get_preset,
    max_batch,
    plan_bytes,
    stepquant_bytes,
)
from stepquant.accounting.synthetic import synthetic_bits, synthetic_layer_formats
from stepquant.cli import main
from stepquant.codecs.base import PIVOT_BITS
from stepquant.families import GDN, KDA, shape_from_config
from stepquant.models import (
    RANDOM_PRESETS,
    build_random,
    count_random_parameters,
    random_config,
    random_layer_types,
)

PRESETS = sorted(RANDOM_PRESETS)


@pytest.mark.parametrize("preset", PRESETS)
def test_random_config_has_the_presets_state_shape(preset):
    shape, want = shape_from_config(random_config(preset).to_dict()), get_preset(preset)
    assert (shape.family, shape.linear_layers, shape.heads, shape.key_dim, shape.value_dim) == (
        want.family,
        want.linear_layers,
        want.heads,
        want.key_dim,
        want.value_dim,
    )
    assert shape.full_attention_layers == want.full_attention_layers
    if want.conv_state_bytes is not None:  # Qwen3.8-27B: the paper's conv state and KV bytes too
        assert (shape.conv_state_bytes, shape.kv_bytes_per_token) == (
            want.conv_state_bytes,
            want.kv_bytes_per_token,
        )


def test_the_qwen_shape_has_the_papers_weight_bytes():
    assert 2 * count_random_parameters("qwen3.8-27b") == dict(get_preset("qwen3.8-27b").weight_bytes)["bf16"]


def test_fewer_layers_keep_the_mix():
    assert (
        random_layer_types("qwen3.8-27b", 16)
        == ["linear_attention"] * 3 + ["full_attention"] + (["linear_attention"] * 3 + ["full_attention"]) * 3
    )
    kinds = random_layer_types("kimi-linear-48b-a3b")
    assert [i for i, k in enumerate(kinds) if k == "full_attention"] == [3, 7, 11, 15, 19, 23, 26]
    assert random_layer_types("kimi-linear-48b-a3b", 2) == ["linear_attention", "full_attention"]
    with pytest.raises(ValueError, match="unknown preset"):
        random_layer_types("llama")


@pytest.mark.parametrize("preset", PRESETS)
def test_build_random_tiny_runs_and_reports(preset):
    model, info = build_random(preset, 4, device="cpu", tiny=True, seed=3)
    again, _ = build_random(preset, 4, device="cpu", tiny=True, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))
    assert next(model.parameters()).dtype == torch.bfloat16
    assert (info["layers"], info["linear_layers"], info["full_attention_layers"]) == (4, 3, 1)
    assert info["weight_bytes"] == 2 * info["parameters"] and "random weights" in info["note"]
    with torch.inference_mode():
        logits = model(input_ids=torch.randint(3, 500, (2, 5)), logits_to_keep=1).logits
    assert logits.shape == (2, 1, model.config.vocab_size) and torch.isfinite(logits).all()


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("bits", [4, 6])
def test_synthetic_formats_cost_the_nominal_budget(preset, bits):
    shape = get_preset(preset)
    formats = synthetic_layer_formats(shape, bits)
    assert len(formats) == shape.linear_layers
    got, want = plan_bytes(formats, shape), stepquant_bytes(shape, bits)
    assert (got.analytical_bytes, got.serving_bytes) == (want.analytical_bytes, want.serving_bytes)
    pivots = sum(int((f.bits == PIVOT_BITS).sum()) for f in formats) // (
        shape.key_dim if shape.family is GDN else 1
    )
    assert pivots == {"qwen3.8-27b": 32, "kimi-linear-48b-a3b": 512}[preset]
    assert synthetic_layer_formats(shape, bits)[0].bits.equal(formats[0].bits)  # seeded
    assert not formats[0].bits.equal(formats[1].bits)  # a draw per layer


def test_synthetic_bits_units():
    gdn = synthetic_bits(GDN, 6, 8, 16, pivots=1)
    assert (gdn == gdn[:, :1]).all()  # a GDN head has equal rows
    kda = synthetic_bits(KDA, 4, 2, 16, pivots=3)
    assert int((kda == PIVOT_BITS).sum()) == 3 and int(kda[kda != PIVOT_BITS].min()) >= 2


def test_max_batch_is_the_largest_batch_that_fits():
    shape = get_preset("qwen3.8-27b")
    weights = dict(shape.weight_bytes)["bf16"]
    budget = 140 * GIB
    for state in (float_bytes(shape, 32), stepquant_bytes(shape, 6)):
        b = max_batch(shape, state.bytes(), budget, weights, 5, 4096)
        assert capacity(shape, state.bytes(), b, 5, 4096).total_bytes(weights) <= budget
        assert capacity(shape, state.bytes(), b + 1, 5, 4096).total_bytes(weights) > budget
    assert max_batch(shape, 10**12, budget, weights) == 0
    with pytest.raises(ValueError, match="KV bytes per token are unknown"):
        max_batch(get_preset("kimi-linear-48b-a3b"), 10**6, budget, 0, 5, 4096)


def test_memory_cli_budget(capsys):
    assert (
        main(
            ["memory", "--preset", "qwen3.8-27b", "--bits", "6", "--budget-gib", "139.8", "--context", "4096"]
        )
        == 0
    )
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    rows = {r["format"]: r["max_batch"]["bf16"] for r in report["capacity"]["rows"]}
    assert "largest batch in a budget of 139.80 GiB" in out
    assert rows["FP32"] == 92 and rows["STEPQuant@6 (32 pivot heads) serving"] == 222


@pytest.mark.parametrize("preset", PRESETS)
def test_float_state_cache(preset):
    from transformers import DynamicCache

    from stepquant.integrations.float_cache import FloatStateCache

    model, _ = build_random(preset, 4, device="cpu", tiny=True, dtype=torch.float32)
    ids = torch.randint(3, 500, (2, 6), generator=torch.Generator().manual_seed(0))
    logits, caches = (
        {},
        {
            "fp32": DynamicCache(config=model.config),
            "assign": FloatStateCache(model.config, torch.float32, assign=True),
            "bf16": FloatStateCache(model.config),
        },
    )
    with torch.inference_mode():
        for name, cache in caches.items():
            model(input_ids=ids[:, :4], past_key_values=cache, use_cache=True)
            model(input_ids=ids[:, 4:5], past_key_values=cache, use_cache=True)
            logits[name] = model(input_ids=ids[:, 5:], past_key_values=cache, use_cache=True).logits
    layer = caches["bf16"].linear_layers[0]
    assert caches["bf16"].layers[layer].recurrent_states[0].dtype == torch.bfloat16
    assert caches["bf16"].state_bytes() * 2 == caches["assign"].state_bytes()
    assert torch.equal(logits["assign"], logits["fp32"])
    err = (logits["bf16"] - logits["fp32"]).norm() / logits["fp32"].norm()
    assert 0 < err < 1e-2


def _bench():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_generate.py"
    spec = importlib.util.spec_from_file_location("bench_generate", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_generate", module)
    spec.loader.exec_module(module)
    return module


def test_capacity_search_finds_the_largest_fitting_batch():
    bench = _bench()
    assert bench.largest(lambda b: b <= 37, 8) == 37
    assert bench.largest(lambda b: b <= 37, 100) == 37
    assert bench.largest(lambda b: False, 8) == 0


def test_bench_generate_dry_run_capacity_agrees_with_the_model(tmp_path, capsys):
    bench = _bench()
    assert (
        bench.main(
            [
                "--dry-run",
                "--no-decode",
                "--presets",
                "qwen3.8-27b",
                "--capacity-context",
                "0",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    result = json.loads((tmp_path / "bench_generate.json").read_text())
    rows = {r["format"]: r for r in result["capacity"]}
    assert set(rows) == {"fp32", "bf16", "sq6", "sq4"}
    for row in rows.values():
        assert row["measured_max_batch"] == row["analytical_max_batch"] > 0
    assert (
        rows["sq4"]["measured_max_batch"]
        > rows["sq6"]["measured_max_batch"]
        > rows["fp32"]["measured_max_batch"]
    )
    assert (tmp_path / "bench_generate.md").read_text().startswith("# Whole-model decode and capacity")

"""Tests of stepquant.analysis (docs/analysis.md): each mechanism on tiny random models or constructed
inputs, with properties that fail when the measurement is wrong; `stepquant analyze` end to end on a tiny
model."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from stepquant import assets
from stepquant.analysis import mechanisms as mech
from stepquant.analysis.run import compact_json
from stepquant.calibrate import Plan, RecurrenceObserver
from stepquant.calibrate.stats import half_lives_from_log_retention
from stepquant.cli import main
from stepquant.codecs import UniformCodec, make_codec
from stepquant.eval.probe import drift_probe
from stepquant.families import linear_layers
from stepquant.models import checkpoint
from stepquant.recurrence import gated_delta_rule, prepare_qk

TINY_LINEAR = 3  # linear-attention layers of the tiny models (then one full-attention layer)


@pytest.fixture(scope="module", autouse=True)
def single_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model(family: str, seed: int = 0):
    """A random 4-layer model of the shipped model's type (3 linear-attention layers, heads of 16 x 16),
    with the shipped vocabulary so the shipped tokenizer and text work with it."""
    name = {"gdn": "gdn", "kda": "kda"}[family]
    fields = json.loads((assets.MODELS / name / "config.json").read_text())
    fields.update(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=TINY_LINEAR + 1,
        num_attention_heads=2,
        layer_types=["linear_attention"] * TINY_LINEAR + ["full_attention"],
        dtype="float32",
    )
    if family == "gdn":
        fields.update(
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            head_dim=16,
            num_key_value_heads=1,
        )
    else:
        fields.update(
            linear_head_dim=16,
            linear_num_heads=2,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            qk_head_dim=16,
            v_head_dim=8,
            head_dim=8,
            num_key_value_heads=2,
            mlp_layer_types=["dense"] * (TINY_LINEAR + 1),
        )
    model_type = fields.pop("model_type")
    for key in ("architectures", "transformers_version"):
        fields.pop(key)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields)).eval()


def mixers(model):
    return [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "dt_bias")]


def plant_long_lived_unit(model, family: str, layer: int, head: int, row: int = 0) -> None:
    """Make one unit (a GDN head / a KDA key row) of linear layer ``layer`` nearly never forget (g ~ 0)."""
    with torch.no_grad():
        if family == "gdn":
            mixers(model)[layer].A_log[head] = -14.0  # g = -exp(A_log) softplus(...) ~ -1e-6
        else:
            gate = [m for m in model.modules() if type(m).__name__.endswith("ForgetGate")][layer]
            gate.dt_bias[head * gate.head_dim + row] = -40.0  # softplus(-40 + f) ~ 0


def captures_of(model, tokens: torch.Tensor) -> list:
    captures = []
    with RecurrenceObserver(model, captures.append, keep_output=False), torch.inference_mode():
        model(input_ids=tokens, use_cache=False)
    return captures


def random_tokens(streams: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 8192, (streams, length), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- ranks


def test_average_ranks_and_spearman():
    assert mech.average_ranks(torch.tensor([3.0, 1.0, 2.0, 2.0])).tolist() == [4.0, 1.0, 2.5, 2.5]
    x = torch.tensor([1.0, 5.0, 2.0, 8.0, 3.0])
    assert mech.spearman(x, x.exp()) == pytest.approx(1.0)
    assert mech.spearman(x, -x) == pytest.approx(-1.0)
    # one swapped pair in five: 1 - 6 * 2 / (5 * 24) = 0.9
    assert mech.spearman(torch.arange(5.0), torch.tensor([0.0, 2.0, 1.0, 3.0, 4.0])) == pytest.approx(0.9)
    assert math.isnan(mech.spearman(x, torch.ones(5)))
    assert mech.percentile_ranks(torch.tensor([10.0, 30.0, 20.0, 40.0])).tolist() == [25.0, 75.0, 50.0, 100.0]


# ---------------------------------------------------------------- 1. lifetime predicts error


@pytest.mark.parametrize("family", ["gdn", "kda"])
def test_a_planted_long_lived_unit_has_the_longest_half_life_and_the_largest_error(family):
    model = tiny_model(family)
    plant_long_lived_unit(model, family, layer=1, head=1, row=5)
    captures = captures_of(model, random_tokens(2, 160))
    half_lives = half_lives_from_log_retention(torch.stack([c.g.mean(dim=(0, 1)) for c in captures]))
    errors = torch.stack([mech.unit_state_error(c, UniformCodec(bits=6)).mean(0) for c in captures])
    planted = (1, 1) if family == "gdn" else (1, 1, 5)
    flat = int(torch.arange(half_lives.numel()).reshape(half_lives.shape)[planted])
    assert int(half_lives.reshape(-1).argmax()) == flat and int(errors.reshape(-1).argmax()) == flat
    result = mech.lifetime_error(half_lives, errors)
    assert result["units"] == half_lives.numel() and result["spearman"] > 0
    # the exact codec leaves no error at all
    assert float(mech.unit_state_error(captures[0], make_codec("fp32")).abs().max()) == 0.0


# ---------------------------------------------------------------- 2. native feedback vs the oracle


@pytest.mark.parametrize("family", ["gdn", "kda"])
def test_feedback_is_identical_without_the_delta_correction_and_smaller_with_it(family):
    capture = captures_of(tiny_model(family), random_tokens(2, 200))[0]
    errors = mech.feedback_errors(capture, UniformCodec(bits=4), inject_at=64)
    assert all(e.shape == (2, 200 - 64) for e in errors.values())
    assert float(errors["native"][:, 0].min()) > 0  # the injected error reaches the first readout
    if family == "gdn":  # the native state error is the oracle's times contractions, at every step
        assert bool((errors["native_state"] <= errors["oracle_state"] * (1 + 1e-5)).all())
        summary = mech.feedback_summary(errors["native_state"], errors["oracle_state"])
        assert summary["ratio"] > 1 and summary["above_one_on_every_trajectory"]
    # beta = 0 after the injection: no delta correction, so the oracle's exact read changes nothing
    beta = capture.beta.clone()
    beta[:, 64:] = 0
    frozen = dataclasses.replace(capture, beta=beta)
    errors = mech.feedback_errors(frozen, UniformCodec(bits=4), inject_at=64)
    assert torch.equal(errors["native"], errors["oracle"]) and float(errors["native"].sum()) > 0
    assert torch.equal(errors["native_state"], errors["oracle_state"])
    # an exact store injects nothing
    exact = mech.feedback_errors(capture, make_codec("fp32"), inject_at=64)
    assert float(exact["native"].max()) == 0 and float(exact["oracle"].max()) == 0


# ---------------------------------------------------------------- 3a. row-impact identity


@pytest.mark.parametrize("family", ["gdn", "kda"])
def test_row_impact_identity_holds_by_direct_propagation(family):
    capture = captures_of(tiny_model(family), random_tokens(2, 40))[2]
    direct, predicted = mech.row_impact_identity(capture, [5, 20, 39], rows_per_call=5)
    assert direct.shape == predicted.shape == (3, 2, capture.v.shape[2], capture.q.shape[3])
    assert mech.identity_errors(direct, predicted)["max_relative_error"] < 1e-9
    fp32 = mech.identity_errors(*mech.row_impact_identity(capture, [20], dtype=torch.float32))
    assert fp32["max_relative_error"] < 1e-4
    # the check has teeth: the gate-only read weight (D_t q_t)_i^2, without the delta term, fails it
    b_q, _ = prepare_qk(capture.q[:, 20].double(), capture.k[:, 20].double(), use_qk_l2norm=True, mode=family)
    gate = capture.g[:, 20].double().exp()
    gate = gate[..., None] if family == "gdn" else gate
    gate_only = (b_q.repeat_interleave(capture.v.shape[2] // b_q.shape[1], dim=1) * gate).pow(2)
    assert mech.identity_errors(direct[1:2], gate_only[None])["max_relative_error"] > 1e-2


def test_omega_spread_of_a_constructed_omega():
    omega = torch.arange(1.0, 12.0).repeat(2, 3, 1)  # every head: 1..11, P10 = 2, P90 = 10
    assert mech.omega_spread(omega) == {"median": 5.0, "p10": 5.0, "p90": 5.0, "heads": 6}
    # KDA rows: omega falling with half-life in every head; GDN rows share their head's half-life
    tau = torch.arange(11.0, 0.0, -1.0).repeat(2, 3, 1)
    assert mech.omega_vs_half_life(omega, tau) == {
        "spearman": pytest.approx(-1.0),
        "median_within_head": -1.0,
    }
    assert mech.omega_vs_half_life(omega, tau[..., 0]) is None


# ---------------------------------------------------------------- 3b. row-impact groups and perplexity


def test_row_impact_groups_and_the_row_group_codec():
    omega = torch.rand(2, 3, 16, generator=torch.Generator().manual_seed(0))
    groups = mech.row_impact_groups(omega, 8)
    for head_omega, head_groups in zip(omega.reshape(-1, 16), groups.reshape(-1, 16), strict=True):
        assert torch.bincount(head_groups, minlength=8).tolist() == [2] * 8
        assert torch.equal(head_groups[torch.argsort(head_omega)], torch.arange(8).repeat_interleave(2))
    rows = groups[0] == 7
    codec = mech.RowGroupCodec(rows, bits=4)
    states = torch.randn(2, 3, 16, 5, generator=torch.Generator().manual_seed(1))
    stored = codec.roundtrip(states)
    mask = rows[None, :, :, None].expand_as(states)
    assert torch.equal(stored[~mask], states[~mask])
    assert torch.equal(stored[mask], UniformCodec(bits=4).roundtrip(states)[mask])
    assert codec.storage_bits(3, 16, 5) == 6 * (4 * 5 + 16) + 42 * 32 * 5


def test_row_impact_perplexity_with_one_group_is_int4_everywhere():
    model = tiny_model("gdn")
    tokens = random_tokens(2, 30)
    omega = torch.rand(TINY_LINEAR, 4, 16, generator=torch.Generator().manual_seed(0))
    result = mech.row_impact_perplexity(model, tokens, omega, prefill_len=8, groups=1)
    layers = linear_layers(model.config)
    probe = drift_probe(
        model,
        tokens,
        [dict.fromkeys(layers, make_codec("fp32")), dict.fromkeys(layers, make_codec("int4"))],
        prefill_len=8,
    )
    ppl = probe.decode_nll.double().mean(dim=(1, 2)).exp()
    assert result["fp32_ppl"] == float(ppl[0]) and result["group_ppl"] == [float(ppl[1])]
    assert result["decode_predictions"] == 21 and result["streams"] == 2


# ---------------------------------------------------------------- 4. state geometry


def test_outlier_contrasts_of_planted_outliers():
    rows = torch.tensor([1.0, 2.0, 3.0, 4.0])[:, None].expand(4, 6)  # row RMS 1..4, all columns equal
    row_contrast, col_contrast = mech.outlier_contrasts(rows[None])
    assert row_contrast.tolist() == [pytest.approx(4 / 2.5)] and col_contrast.tolist() == [pytest.approx(1.0)]
    spike = torch.ones(5, 5)
    spike[2, 3] = 11.0  # row 2 RMS = col 3 RMS = sqrt((4 + 121) / 5) = 5
    row_contrast, col_contrast = mech.outlier_contrasts(spike)
    assert float(row_contrast) == pytest.approx(5.0) and float(col_contrast) == pytest.approx(5.0)
    summary = mech.geometry_summary(
        torch.tensor([5.0, 4.0, 2.0, math.nan]), torch.tensor([5.0, 1.0, 4.0, 1.0])
    )
    assert summary["snapshots"] == 3 and summary["share_both_above_3x"] == pytest.approx(1 / 3)
    assert summary["median_row_contrast"] == 4.0 and summary["skipped_zero_states"] == 1


def test_states_at_equals_one_uninterrupted_run():
    capture = captures_of(tiny_model("kda"), random_tokens(2, 30))[0]
    states = mech.states_at(capture, [3, 17, 30])
    for n, p in enumerate([3, 17, 30]):
        _, expected = gated_delta_rule(
            capture.q[:, :p],
            capture.k[:, :p],
            capture.v[:, :p],
            capture.g[:, :p],
            capture.beta[:, :p],
            use_qk_l2norm=True,
        )
        torch.testing.assert_close(states[:, n], expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="increasing"):
        mech.states_at(capture, [17, 3])


# ---------------------------------------------------------------- 5. lifetime ranks


def test_lifetime_classes_and_rank_stability():
    tau = torch.tensor([[1.0, 8.0, 2.0, 7.0, 3.0, 6.0, 4.0, 5.0], [10.0, 20, 30, 40, 50, 60, 70, 80]])
    classes = mech.lifetime_classes(tau)
    assert classes.tolist() == [[0, 2, 0, 2, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 2, 2]]
    assert mech.lifetime_rank_stability(tau, tau * 3) == {
        "spearman": 1.0,
        "class_retention": 1.0,
        "units": 16,
    }
    swapped = tau.clone()
    swapped[1, 5], swapped[1, 6] = 75.0, 55.0  # two units cross the middle / long boundary of layer 1
    result = mech.lifetime_rank_stability(tau, swapped)
    assert result["class_retention"] == 14 / 16 and result["spearman"] < 1


# ---------------------------------------------------------------- 6. where the bits went


def test_bit_allocation_of_the_shipped_plans():
    plans = {
        v: Plan.load(assets.PLANS / "gdn" / f"{v}-6") for v in ("stepquant", "spatial", "temporal-nopivot")
    }
    spatial = mech.bit_allocation(plans["spatial"])["lifetime_weighted_distortion"]
    assert spatial["ratio_vs_uniform_all"] == 1.0  # uniform bits are the uniform allocation
    nopivot = mech.bit_allocation(plans["temporal-nopivot"])
    assert (
        nopivot["lifetime_weighted_distortion"]["ratio_vs_uniform_all"] <= 1
    )  # the optimum beats a feasible point
    step = mech.bit_allocation(plans["stepquant"])
    summary = plans["stepquant"].summary["lifetime_weighted_distortion"]
    assert step["lifetime_weighted_distortion"]["plan"] == pytest.approx(summary["plan"], rel=1e-6)
    assert step["lifetime_weighted_distortion"]["uniform_integer"] == pytest.approx(
        summary["uniform_6_bits"], rel=1e-6
    )
    assert sum(layer["pivots"] for layer in step["layers"]) == plans["stepquant"].pivots
    assert step["spearman_bits_vs_half_life"] > 0.5


# ---------------------------------------------------------------- the command


@pytest.mark.parametrize("family", ["gdn", "kda"])
def test_analyze_command_end_to_end_on_a_tiny_model(tmp_path, capsys, family):
    model = tiny_model(family)
    plant_long_lived_unit(model, family, layer=0, head=0)
    model.save_pretrained(tmp_path / "model")
    AutoTokenizer.from_pretrained(checkpoint(family), local_files_only=True).save_pretrained(
        tmp_path / "model"
    )
    assert (
        main(
            [
                "calibrate",
                "--model",
                str(tmp_path / "model"),
                "--segments",
                "2",
                "--segment-length",
                "128",
                "--snapshot-every",
                "64",
                "--bits",
                "4",
                "--out",
                str(tmp_path / "plans"),
                "--json",
                "--no-progress",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    out = tmp_path / "analysis"
    assert (
        main(
            [
                "analyze",
                "--model",
                str(tmp_path / "model"),
                "--plan",
                str(tmp_path / "plans" / "stepquant-4"),
                "--data",
                "wiki,sotu",
                "--segment-length",
                "160",
                "--inject-at",
                "64",
                "--identity-positions",
                "2",
                "--rank-segments",
                "1",
                "--ppl-tokens",
                "24",
                "--ppl-prefill",
                "8",
                "--groups",
                "2",
                "--out",
                str(out),
                "--json",
                "--no-progress",
            ]
        )
        == 0
    )
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    text = (out / "analysis.json").read_text()
    record = json.loads(text)
    assert json.loads(compact_json(record)) == record and len(text) < len(json.dumps(record, indent=1))
    assert sorted(line["figures"]) == sorted(record["figures"].values()) and len(line["figures"]) == 6
    assert all((out / name).stat().st_size > 1000 for name in line["figures"])
    ours = record["ours"]
    assert set(ours) == {
        "lifetime_error",
        "feedback",
        "row_identity",
        "omega_spread",
        "omega_vs_half_life",
        "row_ppl",
        "geometry",
        "lifetime_ranks",
        "bits",
    }
    assert ours["row_identity"]["float64"]["max_relative_error"] < 1e-9
    assert ours["feedback"]["trajectories"] == ["wiki:0", "sotu:0"]
    assert len(ours["row_ppl"]["delta_ppl"]) == 2 and ours["geometry"]["snapshots"] > 0
    # the planted unit is the longest-lived on the calibration text and on both other texts
    calibration_tau = torch.tensor(ours["lifetime_ranks"]["calibration_half_lives"])
    assert calibration_tau.reshape(-1).argmax() == 0
    assert all(
        torch.tensor(ours["lifetime_ranks"]["half_lives"][s]).reshape(-1).argmax() == 0
        for s in ("wiki", "sotu")
    )
    assert torch.tensor(ours["lifetime_error"]["error"]).reshape(-1).argmax() == 0
    assert record["paper"]["lifetime_error"][family]["spearman"] in (0.8004, 0.8017)

"""Tests of quantization plans (stepquant/calibrate/plan.py) and `stepquant calibrate`: round trip, the API
the cache uses (codec, bits_per_value), validation against model configs, refusal of truncated or edited
files, the CLI end to end on a shipped model, and the plans committed under plans/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_calibrate import single_torch_thread, synthetic_stats  # noqa: F401 (an autouse fixture)

from stepquant.accounting import plan_bytes
from stepquant.calibrate import Plan, allocate, build_plan
from stepquant.calibrate.plan import PLAN_ARRAYS, PLAN_JSON, PLAN_PLOT
from stepquant.cli import main
from stepquant.codecs import MixedCodec

REPO = Path(__file__).resolve().parent.parent
SHIPPED_GDN = dict(family="gdn", layers=(0, 1, 2, 4, 5, 6), heads=8, key_dim=128, value_dim=128)
SHIPPED_KDA = dict(family="kda", layers=(0, 1, 2, 4, 5, 6), heads=4, key_dim=128, value_dim=128)


@pytest.fixture(scope="module")
def saved_plans(tmp_path_factory):
    """stepquant@6 and temporal@4 plans shaped like the shipped GDN and KDA models, saved once."""
    root = tmp_path_factory.mktemp("plans")
    plans = {}
    for shape in (SHIPPED_GDN, SHIPPED_KDA):
        stats = synthetic_stats(**shape, seed=1)
        for variant, bits in (("stepquant", 6), ("temporal", 4)):
            plan = build_plan(stats, allocate(stats, variant, bits), command="pytest")
            plans[(shape["family"], variant)] = plan.save(root / f"{shape['family']}-{variant}-{bits}")
    return plans


@pytest.mark.parametrize("family", ["gdn", "kda"])
@pytest.mark.parametrize("variant", ["stepquant", "temporal"])
def test_plan_round_trip_and_api(saved_plans, family, variant):
    directory = saved_plans[(family, variant)]
    plan = Plan.load(directory, model_config=family)  # the shipped model's config.json
    again = Plan.load(directory / PLAN_JSON)
    assert all(torch.equal(a, b) for a, b in zip(plan.bits, again.bits, strict=True))
    assert plan.family == family and plan.linear_layers == (0, 1, 2, 4, 5, 6) and plan.variant == variant
    assert all(b.dtype == torch.int8 and b.shape == (plan.num_heads, 128) for b in plan.bits)
    assert all(w.dtype == torch.float32 and w.shape == (plan.num_heads, 128) for w in plan.w)
    codec = plan.codec(2)
    assert isinstance(codec, MixedCodec) and torch.equal(codec.bits, plan.bits[2])
    assert codec.spatial == ("dual_axis" if variant == "stepquant" else "absmax")
    if variant == "stepquant":
        assert torch.equal(codec.w, plan.w[2])
    # bits/value: the packed layout of the plan; the codecs' own storage count agrees
    served = plan_bytes(list(plan.bits), plan.shape, has_col_scale=variant == "stepquant")
    assert plan.bits_per_value(serving=True) == served.bits_per_value(serving=True)
    codec_bits = sum(plan.codec(i).storage_bits(plan.num_heads, 128, 128) for i in range(6))
    assert codec_bits == served.serving_bytes * 8
    document = json.loads((directory / PLAN_JSON).read_text())
    assert document["accounting"]["slack_bits"] == plan.accounting()["slack_bits"] >= 0
    assert plan.layer_number(4) == 3
    if family == "kda":  # one string of K row widths per head
        assert all(len(row) == 128 for row in document["bits"]["0"])


def test_plan_codec_quantizes_a_state(saved_plans):
    plan = Plan.load(saved_plans[("kda", "stepquant")])
    states = torch.randn(2, plan.num_heads, 128, 128)
    approx = plan.codec(0).roundtrip(states)
    assert approx.shape == states.shape and (approx - states).pow(2).mean() < 1e-2 * states.pow(2).mean()
    pivot_rows = plan.bits[0] == 16
    assert torch.equal(approx[:, pivot_rows], states[:, pivot_rows].half().float())


def _config(name: str, **changes) -> dict:
    config = json.loads((REPO / "models" / name / "config.json").read_text())
    config.update(changes)
    return config


@pytest.mark.parametrize(
    "config, message",
    [(lambda: "kda", r"plan is for model_type 'qwen3_5_text' \(GDN\) but the model is 'kimi_linear' \(KDA\)"),
     (lambda: _config("gdn", linear_num_value_heads=16), "heads per layer 8 in the plan, 16 in the model"),
     (lambda: _config("gdn", linear_key_head_dim=64), "key dim K 128 in the plan, 64 in the model"),
     (lambda: _config("gdn", layer_types=["linear_attention"] * 6 + ["full_attention"] * 2),
      r"linear-attention layers \[0, 1, 2, 4, 5, 6\] in the plan, \[0, 1, 2, 3, 4, 5\] in the model"),
     (lambda: _config("gdn", model_type="llama"), "unsupported model_type 'llama'")],
    ids=["other-family", "more-heads", "other-key-dim", "other-layers", "unsupported-type"],
)
def test_plan_refuses_another_model(saved_plans, config, message):
    with pytest.raises(ValueError, match=message):
        Plan.load(saved_plans[("gdn", "stepquant")], model_config=config())


def test_plan_accepts_the_wrapper_model_type(saved_plans):
    wrapped = {"model_type": "qwen3_5", "text_config": _config("gdn")}
    Plan.load(saved_plans[("gdn", "stepquant")], model_config=wrapped)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def _edit_json(change):
    def edit(path: Path) -> None:
        document = json.loads(path.read_text())
        change(document)
        path.write_text(json.dumps(document, indent=1))

    return edit


def _raise_a_head(document: dict) -> None:
    document["bits"]["0"][0] = document["bits"]["0"][0] + 1


@pytest.mark.parametrize(
    "file_name, damage, message",
    [(PLAN_ARRAYS, _truncate, "plan.safetensors changed since calibration"),
     (PLAN_ARRAYS, _flip_last_byte, "plan.safetensors changed since calibration"),
     (PLAN_JSON, _truncate, "plan.json is truncated or not valid JSON"),
     (PLAN_JSON, _edit_json(_raise_a_head), "the bits in .*plan.json were edited"),
     (PLAN_JSON, _edit_json(lambda d: d.update(variant="spatial")), "plan.json was edited since calibration"),
     (PLAN_JSON, _edit_json(lambda d: d.pop("integrity")), "has no integrity block")],
    ids=["arrays-truncated", "arrays-byte-flipped", "json-truncated", "json-bits-edited",
         "json-variant-edited", "json-integrity-removed"],
)
def test_plan_refuses_damaged_files(saved_plans, tmp_path, file_name, damage, message):
    source = saved_plans[("gdn", "stepquant")]
    for name in (PLAN_JSON, PLAN_ARRAYS):
        (tmp_path / name).write_bytes((source / name).read_bytes())
    damage(tmp_path / file_name)
    with pytest.raises(ValueError, match=message) as info:
        Plan.load(tmp_path)
    assert "recalibrate" in str(info.value)


def test_memory_cli_reads_a_plan(saved_plans, capsys):
    rc = main(["memory", "--config", str(REPO / "models" / "gdn"), "--bits", "6", "--plan",
               str(saved_plans[("gdn", "stepquant")]), "--json"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and report["formats"][-1]["format"].startswith("plan ")


def test_calibrate_cli_end_to_end(tmp_path, capsys):
    out = tmp_path / "gdn"
    argv = ["calibrate", "--model", "gdn", "--bits", "4,6", "--variant", "stepquant,spatial", "--segments",
            "2", "--segment-length", "64", "--snapshot-every", "32", "--batch-size", "2", "--out", str(out),
            "--no-progress"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    result = json.loads(printed.strip().splitlines()[-1])
    assert "stepquant @ 6 bits" in printed and "histogram" in printed and "longest-lived" in printed
    assert [(p["variant"], p["bits"]) for p in result["plans"]] == [("stepquant", 4), ("stepquant", 6),
                                                                   ("spatial", 4), ("spatial", 6)]
    assert (out / "stats.safetensors").is_file()
    for record in result["plans"]:
        directory = Path(record["plan"])
        assert (directory / PLAN_PLOT).stat().st_size > 1000
        plan = Plan.load(directory, model_config="gdn")
        assert record["slack_bits"] == plan.accounting()["slack_bits"] >= 0
        assert plan.calibration["num_segments"] == 2 and plan.calibration["segment_length"] == 64
        command = plan.calibration["command"]
        assert command.startswith("stepquant calibrate --model gdn --segments 2 --segment-length 64")
    # reuse the statistics: no model run, the same plan, other budgets and variants on top
    again = tmp_path / "again"
    assert main(["calibrate", "--stats", str(out), "--bits", "6", "--variant", "stepquant,temporal", "--out",
                 str(again), "--json"]) == 0
    first, second = Plan.load(out / "stepquant-6"), Plan.load(again / "stepquant-6")
    assert all(torch.equal(a, b) for a, b in zip(first.bits, second.bits, strict=True))
    assert (again / "temporal-6" / PLAN_JSON).is_file()
    capsys.readouterr()
    assert main(["calibrate", "--stats", str(out), "--exponent", "0.5", "--out", str(again)]) == 2
    assert "--exponent 0.5 differs from the statistics" in capsys.readouterr().err


COMMITTED = sorted(p.parent for p in (REPO / "plans").glob("*/*/plan.json"))


@pytest.mark.parametrize("directory", COMMITTED, ids=[f"{p.parent.name}/{p.name}" for p in COMMITTED])
def test_committed_plans_load_and_meet_their_budget(directory):
    plan = Plan.load(directory, model_config=directory.parent.name)  # plans/<shipped model>/<variant>-<bits>
    accounting = plan.accounting()
    assert plan.variant + f"-{plan.budget_bits}" == directory.name
    assert accounting["within_budget"] and accounting["slack_bits"] >= 0
    assert accounting["serving_bytes"] <= accounting["nominal_serving_bytes"]


@pytest.mark.parametrize(
    "argv, message",
    [(("--model", "gdn", "--bits", "9"), "bits (the budget b̄) must be an int in 2..8, got 9"),
     (("--model", "gdn", "--horizon", "0"), "horizon must be a positive int"),
     (("--model", "gdn", "--candidates", "1,3"), "candidate bit widths must be ints in 2..8"),
     (("--model", "gdn", "--variant", "uniform"), "--variant must be 'all' or a comma list"),
     (("--bits", "6",), "give --model PATH_OR_SHIPPED_NAME (or --stats DIR"),
     (("--model", "nowhere"), "no model at nowhere")],
    ids=["bits-9", "horizon-0", "candidate-1-bit", "unknown-variant", "no-model", "missing-model"],
)
def test_calibrate_cli_refuses_bad_arguments_before_running(capsys, tmp_path, argv, message):
    assert main(["calibrate", "--out", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err


def test_plan_pins_its_quantizer(saved_plans, tmp_path, capsys):
    from stepquant.calibrate.plan import V1_QUANTIZER
    from stepquant.codecs import Grid
    from stepquant.codecs.dual_axis import DualAxisConfig
    from stepquant.pool import plans_from

    # committed plans predate the quantizer block: they load with the defaults they were calibrated with
    shipped = Plan.load(REPO / "plans" / "kda" / "stepquant-4")
    assert "quantizer" not in json.loads((REPO / "plans/kda/stepquant-4" / PLAN_JSON).read_text())
    assert shipped.quantizer == V1_QUANTIZER and shipped.codec(0).config == V1_QUANTIZER
    # a new plan records its quantizer, and its codecs and pool layers run it
    stats = synthetic_stats(**SHIPPED_KDA, seed=2)
    midtread = DualAxisConfig(grid=Grid.MIDTREAD, refit_iters=1)
    plan = build_plan(stats, allocate(stats, "stepquant", 4), command="pytest", quantizer=midtread)
    loaded = Plan.load(plan.save(tmp_path / "midtread"))
    assert json.loads((tmp_path / "midtread" / PLAN_JSON).read_text())["quantizer"]["grid"] == "midtread"
    assert loaded.quantizer == midtread and loaded.codec(3).config == midtread
    assert all(layer.config == midtread and layer.spatial == "dual_axis" for layer in plans_from(loaded))
    temporal = Plan.load(saved_plans[("kda", "temporal")])
    assert all(layer.spatial == "absmax" for layer in plans_from(temporal))  # the plan's own format
    states = torch.randn(1, plan.num_heads, 128, 128)
    assert loaded.codec(0).encode(states).grid is Grid.MIDTREAD
    # the CLI option, recorded in the plan and in its command
    out = tmp_path / "cli"
    stats.save(out)
    assert main(["calibrate", "--stats", str(out), "--bits", "4", "--variant", "stepquant",
                 "--grid", "midtread", "--out", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    made = Plan.load(out / "stepquant-4")
    assert made.quantizer.grid is Grid.MIDTREAD and "--grid midtread" in made.calibration["command"]

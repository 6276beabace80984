"""Tests of quantization plans (stepquant/calibrate/plan.py) and `stepquant calibrate`: round trip, the API
the cache uses (codec, bits_per_value), validation against model configs, refusal of truncated or edited
files, the CLI end to end on a shipped model, and the plans shipped under stepquant/assets/plans/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_calibrate import single_torch_thread, synthetic_stats  # noqa: F401 (an autouse fixture)

from stepquant import assets
from stepquant.accounting import plan_bytes
from stepquant.calibrate import Plan, allocate, build_plan
from stepquant.calibrate.plan import PLAN_ARRAYS, PLAN_JSON, PLAN_PLOT
from stepquant.cli import main
from stepquant.codecs import DualAxisConfig, MixedCodec

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
    config = json.loads((assets.MODELS / name / "config.json").read_text())
    config.update(changes)
    return config


@pytest.mark.parametrize(
    "config, message",
    [(lambda: "kda", r"the plan was calibrated for 'synthetic' \(qwen3_5_text, 6 GDN layers x 8 heads "
                     r"of 128x128\), not for 'kda': model_type 'qwen3_5_text' \(GDN\) in the plan, "
                     r"'kimi_linear' \(KDA\) in the model; give a plan calibrated for this model"),
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
    rc = main(["memory", "--config", str(assets.MODELS / "gdn"), "--bits", "6", "--plan",
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


COMMITTED = sorted(p.parent for p in assets.PLANS.glob("*/*/plan.json"))


@pytest.mark.parametrize("directory", COMMITTED, ids=[f"{p.parent.name}/{p.name}" for p in COMMITTED])
def test_committed_plans_load_and_meet_their_budget(directory):
    plan = Plan.load(directory, model_config=directory.parent.name)  # <shipped model>/<variant>-<bits>
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


def as_version_1(directory: Path, target: Path) -> Path:
    """A copy of a plan directory as a version-1 plan without a quantizer block (the committed plans
    before studies/migrate_plans.py), its integrity block recomputed as the version-1 writer did."""
    import hashlib
    import shutil

    shutil.copytree(directory, target)
    document = json.loads((target / PLAN_JSON).read_text())
    document.pop("quantizer")
    document.pop("integrity")
    document["format_version"] = 1
    canonical = lambda obj: json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    digest = lambda obj: hashlib.sha256(canonical(obj)).hexdigest()
    document["integrity"] = {
        f"{PLAN_ARRAYS}_sha256": hashlib.sha256((target / PLAN_ARRAYS).read_bytes()).hexdigest(),
        "bits_sha256": digest(document["bits"]), "plan_sha256": digest(document)}
    (target / PLAN_JSON).write_text(json.dumps(document, indent=1))
    return target


def test_version_1_plans_load_with_the_v1_quantizer_and_migrate_to_the_same_codecs(tmp_path):
    from stepquant.calibrate.quantizer import V1_QUANTIZER
    from studies.migrate_plans import migrate

    shipped = assets.PLANS / "kda" / "spatial-4"  # a plan still on the quantizer it was calibrated with
    assert json.loads((shipped / PLAN_JSON).read_text())["format_version"] == 2  # migrated
    old = as_version_1(shipped, tmp_path / "v1")
    v1 = Plan.load(old)
    assert v1.quantizer == V1_QUANTIZER and v1.codec(0).config == V1_QUANTIZER
    arrays = (old / PLAN_ARRAYS).read_bytes()
    assert migrate(old) == "migrated" and migrate(old) == "already version 2"
    assert (old / PLAN_ARRAYS).read_bytes() == arrays  # the arrays are not rewritten
    assert (old / PLAN_JSON).read_text() == (shipped / PLAN_JSON).read_text()  # what the committed one is
    migrated = Plan.load(old)
    gen = torch.Generator().manual_seed(0)
    states = torch.randn(2, v1.num_heads, v1.key_dim, v1.value_dim, generator=gen)
    for i in range(len(v1.linear_layers)):
        assert torch.equal(migrated.codec(i).roundtrip(states), v1.codec(i).roundtrip(states))


@pytest.mark.parametrize("model", ["gdn", "kda"])
def test_requantize_plans_gives_a_plan_another_quantizer_and_nothing_else(tmp_path, model):
    import shutil

    from stepquant.calibrate.quantizer import V1_QUANTIZER
    from studies.quantizer_check import calibrated
    from studies.requantize_plans import requantize

    # studies/requantize_plans.py (issue 12; the shipped STEPQuant@6 plans ran this way until the row fill):
    # the quantizer block is replaced, the bits, w, bytes and arrays stay, the calibration block records it
    name = "spatial-6"  # a shipped plan on the quantizer it was calibrated with (exact/2)
    directory = tmp_path / name
    shutil.copytree(assets.PLANS / model / name, directory)
    original = Plan.load(directory, model_config=model)
    assert original.quantizer == V1_QUANTIZER
    assert requantize(directory, "reciprocal", 0) == "requantized"
    assert requantize(directory, "reciprocal", 0) == "already reciprocal/0"
    again = Plan.load(directory, model_config=model)
    assert (again.quantizer.division, again.quantizer.refit_iters) == ("reciprocal", 0)
    assert again.codec(0).config == again.quantizer
    assert again.accounting() == original.accounting()  # the quantizer moves no byte
    pairs = zip(again.bits + again.w, original.bits + original.w, strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    assert (directory / PLAN_ARRAYS).read_bytes() == (assets.PLANS / model / name / PLAN_ARRAYS).read_bytes()
    back = calibrated(again)  # the plan as calibrated
    assert back.quantizer == V1_QUANTIZER and "requantized" not in back.calibration
    # a damaged copy names both commands
    _truncate(directory / PLAN_ARRAYS)
    with pytest.raises(ValueError, match=rf"--out NEW_DIR .*, then: python -m studies.requantize_plans "
                                         rf"--division reciprocal --refit-iters 0 NEW_DIR/{name}"):
        Plan.load(directory)


SHIPPED_QUANTIZERS = {  # budget: (grid, refits, the calibrate options); all reciprocal with the row fill
    6: ("midrise", 0, ["--division", "reciprocal", "--refit-iters", "0", "--row-fill"]),
    4: ("midtread", 1, ["--grid", "midtread", "--division", "reciprocal", "--refit-iters", "1",
                        "--row-fill"]),
}


@pytest.mark.parametrize("bits", [6, 4])
@pytest.mark.parametrize("model", ["gdn", "kda"])
def test_shipped_stepquant_plans_are_their_row_fill_calibration(tmp_path, capsys, model, bits):
    # issue 14: the STEPQuant plans are calibrated under the quantizer they run (the row fill, docs/eval.md
    # section 11: d_u(b) measured with it); the statistics ship beside them and emit them again
    from safetensors.torch import load_file

    from stepquant.calibrate.quantizer import quantizer_from_json

    grid, refits, options = SHIPPED_QUANTIZERS[bits]
    directory = assets.PLANS / model / f"stepquant-{bits}"
    shipped = Plan.load(directory, model_config=model)
    q = shipped.quantizer
    assert (q.grid.value, q.row_stat, q.division, q.refit_iters, q.row_fill) == (grid, "rms", "reciprocal",
                                                                                 refits, True)
    assert "requantized" not in shipped.calibration
    assert quantizer_from_json(shipped.calibration["quantizer"]) == q
    stats = assets.PLANS / model / f"stats-rowfill-{bits}"
    assert main(["calibrate", "--stats", str(stats), "--bits", str(bits), *options, "--out", str(tmp_path),
                 "--json"]) == 0
    capsys.readouterr()
    made, committed = (json.loads((d / PLAN_JSON).read_text())["integrity"]
                       for d in (tmp_path / f"stepquant-{bits}", directory))
    assert made["bits_sha256"] == committed["bits_sha256"]
    # the same arrays (the files' bytes can differ: safetensors writes its metadata in hash order)
    made, committed = (load_file(d / PLAN_ARRAYS) for d in (tmp_path / f"stepquant-{bits}", directory))
    assert made.keys() == committed.keys() and all(torch.equal(made[k], committed[k]) for k in made)


def test_the_row_fill_is_written_only_where_it_is_on():
    # a quantizer block without "row_fill" (every plan written before it) loads without the fill; a block
    # with it reads back, so plans made before keep their bytes when rewritten
    from stepquant.calibrate.quantizer import quantizer_from_json, quantizer_to_json

    plain = DualAxisConfig(division="reciprocal", refit_iters=0)
    filled = DualAxisConfig(division="reciprocal", refit_iters=0, row_fill=True)
    assert "row_fill" not in quantizer_to_json(plain)
    assert quantizer_to_json(filled)["row_fill"] is True
    assert quantizer_from_json(quantizer_to_json(filled)) == filled
    assert quantizer_from_json(quantizer_to_json(plain)) == plain
    with pytest.raises(ValueError, match="invalid quantizer block.*row_fill=True needs division"):
        quantizer_from_json(quantizer_to_json(plain) | {"division": "exact", "row_fill": True})


def test_a_version_2_plan_must_have_its_quantizer_block(tmp_path):
    import shutil

    shutil.copytree(assets.PLANS / "gdn" / "stepquant-6", tmp_path / "plan")
    document = json.loads((tmp_path / "plan" / PLAN_JSON).read_text())
    document.pop("quantizer")
    (tmp_path / "plan" / PLAN_JSON).write_text(json.dumps(document))
    with pytest.raises(ValueError, match="a version-2 plan must have a quantizer block"):
        Plan.load(tmp_path / "plan")
    document["format_version"] = 3
    (tmp_path / "plan" / PLAN_JSON).write_text(json.dumps(document))
    with pytest.raises(ValueError, match="plan format version 3; this stepquant reads versions 1, 2"):
        Plan.load(tmp_path / "plan")


def test_plan_pins_its_quantizer(saved_plans, tmp_path, capsys):
    from stepquant.calibrate.quantizer import quantizer_to_json
    from stepquant.codecs import Grid
    from stepquant.codecs.dual_axis import DualAxisConfig

    # a new plan records the quantizer its statistics were measured with; its codecs and pool layers run it
    midtread = DualAxisConfig(grid=Grid.MIDTREAD, refit_iters=1)
    stats = synthetic_stats(**SHIPPED_KDA, seed=2)
    object.__setattr__(stats, "settings", {"quantizer": quantizer_to_json(midtread)})
    assert stats.quantizer == midtread
    plan = build_plan(stats, allocate(stats, "stepquant", 4), command="pytest")
    loaded = Plan.load(plan.save(tmp_path / "midtread"))
    assert json.loads((tmp_path / "midtread" / PLAN_JSON).read_text())["quantizer"]["grid"] == "midtread"
    assert loaded.quantizer == midtread and loaded.codec(3).config == midtread
    assert all(layer.config == midtread and layer.spatial == "dual_axis" for layer in loaded.layer_formats())
    temporal = Plan.load(saved_plans[("kda", "temporal")])
    assert all(layer.spatial == "absmax" for layer in temporal.layer_formats())  # the plan's own format
    states = torch.randn(1, plan.num_heads, 128, 128)
    assert loaded.codec(0).encode(states).grid is Grid.MIDTREAD
    # a dual-axis plan refuses a quantizer its distortion table was not measured with
    with pytest.raises(ValueError, match="differs from the one the statistics' distortion table"):
        build_plan(stats, allocate(stats, "stepquant", 4), quantizer=DualAxisConfig())
    # the CLI option: statistics measured on the other grid are refused, on the same grid used and recorded
    default_stats = tmp_path / "default-grid"
    synthetic_stats(**SHIPPED_KDA, seed=2).save(default_stats)
    assert main(["calibrate", "--stats", str(default_stats), "--bits", "4", "--variant", "stepquant",
                 "--grid", "midtread", "--out", str(tmp_path / "refused"), "--no-progress"]) == 2
    assert "collect statistics with the plan's quantizer" in capsys.readouterr().err
    out = tmp_path / "cli"
    cli_quantizer = DualAxisConfig(grid=Grid.MIDTREAD)  # what --grid midtread makes
    object.__setattr__(stats, "settings", {"quantizer": quantizer_to_json(cli_quantizer)})
    stats.save(out)
    assert main(["calibrate", "--stats", str(out), "--bits", "4", "--variant", "stepquant",
                 "--grid", "midtread", "--out", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    made = Plan.load(out / "stepquant-4")
    assert made.quantizer.grid is Grid.MIDTREAD and "--grid midtread" in made.calibration["command"]



def test_calibrate_division_and_refit_options(tmp_path, capsys):
    from stepquant.calibrate.quantizer import quantizer_to_json
    from stepquant.codecs.dual_axis import DualAxisConfig

    # --division / --refit-iters pick the quantizer version (the CUDA kernel's fast reciprocal contract);
    # statistics measured with it are used and the plan records it, other statistics are refused
    fast = DualAxisConfig(division="reciprocal", refit_iters=0)
    stats = synthetic_stats(**SHIPPED_KDA, seed=2)
    object.__setattr__(stats, "settings", {"quantizer": quantizer_to_json(fast)})
    out = tmp_path / "fast"
    stats.save(out)
    options = ["--division", "reciprocal", "--refit-iters", "0"]
    assert main(["calibrate", "--stats", str(out), "--bits", "6", "--variant", "stepquant", *options,
                 "--out", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    made = Plan.load(out / "stepquant-6")
    assert made.quantizer == fast and made.codec(0).config == fast
    assert "--division reciprocal --refit-iters 0" in made.calibration["command"]
    assert main(["calibrate", "--stats", str(out), "--bits", "6", "--variant", "stepquant",
                 "--out", str(tmp_path / "refused"), "--no-progress"]) == 2
    assert "collect statistics with the plan's quantizer" in capsys.readouterr().err
    assert main(["calibrate", "--stats", str(out), "--bits", "6", "--refit-iters", "-1",
                 "--out", str(tmp_path / "bad"), "--no-progress"]) == 2
    assert "--refit-iters must be >= 0" in capsys.readouterr().err
    # --row-stat likewise (mean_abs: the authors' statistic, issue 14)
    mean_abs = DualAxisConfig(row_stat="mean_abs", division="reciprocal", refit_iters=1)
    object.__setattr__(stats, "settings", {"quantizer": quantizer_to_json(mean_abs)})
    stats.save(tmp_path / "mean_abs")
    options = ["--row-stat", "mean_abs", "--division", "reciprocal", "--refit-iters", "1"]
    assert main(["calibrate", "--stats", str(tmp_path / "mean_abs"), "--bits", "4", *options,
                 "--out", str(tmp_path / "mean_abs"), "--no-progress"]) == 0
    capsys.readouterr()
    made = Plan.load(tmp_path / "mean_abs" / "stepquant-4")
    assert made.quantizer == mean_abs and " ".join(options) in made.calibration["command"]
    # --row-fill likewise (the shipped STEPQuant plans since docs/eval.md section 11); it needs reciprocal
    filled = DualAxisConfig(division="reciprocal", refit_iters=0, row_fill=True)
    object.__setattr__(stats, "settings", {"quantizer": quantizer_to_json(filled)})
    stats.save(tmp_path / "filled")
    options = ["--division", "reciprocal", "--refit-iters", "0", "--row-fill"]
    assert main(["calibrate", "--stats", str(tmp_path / "filled"), "--bits", "6", *options,
                 "--out", str(tmp_path / "filled"), "--no-progress"]) == 0
    capsys.readouterr()
    made = Plan.load(tmp_path / "filled" / "stepquant-6")
    assert made.quantizer == filled and " ".join(options) in made.calibration["command"]
    assert main(["calibrate", "--stats", str(tmp_path / "filled"), "--bits", "6", "--row-fill",
                 "--out", str(tmp_path / "bad"), "--no-progress"]) == 2
    assert "--row-fill needs --division reciprocal" in capsys.readouterr().err

def test_row_weights_are_bounded_at_plan_build_and_load(saved_plans, tmp_path):
    import dataclasses

    from safetensors.torch import load as load_arrays
    from safetensors.torch import save as save_arrays

    from stepquant.calibrate import StatsConfig

    directory = saved_plans[("gdn", "stepquant")]
    plan = Plan.load(directory)
    stats = synthetic_stats(**SHIPPED_GDN, seed=1)
    huge = stats.w.clone()
    huge[0, 2, 5] = 1e20  # finite but huge, as from a damaged statistics file
    with pytest.raises(ValueError, match=r"w of the statistics \(row-impact factors\) must be finite and in"):
        dataclasses.replace(stats, w=huge)
    with pytest.raises(ValueError, match=r"layer 0 \(bits\[0\], w\[0\]\): w \(row-impact factors\) must be"):
        dataclasses.replace(plan, w=(huge[0], *plan.w[1:]))
    # a plan directory with a consistent integrity block but such a w is refused at load
    arrays = load_arrays((directory / PLAN_ARRAYS).read_bytes())
    arrays["w"] = arrays["w"].clone()
    arrays["w"][0, 2, 5] = 1e20
    target = tmp_path / "huge-w"
    target.mkdir()
    blob = save_arrays(arrays, metadata={"format": "stepquant-plan", "format_version": "1"})
    (target / PLAN_ARRAYS).write_bytes(blob)
    plan.write_json(target, blob)
    with pytest.raises(ValueError, match=r"must be finite and in \[2\^-10, 2\^10\], got values .* to 1e\+20"):
        Plan.load(target)
    # calibration settings that could make such a w are refused before any model runs
    with pytest.raises(ValueError, match="raise --omega-floor or lower --exponent"):
        StatsConfig(exponent=1.0)
    StatsConfig(exponent=0.5)  # 1e-6^-0.5 = 1000: within the bound


# ---------------------------------------------------------------- never lose or mix a user's work


@pytest.fixture
def no_model_run(monkeypatch):
    """Fail the test if a model is loaded: what it checks must be found before the expensive part."""
    import stepquant.models

    monkeypatch.setattr(stepquant.models, "load", lambda *a, **k: pytest.fail("the model was loaded"))


def _stats_dir(tmp_path: Path, run_id: str = "run-a") -> Path:
    import dataclasses

    directory = tmp_path / "calibration"
    dataclasses.replace(synthetic_stats(**SHIPPED_GDN, seed=1), run_id=run_id).save(directory)
    return directory


def test_calibrate_refuses_to_replace_plans_or_statistics_without_force(tmp_path, capsys, no_model_run):
    stats = _stats_dir(tmp_path)
    out = tmp_path / "plans"
    argv = ["calibrate", "--stats", str(stats), "--bits", "6", "--out", str(out), "--json"]
    assert main(argv) == 0
    first = json.loads((out / "stepquant-6" / PLAN_JSON).read_text())["bits"]
    capsys.readouterr()
    assert main([*argv[:-1], "--variant", "stepquant,spatial"]) == 2  # stepquant-6 is there: nothing written
    err = capsys.readouterr().err
    assert f"--out {out} already holds stepquant-6/ (an earlier calibration)" in err and "--force" in err
    assert not (out / "spatial-6").exists()
    assert main([*argv, "--bits", "4"]) == 0  # a new budget beside it is not a conflict
    assert main([*argv, "--force"]) == 0
    assert json.loads((out / "stepquant-6" / PLAN_JSON).read_text())["bits"] == first
    # collecting statistics into a directory that holds some refuses before the model runs
    assert main(["calibrate", "--model", "gdn", "--out", str(stats)]) == 2
    assert "already holds stats.safetensors" in capsys.readouterr().err
    # the recalibrate hint of a committed plan no longer points at the committed directory
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for name in (PLAN_JSON, PLAN_ARRAYS):
        (damaged / name).write_bytes((assets.PLANS / "gdn" / "stepquant-6" / name).read_bytes())
    _truncate(damaged / PLAN_ARRAYS)
    with pytest.raises(ValueError, match=r"--row-fill --out NEW_DIR \(NEW_DIR: a directory of your"):
        Plan.load(damaged)


def test_an_interrupted_plan_save_leaves_the_old_plan(saved_plans, tmp_path, monkeypatch):
    import shutil

    directory = tmp_path / "stepquant-6"
    shutil.copytree(saved_plans[("gdn", "stepquant")], directory)
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    plan = Plan.load(directory)
    stats = synthetic_stats(**SHIPPED_GDN, seed=2)
    other = build_plan(stats, allocate(stats, "stepquant", 4), command="pytest")

    def interrupted(self, target, blob):
        raise KeyboardInterrupt  # the arrays are written, plan.json is not

    monkeypatch.setattr(Plan, "write_json", interrupted)
    with pytest.raises(KeyboardInterrupt):
        other.save(directory)
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stepquant-6"]  # no temporary left behind
    monkeypatch.undo()
    assert torch.equal(Plan.load(directory).bits[0], plan.bits[0])
    other.save(directory)  # replaced as a whole
    assert Plan.load(directory).budget_bits == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stepquant-6"]


def test_plans_are_tied_to_their_statistics_by_a_run_id(tmp_path):
    import dataclasses

    from stepquant.calibrate import CalibrationStats

    stats_dir = _stats_dir(tmp_path, run_id="run-a")
    stats = CalibrationStats.load(stats_dir)
    assert stats.run_id == "run-a"
    plan_dir = build_plan(stats, allocate(stats, "stepquant", 6)).save(stats_dir / "stepquant-6")
    assert Plan.load(plan_dir).calibration["stats_run_id"] == "run-a"
    dataclasses.replace(stats, run_id="run-b").save(stats_dir)  # a rerun into the same --out stopped early
    with pytest.raises(ValueError, match=r"made from the statistics of calibration run run-a, but .* is from "
                                         r"run run-b: the directory mixes two calibrations.*--force"):
        Plan.load(plan_dir)
    dataclasses.replace(stats, run_id="").save(stats_dir)  # statistics without a run id: nothing to compare
    Plan.load(plan_dir)


def test_statistics_carry_their_checksum(tmp_path):
    from stepquant.calibrate import CalibrationStats

    path = _stats_dir(tmp_path) / "stats.safetensors"
    CalibrationStats.load(path)
    _flip_last_byte(path)  # an array value changes; the file still parses
    with pytest.raises(ValueError, match="changed since calibration .*sha256 does not match.*recalibrate"):
        CalibrationStats.load(path)
    CalibrationStats.load(assets.PLANS / "gdn")  # the committed statistics predate checksums: they load


CUDA_ABSENT = pytest.mark.skipif(torch.cuda.is_available(), reason="probes a machine without CUDA")


@pytest.mark.parametrize(
    "argv, message",
    [(("--out", "{file}/sub"), "is not a directory this user can write"),
     (("--data", "calib2"), "'calib2' is not a shipped split (train, calib, wiki, sotu, brown)"),
     (("--data", "{bad_utf8}"), "bad.txt:2: not UTF-8 text (byte 0xff"),
     (("--data", "{bad_jsonl}"), "bad.jsonl:2: not valid JSON"),
     pytest.param(("--device", "cuda"), "--device cuda: no CUDA GPU is available", marks=CUDA_ABSENT),
     pytest.param(("--replay-device", "cuda:0"), "--replay-device cuda:0: no CUDA GPU", marks=CUDA_ABSENT),
     (("--segment-length", "64", "--snapshot-every", "128"), "--snapshot-every must be in 1..--segment-"),
     (("--exponent", "1"), "raise --omega-floor or lower --exponent"),
     (("--dtype", "int8"), "--dtype must be one of")],
    ids=["unwritable-out", "data-typo", "data-not-utf8", "data-bad-json", "no-cuda", "no-cuda-replay",
         "snapshot-every", "w-spread", "dtype"],
)
def test_calibrate_checks_every_argument_before_the_model_runs(tmp_path, capsys, no_model_run, argv, message):
    paths = {name: tmp_path / file for name, file in
             (("file", "a-file"), ("bad_utf8", "bad.txt"), ("bad_jsonl", "bad.jsonl"))}
    paths["file"].write_text("x")
    paths["bad_utf8"].write_bytes(b"fine\n\xff\n")
    paths["bad_jsonl"].write_text('{"text": "fine"}\n{"text": \n')
    argv = [a.format(**paths) for a in argv]
    out = [] if "--out" in argv else ["--out", str(tmp_path / "out")]
    assert main(["calibrate", "--model", "gdn", *out, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1  # one clear line, no traceback


def test_cli_turns_os_and_runtime_errors_into_one_line(capsys, monkeypatch):
    import stepquant.accounting.cli as memory_cli

    for error in (PermissionError(13, "Permission denied", "/x/stats.safetensors"),
                  RuntimeError("CUDA out of memory")):
        def fail(*args, error=error, **kwargs):
            raise error

        monkeypatch.setattr(memory_cli, "memory_report", fail)
        assert main(["memory", "--preset", "qwen3.8-27b"]) == 2
        assert capsys.readouterr().err.strip() == f"stepquant memory: error: {error}"

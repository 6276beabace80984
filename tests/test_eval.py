"""Tests for stepquant.eval: probe arithmetic, methods, report, and a tiny end-to-end `stepquant eval`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from stepquant.accounting import dsq_bytes, int_rowwise_bytes
from stepquant.codecs import make_codec
from stepquant.eval.cli import add_cli
from stepquant.eval.methods import (
    DEFAULT_METHODS,
    Method,
    plan_method,
    plan_path,
    resolve_method,
    resolve_methods,
)
from stepquant.eval.probe import agreement_lengths, drift_probe, excess_nll, first_eos_lengths
from stepquant.eval.report import markdown_report, moving_average
from stepquant.families import shape_from_config
from stepquant.models import load, resolve

GDN_LINEAR = [0, 1, 2, 4, 5, 6]


def test_excess_nll_windows_on_a_constructed_example():
    steps = 600
    reference = torch.rand(2, steps, generator=torch.Generator().manual_seed(0))  # [S, D]
    ramp = torch.arange(steps, dtype=torch.float64) / 100  # excess 0.00, 0.01, ..., 5.99
    method = reference.double() + torch.stack([ramp, 2 * ramp])  # stream 1 drifts twice as fast
    nll = torch.stack([reference.double(), method, reference.double() - 0.5])  # [M=3, S=2, D]
    result = excess_nll(nll, reference=0, window=256)
    assert result.window == 256
    first = ramp[:256].mean().item()  # (0 + 2.55) / 2
    last = ramp[-256:].mean().item()  # (3.44 + 5.99) / 2
    everything = ramp.mean().item()  # 5.99 / 2
    torch.testing.assert_close(result.first[1], torch.tensor([first, 2 * first], dtype=torch.float64))
    torch.testing.assert_close(result.last[1], torch.tensor([last, 2 * last], dtype=torch.float64))
    torch.testing.assert_close(result.all[1], torch.tensor([everything, 2 * everything], dtype=torch.float64))
    assert math.isclose(first, 1.275) and math.isclose(last, 4.715) and math.isclose(everything, 2.995)
    assert torch.equal(result.all[0], torch.zeros(2, dtype=torch.float64))
    torch.testing.assert_close(result.all[2], torch.full((2,), -0.5, dtype=torch.float64))
    torch.testing.assert_close(result.curve[1], 1.5 * ramp)  # mean over the two streams
    blocks = excess_nll(nll, window=256, block=100)  # 6 blocks of 100 predictions per stream
    expected_blocks = torch.cat([ramp.view(6, 100).mean(-1), 2 * ramp.view(6, 100).mean(-1)])  # [S * 6]
    torch.testing.assert_close(blocks.block_means[1], expected_blocks)
    torch.testing.assert_close(blocks.stderr[1], expected_blocks.std() / 12**0.5)
    assert blocks.stderr[0] == 0
    short = excess_nll(nll[..., :100], window=256)  # the window shrinks to D
    assert short.window == 100 and short.block == 64 and short.block_means.shape == (3, 2)
    assert torch.equal(short.first, short.last) and torch.equal(short.first, short.all)
    with pytest.raises(ValueError, match="methods, streams, decode steps"):
        excess_nll(nll[0])
    with pytest.raises(ValueError, match="reference"):
        excess_nll(nll, reference=3)


def test_generation_length_arithmetic():
    eos = 0
    tokens = torch.tensor([[5, 6, 0, 0], [5, 7, 8, 9], [0, 0, 0, 0]])
    lengths, capped = first_eos_lengths(tokens, eos)
    assert lengths.tolist() == [3, 4, 1] and capped.tolist() == [False, True, False]
    reference = torch.tensor([[5, 6, 0, 0]]).expand(3, 4)
    assert agreement_lengths(tokens, reference).tolist() == [4, 1, 0]


def test_moving_average():
    curve = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])
    expected = lambda values: torch.tensor([values], dtype=torch.float64)
    torch.testing.assert_close(moving_average(curve, 2), expected([1.0, 1.5, 2.5, 3.5, 4.5]))
    torch.testing.assert_close(moving_average(curve, 10), expected([1.0, 1.5, 2.0, 2.5, 3.0]))


@pytest.mark.parametrize("name", ["gdn", "kda"])
def test_drift_probe_scores_the_right_tokens(name):
    """The probe's NLLs equal those of one plain forward over the whole stream (no off-by-one), FP32 rows
    have zero excess, and a quantized method is scored against them."""
    torch.set_num_threads(1)
    model, _ = load(name)
    tokens = torch.randint(1, 8000, (2, 21), generator=torch.Generator().manual_seed(1))
    prefill_len = 12
    result = drift_probe(model, tokens, ["fp32", "int4", "fp32"], prefill_len=prefill_len, window=4)
    with torch.inference_mode():
        logits = model(input_ids=tokens).logits
    full = F.cross_entropy(logits[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none")  # [S, 20]
    torch.testing.assert_close(result.prefill_nll, full[:, :prefill_len], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(result.decode_nll[0], full[:, prefill_len:], rtol=1e-4, atol=1e-4)
    assert result.decode_nll.shape == (3, 2, 8)
    # a second FP32 row group sits at other batch positions: BLAS may round those rows differently (~1e-7)
    assert result.excess.all[2].abs().max() < 1e-5
    assert not torch.equal(result.decode_nll[1], result.decode_nll[0])
    assert result.held_bytes["group_sizes"] == [2, 2, 2]
    with pytest.raises(ValueError, match="at least one decode step"):
        drift_probe(model, tokens[:, :13], ["fp32"], prefill_len=12)


def test_methods_resolve_to_codecs_with_accounted_bytes():
    shape = shape_from_config(resolve("gdn"))
    methods = resolve_methods(["int4", "dsq6", "fp32", "int6-sr"], "gdn", GDN_LINEAR)
    assert [m.name for m in methods] == ["fp32", "int4", "dsq6", "int6-sr"]  # the reference first, once
    assert methods[1].state_bytes(shape).serving_bytes == int_rowwise_bytes(shape, 4).serving_bytes
    assert methods[2].state_bytes(shape).serving_bytes == dsq_bytes(shape, 6).serving_bytes
    assert methods[0].state_bytes(shape).serving_bytes == shape.fp32_bytes
    assert methods[3].label == "INT6 SR"
    one = resolve_method("int4@4", "gdn", GDN_LINEAR)
    assert one.codecs[4].name == "int4" and all(one.codecs[i].name == "fp32" for i in GDN_LINEAR if i != 4)
    with pytest.raises(ValueError, match="linear-attention layer index"):
        resolve_method("int4@3", "gdn", GDN_LINEAR)  # layer 3 is full attention
    with pytest.raises(ValueError, match="unknown method"):
        resolve_method("int12", "gdn", GDN_LINEAR)
    with pytest.raises(ValueError, match="more than once"):
        resolve_methods(["int4", "int4"], "gdn", GDN_LINEAR)
    with pytest.raises(FileNotFoundError, match="no calibrated plan"):
        resolve_method("stepquant-6", "gdn", GDN_LINEAR, plans_dir="/nonexistent")
    kept = resolve_methods(["int4", "stepquant-6", "spatial-4@0"], "gdn", GDN_LINEAR,
                           plans_dir="/nonexistent", skip_missing_plans=True)
    assert [m.name for m in kept] == ["fp32", "int4"]
    assert DEFAULT_METHODS[0] == "fp32" and "stepquant-4" in DEFAULT_METHODS


def test_plan_directories_in_both_layouts(tmp_path):
    (tmp_path / "gdn" / "stepquant-6").mkdir(parents=True)
    assert plan_path("stepquant-6", "gdn", tmp_path) == tmp_path / "gdn" / "stepquant-6"  # plans/<model>/
    (tmp_path / "temporal-4").mkdir()
    assert plan_path("temporal-4", "gdn", tmp_path) == tmp_path / "temporal-4"  # a calibrate --out folder


def test_a_plan_directory_named_like_a_listed_method_is_refused(tmp_path):
    # results are keyed by method name: the --plan method would silently replace the listed one
    clash = tmp_path / "stepquant-6"
    clash.mkdir()
    with pytest.raises(ValueError, match="already evaluated.*rename the plan directory"):
        resolve_methods(["stepquant-6"], "gdn", GDN_LINEAR, plan_paths=[clash])
    with pytest.raises(ValueError, match="already evaluated"):
        resolve_methods(["int4"], "gdn", GDN_LINEAR, plan_paths=[tmp_path / "int4"])


def test_plan_methods_use_the_plan_codec_of_each_layer():
    codecs = [make_codec("int6"), make_codec("int4")] * 3
    plan = SimpleNamespace(linear_layers=tuple(GDN_LINEAR), variant="stepquant", budget_bits=6,
                           codec=lambda i: codecs[i])
    method = plan_method(plan, "stepquant-6", GDN_LINEAR)
    assert method.label == "STEPQuant@6"
    assert [method.codecs[layer] for layer in GDN_LINEAR] == codecs
    with pytest.raises(ValueError, match="another model"):
        plan_method(plan, "stepquant-6", [0, 1, 2])


def _record(methods: dict) -> dict:
    streams = ["wiki", "sotu"]
    stream_values = lambda v: {**{s: v for s in streams}, "mean": v}
    entries = {}
    for name, (label, excess) in methods.items():
        entries[name] = {
            "label": label, "bits_per_value": 4.125, "bytes_per_request": 405504,
            "measured_bytes_per_request": 405504, "ratio_vs_fp32": 7.76,
            "excess_nll": {"first": stream_values(excess), "last": stream_values(excess),
                           "all": stream_values(excess)},
            "decode_ppl": stream_values(100.0), "curve": [excess] * 4,
            "generation": {"mean_length": 10.0, "length": {s: 10.0 for s in streams}, "capped_fraction": 0.5,
                           "mean_agree": 3.0},
        }
    model = {"architecture": "Qwen3_5ForCausalLM", "trained_context": 4096,
             "shape": {"linear_layers": 6, "heads": 8, "key_dim": 128, "value_dim": 128,
                       "fp32_bytes": 3145728},
             "prefill_ppl": {s: 50.0 for s in streams}, "rows": 4, "methods": entries,
             "seconds": {"prefill": 1.0, "replicate": 0.1, "decode": 4.0, "generation": 2.0},
             "generation": {"prompts_per_stream": 1, "prompt_tokens": 8, "max_new_tokens": 4}}
    return {"command": "stepquant eval --quick", "machine": "test", "date": "2026-01-01", "torch": "x",
            "transformers": "y", "seconds": 9.0,
            "settings": {"prefill": 8, "decode": 4, "window": 2, "segments": 1, "data": streams,
                         "packed": False},
            "models": {"gdn": model}}


def test_markdown_report_lists_every_method():
    text = markdown_report(_record({"fp32": ("FP32 (reference)", 0.0), "int4": ("INT4", 0.0123)}))
    row = "| INT4 | 4.1250 | 405,504 | 405,504 | 7.76x | " + " | ".join(["+0.0123"] * 5) + " | 100.00 |"
    assert row in text
    assert "stepquant eval --quick" in text and "wiki 50.00" in text
    assert "| INT4 | 10.0 | 10.0 | 10.0 | 50% | 3.0 |" in text


def test_eval_command_end_to_end(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["eval", "--models", "kda", "--methods", "int4,bf16", "--data", "wiki,sotu",
                              "--prefill", "8", "--decode", "6", "--window", "3", "--gen-prompts", "1",
                              "--gen-prompt-tokens", "8", "--gen-max-new", "3", "--out", str(tmp_path)])
    args.argv = ["--quick"]
    assert args.func(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(summary["excess_nll_all"]["kda"]) == {"fp32", "int4", "bf16"}
    assert summary["excess_nll_all"]["kda"]["fp32"] == 0.0
    record = json.loads((tmp_path / "eval.json").read_text())
    kda = record["models"]["kda"]
    assert kda["streams"] == ["wiki", "sotu"] and len(kda["methods"]["int4"]["curve"]) == 6
    assert kda["methods"]["int4"]["measured_bytes_per_request"] == kda["methods"]["int4"]["bytes_per_request"]
    assert (tmp_path / "eval.md").exists() and (tmp_path / "excess_nll_kda.png").stat().st_size > 0
    assert isinstance(Method, type)


@pytest.mark.parametrize("name", ["gdn", "kda"])
def test_attribution_head_variants_isolate_one_head(name):
    from stepquant.calibrate import Plan
    from stepquant.eval.methods import DEFAULT_PLANS_DIR
    from studies.attribution import head_variants

    variants_of = ("stepquant", "temporal")
    plans = {v: Plan.load(DEFAULT_PLANS_DIR / name / f"{v}-4", model_config=name) for v in variants_of}
    layers = [int(i) for i in plans["stepquant"].linear_layers]
    layer, i = layers[-1], len(layers) - 1
    heads = plans["stepquant"].bits[i].shape[0]
    variants = head_variants(plans, layers, 4, layer)
    expected = [(v, h) for v in variants_of for h in range(heads)]
    assert [v[0] for v in variants] == [f"{v}-4@{layer}.h{h}" for v, h in expected]
    torch.manual_seed(0)
    states = torch.randn(2, heads, 128, 128) * torch.rand(1, heads, 128, 1)  # rows of different magnitudes
    for (variant_name, _, codecs), (variant, head) in zip(variants, expected, strict=True):
        assert all(codecs[other].name == "fp32" for other in layers if other != layer), variant_name
        one_head = codecs[layer]
        assert torch.equal(one_head.bits[head], plans[variant].bits[i][head])
        assert bool((one_head.bits[torch.arange(heads) != head] == 16).all())  # the other heads: FP16 pivots
        got = one_head.roundtrip(states)
        want = plans[variant].codec(i).roundtrip(states)
        assert torch.equal(got[:, head], want[:, head])  # the head is fitted exactly as in the full plan
        others = torch.arange(heads) != head
        assert torch.equal(got[:, others], states[:, others].half().float())  # the rest: FP16 cast
    with pytest.raises(ValueError, match="linear-attention layer"):
        head_variants(plans, layers, 4, 3)  # layer 3 is full attention


def test_attribution_diagnostic_variants_change_one_thing_each():
    from stepquant.calibrate import Plan
    from stepquant.eval.methods import DEFAULT_PLANS_DIR
    from studies.attribution import diagnostic_variants

    plans = {v: Plan.load(DEFAULT_PLANS_DIR / "gdn" / f"{v}-4", model_config="gdn")
             for v in ("stepquant", "temporal")}
    variants = {name: codecs for name, _, codecs in diagnostic_variants(plans, GDN_LINEAR, 4)}
    assert len(variants) == 14 + 2 * len(GDN_LINEAR)  # names are unique
    default = plans["stepquant"].codec(0).config
    assert default.refit_iters == 1 and "stepquant+refit=1" not in variants  # the plan's own count
    assert [variants[f"stepquant+refit={n}"][0].config.refit_iters for n in (0, 2)] == [0, 2]
    assert "stepquant-recalibrated" not in variants
    other = Plan.load(DEFAULT_PLANS_DIR / "gdn" / "stepquant-6", model_config="gdn")
    recalibrated = {name: codecs for name, _, codecs in diagnostic_variants(plans, GDN_LINEAR, 4, other)}
    assert torch.equal(recalibrated["stepquant-recalibrated"][4].bits, other.bits[3])  # layer 4 = index 3
    assert variants["stepquant+row-absmax"][0].config == dataclasses.replace(default, row_stat="absmax")
    assert variants["stepquant+row-meanabs"][0].config == dataclasses.replace(default, row_stat="mean_abs")
    other_grid = {"midrise": "midtread", "midtread": "midrise"}[default.grid.value]
    assert variants[f"stepquant+{other_grid}"][0].config.grid.value == other_grid
    assert all(torch.equal(variants["temporal-bits+dual"][layer].bits, plans["temporal"].bits[i])
               for i, layer in enumerate(GDN_LINEAR))
    one = variants["stepquant-4@4"]
    assert one[4] is not None and all(one[i].name == "fp32" for i in GDN_LINEAR if i != 4)


def test_attribution_memory_variants_zero_the_right_units():
    from stepquant.analysis.mechanisms import lifetime_classes
    from stepquant.calibrate import Plan
    from stepquant.eval.methods import DEFAULT_PLANS_DIR
    from studies.attribution import memory_variants

    plans = {v: Plan.load(DEFAULT_PLANS_DIR / "kda" / f"{v}-4", model_config="kda")
             for v in ("stepquant", "temporal")}
    layers = [int(i) for i in plans["temporal"].linear_layers]
    variants = {name: codecs for name, _, codecs in memory_variants(plans, layers, 4)}
    classes = lifetime_classes(plans["temporal"].half_lives)  # [L, H, K]: key rows ranked in their layer
    heads = classes.shape[1]
    torch.manual_seed(0)
    states = torch.randn(2, heads, 128, 128)
    later = torch.randn(2, heads, 128, 128)
    for i, layer in enumerate(layers):
        long = classes[i] == 2
        assert int(long.sum()) == classes[i].numel() // 4
        every, once = variants["memoryless-long"][layer], variants["forget-prompt-long"][layer]
        for codec in (every, once):  # the first store (the prefill boundary) zeroes the long-lived rows
            first = codec.encode(states)
            assert bool((first[:, long] == 0).all()) and torch.equal(first[:, ~long], states[:, ~long])
        assert torch.equal(every.requantize(later, first)[:, ~long], later[:, ~long])
        assert bool((every.requantize(later, first)[:, long] == 0).all())  # memoryless: at every store
        assert once.carries_residual and torch.equal(once.requantize(later, first), later)  # once: FP32 after
        assert bool((variants["memoryless"][layer].encode(states) == 0).all())
        bits = variants["int4-long"][layer].bits
        assert bool((bits[long] == 4).all()) and bool((bits[~long] == 16).all())  # INT4 there, FP16 elsewhere


# ---------------------------------------------------------------- checked before the work


@pytest.fixture
def no_model_run(monkeypatch):
    import stepquant.models

    monkeypatch.setattr(stepquant.models, "load", lambda *a, **k: pytest.fail("a model was loaded"))


@pytest.mark.parametrize(
    "argv, message",
    [(("--methods", ""), "--methods '' lists no method"),
     (("--methods", " , "), "lists no method: give a comma list"),
     (("--window", "0"), "--window must be >= 1"),
     (("--gen-prompt-tokens", "0"), "--gen-prompt-tokens must be >= 1, got 0"),
     (("--prefill", "1"), "--prefill must be >= 2"),
     pytest.param(("--device", "cuda"), "--device cuda: no CUDA GPU is available",
                  marks=pytest.mark.skipif(torch.cuda.is_available(), reason="probes a CPU-only machine")),
     (("--out", "{file}/sub"), "is not a directory this user can write"),
     (("--data", "wiki,wikii"), "'wikii' is not a shipped split (train, calib, wiki, sotu, brown)"),
     (("--models", "gdn,gdm"), "no model at gdm"),
     (("--models", "gdn,kda", "--methods", "stepquant-6", "--plans-dir", "{plans}"),
      "no calibrated plan at {plans}/kda/stepquant-6"),
     (("--models", "gdn,kda", "--plan", "{plans}/gdn/stepquant-6"),
      "the plan was calibrated for 'gdn' (qwen3_5_text, 6 GDN layers x 8 heads of 128x128), not for 'kda'")],
    ids=["methods-empty", "methods-blank", "window-0", "gen-prompt-tokens-0", "prefill-1", "no-cuda",
         "unwritable-out", "data-typo", "model-typo", "second-model-without-plan", "second-model-other-plan"],
)
def test_eval_checks_every_argument_and_plan_before_the_first_model(tmp_path, capsys, no_model_run, argv,
                                                                    message):
    import shutil

    from stepquant import assets
    from stepquant.cli import main

    plans = tmp_path / "plans"
    shutil.copytree(assets.PLANS / "gdn" / "stepquant-6", plans / "gdn" / "stepquant-6")
    (tmp_path / "a-file").write_text("x")
    paths = {"file": tmp_path / "a-file", "plans": plans}
    argv = [a.format(**paths) for a in argv]
    base = ([] if "--models" in argv else ["--models", "gdn"]) + ([] if "--out" in argv else
                                                                   ["--out", str(tmp_path / "out")])
    assert main(["eval", "--methods", "int4", "--no-plots", *base, *argv]) == 2
    err = capsys.readouterr().err
    assert message.format(**paths) in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out" / "eval.json").exists()


def test_eval_writes_each_model_as_it_finishes(tmp_path, capsys, monkeypatch):
    import stepquant.eval.run as run
    from stepquant.cli import main

    def evaluate(model_name, **kwargs):
        if model_name == "kda":
            raise RuntimeError("the second model ran out of memory")
        return _record({"fp32": ("FP32 (reference)", 0.0), "int4": ("INT4", 0.0123)})["models"]["gdn"]

    monkeypatch.setattr(run, "evaluate_model", evaluate)
    argv = ["eval", "--models", "gdn,kda", "--methods", "int4", "--no-plots", "--out", str(tmp_path)]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == "stepquant eval: error: the second model ran out of memory"
    record = json.loads((tmp_path / "eval.json").read_text())
    assert list(record["models"]) == ["gdn"] and "| INT4 |" in (tmp_path / "eval.md").read_text()


def test_verdicts_pair_blocks_and_read_the_sides():
    from stepquant.eval.report import read_records
    from studies.verdicts import TARGETS, table, verdict

    def method(blocks):
        return {"excess_nll": {"all": {"mean": sum(blocks) / len(blocks)}, "block_means": [blocks]}}

    methods = {"stepquant-4": method([0.010, 0.012, 0.011, 0.013]),
               "int6": method([0.020, 0.021, 0.022, 0.023]), "int4": method([0.050, 0.065, 0.050, 0.065])}
    below = verdict(methods, "stepquant-4", "int6", 1.0, "below", 0.0)
    # per-block differences -0.010, -0.009, -0.011, -0.010: mean -0.010, sample sd 0.000816 / sqrt 4
    assert below["d"] == pytest.approx(-0.0100) and below["se"] == pytest.approx(0.000408, rel=1e-3)
    assert below["verdict"] == "met"
    fifth = verdict(methods, "stepquant-4", "int4", 0.2, "below", 0.0)  # paired: a_i - b_i / 5
    assert fifth["d"] == pytest.approx(0.0, abs=1e-12) and fifth["verdict"] == "not resolvable"
    band = verdict(methods, "stepquant-4", None, 1.0, "band", 0.005)  # +0.0115 is outside ±0.005
    assert band["verdict"] == "missed" and band["d"] == pytest.approx(0.0115)
    with pytest.raises(ValueError, match="no method"):
        verdict(methods, "stepquant-6", "bf16", 1.0, "below", 0.0)
    quick = Path(__file__).parents[1] / "docs" / "results" / "eval.json.gz"
    committed = read_records([quick])
    text, results = table(committed)  # every target's methods are in the committed eval
    assert text.count("\n") == 2 + len(TARGETS) and set(results) == set(committed["models"])
    # the full protocol's GPU runs: one .json.gz per model, a shorter method list (no spatial, no nopivot)
    full = [Path(__file__).parents[1] / "docs" / "results" / f"full_eval_{m}.json.gz" for m in ("gdn", "kda")]
    text, results = table(read_records(full))
    skipped = [label for label, method, reference, *_ in TARGETS if "spatial" in method + str(reference)
               or "nopivot" in str(reference)]
    assert len(skipped) == 4 and all(label in text.split("Not run in this eval")[1] for label in skipped)
    assert set(results) == {"gdn", "kda"} and all(len(r) == len(TARGETS) - 4 for r in results.values())
    # one model from two runs with the same FP32 rows: merged, the later file's methods replace the earlier's
    twice = read_records([full[0], full[0]])
    assert twice["models"]["gdn"]["methods"] == read_records([full[0]])["models"]["gdn"]["methods"]
    assert twice["models"]["gdn"]["replaced"] == sorted(set(twice["models"]["gdn"]["methods"]) - {"fp32"})
    with pytest.raises(ValueError, match="more than one .* other FP32 reference rows"):
        read_records([full[0], quick])  # the full protocol's gdn and the quick one's: other streams
    with pytest.raises(ValueError, match="none of the targets"):
        table({"models": {"gdn": {"methods": {"fp32": method([0.0, 0.0])}}}})


def test_horizon_windows_read_the_curves_and_pair_blocks():
    from stepquant.eval.report import read_records
    from studies.horizon_windows import default_windows, rows, window_means

    assert default_windows(3072) == [(0, 256), (768, 1024), (1792, 2048), (2816, 3072)]
    assert default_windows(100) == [(0, 100)]
    assert window_means([0.0, 1.0, 2.0, 3.0], [(0, 2), (2, 4)]) == [0.5, 2.5]
    with pytest.raises(ValueError, match="inside the curve"):
        window_means([0.0, 1.0], [(1, 3)])

    def method(curve, blocks):
        return {"curve": curve, "excess_nll": {"all": {"mean": sum(curve) / len(curve)}, "stderr": 0.0,
                                               "block_means": [blocks]}}

    record = {"models": {"m": {"methods": {"int6": method([0.0, 0.2, 0.4, 0.6], [0.1, 0.5]),
                                            "sq": method([0.1, 0.1, 0.1, 0.1], [0.1, 0.1])}}}}
    got = rows(record, "int6", windows=[(0, 2), (2, 4)])
    assert got == ["| m int6 | +0.1000 | +0.5000 | +0.3000 ± 0.0000 | - |",
                   "| m sq | +0.1000 | +0.1000 | +0.1000 ± 0.0000 | -0.2000 ± 0.2000 |"]
    with pytest.raises(ValueError, match="no method 'bf16'"):
        rows(record, "bf16")
    committed = read_records([Path(__file__).parents[1] / "docs" / "results" / "horizon_eval.json.gz"])
    gdn_int4 = [r for r in rows(committed, None) if r.startswith("| gdn int4 |")]  # docs/eval.md section 8
    assert gdn_int4 == ["| gdn int4 | +0.0089 | +0.0416 | +0.1240 | +0.1756 | +0.1003 ± 0.0073 |"]

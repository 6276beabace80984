"""Tests for stepquant.accounting: the paper's byte counts reproduced exactly, config.json parsing for every
supported model type, concrete plans counted through the packed layout, and the `stepquant memory` CLI."""

from __future__ import annotations

import json

import pytest
import torch

from stepquant import assets
from stepquant.accounting import (
    GIB,
    MIB,
    PRESETS,
    Capacity,
    Mixer,
    ModelShape,
    capacity,
    codec_bytes,
    default_pivots,
    dsq_bytes,
    float_bytes,
    get_preset,
    int_rowwise_bytes,
    max_pivots,
    measured_bytes,
    plan_bytes,
    stepquant_bytes,
)
from stepquant.cli import main
from stepquant.codecs.base import Codec
from stepquant.families import shape_from_config

QWEN = PRESETS["qwen3.8-27b"]
KIMI = PRESETS["kimi-linear-48b-a3b"]


# ------------------------------------------------------- the paper's numbers (docs/method.md section 4)

def test_qwen_preset_shape():
    assert QWEN.num_heads == 2_304 and QWEN.full_attention_layers == 16
    assert QWEN.fp32_bytes == float_bytes(QWEN).analytical_bytes == 150_994_944
    assert QWEN.conv_state_bytes == 2_949_120
    assert QWEN.kv_bytes_per_token == 65_536
    assert dict(QWEN.weight_bytes) == {"bf16": 53_791_996_928, "w4a16": 17_776_688_128}


def test_qwen_stepquant_6_bits_with_32_pivot_heads():
    assert default_pivots(QWEN, 6) == 32
    state = stepquant_bytes(QWEN, 6)
    assert state.analytical_bytes == 30_015_488  # scale slots for every head
    assert state.serving_bytes == 29_999_104  # 32 pivot heads carry no scales
    assert state.analytical_bytes - state.serving_bytes == 32 * 2 * (128 + 128)
    assert f"{state.ratio_vs_fp32():.2f}" == f"{state.ratio_vs_fp32(serving=True):.2f}" == "5.03"
    assert f"{100 * (1 - state.serving_bytes / QWEN.fp32_bytes):.2f}" == "80.13"  # "80.13%" in the paper
    assert f"{state.serving_bytes / MIB:.3f}" == "28.609"


def test_qwen_4_bit_nominal_count_and_the_papers_evaluated_count():
    nominal = stepquant_bytes(QWEN, 4, pivots=32)
    # b̄ N + 8 N_piv + scales: 4 * 37,748,736 + 8 * 32 * 16,384 bits + 2,304 * 512 B
    assert nominal.analytical_bytes == 20_578_304
    assert nominal.serving_bytes == 20_561_920
    assert f"{nominal.bits_per_value():.4f}" == "4.3611"
    evaluated = measured_bytes(QWEN, 21_804_032)
    assert f"{evaluated.bits_per_value():.4f}" == "4.6209"
    assert f"{evaluated.ratio_vs_fp32():.4f}" == "6.9251"
    # the paper's evaluated 4-bit plan is larger than the nominal budget; docs/accounting.md says so
    assert evaluated.analytical_bytes - nominal.analytical_bytes == 1_225_728


@pytest.mark.parametrize(
    "bits, mib, bits_per_value, ratio", [(4, 5.375, 4.30, "7.44"), (6, 7.875, 6.30, "5.08")], ids=["4b", "6b"]
)
def test_kimi_stepquant_with_512_pivot_rows(bits, mib, bits_per_value, ratio):
    assert KIMI.num_units == 81_920 and KIMI.unit_values == 128
    assert KIMI.fp32_bytes == 40 * MIB
    assert default_pivots(KIMI, bits) == 512
    state = stepquant_bytes(KIMI, bits)
    assert state.analytical_bytes == state.serving_bytes == mib * MIB  # KDA pivot rows keep scale slots
    assert state.bits_per_value() == pytest.approx(bits_per_value, abs=1e-12)
    assert f"{state.ratio_vs_fp32():.2f}" == ratio


def test_kimi_preset_leaves_what_the_paper_does_not_give_unknown():
    assert KIMI.linear_layers * KIMI.heads * KIMI.key_dim == 81_920
    assert KIMI.conv_state_bytes is None and KIMI.kv_bytes_per_token is None and KIMI.weight_bytes == ()


def test_capacity_with_radix_caching_at_b64():
    fp32 = capacity(QWEN, float_bytes(QWEN), batch=64)
    step = capacity(QWEN, stepquant_bytes(QWEN, 6), batch=64)
    assert fp32.slots == step.slots == 5 * 64 + 1
    assert fp32.slot_bytes / MIB == 146.8125
    assert step.slot_bytes / MIB == 31.4375
    assert f"{fp32.pool_bytes / GIB:.2f}" == "46.02"
    assert f"{step.pool_bytes / GIB:.2f}" == "9.85"


def test_total_serving_memory_at_b512_matches_section_5_6():
    # W4A16 weights + (5B+1) slots + B x (128 prompt + 1,024 generated tokens) x 64 KiB of attention KV
    w4a16 = dict(QWEN.weight_bytes)["w4a16"]
    fp32 = capacity(QWEN, float_bytes(QWEN), batch=512, context_tokens=1_152)
    step = capacity(QWEN, stepquant_bytes(QWEN, 6), batch=512, context_tokens=1_152)
    assert f"{fp32.total_bytes(w4a16) / GIB:.2f}" == "419.73"
    assert f"{step.total_bytes(w4a16) / GIB:.2f}" == "131.18"


def test_kimi_state_memory_at_b512_matches_appendix_f():
    # state-level memory: (5B+1) recurrent-state slots, conv state not included
    assert f"{capacity(KIMI, float_bytes(KIMI), batch=512).pool_bytes / GIB:.2f}" == "100.04"
    assert f"{capacity(KIMI, stepquant_bytes(KIMI, 6), batch=512).pool_bytes / GIB:.2f}" == "19.70"


def test_capacity_kv_term_is_unknown_when_the_kv_size_is():
    cap = capacity(KIMI, float_bytes(KIMI), batch=4, context_tokens=100)
    assert cap.kv_bytes is None and cap.total_bytes(10) is None
    assert capacity(KIMI, float_bytes(KIMI), batch=4).total_bytes(10) == 10 + 21 * 40 * MIB


def test_capacity_rejects_bad_arguments():
    with pytest.raises(ValueError, match="batch must be >= 1"):
        capacity(QWEN, float_bytes(QWEN), batch=0)
    with pytest.raises(TypeError, match="slots_per_request must be an int"):
        Capacity("x", 1, 2.5, 10, 0)


# ---------------------------------------------------------------- plain formats and budget rules

@pytest.mark.parametrize("bits", [2, 3, 4, 6, 8])
def test_plain_integer_formats_add_their_scale_bits(bits):
    assert int_rowwise_bytes(QWEN, bits).bits_per_value() == bits + 16 / 128
    assert dsq_bytes(QWEN, bits).bits_per_value() == bits + 16 / 128 + 16 / 128
    assert float_bytes(QWEN, 16).bits_per_value() == 16


def test_stepquant_without_pivots_is_dsq():
    for shape in (QWEN, KIMI):
        assert stepquant_bytes(shape, 6, pivots=0).analytical_bytes == dsq_bytes(shape, 6).analytical_bytes


def small(mixer: Mixer, layers: int, heads: int, k: int = 128, v: int = 128) -> ModelShape:
    return ModelShape("small", mixer, layers, heads, k, v)


@pytest.mark.parametrize(
    "shape, expected",
    [(small(Mixer.GDN, 8, 4), 0), (small(Mixer.GDN, 9, 4), 1), (small(Mixer.GDN, 48, 48), 32),
     (small(Mixer.GDN, 24, 16), 5), (small(Mixer.KDA, 8, 4), 26), (small(Mixer.KDA, 1, 1, 80), 1)],
    ids=["gdn-32heads-0", "gdn-36heads-half-up", "gdn-qwen", "gdn-384heads", "kda-4096rows",
         "kda-80rows-half-up"],
)
def test_default_pivots_round_the_papers_share_half_up(shape, expected):
    assert default_pivots(shape) == expected


def test_pivots_must_fit_the_budget():
    assert default_pivots(QWEN, 2) == 0  # a 2-bit budget cannot pay for any pivot
    assert max_pivots(QWEN, 8) == QWEN.num_units
    assert max_pivots(QWEN, 6) == 4 * QWEN.num_units // 6
    with pytest.raises(ValueError, match="pivots=1 heads do not fit a 2-bit budget"):
        stepquant_bytes(QWEN, 2, pivots=1)
    with pytest.raises(ValueError, match="pivots must be >= 0"):
        stepquant_bytes(QWEN, 6, pivots=-1)
    with pytest.raises(ValueError, match="bits=9 is out of range"):
        stepquant_bytes(QWEN, 9)
    with pytest.raises(TypeError, match="bits must be an int"):
        int_rowwise_bytes(QWEN, True)
    with pytest.raises(TypeError, match="shape must be a ModelShape"):
        dsq_bytes("qwen3.8-27b", 4)


def test_model_shape_validates():
    with pytest.raises(ValueError, match="heads must be >= 1"):
        ModelShape("x", Mixer.GDN, 1, 0, 128, 128)
    with pytest.raises(TypeError, match="mixer must be a Mixer"):
        ModelShape("x", "gdn", 1, 1, 128, 128)
    with pytest.raises(ValueError, match="weight_bytes names must be unique"):
        ModelShape("x", Mixer.GDN, 1, 1, 8, 8, weight_bytes=(("a", 1), ("a", 2)))
    with pytest.raises(ValueError, match="unknown preset 'qwen'; available: kimi-linear-48b-a3b, qwen3.8"):
        get_preset("qwen")


# ---------------------------------------------------------------- concrete plans and codecs

def test_a_qwen_plan_at_the_nominal_budget_packs_to_the_papers_bytes():
    # 32 pivot heads, 64 heads at 5 bits, 2,208 at 6 bits: exactly b̄ N - 8 N_piv integer bits
    head_bits = torch.full((QWEN.num_heads,), 6, dtype=torch.int8)
    chosen = torch.randperm(QWEN.num_heads, generator=torch.Generator().manual_seed(0))[:96]
    head_bits[chosen[:32]] = 16
    head_bits[chosen[32:]] = 5
    assert int(head_bits.to(torch.int64).sum()) == 6 * 2_304 + 8 * 32
    state = plan_bytes(head_bits.view(QWEN.linear_layers, QWEN.heads), QWEN)
    assert (state.analytical_bytes, state.serving_bytes) == (30_015_488, 29_999_104)


@pytest.mark.parametrize("whole_pivot_heads", [False, True], ids=["spread-pivot-rows", "4-whole-pivot-heads"])
def test_a_kimi_plan_at_the_nominal_budget(whole_pivot_heads):
    # 512 pivot rows, 1,024 rows at 5 bits, 80,384 at 6 bits: exactly b̄ N - 8 N_piv integer bits
    rows = torch.full((KIMI.linear_layers, KIMI.heads, KIMI.key_dim), 6, dtype=torch.int8)
    per_head = rows.view(-1, KIMI.key_dim)  # [640 heads, K]
    if whole_pivot_heads:
        per_head[:4] = 16
    else:
        per_head[:512, 7] = 16  # one pivot row in each of 512 heads
    per_head[-8:] = 5  # 8 heads x 128 rows
    assert int(rows.to(torch.int64).sum()) == 6 * 81_920 + 8 * 512
    state = plan_bytes(rows, KIMI)
    assert state.analytical_bytes == 7.875 * MIB
    # a KDA pivot row keeps its scale slot; a head of pivots only has none in the serving layout
    assert state.serving_bytes == state.analytical_bytes - (4 * 2 * 256 if whole_pivot_heads else 0)


def test_plan_bytes_counts_word_padding_and_checks_shapes():
    shape = small(Mixer.GDN, 2, 3, k=5, v=33)
    state = plan_bytes([torch.tensor([3, 3, 16]), torch.tensor([8, 2, 2])], shape)
    # rows of 33 values: 3 bits = ceil(33/16) + ceil(33/32) = 5 words, 16 bits = 17, 8 bits = 9, 2 bits = 3
    words = 5 * (5 + 5 + 17 + 9 + 3 + 3)
    assert state.analytical_bytes == 4 * words + 2 * 6 * (5 + 33)
    assert state.serving_bytes == 4 * words + 2 * 5 * (5 + 33)
    with pytest.raises(ValueError, match="got 1 layers, the model has 2"):
        plan_bytes([torch.tensor([3, 3, 3])], shape)
    with pytest.raises(ValueError, match=r"layers\[1\] must have shape \[H\]=\[3\]"):
        plan_bytes([torch.tensor([3, 3, 3]), torch.tensor([3, 3])], shape)


class _PivotHeadsForTest(Codec):
    """Int8 rowwise codes with the first head of every layer an FP16 pivot head (accounting only)."""

    name = "pivot-head-test"

    def encode(self, states):  # pragma: no cover - only the accounting is exercised
        raise NotImplementedError

    def decode(self, encoded):  # pragma: no cover
        raise NotImplementedError

    def storage_bits(self, num_heads, key_dim, value_dim, *, analytical=False):
        scaled_heads = num_heads if analytical else num_heads - 1
        return key_dim * value_dim * (16 + 8 * (num_heads - 1)) + scaled_heads * key_dim * 16


def test_codec_bytes_uses_storage_bits_per_layer():
    state = codec_bytes(_PivotHeadsForTest(), QWEN)
    assert state.label == "pivot-head-test"
    assert state.serving_bytes == 48 * (128 * 128 * (16 + 8 * 47) + 47 * 128 * 16) // 8
    assert state.analytical_bytes - state.serving_bytes == 48 * 128 * 2


def test_codec_bytes_of_the_repository_codecs_match_the_formulas():
    codecs = pytest.importorskip("stepquant.codecs")
    make_codec = getattr(codecs, "make_codec", None)
    if make_codec is None:
        pytest.skip("stepquant.codecs.make_codec not available")
    cases = [("fp32", QWEN, float_bytes(QWEN)), ("int6", QWEN, int_rowwise_bytes(QWEN, 6)),
             ("dsq4", KIMI, dsq_bytes(KIMI, 4))]
    for codec, shape, expected in cases:
        state = codec_bytes(make_codec(codec), shape)
        assert (state.analytical_bytes, state.serving_bytes) == (expected.analytical_bytes,) * 2, codec


def test_codec_bytes_rejects_non_codecs():
    with pytest.raises(TypeError, match="codec must implement storage_bits"):
        codec_bytes(object(), QWEN)


# ---------------------------------------------------------------- config.json

QWEN38_TEXT = {
    "model_type": "qwen3_5_text", "num_hidden_layers": 64, "full_attention_interval": 4,
    "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_key_value_heads": 4, "head_dim": 256,
    "dtype": "bfloat16",
}
KIMI_HUB = {
    "model_type": "kimi_linear", "num_hidden_layers": 27, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
    "torch_dtype": "bfloat16",
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
        "num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4,
    },
}


@pytest.mark.parametrize(
    "config",
    [{"model_type": "qwen3_5", "text_config": QWEN38_TEXT},
     {"model_type": "qwen3_5_moe", "text_config": {**QWEN38_TEXT, "model_type": "qwen3_5_moe_text"}},
     {**QWEN38_TEXT, "model_type": "qwen3_next"},
     QWEN38_TEXT,
     {**QWEN38_TEXT, "layer_types": ["full_attention" if i % 4 == 3 else "linear_attention"
                                     for i in range(64)]}],
    ids=["qwen3_5-nested", "qwen3_5_moe-nested", "qwen3_next-flat", "qwen3_5_text-flat",
         "explicit-layer_types"],
)
def test_a_qwen38_like_config_gives_the_papers_shape(config, tmp_path):
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    for source in (path, path / "config.json", config):
        shape = shape_from_config(source)
        assert shape.family is Mixer.GDN
        assert (shape.linear_layers, shape.heads, shape.key_dim, shape.value_dim) == (48, 48, 128, 128)
        assert shape.full_attention_layers == 16
        assert shape.conv_state_bytes == QWEN.conv_state_bytes == 2_949_120
        assert shape.kv_bytes_per_token == QWEN.kv_bytes_per_token == 65_536
        assert shape.weight_bytes == ()
    assert shape_from_config(path).name == "model"


def test_kimi_hub_config_gives_81920_kda_rows():
    shape = shape_from_config(KIMI_HUB)
    assert shape.family is Mixer.KDA
    assert (shape.linear_layers, shape.heads, shape.key_dim, shape.value_dim) == (20, 32, 128, 128)
    assert shape.num_units == KIMI.num_units == 81_920
    assert shape.full_attention_layers == 7
    assert shape.conv_state_bytes == 20 * 3 * (3 * 32 * 128) * 2 == 1_474_560
    assert shape.kv_bytes_per_token == 7 * (512 + 64) * 2 == 8_064
    assert stepquant_bytes(shape, 4).bits_per_value() == pytest.approx(4.30)


def test_float32_dtype_doubles_conv_and_kv():
    shape = shape_from_config({**QWEN38_TEXT, "dtype": "float32"})
    assert shape.conv_state_bytes == 2 * 2_949_120 and shape.kv_bytes_per_token == 2 * 65_536


@pytest.mark.parametrize(
    "config, error, match",
    [({"model_type": "llama"}, ValueError, "unsupported model_type 'llama'; supported: qwen3_next, qwen3_5"),
     ({}, ValueError, "unsupported model_type None"),
     ({**QWEN38_TEXT, "layer_types": ["linear_attention"] * 3}, ValueError, "must list num_hidden_layers=64"),
     ({**QWEN38_TEXT, "layer_types": ["mamba"] * 64}, ValueError, r"layer_types holds \['mamba'\]"),
     ({**QWEN38_TEXT, "layer_types": ["full_attention"] * 64}, ValueError, "no linear_attention layers"),
     ({**QWEN38_TEXT, "dtype": "int4"}, ValueError, "config dtype 'int4'"),
     ([1, 2], TypeError, "config must be a path or a dict")],
    ids=["llama", "no-type", "short-layer_types", "mamba-layers", "no-linear", "int4-dtype", "list"],
)
def test_bad_configs_are_rejected(config, error, match):
    with pytest.raises(error, match=match):
        shape_from_config(config)


def test_missing_config_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config file not found"):
        shape_from_config(tmp_path / "nope")


def test_configs_saved_by_transformers_match_its_own_fields(tmp_path):
    transformers = pytest.importorskip("transformers")
    cases = [
        transformers.Qwen3NextConfig(num_hidden_layers=7, linear_num_value_heads=6, linear_num_key_heads=3,
                                     linear_key_head_dim=32, linear_value_head_dim=48, num_key_value_heads=1),
        transformers.Qwen3_5Config(text_config={"num_hidden_layers": 5, "linear_num_value_heads": 4}),
        transformers.Qwen3_5MoeConfig(text_config={"num_hidden_layers": 6, "linear_value_head_dim": 64}),
        transformers.KimiLinearConfig(num_hidden_layers=9, linear_num_heads=3, linear_head_dim=40),
    ]
    for index, cfg in enumerate(cases):
        folder = tmp_path / f"m{index}"
        cfg.save_pretrained(folder)
        text = getattr(cfg, "text_config", cfg)
        shape = shape_from_config(folder)
        assert shape.linear_layers == text.layer_types.count("linear_attention"), type(cfg).__name__
        assert shape.full_attention_layers == text.layer_types.count("full_attention")
        if cfg.model_type == "kimi_linear":
            assert (shape.heads, shape.key_dim, shape.value_dim) == (3, 40, 40)
        else:
            assert (shape.heads, shape.key_dim, shape.value_dim) == (
                text.linear_num_value_heads, text.linear_key_head_dim, text.linear_value_head_dim)


# ---------------------------------------------------------------- the CLI

def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["memory", *argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_cli_qwen_6_bits(capsys):
    rc, out, _ = run_cli(capsys, "--preset", "qwen3.8-27b", "--bits", "6")
    assert rc == 0
    for text in ("30,015,488", "29,999,104", "150,994,944", "5.03x", "146.8125", "31.4375", "46.02", "9.85",
                 "32 FP16 heads of 2,304 (1.39%", "2,949,120", "53,791,996,928", "17,776,688,128"):
        assert text in out, text
    report = json.loads(out.strip().splitlines()[-1])
    step = report["formats"][4]
    assert (step["analytical_bytes"], step["serving_bytes"]) == (30_015_488, 29_999_104)
    assert report["pivots"] == 32 and report["capacity"]["slots"] == 321
    pools = {row["format"]: row["pool_gib"] for row in report["capacity"]["rows"]}
    assert round(pools["FP32"], 2) == 46.02
    assert round(pools["STEPQuant@6 (32 pivot heads) analytical"], 2) == 9.85


@pytest.mark.parametrize("bits, shown", [("4", ("4.30 bits/value", "5.3750 MiB", "7.44x")),
                                         ("6", ("6.30 bits/value", "7.8750 MiB", "5.08x"))], ids=["4b", "6b"])
def test_cli_kimi(capsys, bits, shown):
    rc, out, _ = run_cli(capsys, "--preset", "kimi-linear-48b-a3b", "--bits", bits)
    assert rc == 0
    for text in (*shown, "512 FP16 key rows of 81,920 (0.625%", "conv state unknown", "weights: unknown"):
        assert text in out, text


def test_cli_measured_bytes(capsys):
    rc, out, _ = run_cli(capsys, "--preset", "qwen3.8-27b", "--bits", "4", "--measured-bytes", "21804032")
    assert rc == 0
    assert "20,578,304" in out and "4.6209 bits/value, 6.9251x vs FP32" in out


def test_cli_error_feedback_codecs_count_the_residual(capsys):
    rc, out, _ = run_cli(capsys, "--preset", "qwen3.8-27b", "--codec", "int8-ef4,int6-ef4",
                         "--codec", "int4-ef32")
    assert rc == 0
    formats = {f["format"]: f for f in json.loads(out.strip().splitlines()[-1])["formats"]}
    assert formats["int8-ef4"]["bits_per_value"] == 8.125 + 4.125  # INT8 + INT4 residual, FP16 row scales
    assert formats["int6-ef4"]["serving_bytes"] == 37_748_736 * 10.25 / 8
    assert formats["int4-ef32"]["ratio_vs_fp32"] < 1  # an FP32 residual is no compression
    rc, _, err = run_cli(capsys, "--preset", "qwen3.8-27b", "--codec", "int8-ef12")
    assert rc == 2 and "2..8 bits" in err


def test_cli_totals_with_context(capsys):
    rc, out, _ = run_cli(capsys, "--preset", "qwen3.8-27b", "--bits", "6", "--batch", "512",
                         "--context", "1152")
    assert rc == 0
    fp32 = next(line for line in out.splitlines() if line.startswith("FP32 ") and "146.8125" in line)
    step = next(line for line in out.splitlines() if "analytical" in line and "31.4375" in line)
    assert fp32.split()[-1] == "419.73" and step.split()[-1] == "131.18"  # W4A16 column, last


def test_cli_json_only_and_pivots_override(capsys):
    rc, out, _ = run_cli(capsys, "--preset", "qwen3.8-27b", "--bits", "6", "--pivots", "0", "--json")
    assert rc == 0
    lines = out.strip().splitlines()
    assert len(lines) == 1
    report = json.loads(lines[0])
    assert report["pivots"] == 0 and report["pivots_source"] == "given"
    assert report["formats"][4]["analytical_bytes"] == 29_491_200


def test_cli_config(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(KIMI_HUB))
    rc, out, _ = run_cli(capsys, "--config", str(tmp_path / "config.json"), "--bits", "6")
    assert rc == 0
    assert "20 linear-attention layers x 32 heads" in out and "1,474,560" in out and "6.30 bits/value" in out


def test_cli_plan_counts_the_plans_own_format(capsys):
    """A temporal plan (rowwise absmax) keeps row scales only: its printed serving bytes are the packed
    pool's slot size, not the count with column scales that every plan used to get."""
    from stepquant.calibrate import Plan
    from stepquant.models import resolve
    from stepquant.pool import PackedStatePool

    plans = assets.PLANS / "gdn"
    model_dir = str(resolve("gdn"))
    shape = shape_from_config(model_dir)
    printed = {}
    for variant in ("temporal-6", "stepquant-6"):
        rc, out, _ = run_cli(capsys, "--config", model_dir, "--plan", str(plans / variant), "--json")
        assert rc == 0
        plan_row = json.loads(out)["formats"][5]
        assert plan_row["format"].startswith(f"plan {variant}")
        printed[variant] = plan_row["serving_bytes"]
    temporal, stepquant = Plan.load(plans / "temporal-6"), Plan.load(plans / "stepquant-6")
    assert not temporal.has_col_scale and stepquant.has_col_scale
    pool = PackedStatePool(temporal.layer_formats(), 1, shape.value_dim)
    assert printed["temporal-6"] == pool.bytes_per_slot == temporal.accounting()["serving_bytes"]
    # the column scales: one FP16 per value column of every head that has integer rows (not a pivot head)
    scaled_heads = sum(int((bits != 16).any(dim=1).sum()) for bits in temporal.bits)
    col_scale_bytes = scaled_heads * shape.value_dim * 2
    with_columns = plan_bytes(list(temporal.bits), shape, has_col_scale=True).serving_bytes
    assert with_columns - printed["temporal-6"] == col_scale_bytes  # what the CLI overstated before
    assert printed["stepquant-6"] - printed["temporal-6"] == col_scale_bytes  # same budget, same pivots


SHIPPED_PLANS = sorted(p.parent for p in assets.PLANS.glob("*/*/plan.json"))


@pytest.mark.parametrize("directory", SHIPPED_PLANS, ids=lambda d: f"{d.parent.name}-{d.name}")
def test_the_nominal_formulas_equal_the_layer_format_count_of_the_shipped_plans(directory):
    """A plan's bytes are its LayerFormats' (the packed layout); the paper's nominal formulas give the same
    numbers for the shipped plans, which spend their budget exactly (V = 128: no word padding)."""
    from stepquant.calibrate import Plan

    plan = Plan.load(directory)
    state, accounting = plan.state_bytes(), plan.accounting()
    formats = plan.layer_formats()
    assert state.serving_bytes == sum(f.bytes(plan.value_dim) for f in formats)
    assert state.analytical_bytes == sum(f.bytes(plan.value_dim, analytical=True) for f in formats)
    assert accounting == json.loads((directory / "plan.json").read_text())["accounting"]  # as committed
    assert accounting["slack_bits"] == 0
    assert (accounting["nominal_analytical_bytes"], accounting["nominal_serving_bytes"]) == (
        state.analytical_bytes, state.serving_bytes)
    if plan.has_col_scale:  # stepquant (pivots) and spatial (none): the paper's STEPQuant count
        nominal = stepquant_bytes(plan.shape, plan.budget_bits, plan.pivots)
    elif plan.pivots == 0:  # temporal w/o pivots: rowwise absmax at b̄ bits on average
        nominal = int_rowwise_bytes(plan.shape, plan.budget_bits)
    else:
        return  # temporal (pivots, no column scales): no formula of the paper; the accounting above
    assert (nominal.analytical_bytes, nominal.serving_bytes) == (state.analytical_bytes, state.serving_bytes)


@pytest.mark.parametrize(
    "argv, message",
    [((), "give exactly one of --preset NAME or --config"),
     (("--preset", "qwen3.8-27b", "--bits", "9"), "bits=9 is out of range"),
     (("--preset", "qwen3.8-27b", "--pivots", "5000"), "pivots=5000 heads do not fit"),
     (("--preset", "qwen3.8-27b", "--plan", "plan.json"), "plan.json does not exist"),
     (("--preset", "qwen3.8-27b", "--batch", "0"), "batch must be >= 1"),
     (("--config", str(assets.MODELS / "kda"), "--plan", str(assets.PLANS / "gdn" / "stepquant-6")),
      "the plan was calibrated for 'gdn' (qwen3_5_text, 6 GDN layers x 8 heads of 128x128), not for 'kda': "
      "model_type 'qwen3_5_text' (GDN) in the plan, 'kimi_linear' (KDA) in the model"),
     (("--preset", "qwen3.8-27b", "--plan", str(assets.PLANS / "gdn" / "stepquant-6")),
      "not for 'qwen3.8-27b': linear-attention layers 6 in the plan, 48 in the model")],
    ids=["no-model", "bits-9", "too-many-pivots", "plan-hook", "batch-0", "plan-of-another-model",
         "plan-of-another-preset"],
)
def test_cli_errors(capsys, argv, message):
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 2 and message in err


def test_cli_unknown_model_type(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    rc, _, err = run_cli(capsys, "--config", str(tmp_path))
    assert rc == 2
    assert "supported: qwen3_next, qwen3_5, qwen3_5_text, qwen3_5_moe, qwen3_5_moe_text, kimi_linear" in err

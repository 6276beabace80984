"""Tests of the state codecs: casts, rowwise absmax (+ stochastic rounding), DSQ, dual-axis fitting, mixed.

Errors are compared by relative RMS / SQNR; integer outputs bit-exact against hand-worked or naive
references; storage counts against exact formulas and the paper's byte counts.
"""

from __future__ import annotations

import math

import pytest
import torch

from stepquant.codecs import (
    CastCodec,
    DSQCodec,
    DualAxisCodec,
    DualAxisConfig,
    Grid,
    LayerFormat,
    MixedCodec,
    QState,
    UniformCodec,
    codec_names,
    make_codec,
    weighted_error,
)
from stepquant.codecs.base import FP16_SCALE_MIN, round_to_codes
from stepquant.codecs.dual_axis import dual_axis_iterates, refit_weights, row_factor, row_gains

SHAPES = [(2, 3, 100, 96), (1, 2, 128, 128), (3, 1, 7, 33)]
SHAPE_IDS = [f"N{n}-H{h}-K{k}-V{v}" for n, h, k, v in SHAPES]


def outlier_states(shape, seed=0, dtype=torch.float32):
    """Random states with heavy key-row and value-column outliers (log-normal profiles, like GDN states)."""
    gen = torch.Generator().manual_seed(seed)
    n, h, k, v = shape
    rows = torch.exp(1.2 * torch.randn(1, h, k, 1, generator=gen))
    cols = torch.exp(1.2 * torch.randn(1, h, 1, v, generator=gen))
    return (torch.randn(shape, generator=gen) * rows * cols).to(dtype)


def random_w(h, k, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.exp(0.5 * torch.randn(h, k, generator=gen))


def rel_rms(x, y):
    return ((x.double() - y.double()).pow(2).sum() / x.double().pow(2).sum()).sqrt().item()


def fp16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of FP16 values at x (x > 0, normal range)."""
    return torch.pow(2.0, torch.floor(torch.log2(x.float())) - 10)


# ------------------------------------------------------------------------------------------ registry


@pytest.mark.parametrize("name", codec_names())
def test_every_registered_name_builds_and_roundtrips(name):
    kwargs = {"bits": torch.full((2, 9), 4)} if name == "mixed" else {}
    codec = make_codec(name, **kwargs)
    x = outlier_states((2, 2, 9, 10))
    out = codec.roundtrip(x)
    assert out.dtype == torch.float32 and out.shape == x.shape
    assert rel_rms(x, out) < 0.8  # even 2 bits keeps the state's direction
    assert codec.name == name


@pytest.mark.parametrize("name", ["int9", "int1", "dual1", "dsq4-sr", "dual4-sr", "fp8", "int", "stepquant"])
def test_unknown_codec_name_lists_the_valid_ones(name):
    with pytest.raises(ValueError, match="valid names: fp32, bf16, fp16, int2"):
        make_codec(name)


def test_registry_passes_config_fields_and_kwargs():
    codec = make_codec("dual4", grid="midtread", row_stat="absmax", refit_iters=0, clip=0.9)
    assert codec.config == DualAxisConfig(grid=Grid.MIDTREAD, row_stat="absmax", clip=0.9, refit_iters=0)
    assert make_codec("int6-sr", seed=3).seed == 3 and make_codec("int6-sr").stochastic
    assert make_codec("dsq5", col_exponent=1.0).col_exponent == 1.0
    with pytest.raises(TypeError, match="either config= or the fields"):
        make_codec("dual4", config=DualAxisConfig(), refit_iters=1)


# ------------------------------------------------------------------------------------------ bad input

ALL_CODECS = [
    CastCodec("fp16"),
    UniformCodec(4),
    DSQCodec(4),
    DualAxisCodec(4),
    MixedCodec(torch.full((2, 5), 6)),
]


@pytest.mark.parametrize("codec", ALL_CODECS, ids=lambda c: c.name)
def test_bad_states_raise_clear_errors(codec):
    with pytest.raises(ValueError, match=r"\[N, H, K, V\] \(4 dims\)"):
        codec.encode(torch.zeros(2, 5, 4))
    with pytest.raises(TypeError, match="floating-point"):
        codec.encode(torch.zeros(1, 2, 5, 4, dtype=torch.int32))
    with pytest.raises(TypeError, match="torch.Tensor"):
        codec.encode([[1.0]])
    for bad in (float("nan"), float("inf")):
        x = torch.zeros(1, 2, 5, 4)
        x[0, 1, 2, 3] = bad
        with pytest.raises(ValueError, match="1 NaN/Inf"):
            codec.encode(x)


@pytest.mark.parametrize("bits", [1, 9, 0, 16])
@pytest.mark.parametrize("cls", [UniformCodec, DSQCodec, DualAxisCodec], ids=lambda c: c.__name__)
def test_bits_outside_2_to_8_raise(cls, bits):
    with pytest.raises(ValueError, match="out of range"):
        cls(bits)


def test_bad_constructor_arguments_raise():
    with pytest.raises(TypeError, match="must be an int"):
        UniformCodec(4.0)
    with pytest.raises(TypeError, match="must be an int"):
        UniformCodec(True)
    with pytest.raises(ValueError, match="dtype must be one of"):
        CastCodec("fp8")
    with pytest.raises(ValueError, match="overflow must be one of"):
        CastCodec("fp16", overflow="wrap")
    with pytest.raises(ValueError, match=r"col_exponent must be in \(0, 1\]"):
        DSQCodec(4, col_exponent=0.0)
    with pytest.raises(ValueError, match="row_stat must be one of"):
        DualAxisConfig(row_stat="median")
    with pytest.raises(ValueError, match="grid must be one of"):
        DualAxisConfig(grid="uniform")
    with pytest.raises(ValueError, match=r"clip for 4 bits must be in \(0, 1\]"):
        DualAxisConfig(clip={4: 1.5})
    with pytest.raises(ValueError, match="clip keys must be bit widths"):
        DualAxisConfig(clip={9: 0.9})
    with pytest.raises(TypeError, match="clip must be a float"):
        DualAxisConfig(clip=(0.9, 0.9))
    with pytest.raises(ValueError, match="refit_iters must be an int >= 0"):
        DualAxisConfig(refit_iters=-1)
    with pytest.raises(ValueError, match="spatial must be one of"):
        MixedCodec(torch.full((2, 5), 4), spatial="rowwise")


def test_bad_bit_plans_and_row_weights_raise():
    with pytest.raises(ValueError, match=r"values must be in 2\.\.8 or 16"):
        MixedCodec(torch.tensor([[4, 9]]))
    with pytest.raises(ValueError, match=r"values must be in 2\.\.8 or 16 \(FP16 pivot\), got \[1\]"):
        MixedCodec(torch.tensor([[1, 4]]))
    with pytest.raises(TypeError, match="integer tensor"):
        MixedCodec(torch.tensor([[4.0, 4.0]]))
    with pytest.raises(ValueError, match=r"shape \[H, K\] \(2 dims\)"):
        MixedCodec(torch.tensor([4, 4]))
    with pytest.raises(ValueError, match=r"w must have shape \[H, K\] = \[1, 2\]"):
        MixedCodec(torch.tensor([[4, 4]]), w=torch.ones(2, 1))
    with pytest.raises(ValueError, match="finite and in"):
        MixedCodec(torch.tensor([[4, 4]]), w=torch.tensor([[1.0, 0.0]]))
    with pytest.raises(ValueError, match="finite and in"):
        DualAxisCodec(4, w=torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(TypeError, match="floating-point"):
        DualAxisCodec(4, w=torch.ones(1, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"states has \[H, K\] = \[2, 5\] but w is \[H, K\] = \[1, 5\]"):
        DualAxisCodec(4, w=torch.ones(1, 5)).encode(torch.zeros(1, 2, 5, 3))
    with pytest.raises(ValueError, match=r"but bits is \[H, K\]"):
        MixedCodec(torch.full((2, 4), 4)).encode(torch.zeros(1, 2, 5, 3))


def test_decode_rejects_foreign_objects():
    with pytest.raises(TypeError, match="decodes a QState"):
        UniformCodec(4).decode(torch.zeros(1, 1, 1, 1))
    with pytest.raises(TypeError, match="decodes a torch.bfloat16 tensor"):
        CastCodec("bf16").decode(torch.zeros(1, 1, 1, 1))


# ------------------------------------------------------------------------------------------ casts


@pytest.mark.parametrize("dtype, unit_roundoff", [("fp32", 0.0), ("bf16", 2.0**-8), ("fp16", 2.0**-11)])
def test_casts_round_to_nearest_within_half_an_ulp(dtype, unit_roundoff):
    x = outlier_states((2, 3, 17, 9)) * 1e-2  # keep FP16 inside its normal range
    out = CastCodec(dtype).roundtrip(x)
    subnormal_half_spacing = 2.0**-25 if dtype == "fp16" else 0.0
    assert bool(((out - x).abs() <= unit_roundoff * x.abs() + subnormal_half_spacing).all())
    if dtype == "fp32":
        assert torch.equal(out, x)


def test_fp16_cast_saturates_by_default_and_raises_on_request():
    x = torch.tensor([1e5, -7e4, 65504.0, 3.0]).reshape(1, 1, 1, 4)
    out = CastCodec("fp16").roundtrip(x)
    assert out.flatten().tolist() == [65504.0, -65504.0, 65504.0, 3.0]
    with pytest.raises(ValueError, match="2 state values exceed the fp16 range"):
        CastCodec("fp16", overflow="raise").encode(x)
    assert torch.isfinite(CastCodec("bf16").roundtrip(x * 1e30)).all()


def test_casts_accept_other_float_dtypes():
    x = outlier_states((1, 2, 4, 4), dtype=torch.float64)
    assert CastCodec("fp32").roundtrip(x).dtype == torch.float32
    assert UniformCodec(8).roundtrip(x.to(torch.bfloat16)).dtype == torch.float32


# ------------------------------------------------------------------------------------------ uniform


def test_rowwise_absmax_golden_values():
    x = torch.tensor(
        [[1.0, -0.5, 0.25, 0.0, -1.0], [0.3, 0.1, -0.2, 0.05, 0.0], [0.0] * 5], dtype=torch.float32
    ).reshape(1, 1, 3, 5)
    q = UniformCodec(4).encode(x)
    # scales: fp16(1/7) = 1170 * 2^-13, fp16(0.3/7) = 1404 * 2^-15, zero row clamped to 2^-14
    assert q.row_scale.flatten().tolist() == [1170 * 2.0**-13, 1404 * 2.0**-15, 2.0**-14]
    assert q.codes.flatten().tolist() == [15, 4, 10, 8, 1, 15, 10, 3, 9, 8, 8, 8, 8, 8, 8]
    assert q.grid is Grid.MIDTREAD and q.col_scale is None and q.pivots is None
    expected_row0 = torch.tensor([7.0, -4.0, 2.0, 0.0, -7.0]) * (1170 * 2.0**-13)
    assert torch.equal(UniformCodec(4).decode(q)[0, 0, 0], expected_row0)
    assert torch.equal(UniformCodec(4).decode(q)[0, 0, 2], torch.zeros(5))


@pytest.mark.parametrize("bits", range(2, 9), ids=lambda b: f"{b}b")
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_rowwise_absmax_error_at_most_half_a_step(shape, bits):
    x = outlier_states(shape, seed=bits)
    q = UniformCodec(bits).encode(x).validate()
    scale = q.row_scale.float()[..., None]
    err = (q.dequantize() - x).abs()
    assert bool((err <= scale / 2 + x.abs() * 2.0**-22).all())  # + FP32 rounding
    assert int(q.codes.min()) >= 1 and int(q.codes.max()) <= 2**bits - 1
    expected_scale = (x.abs().amax(-1) / (2 ** (bits - 1) - 1)).clamp(2.0**-14, 65504).half()
    assert torch.equal(q.row_scale, expected_scale)


def test_rowwise_absmax_scale_clamps():
    x = torch.tensor([1e-9, -1e-9, 0.0, 1e9]).reshape(1, 1, 2, 2)
    q = UniformCodec(8).encode(x)
    assert q.row_scale.flatten().tolist() == [FP16_SCALE_MIN, 65504.0]
    assert q.codes[0, 0, 1].tolist() == [128, 255]  # 1e9 / 65504 is beyond the grid: clipped to +127


def test_stochastic_rounding_is_unbiased_and_seeded():
    x = outlier_states((1, 2, 6, 40), seed=5)
    codec = UniformCodec(3, stochastic=True, seed=11)
    draws = 1500
    total = torch.zeros_like(x)
    for _ in range(draws):
        total += codec.roundtrip(x)
    mean = total / draws
    step = codec.encode(x).row_scale.float()[..., None]  # the same for every draw
    # per-draw error std <= step/2, so |mean - x| <= 5 sigma of the mean, sigma = step / (2 sqrt(draws))
    assert bool(((mean - x).abs() <= 5 * step / (2 * math.sqrt(draws))).all())
    nearest_bias = (UniformCodec(3).roundtrip(x) - x).abs().mean()
    assert (mean - x).abs().mean() < nearest_bias / 10  # nearest rounding is biased, SR is not
    # the scale is rounded up so even the row's largest value is never clipped
    assert bool((x.abs().amax(-1) <= codec.encode(x).row_scale.float() * 3).all())
    # same seed -> same stream; successive calls draw fresh noise
    first, second = UniformCodec(3, True, seed=11), UniformCodec(3, True, seed=11)
    a, b = first.encode(x).codes, second.encode(x).codes
    assert torch.equal(a, b) and not torch.equal(a, first.encode(x).codes)
    generator = torch.Generator().manual_seed(0)
    c = codec.encode(x, generator=generator).codes
    assert torch.equal(c, codec.encode(x, generator=torch.Generator().manual_seed(0)).codes)


# ------------------------------------------------------------------------------------------ DSQ


@pytest.mark.parametrize("col_exponent", [1.0, 0.5])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_dsq_scales_and_error_bound(shape, col_exponent):
    x = outlier_states(shape, seed=3)
    q = DSQCodec(4, col_exponent=col_exponent).encode(x).validate()
    expected_col = (x.abs().amax(2) ** col_exponent).clamp(2.0**-14, 65504).half()
    assert torch.equal(q.col_scale, expected_col)
    y = x / q.col_scale.float()[:, :, None, :]
    expected_row = (y.abs().amax(-1) / 7).clamp(2.0**-14, 65504).half()
    assert torch.equal(q.row_scale, expected_row)
    step = q.row_scale.float()[..., None] * q.col_scale.float()[:, :, None, :]
    assert bool(((q.dequantize() - x).abs() <= step / 2 + x.abs() * 2.0**-21).all())


def test_dsq_beats_rowwise_absmax_on_column_outliers():
    x = outlier_states((2, 2, 64, 64), seed=4)
    assert rel_rms(x, DSQCodec(4).roundtrip(x)) < 0.8 * rel_rms(x, UniformCodec(4).roundtrip(x))


# ------------------------------------------------------------------------------------------ dual-axis


def naive_dual_axis(x, bits, w, grid, row_stat, clip, refit_iters):
    """The five steps of dual_axis.py written out per (request, head), as a kernel would run them."""
    n_req, n_head, k_dim, v_dim = x.shape
    codes = torch.zeros(x.shape, dtype=torch.uint8)
    rows = torch.zeros(n_req, n_head, k_dim)
    cols = torch.zeros(n_req, n_head, v_dim)
    qmax = 2 ** (bits - 1) - (1 if grid is Grid.MIDTREAD else 0.5)
    zero = 2 ** (bits - 1) - (0 if grid is Grid.MIDTREAD else 0.5)
    gain = torch.tensor(clip / qmax, dtype=torch.float32)
    low, high = (1, 2**bits - 1) if grid is Grid.MIDTREAD else (0, 2**bits - 1)

    def fp16(s):
        return s.clamp(2.0**-14, 65504).half().float()

    def quantize(y, c):
        t = y / c[None, :]
        u = torch.round(t + zero) if grid is Grid.MIDTREAD else torch.floor(t + 2 ** (bits - 1))
        return u.clamp(low, high)

    for n in range(n_req):
        for h in range(n_head):
            b_x, b_w = x[n, h], w[h]  # [K, V], [K]
            if row_stat == "absmax":
                m = b_x.abs().amax(1)
            elif row_stat == "mean_abs":
                m = b_x.abs().mean(1)
            else:
                m = torch.sqrt((b_x * b_x).mean(1))
            r = fp16(torch.sqrt(m) * (1.0 / torch.sqrt(b_w)))
            y = b_x / r[:, None]
            c = fp16((y.abs() * gain).amax(0))
            u = quantize(y, c)
            for it in range(refit_iters):
                if it > 0:
                    u = quantize(y, c)
                z = u - zero
                num = torch.einsum("k,kv->v", b_w * b_w * r, z * b_x)
                den = torch.einsum("k,kv->v", b_w * b_w * r * r, z * z)
                c = fp16(torch.where(den > 0, num / den, c))
            codes[n, h], rows[n, h], cols[n, h] = u.to(torch.uint8), r, c
    return codes, rows, cols


@pytest.mark.parametrize("refit_iters", [0, 1, 3])
@pytest.mark.parametrize("grid, row_stat", [(Grid.MIDTREAD, "absmax"), (Grid.MIDRISE, "rms"),
                                            (Grid.MIDTREAD, "mean_abs")])
@pytest.mark.parametrize("bits", [3, 6], ids=lambda b: f"{b}b")
def test_dual_axis_matches_the_written_out_algorithm(bits, grid, row_stat, refit_iters):
    x = outlier_states((2, 2, 37, 24), seed=bits)
    w = random_w(2, 37)
    config = DualAxisConfig(grid=grid, row_stat=row_stat, clip=0.9, refit_iters=refit_iters)
    q = DualAxisCodec(bits, w, config).encode(x).validate()
    codes, rows, cols = naive_dual_axis(x, bits, w, grid, row_stat, 0.9, refit_iters)
    assert q.grid is grid
    assert torch.equal(q.row_scale.float(), rows)
    # refit sums are FP32 reductions: allow one FP16 ulp where summation order could tip the rounding
    assert bool(((q.col_scale.float() - cols).abs() <= fp16_ulp(cols)).all())
    assert (q.codes != codes).float().mean().item() <= 0.002
    if refit_iters == 0:
        assert torch.equal(q.col_scale.float(), cols) and torch.equal(q.codes, codes)


@pytest.mark.parametrize("grid", list(Grid), ids=lambda g: g.value)
@pytest.mark.parametrize("bits", [2, 4, 7], ids=lambda b: f"{b}b")
def test_dual_axis_weighted_error_never_increases_with_refits(bits, grid):
    x = outlier_states((3, 2, 50, 45), seed=bits)
    w = random_w(2, 50)
    config = DualAxisConfig(grid=grid, row_stat="rms", clip=0.8, refit_iters=6)
    errors = [
        weighted_error(x, q.dequantize(), w).sum().item()
        for q in dual_axis_iterates(x, torch.full((2, 50), bits), w, config)
    ]
    assert all(later <= earlier * (1 + 1e-6) for earlier, later in zip(errors, errors[1:], strict=False))
    assert errors[-1] < errors[0] * 0.995  # and the refit does something


@pytest.mark.parametrize("grid", list(Grid), ids=lambda g: g.value)
def test_dual_axis_column_scales_are_the_weighted_least_squares_optimum(grid):
    x = outlier_states((2, 2, 40, 30), seed=7)
    w = random_w(2, 40)
    q = DualAxisCodec(4, w, DualAxisConfig(grid=grid, refit_iters=2)).encode(x)
    z = q.codes.double() - grid.zero(4)
    r = q.row_scale.double()[..., None]
    w2 = w.double()[None, :, :, None] ** 2
    optimum = (w2 * r * z * x.double()).sum(2) / (w2 * r * r * z * z).sum(2)  # [N, H, V], FP64
    optimum = optimum.clamp(2.0**-14, 65504).float()
    assert bool(((q.col_scale.float() - optimum).abs() <= fp16_ulp(optimum) / 2 * (1 + 1e-3)).all())

    def column_error(c):  # weighted squared error per column for the stored codes and row scales
        return (w2 * (x.double() - r * z * c[:, :, None, :]) ** 2).sum(2)

    stored = column_error(q.col_scale.double())
    for factor in (1 - 2.0**-8, 1 + 2.0**-8):
        assert bool((column_error(q.col_scale.double() * factor) > stored).all())


def test_dual_axis_row_weights_shift_error_to_low_impact_rows():
    x = outlier_states((4, 2, 64, 64), seed=9)
    w = torch.ones(2, 64)
    w[:, ::2] = 4.0  # even rows matter 16x more in the weighted error
    row_error = lambda out: ((out - x) ** 2).sum(-1) / (x**2).sum(-1)  # [N, H, K] relative per row
    plain = row_error(DualAxisCodec(4).roundtrip(x))
    aware = row_error(DualAxisCodec(4, w).roundtrip(x))
    assert aware[..., ::2].mean() < 0.8 * plain[..., ::2].mean()  # high-impact rows get finer steps
    assert aware[..., 1::2].mean() > plain[..., 1::2].mean()  # paid for by the low-impact rows
    weighted = lambda out: weighted_error(x, out, w).sum()
    assert weighted(DualAxisCodec(4, w).roundtrip(x)) < weighted(DualAxisCodec(4).roundtrip(x))


@pytest.mark.parametrize("bits", [3, 4, 6], ids=lambda b: f"{b}b")
def test_dual_axis_beats_rowwise_absmax_on_two_axis_outliers(bits):
    x = outlier_states((2, 2, 128, 128), seed=bits)
    assert rel_rms(x, DualAxisCodec(bits).roundtrip(x)) < rel_rms(x, UniformCodec(bits).roundtrip(x)) * 0.8


@pytest.mark.parametrize("grid", list(Grid), ids=lambda g: g.value)
def test_dual_axis_code_range_and_zero_state(grid):
    q = DualAxisCodec(2, config=DualAxisConfig(grid=grid)).encode(outlier_states((1, 1, 9, 11))).validate()
    low = 1 if grid is Grid.MIDTREAD else 0
    assert int(q.codes.min()) == low and int(q.codes.max()) == 3
    zero = torch.zeros(1, 1, 4, 5)
    out = DualAxisCodec(4, config=DualAxisConfig(grid=grid)).roundtrip(zero)
    if grid is Grid.MIDTREAD:
        assert torch.equal(out, zero)
    else:  # mid-rise has no zero level: an all-zero row decodes to +-0.5 * 2^-14 * c
        assert out.abs().max().item() <= 0.5 * 2.0**-14 * 2.0**-14


@pytest.mark.parametrize("grid", list(Grid), ids=lambda g: g.value)
def test_row_fill_brings_every_row_to_its_grid_top_and_lowers_the_error(grid):
    # a mixed head (KDA-like) and a uniform one: the column scales are set by a few rows, so without the
    # fill most rows' largest code stays far below their grid's top
    x = outlier_states((3, 2, 48, 40), seed=11)
    bits = torch.randint(3, 9, (2, 48), generator=torch.Generator().manual_seed(5))
    bits[1] = 5
    bits[0, :3] = 16  # FP16 pivot rows take no part
    w = random_w(2, 48)
    plain = DualAxisConfig(grid=grid, division="reciprocal", refit_iters=0)
    filled = DualAxisConfig(grid=grid, division="reciprocal", refit_iters=0, row_fill=True)
    before, after = (MixedCodec(bits, w, config=c).encode(x).validate() for c in (plain, filled))
    is_int = (bits != 16)[None].expand(3, -1, -1)
    top = lambda q: (q.codes.float() - grid.zero(bits.clamp(max=8))[None, :, :, None]).abs().amax(-1)
    qmax = grid.qmax(bits.clamp(max=8)).float()[None].expand(3, -1, -1)
    assert bool((top(after)[is_int] >= qmax[is_int] - 1).all())  # within one level of the top
    assert (top(before)[is_int] < qmax[is_int] - 1).float().mean() > 0.5
    assert torch.equal(after.col_scale, before.col_scale)  # no refit: the column init is kept
    assert torch.equal(after.pivots, before.pivots)
    row_error = lambda q: (((q.dequantize() - x) ** 2).sum(-1) / (x**2).sum(-1))[is_int].mean()
    assert row_error(after) < 0.5 * row_error(before)
    assert rel_rms(x, after.dequantize()) < rel_rms(x, before.dequantize())


def test_row_fill_needs_the_reciprocal_division_and_a_bool():
    with pytest.raises(ValueError, match="row_fill=True needs division='reciprocal'"):
        DualAxisConfig(row_fill=True)
    with pytest.raises(TypeError, match="row_fill must be a bool"):
        DualAxisConfig(division="reciprocal", row_fill=1)


def test_round_to_codes_ties_and_ranges():
    t = torch.tensor([-0.5, 0.5, 1.5, 2.5, -9.0, 9.0, 0.0])
    assert round_to_codes(t, 3, Grid.MIDTREAD).tolist() == [4, 4, 6, 6, 1, 7, 4]  # half to even
    assert round_to_codes(t, 3, Grid.MIDRISE).tolist() == [3, 4, 5, 6, 0, 7, 4]  # floor(t + 4)


# ------------------------------------------------------------------------------------------ mixed


def kda_plan(h, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(2, 9, (h, k), generator=gen)
    bits[0, : k // 4] = 16  # FP16 pivot rows inside a head
    return bits


@pytest.mark.parametrize("spatial", ["dual_axis", "absmax"])
@pytest.mark.parametrize("shape", SHAPES[:2], ids=SHAPE_IDS[:2])
def test_mixed_respects_per_row_bits_and_pivots(shape, spatial):
    n, h, k, v = shape
    x = outlier_states(shape, seed=2)
    bits = kda_plan(h, k)
    q = MixedCodec(bits, random_w(h, k), spatial=spatial).encode(x).validate()
    out = q.dequantize()
    is_pivot = bits == 16
    assert torch.equal(q.bits, bits.to(torch.int8))
    assert torch.equal(out[:, is_pivot], x[:, is_pivot].half().float())  # pivots to FP16 precision
    assert bool((q.codes[:, is_pivot] == 0).all()) and bool((q.row_scale[:, is_pivot] == 1).all())
    for b in range(2, 9):
        rows = bits == b
        codes = q.codes[:, rows]
        assert int(codes.max()) <= 2**b - 1
        if spatial == "absmax":
            scale = q.row_scale[:, rows].float()[..., None]
            assert bool(((out[:, rows] - x[:, rows]).abs() <= scale / 2 + x[:, rows].abs() * 2.0**-22).all())
    row_sqnr = lambda sel: -10 * math.log10(rel_rms(x[:, sel], out[:, sel]) ** 2)
    assert row_sqnr(bits == 8) > row_sqnr(bits == 4) + 12
    assert row_sqnr(bits == 4) > row_sqnr(bits == 2) + 6


def test_mixed_with_uniform_plan_equals_the_uniform_codecs():
    x = outlier_states((2, 3, 20, 12), seed=6)
    w = random_w(3, 20)
    plan = torch.full((3, 20), 5)
    dual, mixed = DualAxisCodec(5, w).encode(x), MixedCodec(plan, w).encode(x)
    assert torch.equal(dual.codes, mixed.codes) and torch.equal(dual.col_scale, mixed.col_scale)
    uniform, temporal = UniformCodec(5).encode(x), MixedCodec(plan, spatial="absmax").encode(x)
    assert torch.equal(uniform.codes, temporal.codes) and torch.equal(uniform.row_scale, temporal.row_scale)
    assert temporal.col_scale is None and temporal.pivots is None


def test_mixed_pivot_head_and_joint_column_fit():
    x = outlier_states((2, 3, 16, 8), seed=8)
    bits = torch.tensor(
        [[16] * 16, [4] * 16, [2] * 8 + [8] * 8]
    )  # a GDN pivot head, a 4-bit head, a mixed head
    q = MixedCodec(bits).encode(x)
    assert bool((q.col_scale[:, 0] == 1).all()) and bool((q.row_scale[:, 0] == 1).all())
    assert torch.equal(q.dequantize()[:, 0], x[:, 0].half().float())
    # the mixed head's column init takes the max over rows of clip_b |Y| / qmax_b
    config = DualAxisConfig(refit_iters=0)
    q0 = MixedCodec(bits, config=config).encode(x)
    y = x[:, 2] / q0.row_scale[:, 2].float()[..., None]
    gain = torch.tensor([config.gain(2)] * 8 + [config.gain(8)] * 8, dtype=torch.float32)
    expected = (y.abs() * gain[None, :, None]).amax(1).clamp(2.0**-14, 65504).half()
    assert torch.equal(q0.col_scale[:, 2], expected)


def test_per_row_tensors_of_the_kernel():
    config = DualAxisConfig(grid="midrise", clip={2: 0.6, 8: 1.0}, step_normalised_refit=False)
    bits = torch.tensor([[2, 8, 16, 8], [5, 5, 5, 5]])
    w = torch.tensor([[4.0, 1.0, 9.0, 0.25], [4.0, 1.0, 9.0, 0.25]])
    gain2, gain8, gain5 = 0.6 / 1.5, 1.0 / 127.5, 1.0 / 15.5
    gains = row_gains(bits, config)
    assert gains.tolist() == torch.tensor([[gain2, gain8, 0.0, gain8], [gain5] * 4]).tolist()
    factor = row_factor(w, bits, config)
    ratio = torch.tensor(gain8, dtype=torch.float32) / torch.tensor(gain2, dtype=torch.float32)
    expected = torch.tensor([[0.5, ratio.item(), 1.0, 2.0 * ratio.item()], [0.5, 1.0, 1.0 / 3, 2.0]])
    assert torch.allclose(factor, expected, rtol=1e-6, atol=0)
    assert torch.equal(factor[1], 1.0 / torch.sqrt(w[1]))  # one bit width per head: exactly w^(-1/2)
    assert torch.equal(refit_weights(w, bits, config), torch.where(bits == 16, 0.0, w * w))
    normalised = refit_weights(w, bits, DualAxisConfig(clip={2: 0.6}, step_normalised_refit=True))
    assert torch.equal(normalised[1], w[1] ** 2) and normalised[0, 0].item() == 16.0  # the 2-bit row: ratio 1
    assert normalised[0, 1].item() == pytest.approx(1 / ratio.item() ** 2, rel=1e-6)  # the 8-bit row


def test_mixed_heads_plain_refit_trades_high_bit_precision_for_total_error():
    x = outlier_states((3, 2, 64, 48), seed=12)
    w = random_w(2, 64)
    bits = torch.tensor([2, 8] * 32).repeat(2, 1)  # alternate 2- and 8-bit rows in both heads
    high = bits == 8
    high_sqnr = lambda out: -20 * math.log10(rel_rms(x[:, high], out[:, high]))
    runs = {}
    for name, config in {
        "init": DualAxisConfig(refit_iters=0),
        "refit": DualAxisConfig(refit_iters=2, step_normalised_refit=False),
        "step-normalised": DualAxisConfig(refit_iters=2, step_normalised_refit=True),
    }.items():
        out = MixedCodec(bits, w, config=config).roundtrip(x)
        runs[name] = (weighted_error(x, out, w).sum().item(), high_sqnr(out))
    uniform_8bit = DualAxisCodec(8, w, DualAxisConfig(refit_iters=0)).roundtrip(x)
    assert runs["init"][1] > high_sqnr(uniform_8bit) - 3  # every row gets its own grid's step
    assert runs["refit"][0] < runs["init"][0]  # the w^2 refit lowers the head's total error ...
    assert runs["refit"][1] < runs["init"][1] - 3  # ... at the cost of the 8-bit rows
    assert runs["step-normalised"][1] > runs["init"][1] - 0.5  # which step-normalised weights keep
    plan = torch.full((2, 64), 5)  # and with one width per head the two refits are identical
    a = MixedCodec(plan, w, config=DualAxisConfig(step_normalised_refit=True)).encode(x)
    b = MixedCodec(plan, w, config=DualAxisConfig(step_normalised_refit=False)).encode(x)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.col_scale, b.col_scale)


def test_layer_format_is_validated_once_and_builds_its_parts_once():
    w = torch.rand(2, 4, generator=torch.Generator().manual_seed(0)) + 0.5
    fmt = LayerFormat(torch.tensor([[4, 4, 4, 4], [6, 16, 6, 2]]), w, "absmax")
    codec = fmt.codec()
    assert codec is fmt.codec() and fmt.layout(24) is fmt.layout(24)  # built once
    assert isinstance(codec, MixedCodec) and codec.spatial == "absmax" and codec.bits is fmt.bits
    assert fmt.bits.dtype == torch.int8 and fmt.grid is Grid.MIDTREAD and not fmt.has_col_scale
    assert fmt.bytes(24) == fmt.layout(24).bytes_per_slot == codec.storage_bits(2, 4, 24) // 8
    assert fmt.bytes(24, analytical=True) == fmt.layout(24).analytical_bytes
    again = MixedCodec(fmt.bits, w, spatial="absmax")  # the public constructor validates; same codec
    x = torch.randn(1, 2, 4, 24)
    assert torch.equal(again.encode(x).codes, codec.encode(x).codes)
    with pytest.raises(ValueError, match="spatial"):
        LayerFormat(fmt.bits, None, "nope")
    with pytest.raises(ValueError, match=r"values must be in 2\.\.8 or 16"):
        LayerFormat(torch.tensor([[4, 9]]))
    with pytest.raises(ValueError, match="finite and in"):
        LayerFormat(torch.tensor([[4, 4]]), torch.tensor([[1.0, 0.0]]))
    with pytest.raises(TypeError, match="DualAxisConfig"):
        LayerFormat(fmt.bits, config={"grid": "midrise"})


@pytest.mark.parametrize("value", [1e20, 2e3, 1e-4, float("inf")], ids=["1e20", "2e3", "1e-4", "inf"])
def test_row_weights_outside_the_bound_are_refused(value):
    # finite but huge w (a damaged stats file) used to turn a whole head into NaN
    w = torch.ones(2, 4)
    w[0, 1] = value
    with pytest.raises(ValueError, match=r"finite and in \[2\^-10, 2\^10\].*damaged plan or statistics"):
        LayerFormat(torch.full((2, 4), 6), w)
    w[0, 1] = 2.0**10  # the bound itself is accepted, and quantizes without NaN
    x = torch.randn(3, 2, 4, 8, generator=torch.Generator().manual_seed(1))
    assert torch.isfinite(LayerFormat(torch.full((2, 4), 6), w).codec().roundtrip(x)).all()


@pytest.mark.parametrize("grid, refit_iters, spreads", [("midtread", 2, False), ("midrise", 0, False),
                                                       ("midrise", 2, True)],
                         ids=["midtread", "midrise-refit0", "midrise-refit2"])
@pytest.mark.parametrize("outlier", [1e10, 1e30, 3e38], ids=["1e10", "1e30", "3e38"])
def test_an_extreme_state_value_saturates_and_stays_in_its_head(grid, refit_iters, spreads, outlier):
    # what the dual_axis module docstring says of extreme values
    gen = torch.Generator().manual_seed(2)
    fmt = LayerFormat(torch.full((2, 16), 6), torch.rand(2, 16, generator=gen) + 0.5, "dual_axis",
                      DualAxisConfig(grid=grid, refit_iters=refit_iters))
    x = torch.randn(2, 2, 16, 16, generator=gen)
    base = fmt.codec().roundtrip(x)
    x_out = x.clone()
    x_out[0, 0, 3, 5] = outlier
    y = fmt.codec().roundtrip(x_out)
    assert torch.isfinite(y).all() and 9e9 <= float(y[0, 0, 3, 5]) <= 65504.0**2 * 32
    assert torch.equal(y[0, 1], base[0, 1]) and torch.equal(y[1], base[1])  # other heads and requests
    rest = torch.ones(16, 16, dtype=torch.bool)
    rest[3], rest[:, 5] = False, False  # all but the outlier's key row and value column
    error, error_before = ((y - x_out)[0, 0][rest] ** 2).sum(), ((base - x)[0, 0][rest] ** 2).sum()
    if spreads:  # mid-rise has no zero level: the outlier row's huge levels pull the refit of every column
        assert error > 100 * error_before
    else:
        assert error < 2 * error_before


# ------------------------------------------------------------------------------------------ storage


def test_storage_bits_exact_small_config():
    h, k, v = 3, 5, 7
    assert make_codec("fp32").storage_bits(h, k, v) == 105 * 32
    assert make_codec("bf16").storage_bits(h, k, v) == make_codec("fp16").storage_bits(h, k, v) == 105 * 16
    assert make_codec("int4").storage_bits(h, k, v) == 3 * 5 * (4 * 7 + 16)
    assert make_codec("int4-sr").storage_bits(h, k, v) == 660
    assert (
        make_codec("dsq4").storage_bits(h, k, v)
        == make_codec("dual4").storage_bits(h, k, v)
        == 3 * (140 + 192)
    )
    bits = torch.tensor([[16] * 5, [4] * 5, [2, 3, 16, 8, 6]])
    # packed codes (docs/format.md): each plane of a row of 7 values in whole int32 words: 16 bits -> 4
    # words (a pivot row), 8 -> 2, 4 -> 1, 2 -> 1, 1 -> 1; so 3 = 2 + 1 -> 2 words and 6 = 4 + 2 -> 2
    codes = 32 * (5 * 4 + 5 * 1 + (1 + 2 + 4 + 2 + 2))
    dual, absmax = MixedCodec(bits), MixedCodec(bits, spatial="absmax")
    assert dual.storage_bits(h, k, v) == codes + 2 * 16 * (5 + 7)  # the pivot head carries no scales
    assert dual.storage_bits(h, k, v, analytical=True) == codes + 3 * 16 * (5 + 7)
    assert absmax.storage_bits(h, k, v) == codes + 2 * 16 * 5
    assert absmax.storage_bits(h, k, v, analytical=True) == codes + 3 * 16 * 5
    assert make_codec("int4").bits_per_value(1, 128, 128) == 4.125
    assert make_codec("dual6").bits_per_value(1, 128, 128) == 6.25
    with pytest.raises(ValueError, match="does not match the plan"):
        dual.storage_bits(3, 6, 7)
    with pytest.raises(ValueError, match="num_heads must be a positive int"):
        make_codec("int4").storage_bits(0, 5, 7)


def test_storage_bits_reproduce_the_papers_qwen_count():
    # Qwen3.8-27B: 48 GDN layers x 48 heads of 128x128; STEPQuant@6 with 32 FP16 pivot heads. The integer
    # budget is 6 N - 8 N_piv; one plan meeting it exactly: 32 pivot heads, 32 heads at 4 bits, the rest 6.
    head_bits = torch.full((48 * 48,), 6)
    head_bits[::72], head_bits[1::72] = 16, 4
    plans = head_bits.view(48, 48, 1).expand(48, 48, 128)  # GDN: constant within a head
    layers = [MixedCodec(plans[layer]) for layer in range(48)]
    serving = sum(c.storage_bits(48, 128, 128) for c in layers)
    analytical = sum(c.storage_bits(48, 128, 128, analytical=True) for c in layers)
    assert sum(c.num_pivot_rows for c in layers) == 32 * 128
    assert (analytical // 8, serving // 8) == (30_015_488, 29_999_104)
    assert analytical % 8 == serving % 8 == 0


def test_storage_bits_reproduce_the_papers_kimi_count():
    # Kimi-Linear-48B: 81,920 KDA key rows of 128 values (20 layers x 32 heads); 4-bit budget with 512
    # FP16 pivot rows (at most one per head) and 2,048 rows at 3 bits keeping sum b = 4 N - 8 N_piv.
    row_bits = torch.full((81_920,), 4)
    row_bits[::160], row_bits[1::40] = 16, 3
    layers = [MixedCodec(plan) for plan in row_bits.view(20, 32, 128)]
    assert sum(c.num_pivot_rows for c in layers) == 512
    total = sum(c.storage_bits(32, 128, 128) for c in layers)
    assert total == sum(c.storage_bits(32, 128, 128, analytical=True) for c in layers)  # no pivot heads
    assert total / (81_920 * 128) == pytest.approx(4.30, abs=1e-12)
    assert total / 8 / 2**20 == 5.375


# ------------------------------------------------------------------------------------------ QState


def test_qstate_validate_catches_contract_violations():
    q = UniformCodec(3).encode(outlier_states((1, 2, 4, 5)))
    q.validate()
    bad = QState(q.codes.clone(), q.bits, q.row_scale, None, None)
    bad.codes[0, 0, 0, 0] = 0  # code 0 is unused on the mid-tread grid
    with pytest.raises(ValueError, match="1 codes lie outside"):
        bad.validate()
    with pytest.raises(ValueError, match="row_scale must be torch.float16"):
        QState(q.codes, q.bits, q.row_scale.float(), None, None).validate()
    with pytest.raises(ValueError, match="marks FP16 pivot rows but pivots is None"):
        QState(q.codes, torch.full_like(q.bits, 16), q.row_scale, None, None).validate()

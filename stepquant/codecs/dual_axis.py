"""Key-row-aware dual-axis fitting: STEPQuant's spatial quantizer (docs/method.md section 3).

Each head's state X [K, V] is stored as X ~ diag(r) Z diag(c): one FP16 scale per key row (r), one per
value column (c), and b-bit codes Z on a symmetric grid whose normalisation is fixed by b (it costs
no metadata). Row-impact factors w [H, K] (w_i > 0; w = 1 is the impact-free variant) make rows that
the readout weighs more get a finer step, and the column scales are refitted for the w^2-weighted
error. The algorithm is written so that a GPU kernel can run it per (request, head) on one register
tile, and ``stepquant/kernels`` re-implements exactly this: grid, row_stat and refit_iters are
constexpr flags, and three per-row FP32 tensors come with the plan (:func:`row_factor`,
:func:`row_gains`, :func:`refit_weights`):

1. m_i  = row statistic of X row i, ``row_stat``: "absmax" (max_j |X_ij|), "rms" (sqrt(mean_j X_ij^2)) or
          "mean_abs" (mean_j |X_ij|, the authors' public code's choice).
2. r_i  = fp16(clamp(sqrt(m_i) * f_i, 2^-14, 65504))   (sqrt correctly rounded), f_i = row_factor =
          w_i^(-1/2) * gain_b(i) / gain_ref(h), with gain_ref(h) the largest gain_b among the head's
          integer rows, so f_i = w_i^(-1/2) exactly (ratio 1.0) in every head whose integer rows share
          one bit width (all GDN heads, all uniform-bit codecs).
3. Y    = X / r  (row-normalised);  c_j = fp16(clamp(max_i |Y_ij| * gain_b(i), 2^-14, 65504))
          with gain_b = clip_b / qmax_b (one FP32 constant per bit width, :meth:`DualAxisConfig.gain`),
          qmax_b = Grid.qmax(b) and clip_b in (0, 1] the per-bit clipping ratio.
3b. with ``row_fill``: r_i = fp16(clamp(r_i * u_i)), u_i = max_j |Y_ij / c_j| * gain_b(i) (the fraction
          of row i's grid its largest value reaches), and Y = Y * fl(r_old * fl(1 / r_new)) (from step 3's
          Y, which is what the kernels hold; so row_fill needs division="reciprocal"). Coordinate descent on
          the rows after the columns: the column maxima are set by a few rows, and without it the others,
          most often the narrow rows of a mixed head, keep a third of their levels (docs/eval.md section 11).
4. codes u_ij = round_to_codes(Y_ij / c_j, b_i, grid)  (base.py: MIDTREAD rint, MIDRISE floor).
5. ``refit_iters`` times: with codes fixed (levels z = u - zero(b)), the weighted least-squares column
          scale  c_j = sum_i v_i r_i z_ij X_ij / sum_i v_i r_i^2 z_ij^2  with row weights v_i =
          refit_weights = w_i^2 in every head of one bit width (columns whose denominator is 0 keep
          their previous c_j; mixed heads: see below), then
          fp16(clamp(.)); except after the last iteration the codes are recomputed against the new c
          (step 4). So the stored (codes, c) pair is always consistent: c is the fitted optimum for
          exactly those codes (or the init when refit_iters = 0).

Every step is non-increasing in the weighted error sum_ij v_i (X_ij - r_i z_ij c_j)^2: the error is a
separate quadratic per column, nearest-FP16 rounding of its minimiser cannot land farther from it
than the previous FP16 c_j, and nearest-level codes minimise each element's error for fixed scales.

Mixed bits within a head (KDA units are key rows): grid, qmax_b and clip_b are per row, the column init
is the max over rows of |Y_ij| * gain_b(i), and the refit formula is unchanged (z_ij is each row's own
level). The gain ratio in f_i is the codebook normalisation fixed by b: it makes the stored row scale of
a b-bit row gain_b / gain_ref times smaller, so X_ij / (r_i c_j) spans row i's own grid (|.| <=
qmax_b / clip_b) and an 8-bit row gets an 8-bit step. Without it the shared column scale is set by the
lowest-precision row and every row of the head gets that row's coarse step (measured: an 8-bit row in
a head with 2-bit rows came out barely better than a 4-bit row).
The w^2 refit then trades precision between the rows of a mixed head: it lowers the head's total
weighted error, mostly that of its low-bit rows, by moving c_j away from what the high-bit rows need,
so those can lose much of their extra precision (tests/test_codecs.py pins both effects). The default
``step_normalised_refit=True`` instead weights each row's error in units of its own step (v_i = w_i^2
(gain_ref / gain_b(i))^2), which keeps the high-bit rows' precision, gave the better readout in the
mixed-plan drift probe of docs/codec_study.md, and changes nothing in heads of one bit width;
``step_normalised_refit=False`` is the plain w^2 objective (the paper's wording).

FP16 pivot rows (bits 16) take no part in the fit: their values go to ``pivots``; their code is 0 and
their row scale 1.0 (unused). A head with no integer row gets column scales 1.0 (unused).
Row sums ("rms", "mean_abs") and the refit are FP32 reductions, so a kernel may differ from this reference
by FP32 summation order; with row_stat="absmax" and refit_iters=0 the result is order-independent.

Extreme values (e.g. one 1e30 in a head of O(1) values; the delta rule itself keeps a state within a sum
of |beta| ||k|| ||v|| over the tokens, so this means extreme inputs) never give NaN or inf: the scales
clamp at 65504, so the value saturates (to about 65504^2 qmax / clip, 1.3e11 at 6 bits), and the damage
stays in its head (other heads and other requests are bit-identical). Within the head its key row and
value column take the outlier's scales: on the mid-tread grid their other values round to 0 and the rest
of the head keeps its precision; on the mid-rise grid (no zero level) every value of the column is
stored as at least +-r_i c_j / 2, and the refit of the other columns is dominated by the outlier row's
huge levels, so the whole head loses its precision (tests/test_codecs.py pins all of it).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .base import (
    FP16_MAX,
    MAX_BITS,
    MIN_BITS,
    PIVOT_BITS,
    Codec,
    Grid,
    QState,
    as_fp32,
    check_bits,
    check_bits_plan,
    check_dims,
    check_state_heads,
    code_levels,
    fp16_scale,
    parse_grid,
    round_to_codes,
)

ROW_STATS = ("absmax", "rms", "mean_abs")
BIT_WIDTHS = tuple(range(MIN_BITS, MAX_BITS + 1))  # the bit widths a clip table covers, 2..8

# Defaults chosen by studies/codec_study.py on synthetic gated-delta-rule states; the table, the
# command and the evidence are in docs/codec_study.md.
DEFAULT_GRID = Grid.MIDRISE
DEFAULT_ROW_STAT = "rms"
DEFAULT_CLIP = (0.6, 0.85, 0.95, 1.0, 1.0, 1.0, 1.0)  # clip_b for b = 2..8
DEFAULT_REFIT_ITERS = 2
DEFAULT_STEP_NORMALISED_REFIT = True  # changes only heads with mixed bit widths
DIVISIONS = ("exact", "reciprocal")
DEFAULT_DIVISION = "exact"
DEFAULT_ROW_FILL = False  # plans written before it existed did not fill their rows


def _normalise_clip(clip) -> tuple[float, ...]:
    """A clip table for b = 2..8 from a float (all bits), a {bits: clip} dict (others default) or 7 floats."""
    if isinstance(clip, bool):
        raise TypeError(f"clip must be a float, a {{bits: float}} dict or 7 floats (b = 2..8), got {clip!r}")
    if isinstance(clip, (int, float)):
        table = (float(clip),) * len(BIT_WIDTHS)
    elif isinstance(clip, dict):
        unknown = [b for b in clip if b not in BIT_WIDTHS]
        if unknown:
            raise ValueError(f"clip keys must be bit widths in {MIN_BITS}..{MAX_BITS}, got {unknown}")
        table = tuple(float(clip.get(b, DEFAULT_CLIP[b - MIN_BITS])) for b in BIT_WIDTHS)
    elif isinstance(clip, (tuple, list)) and len(clip) == len(BIT_WIDTHS):
        table = tuple(float(c) for c in clip)
    else:
        raise TypeError(f"clip must be a float, a {{bits: float}} dict or 7 floats (b = 2..8), got {clip!r}")
    for b, c in zip(BIT_WIDTHS, table, strict=True):
        if not (math.isfinite(c) and 0.0 < c <= 1.0):
            raise ValueError(f"clip for {b} bits must be in (0, 1], got {c}")
    return table


@dataclass(frozen=True)
class DualAxisConfig:
    """The fixed parameters of the fitting algorithm (each one a constexpr flag of the kernel).

    grid:        Grid.MIDTREAD or Grid.MIDRISE (or its name)
    row_stat:    "absmax", "rms" or "mean_abs": the row magnitude m_i
    clip:        clip_b in (0, 1] for b = 2..8: a float for all bits, a {bits: clip} dict, or 7 floats
    refit_iters: number of weighted least-squares column refits, >= 0
    step_normalised_refit: weight row i's refit error by w_i^2 (gain_ref / gain_b(i))^2 instead of w_i^2,
                 i.e. in units of the row's own step (:func:`refit_weights`); only changes heads with
                 mixed bit widths (see the module docstring)
    division:    "exact": Y = X / r and codes of Y / c by true FP32 division, the code offset added
                 in FP32, refit numerator sum v r z X (the first quantizer); "reciprocal": Y = X * (1 / r)
                 and Y * (1 / c), each reciprocal correctly rounded once per row / column, codes from the
                 exact sum (round_to_codes exact_sum=True), refit numerator sum (v r^2 z) Y: one multiply
                 and one directed-rounding add per value instead of a division and two adds, which is
                 what the CUDA decode kernel computes
    row_fill:    after the column init, rescale each integer row so that its largest |value| reaches the
                 top of its own grid (step 3b of the module docstring); without it a row whose values are
                 small next to the column maxima other rows set uses a fraction of its levels
    """

    grid: Grid = DEFAULT_GRID
    row_stat: str = DEFAULT_ROW_STAT
    clip: tuple[float, ...] = DEFAULT_CLIP
    refit_iters: int = DEFAULT_REFIT_ITERS
    step_normalised_refit: bool = DEFAULT_STEP_NORMALISED_REFIT
    division: str = DEFAULT_DIVISION
    row_fill: bool = DEFAULT_ROW_FILL

    def __post_init__(self) -> None:
        object.__setattr__(self, "grid", parse_grid(self.grid))
        if self.row_stat not in ROW_STATS:
            raise ValueError(f"row_stat must be one of {list(ROW_STATS)}, got {self.row_stat!r}")
        object.__setattr__(self, "clip", _normalise_clip(self.clip))
        iters = self.refit_iters
        if isinstance(iters, bool) or not isinstance(iters, int) or iters < 0:
            raise ValueError(f"refit_iters must be an int >= 0, got {self.refit_iters!r}")
        if not isinstance(self.step_normalised_refit, bool):
            raise TypeError(f"step_normalised_refit must be a bool, got {self.step_normalised_refit!r}")
        if self.division not in DIVISIONS:
            raise ValueError(f"division must be one of {list(DIVISIONS)}, got {self.division!r}")
        if not isinstance(self.row_fill, bool):
            raise TypeError(f"row_fill must be a bool, got {self.row_fill!r}")
        if self.row_fill and self.division != "reciprocal":
            raise ValueError("row_fill=True needs division='reciprocal' (the filled rows are rescaled from "
                             "Y, as the kernels hold it; exact division would need X again): pass both")

    def clip_for(self, bits: int) -> float:
        return self.clip[check_bits(bits) - MIN_BITS]

    def gain(self, bits: int) -> float:
        """clip_b / qmax_b in double precision; the kernel uses it as one FP32 constant."""
        return self.clip_for(bits) / self.grid.qmax(bits)


# Row-impact factors outside [2^-10, 2^10] are refused. Calibration gives each head geometric mean 1 and
# a spread of at most omega_floor^-exponent (1e-6^-1/8 = 5.6 by default; the shipped plans span 0.43 ..
# 2.41); beyond the bound the fit degrades (one row at w = 1e6: mean squared error x1e5 at 6 bits) and
# then breaks (w = 1e20: w^2 overflows FP32 in the refit, the whole head decodes to NaN).
ROW_WEIGHT_RANGE = (2.0**-10, 2.0**10)


def check_row_weights(w: torch.Tensor | None, num_heads: int, key_dim: int, name: str = "w") -> torch.Tensor:
    """Row-impact factors as FP32 [H, K], finite and within :data:`ROW_WEIGHT_RANGE`; None means all
    ones (impact-free)."""
    if w is None:
        return torch.ones(num_heads, key_dim, dtype=torch.float32)
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{name} must be a float torch.Tensor [H, K] or None, got {type(w).__name__}")
    if not w.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {w.dtype}")
    if tuple(w.shape) != (num_heads, key_dim):
        raise ValueError(f"{name} must have shape [H, K] = {[num_heads, key_dim]}, got {list(w.shape)}")
    w = w.detach().to(torch.float32)
    low, high = ROW_WEIGHT_RANGE
    if not bool(((w >= low) & (w <= high)).all()):  # NaN fails both comparisons
        raise ValueError(
            f"{name} (row-impact factors) must be finite and in [2^-10, 2^10], got values from "
            f"{w.min().item():g} to {w.max().item():g} (calibration normalises them to geometric mean 1 "
            "per head; far larger or smaller values come from a damaged plan or statistics file, or from "
            "an extreme --exponent / --omega-floor)"
        )
    return w


def row_gains(bits: torch.Tensor, config: DualAxisConfig) -> torch.Tensor:
    """gain_b(i) = clip_b / qmax_b of every row of a plan [H, K] as FP32 [H, K]; 0 for FP16 pivot rows."""
    plan = check_bits_plan(bits).to(torch.int64)
    gains = [0.0] + [config.gain(b) for b in BIT_WIDTHS]
    table = torch.tensor(gains, dtype=torch.float32, device=plan.device)
    return table[torch.where(plan == PIVOT_BITS, 0, plan - MIN_BITS + 1)]


def _step_ratio(bits: torch.Tensor, config: DualAxisConfig) -> torch.Tensor:
    """gain_b(i) / gain_ref(h) per row [H, K]: exactly 1.0 where a head's integer rows share one width."""
    gains = row_gains(bits, config)  # [H, K]
    reference = gains.amax(dim=1, keepdim=True)  # [H, 1]
    return torch.where(gains > 0, gains / reference.clamp_min(1e-30), torch.ones_like(gains))


def row_factor(w: torch.Tensor | None, bits: torch.Tensor, config: DualAxisConfig) -> torch.Tensor:
    """f_i of step 2 as FP32 [H, K]: (1 / sqrt(w_i)) * (gain_b(i) / gain_ref(h)); 1.0 for pivot rows.

    gain_ref(h) is the largest gain_b among the head's integer rows, so the ratio is exactly 1.0 when
    they share one bit width. A kernel loads this per-row tensor with the plan (w=None means w = 1).
    """
    plan = check_bits_plan(bits)
    w = check_row_weights(w, *plan.shape).to(plan.device)  # the plan's device (CUDA when calibrating there)
    factor = (1.0 / torch.sqrt(w)) * _step_ratio(plan, config)
    return torch.where(plan == PIVOT_BITS, torch.ones_like(factor), factor)


def refit_weights(w: torch.Tensor | None, bits: torch.Tensor, config: DualAxisConfig) -> torch.Tensor:
    """Row weights of the step-5 refit as FP32 [H, K]: w_i^2, or w_i^2 (gain_ref / gain_b(i))^2 with
    config.step_normalised_refit; 0 for pivot rows (they take no part in the fit)."""
    plan = check_bits_plan(bits)
    w = check_row_weights(w, *plan.shape).to(plan.device)  # the plan's device (CUDA when calibrating there)
    weights = w * w
    if config.step_normalised_refit:
        inverse_step = 1.0 / _step_ratio(plan, config)
        weights = weights * (inverse_step * inverse_step)
    return torch.where(plan == PIVOT_BITS, torch.zeros_like(weights), weights)


def row_statistic(x: torch.Tensor, row_stat: str) -> torch.Tensor:
    """m_i of every key row: [N, H, K, V] -> [N, H, K]."""
    if row_stat == "absmax":
        return x.abs().amax(dim=-1)
    if row_stat == "mean_abs":
        return x.abs().sum(dim=-1) * (1.0 / x.shape[-1])  # sum x (1/V), as both kernels compute it
    return torch.sqrt((x * x).mean(dim=-1))


def fit_dual_axis(
    states: torch.Tensor,
    bits: torch.Tensor,
    w: torch.Tensor | None = None,
    config: DualAxisConfig = DualAxisConfig(),
) -> QState:
    """Key-row-aware dual-axis fit (module docstring) of states [N, H, K, V] under a bit plan [H, K].

    bits: int tensor [H, K] of 2..8, or 16 for FP16 pivot rows; w: row-impact factors [H, K] or None.
    Returns one QState on config.grid with row and column scales (and pivots if any row is 16).
    """
    *_, last = dual_axis_iterates(states, bits, w, config)
    return last


def dual_axis_iterates(
    states: torch.Tensor,
    bits: torch.Tensor,
    w: torch.Tensor | None = None,
    config: DualAxisConfig = DualAxisConfig(),
) -> Iterator[QState]:
    """The fits with 0, 1, ..., config.refit_iters refits, in order, computed in one pass.

    The k-th QState yielded is exactly fit_dual_axis with refit_iters = k (same codes and scales);
    studies use it to compare iteration counts without refitting from scratch.
    """
    x = as_fp32(states)  # [N, H, K, V]
    num_heads, key_dim = x.shape[1:3]
    plan = check_bits_plan(bits)
    check_state_heads(x, *plan.shape, "bits")
    w = check_row_weights(w, num_heads, key_dim)  # [H, K]
    if not isinstance(config, DualAxisConfig):
        raise TypeError(f"config must be a DualAxisConfig, got {type(config).__name__}")
    grid = config.grid
    # the three per-row FP32 tensors a kernel loads with the plan
    factor = row_factor(w, plan, config).to(x.device)  # [H, K]  f_i of step 2
    row_gain = row_gains(plan, config).to(x.device)  # [H, K]  gain_b(i) of step 3
    w2 = refit_weights(w, plan, config).to(x.device)  # [H, K]  row weights of step 5
    plan = plan.to(x.device)
    is_pivot = plan == PIVOT_BITS  # [H, K]
    is_int = ~is_pivot
    # pivot rows get a placeholder width so per-row tables can be indexed; they are masked out below
    row_bits = torch.where(is_pivot, torch.full_like(plan, MAX_BITS), plan).to(torch.int64)
    b_bits = row_bits[None, :, :, None]  # [1, H, K, 1]
    b_int = is_int[None, :, :, None]  # [1, H, K, 1]
    has_int = is_int.any(dim=1)[None, :, None]  # [1, H, 1]: heads with at least one integer row
    pivots = None
    if bool(is_pivot.any()):
        pivots = torch.where(b_int, torch.zeros_like(x), x.clamp(-FP16_MAX, FP16_MAX)).to(torch.float16)

    def emit(codes: torch.Tensor, c: torch.Tensor) -> QState:
        codes = torch.where(b_int, codes, torch.zeros_like(codes))
        c = torch.where(has_int, c, torch.ones_like(c))
        return QState(codes, plan.to(torch.int8), r.to(torch.float16), c.to(torch.float16), pivots, grid)

    # steps 1-2: row scales
    m = row_statistic(x, config.row_stat)  # [N, H, K]
    r = fp16_scale(torch.sqrt(m) * factor)  # [N, H, K]
    r = torch.where(is_int, r, torch.ones_like(r))
    # step 3: column init on the row-normalised state
    y = scale_down(x, r[..., None], config)  # [N, H, K, V]
    c_init = torch.where(b_int, y.abs() * row_gain[None, :, :, None], torch.zeros_like(y)).amax(dim=2)
    c = fp16_scale(c_init)  # [N, H, V]
    if config.row_fill:  # step 3b
        y, r = fill_rows(y, r, c, plan, config)
    # step 4: codes
    codes = codes_for(y, c, b_bits, config)  # [N, H, K, V]
    yield emit(codes, c)
    # step 5: weighted least-squares refits of c with the codes fixed
    w2r = w2[None] * r  # [N, H, K]
    w2r2 = w2r * r
    for iteration in range(config.refit_iters):
        if iteration > 0:  # codes against the previous refit (never after the last one)
            codes = codes_for(y, c, b_bits, config)
        z = torch.where(b_int, code_levels(codes, b_bits, grid), torch.zeros_like(x))  # [N, H, K, V]
        if config.division == "reciprocal":  # (v r^2 z) Y: the product the kernel shares between both sums
            numerator = ((w2r2[..., None] * z) * y).sum(dim=2)
        else:
            numerator = torch.einsum("nhk,nhkv->nhv", w2r, z * x)
        denominator = torch.einsum("nhk,nhkv->nhv", w2r2, z * z)
        c = fp16_scale(torch.where(denominator > 0, numerator / denominator, c))
        yield emit(codes, c)


def fill_rows(y: torch.Tensor, r: torch.Tensor, c: torch.Tensor, bits: torch.Tensor,
              config: DualAxisConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 3b: (Y', r') from Y [N, H, K, V], its row scales r [N, H, K] and the column scales c [N, H, V].

    r'_i = fp16(clamp(r_i u_i)) with u_i = max_j |Y_ij / c_j| gain_b(i), and Y' = Y * fl(r_i * fl(1 / r'_i))
    (pivot rows keep Y and r' = 1). The one definition of the fill: the kernels' row scales are checked
    against it given their pre-fill r (tests/kernel_checks.py).
    """
    is_int = (bits != PIVOT_BITS).to(y.device)  # [H, K]
    t = scale_down(y, c[:, :, None, :], config)  # [N, H, K, V]
    used = t.abs().amax(dim=-1) * row_gains(bits, config).to(y.device)[None]  # [N, H, K]; 0 on pivot rows
    filled = torch.where(is_int, fp16_scale(r * used), torch.ones_like(r))
    factor = torch.where(is_int, r * (1.0 / filled), torch.ones_like(r))  # the kernels keep Y, not X
    return y * factor[..., None], filled


def scale_down(a: torch.Tensor, scale: torch.Tensor, config: DualAxisConfig) -> torch.Tensor:
    """a / scale as the quantizer divides: true FP32 division, or a * fl(1 / scale) ("reciprocal")."""
    return a * (1.0 / scale) if config.division == "reciprocal" else a / scale


def codes_for(y: torch.Tensor, c: torch.Tensor, bits: torch.Tensor | int,
              config: DualAxisConfig) -> torch.Tensor:
    """Step 4: the codes of the row-normalised state Y [N, H, K, V] against column scales c [N, H, V].

    bits broadcasts against Y (e.g. [1, H, K, 1]). The one definition of the codes a fit stores given its
    scales: the kernels' codes are checked against it.
    """
    reciprocal = config.division == "reciprocal"
    return round_to_codes(scale_down(y, c[:, :, None, :], config), bits, config.grid, exact_sum=reciprocal)


def weighted_error(states: torch.Tensor, approx: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
    """sum_ij w_i^2 (X_ij - X_hat_ij)^2 per (n, h): [N, H] (FP64), the objective the fit minimises."""
    diff = (states.to(torch.float64) - approx.to(torch.float64)) ** 2  # [N, H, K, V]
    if w is None:
        return diff.sum(dim=(-1, -2))
    return torch.einsum("hk,nhkv->nh", w.to(torch.float64) ** 2, diff)


@dataclass(frozen=True, eq=False)
class DualAxisCodec(Codec):
    """STEPQuant's spatial quantizer at one uniform bit width ("spatial only"; see module docstring).

    bits:   2..8
    w:      row-impact factors [H, K] (> 0) or None for w = 1 (impact-free)
    config: the fitting algorithm's parameters (defaults from docs/codec_study.md)
    """

    bits: int = 4
    w: torch.Tensor | None = None
    config: DualAxisConfig = field(default_factory=DualAxisConfig)
    name: str = field(init=False)

    def __post_init__(self) -> None:
        check_bits(self.bits)
        if self.w is not None:
            if not isinstance(self.w, torch.Tensor) or self.w.dim() != 2:
                got = tuple(self.w.shape) if isinstance(self.w, torch.Tensor) else type(self.w).__name__
                raise ValueError(f"w must be a float tensor [H, K] or None, got {got}")
            check_row_weights(self.w, *self.w.shape)
        if not isinstance(self.config, DualAxisConfig):
            raise TypeError(f"config must be a DualAxisConfig, got {type(self.config).__name__}")
        object.__setattr__(self, "name", f"dual{self.bits}")

    def encode(self, states: torch.Tensor) -> QState:
        """states [N, H, K, V] -> QState with row and column scales, uniform bits."""
        x = as_fp32(states)
        plan = torch.full(tuple(x.shape[1:3]), self.bits, dtype=torch.int8)
        if self.w is not None:
            check_state_heads(x, *self.w.shape, "w")
        return fit_dual_axis(x, plan, self.w, self.config)

    def decode(self, encoded: QState) -> torch.Tensor:
        if not isinstance(encoded, QState):
            raise TypeError(f"{self.name} codec decodes a QState, got {type(encoded).__name__}")
        return encoded.dequantize()

    def storage_bits(self, num_heads: int, key_dim: int, value_dim: int, *, analytical: bool = False) -> int:
        """Codes b*K*V plus FP16 row (K) and column (V) scales, per head."""
        check_dims(num_heads, key_dim, value_dim)
        return num_heads * (self.bits * key_dim * value_dim + 16 * (key_dim + value_dim))

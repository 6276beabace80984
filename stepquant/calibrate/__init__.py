"""Calibration: observe a model's linear-attention recurrences, measure lifetimes / row impact / distortion,
allocate bits (lifetime-aware, exact knapsack, FP16 pivots) and write validated quantization plans.

    observers.py  RecurrenceObserver (captures q, k, v, g, beta per layer), replay (FP32 reference)
    stats.py      collect_stats -> CalibrationStats (stats.safetensors), unit_half_lives, row_impact_factors
    allocate.py   allocate -> Allocation (variants stepquant / temporal / temporal-nopivot / spatial)
    plan.py       Plan (plan.json v2 + plan.safetensors): load/validate, layer_format(i) / codec(i), bytes
    quantizer.py  the quantizer block (DualAxisConfig <-> JSON) of plans and statistics, V1_QUANTIZER
    cli.py        `stepquant calibrate`

docs/calibration.md describes the method choices, the commands and the measured timings.
"""

from .allocate import (
    DEFAULT_HORIZON,
    VARIANTS,
    Allocation,
    Variant,
    allocate,
    default_candidates,
    lifetime_weights,
    select_pivots,
    solve_allocation,
)
from .observers import (
    RecurrenceCapture,
    RecurrenceObserver,
    Replay,
    replay,
    replay_error,
)
from .plan import Plan, build_plan, load_plan, model_shape, plan_accounting
from .stats import (
    CalibrationStats,
    StatsConfig,
    collect_stats,
    half_life_census,
    row_impact_factors,
    unit_half_lives,
)

__all__ = [
    "DEFAULT_HORIZON",
    "VARIANTS",
    "Allocation",
    "CalibrationStats",
    "Plan",
    "RecurrenceCapture",
    "RecurrenceObserver",
    "Replay",
    "StatsConfig",
    "Variant",
    "allocate",
    "build_plan",
    "collect_stats",
    "default_candidates",
    "half_life_census",
    "lifetime_weights",
    "load_plan",
    "model_shape",
    "plan_accounting",
    "replay",
    "replay_error",
    "row_impact_factors",
    "select_pivots",
    "solve_allocation",
    "unit_half_lives",
]

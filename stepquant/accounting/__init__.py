"""Memory accounting: bits/value and bytes/request of every state format, and the serving capacity model.

The paper's claims are byte counts and a capacity model for a serving engine that reserves (5B + 1)
persistent-state slots. This package computes them for any model shape (docs/accounting.md):

    formulas.py  StateBytes and the byte count of each format (float casts, INT-b rowwise, DSQ,
                 STEPQuant at a nominal budget, any codec, a concrete plan through its LayerFormats)
    capacity.py  Capacity: state slots, pool bytes, totals with weights and attention KV;
                 max_batch: the largest batch in a memory budget
    presets.py   the paper's models (Qwen3.8-27B, Kimi-Linear-48B-A3B)
    synthetic.py plan-shaped LayerFormats for a shape without a calibrated plan (random-weight models)
    report.py    memory_report / format_report: what ``stepquant memory`` prints
    cli.py       ``stepquant memory`` (imports calibration for --plan; nothing here imports it)

Model shapes come from stepquant.families (``shape_from_config``). ``Mixer.GDN`` / ``Mixer.KDA`` name
the families where a shape is written by hand.
"""

from types import SimpleNamespace

from stepquant.families import FAMILIES, ModelShape

from .capacity import GIB, MIB, Capacity, capacity, max_batch
from .formulas import (
    FP16_BITS,
    FP32_BITS,
    PIVOT_REPLACES_BITS,
    SCALE_BITS,
    StateBytes,
    as_layer_formats,
    codec_bytes,
    default_pivots,
    dsq_bytes,
    float_bytes,
    int_rowwise_bytes,
    max_pivots,
    measured_bytes,
    plan_bytes,
    stepquant_bytes,
)
from .presets import PRESETS, get_preset
from .report import format_report, memory_report

Mixer = SimpleNamespace(**{name.upper(): family for name, family in FAMILIES.items()})

__all__ = [
    "FP16_BITS", "FP32_BITS", "GIB", "MIB", "PIVOT_REPLACES_BITS", "PRESETS", "SCALE_BITS", "Capacity",
    "Mixer", "ModelShape", "StateBytes", "as_layer_formats", "capacity", "codec_bytes", "default_pivots",
    "dsq_bytes", "float_bytes", "format_report", "get_preset", "int_rowwise_bytes", "max_pivots",
    "max_batch", "measured_bytes", "memory_report", "plan_bytes", "stepquant_bytes",
]

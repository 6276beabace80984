"""Recurrent-state codecs behind one interface (base.Codec), and a registry to build them by name.

Names:
  "fp32", "bf16", "fp16"      float casts (cast.py)
  "int2" .. "int8"            uniform symmetric rowwise absmax, the paper's baseline (uniform.py)
  "int2-sr" .. "int8-sr"      the same with stochastic rounding (unbiased, seeded)
  "dsq2" .. "dsq8"            Q-Mamba's decoupled dual-axis scales, uniform bits (dsq.py)
  "dual2" .. "dual8"          STEPQuant's key-row-aware dual-axis fitting, uniform bits: "spatial only"
  "mixed"                     plan-driven per-row bits with FP16 pivots (mixed.py; needs bits=, w=)
  "<name>-ef<r>"              any of the above but "mixed" with error feedback: the rounding residual kept in
                              r bits (2..8 INT rowwise, 16 FP16, 32 FP32) and added before the next
                              requantization (error_feedback.py), e.g. "int6-ef4", "int8-ef4"
  "<name>-defer<R>"           any of the above but "mixed" fitted every R-th decode token (R = 2..16), the
                              float state kept between fits (deferred.py), e.g. "int6-defer4"

A calibrated plan's layer is a :class:`LayerFormat` (layer_format.py: its codec, packed layout and bytes).

``make_codec(name, **kwargs)`` passes kwargs to the codec: e.g. make_codec("fp16", overflow="raise"),
make_codec("int4-sr", seed=3), make_codec("dsq4", col_exponent=0.5), make_codec("dual4", w=w,
refit_iters=2, grid="midrise"), make_codec("mixed", bits=bits, w=w, spatial="absmax").
"""

from __future__ import annotations

import re

from .base import (
    FP16_SCALE_MAX,
    FP16_SCALE_MIN,
    MAX_BITS,
    MIN_BITS,
    PIVOT_BITS,
    Codec,
    Grid,
    QState,
    check_bits,
    check_states,
    code_levels,
    fp16_scale,
    round_to_codes,
)
from .cast import CastCodec
from .deferred import MAX_DEFER, DeferredCodec, DeferredState, split_deferred
from .dsq import DSQCodec
from .dual_axis import (
    DualAxisCodec,
    DualAxisConfig,
    dual_axis_iterates,
    fit_dual_axis,
    refit_weights,
    row_factor,
    row_gains,
    weighted_error,
)
from .error_feedback import RESIDUAL_BITS, ErrorFeedbackCodec, ErrorFeedbackState, residual_codec, split_name
from .layer_format import LayerFormat
from .mixed import MixedCodec, fit_rowwise_absmax
from .uniform import UniformCodec, rowwise_absmax_scale

__all__ = [
    "FP16_SCALE_MAX",
    "FP16_SCALE_MIN",
    "MAX_BITS",
    "MIN_BITS",
    "PIVOT_BITS",
    "CastCodec",
    "Codec",
    "DSQCodec",
    "DualAxisCodec",
    "DualAxisConfig",
    "DeferredCodec",
    "DeferredState",
    "ErrorFeedbackCodec",
    "ErrorFeedbackState",
    "Grid",
    "LayerFormat",
    "MixedCodec",
    "QState",
    "UniformCodec",
    "check_bits",
    "check_states",
    "code_levels",
    "codec_names",
    "dual_axis_iterates",
    "fit_dual_axis",
    "fit_rowwise_absmax",
    "fp16_scale",
    "is_codec_name",
    "make_codec",
    "refit_weights",
    "residual_codec",
    "round_to_codes",
    "row_factor",
    "row_gains",
    "rowwise_absmax_scale",
    "split_name",
    "weighted_error",
]

_CONFIG_FIELDS = ("grid", "row_stat", "clip", "refit_iters", "step_normalised_refit", "division", "row_fill")
_PATTERN = re.compile(r"^(int|dsq|dual)([0-9])(-sr)?$")


def codec_names() -> list[str]:
    """Every base name make_codec accepts (each but "mixed" also takes the error-feedback suffix -ef<r>)."""
    bit_range = range(MIN_BITS, MAX_BITS + 1)
    return (
        ["fp32", "bf16", "fp16"]
        + [f"int{b}" for b in bit_range]
        + [f"int{b}-sr" for b in bit_range]
        + [f"dsq{b}" for b in bit_range]
        + [f"dual{b}" for b in bit_range]
        + ["mixed"]
    )


def is_codec_name(name: str) -> bool:
    """Whether make_codec builds ``name`` without extra arguments: a base name but "mixed", optionally with
    the error-feedback suffix "-ef<r>" (r in error_feedback.RESIDUAL_BITS) or the deferral suffix
    "-defer<R>" (R = 2..MAX_DEFER)."""
    base, every = split_deferred(name.strip().lower())
    if every is not None and not 2 <= every <= MAX_DEFER:
        return False
    base, residual = split_name(base)
    return base in codec_names() and base != "mixed" and (residual is None or residual in RESIDUAL_BITS)


def _split_config(kwargs: dict) -> dict:
    """Move DualAxisConfig fields given as plain kwargs into one config= entry."""
    fields = {k: kwargs.pop(k) for k in _CONFIG_FIELDS if k in kwargs}
    if fields:
        if "config" in kwargs:
            raise TypeError(f"pass either config= or the fields {sorted(fields)}, not both")
        kwargs["config"] = DualAxisConfig(**fields)
    return kwargs


def make_codec(name: str, **kwargs) -> Codec:
    """Build a codec by name (see module docstring); unknown names raise ValueError listing valid ones."""
    if not isinstance(name, str):
        raise TypeError(f"codec name must be a str, got {type(name).__name__}")
    key = name.strip().lower()
    base, every = split_deferred(key)
    if every is not None and base != "mixed" and is_codec_name(base):
        return DeferredCodec(make_codec(base, **kwargs), every=every)
    base, residual_bits = split_name(key)
    if residual_bits is not None and base != "mixed" and is_codec_name(base):
        return ErrorFeedbackCodec(make_codec(base, **kwargs), residual_bits=residual_bits)
    if residual_bits is not None and base in codec_names():
        raise ValueError(f"codec name {name!r}: 'mixed' needs a plan's bits and w; give a plan layer error "
                         "feedback as ErrorFeedbackCodec(plan.codec(i), residual_bits=r), or in stepquant "
                         "eval as <variant>-<bits>-ef<r> (e.g. stepquant-6-ef4)")
    if key in ("fp32", "bf16", "fp16"):
        return CastCodec(dtype=key, **kwargs)
    if key == "mixed":
        return MixedCodec(**_split_config(kwargs))
    match = _PATTERN.match(key)
    if match is not None and MIN_BITS <= int(match.group(2)) <= MAX_BITS:
        family, bits, stochastic = match.group(1), int(match.group(2)), match.group(3) is not None
        if family == "int":
            return UniformCodec(bits=bits, stochastic=stochastic, **kwargs)
        if not stochastic and family == "dsq":
            return DSQCodec(bits=bits, **kwargs)
        if not stochastic and family == "dual":
            return DualAxisCodec(bits=bits, **_split_config(kwargs))
    raise ValueError(f"unknown codec name {name!r}; valid names: {', '.join(codec_names())} (each but mixed "
                     "also as <name>-ef<r>: error feedback with an r-bit residual, and <name>-defer<R>: "
                     "fitted every R-th token)")

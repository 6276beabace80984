"""Byte formulas: bits/value and bytes/request of every state format on a model shape.

The paper's claims are byte counts (STEPQuant@6 on Qwen3.8-27B: 30,015,488 B analytical, 29,999,104 B
served, 5.03x vs FP32; Kimi-Linear: 4.30 / 6.30 bits/value). These functions compute them from a
:class:`~stepquant.families.ModelShape`, so every number can be re-derived for any GDN / KDA model and any
format (docs/accounting.md explains the conventions with the numbers):

- A request's recurrent state is ``L x H x K x V`` values (L linear-attention layers, H heads each).
- STEPQuant at a nominal budget b̄ with N_piv pivot units: integer codes get b̄ N - 8 N_piv bits (each
  FP16 pivot replaces an 8-bit unit), pivots take 16 bits per value, every head stores an FP16 row-scale
  and column-scale vector. "Analytical" reserves those scale slots for every head; "serving" (the packed
  layout of docs/format.md) drops them for GDN pivot heads. A KDA pivot row keeps its slot.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import torch

from stepquant.codecs import LayerFormat
from stepquant.codecs.base import MIN_BITS, PIVOT_BITS, check_bits
from stepquant.families import ModelShape, check_count

FP32_BITS = 32
FP16_BITS = 16
SCALE_BITS = 16  # row / column scales are FP16
PIVOT_REPLACES_BITS = 8  # the paper's accounting: a pivot replaces an 8-bit unit


@dataclass(frozen=True)
class StateBytes:
    """Bytes one request's recurrent state occupies in a format, all linear-attention layers.

    analytical_bytes: the paper's compact count (scale slots for every head); serving_bytes: the
    packed serving layout. Equal for every format except STEPQuant with GDN pivot heads.
    """

    label: str
    analytical_bytes: int
    serving_bytes: int
    values: int

    def __post_init__(self) -> None:
        if not isinstance(self.label, str) or not self.label:
            raise TypeError(f"label must be a non-empty str, got {self.label!r}")
        check_count(self.analytical_bytes, "analytical_bytes")
        check_count(self.serving_bytes, "serving_bytes")
        check_count(self.values, "values")

    def bytes(self, serving: bool = False) -> int:
        return self.serving_bytes if serving else self.analytical_bytes

    def bits_per_value(self, serving: bool = False) -> float:
        return self.bytes(serving) * 8 / self.values

    def ratio_vs_fp32(self, serving: bool = False) -> float:
        return self.values * 4 / self.bytes(serving)

    def as_dict(self) -> dict:
        return {
            "format": self.label,
            "analytical_bytes": self.analytical_bytes,
            "serving_bytes": self.serving_bytes,
            "bits_per_value": round(self.bits_per_value(), 6),
            "serving_bits_per_value": round(self.bits_per_value(serving=True), 6),
            "ratio_vs_fp32": round(self.ratio_vs_fp32(), 6),
            "serving_ratio_vs_fp32": round(self.ratio_vs_fp32(serving=True), 6),
        }


def _bits_to_bytes(bits: int) -> int:
    return -(-bits // 8)


def _check_shape(shape) -> ModelShape:
    if not isinstance(shape, ModelShape):
        raise TypeError(f"shape must be a ModelShape (see accounting.PRESETS or families.shape_from_config), "
                        f"got {type(shape).__name__}")
    return shape


# ---------------------------------------------------------------- formats

def float_bytes(shape: ModelShape, bits: int = FP32_BITS) -> StateBytes:
    """A plain float cast: FP32 (SGLang's default) or BF16 / FP16 (16 bits)."""
    _check_shape(shape)
    if bits not in (FP32_BITS, FP16_BITS):
        raise ValueError(f"bits={bits!r}: float states are 32 (FP32) or 16 (BF16/FP16) bits")
    label = "FP32" if bits == FP32_BITS else "BF16/FP16"
    size = _bits_to_bytes(shape.values * bits)
    return StateBytes(label, size, size, shape.values)


def int_rowwise_bytes(shape: ModelShape, bits: int) -> StateBytes:
    """Uniform b-bit codes with one FP16 absmax scale per key row (the paper's INT4/6/8 baseline)."""
    _check_shape(shape)
    check_bits(bits)
    rows = shape.num_heads * shape.key_dim
    size = _bits_to_bytes(shape.values * bits + rows * SCALE_BITS)
    return StateBytes(f"INT{bits} rowwise", size, size, shape.values)


def dsq_bytes(shape: ModelShape, bits: int) -> StateBytes:
    """DSQ (Q-Mamba): uniform b-bit codes with an FP16 row and an FP16 column scale vector per head."""
    _check_shape(shape)
    check_bits(bits)
    scale_bits = shape.num_heads * (shape.key_dim + shape.value_dim) * SCALE_BITS
    size = _bits_to_bytes(shape.values * bits + scale_bits)
    return StateBytes(f"DSQ{bits}", size, size, shape.values)


def max_pivots(shape: ModelShape, bits: int) -> int:
    """Most pivot units the budget b̄ N - 8 N_piv can pay for while integer values keep >= 2 bits."""
    _check_shape(shape)
    check_bits(bits)
    # (b̄ N - 8 N_piv) >= 2 (N - N_piv)  <=>  6 N_piv <= (b̄ - 2) N
    most_values = (bits - MIN_BITS) * shape.values // (PIVOT_REPLACES_BITS - MIN_BITS)
    return min(shape.num_units, most_values // shape.unit_values)


def default_pivots(shape: ModelShape, bits: int | None = None) -> int:
    """The paper's pivot share of ``shape``'s units, rounded half up (Qwen3.8-27B: 32 heads, Kimi: 512 rows).

    With ``bits`` given, capped at what that budget can pay for (no pivots at 2 bits).
    """
    _check_shape(shape)
    share = shape.family.paper_pivot_share * shape.num_units
    pivots = math.floor(share + Fraction(1, 2))
    return pivots if bits is None else min(pivots, max_pivots(shape, bits))


def stepquant_bytes(shape: ModelShape, bits: int, pivots: int | None = None) -> StateBytes:
    """STEPQuant at nominal budget b̄ = ``bits`` with ``pivots`` FP16 pivot units (heads / key rows).

    codes: b̄ N - 8 N_piv bits; pivots: 16 N_piv bits; scales: an FP16 row and column vector per head
    (analytical: every head; serving: GDN pivot heads carry none). N_piv counts values. This is the
    nominal budget count, independent of how a plan spreads the bits (rows are assumed word aligned,
    true for V a multiple of 32); :func:`plan_bytes` counts an actual plan's packed layout.
    """
    _check_shape(shape)
    check_bits(bits)
    if pivots is None:
        pivots = default_pivots(shape, bits)
    check_count(pivots, "pivots", allow_zero=True)
    limit = max_pivots(shape, bits)
    if pivots > limit:
        raise ValueError(
            f"pivots={pivots} {shape.family.unit}s do not fit a {bits}-bit budget: each replaces an "
            f"8-bit unit and the other units need >= {MIN_BITS} bits, so at most {limit} are possible"
        )
    pivot_values = pivots * shape.unit_values
    code_bits = bits * shape.values - PIVOT_REPLACES_BITS * pivot_values
    pivot_bits = PIVOT_BITS * pivot_values
    head_scale_bits = (shape.key_dim + shape.value_dim) * SCALE_BITS
    analytical = code_bits + pivot_bits + shape.num_heads * head_scale_bits
    pivot_heads = pivots if shape.family.unit_is_head else 0  # a KDA pivot row keeps its row-scale slot
    serving = analytical - pivot_heads * head_scale_bits
    unit = "head" if shape.family.unit_is_head else "row"
    label = f"STEPQuant@{bits} ({pivots:,} pivot {unit}{'s' if pivots != 1 else ''})"
    return StateBytes(label, _bits_to_bytes(analytical), _bits_to_bytes(serving), shape.values)


def codec_bytes(codec, shape: ModelShape) -> StateBytes:
    """Bytes of any :class:`~stepquant.codecs.base.Codec`: its ``storage_bits`` per layer x layers.

    Serving bytes come from ``storage_bits(H, K, V)`` of ``codec.for_shape(shape)`` (a deferred format's
    buffers in the model's layout), analytical bytes from ``analytical=True`` where the codec takes that
    keyword (they differ only for formats with FP16 pivot heads).
    """
    _check_shape(shape)
    for_shape = getattr(codec, "for_shape", None)  # Codec's: the model's layout (GDN's shared pending k_j)
    codec = for_shape(shape) if callable(for_shape) else codec
    storage_bits = getattr(codec, "storage_bits", None)
    if not callable(storage_bits):
        raise TypeError(f"codec must implement storage_bits(num_heads, key_dim, value_dim), got {codec!r}")
    dims = (shape.heads, shape.key_dim, shape.value_dim)
    serving = storage_bits(*dims)
    takes_analytical = "analytical" in inspect.signature(storage_bits).parameters
    analytical = storage_bits(*dims, analytical=True) if takes_analytical else serving
    check_count(serving, "codec.storage_bits(...)")
    check_count(analytical, "codec.storage_bits(..., analytical=True)")
    return StateBytes(str(getattr(codec, "name", type(codec).__name__)),
                      _bits_to_bytes(analytical * shape.linear_layers),
                      _bits_to_bytes(serving * shape.linear_layers), shape.values)


def as_layer_formats(layers, shape: ModelShape, has_col_scale: bool = True) -> list[LayerFormat]:
    """One :class:`~stepquant.codecs.LayerFormat` per linear-attention layer of ``shape``.

    ``layers``: one entry per layer, a LayerFormat or a bit table, [H] (bits per GDN head) or [H, K]
    (bits per key row), 2..8 or 16 (FP16 pivot); a tensor [L, H] / [L, H, K] works too. A bit table
    becomes the format with column scales (dual-axis) or, with has_col_scale=False, without (absmax).
    """
    _check_shape(shape)
    if isinstance(layers, torch.Tensor):
        layers = list(layers)
    if not isinstance(layers, Sequence) or isinstance(layers, str):
        raise TypeError("layers must be a sequence of LayerFormats or per-layer bit tensors [H] or [H, K]")
    if len(layers) != shape.linear_layers:
        raise ValueError(f"got {len(layers)} layers, the model has {shape.linear_layers}")
    formats = []
    for index, layer in enumerate(layers):
        if not isinstance(layer, LayerFormat):
            bits = torch.as_tensor(layer)
            if bits.dim() == 1:
                bits = bits[:, None].expand(-1, shape.key_dim)  # a GDN head's rows share its width
            if tuple(bits.shape) != (shape.heads, shape.key_dim):
                raise ValueError(f"layers[{index}] must have shape [H]=[{shape.heads}] or [H, K]="
                                 f"[{shape.heads}, {shape.key_dim}], got {tuple(bits.shape)}")
            layer = LayerFormat(bits, spatial="dual_axis" if has_col_scale else "absmax")
        elif (layer.num_heads, layer.key_dim) != (shape.heads, shape.key_dim):
            raise ValueError(f"layers[{index}] is a format of [H, K] = {[layer.num_heads, layer.key_dim]}, "
                             f"the model has {[shape.heads, shape.key_dim]}")
        formats.append(layer)
    return formats


def plan_bytes(layers, shape: ModelShape, has_col_scale: bool = True, label: str = "plan") -> StateBytes:
    """Bytes of a concrete plan: the sum of its layers' ``LayerFormat.bytes`` (see :func:`as_layer_formats`).

    Serving bytes are the packed layout's (docs/format.md, word padding included); analytical bytes
    reserve scale slots for every head.
    """
    formats = as_layer_formats(layers, shape, has_col_scale)
    analytical = sum(f.bytes(shape.value_dim, analytical=True) for f in formats)
    serving = sum(f.bytes(shape.value_dim) for f in formats)
    return StateBytes(label, analytical, serving, shape.values)


def measured_bytes(shape: ModelShape, num_bytes: int, label: str = "measured") -> StateBytes:
    """A byte count measured elsewhere, turned into bits/value and a ratio vs FP32 on ``shape``."""
    _check_shape(shape)
    check_count(num_bytes, "num_bytes")
    return StateBytes(label, num_bytes, num_bytes, shape.values)

"""Plan-shaped state formats for a model without a calibrated plan (random-weight production shapes).

A calibrated plan (stepquant.calibrate) spends a nominal budget of b̄ bits/value unevenly: GDN heads get whole
widths around b̄ with the paper's share of FP16 pivot heads (32 of Qwen3.8-27B's 2,304), KDA key rows get
mixed widths with the paper's share of FP16 pivot rows (512 of 81,920); each FP16 pivot replaces an 8-bit
unit (docs/accounting.md). :func:`synthetic_layer_formats` draws such a layout, seeded, for any shape: the
bytes, the packed layout and the kernel's work are those of a calibrated plan of that budget; which heads or
rows get which width is random, so it says nothing about quality. The decode benchmark's plans
(benchmarks/bench_decode.py) are drawn the same way.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from stepquant.codecs import LayerFormat
from stepquant.codecs.base import MIN_BITS, PIVOT_BITS, check_bits
from stepquant.codecs.dual_axis import DualAxisConfig
from stepquant.families import Family, ModelShape

from .formulas import PIVOT_REPLACES_BITS, default_pivots


def spread_widths(count: int, target_sum: int, choices: list[int], gen: torch.Generator) -> torch.Tensor:
    """``count`` widths drawn from ``choices`` and nudged one bit at a time until they sum to ``target_sum``
    (clamped to what the choices can reach)."""
    widths = torch.tensor(choices)[torch.randint(len(choices), (count,), generator=gen)]
    lo, hi = min(choices), max(choices)
    target_sum = min(max(target_sum, lo * count), hi * count)
    while int(widths.sum()) != target_sum:
        i = int(torch.randint(count, (1,), generator=gen))
        if int(widths.sum()) > target_sum and widths[i] > lo:
            widths[i] -= 1
        elif int(widths.sum()) < target_sum and widths[i] < hi:
            widths[i] += 1
    return widths


def synthetic_bits(
    family: Family, bits: int, heads: int, key_dim: int, seed: int = 0, pivots: int | None = None
) -> torch.Tensor:
    """int8 [H, K] bits of one layer shaped like a calibrated plan at budget ``bits`` (module docstring).

    GDN: one width per head from {b̄-1 .. b̄+2}, KDA: one width per key row from {b̄-2 .. b̄+2}, plus ``pivots``
    FP16 pivot units (default: the paper's share of this layer's units, rounded half up). The integer widths
    sum to b̄ x units - 8 x pivots, so the layer averages b̄ bits/value in the paper's accounting.
    """
    check_bits(bits)
    gen = torch.Generator().manual_seed(seed * 1009 + bits)
    units = heads if family.unit_is_head else heads * key_dim
    if pivots is None:
        pivots = math.floor(family.paper_pivot_share * units + Fraction(1, 2)) if bits > MIN_BITS else 0
    spread = (-1, 2) if family.unit_is_head else (-2, 2)
    choices = [b for b in range(bits + spread[0], bits + spread[1] + 1) if MIN_BITS <= b <= 8]
    widths = spread_widths(units - pivots, bits * units - PIVOT_REPLACES_BITS * pivots, choices, gen)
    widths = torch.cat([widths, torch.full((pivots,), PIVOT_BITS)])[torch.randperm(units, generator=gen)]
    if family.unit_is_head:
        return widths[:, None].expand(heads, key_dim).to(torch.int8).contiguous()
    return widths.reshape(heads, key_dim).to(torch.int8)


def synthetic_layer_formats(
    shape: ModelShape, bits: int, seed: int = 0, config: DualAxisConfig | None = None
) -> list[LayerFormat]:
    """One plan-shaped LayerFormat per linear-attention layer of ``shape`` (a different draw per layer), with
    log-normal row-impact factors w, dual-axis fitting with ``config`` (default: DualAxisConfig()).

    The model's pivots (accounting.default_pivots: the paper's share of all units, e.g. 32 of Qwen3.8-27B's
    2,304) are dealt out over the layers as evenly as whole units allow, so the plan's bytes are the nominal
    budget's (``stepquant_bytes(shape, bits)``) up to word padding."""
    total = default_pivots(shape, bits)
    layers = shape.linear_layers
    per_layer = [total // layers + (1 if i < total % layers else 0) for i in range(layers)]
    spread = torch.randperm(layers, generator=torch.Generator().manual_seed(seed)).tolist()
    formats = []
    for layer in range(layers):
        layer_bits = synthetic_bits(
            shape.family,
            bits,
            shape.heads,
            shape.key_dim,
            seed + 7919 * layer,
            pivots=per_layer[spread[layer]],
        )
        gen = torch.Generator().manual_seed(seed + 7919 * layer + 1)
        w = torch.exp(0.5 * torch.randn(layer_bits.shape, generator=gen))
        formats.append(LayerFormat(layer_bits, w, "dual_axis", config or DualAxisConfig()))
    return formats

"""Plan-driven mixed precision: per-key-row bit widths (2..8, or 16 for FP16 pivots) from calibration.

STEPQuant's temporal component (lifetime-aware bit allocation + FP16 pivots) decides a bit width per
unit offline: per head for GDN (constant within a head), per key row for KDA. This codec applies such
a plan, ``bits [H, K]`` for one layer, and produces one :class:`QState` with mixed bits:

- ``spatial="dual_axis"`` (full STEPQuant): integer rows go through key-row-aware dual-axis fitting
  with the row-impact factors ``w [H, K]`` (dual_axis.py). A head whose rows have different bit
  widths still has one row-scale vector and one column-scale vector; the column scales are fitted
  jointly across its rows: each row on its own b-bit grid, column init = max over rows of
  clip_b(i) |Y_ij| / qmax_b(i), the weighted least-squares refit formula unchanged (z_ij is each row's
  own level). Two per-row details make the rows of one head keep their own precision (dual_axis.py
  explains and tests/test_codecs.py measures them): the codebook normalisation of each width enters
  its row scale (``row_factor``), and by default the refit weighs each row's error in units of its own
  step (``DualAxisConfig.step_normalised_refit``). Heads of one bit width are unaffected by either.
- ``spatial="absmax"`` (the "temporal only" ablation): each integer row is rowwise absmax at its own
  bit width (uniform.py's rule with qmax_b(i)), MIDTREAD grid, no column scales; w is not used.

Rows with 16 bits are FP16 pivots (values saturated to +-65504, as the FP16 cast does). Storage
(Codec.storage_bits) is the packed layout's count (packing.PackedLayout, docs/format.md): codes b_i V
per integer row and 16 V per pivot row, in whole int32 words, and FP16 scales (K per head, plus V with
column scales) for every head that has at least one integer row (serving count: a GDN pivot head
carries none) or for every head (analytical=True, the paper's count).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .base import (
    FP16_MAX,
    MAX_BITS,
    PIVOT_BITS,
    Codec,
    Grid,
    QState,
    as_fp32,
    check_bits_plan,
    check_dims,
    check_state_heads,
    round_to_codes,
)
from .dual_axis import DualAxisConfig, check_row_weights, fit_dual_axis
from .packing import PackedLayout
from .uniform import rowwise_absmax_scale

SPATIAL_CHOICES = ("dual_axis", "absmax")
_NAMES = {"dual_axis": "mixed", "absmax": "mixed-absmax"}


def fit_rowwise_absmax(states: torch.Tensor, bits: torch.Tensor) -> QState:
    """Rowwise absmax at per-row bit widths [H, K] (16 = FP16 pivot row) of states [N, H, K, V]."""
    x = as_fp32(states)  # [N, H, K, V]
    plan = check_bits_plan(bits)
    check_state_heads(x, *plan.shape, "bits")
    plan = plan.to(x.device)
    is_pivot = plan == PIVOT_BITS  # [H, K]
    row_bits = torch.where(is_pivot, torch.full_like(plan, MAX_BITS), plan).to(torch.int64)
    scale = rowwise_absmax_scale(x, row_bits[None])  # [N, H, K]
    scale = torch.where(is_pivot, torch.ones_like(scale), scale)
    codes = round_to_codes(x / scale[..., None], row_bits[None, :, :, None], Grid.MIDTREAD)
    codes = torch.where(is_pivot[None, :, :, None], torch.zeros_like(codes), codes)
    pivots = None
    if bool(is_pivot.any()):
        pivots = torch.where(is_pivot[None, :, :, None], x.clamp(-FP16_MAX, FP16_MAX), torch.zeros_like(x))
        pivots = pivots.to(torch.float16)
    return QState(codes, plan.to(torch.int8), scale.to(torch.float16), None, pivots, Grid.MIDTREAD)


@dataclass(frozen=True, eq=False)
class MixedCodec(Codec):
    """Apply one layer's bit plan (see module docstring).

    bits:    int tensor [H, K]: 2..8 per key row, 16 for an FP16 pivot row
    w:       row-impact factors [H, K] (> 0) or None (= 1); used by spatial="dual_axis" only
    spatial: "dual_axis" (STEPQuant) or "absmax" (temporal-only ablation)
    config:  dual-axis fitting parameters (ignored by "absmax")
    """

    bits: torch.Tensor
    w: torch.Tensor | None = None
    spatial: str = "dual_axis"
    config: DualAxisConfig = field(default_factory=DualAxisConfig)
    name: str = field(init=False)

    def __post_init__(self) -> None:
        plan = check_bits_plan(self.bits)
        object.__setattr__(self, "bits", plan)
        if self.w is not None:
            object.__setattr__(self, "w", check_row_weights(self.w, *plan.shape))
        if self.spatial not in SPATIAL_CHOICES:
            raise ValueError(f"spatial must be one of {list(SPATIAL_CHOICES)}, got {self.spatial!r}")
        if not isinstance(self.config, DualAxisConfig):
            raise TypeError(f"config must be a DualAxisConfig, got {type(self.config).__name__}")
        object.__setattr__(self, "name", _NAMES[self.spatial])

    @classmethod
    def _of_checked(cls, bits: torch.Tensor, w: torch.Tensor | None, spatial: str,
                    config: DualAxisConfig) -> MixedCodec:
        """The codec of fields a LayerFormat validated already (its ``codec()``), without validating
        them again."""
        codec = object.__new__(cls)
        for name, value in (("bits", bits), ("w", w), ("spatial", spatial), ("config", config)):
            object.__setattr__(codec, name, value)
        object.__setattr__(codec, "name", _NAMES[spatial])
        return codec

    @property
    def num_pivot_rows(self) -> int:
        return int((self.bits == PIVOT_BITS).sum())

    def encode(self, states: torch.Tensor) -> QState:
        """states [N, H, K, V] -> QState with mixed per-row bits."""
        if self.spatial == "absmax":
            return fit_rowwise_absmax(states, self.bits)
        return fit_dual_axis(states, self.bits, self.w, self.config)

    def decode(self, encoded: QState) -> torch.Tensor:
        if not isinstance(encoded, QState):
            raise TypeError(f"{self.name} codec decodes a QState, got {type(encoded).__name__}")
        return encoded.dequantize()

    def storage_bits(self, num_heads: int, key_dim: int, value_dim: int, *, analytical: bool = False) -> int:
        """Bits of one request's layer state in the packed layout (serving or analytical count)."""
        check_dims(num_heads, key_dim, value_dim)
        if (num_heads, key_dim) != tuple(self.bits.shape):
            raise ValueError(
                f"(num_heads, key_dim) = {(num_heads, key_dim)} does not match the plan's [H, K] = "
                f"{list(self.bits.shape)}"
            )
        layout = PackedLayout._of_checked(self.bits, value_dim, self.spatial == "dual_axis")
        return 8 * (layout.analytical_bytes if analytical else layout.bytes_per_slot)

"""One linear-attention layer's state format: what calibration decides for a layer, in one type.

A layer of a calibrated plan is stored by its bit table ``bits [H, K]`` (2..8 per key row, 16 for an
FP16 pivot row), its row-impact factors ``w [H, K]``, the spatial quantizer ("dual_axis": row and
column scales, STEPQuant; "absmax": rowwise absmax, no column scales) and the dual-axis fitting
parameters. :class:`LayerFormat` validates them once, and everything else is read from it:

- ``codec()``: the torch codec (mixed.MixedCodec) that defines the quantizer, built once;
- ``layout(V)``: the packed layout of a slot (packing.PackedLayout, docs/format.md), built once per V;
- ``bytes(V)``: the bytes of one request's layer state, the layout's count (the one byte count of a
  plan layer: the plan's accounting, the pool, the caches and the evaluation all read it);
- ``shard(rank, world_size)``: the heads of a tensor-parallel rank.

Plan.layer_format(i) gives the format of a calibrated plan's layer; the serving pool, the kernels'
tables and the caches are built from formats.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .base import Grid, check_bits_plan
from .dual_axis import DualAxisConfig, check_row_weights
from .mixed import SPATIAL_CHOICES, MixedCodec
from .packing import PackedLayout


@dataclass(frozen=True, eq=False)
class LayerFormat:
    """How one linear-attention layer's recurrent state is stored (module docstring).

    bits:    int8 [H, K] (CPU): 2..8 per key row, 16 for an FP16 pivot row (a GDN head has equal rows)
    w:       FP32 [H, K] (CPU) row-impact factors (> 0), or None for w = 1
    spatial: "dual_axis" (STEPQuant) or "absmax" (rowwise absmax, no column scales; w unused)
    config:  the dual-axis fitting parameters (grid, row statistic, clip table, refit iterations, division)
    """

    bits: torch.Tensor
    w: torch.Tensor | None = None
    spatial: str = "dual_axis"
    config: DualAxisConfig = field(default_factory=DualAxisConfig)
    _built: dict = field(default_factory=dict, init=False, repr=False)  # the codec and layouts, made once

    def __post_init__(self) -> None:
        bits = check_bits_plan(self.bits)
        object.__setattr__(self, "bits", bits)
        if self.w is not None:
            object.__setattr__(self, "w", check_row_weights(self.w, *bits.shape).cpu())
        if self.spatial not in SPATIAL_CHOICES:
            raise ValueError(f"spatial must be one of {list(SPATIAL_CHOICES)}, got {self.spatial!r}")
        if not isinstance(self.config, DualAxisConfig):
            raise TypeError(f"config must be a DualAxisConfig, got {type(self.config).__name__}")

    @property
    def num_heads(self) -> int:
        return self.bits.shape[0]

    @property
    def key_dim(self) -> int:
        return self.bits.shape[1]

    @property
    def has_col_scale(self) -> bool:
        return self.spatial == "dual_axis"

    @property
    def grid(self) -> Grid:
        """The code grid: the config's for dual-axis, mid-tread for rowwise absmax."""
        return self.config.grid if self.has_col_scale else Grid.MIDTREAD

    def codec(self) -> MixedCodec:
        """The torch codec that defines this layer's quantizer (what the kernels reproduce)."""
        if "codec" not in self._built:
            self._built["codec"] = MixedCodec._of_checked(self.bits, self.w, self.spatial, self.config)
        return self._built["codec"]

    def layout(self, value_dim: int) -> PackedLayout:
        """Where everything of a slot lives for value dim V (docs/format.md)."""
        key = ("layout", value_dim)
        if key not in self._built:
            self._built[key] = PackedLayout._of_checked(self.bits, value_dim, self.has_col_scale)
        return self._built[key]

    def bytes(self, value_dim: int, analytical: bool = False) -> int:
        """Bytes of one request's layer state: the packed layout's serving count (a GDN pivot head
        carries no scales), or with analytical=True the paper's count (scale slots for every head)."""
        layout = self.layout(value_dim)
        return layout.analytical_bytes if analytical else layout.bytes_per_slot

    def shard(self, rank: int, world_size: int) -> LayerFormat:
        """The heads h in [rank * H / tp, (rank + 1) * H / tp) of a tensor-parallel rank."""
        start, stop = _shard_range(self.num_heads, rank, world_size)
        w = None if self.w is None else self.w[start:stop].clone()
        return LayerFormat(self.bits[start:stop].clone(), w, self.spatial, self.config)


def _shard_range(num_heads: int, rank: int, world_size: int) -> tuple[int, int]:
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if num_heads % world_size != 0:
        raise ValueError(f"{num_heads} heads cannot be split evenly over {world_size} tensor-parallel ranks")
    per_rank = num_heads // world_size
    return rank * per_rank, (rank + 1) * per_rank

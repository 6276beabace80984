"""Packed recurrent-state pool: per-layer packed pages for N request slots, fixed by a calibration plan.

A serving engine keeps every request's recurrent state in a preallocated pool and hands kernels slot
indices (continuous batching). Here a slot of a linear-attention layer is the packed layout of
docs/format.md: int32 code words (FP16 pivots inside them as raw bit patterns) plus FP16 row and
column scales of the heads that have integer rows. The layout is fixed by the layer's plan (bits per
key row, row-impact factors w), so every slot of a layer has the same size and the decode kernel
finds a head's words by table lookup.

- :class:`LayerPlan`: one layer's bits [H, K] and w [H, K] plus the spatial quantizer (dual-axis or
  rowwise absmax) and its :class:`~stepquant.codecs.dual_axis.DualAxisConfig`; ``shard`` slices the
  heads of a tensor-parallel rank.
- :class:`PackedLayer`: the pages of one layer (``codes [S, W]``, ``row_scale [S, Hs, K]``,
  ``col_scale [S, Hs, V]``) and the per-row tables the kernels read.
- :class:`PackedStatePool`: all layers, one slot allocator (a slot index means the same request in
  every layer). ``alloc`` hands out zeroed slots (a zeroed slot decodes to the zero state), ``free``
  returns them; exhaustion and double free raise.

``bytes_held`` is exactly the packed layout's bytes per slot times the number of slots, the serving
count of ``stepquant.accounting.plan_bytes``. Torch only; any device.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from stepquant.codecs import dual_axis
from stepquant.codecs.base import PIVOT_BITS, Grid, check_bits_plan
from stepquant.codecs.dual_axis import DualAxisConfig, check_row_weights
from stepquant.codecs.mixed import SPATIAL_CHOICES, MixedCodec
from stepquant.codecs.packing import PackedLayout, PackedState


@dataclass(frozen=True, eq=False)
class LayerPlan:
    """How one linear-attention layer is stored.

    bits:    int [H, K]: 2..8 per key row, 16 for an FP16 pivot row (a GDN head has equal rows)
    w:       FP32 [H, K] row-impact factors (> 0), or None for w = 1
    spatial: "dual_axis" (STEPQuant) or "absmax" (rowwise absmax, no column scales)
    config:  the dual-axis fitting parameters (grid, row statistic, clip table, refit iterations)
    """

    bits: torch.Tensor
    w: torch.Tensor | None = None
    spatial: str = "dual_axis"
    config: DualAxisConfig = field(default_factory=DualAxisConfig)

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
        return self.config.grid if self.has_col_scale else Grid.MIDTREAD

    def codec(self) -> MixedCodec:
        """The torch codec that defines this layer's quantizer (what the kernels reproduce)."""
        return MixedCodec(bits=self.bits, w=self.w, spatial=self.spatial, config=self.config)

    def shard(self, rank: int, world_size: int) -> LayerPlan:
        """The heads h in [rank * H / tp, (rank + 1) * H / tp) of a tensor-parallel rank."""
        start, stop = _shard_range(self.num_heads, rank, world_size)
        w = None if self.w is None else self.w[start:stop].clone()
        return LayerPlan(self.bits[start:stop].clone(), w, self.spatial, self.config)


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


def plans_from(plan, *, spatial: str | None = None, config: DualAxisConfig | None = None) -> list[LayerPlan]:
    """LayerPlans from a calibration plan object with per-layer ``bits[L][H, K]`` and ``w[L][H, K]``.

    spatial and config default to the plan's own (``plan.spatial``, ``plan.quantizer``) where it has
    them, else "dual_axis" and the library's DualAxisConfig.
    """
    try:
        layer_bits, layer_w = plan.bits, plan.w
    except AttributeError as err:
        raise TypeError(f"plan must have per-layer bits[L][H, K] and w[L][H, K] ({err})") from err
    if len(layer_bits) != len(layer_w):
        raise ValueError(f"plan has {len(layer_bits)} bit tables but {len(layer_w)} w tables")
    if spatial is None:
        spatial = getattr(plan, "spatial", "dual_axis")
    if config is None:
        config = getattr(plan, "quantizer", None) or DualAxisConfig()
    return [
        LayerPlan(torch.as_tensor(bits), None if w is None else torch.as_tensor(w), spatial, config)
        for bits, w in zip(layer_bits, layer_w, strict=True)
    ]


class PackedLayer:
    """One layer's packed pages for ``num_slots`` slots and the per-row tables of its plan.

    codes:     int32 [S, W]        code words of each slot (docs/format.md)
    row_scale: fp16  [S, Hs, K]    row scales of the scaled heads
    col_scale: fp16  [S, Hs, V]    column scales (None for spatial="absmax")
    Tables (device, flat row index h * K + i): ``row_bits`` int32, ``row_word_offset`` int32,
    ``head_scale_slot`` int32 [H]; what the kernel reads: ``row_table`` int32 (first word << 5 | bits),
    ``head_table`` int32 [H, 2] (scale slot, flags: plane widths used | 32 if every row of the head has
    the same integer width); and the FP32 factors of
    dual_axis.fit_dual_axis, bit for bit:
    ``row_winv`` = row_factor (w^(-1/2) times the head's gain ratio), ``row_w2`` = w^2 (refit
    weight; 0 for pivot rows), ``row_gain`` = clip_b / qmax_b (0 for pivot rows).
    """

    def __init__(self, plan: LayerPlan, num_slots: int, value_dim: int, device: torch.device | str = "cpu"):
        if not isinstance(plan, LayerPlan):
            raise TypeError(f"plan must be a LayerPlan, got {type(plan).__name__}")
        _check_count(num_slots, "num_slots")
        self.plan = plan
        self.layout = PackedLayout(plan.bits, value_dim, has_col_scale=plan.has_col_scale)
        self.device = torch.device(device)
        lay = self.layout
        self.codes = torch.zeros(num_slots, lay.words_per_slot, dtype=torch.int32, device=self.device)
        self.row_scale = torch.zeros(num_slots, lay.num_scaled_heads, lay.key_dim, dtype=torch.float16,
                                     device=self.device)
        self.col_scale = None
        if plan.has_col_scale:
            self.col_scale = torch.zeros(num_slots, lay.num_scaled_heads, value_dim, dtype=torch.float16,
                                         device=self.device)
        bits = plan.bits.to(torch.int64)
        # the codec's own per-row FP32 factors, so the kernel computes bit-identical scales
        put = lambda t: t.reshape(-1).contiguous().to(self.device)
        self.row_bits = put(bits.to(torch.int32))
        self.row_word_offset = put(lay.row_word_offset)
        self.head_scale_slot = put(lay.head_scale_slot)
        if lay.words_per_slot >= 2**26:
            raise ValueError(f"a slot of {lay.words_per_slot} words is too large for the kernel's row table")
        # what the kernel loads: one int32 per row (first word << 5 | bits), per head (scale slot, planes)
        self.row_table = put((lay.row_word_offset.to(torch.int64) << 5 | bits.reshape(-1)).to(torch.int32))
        head_planes = torch.zeros(lay.num_heads, dtype=torch.int64)
        for width in (16, 8, 4, 2, 1):
            head_planes |= ((bits & width) != 0).any(dim=1).to(torch.int64) * width
        uniform = (bits == bits[:, :1]).all(dim=1) & (bits[:, 0] != PIVOT_BITS)  # one integer width per head
        flags = head_planes | uniform.to(torch.int64) * 32
        self.head_table = put(torch.stack([lay.head_scale_slot.to(torch.int64), flags], 1).to(torch.int32))
        # the CUDA kernel's head table [H, 4]: (b if every row of the head has integer width b else 0,
        # scale slot, first word of the head in a slot, words of the head)
        starts = lay.row_word_offset.view(lay.num_heads, lay.key_dim)[:, 0].to(torch.int64)
        head_words = lay.row_words.view(lay.num_heads, lay.key_dim).to(torch.int64).sum(dim=1)
        kind = torch.where(uniform, bits[:, 0], 0)
        self.head_info = put(torch.stack([kind, lay.head_scale_slot.to(torch.int64), starts, head_words], 1)
                             .to(torch.int32)).view(lay.num_heads, 4)
        self.row_winv = put(dual_axis.row_factor(plan.w, plan.bits, plan.config))
        self.row_w2 = put(dual_axis.refit_weights(plan.w, plan.bits, plan.config))
        self.row_gain = put(dual_axis.row_gains(plan.bits, plan.config))
        # plane widths present anywhere in the layer: the kernel compiles only those paths
        present = 0
        for width in (16, 8, 4, 2, 1):
            if bool((head_planes & width).any()):
                present |= width
        self.planes = present

        self.pending: torch.cuda.Event | None = None  # a side-stream writeback into these pages

    def wait_writes(self) -> None:
        """Make the current stream wait for a pending side-stream writeback (decode_step_split)."""
        if self.pending is not None:
            torch.cuda.current_stream(self.device).wait_event(self.pending)
            self.pending = None

    @property
    def num_slots(self) -> int:
        return self.codes.shape[0]

    @property
    def num_heads(self) -> int:
        return self.layout.num_heads

    @property
    def key_dim(self) -> int:
        return self.layout.key_dim

    @property
    def value_dim(self) -> int:
        return self.layout.value_dim

    @property
    def grid(self) -> Grid:
        return self.plan.grid

    @property
    def bytes_per_slot(self) -> int:
        return self.layout.bytes_per_slot

    @property
    def bytes_held(self) -> int:
        return self.bytes_per_slot * self.num_slots

    def tensors(self) -> Iterable[torch.Tensor]:
        yield self.codes
        yield self.row_scale
        if self.col_scale is not None:
            yield self.col_scale

    def gather(self, slots: torch.Tensor | Sequence[int]) -> PackedState:
        """The packed states of ``slots`` (a copy), for the torch reference and the boundary path."""
        self.wait_writes()
        index = _as_index(slots, self.num_slots, self.device)
        col = None if self.col_scale is None else self.col_scale[index]
        return PackedState(self.codes[index], self.row_scale[index], col, self.layout, self.grid)

    def scatter(self, slots: torch.Tensor | Sequence[int], packed: PackedState) -> None:
        """Write packed states (e.g. packing.pack of a codec's QState) into ``slots``."""
        self.wait_writes()
        index = _as_index(slots, self.num_slots, self.device)
        if not packed.layout.same_as(self.layout):
            raise ValueError("packed states were built for a different layout (plan or value_dim differ)")
        if packed.num_slots != index.numel():
            raise ValueError(f"got {packed.num_slots} packed states for {index.numel()} slots")
        self.codes[index] = packed.codes.to(self.device)
        self.row_scale[index] = packed.row_scale.to(self.device)
        if self.col_scale is not None:
            self.col_scale[index] = packed.col_scale.to(self.device)

    def zero_(self, slots: torch.Tensor | Sequence[int]) -> None:
        """Reset slots to the zero state (all code words and scales zero)."""
        self.wait_writes()
        index = _as_index(slots, self.num_slots, self.device)
        for t in self.tensors():
            t[index] = 0


class PackedStatePool:
    """Packed pages of every linear-attention layer for ``num_slots`` request slots.

    plans:      one LayerPlan per layer (all layers must share K)
    value_dim:  V
    tp_rank / tp_size: keep only this tensor-parallel rank's heads of every layer
    """

    def __init__(self, plans: Sequence[LayerPlan], num_slots: int, value_dim: int,
                 device: torch.device | str = "cpu", tp_rank: int = 0, tp_size: int = 1):
        if isinstance(plans, LayerPlan) or not isinstance(plans, Sequence) or not plans:
            raise TypeError("plans must be a non-empty sequence of LayerPlan (one per layer)")
        _check_count(num_slots, "num_slots")
        shards = [p.shard(tp_rank, tp_size) if tp_size > 1 else p for p in plans]
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.layers = [PackedLayer(p, num_slots, value_dim, device) for p in shards]
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest slot first
        self._in_use: set[int] = set()

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, layer: int) -> PackedLayer:
        return self.layers[layer]

    @property
    def num_slots(self) -> int:
        return self.layers[0].num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def bytes_per_slot(self) -> int:
        """Packed bytes of one request over all layers (this rank's heads)."""
        return sum(layer.bytes_per_slot for layer in self.layers)

    @property
    def bytes_held(self) -> int:
        """Device bytes of the pages: bytes_per_slot * num_slots, exactly (no padding)."""
        return sum(layer.bytes_held for layer in self.layers)

    def alloc(self, count: int = 1) -> list[int]:
        """``count`` free slots, zeroed (a reused slot never leaks a previous request's state)."""
        _check_count(count, "count")
        if count > len(self._free):
            raise RuntimeError(f"state pool exhausted: asked for {count} slots, {len(self._free)} of "
                               f"{self.num_slots} are free")
        slots = [self._free.pop() for _ in range(count)]
        self._in_use.update(slots)
        for layer in self.layers:
            layer.zero_(slots)
        return slots

    def free(self, slots: int | Iterable[int]) -> None:
        """Return slots to the pool; freeing a slot that is not allocated raises (double free)."""
        slots = [slots] if isinstance(slots, int) else [int(s) for s in slots]
        bad = [s for s in slots if s not in self._in_use]
        if bad or len(set(slots)) != len(slots):
            raise ValueError(f"slots {bad or slots} are not allocated (double free or never allocated)")
        for s in slots:
            self._in_use.remove(s)
            self._free.append(s)

    def slot_tensor(self, slots: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
        """int32 slot indices for the kernels (-1 = a batch row to skip)."""
        device = self.layers[0].device if device is None else device
        return torch.as_tensor(list(slots), dtype=torch.int32, device=device)


def _check_count(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _as_index(slots, num_slots: int, device: torch.device) -> torch.Tensor:
    index = torch.as_tensor(slots, dtype=torch.int64).reshape(-1)
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= num_slots):
        raise IndexError(f"slot indices must be in [0, {num_slots}), got {index.tolist()[:8]}")
    return index.to(device)

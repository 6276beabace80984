"""Packed recurrent-state pool: per-layer packed pages for N request slots, fixed by a calibration plan.

A serving engine keeps every request's recurrent state in a preallocated pool and hands kernels slot
indices (continuous batching). Here a slot of a linear-attention layer is the packed layout of
docs/format.md: int32 code words (FP16 pivots inside them as raw bit patterns) plus FP16 row and
column scales of the heads that have integer rows. The layout is fixed by the layer's
:class:`~stepquant.codecs.LayerFormat` (bits per key row, row-impact factors w, spatial quantizer), so
every slot of a layer has the same size and the decode kernel finds a head's words by table lookup.

This pool is one user of the kernels' tensor API (stepquant.kernels.tables): any engine's pool can
drive the kernels with its own pages.

- :class:`PackedLayer`: one layer's :class:`~stepquant.kernels.tables.FormatTables` and
  :class:`~stepquant.kernels.tables.Pages`, and the side-stream writeback still pending on them.
- :class:`PackedStatePool`: all layers, one slot allocator (a slot index means the same request in
  every layer). ``alloc`` hands out zeroed slots (a zeroed slot decodes to the zero state), ``free``
  returns them; exhaustion and double free raise.

Slot ids are plain ints, as serving engines hand them around. What is checked where:
- ``free`` refuses a slot that is not allocated (double free) and a slot listed twice;
- every kernel entry point (decode, pack, prefill; CUDA, Triton and the torch reference, any device)
  refuses slot tensors that are not int32 [N], entries other than -1 (skip the row) and [0, S), a slot
  named by two rows, and a slot the pool has not handed out: the pool's layers share one ``in_use``
  mask with their pages (kernels.tables.check_slots), so a decode on a freed slot raises;
- a freed id that has been allocated again names its new request, which no id check can tell from the
  old holder; the pool hands out the slot freed longest ago first, so a stale id stays free, and
  refused, for as long as the pool allows. Drop a request's ids when you free them.

``bytes_held`` is exactly the formats' bytes per slot (``LayerFormat.bytes``) times the number of
slots, the serving count of ``stepquant.accounting.plan_bytes``. Torch only; any device.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import replace

import torch

from stepquant.codecs import LayerFormat
from stepquant.codecs.base import Grid
from stepquant.codecs.packing import PackedLayout, PackedState
from stepquant.kernels.tables import FormatTables, Pages


class PackedLayer:
    """One layer's format tables and pages for ``num_slots`` slots (stepquant.kernels.tables).

    tables:  FormatTables of the layer's format on ``device`` (what the kernels read)
    pages:   Pages: codes [S, W] int32, row_scale [S, Hs, K], col_scale [S, Hs, V] FP16 (or None)
    pending: a CUDA event of a side-stream writeback into the pages (decode_step_split), or None; every
             access through this layer first makes the current stream wait for it (``wait_writes``)
    """

    def __init__(self, format: LayerFormat, num_slots: int, value_dim: int,
                 device: torch.device | str = "cpu"):
        if not isinstance(format, LayerFormat):
            raise TypeError(f"format must be a LayerFormat, got {type(format).__name__}")
        self.tables = FormatTables(format, value_dim, torch.device(device))
        self.pages = Pages.empty(self.tables, num_slots)
        self.pending: torch.cuda.Event | None = None

    def wait_writes(self) -> None:
        """Make the current stream wait for a pending side-stream writeback (decode_step_split)."""
        if self.pending is not None:
            torch.cuda.current_stream(self.device).wait_event(self.pending)
            self.pending = None

    @property
    def format(self) -> LayerFormat:
        return self.tables.format

    @property
    def layout(self) -> PackedLayout:
        return self.tables.layout

    @property
    def device(self) -> torch.device:
        return self.tables.device

    @property
    def num_slots(self) -> int:
        return self.pages.num_slots

    @property
    def num_heads(self) -> int:
        return self.tables.num_heads

    @property
    def key_dim(self) -> int:
        return self.tables.key_dim

    @property
    def value_dim(self) -> int:
        return self.tables.value_dim

    @property
    def grid(self) -> Grid:
        return self.tables.grid

    @property
    def bytes_per_slot(self) -> int:
        return self.format.bytes(self.value_dim)

    @property
    def bytes_held(self) -> int:
        return self.bytes_per_slot * self.num_slots

    def tensors(self) -> Iterable[torch.Tensor]:
        return self.pages.tensors()

    def gather(self, slots: torch.Tensor | Sequence[int]) -> PackedState:
        """The packed states of ``slots`` (a copy), for the torch reference and the boundary path."""
        self.wait_writes()
        return self.pages.gather(self.tables, slots)

    def scatter(self, slots: torch.Tensor | Sequence[int], packed: PackedState) -> None:
        """Write packed states (e.g. packing.pack of a codec's QState) into ``slots``."""
        self.wait_writes()
        self.pages.scatter(self.tables, slots, packed)

    def zero_(self, slots: torch.Tensor | Sequence[int]) -> None:
        """Reset slots to the zero state (all code words and scales zero)."""
        self.wait_writes()
        self.pages.zero_(slots)


class PackedStatePool:
    """Packed pages of every linear-attention layer for ``num_slots`` request slots.

    formats:    one LayerFormat per layer (e.g. ``Plan.layer_formats()``; all layers must share K)
    value_dim:  V
    tp_rank / tp_size: keep only this tensor-parallel rank's heads of every layer
    """

    def __init__(self, formats: Sequence[LayerFormat], num_slots: int, value_dim: int,
                 device: torch.device | str = "cpu", tp_rank: int = 0, tp_size: int = 1):
        if isinstance(formats, LayerFormat) or not isinstance(formats, Sequence) or not formats:
            raise TypeError("formats must be a non-empty sequence of LayerFormat (one per layer)")
        _check_count(num_slots, "num_slots")
        shards = [f.shard(tp_rank, tp_size) if tp_size > 1 else f for f in formats]
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.layers = [PackedLayer(f, num_slots, value_dim, device) for f in shards]
        # the device mirror of _in_use, shared by every layer's pages: the kernels refuse the other slots
        # (a normal tensor even under inference_mode: its version counter tells check_slots it changed)
        with torch.inference_mode(False):
            self.in_use = torch.zeros(num_slots, dtype=torch.bool, device=self.layers[0].device)
        for layer in self.layers:
            layer.pages = replace(layer.pages, in_use=self.in_use)
        self._free = deque(range(num_slots))  # the slot freed longest ago is handed out first
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
        slots = [self._free.popleft() for _ in range(count)]
        self._in_use.update(slots)
        self.in_use[slots] = True
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
        self.in_use[slots] = False

    def slot_tensor(self, slots: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
        """int32 slot indices for the kernels (-1 = a batch row to skip); a normal tensor even under
        inference_mode, so that the kernels check it once, not at every layer (tables.check_slots)."""
        device = self.layers[0].device if device is None else device
        with torch.inference_mode(False):
            return torch.as_tensor(list(slots), dtype=torch.int32, device=device)


def _check_count(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")

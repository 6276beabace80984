"""What the packed-state kernels read and write, as plain tensors: a layer's format tables and its pages.

fla's and the serving engines' recurrent kernels take state tensors plus slot indices, so any engine's
pool can call them. The kernels here do the same: every entry point of ``decode/`` and ``prefill.py``
takes ``(tables, pages, slots, q, k, v, g, beta, ...)``:

- :class:`FormatTables`: built once per layer from its :class:`~stepquant.codecs.LayerFormat` and V on
  a device: the int32 / FP32 per-row and per-head tables of the packed layout and of the quantizer
  (docs/kernels.md), the Triton launch groups, and the sizes of a slot.
- :class:`Pages`: the packed slots of one layer, ``codes [S, W]`` int32 (docs/format.md),
  ``row_scale [S, Hs, K]`` and ``col_scale [S, Hs, V]`` FP16 (None without column scales). An engine
  allocates them where it wants (``Pages.empty(tables, S)`` gives zeroed ones: a zeroed slot decodes to
  the zero state) and hands the kernels int32 slot indices into them; an allocator may attach its
  ``in_use`` mask, and the kernels then refuse a slot it has not handed out (use after free).
- :func:`check_slots`: what every kernel entry point checks of its slot indices (one int32 index per
  batch row, -1 the only "skip this row" value, each slot at most once, in range, in use).

stepquant.pool.PackedStatePool is one user: each of its layers holds a FormatTables and Pages.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch.utils.weak import WeakIdKeyDictionary

from stepquant.codecs import LayerFormat, dual_axis
from stepquant.codecs.base import PIVOT_BITS, Grid
from stepquant.codecs.packing import PLANE_WIDTHS, PackedLayout, PackedState

MAX_SLOT_WORDS = 2**26  # the row table keeps a row's first word in 27 bits (first word << 5 | bits)


@dataclass(frozen=True, eq=False)
class FormatTables:
    """One layer's format as the kernels read it, on ``device`` (flat row index ``h * K + i``).

    row_bits int32 [H*K], row_word_offset int32 [H*K], head_scale_slot int32 [H] (packing.PackedLayout);
    row_table int32 [H*K]: first word << 5 | bits (Triton, CUDA); head_table int32 [H, 2]: scale slot,
    flags = plane widths used | 32 if every row of the head has one integer width (Triton);
    head_info int32 [H, 4]: (b if every row of the head has integer width b else 0, scale slot, first
    word of the head in a slot, words of the head) (CUDA); the FP32 factors of dual_axis.fit_dual_axis,
    bit for bit: row_winv = row_factor (w^(-1/2) times the head's gain ratio), row_w2 = the refit
    weight (0 for pivot rows), row_gain = clip_b / qmax_b (0 for pivot rows); planes: the plane widths
    present anywhere in the layer (the kernels compile only those paths); head_groups: the Triton
    launches of a step, (head indices int32, plane widths, uniform bits): heads whose rows share one
    width b (GDN heads; FP16 pivot heads, b = 16) grouped by b, heads with mixed rows (KDA) in one
    group compiled for the union of their plane widths.
    """

    format: LayerFormat
    value_dim: int
    device: torch.device = torch.device("cpu")
    layout: PackedLayout = field(init=False, repr=False)
    row_bits: torch.Tensor = field(init=False, repr=False)
    row_word_offset: torch.Tensor = field(init=False, repr=False)
    head_scale_slot: torch.Tensor = field(init=False, repr=False)
    row_table: torch.Tensor = field(init=False, repr=False)
    head_table: torch.Tensor = field(init=False, repr=False)
    head_info: torch.Tensor = field(init=False, repr=False)
    row_winv: torch.Tensor = field(init=False, repr=False)
    row_w2: torch.Tensor = field(init=False, repr=False)
    row_gain: torch.Tensor = field(init=False, repr=False)
    planes: int = field(init=False)
    head_groups: tuple[tuple[torch.Tensor, int, int], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        fmt = self.format
        if not isinstance(fmt, LayerFormat):
            raise TypeError(f"format must be a LayerFormat, got {type(fmt).__name__}")
        device = torch.device(self.device)
        if device.type == "cuda" and device.index is None:  # "cuda" is the current GPU, where pages land
            device = torch.device("cuda", torch.cuda.current_device())
        lay = fmt.layout(self.value_dim)
        if lay.words_per_slot >= MAX_SLOT_WORDS:
            raise ValueError(f"a slot of {lay.words_per_slot} words is too large for the kernel's row table")
        bits = fmt.bits.to(torch.int64)  # [H, K]
        put = lambda t: t.reshape(-1).contiguous().to(device)
        set_ = lambda name, value: object.__setattr__(self, name, value)
        set_("device", device)
        set_("layout", lay)
        set_("row_bits", put(bits.to(torch.int32)))
        set_("row_word_offset", put(lay.row_word_offset))
        set_("head_scale_slot", put(lay.head_scale_slot))
        set_("row_table", put((lay.row_word_offset.to(torch.int64) << 5 | bits.reshape(-1)).to(torch.int32)))
        head_planes = torch.zeros(fmt.num_heads, dtype=torch.int64)  # [H] plane widths each head uses
        for width in PLANE_WIDTHS:
            head_planes |= ((bits & width) != 0).any(dim=1).to(torch.int64) * width
        same = (bits == bits[:, :1]).all(dim=1)  # [H] every row of the head has one width
        uniform = same & (bits[:, 0] != PIVOT_BITS)  # ... and it is an integer width
        scale_slot = lay.head_scale_slot.to(torch.int64)
        set_("head_table", put(torch.stack([scale_slot, head_planes | uniform.to(torch.int64) * 32], 1)
                               .to(torch.int32)))
        starts = lay.row_word_offset.view(fmt.num_heads, fmt.key_dim)[:, 0].to(torch.int64)
        head_words = lay.row_words.view(fmt.num_heads, fmt.key_dim).to(torch.int64).sum(dim=1)
        kind = torch.where(uniform, bits[:, 0], 0)
        set_("head_info", put(torch.stack([kind, scale_slot, starts, head_words], 1).to(torch.int32))
             .view(fmt.num_heads, 4))
        set_("row_winv", put(dual_axis.row_factor(fmt.w, fmt.bits, fmt.config)))
        set_("row_w2", put(dual_axis.refit_weights(fmt.w, fmt.bits, fmt.config)))
        set_("row_gain", put(dual_axis.row_gains(fmt.bits, fmt.config)))
        set_("planes", sum(width for width in PLANE_WIDTHS if bool((head_planes & width).any())))
        set_("head_groups", _head_groups(bits, head_planes, same, device))

    @property
    def num_heads(self) -> int:
        return self.format.num_heads

    @property
    def key_dim(self) -> int:
        return self.format.key_dim

    @property
    def words_per_slot(self) -> int:
        return self.layout.words_per_slot

    @property
    def num_scaled_heads(self) -> int:
        return self.layout.num_scaled_heads

    @property
    def has_col_scale(self) -> bool:
        return self.format.has_col_scale

    @property
    def row_fill(self) -> bool:
        """Whether the kernels refit the rows after the column scales (a dual-axis row_fill quantizer)."""
        return self.has_col_scale and self.format.config.row_fill

    @property
    def grid(self) -> Grid:
        return self.format.grid


def _head_groups(bits: torch.Tensor, head_planes: torch.Tensor, same: torch.Tensor,
                 device: torch.device) -> tuple[tuple[torch.Tensor, int, int], ...]:
    """(head indices, plane widths, uniform bits) of each launch, in the order of their first head."""
    groups: dict[tuple[int, int], list[int]] = {}
    mixed_planes = 0
    for head in range(bits.shape[0]):
        if bool(same[head]):
            groups.setdefault((int(head_planes[head]), int(bits[head, 0])), []).append(head)
        else:
            mixed_planes |= int(head_planes[head])
            groups.setdefault((-1, 0), []).append(head)
    ordered = sorted(groups.items(), key=lambda item: item[1][0])
    return tuple((torch.tensor(members, dtype=torch.int32, device=device),
                  mixed_planes if planes < 0 else planes, uniform) for (planes, uniform), members in ordered)


@dataclass(frozen=True, eq=False)
class Pages:
    """The packed slots of one layer (docs/format.md), on one device.

    codes:     int32 [S, W]        code words of each slot
    row_scale: fp16  [S, Hs, K]    row scales of the scaled heads (layout.scaled_heads order)
    col_scale: fp16  [S, Hs, V]    column scales, or None (spatial="absmax")
    in_use:    bool  [S]           the slots an allocator has handed out (updated in place by it), or
                                   None: every slot may be used (check_slots)
    """

    codes: torch.Tensor
    row_scale: torch.Tensor
    col_scale: torch.Tensor | None = None
    in_use: torch.Tensor | None = None

    @classmethod
    def empty(cls, tables: FormatTables, num_slots: int) -> Pages:
        """Zeroed pages for ``num_slots`` slots of ``tables``' layout on its device (zero states)."""
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be a positive int, got {num_slots!r}")
        zeros = lambda *shape, dtype: torch.zeros(num_slots, *shape, dtype=dtype, device=tables.device)
        scaled = tables.num_scaled_heads
        col_scale = zeros(scaled, tables.value_dim, dtype=torch.float16) if tables.has_col_scale else None
        return cls(zeros(tables.words_per_slot, dtype=torch.int32),
                   zeros(scaled, tables.key_dim, dtype=torch.float16), col_scale)

    @property
    def num_slots(self) -> int:
        return self.codes.shape[0]

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def tensors(self) -> Iterable[torch.Tensor]:
        yield self.codes
        yield self.row_scale
        if self.col_scale is not None:
            yield self.col_scale

    def gather(self, tables: FormatTables, slots: torch.Tensor | Sequence[int]) -> PackedState:
        """The packed states of ``slots`` (a copy), for the torch reference and the boundary path."""
        index = _as_index(slots, self.num_slots, self.device)
        col = None if self.col_scale is None else self.col_scale[index]
        return PackedState(self.codes[index], self.row_scale[index], col, tables.layout, tables.grid)

    def scatter(self, tables: FormatTables, slots: torch.Tensor | Sequence[int], packed: PackedState) -> None:
        """Write packed states (e.g. packing.pack of the format's codec's QState) into ``slots``."""
        index = _as_index(slots, self.num_slots, self.device)
        if packed.layout is not tables.layout and not packed.layout.same_as(tables.layout):
            raise ValueError("packed states were built for a different layout (format or value_dim differ)")
        if packed.num_slots != index.numel():
            raise ValueError(f"got {packed.num_slots} packed states for {index.numel()} slots")
        self.codes[index] = packed.codes.to(self.device)
        self.row_scale[index] = packed.row_scale.to(self.device)
        if self.col_scale is not None:
            self.col_scale[index] = packed.col_scale.to(self.device)

    def zero_(self, slots: torch.Tensor | Sequence[int]) -> None:
        """Reset slots to the zero state (all code words and scales zero)."""
        index = _as_index(slots, self.num_slots, self.device)
        for t in self.tensors():
            t[index] = 0


def check_pages(tables: FormatTables, pages: Pages) -> None:
    """TypeError / ValueError unless ``pages`` hold slots of ``tables``' layout on its device."""
    if not isinstance(tables, FormatTables):
        raise TypeError(f"tables must be a FormatTables, got {type(tables).__name__}")
    if not isinstance(pages, Pages):
        raise TypeError(f"pages must be Pages, got {type(pages).__name__}")
    num_slots, scaled = pages.codes.shape[0], tables.num_scaled_heads
    expected = {"codes": (torch.int32, (num_slots, tables.words_per_slot)),
                "row_scale": (torch.float16, (num_slots, scaled, tables.key_dim)),
                "col_scale": (torch.float16, (num_slots, scaled, tables.value_dim))}
    in_use = pages.in_use
    if in_use is not None and (in_use.dtype != torch.bool or tuple(in_use.shape) != (num_slots,)
                               or in_use.device != tables.device):
        raise ValueError(f"pages.in_use must be a bool tensor [{num_slots}] on {tables.device}, got "
                         f"{in_use.dtype} {list(in_use.shape)} on {in_use.device}")
    if (pages.col_scale is not None) != tables.has_col_scale:
        raise ValueError(f"the format {'has' if tables.has_col_scale else 'has no'} column scales but "
                         f"pages.col_scale is {'None' if pages.col_scale is None else 'given'}")
    for name, (dtype, shape) in expected.items():
        t = getattr(pages, name)
        if t is not None and (t.dtype != dtype or tuple(t.shape) != shape or t.device != tables.device):
            raise ValueError(f"pages.{name} must be {dtype} {list(shape)} on {tables.device}, got {t.dtype} "
                             f"{list(t.shape)} on {t.device}")


_CHECKED = WeakIdKeyDictionary()  # slots tensor -> (its version, the pages' slot count, in_use, its version)


def check_slots(slots: torch.Tensor, pages: Pages) -> None:
    """TypeError / ValueError unless ``slots`` are the slot indices of a batch into ``pages``.

    slots must be an int32 tensor [N], one entry per batch row (the callers check the other inputs
    against N); each entry is -1 (skip the row: its output and every slot untouched; no other negative
    value is accepted) or a slot in [0, num_slots) that no other row names and, when the pages carry an
    allocator's ``in_use`` mask, one it has handed out.

    The value checks are one small reduction and, for a CUDA tensor, one device-to-host sync, paid once
    per tensor: a slots tensor that passed is not checked again until it is modified in place (its
    version counter) or the in_use mask changes, so the serving loop, which hands every layer of every
    token the same tensor, pays it once per batch. Inference tensors (made under torch.inference_mode)
    have no version counter and are checked at every call; ``PackedStatePool.slot_tensor`` makes normal
    ones. Inside CUDA graph capture (no sync allowed) only the dtype and the shape are checked.
    """
    if not isinstance(slots, torch.Tensor) or slots.dtype != torch.int32 or slots.dim() != 1:
        is_tensor = isinstance(slots, torch.Tensor)
        got = f"{slots.dtype} {list(slots.shape)}" if is_tensor else type(slots).__name__
        raise TypeError(f"slots must be an int32 tensor [N] (one slot index per batch row, -1 to skip a "
                        f"row), got {got}")
    in_use = pages.in_use
    versioned = not slots.is_inference() and (in_use is None or not in_use.is_inference())
    key = versioned and (slots._version, pages.num_slots, in_use, None if in_use is None else in_use._version)
    seen = _CHECKED.get(slots) if versioned else None
    if seen is not None and seen[2] is in_use and seen == key:  # `is` first: no tensor == on in_use
        return
    if slots.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    index = slots.to(torch.int64)
    bad = (index < -1) | (index >= pages.num_slots)
    ordered = index.sort().values
    twice = (ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)
    if in_use is not None:
        free = (index >= 0) & ~in_use.to(index.device)[index.clamp(0, pages.num_slots - 1)]
        bad = bad | free
    if bool(bad.any() | twice.any()):  # the one sync; the message is built on the host
        _raise_bad_slots(index.cpu(), pages.num_slots, None if in_use is None else in_use.cpu())
    if versioned:
        _CHECKED[slots] = key


def _raise_bad_slots(index: torch.Tensor, num_slots: int, in_use: torch.Tensor | None) -> None:
    values = index.tolist()
    out_of_range = [s for s in values if s < -1 or s >= num_slots]
    if out_of_range:
        raise ValueError(f"slot indices must be -1 (skip the row) or in [0, {num_slots}), got "
                         f"{out_of_range[:8]}")
    repeated = sorted({s for s in values if s >= 0 and values.count(s) > 1})
    if repeated:
        raise ValueError(f"slots {repeated[:8]} are named by more than one batch row; each row needs its "
                         "own slot (two rows would write one state)")
    free = [s for s in values if s >= 0 and not bool(in_use[s])]
    raise ValueError(f"slots {free[:8]} are not allocated (freed, or never handed out by the pool): a "
                     "request's slot ids are valid from alloc until free")


def _as_index(slots, num_slots: int, device: torch.device) -> torch.Tensor:
    index = torch.as_tensor(slots, dtype=torch.int64).reshape(-1)
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= num_slots):
        raise IndexError(f"slot indices must be in [0, {num_slots}), got {index.tolist()[:8]}")
    return index.to(device)

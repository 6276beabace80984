"""Bit-packing of a :class:`~stepquant.codecs.base.QState` into the flat per-slot buffers of docs/format.md.

Codecs produce one uint8 code per value; the GPU pool and kernels store a slot as int32 code words
(2..8-bit codes split into bit planes, FP16 pivot rows as raw binary16 bit patterns) plus FP16 scale
vectors for the heads that have integer rows. This module is the reference implementation of that
layout, in vectorised torch so it runs on any device: :func:`pack` / :func:`unpack` round-trip a
QState exactly (codes, scales and pivot bit patterns), and :class:`PackedLayout` computes, once per
layer from ``bits [H, K]`` and ``V``, the offsets the kernels and the pool index with.

What packing does not keep (codes of pivot rows, pivot values of integer rows, scales of heads that
are all pivots) is refilled by :func:`unpack` with the values the codecs write there (code 0, pivot
+0.0, scale 1.0), so ``unpack(pack(q))`` equals ``canonicalize(q)`` bit for bit, and equals ``q``
itself for a QState a codec produced.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .base import MAX_BITS, MIN_BITS, PIVOT_BITS, Grid, QState

WORD_BITS = 32
# Every plane width that occurs, widest first: the order planes are laid out in a row.
PLANE_WIDTHS = (16, 8, 4, 2, 1)
ALLOWED_BITS = tuple(range(MIN_BITS, MAX_BITS + 1)) + (PIVOT_BITS,)


class PackingFormat(enum.Enum):
    """How the codes of one slot are laid out in memory (docs/format.md is the contract).

    BIT_PLANES_INT32: rows in ``h * K + i`` order, each row word-aligned and contiguous. A row of
    bit width b is split into bit planes whose widths are the binary decomposition of b, widest
    first (3 -> [2, 1], 6 -> [4, 2], 7 -> [4, 2, 1], 8 -> [8], pivot 16 -> [16]). Plane p of width w
    holds code bits ``o_p .. o_p + w - 1`` with o_0 = 0 (the widest plane holds the lowest bits).
    Each plane packs 32 / w values per int32 word, little-endian within the word: value j sits in
    word ``j // (32 / w)`` of that plane at bit offset ``(j % (32 / w)) * w``; a plane takes
    ``ceil(V * w / 32)`` words and unused high bits of its last word are zero. The 16-bit code of a
    pivot row is the raw IEEE binary16 bit pattern of the value. Words are stored as int32 (two's
    complement of the 32-bit pattern), so in memory the bytes of a slot are little-endian words.
    """

    BIT_PLANES_INT32 = "bit_planes_int32"


def _check_bit_width(bits: int, name: str = "bits") -> int:
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(f"{name} must be an int in {MIN_BITS}..{MAX_BITS} or {PIVOT_BITS}, got {bits!r}")
    if bits not in ALLOWED_BITS:
        raise ValueError(f"{name}={bits} is not a packable width: allowed are {MIN_BITS}..{MAX_BITS} "
                         f"and {PIVOT_BITS} (FP16 pivot)")
    return bits


def _check_value_dim(value_dim: int) -> int:
    if isinstance(value_dim, bool) or not isinstance(value_dim, int):
        raise TypeError(f"value_dim must be a positive int, got {value_dim!r}")
    if value_dim < 1:
        raise ValueError(f"value_dim must be >= 1, got {value_dim}")
    return value_dim


def plane_widths(bits: int) -> tuple[int, ...]:
    """Bit-plane widths of a row of ``bits`` bits, widest first: 6 -> (4, 2), 16 -> (16,)."""
    _check_bit_width(bits)
    return tuple(w for w in PLANE_WIDTHS if bits & w)


def plane_bit_offsets(bits: int) -> tuple[int, ...]:
    """Lowest code bit held by each plane of :func:`plane_widths`: 7 -> (0, 4, 6)."""
    return tuple(bits & ~(2 * w - 1) for w in plane_widths(bits))


def plane_words(width: int, value_dim: int) -> int:
    """int32 words one plane of ``width`` bits takes for ``value_dim`` values: ceil(V * w / 32)."""
    if width not in PLANE_WIDTHS:
        raise ValueError(f"width={width} is not a plane width; allowed are {PLANE_WIDTHS}")
    return -(-_check_value_dim(value_dim) * width // WORD_BITS)


def row_words(bits: int, value_dim: int) -> int:
    """int32 words one key row of ``bits`` bits and ``value_dim`` values takes (4b at V = 128)."""
    return sum(plane_words(w, value_dim) for w in plane_widths(bits))


def _validate_bits_tensor(bits: torch.Tensor, name: str = "bits") -> torch.Tensor:
    if not isinstance(bits, torch.Tensor):
        raise TypeError(f"{name} must be an integer torch.Tensor of shape [H, K], got {type(bits).__name__}")
    if bits.dtype.is_floating_point or bits.dtype.is_complex or bits.dtype == torch.bool:
        raise TypeError(f"{name} must have an integer dtype (int8 as in QState), got {bits.dtype}")
    if bits.dim() != 2 or bits.shape[0] < 1 or bits.shape[1] < 1:
        raise ValueError(f"{name} must have shape [H, K] with H, K >= 1, got {tuple(bits.shape)}")
    flat = bits.detach().to("cpu", torch.int64)
    bad = ~torch.isin(flat, torch.tensor(ALLOWED_BITS))
    if bad.any():
        values = sorted(set(flat[bad].tolist()))
        raise ValueError(f"{name} holds unsupported widths {values[:8]}: allowed are "
                         f"{MIN_BITS}..{MAX_BITS} and {PIVOT_BITS} (FP16 pivot row)")
    return flat


@dataclass(frozen=True, eq=False)
class PackedLayout:
    """Where everything of one layer's slot lives, fixed by the plan ``bits [H, K]`` and ``value_dim``.

    Built once per layer (on the CPU, ``LayerFormat.layout``) and shared by every slot; the kernels'
    FormatTables copy the int32 tables to the device. Index tables use the flat row index ``r = h * K + i``.
    ``bytes_per_slot`` / ``analytical_bytes`` are the one byte count of a layer's packed state.

    bits:               int8  [H, K]      bit width per key row (2..8, or 16 for an FP16 pivot row)
    row_words:          int32 [H*K]       words each row takes
    row_word_offset:    int32 [H*K]       first word of each row in the slot
    plane_word_offset:  int32 [H*K, 5]    first word of the plane of width PLANE_WIDTHS[p] (16, 8, 4,
                                          2, 1) of each row, -1 where the row has no such plane
    head_scale_slot:    int32 [H]         index of the head in the scale buffers, -1 if it has none
    scaled_heads:       heads that have at least one integer row, in head order (they carry scales)
    words_per_slot:     W, int32 code words per slot
    bytes_per_slot:     serving bytes: 4 W + 2 Hs (K + V) (2 Hs K without column scales)
    analytical_bytes:   scale slots reserved for every head: 4 W + 2 H (K + V) (2 H K without columns)
    """

    bits: torch.Tensor
    value_dim: int
    has_col_scale: bool = True
    num_heads: int = field(init=False)
    key_dim: int = field(init=False)
    row_words: torch.Tensor = field(init=False, repr=False)
    row_word_offset: torch.Tensor = field(init=False, repr=False)
    plane_word_offset: torch.Tensor = field(init=False, repr=False)
    head_scale_slot: torch.Tensor = field(init=False, repr=False)
    scaled_heads: tuple[int, ...] = field(init=False)
    words_per_slot: int = field(init=False)
    num_pivot_rows: int = field(init=False)
    bytes_per_slot: int = field(init=False)
    analytical_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        self._build(_validate_bits_tensor(self.bits), self.value_dim, self.has_col_scale)

    @classmethod
    def _of_checked(cls, bits: torch.Tensor, value_dim: int, has_col_scale: bool) -> PackedLayout:
        """The layout of a bit table validated already (a LayerFormat's int8 [H, K] on the CPU), without
        validating it again."""
        layout = object.__new__(cls)
        layout._build(bits.to(torch.int64), value_dim, has_col_scale)
        return layout

    def _build(self, bits: torch.Tensor, value_dim: int, has_col_scale: bool) -> None:
        """Every field from valid bits (int64 [H, K], CPU)."""
        value_dim = _check_value_dim(value_dim)
        if not isinstance(has_col_scale, bool):
            raise TypeError(f"has_col_scale must be a bool, got {has_col_scale!r}")
        num_heads, key_dim = bits.shape
        flat = bits.reshape(-1)  # [H*K]

        # Planes are laid out widest first, so a plane starts after the wider planes of its row.
        plane_offset = torch.full((flat.numel(), len(PLANE_WIDTHS)), -1, dtype=torch.int64)
        words_so_far = torch.zeros_like(flat)
        for p, width in enumerate(PLANE_WIDTHS):
            present = (flat & width) != 0
            plane_offset[:, p] = torch.where(present, words_so_far, -1)
            words_so_far = words_so_far + present.to(torch.int64) * plane_words(width, value_dim)
        row_word_count = words_so_far  # [H*K]
        row_start = torch.cumsum(row_word_count, 0) - row_word_count  # exclusive prefix sum
        plane_offset = torch.where(plane_offset >= 0, plane_offset + row_start[:, None], -1)

        has_integer_row = (bits != PIVOT_BITS).any(dim=1)  # [H]
        scaled = tuple(int(h) for h in torch.nonzero(has_integer_row).flatten().tolist())
        head_slot = torch.full((num_heads,), -1, dtype=torch.int64)
        head_slot[list(scaled)] = torch.arange(len(scaled))

        words = int(row_word_count.sum())
        if words >= 2**31:
            raise ValueError(f"a slot of {words} words does not fit int32 offsets; split the layer")
        scale_values = key_dim + value_dim if has_col_scale else key_dim
        set_ = lambda name, value: object.__setattr__(self, name, value)
        set_("bits", bits.to(torch.int8))
        set_("value_dim", value_dim)
        set_("has_col_scale", has_col_scale)
        set_("num_heads", int(num_heads))
        set_("key_dim", int(key_dim))
        set_("row_words", row_word_count.to(torch.int32))
        set_("row_word_offset", row_start.to(torch.int32))
        set_("plane_word_offset", plane_offset.to(torch.int32))
        set_("head_scale_slot", head_slot.to(torch.int32))
        set_("scaled_heads", scaled)
        set_("words_per_slot", words)
        set_("num_pivot_rows", int((flat == PIVOT_BITS).sum()))
        set_("bytes_per_slot", 4 * words + 2 * len(scaled) * scale_values)
        set_("analytical_bytes", 4 * words + 2 * num_heads * scale_values)

    @property
    def num_scaled_heads(self) -> int:
        return len(self.scaled_heads)

    @property
    def code_bytes(self) -> int:
        """Bytes of the int32 code words of one slot (pivot rows included)."""
        return 4 * self.words_per_slot

    def same_as(self, other: PackedLayout) -> bool:
        """True when both layouts describe byte-identical slots."""
        return (
            isinstance(other, PackedLayout)
            and self.value_dim == other.value_dim
            and self.has_col_scale == other.has_col_scale
            and self.bits.shape == other.bits.shape
            and bool(torch.equal(self.bits, other.bits))
        )

    def _rows_with_plane(self, p: int) -> torch.Tensor:
        """Flat row indices (int64, CPU) that have the plane of width PLANE_WIDTHS[p]."""
        return torch.nonzero(self.plane_word_offset[:, p] >= 0).flatten()


@dataclass(frozen=True, eq=False)
class PackedState:
    """N packed slots of one layer (docs/format.md, format ``PackingFormat.BIT_PLANES_INT32``).

    codes:     int32 [N, W]         code words of every row, pivots included
    row_scale: fp16  [N, Hs, K]     row scales of the scaled heads, in ``layout.scaled_heads`` order
    col_scale: fp16  [N, Hs, V] or None (format without column scales)
    """

    codes: torch.Tensor
    row_scale: torch.Tensor
    col_scale: torch.Tensor | None
    layout: PackedLayout
    grid: Grid = Grid.MIDTREAD
    format: PackingFormat = PackingFormat.BIT_PLANES_INT32

    def __post_init__(self) -> None:
        layout = self.layout
        if not isinstance(layout, PackedLayout):
            raise TypeError(f"layout must be a PackedLayout, got {type(layout).__name__}")
        if not isinstance(self.grid, Grid):
            raise TypeError(f"grid must be a Grid, got {self.grid!r}")
        if self.format is not PackingFormat.BIT_PLANES_INT32:
            raise ValueError(f"format={self.format!r} is not supported; only BIT_PLANES_INT32 exists")
        _check_tensor(self.codes, "codes", torch.int32, None, layout.words_per_slot)
        n = self.codes.shape[0]
        scaled_heads = layout.num_scaled_heads
        _check_tensor(self.row_scale, "row_scale", torch.float16, (n, scaled_heads, layout.key_dim))
        if layout.has_col_scale:
            if self.col_scale is None:
                raise ValueError("col_scale is None but the layout has column scales")
            _check_tensor(self.col_scale, "col_scale", torch.float16, (n, scaled_heads, layout.value_dim))
        elif self.col_scale is not None:
            raise ValueError("col_scale given but the layout has no column scales (has_col_scale=False)")

    @property
    def num_slots(self) -> int:
        return self.codes.shape[0]


def _check_tensor(t, name: str, dtype: torch.dtype, shape: tuple[int, ...] | None, last: int | None = None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of dtype {dtype}, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if last is not None and (t.dim() != 2 or t.shape[1] != last):
        raise ValueError(f"{name} must have shape [N, {last}], got {tuple(t.shape)}")


def _check_qstate(q: QState) -> None:
    if not isinstance(q, QState):
        raise TypeError(f"q must be a QState, got {type(q).__name__}")
    if not isinstance(q.codes, torch.Tensor) or q.codes.dtype != torch.uint8 or q.codes.dim() != 4:
        c = q.codes
        got = f"{c.dtype} {tuple(c.shape)}" if isinstance(c, torch.Tensor) else type(c).__name__
        raise TypeError(f"q.codes must be a uint8 tensor [N, H, K, V], got {got}")
    n, h, k, v = q.codes.shape
    if min(n, h, k, v) < 1:
        raise ValueError(f"q.codes must have non-empty shape [N, H, K, V], got {(n, h, k, v)}")
    _validate_bits_tensor(q.bits, "q.bits")
    if tuple(q.bits.shape) != (h, k):
        raise ValueError(f"q.bits must have shape [H, K] = {(h, k)}, got {tuple(q.bits.shape)}")
    _check_tensor(q.row_scale, "q.row_scale", torch.float16, (n, h, k))
    if q.col_scale is not None:
        _check_tensor(q.col_scale, "q.col_scale", torch.float16, (n, h, v))
    if q.pivots is not None:
        _check_tensor(q.pivots, "q.pivots", torch.float16, (n, h, k, v))
    for name in ("row_scale", "col_scale", "pivots"):
        t = getattr(q, name)
        if t is not None and t.device != q.codes.device:
            raise ValueError(f"q.{name} is on {t.device} but q.codes is on {q.codes.device}")
    if not isinstance(q.grid, Grid):
        raise TypeError(f"q.grid must be a Grid, got {q.grid!r}")


def _to_int32_words(words: torch.Tensor) -> torch.Tensor:
    """int64 32-bit patterns in [0, 2**32) -> int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack(q: QState, layout: PackedLayout | None = None) -> PackedState:
    """Pack ``q`` (N slots of one layer) into int32 code words and FP16 scale buffers.

    ``layout`` defaults to ``PackedLayout(q.bits, V, has_col_scale=q.col_scale is not None)``; pass
    the layer's layout to skip rebuilding it (it must describe the same plan). Raises ValueError if
    an integer row holds a code >= 2**b (it would corrupt its neighbours) or pivot rows lack values.
    """
    _check_qstate(q)
    n, h, k, v = q.codes.shape
    if layout is None:
        layout = PackedLayout(q.bits, v, has_col_scale=q.col_scale is not None)
    elif not isinstance(layout, PackedLayout):
        raise TypeError(f"layout must be a PackedLayout or None, got {type(layout).__name__}")
    elif (layout.value_dim != v or layout.has_col_scale != (q.col_scale is not None)
          or tuple(layout.bits.shape) != (h, k)
          or not torch.equal(layout.bits, q.bits.to("cpu", torch.int8))):
        raise ValueError("layout does not match q (bits, value_dim or column-scale presence differ)")
    device = q.codes.device
    bits = layout.bits.to(device=device, dtype=torch.int64).reshape(h * k)  # [H*K]
    is_pivot = bits == PIVOT_BITS

    raw = q.codes.reshape(n, h * k, v).to(torch.int32)  # [N, H*K, V]
    code_limit = torch.ones_like(bits) << bits.clamp(max=MAX_BITS)
    too_big = (raw >= code_limit[None, :, None]) & ~is_pivot[None, :, None]
    if too_big.any():
        slot, row, col = torch.nonzero(too_big)[0].tolist()
        raise ValueError(f"q.codes[{slot}, {row // k}, {row % k}, {col}] = {int(raw[slot, row, col])} does "
                         f"not fit the row's {int(bits[row])} bits (codes must be < 2**bits)")
    if layout.num_pivot_rows:
        if q.pivots is None:
            raise ValueError(f"q.bits marks {layout.num_pivot_rows} FP16 pivot rows but q.pivots is None")
        pivot_bits = q.pivots.reshape(n, h * k, v).view(torch.int16).to(torch.int32) & 0xFFFF
        raw = torch.where(is_pivot[None, :, None], pivot_bits, raw)

    words = torch.zeros(n, layout.words_per_slot, dtype=torch.int64, device=device)  # [N, W]
    for p, width in enumerate(PLANE_WIDTHS):
        rows = layout._rows_with_plane(p).to(device)  # [R]
        if rows.numel() == 0:
            continue
        per_word, n_words = WORD_BITS // width, plane_words(width, v)
        bit_offset = bits[rows] & ~(2 * width - 1)  # [R] lowest code bit held by this plane
        plane = (raw[:, rows].to(torch.int64) >> bit_offset[None, :, None]) & ((1 << width) - 1)  # [N, R, V]
        plane = F.pad(plane, (0, n_words * per_word - v))  # [N, R, n_words * per_word], zero padded
        lane_shift = torch.arange(per_word, device=device, dtype=torch.int64) * width  # [per_word]
        packed_plane = (plane.view(n, -1, n_words, per_word) << lane_shift).sum(-1)  # [N, R, n_words]
        start = layout.plane_word_offset[:, p].to(device=device, dtype=torch.int64)[rows]  # [R]
        word_index = start[:, None] + torch.arange(n_words, device=device)  # [R, n_words]
        words[:, word_index.reshape(-1)] = packed_plane.reshape(n, -1)

    scaled = torch.tensor(layout.scaled_heads, dtype=torch.int64, device=device)  # [Hs]
    row_scale = q.row_scale.index_select(1, scaled).contiguous()  # [N, Hs, K]
    col_scale = q.col_scale.index_select(1, scaled).contiguous() if q.col_scale is not None else None
    return PackedState(_to_int32_words(words), row_scale, col_scale, layout, q.grid)


def unpack(packed: PackedState) -> QState:
    """The QState ``packed`` stores: equal, bit for bit, to ``canonicalize`` of what was packed."""
    if not isinstance(packed, PackedState):
        raise TypeError(f"packed must be a PackedState, got {type(packed).__name__}")
    layout = packed.layout
    device = packed.codes.device
    n, h, k, v = packed.num_slots, layout.num_heads, layout.key_dim, layout.value_dim
    bits = layout.bits.to(device=device, dtype=torch.int64).reshape(h * k)  # [H*K]
    is_pivot = bits == PIVOT_BITS

    words = packed.codes.to(torch.int64) & 0xFFFFFFFF  # [N, W] unsigned 32-bit patterns
    raw = torch.zeros(n, h * k, v, dtype=torch.int32, device=device)  # [N, H*K, V]
    for p, width in enumerate(PLANE_WIDTHS):
        rows = layout._rows_with_plane(p).to(device)  # [R]
        if rows.numel() == 0:
            continue
        per_word, n_words = WORD_BITS // width, plane_words(width, v)
        start = layout.plane_word_offset[:, p].to(device=device, dtype=torch.int64)[rows]  # [R]
        word_index = start[:, None] + torch.arange(n_words, device=device)  # [R, n_words]
        packed_plane = words[:, word_index.reshape(-1)].view(n, -1, n_words)  # [N, R, n_words]
        lane_shift = torch.arange(per_word, device=device, dtype=torch.int64) * width  # [per_word]
        plane = (packed_plane[..., None] >> lane_shift) & ((1 << width) - 1)  # [N, R, n_words, per_word]
        plane = plane.reshape(n, -1, n_words * per_word)[..., :v]  # [N, R, V]
        bit_offset = bits[rows] & ~(2 * width - 1)  # [R]
        raw[:, rows] = raw[:, rows] | (plane << bit_offset[None, :, None]).to(torch.int32)

    codes = torch.where(is_pivot[None, :, None], 0, raw).to(torch.uint8).view(n, h, k, v)
    pivots = None
    if layout.num_pivot_rows:
        pattern = torch.where(is_pivot[None, :, None], raw, 0)  # [N, H*K, V] in [0, 2**16)
        pattern = torch.where(pattern >= 2**15, pattern - 2**16, pattern).to(torch.int16)
        pivots = pattern.view(torch.float16).view(n, h, k, v)

    scaled = torch.tensor(layout.scaled_heads, dtype=torch.int64, device=device)  # [Hs]
    row_scale = torch.ones(n, h, k, dtype=torch.float16, device=device)  # 1.0 where a head has no scales
    row_scale[:, scaled] = packed.row_scale
    col_scale = None
    if packed.col_scale is not None:
        col_scale = torch.ones(n, h, v, dtype=torch.float16, device=device)
        col_scale[:, scaled] = packed.col_scale
    return QState(codes, layout.bits.to(device), row_scale, col_scale, pivots, packed.grid)


def canonicalize(q: QState) -> QState:
    """``q`` with what the packed format does not store set to the codecs' fill values: ``unpack(pack(q))``.

    Codes of pivot rows -> 0; pivot values of integer rows -> +0.0 (``pivots`` is None when no row is
    a pivot); row and column scales of heads without integer rows (GDN pivot heads) -> 1.0. A KDA
    pivot row keeps its row-scale slot, so its scale survives. Dequantized values are unchanged.
    """
    _check_qstate(q)
    n, h, k, v = q.codes.shape
    device = q.codes.device
    bits = q.bits.to(device=device, dtype=torch.int8)
    is_pivot = (bits == PIVOT_BITS)[None, :, :, None]  # [1, H, K, 1]
    codes = torch.where(is_pivot, 0, q.codes).to(torch.uint8)
    pivots = None
    if bool(is_pivot.any()):
        if q.pivots is None:
            raise ValueError("q.bits marks FP16 pivot rows but q.pivots is None")
        pattern = q.pivots.view(torch.int16)
        pivots = torch.where(is_pivot, pattern, torch.zeros_like(pattern)).view(torch.float16)
    has_integer_row = (bits != PIVOT_BITS).any(dim=1)[None, :, None]  # [1, H, 1]
    # Select on int16 views so every kept scale keeps its exact bit pattern (NaN payloads included).
    fp16_one = 0x3C00  # bit pattern of 1.0
    keep = lambda scale: torch.where(has_integer_row, scale.view(torch.int16), fp16_one).view(torch.float16)
    row_scale = keep(q.row_scale)
    col_scale = keep(q.col_scale) if q.col_scale is not None else None
    return QState(codes, bits, row_scale, col_scale, pivots, q.grid)

"""The one interface every state format implements, the quantized-state container they share, and the
reference quantization primitives every integer format (and every GPU kernel) is built from.

A codec turns a batch of recurrent states ``[N, H, K, V]`` (key-row-major) into a typed encoded object
and back to FP32, and reports exactly how many bits that object occupies. Serving code, the quantized
recurrence loop, the cache and the evaluation only ever talk to this interface, so every baseline and
every STEPQuant variant is interchangeable.

All integer formats share one container, :class:`QState`, so that packing, the GPU pool and the
kernels need to understand a single representation (docs/format.md gives the exact meaning):

    value[n, h, i, j] = (codes[n, h, i, j] - zero(bits[h, i])) * row_scale[n, h, i] * col_scale[n, h, j]

for integer rows, where ``zero(b) = 2**(b-1)`` on the mid-tread grid and ``2**(b-1) - 0.5`` on
the mid-rise grid. Rows with ``bits == 16`` are FP16 pivots: their values are ``pivots`` and
their codes/scales are ignored (codecs write code 0 and row scale 1.0 there).

The primitives below are the bit-exact reference a kernel must reproduce:

- :func:`fp16_scale`: a scale is clamped to [2^-14, 65504] in FP32, then rounded to nearest FP16;
  codes are always computed against that rounded value.
- :func:`round_to_codes`: ``t`` is the value already divided by its scale(s) (how it was divided is
  the caller's contract: true FP32 division, or the dual-axis quantizer's "reciprocal" mode).
  MIDTREAD: ``u = clamp(rint(t + zero(b)), 1, 2^b - 1)`` with rint = round half to even (torch.round,
  CUDA rintf, Triton libdevice.rint). MIDRISE: ``u = clamp(floor(t + 2^(b-1)), 0, 2^b - 1)`` (the
  nearest mid-rise level). The sum is rounded to FP32 first, unless exact_sum=True.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

PIVOT_BITS = 16
MIN_BITS, MAX_BITS = 2, 8
FP16_SCALE_MIN, FP16_SCALE_MAX = 2.0**-14, 65504.0
FP16_MAX = 65504.0


class Grid(enum.Enum):
    """Integer grid of a b-bit code u in [0, 2**b).

    MIDTREAD: level = u - 2**(b-1); codes used are 1..2**b-1 (symmetric, includes 0).
    MIDRISE:  level = u - 2**(b-1) + 0.5; all 2**b codes are used (symmetric, no 0).
    """

    MIDTREAD = "midtread"
    MIDRISE = "midrise"

    def zero(self, bits: torch.Tensor | int) -> torch.Tensor | float:
        """The code that represents level 0 (possibly half-way between two codes)."""
        if isinstance(bits, int):
            z = float(2 ** (bits - 1))
        else:
            z = torch.pow(2.0, bits.to(torch.float32) - 1)
        return z - 0.5 if self is Grid.MIDRISE else z

    def qmax(self, bits: torch.Tensor | int) -> torch.Tensor | float:
        """Largest level magnitude on the grid (float for an int, FP32 tensor for a tensor of bits)."""
        half = 2.0 ** (bits - 1) if isinstance(bits, int) else torch.pow(2.0, bits.to(torch.float32) - 1)
        return half - 1 if self is Grid.MIDTREAD else half - 0.5

    def code_range(self, bits: torch.Tensor | int) -> tuple[torch.Tensor | float, torch.Tensor | float]:
        """(lowest, highest) code the grid uses at b bits: MIDTREAD [1, 2^b-1], MIDRISE [0, 2^b-1]."""
        top = 2.0**bits - 1 if isinstance(bits, int) else torch.pow(2.0, bits.to(torch.float32)) - 1
        low = 1.0 if self is Grid.MIDTREAD else 0.0
        return (low if isinstance(bits, int) else torch.full_like(top, low)), top


def parse_grid(grid: Grid | str, name: str = "grid") -> Grid:
    """Accept a Grid or its name ("midtread"/"midrise"), case-insensitive."""
    if isinstance(grid, Grid):
        return grid
    if isinstance(grid, str):
        for g in Grid:
            if grid.lower() == g.value:
                return g
    raise ValueError(f"{name} must be one of {[g.value for g in Grid]} (or a Grid), got {grid!r}")


@dataclass
class QState:
    """A batch of quantized states in the shared integer format (see module docstring).

    codes:     uint8 [N, H, K, V]   code indices in [0, 2**bits)
    bits:      int8  [H, K]         bit width per key row (2..8), or 16 for an FP16 pivot row
    row_scale: fp16  [N, H, K]      per key row scale
    col_scale: fp16  [N, H, V] or None (treated as ones)
    pivots:    fp16  [N, H, K, V] or None; read only where bits == 16
    grid:      the integer grid of all rows
    """

    codes: torch.Tensor
    bits: torch.Tensor
    row_scale: torch.Tensor
    col_scale: torch.Tensor | None
    pivots: torch.Tensor | None
    grid: Grid = Grid.MIDTREAD

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    def dequantize(self) -> torch.Tensor:
        """FP32 [N, H, K, V] reconstruction."""
        bits = self.bits.to(self.codes.device)
        level = self.codes.to(torch.float32) - self.grid.zero(bits.clamp(max=MAX_BITS))[None, :, :, None]
        out = level * self.row_scale.to(torch.float32)[..., None]
        if self.col_scale is not None:
            out = out * self.col_scale.to(torch.float32)[:, :, None, :]
        if self.pivots is not None:
            is_pivot = (bits == PIVOT_BITS)[None, :, :, None]
            out = torch.where(is_pivot, self.pivots.to(torch.float32), out)
        return out

    def validate(self) -> QState:
        """Check dtypes, shapes and code ranges against docs/format.md; return self or raise ValueError."""
        if self.codes.dim() != 4 or self.codes.dtype != torch.uint8:
            got = f"{self.codes.dtype} {tuple(self.codes.shape)}"
            raise ValueError(f"codes must be uint8 [N, H, K, V], got {got}")
        n, h, k, v = self.codes.shape
        expected = {
            "bits": (self.bits, torch.int8, (h, k)),
            "row_scale": (self.row_scale, torch.float16, (n, h, k)),
            "col_scale": (self.col_scale, torch.float16, (n, h, v)),
            "pivots": (self.pivots, torch.float16, (n, h, k, v)),
        }
        for name, (tensor, dtype, shape) in expected.items():
            if tensor is None and name in ("col_scale", "pivots"):
                continue
            if tensor.dtype != dtype or tuple(tensor.shape) != shape:
                raise ValueError(
                    f"{name} must be {dtype} {list(shape)}, got {tensor.dtype} {list(tensor.shape)}"
                )
        if not isinstance(self.grid, Grid):
            raise ValueError(f"grid must be a Grid, got {self.grid!r}")
        is_pivot = self.bits == PIVOT_BITS
        is_int = (self.bits >= MIN_BITS) & (self.bits <= MAX_BITS)
        if not bool((is_pivot | is_int).all()):
            got = self.bits.unique().tolist()
            raise ValueError(f"bits must be in {MIN_BITS}..{MAX_BITS} or {PIVOT_BITS}, got {got}")
        if bool(is_pivot.any()) and self.pivots is None:
            raise ValueError("bits marks FP16 pivot rows but pivots is None")
        low, high = self.grid.code_range(self.bits.clamp(max=MAX_BITS).to(self.codes.device))
        codes = self.codes.to(torch.float32)
        outside = (codes < low[None, :, :, None]) | (codes > high[None, :, :, None])
        outside = outside & is_int[None, :, :, None]
        if bool(outside.any()):
            count = int(outside.sum())
            raise ValueError(f"{count} codes lie outside the {self.grid.value} range of their row")
        return self


def fp16_scale(scale: torch.Tensor) -> torch.Tensor:
    """A scale as stored: clamp to [2^-14, 65504] (FP32), round to nearest FP16; returned as FP32."""
    return scale.to(torch.float32).clamp(FP16_SCALE_MIN, FP16_SCALE_MAX).to(torch.float16).to(torch.float32)


def round_to_codes(scaled: torch.Tensor, bits: torch.Tensor | int, grid: Grid,
                   exact_sum: bool = False) -> torch.Tensor:
    """Nearest-level codes (uint8) of values already divided by their scale; bits broadcasts against it.

    exact_sum=False rounds the FP32 sum ``scaled + offset`` (offset = zero(b) on MIDTREAD, 2^(b-1) on
    MIDRISE) and then takes rint / floor of it; exact_sum=True takes rint / floor of the exact sum
    (computed in FP64), which is what one FP32 add with a directed rounding mode gives on a GPU.
    """
    low, high = grid.code_range(bits)
    offset = grid.zero(bits) if grid is Grid.MIDTREAD else grid.zero(bits) + 0.5  # zero + 0.5 = 2^(b-1)
    if exact_sum:
        total = scaled.to(torch.float64) + (offset.to(torch.float64) if isinstance(offset, torch.Tensor)
                                            else offset)
    else:
        total = scaled + offset
    codes = torch.round(total) if grid is Grid.MIDTREAD else torch.floor(total)
    return torch.clamp(codes, low, high).to(torch.uint8)


def code_levels(codes: torch.Tensor, bits: torch.Tensor | int, grid: Grid) -> torch.Tensor:
    """Signed FP32 levels z = u - zero(b) of uint8 codes."""
    return codes.to(torch.float32) - grid.zero(bits)


class Codec(ABC):
    """A recurrent-state format. Subclasses are small frozen dataclasses validated on construction."""

    name: str

    @abstractmethod
    def encode(self, states: torch.Tensor) -> object:
        """Encode states [N, H, K, V] (any float dtype; arithmetic is FP32) into this format's object."""

    @abstractmethod
    def decode(self, encoded: object) -> torch.Tensor:
        """Reconstruct FP32 states [N, H, K, V]."""

    @abstractmethod
    def storage_bits(self, num_heads: int, key_dim: int, value_dim: int, *, analytical: bool = False) -> int:
        """Exact bits one request's state of one layer occupies (codes + FP16 scales + FP16 pivots).

        The compact count (codes b*V per row, no word padding). analytical=False is the serving count
        (a GDN pivot head carries no scale slots); analytical=True reserves scale slots for every head
        (the paper's count). The two differ only for formats with FP16 pivot heads.
        """

    # True for formats whose next encoding depends on what was stored before (error_feedback.py)
    carries_residual = False

    def for_shape(self, shape) -> Codec:
        """This format as a model (a stepquant.families.ModelShape) stores it, for byte counts: itself, unless
        its bytes depend on the model's layout beyond (H, K, V) (deferred.py: GDN's shared k_j)."""
        return self

    def requantize(self, states: torch.Tensor, previous: object | None) -> object:
        """Encode the next decode step's state, given the object stored for the previous step.

        Every stateless format ignores ``previous`` (this default); an error-feedback format adds the
        residual it stored there. Caches and the quantized loop call this for every decode token.
        """
        return self.encode(states)

    def roundtrip(self, states: torch.Tensor) -> torch.Tensor:
        """decode(encode(states)): the dequantized approximation used by the quantized recurrence."""
        return self.decode(self.encode(states))

    def bits_per_value(
        self, num_heads: int, key_dim: int, value_dim: int, *, analytical: bool = False
    ) -> float:
        total = self.storage_bits(num_heads, key_dim, value_dim, analytical=analytical)
        return total / (num_heads * key_dim * value_dim)


def check_states(states: torch.Tensor, name: str = "states") -> None:
    """Raise a clear error for anything a codec cannot encode faithfully."""
    if not isinstance(states, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape [N, H, K, V], got {type(states).__name__}")
    if states.dim() != 4:
        raise ValueError(f"{name} must have shape [N, H, K, V] (4 dims), got shape {tuple(states.shape)}")
    if not states.is_floating_point():
        raise TypeError(
            f"{name} must be a floating-point tensor (float32/bfloat16/float16/float64), got {states.dtype}"
        )
    if not torch.isfinite(states).all():
        bad = (~torch.isfinite(states)).sum().item()
        raise ValueError(f"{name} contains {bad} NaN/Inf values; a recurrent state must be finite")


def check_bits(bits: int, name: str = "bits") -> int:
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(f"{name} must be an int in {MIN_BITS}..{MAX_BITS}, got {bits!r}")
    if not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(
            f"{name}={bits} is out of range: integer state formats support {MIN_BITS}..{MAX_BITS} bits"
        )
    return bits


def check_dims(num_heads: int, key_dim: int, value_dim: int) -> None:
    """Validate the (H, K, V) a storage count is asked for."""
    for name, value in (("num_heads", num_heads), ("key_dim", key_dim), ("value_dim", value_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_bits_plan(bits: torch.Tensor, name: str = "bits") -> torch.Tensor:
    """Validate a per-row bit plan [H, K] (2..8, or 16 for FP16 pivot rows); return it as int8 (CPU)."""
    if not isinstance(bits, torch.Tensor):
        raise TypeError(f"{name} must be an integer torch.Tensor [H, K], got {type(bits).__name__}")
    if bits.dim() != 2:
        raise ValueError(f"{name} must have shape [H, K] (2 dims), got shape {tuple(bits.shape)}")
    if bits.is_floating_point() or bits.is_complex() or bits.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {bits.dtype}")
    bits = bits.detach().cpu().to(torch.int64)
    ok = ((bits >= MIN_BITS) & (bits <= MAX_BITS)) | (bits == PIVOT_BITS)
    if not bool(ok.all()):
        bad = sorted(set(bits[~ok].tolist()))
        allowed = f"{MIN_BITS}..{MAX_BITS} or {PIVOT_BITS} (FP16 pivot)"
        raise ValueError(f"{name} values must be in {allowed}, got {bad}")
    return bits.to(torch.int8)


def check_state_heads(states: torch.Tensor, num_heads: int, key_dim: int, what: str) -> None:
    """states [N, H, K, V] must have the H and K a per-row tensor ([H, K]) was built for."""
    if tuple(states.shape[1:3]) != (num_heads, key_dim):
        raise ValueError(
            f"states has [H, K] = {list(states.shape[1:3])} but {what} is [H, K] = {[num_heads, key_dim]}"
        )


def as_fp32(states: torch.Tensor) -> torch.Tensor:
    """Validated states as FP32 (the arithmetic precision of every codec)."""
    check_states(states)
    return states.to(torch.float32)

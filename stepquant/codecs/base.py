"""The one interface every state format implements, and the quantized-state container they share.

A codec turns a batch of recurrent states ``[N, H, K, V]`` (key-row-major, FP32) into a typed
encoded object and back, and reports exactly how many bits that object occupies. Serving code,
the quantized recurrence loop, the cache and the evaluation only ever talk to this interface,
so every baseline and every STEPQuant variant is interchangeable.

All integer formats share one container, :class:`QState`, so that packing, the GPU pool and the
kernels need to understand a single representation (docs/format.md gives the exact meaning):

    value[n, h, i, j] = (codes[n, h, i, j] - zero(bits[h, i])) * row_scale[n, h, i] * col_scale[n, h, j]

for integer rows, where ``zero(b) = 2**(b-1)`` on the mid-tread grid and ``2**(b-1) - 0.5`` on
the mid-rise grid. Rows with ``bits == 16`` are FP16 pivots: their values are ``pivots`` and
their codes/scales are ignored.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

PIVOT_BITS = 16
MIN_BITS, MAX_BITS = 2, 8
FP16_SCALE_MIN, FP16_SCALE_MAX = 2.0**-14, 65504.0


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

    def qmax(self, bits: int) -> float:
        """Largest level magnitude on the grid."""
        return 2 ** (bits - 1) - 1 if self is Grid.MIDTREAD else 2 ** (bits - 1) - 0.5


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


class Codec(ABC):
    """A recurrent-state format. Subclasses are small frozen dataclasses validated on construction."""

    name: str

    @abstractmethod
    def encode(self, states: torch.Tensor) -> object:
        """Encode FP32 states [N, H, K, V] into this format's object."""

    @abstractmethod
    def decode(self, encoded: object) -> torch.Tensor:
        """Reconstruct FP32 states [N, H, K, V]."""

    @abstractmethod
    def storage_bits(self, num_heads: int, key_dim: int, value_dim: int) -> int:
        """Exact bits one request's state of one layer occupies (codes + scales + pivots)."""

    def roundtrip(self, states: torch.Tensor) -> torch.Tensor:
        """decode(encode(states)): the dequantized approximation used by the quantized recurrence."""
        return self.decode(self.encode(states))

    def bits_per_value(self, num_heads: int, key_dim: int, value_dim: int) -> float:
        return self.storage_bits(num_heads, key_dim, value_dim) / (num_heads * key_dim * value_dim)


def check_states(states: torch.Tensor, name: str = "states") -> None:
    """Raise a clear error for anything a codec cannot encode faithfully."""
    if not isinstance(states, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape [N, H, K, V], got {type(states).__name__}")
    if states.dim() != 4:
        raise ValueError(f"{name} must have shape [N, H, K, V] (4 dims), got shape {tuple(states.shape)}")
    if not states.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor (float32/bfloat16/float16), got {states.dtype}")
    if not torch.isfinite(states).all():
        bad = (~torch.isfinite(states)).sum().item()
        raise ValueError(f"{name} contains {bad} NaN/Inf values; a recurrent state must be finite")


def check_bits(bits: int, name: str = "bits") -> int:
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(f"{name} must be an int in {MIN_BITS}..{MAX_BITS}, got {bits!r}")
    if not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"{name}={bits} is out of range: integer state formats support {MIN_BITS}..{MAX_BITS} bits")
    return bits

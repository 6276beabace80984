"""Uniform symmetric rowwise-absmax INT2..INT8: the paper's baseline (docs/method.md section 3), exactly.

Per key row i of every head:

    scale_i = fp16(clamp(max_j |X_ij| / (2^(b-1) - 1), 2^-14, 65504))
    code_ij = clamp(rint(X_ij / scale_i + 2^(b-1)), 1, 2^b - 1)      (levels -(2^(b-1)-1) .. 2^(b-1)-1)

codes computed against the FP16-rounded scale, encoded as a :class:`QState` on the MIDTREAD grid
without column scales. Round-to-nearest gives |x - x_hat| <= scale/2 for every element in range
(an element can only leave the range by the FP16 rounding of its row's scale, by < 2^-11 relative).

Stochastic rounding (``stochastic=True``, beyond the paper; serving engines discuss it for 8-bit
states): ``code = clamp(floor(X/scale + 2^(b-1) + U), 1, 2^b-1)`` with U ~ Uniform[0, 1) drawn from a
seeded torch.Generator, so E[level] = X/scale and E[decode] = X for every element. To keep that true
for the row's largest element too, the FP16 scale is rounded UP (the next FP16 value when nearest
rounding falls below absmax/qmax), so |X/scale| <= qmax and nothing is clipped; only a row whose
scale hits the 65504 clamp is biased. The generator lives in the codec and advances across calls, so
successive recurrence steps draw independent noise; pass ``generator=`` to encode for full control.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .base import (
    FP16_SCALE_MAX,
    FP16_SCALE_MIN,
    Codec,
    Grid,
    QState,
    as_fp32,
    check_bits,
    check_dims,
    fp16_scale,
    round_to_codes,
)


def rowwise_absmax_scale(states: torch.Tensor, bits: torch.Tensor | int) -> torch.Tensor:
    """FP16-representable row scales (FP32 [N, H, K]): row absmax / (2^(b-1)-1), clamped and rounded.

    bits is an int or a per-row tensor broadcastable to [N, H, K] (e.g. [H, K]).
    """
    return fp16_scale(states.abs().amax(dim=-1) / Grid.MIDTREAD.qmax(bits))


def _fp16_scale_round_up(scale: torch.Tensor) -> torch.Tensor:
    """Smallest FP16 value >= scale (clamped to [2^-14, 65504]); returned as FP32."""
    clamped = scale.clamp(FP16_SCALE_MIN, FP16_SCALE_MAX)
    half = clamped.to(torch.float16)
    below = half.to(torch.float32) < clamped
    up = torch.nextafter(half, torch.full_like(half, float("inf")))
    return torch.where(below, up, half).to(torch.float32)


@dataclass(frozen=True, eq=False)
class UniformCodec(Codec):
    """Symmetric rowwise-absmax integer codec (see module docstring).

    bits:       2..8
    stochastic: stochastic instead of nearest rounding (unbiased, seeded)
    seed:       seed of the codec's own generator (used when encode gets no generator)
    """

    bits: int = 8
    stochastic: bool = False
    seed: int = 0
    name: str = field(init=False)
    _generators: dict = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        check_bits(self.bits)
        if not isinstance(self.stochastic, bool):
            raise TypeError(f"stochastic must be a bool, got {self.stochastic!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int, got {self.seed!r}")
        object.__setattr__(self, "name", f"int{self.bits}" + ("-sr" if self.stochastic else ""))

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[key]

    def encode(self, states: torch.Tensor, generator: torch.Generator | None = None) -> QState:
        """states [N, H, K, V] -> QState (MIDTREAD, row scales only, uniform bits)."""
        x = as_fp32(states)  # [N, H, K, V]
        num_heads, key_dim = x.shape[1:3]
        grid = Grid.MIDTREAD
        if not self.stochastic:
            scale = rowwise_absmax_scale(x, self.bits)  # [N, H, K]
            codes = round_to_codes(x / scale[..., None], self.bits, grid)
        else:
            scale = _fp16_scale_round_up(x.abs().amax(dim=-1) / grid.qmax(self.bits))
            generator = self._generator(x.device) if generator is None else generator
            noise = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32)
            low, high = grid.code_range(self.bits)
            codes = torch.floor(x / scale[..., None] + grid.zero(self.bits) + noise)
            codes = codes.clamp(low, high).to(torch.uint8)
        bits = torch.full((num_heads, key_dim), self.bits, dtype=torch.int8, device=x.device)
        return QState(codes, bits, scale.to(torch.float16), None, None, grid)

    def decode(self, encoded: QState) -> torch.Tensor:
        if not isinstance(encoded, QState):
            raise TypeError(f"{self.name} codec decodes a QState, got {type(encoded).__name__}")
        return encoded.dequantize()

    def storage_bits(self, num_heads: int, key_dim: int, value_dim: int, *, analytical: bool = False) -> int:
        """Codes b*K*V plus one FP16 row scale per key row, per head."""
        check_dims(num_heads, key_dim, value_dim)
        return num_heads * key_dim * (self.bits * value_dim + 16)

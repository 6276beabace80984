"""Floating-point casts of the state: FP32 (the reference), BF16 and FP16 (what SGLang/vLLM offer).

These are the serving engines' own state dtypes, so they are the baselines every integer format is
compared with. The encoded object is simply the tensor in the storage dtype.

FP16 overflow: FP16's largest finite value is 65504, and a plain cast turns anything beyond it into
inf, which then poisons the recurrence for good. By default this codec SATURATES (clamps to
+-65504 before the cast) and so never produces inf; ``overflow="raise"`` raises ValueError instead,
naming how many values overflowed, for evaluations that want to know. BF16 shares FP32's exponent
range, so it cannot overflow on finite FP32 inputs except within half a BF16 ulp of FP32's maximum
(~3.39e38), where it also saturates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .base import Codec, as_fp32, check_dims

CAST_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
OVERFLOW_MODES = ("saturate", "raise")


@dataclass(frozen=True)
class CastCodec(Codec):
    """Store the state as FP32 (identity), BF16 or FP16, round to nearest even.

    dtype:    "fp32", "bf16" or "fp16"
    overflow: "saturate" (default: clamp to the dtype's finite range) or "raise" (ValueError)
    """

    dtype: str = "fp32"
    overflow: str = "saturate"
    name: str = field(init=False)

    def __post_init__(self) -> None:
        if self.dtype not in CAST_DTYPES:
            raise ValueError(f"dtype must be one of {list(CAST_DTYPES)}, got {self.dtype!r}")
        if self.overflow not in OVERFLOW_MODES:
            raise ValueError(f"overflow must be one of {list(OVERFLOW_MODES)}, got {self.overflow!r}")
        object.__setattr__(self, "name", self.dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        return CAST_DTYPES[self.dtype]

    def encode(self, states: torch.Tensor) -> torch.Tensor:
        """states [N, H, K, V] -> the same values in the storage dtype."""
        x = as_fp32(states)
        if self.dtype == "fp32":
            return x.clone()
        limit = torch.finfo(self.torch_dtype).max
        too_big = x.abs() > limit
        if self.overflow == "raise" and bool(too_big.any()):
            raise ValueError(
                f"{int(too_big.sum())} state values exceed the {self.dtype} range (|x| > {limit:g}); "
                f"largest |x| = {x.abs().max().item():g}"
            )
        return x.clamp(-limit, limit).to(self.torch_dtype)

    def decode(self, encoded: torch.Tensor) -> torch.Tensor:
        if not isinstance(encoded, torch.Tensor) or encoded.dtype != self.torch_dtype:
            got = encoded.dtype if isinstance(encoded, torch.Tensor) else type(encoded).__name__
            raise TypeError(f"{self.name} codec decodes a {self.torch_dtype} tensor, got {got}")
        return encoded.to(torch.float32)

    def storage_bits(self, num_heads: int, key_dim: int, value_dim: int, *, analytical: bool = False) -> int:
        check_dims(num_heads, key_dim, value_dim)
        return num_heads * key_dim * value_dim * torch.finfo(self.torch_dtype).bits

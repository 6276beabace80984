"""DSQ, Q-Mamba's decoupled scale quantization, adapted to delta-rule states as a uniform-precision baseline.

Q-Mamba (Tianqi et al., ACL Findings 2025) quantizes Mamba's state cache with separate scales on
both state axes ("decoupled scale quantization"), so that outliers along either axis stop inflating
the step of the other. Its exact scale rule is not in the material available to us, so this is the
natural decoupled dual-axis absmax reading of it, fixed here (per head, FP32 arithmetic):

    s_col_j = fp16(clamp((max_i |X_ij|) ** col_exponent, 2^-14, 65504))   value-column scale
    Y       = X / s_col
    s_row_i = fp16(clamp(max_j |Y_ij| / (2^(b-1) - 1), 2^-14, 65504))      key-row absmax of Y
    code_ij = clamp(rint(Y_ij / s_row_i + 2^(b-1)), 1, 2^b - 1)            MIDTREAD grid

and X_hat = (code - 2^(b-1)) * s_row_i * s_col_j, the same QState reconstruction STEPQuant uses.
col_exponent = 1 divides every column by its absmax (the literal decoupled reading); col_exponent = 0.5
(the default) is the SmoothQuant-style square-root split of a column's range between the two scales.
studies/codec_study.py measures both and the default is the one with the lower reconstruction error
on our states (docs/codec_study.md), so STEPQuant is compared against the stronger reading of DSQ.

What DSQ does NOT have, and STEPQuant's dual-axis fitting does: no row-impact factors (every key row
is treated as equally important) and no refit of the column scales (both come from one absmax pass).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .base import Codec, Grid, QState, as_fp32, check_bits, check_dims, fp16_scale, round_to_codes


@dataclass(frozen=True)
class DSQCodec(Codec):
    """Decoupled dual-axis absmax scales, uniform precision (see module docstring).

    bits:         2..8
    col_exponent: exponent in (0, 1] applied to the column absmax before it becomes the column scale
                  (default 0.5, chosen by studies/codec_study.py)
    """

    bits: int = 4
    col_exponent: float = 0.5
    name: str = field(init=False)

    def __post_init__(self) -> None:
        check_bits(self.bits)
        if isinstance(self.col_exponent, bool) or not isinstance(self.col_exponent, (int, float)):
            raise TypeError(f"col_exponent must be a float in (0, 1], got {self.col_exponent!r}")
        if not 0.0 < float(self.col_exponent) <= 1.0:
            raise ValueError(f"col_exponent must be in (0, 1], got {self.col_exponent}")
        object.__setattr__(self, "name", f"dsq{self.bits}")

    def encode(self, states: torch.Tensor) -> QState:
        """states [N, H, K, V] -> QState (MIDTREAD, row and column scales, uniform bits)."""
        x = as_fp32(states)  # [N, H, K, V]
        grid = Grid.MIDTREAD
        col_scale = fp16_scale(x.abs().amax(dim=2) ** float(self.col_exponent))  # [N, H, V]
        y = x / col_scale[:, :, None, :]
        row_scale = fp16_scale(y.abs().amax(dim=-1) / grid.qmax(self.bits))  # [N, H, K]
        codes = round_to_codes(y / row_scale[..., None], self.bits, grid)
        bits = torch.full(x.shape[1:3], self.bits, dtype=torch.int8, device=x.device)
        return QState(codes, bits, row_scale.to(torch.float16), col_scale.to(torch.float16), None, grid)

    def decode(self, encoded: QState) -> torch.Tensor:
        if not isinstance(encoded, QState):
            raise TypeError(f"{self.name} codec decodes a QState, got {type(encoded).__name__}")
        return encoded.dequantize()

    def storage_bits(self, num_heads: int, key_dim: int, value_dim: int, *, analytical: bool = False) -> int:
        """Codes b*K*V plus FP16 row (K) and column (V) scales, per head."""
        check_dims(num_heads, key_dim, value_dim)
        return num_heads * (self.bits * key_dim * value_dim + 16 * (key_dim + value_dim))

"""Error feedback: a state format that carries each token's rounding residual into the next requantization.

Motivation (beyond the paper): serving engines discussing 8-bit recurrent states report that plain INT8
rounding of a Gated DeltaNet state degrades long generations and that carrying the rounding residual
forward restores them (vLLM RFC #55196: uniform INT8 GDN state on Qwen3.5-4B, GSM8K 81% -> 41%, back to
~81% with error feedback; "INT8 state + int4 residual"). This module defines our variant precisely; the
RFC is the motivation, not the specification.

The format wraps any other codec Q (the "inner" format: uniform INT-b, DSQ, dual-axis, a plan layer's
MixedCodec) and a residual codec R (a registry format: INT-r rowwise absmax, FP16 or FP32). What is
stored per request is the pair (Q-encoded state, R-encoded residual):

    boundary pack (no residual yet):  S_hat_0 = Q(X_0),                 e_0 = R(X_0 - S_hat_0)
    decode token t:                   T_t = X_t + e_{t-1}
                                      S_hat_t = Q(T_t),                 e_t = R(T_t - S_hat_t)

where X_t = A_t S_hat_{t-1} + B_t is the float state the layer computed from the decoded state, and the
readout y_t = X_t^T q_t and the next update read S_hat only (``decode`` returns Q's reconstruction; the
residual never enters a readout). The residual is added as stored, not propagated through A_t: the
cache hook that stores a state does not see A_t, and this is the variant the RFC and other engines
describe ("add the carried per-element residual back before requantizing").

Why it helps: the "shadow" state P_t = S_hat_t + e_t obeys P_t = A_t P_{t-1} + B_t + (I - A_t) e_{t-1}
(with e kept exactly), so for a long-lived unit (A_t close to I) the rounding errors of successive tokens
cancel instead of accumulating; the stored state is off by about one rounding step plus what leaks
through (I - A_t). With a quantized residual, R's own rounding error accumulates instead, at the
residual's much smaller scale.

Bytes: Q's storage plus R's (``storage_bits``); stepquant.accounting counts it like any codec, so the
residual is in every bits/value this format reports. With R = FP32 the format holds more than an FP32
state: it is an upper bound on what error feedback can do, not a compression.

Names (stepquant.codecs.make_codec): ``<name>-ef<r>`` for any registry name except "mixed", with r = 2..8
(INT-r rowwise absmax residual, r + 16/V bits/value), 16 (FP16 residual) or 32 (FP32 residual), e.g.
"int6-ef4", "int8-ef4", "dual4-ef16". Calibrated plans take the same suffix in stepquant eval
("stepquant-6-ef4").
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from .base import Codec, as_fp32
from .cast import CastCodec
from .uniform import UniformCodec

RESIDUAL_BITS = (2, 3, 4, 5, 6, 7, 8, 16, 32)
SUFFIX = re.compile(r"^(?P<base>.+)-ef(?P<bits>[0-9]+)$")


def residual_codec(bits: int) -> Codec:
    """The codec a residual of ``bits`` is kept in: INT-r rowwise absmax (2..8), FP16 (16) or FP32 (32)."""
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in RESIDUAL_BITS:
        raise ValueError(f"an error-feedback residual is kept in 2..8 bits (INT rowwise absmax), 16 (FP16) "
                         f"or 32 (FP32), got {bits!r}")
    if bits == 32:
        return CastCodec("fp32")
    if bits == 16:
        return CastCodec("fp16")
    return UniformCodec(bits)


def split_name(name: str) -> tuple[str, int | None]:
    """"int6-ef4" -> ("int6", 4); a name without the suffix -> (name, None)."""
    match = SUFFIX.match(name)
    return (name, None) if match is None else (match.group("base"), int(match.group("bits")))


@dataclass
class ErrorFeedbackState:
    """One stored error-feedback state: the inner format's encoded state and the residual codec's encoding."""

    state: object
    residual: object


@dataclass(frozen=True, eq=False)
class ErrorFeedbackCodec(Codec):
    """Inner codec + a residual carried to the next requantization (see module docstring).

    inner:         the state format whose reconstruction every readout and update reads
    residual_bits: 2..8 (INT rowwise absmax), 16 (FP16) or 32 (FP32): how the residual is stored
    """

    inner: Codec
    residual_bits: int = 4
    name: str = field(init=False)
    residual: Codec = field(init=False, repr=False)

    carries_residual = True

    def __post_init__(self) -> None:
        if not isinstance(self.inner, Codec):
            raise TypeError(f"inner must be a stepquant Codec, got {type(self.inner).__name__}")
        if getattr(self.inner, "carries_residual", False):
            raise ValueError("error feedback is applied once, to a stateless format: the inner codec already "
                             "carries state across tokens (a residual, or deferred fits)")
        object.__setattr__(self, "residual", residual_codec(self.residual_bits))
        object.__setattr__(self, "name", f"{self.inner.name}-ef{self.residual_bits}")

    def _store(self, target: torch.Tensor) -> ErrorFeedbackState:
        state = self.inner.encode(target)
        residual = target - self.inner.decode(state)  # [N, H, K, V]
        return ErrorFeedbackState(state, self.residual.encode(residual))

    def encode(self, states: torch.Tensor) -> ErrorFeedbackState:
        """The boundary pack: states [N, H, K, V] with no residual carried in."""
        return self._store(as_fp32(states))

    def requantize(self, states: torch.Tensor, previous: ErrorFeedbackState | None) -> ErrorFeedbackState:
        """The next token's state: quantize states + the residual stored with ``previous``."""
        if previous is None:
            return self.encode(states)
        if not isinstance(previous, ErrorFeedbackState):
            raise TypeError(f"{self.name} requantizes after an ErrorFeedbackState, got "
                            f"{type(previous).__name__}")
        x = as_fp32(states)
        carried = self.residual.decode(previous.residual).to(x.device)
        if carried.shape != x.shape:
            raise ValueError(f"the stored residual has shape {list(carried.shape)}, the new state "
                             f"{list(x.shape)}: a batch that changed rows must be re-encoded with encode()")
        return self._store(x + carried)

    def decode(self, encoded: ErrorFeedbackState) -> torch.Tensor:
        """The inner format's reconstruction: what readouts and updates read (the residual is not added)."""
        if not isinstance(encoded, ErrorFeedbackState):
            raise TypeError(f"{self.name} codec decodes an ErrorFeedbackState, got {type(encoded).__name__}")
        return self.inner.decode(encoded.state)

    def storage_bits(self, num_heads: int, key_dim: int, value_dim: int, *, analytical: bool = False) -> int:
        """The inner format's bits plus the residual's (every value keeps a residual)."""
        dims = (num_heads, key_dim, value_dim)
        return (self.inner.storage_bits(*dims, analytical=analytical)
                + self.residual.storage_bits(*dims, analytical=analytical))

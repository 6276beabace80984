"""Deferred fitting: a state format that requantizes every R-th decode token instead of every token.

Motivation (beyond the paper): the packed decode step is bound by the per-token fit and writeback (docs/
kernels.md, "What separates the step from the bandwidth floor"); the readout from the packed codes alone
runs 3.5-5.6x faster than fla's FP32 step. Serving formats for KV caches keep the most recent tokens in
full precision and quantize them in groups (KIVI's residual window); this is the same idea for a delta-rule
state. Between fits the state is the last fit's codes plus the updates since, kept exactly:

    fit (boundary pack, and every R-th decode token):  S_hat_t = Q(X_t)
    the R - 1 tokens after a fit:                       S_hat_t = X_t = A_t S_hat_{t-1} + B_t

where X_t is the float state the layer computed from the decoded previous state. A serving kernel stores
the same state as the codes of the last fit, the decay accumulated since (a log-gate per key row, FP32)
and the rank-1 updates since (k_r and u_r = beta_r (v_r - ...), FP16), and reads
S_t = G_t . dequant(codes) + sum_r k_r u_r^T (decayed to t). Only every R-th token fits and writes the
codes; the others read them. So a request's state takes R times fewer requantizations, and its
per-token cost is the readout plus 1/R of the fit.

What this module models: the quantization events. The R - 1 pending updates are held here as the float
state itself (FP32), not as FP16 k_r, u_r: the serving format's FP16 rounding of u (2^-11 relative) is
below anything the eval resolves and is not modelled.

Bytes (``storage_bits``): Q's plus what the serving format (stepquant.kernels.decode.deferred's
DeferredBuffers) holds beside the codes: R - 1 pending (k, u) pairs in FP16 and the accumulated log-gate in
FP32. KDA (the default count): (R - 1)(K + V) 16 + 32 K bits per head, (R - 1) / 4 + 1/4 bits/value at
K = V = 128. GDN (``shared_keys`` = H / HQ value heads per q/k head, ``head_gate``): a q/k head's k_j is
held once for its group and a head's gate is one value, (R - 1)(K / shared_keys + V) 16 + 32 bits per head:
(R - 1) / 6 + 1/512 bits/value at H / HQ = 3.

Names (stepquant.codecs.make_codec): ``<name>-defer<R>`` for any registry name except "mixed", R = 2..16
(e.g. "int6-defer4"); calibrated plans take the same suffix in stepquant eval ("stepquant-6-defer4").
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

import torch

from .base import Codec, as_fp32

MAX_DEFER = 16  # the CUDA kernel takes up to 15 pending updates (kernels/decode/cuda.py MAX_PENDING)


def check_every(every, name: str = "every") -> int:
    """R, tokens per fit, checked: an int in 2..MAX_DEFER (R = 1 would be the inner format itself)."""
    if isinstance(every, bool) or not isinstance(every, int) or not 2 <= every <= MAX_DEFER:
        raise ValueError(f"{name} is R, a fit every 2..{MAX_DEFER} decode tokens; got {every!r} (R = 1 is a "
                         "fit every token: the inner format itself)")
    return every


SUFFIX = re.compile(r"^(?P<base>.+)-defer(?P<every>[0-9]+)$")


def split_deferred(name: str) -> tuple[str, int | None]:
    """"int6-defer4" -> ("int6", 4); a name without the suffix -> (name, None)."""
    match = SUFFIX.match(name)
    return (name, None) if match is None else (match.group("base"), int(match.group("every")))


def pending_layout(kda: bool, heads: int, key_heads: int | None) -> dict:
    """How a layer's serving buffers hold the pending updates, as DeferredCodec's layout fields: KDA's gates
    decay each value head's k_j per key row, so every head keeps its own k_j and one gate per key row; GDN's
    k_j is its q/k head's normalized k (never decayed: GDN decays u_j), one copy for the heads / key_heads
    value heads of the group, and one gate per head. key_heads None (not known): counted unshared, an upper
    bound."""
    if kda:
        return {"shared_keys": 1, "head_gate": False}
    return {"shared_keys": 1 if key_heads is None else heads // check_key_heads(heads, key_heads),
            "head_gate": True}


def check_key_heads(heads: int, key_heads) -> int:
    """A layer's q/k heads HQ, checked: an int that divides its value heads H."""
    if isinstance(key_heads, bool) or not isinstance(key_heads, int) or key_heads < 1 or heads % key_heads:
        raise ValueError(f"key_heads is the layer's q/k heads, a divisor of its {heads} value heads; got "
                         f"{key_heads!r}")
    return key_heads


@dataclass
class DeferredState:
    """One stored deferred state: the codes of the last fit, and the float state since (None right after
    a fit); age is the number of tokens since the fit (0 right after it)."""

    state: object
    pending: torch.Tensor | None
    age: int


@dataclass(frozen=True, eq=False)
class DeferredCodec(Codec):
    """Inner codec, fitted every ``every``-th decode token (see module docstring).

    inner: the state format of the fits
    every: R = 2..16, tokens per fit (R = 1 would be the inner format itself)
    shared_keys, head_gate: the byte count's layout (module docstring, pending_layout); the defaults count
        KDA's, ``for_shape`` a model's
    """

    inner: Codec
    every: int = 4
    shared_keys: int = 1
    head_gate: bool = False
    name: str = field(init=False)

    carries_residual = True  # the next encoding depends on what was stored (the age)

    def __post_init__(self) -> None:
        if not isinstance(self.inner, Codec):
            raise TypeError(f"inner must be a stepquant Codec, got {type(self.inner).__name__}")
        if getattr(self.inner, "carries_residual", False):
            raise ValueError(f"deferred fitting wraps a stateless format; {self.inner.name} already carries "
                             "state across tokens (error feedback or deferral)")
        check_every(self.every)
        keys = self.shared_keys
        if isinstance(keys, bool) or not isinstance(keys, int) or keys < 1:
            raise ValueError(f"shared_keys is the value heads per stored k_j (GDN: H / HQ), got "
                             f"{self.shared_keys!r}")
        object.__setattr__(self, "name", f"{self.inner.name}-defer{self.every}")

    def for_shape(self, shape) -> DeferredCodec:
        """This codec with the byte count of a model's serving layout (a stepquant.families.ModelShape)."""
        return replace(self, **pending_layout(shape.family.name == "kda", shape.heads, shape.key_heads))

    def encode(self, states: torch.Tensor) -> DeferredState:
        """The boundary pack: a fit."""
        return DeferredState(self.inner.encode(as_fp32(states)), None, 0)

    def requantize(self, states: torch.Tensor, previous: DeferredState | None) -> DeferredState:
        """The next token's state: a fit when ``every`` tokens have passed since the last one, else the
        float state beside the last fit's codes."""
        if previous is None:
            return self.encode(states)
        if not isinstance(previous, DeferredState):
            raise TypeError(f"{self.name} requantizes after a DeferredState, got {type(previous).__name__}")
        age = previous.age + 1
        if age >= self.every:
            return self.encode(states)
        return DeferredState(previous.state, as_fp32(states).clone(), age)

    def decode(self, encoded: DeferredState) -> torch.Tensor:
        """What readouts and updates read: the float state between fits, the fit's reconstruction at one."""
        if not isinstance(encoded, DeferredState):
            raise TypeError(f"{self.name} decodes a DeferredState, got {type(encoded).__name__}")
        return encoded.pending.clone() if encoded.pending is not None else self.inner.decode(encoded.state)

    def storage_bits(self, num_heads: int, key_dim: int, value_dim: int, *, analytical: bool = False) -> int:
        """The inner format's bits plus the serving format's pending updates and accumulated gate."""
        if num_heads % self.shared_keys:
            raise ValueError(f"{num_heads} heads do not share k_j in groups of {self.shared_keys}")
        pending = (self.every - 1) * (num_heads // self.shared_keys * key_dim + num_heads * value_dim) * 16
        gates = num_heads * (1 if self.head_gate else key_dim) * 32
        inner = self.inner.storage_bits(num_heads, key_dim, value_dim, analytical=analytical)
        return inner + pending + gates

"""The serving capacity model: reserved persistent-state memory and totals at a batch size.

A serving engine reserves (r B + 1) state slots (SGLang with radix caching: r = 5); a slot holds the
recurrent state in some format plus the convolution state, kept as is. Total memory = weights + state
slots + B x context x attention KV bytes per token. MiB = 2**20 bytes, GiB = 2**30 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from stepquant.families import ModelShape, check_count

from .formulas import StateBytes, _check_shape

MIB = 2**20
GIB = 2**30


@dataclass(frozen=True)
class Capacity:
    """Reserved persistent-state memory (and totals) of a serving engine at one batch size.

    slots = slots_per_request x batch + 1 (one global sentinel); a slot holds the recurrent state
    (``state_bytes``) and the unchanged convolution state (``conv_bytes``, 0 if unknown).
    """

    label: str
    batch: int
    slots_per_request: int
    state_bytes: int
    conv_bytes: int
    context_tokens: int = 0
    kv_bytes_per_token: int | None = None

    def __post_init__(self) -> None:
        check_count(self.batch, "batch")
        check_count(self.slots_per_request, "slots_per_request")
        check_count(self.state_bytes, "state_bytes")
        check_count(self.conv_bytes, "conv_bytes", allow_zero=True)
        check_count(self.context_tokens, "context_tokens", allow_zero=True)
        if self.kv_bytes_per_token is not None:
            check_count(self.kv_bytes_per_token, "kv_bytes_per_token", allow_zero=True)

    @property
    def slots(self) -> int:
        return self.slots_per_request * self.batch + 1

    @property
    def slot_bytes(self) -> int:
        return self.state_bytes + self.conv_bytes

    @property
    def pool_bytes(self) -> int:
        return self.slots * self.slot_bytes

    @property
    def kv_bytes(self) -> int | None:
        """B x context x KV bytes/token; None when the model's KV size is unknown."""
        if self.kv_bytes_per_token is None:
            return None if self.context_tokens else 0
        return self.batch * self.context_tokens * self.kv_bytes_per_token

    def total_bytes(self, weight_bytes: int) -> int | None:
        """weights + reserved state slots + attention KV; None if the KV size is needed but unknown."""
        kv = self.kv_bytes
        return None if kv is None else weight_bytes + self.pool_bytes + kv

    def as_dict(self) -> dict:
        return {
            "format": self.label,
            "slot_bytes": self.slot_bytes,
            "slot_mib": self.slot_bytes / MIB,
            "slots": self.slots,
            "pool_bytes": self.pool_bytes,
            "pool_gib": round(self.pool_bytes / GIB, 6),
        }


def capacity(shape: ModelShape, state: StateBytes | int, batch: int, slots_per_request: int = 5,
             context_tokens: int = 0, serving: bool = False) -> Capacity:
    """The capacity model for ``shape`` with its state stored as ``state`` (a StateBytes or bytes).

    Default ``slots_per_request=5`` is SGLang with radix caching: 3 slots per request plus 2 for
    overlap tracking, plus one sentinel, i.e. (5B + 1) slots. The paper's curve uses analytical bytes.
    """
    _check_shape(shape)
    if isinstance(state, StateBytes):
        label, state_bytes = state.label, state.bytes(serving)
    else:
        label, state_bytes = "state", state
    return Capacity(label, batch, slots_per_request, state_bytes, shape.conv_state_bytes or 0,
                    context_tokens, shape.kv_bytes_per_token)


def max_batch(shape: ModelShape, state: StateBytes | int, budget_bytes: int, weight_bytes: int,
              slots_per_request: int = 5, context_tokens: int = 0, serving: bool = False) -> int:
    """The largest batch B whose total (:meth:`Capacity.total_bytes`) fits ``budget_bytes``; 0 if none does.

    Per request: ``slots_per_request`` state slots plus ``context_tokens`` of attention KV; once: the weights
    and the sentinel slot. An unknown KV size counts as 0 only when no context is asked for.
    """
    _check_shape(shape)
    check_count(budget_bytes, "budget_bytes", allow_zero=True)
    check_count(weight_bytes, "weight_bytes", allow_zero=True)
    check_count(slots_per_request, "slots_per_request")
    check_count(context_tokens, "context_tokens", allow_zero=True)
    one = capacity(shape, state, 1, slots_per_request, context_tokens, serving)
    if one.kv_bytes is None:
        raise ValueError(f"{shape.name}: the attention KV bytes per token are unknown, so a context of "
                         f"{context_tokens} tokens cannot be counted (give --config with the model's config)")
    per_request = slots_per_request * one.slot_bytes + one.kv_bytes
    room = budget_bytes - weight_bytes - one.slot_bytes  # the sentinel slot
    return max(0, room // per_request)

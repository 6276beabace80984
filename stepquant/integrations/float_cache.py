"""A transformers cache that keeps GDN / KDA recurrent states in a float dtype other than the model's FP32.

transformers' DynamicCache stores the state its recurrence function returns (FP32: fla's kernels and the
torch fallback compute and return FP32 states). :class:`FloatStateCache` stores it in ``dtype`` (BF16 or
FP16) instead: the next step reads the low-precision state (fla's kernels load any float dtype and compute
in FP32) and the cache casts the FP32 result back into its buffer. It is the cheapest honest BF16-state
baseline for a whole model: half the state memory, the same kernels (the cast is one extra read of the FP32
result per step, so it is not faster than FP32 in this loop; an engine with a BF16-native kernel moves fewer
bytes, benchmarks/bench_decode.py times that kernel alone). ``assign=True`` keeps the returned tensor
instead of copying it into a fixed buffer; with FP32 that is the traffic of an in-place kernel (the class).
"""

from __future__ import annotations

import torch

from stepquant.integrations.hf_cache import check_transformers_version  # isort: skip
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionLayer

from stepquant.families import linear_layers


class CastLinearAttentionLayer(LinearAttentionLayer):
    """A linear-attention cache layer whose recurrent-state buffers are ``state_dtype``; with ``assign`` it
    keeps the tensor the recurrence returned (cast if needed) instead of copying it into a fixed buffer."""

    def __init__(self, state_dtype: torch.dtype, number_of_states: int = 1, assign: bool = False, **kwargs):
        super().__init__(number_of_states=number_of_states, **kwargs)
        self.state_dtype = state_dtype
        self.assign = assign

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs):
        if not self.assign:
            return super().update_recurrent_state(recurrent_states, state_idx, **kwargs)
        self.recurrent_states[state_idx] = recurrent_states.to(self.state_dtype)
        self.is_recurrent_states_initialized[state_idx] = True
        return self.recurrent_states[state_idx]

    def lazy_initialization(
        self, conv_states=None, recurrent_states=None, state_idx: int = 0, conv_kernel_size: int | None = None
    ) -> None:
        if recurrent_states is not None:
            recurrent_states = recurrent_states.to(self.state_dtype)  # zeros_like of it: the buffer's dtype
        super().lazy_initialization(
            conv_states=conv_states,
            recurrent_states=recurrent_states,
            state_idx=state_idx,
            conv_kernel_size=conv_kernel_size,
        )


class FloatStateCache(DynamicCache):
    """DynamicCache whose linear-attention recurrent states are stored as ``dtype`` (default BF16).

    assign: keep the state tensor each step returns rather than copying it into the layer's fixed buffer
    (DynamicCache's copy keeps a static address for CUDA graphs and costs one more read and write of the whole
    state per step). With FP32 this moves the bytes of an in-place kernel (read once, write once), the
    engine's baseline (SGLang updates FP32 states in place)."""

    def __init__(self, config, dtype: torch.dtype = torch.bfloat16, assign: bool = False):
        check_transformers_version()
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a float dtype, got {dtype}")
        super().__init__(config=config)
        self.state_dtype = dtype
        self.linear_layers = list(linear_layers(config))
        for i in self.linear_layers:
            self.layers[i] = CastLinearAttentionLayer(
                dtype, number_of_states=self.layers[i].number_of_states, assign=assign
            )

    def state_bytes(self) -> int:
        """Bytes of the recurrent states held now (all linear-attention layers and rows)."""
        return sum(
            t.numel() * t.element_size()
            for i in self.linear_layers
            for t in self.layers[i].recurrent_states.values()
            if t is not None
        )

"""Static-shape greedy decode: a fixed-length attention KV and one decode step replayed as a CUDA graph.

A hybrid GDN / KDA model's decode step launches a few kernels per layer from Python; at serving batch sizes
the host issues them no faster than the GPU runs them, so tokens/s measure Python, not the state format
(benchmarks/bench_generate.py). Capturing one step (forward of B tokens + argmax into the next step's input
ids) in a ``torch.cuda.CUDAGraph`` and replaying it removes the host from the loop. What that needs, in
transformers (>=5.23,<5.24):

- :func:`use_static_attention`: the attention layers' KV in transformers' ``StaticLayer`` (preallocated
  [B, heads, max_cache_len, D], written with ``index_copy_`` at the layer's ``cumulative_length``, a device
  tensor advanced in place), instead of DynamicCache's ``torch.cat`` that reallocates every step. The
  model reads its positions (``past_key_values.get_seq_length()``) and the mask's query offset from that
  tensor, so positions advance inside the graph. The linear-attention layers are left as they are
  (DynamicCache's, FloatStateCache's or PackedStateCache's: their conv and recurrent states already keep
  their addresses). With every layer static, ``cache.is_compileable`` is True and transformers'
  ``create_causal_mask`` materializes the single-token mask over all max_cache_len keys (key j visible to
  the query at position p iff j <= p) instead of skipping it, which would let the query see the zero rows
  past the current position; the prefill of an empty static cache uses SDPA's upper-left causal mask;
- :class:`GraphDecodeStep`: eager warm-up steps on a side stream (Triton compilation and autotuning,
  cuBLAS workspaces, the packed kernels' one-time slot check: stepquant.kernels.tables.check_slots), then
  the capture, then ``step()`` = one replay. Nothing in the captured forward may sync with the host or
  branch on tensor values: the decode paths of Qwen3.5 (GDN + gated attention) and Kimi-Linear (KDA + MLA,
  MoE with the ``grouped_mm`` experts) do neither once the KV is static; a PackedStateCache split step's
  side-stream writebacks are joined at the end of the captured step.

A cache whose recurrent state tensor is rebound every step (FloatStateCache(assign=True)) cannot be
replayed: the graph would read the state captured at its first step forever; :func:`graph_safe` says so.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from stepquant.integrations.hf_cache import check_transformers_version  # isort: skip
from transformers.cache_utils import (
    Cache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    StaticLayer,
    StaticSlidingWindowLayer,
)


def use_static_attention(cache: Cache, max_cache_len: int) -> Cache:
    """Replace the attention layers of a cache built from a config (DynamicCache and its subclasses) by
    static layers of ``max_cache_len`` tokens (prompt + every token the cache will be given), in place.

    The cache must be empty. Linear-attention layers are kept. Returns the cache."""
    check_transformers_version()
    if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < 1:
        raise ValueError(f"max_cache_len must be a positive int, got {max_cache_len!r}")
    if getattr(cache, "layer_class_to_replicate", None) is not None:
        raise ValueError("the cache has no layers yet: build it with the model's config "
                         "(DynamicCache(config=model.config))")
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            static = StaticLayer(max_cache_len)
        elif type(layer) is DynamicSlidingWindowLayer:
            static = StaticSlidingWindowLayer(max_cache_len, layer.sliding_window)
        elif isinstance(layer, StaticLayer):
            continue
        elif isinstance(layer, DynamicLayer):
            raise ValueError(f"layer {i} is a {type(layer).__name__}: only DynamicLayer and "
                             "DynamicSlidingWindowLayer attention layers can be made static")
        else:  # linear attention (any of our subclasses) or a dummy layer
            continue
        if getattr(layer, "is_initialized", False):
            raise ValueError("use_static_attention needs an empty cache (before the prefill)")
        cache.layers[i] = static
    if not cache.is_compileable:  # the mask would be skipped for one-token steps (module docstring)
        names = sorted({type(layer).__name__ for layer in cache.layers if not layer.is_compileable})
        raise ValueError(f"cache layers {names} are not static: the single-token causal mask would be "
                         "skipped")
    cache.max_cache_len = max_cache_len
    return cache


def graph_safe(cache: Cache) -> str | None:
    """None if a decode step on this cache can be captured and replayed, else why not."""
    if not cache.is_compileable:
        return "the attention KV is not static (use_static_attention)"
    for layer in cache.layers:
        if getattr(layer, "assign", False):
            return ("the recurrent state tensor is rebound every step (FloatStateCache(assign=True)): a "
                    "graph would read the first step's state at every replay")
    return None


def join_side_streams(cache: Cache) -> None:
    """Make the current stream wait for a PackedStateCache's pending split-step writebacks (no-op else)."""
    pool = getattr(cache, "pool", None)
    for layer in getattr(pool, "layers", ()):
        layer.wait_writes()


class GraphDecodeStep:
    """One greedy decode step captured in a CUDA graph: ``step()`` replays it and returns the tokens [B].

    forward: ``forward(ids [B, 1]) -> logits [B, vocab]`` (the model with its cache bound); token: the last
    tokens [B] (the prefill's argmax); cache: the forward's cache (checked with :func:`graph_safe`, and its
    split-step writebacks joined inside the step); warmup: eager steps before the capture (>= 1; each one
    advances the cache like a replay). Every replay advances the cache by one token. ``logits`` and
    ``token`` are the graph's output buffers, overwritten by the next replay; ``ids`` its input, which the
    step itself overwrites with its argmax.
    """

    def __init__(self, forward: Callable[[torch.Tensor], torch.Tensor], token: torch.Tensor, cache: Cache,
                 warmup: int = 2):
        reason = graph_safe(cache)
        if reason is not None:
            raise ValueError(f"this cache cannot be replayed as a CUDA graph: {reason}")
        if not token.is_cuda:
            raise ValueError("CUDA graphs need the model on a CUDA device")
        if warmup < 1:
            raise ValueError("warmup must be >= 1: the first eager step compiles kernels and checks the "
                             "slots")
        self.forward, self.cache = forward, cache
        self.ids = token.reshape(-1, 1).clone()  # [B, 1] the static input
        current = torch.cuda.current_stream(token.device)
        side = torch.cuda.Stream(token.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self._step()
        current.wait_stream(side)
        torch.cuda.synchronize(token.device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits, self.token = self._step()

    def _step(self) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.forward(self.ids)  # [B, vocab]
        token = logits.argmax(-1)  # [B]
        self.ids.copy_(token[:, None])  # the next step's input, in place
        join_side_streams(self.cache)  # a capture must end with every forked stream joined
        return logits, token

    def step(self) -> torch.Tensor:
        self.graph.replay()
        return self.token

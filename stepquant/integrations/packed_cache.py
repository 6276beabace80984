"""A transformers cache that serves GDN / KDA recurrent states from a packed state pool (the serving path).

:class:`~stepquant.integrations.hf_cache.CompressedStateCache` stores encoded states but lets the
model's own recurrent function do the float step on a decoded FP32 copy. :class:`PackedStateCache`
is the path a GPU server runs: every linear-attention layer keeps its states in one
:class:`~stepquant.pool.PackedStatePool` built from a calibrated plan (one slot per batch row,
allocated at the first store, the same slot in every layer), and a single-token decode never
materializes the FP32 state between steps:

- prefill (no previous state): the model's float path runs over the prompt and hands the boundary
  state to ``update_recurrent_state``, which packs it with
  :func:`stepquant.kernels.decode.pack_states` (Triton on CUDA, the torch codec elsewhere);
- decode (one token): ``get_recurrent_state`` returns a :class:`PackedSlots` handle instead of a
  tensor; the mixer passes it on as ``initial_state`` to the module-level recurrence function it
  calls by global name, which is wrapped (below) to run
  :func:`stepquant.kernels.decode.decode_step_packed` on the handle's slots: it reads the packed
  slot, updates it, returns y read before requantizing and rewrites the slot in place. The handle
  comes back as the "final state" and ``update_recurrent_state`` ignores it (already written);
- a multi-token call on an existing state (prefill continuation, e.g. a chat turn appended to the
  cache) decodes the slots to FP32 for that one call, runs the model's own chunked function from it
  and packs the final state again, as ``stepquant.kernels.prefill.prefill_packed`` does;
- with ``defer=R`` (the deferred-fit format, stepquant.codecs.deferred) a decode token runs
  :func:`stepquant.kernels.decode.deferred.decode_deferred` instead: the codes are read every token and
  fitted every R-th, and each layer holds the rows' gate sums and pending updates beside the slots
  (``DeferredBuffers``; folded into the FP32 state of a multi-token call, reordered with the slots).

Why a new class rather than a ``backend=`` option of CompressedStateCache: that cache is built
around row groups with one codec each and an encoded object per group; a pool has one format (the
plan's) fixed at construction, preallocated slots, and no float state to hand to the model. Sharing
a class would mean two storage models behind every method.

Routing. transformers (>=5.23,<5.24) mixers call ``torch_chunk_gated_delta_rule`` /
``torch_recurrent_gated_delta_rule`` (Qwen3-Next, Qwen3.5) and ``chunk_kimi_delta_attention`` /
``recurrent_kimi_delta_attention`` (Kimi-Linear) by their global name on CPU and on CUDA alike (with
fla installed those names are transformers' wrappers that dispatch to fla's ``chunk_*`` /
``fused_recurrent_*``; the mixer passes q/k un-normalised with ``use_qk_l2norm_in_kernel=True``,
no ``scale`` (K^-1/2), ``initial_state``, ``output_final_state``). Building a cache wraps those
names of the model family's modeling module (:func:`route_recurrences`; the names come from
the model type's ``stepquant.families`` entry), and ``get_recurrent_state`` re-checks it each time it
hands out a handle (another tool may have replaced the names since, e.g.
``stepquant.models.use_recurrent_prefill``). The wrapper is a pass-through unless ``initial_state``
is a :class:`PackedSlots`, which only this cache creates: a model run with any other cache (or
none) computes exactly what it computed before (tested). :func:`unroute_recurrences` removes it.

Memory: :meth:`PackedStateCache.state_bytes` reports the pool's packed bytes, equal to
``stepquant.accounting.plan_bytes(...).serving_bytes`` per request. Attention KV and convolution
states stay in the DynamicCache (uncompressed), as in CompressedStateCache.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

# hf_cache first: it raises a clear ImportError when transformers is missing or too old
from stepquant.integrations.hf_cache import (  # isort: skip
    check_plan_fits,
    check_transformers_version,
    config_model_type,
)
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionLayer

from stepquant.codecs import LayerFormat
from stepquant.codecs.deferred import check_every
from stepquant.families import KDA, SUPPORTED_MODEL_TYPES, family_for, linear_layers, shape_from_config
from stepquant.kernels.decode import (
    backend_for,
    cuda,
    decode_step_packed,
    decode_step_split,
    naive_unpack_states,
    pack_states,
)
from stepquant.kernels.decode.deferred import DeferredBuffers, decode_deferred
from stepquant.pool import PackedLayer, PackedStatePool

_ROUTE_MARK = "_stepquant_packed_route"


class PackedSlots:
    """What ``PackedStateCache.get_recurrent_state`` hands the mixer instead of an FP32 state.

    layer: the pool layer holding the states; slots: int32 [N] slot of each batch row (pool device);
    split_stream: the side stream of the split step (decode_step_split), or None for the fused step;
    deferred: the batch rows' deferred buffers (a fit every R-th token, decode_deferred), or None.
    ``to()`` returns the handle itself because Kimi-Linear's mixer calls ``state.to(torch.float32)``
    on the final state before storing it.
    """

    __slots__ = ("layer", "slots", "split_stream", "deferred")

    def __init__(self, layer: PackedLayer, slots: torch.Tensor,
                 split_stream: torch.cuda.Stream | None = None, deferred: DeferredBuffers | None = None):
        self.layer, self.slots, self.split_stream, self.deferred = layer, slots, split_stream, deferred

    def to(self, *args, **kwargs) -> PackedSlots:
        return self

    def __repr__(self) -> str:
        return f"PackedSlots(slots={self.slots.tolist()}, heads={self.layer.num_heads})"


# ---------------------------------------------------------------- routing of the recurrence functions

def _argument(args: tuple, kwargs: dict, position: int, name: str):
    return kwargs[name] if name in kwargs else (args[position] if len(args) > position else None)


def _route(original: Callable) -> Callable:
    """original, except that a call whose initial_state is a PackedSlots runs on the packed slots."""

    @functools.wraps(original)
    def routed(*args, **kwargs):
        handle = kwargs.get("initial_state")
        if not isinstance(handle, PackedSlots):
            return original(*args, **kwargs)
        query, key, value = (_argument(args, kwargs, i, n) for i, n in enumerate(("query", "key", "value")))
        g, beta = _argument(args, kwargs, 3, "g"), _argument(args, kwargs, 4, "beta")
        use_qk_l2norm = bool(kwargs.get("use_qk_l2norm_in_kernel", False))
        if value.shape[1] == 1:  # single-token decode: y from the packed slots, slots rewritten in place
            layer = handle.layer
            # q, k [N, H_k, K]; v [N, H, V]; g [N, H] or [N, H, K]; beta [N, H]. The CUDA kernel reads BF16
            # or FP32 as it comes and writes y in the model's dtype (no cast kernels); the others take FP32
            direct = backend_for(layer.tables) == "cuda" and value.device == layer.device
            step_inputs = [t[:, 0] if direct else t[:, 0].to(layer.device, torch.float32)
                           for t in (query, key, value, g, beta)]
            out = torch.empty(value[:, 0].shape, dtype=query.dtype, device=layer.device) if direct else None
            options = dict(scale=kwargs.get("scale"), use_qk_l2norm=use_qk_l2norm, out=out)
            if handle.deferred is not None:  # the CUDA kernel (emulated off CUDA): a fit every R-th token
                layer.wait_writes()
                y = decode_deferred(layer.tables, layer.pages, handle.slots, *step_inputs, handle.deferred,
                                    **options)
            elif handle.split_stream is not None:  # readout here, writeback on the side stream
                y = decode_step_split(layer, handle.slots, *step_inputs, stream=handle.split_stream,
                                      **options)
            else:
                y = decode_step_packed(layer, handle.slots, *step_inputs, **options)  # [N, H, V]
            return y[:, None].to(device=value.device, dtype=query.dtype), handle
        # several tokens on an existing state: the model's own function from the decoded state (a deferred
        # state: with its held updates and gate sum), repacked (a fit)
        initial = naive_unpack_states(handle.layer, handle.slots)  # [N, H, K, V] FP32
        if handle.deferred is not None:
            initial = handle.deferred.state(initial)
        kwargs = {**kwargs, "initial_state": initial.to(value.device), "output_final_state": True}
        output, final = original(*args, **kwargs)
        pack_states(handle.layer, handle.slots, final.to(device=handle.layer.device, dtype=torch.float32))
        if handle.deferred is not None:
            handle.deferred.clear()
        return output, handle

    setattr(routed, _ROUTE_MARK, routed)  # points to itself: a functools.wraps copy elsewhere is not ours
    return routed


def _is_route(fn) -> bool:
    return fn is not None and getattr(fn, _ROUTE_MARK, None) is fn


def _is_routed(fn) -> bool:
    """Whether fn is, or wraps (through ``__wrapped__``, e.g. an observer's wrapper), a routed function."""
    for _ in range(64):  # a wrapper chain, not a cycle
        if fn is None:
            return False
        if _is_route(fn):
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def route_recurrences(model_type: str) -> None:
    """Wrap the recurrence functions of model_type's modeling module (idempotent; pass-through wrapper)."""
    family = family_for(model_type)
    module = family.modeling_module(model_type)
    for name in family.recurrence_functions:
        current = getattr(module, name)
        if not _is_routed(current):
            setattr(module, name, _route(current))


def unroute_recurrences(model_type: str) -> None:
    """Undo :func:`route_recurrences` where the routed wrapper is still the module attribute."""
    family = family_for(model_type)
    module = family.modeling_module(model_type)
    for name in family.recurrence_functions:
        current = getattr(module, name)
        if _is_route(current):
            setattr(module, name, current.__wrapped__)


# ---------------------------------------------------------------- cache

class _RowSlots:
    """The pool slot of each batch row, shared by every linear-attention layer of one cache."""

    def __init__(self, pool: PackedStatePool):
        self.pool = pool
        self.ids: list[int] | None = None  # slot of batch row r, allocated at the first store
        self.tensor: torch.Tensor | None = None  # the same, int32 [N] on the pool's device

    def ensure(self, num_rows: int) -> torch.Tensor:
        if self.ids is None:
            if num_rows > self.pool.num_free:
                raise ValueError(
                    f"a batch of {num_rows} rows needs {num_rows} state slots but the pool has "
                    f"{self.pool.num_free} free of {self.pool.num_slots}; build the cache with "
                    f"max_batch >= {num_rows} (beam search holds batch x num_beams rows)"
                )
            self.ids = self.pool.alloc(num_rows)
            self.tensor = self.pool.slot_tensor(self.ids)
        elif len(self.ids) != num_rows:
            raise ValueError(
                f"the cache holds {len(self.ids)} requests but this forward has {num_rows} rows; "
                "call cache.reset() before a new batch"
            )
        return self.tensor

    def release(self) -> None:
        if self.ids is not None:
            self.pool.free(self.ids)
        self.ids, self.tensor = None, None


class PackedLinearAttentionLayer(LinearAttentionLayer):
    """A linear-attention cache layer whose recurrent state lives in one layer of a packed state pool.

    pool_layer: this layer's pages; rows: the slot of each batch row (shared by all layers of a cache);
    defer: R for a fit every R-th decode token (the layer then holds the rows' DeferredBuffers, made at the
    first store), or None; kda: the gates are per key row (Kimi-Linear); key_heads: the q/k heads (default:
    one per value head). Convolution states are kept by the
    parent class as usual.
    """

    def __init__(self, pool_layer: PackedLayer, rows: _RowSlots, split_stream=None, *,
                 defer: int | None = None, kda: bool = False, key_heads: int | None = None, **kwargs):
        super().__init__(number_of_states=1, **kwargs)
        self.pool_layer = pool_layer
        self.rows = rows
        self.split_stream = split_stream
        self.defer, self.kda = defer, kda
        self.key_heads = pool_layer.num_heads if key_heads is None else key_heads
        self.deferred: DeferredBuffers | None = None

    def lazy_initialization(self, conv_states=None, recurrent_states=None, state_idx: int = 0,
                            conv_kernel_size: int | None = None) -> None:
        if conv_states is not None:
            super().lazy_initialization(conv_states=conv_states, state_idx=state_idx,
                                        conv_kernel_size=conv_kernel_size)
        if recurrent_states is not None:  # no float buffer: the state lives in the pool
            if self.device is None:
                self.device = recurrent_states.device
            self.is_recurrent_states_initialized[state_idx] = True

    def handle(self) -> PackedSlots | None:
        """The packed state of every batch row, or None before the first store."""
        if not self.has_previous_state[0] or self.rows.tensor is None:
            return None
        return PackedSlots(self.pool_layer, self.rows.tensor, self.split_stream, self.deferred)

    def update_recurrent_state(self, recurrent_states, state_idx: int = 0, **kwargs):
        """Pack a float state (the boundary after a prefill); a PackedSlots was already written in place."""
        if isinstance(recurrent_states, PackedSlots):
            return recurrent_states
        if state_idx != 0:
            raise ValueError(f"a packed layer holds one recurrent state, got state_idx={state_idx}")
        if recurrent_states.device != self.pool_layer.device:
            raise ValueError(
                f"the model's recurrent state is on {recurrent_states.device} but the state pool is on "
                f"{self.pool_layer.device}; build the cache with device={str(recurrent_states.device)!r}"
            )
        if not self.is_recurrent_states_initialized[state_idx]:
            self.lazy_initialization(recurrent_states=recurrent_states, state_idx=state_idx)
        slots = self.rows.ensure(recurrent_states.shape[0])
        pack_states(self.pool_layer, slots, recurrent_states.to(torch.float32))  # [N, H, K, V]
        if self.defer is not None:  # a fit: nothing held since
            if self.deferred is None:
                self.deferred = DeferredBuffers.empty(self.pool_layer.tables, slots.shape[0], self.defer,
                                                      self.kda, self.key_heads)
            self.deferred.clear()
        return recurrent_states

    def reset(self) -> None:
        """Give this cache's slots back to the pool (all layers share them) and drop the conv state, so
        the next forward starts fresh requests, with any batch size up to the pool's slots."""
        self.conv_states[0], self.is_conv_states_initialized[0] = None, False
        self.has_previous_state[0] = False
        self.deferred = None
        self.rows.release()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row r takes the state of row beam_idx[r] (slot contents copied, slots kept)."""
        if self.is_conv_states_initialized[0]:
            conv = self.conv_states[0]
            self.conv_states[0] = conv.index_select(0, beam_idx.to(conv.device))
        slots = self.rows.tensor
        if slots is None:
            return
        sources = slots.index_select(0, beam_idx.to(slots.device, torch.int64))  # [N]
        self.pool_layer.scatter(slots, self.pool_layer.gather(sources))  # gather copies: no aliasing
        if self.deferred is not None:
            self.deferred.reorder(beam_idx)

    def offload(self):  # the pool stays where it was built; only the conv state moves
        if self.is_conv_states_initialized[0]:
            self.conv_states[0] = self.conv_states[0].to("cpu", non_blocking=True)

    def prefetch(self):
        if self.is_conv_states_initialized[0] and self.device is not None:
            self.conv_states[0] = self.conv_states[0].to(self.device, non_blocking=True)


def _layer_formats(plan, config, linear_layers: list[int]) -> list[LayerFormat]:
    """One LayerFormat per linear-attention layer: the list given, or a calibration plan's
    ``layer_formats()`` (serving does not import calibration, so a plan is known by that method), checked
    against the model's config."""
    if isinstance(plan, Sequence) and plan and all(isinstance(f, LayerFormat) for f in plan):
        formats = list(plan)
    elif callable(getattr(plan, "layer_formats", None)):
        check_plan_fits(plan, config, linear_layers)
        formats = plan.layer_formats()
    else:
        raise TypeError(
            "plan must be a calibration plan (stepquant.calibrate.Plan.load('plans/gdn/stepquant-6')) or a "
            f"list of stepquant.codecs.LayerFormat, one per linear-attention layer; got {type(plan).__name__}"
        )
    if len(formats) != len(linear_layers):
        raise ValueError(f"got {len(formats)} layer formats for {len(linear_layers)} linear-attention layers "
                         f"{linear_layers}")
    return formats


class PackedStateCache(DynamicCache):
    """DynamicCache whose linear-attention states live in a packed state pool (module docstring).

    config:    the model's config (qwen3_next, qwen3_5(_text), qwen3_5_moe(_text), kimi_linear)
    plan:      a calibration plan (``Plan.load(dir)``) or one LayerFormat per linear layer
    max_batch: slots in the pool = the most rows a forward may have (batch x num_beams for beam search)
    device:    where the pool lives: the model's device ("cuda" for the GPU kernels)
    split:     on CUDA, run each decode as the paper's split step: the readout on the model's stream and the
               requantize + writeback on one side stream behind the following layers (decode_step_split;
               the pool orders every later access of a layer after its writeback). Default False: the
               fused step, which moves fewer bytes (the benchmark in benchmarks/results compares them)
    defer:     R = 2..16: the deferred-fit format (stepquant.codecs.deferred): the CUDA kernel reads the codes
               every token and fits them every R-th, holding the gate sum and R - 1 updates (FP16) per
               request beside the slot (docs/kernels.md "Deferred fitting": on an H100 at B = 512 the GDN@6
               step runs 3.1x fla's FP32 step at R = 4, the fused step 2.0x). Needs the CUDA kernel (V = 128,
               K a multiple of 16; off CUDA its emulation runs, for tests: slow). Default None: a fit every
               token

        cache = PackedStateCache(model.config, Plan.load("plans/gdn/stepquant-6"), max_batch=4)
        model.generate(ids, past_key_values=cache, max_new_tokens=32)
        cache.reset()   # frees the slots; the cache serves a new batch
    """

    def __init__(self, config, plan, *, max_batch: int, device: torch.device | str = "cpu",
                 split: bool = False, defer: int | None = None):
        check_transformers_version()
        model_type = config_model_type(config)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"config.model_type={model_type!r} is not supported: the packed-state cache "
                             f"covers {', '.join(SUPPORTED_MODEL_TYPES)}")
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be a positive int (the pool's slots), got {max_batch!r}")
        super().__init__(config=config)
        self.linear_layers = list(linear_layers(config))
        if not self.linear_layers:
            raise ValueError("the config has no linear-attention layers to serve from a pool")
        if any(self.layers[i].number_of_states != 1 for i in self.linear_layers):
            raise ValueError("the packed pool holds one recurrent state per linear-attention layer")
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        shape = shape_from_config(text.to_dict())
        formats = _layer_formats(plan, config, self.linear_layers)
        for i, layer in zip(self.linear_layers, formats, strict=True):
            if (layer.num_heads, layer.key_dim) != (shape.heads, shape.key_dim):
                raise ValueError(
                    f"the format of layer {i} is for [H, K] = {[layer.num_heads, layer.key_dim]} but the "
                    f"model has {[shape.heads, shape.key_dim]}"
                )
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" means the current GPU, as in torch
            device = torch.device("cuda", torch.cuda.current_device())
        self.model_type = model_type
        self.pool = PackedStatePool(formats, max_batch, shape.value_dim, device)
        self._rows = _RowSlots(self.pool)
        if split and device.type != "cuda":
            raise ValueError("split=True runs the CUDA kernel's readout and writeback on two streams: it "
                             f"needs device='cuda', got {str(device)!r}")
        self.split_stream = torch.cuda.Stream(device) if split else None
        if defer is not None:
            check_every(defer, "defer")
            if split:
                raise ValueError("split=True and defer: choose one (the deferred step fits in one pass)")
            served = (cuda.supported if device.type == "cuda" else cuda.fits)
            unserved = [i for i, layer in zip(self.linear_layers, self.pool, strict=True)
                        if not served(layer.tables)]
            if unserved:
                raise ValueError(f"defer needs the CUDA kernel (V = 128, K a multiple of 16 up to 128; on "
                                 f"CUDA sm_80+ and nvcc); it does not serve layers {unserved} here")
        self.defer = defer
        kda = family_for(model_type) is KDA
        for number, i in enumerate(self.linear_layers):
            self.layers[i] = PackedLinearAttentionLayer(self.pool[number], self._rows, self.split_stream,
                                                        defer=defer, kda=kda, key_heads=shape.key_heads)
        route_recurrences(model_type)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        layer = self.layers[layer_idx]
        if not isinstance(layer, PackedLinearAttentionLayer):
            return super().get_recurrent_state(layer_idx, state_idx)
        handle = layer.handle()
        if handle is not None:
            route_recurrences(self.model_type)  # cheap check; another tool may have replaced the names
        return handle

    @property
    def slots(self) -> list[int] | None:
        """The pool slot of each batch row, or None before the first forward (and after reset)."""
        return None if self._rows.ids is None else list(self._rows.ids)

    def state_bytes(self) -> dict:
        """Packed bytes of the recurrent states, all linear-attention layers.

        bytes_per_request: one slot (equal to accounting.plan_bytes(...).serving_bytes); held_bytes: the
        slots this cache holds now; pool_bytes: the whole preallocated pool (max_batch slots); with defer,
        deferred_bytes_per_request: the deferred buffers each request holds beside its slot (the gate sum and
        R - 1 FP16 updates per head, every layer; None before the first store).
        """
        held = 0 if self._rows.ids is None else len(self._rows.ids)
        per_slot = self.pool.bytes_per_slot
        result = {"bytes_per_request": per_slot, "held_bytes": per_slot * held,
                  "pool_bytes": self.pool.bytes_held, "slots": self.slots, "num_slots": self.pool.num_slots}
        if self.defer is not None:  # beside the slots: each request's deferred buffers, in every layer
            buffers = [self.layers[i].deferred for i in self.linear_layers]
            per_request = sum(b.bytes_per_row for b in buffers) if all(buffers) else None
            result["deferred_bytes_per_request"] = per_request
        return result

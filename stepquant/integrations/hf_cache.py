"""A transformers cache whose linear-attention layers keep the recurrent state encoded by a stepquant codec.

Serving a GDN / KDA model with a compressed state means: a prefill evolves the float state and packs it
once at the boundary; every decode token then reads the stored state, updates it in FP32 and writes it
back encoded (docs/method.md section 2). transformers (>=5.23,<5.24) already routes every linear-attention
layer through two cache calls, so the least machinery is a :class:`~transformers.DynamicCache` whose
linear-attention layers hold the encoded object instead of a tensor:

- ``get_recurrent_state`` decodes the stored state (FP32 [N, H, K, V]) for the one step that needs it;
- ``update_recurrent_state`` encodes the state the layer hands back and drops the float one (the first
  store of a state is ``Codec.encode``, every later one ``Codec.requantize(states, previous)``, so an
  error-feedback format, stepquant.codecs.error_feedback, adds the residual it stored with the previous
  token; its residual is packed and counted like the state).

In transformers' single-token decode path (``torch_recurrent_gated_delta_rule`` for Qwen3-Next / Qwen3.5
and ``recurrent_kimi_delta_attention`` for Kimi-Linear) the layer computes X_t = A_t S_hat_{t-1} + B_t
from the decoded state, reads y_t = X_t^T q_t from that updated FP32 state, and only then passes X_t to
``update_recurrent_state``: the readout never sees the requantized state, exactly the serving path of
docs/method.md section 2 (X from the dequantized state, y read before requantizing). During a prefill the
layer's chunked (or token-by-token) path runs on the float state and calls ``update_recurrent_state``
once with the final state: the boundary pack. Convolution states and attention KV stay uncompressed.

Per-row codecs: ``row_codecs=[a, b, ...]`` splits the batch into contiguous row groups (equal sizes
unless ``group_sizes`` is given), group m stored with codec m. One batched forward then evaluates
several state formats at once (stepquant.eval does this: one prefill, one decode loop for all methods).
A codec spec is a :class:`~stepquant.codecs.base.Codec`, a registry name ("int4", "bf16", ...), a
calibration plan (anything with ``linear_layers`` and ``codec(i)``), a list with one codec per
linear-attention layer, or a ``{model layer index: codec}`` dict.

Storage: an integer format's :class:`~stepquant.codecs.base.QState` is bit-packed (codecs.packing,
exact round trip) unless ``packed=False``, so :meth:`CompressedStateCache.state_bytes` measures the bytes
a serving pool would hold (the serving count of stepquant.accounting). ``packed=False`` keeps one byte
per code (faster on CPU; same values, since unpack(pack(q)) dequantizes to the same state).

:meth:`CompressedLinearAttentionLayer.decode_step` (decode the stored state, one delta-rule token,
re-encode, return y) is the float reference of one serving step. The serving path itself, with the
states in a packed pool and the model's recurrent call routed to
stepquant.kernels.decode.decode_step_packed, is stepquant.integrations.packed_cache.PackedStateCache.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

try:
    from transformers import DynamicCache
    from transformers.cache_utils import LinearAttentionLayer
except ImportError as err:  # transformers missing, or a version without linear-attention cache layers
    raise ImportError(
        "stepquant.integrations.hf_cache needs transformers>=5.23,<5.24 (pip install 'stepquant[hf]'): "
        f"{err}"
    ) from err

from stepquant.codecs import Codec, DeferredState, ErrorFeedbackState, QState, make_codec
from stepquant.codecs.packing import PackedLayout, PackedState, pack, unpack
from stepquant.families import SUPPORTED_MODEL_TYPES, linear_layers  # qwen3_next, qwen3_5(_moe), kimi_linear
from stepquant.recurrence import prepare_qk, step

SUPPORTED_TRANSFORMERS = ((5, 23), (5, 24))  # >= 5.23, < 5.24


def check_transformers_version(version: str | None = None) -> str:
    """Return transformers' version, or raise ImportError outside the supported range >=5.23,<5.24."""
    if version is None:
        try:
            import transformers
        except ImportError as err:  # pragma: no cover - the dependency is installed in every setup we ship
            raise ImportError("stepquant's transformers cache needs transformers>=5.23,<5.24 "
                              "(pip install 'stepquant[hf]')") from err
        version = transformers.__version__
    parts = version.split(".")
    try:
        major_minor = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError) as err:
        raise ImportError(f"cannot parse the transformers version {version!r}") from err
    low, high = SUPPORTED_TRANSFORMERS
    if not low <= major_minor < high:
        raise ImportError(
            f"transformers {version} is not supported by stepquant's cache: it hooks into the "
            f"linear-attention cache layers of transformers>={low[0]}.{low[1]},<{high[0]}.{high[1]} "
            "(cache_utils.LinearAttentionLayer, get/update_recurrent_state); install a version in that range"
        )
    return version


def _is_codec(obj) -> bool:
    return all(callable(getattr(obj, name, None)) for name in ("encode", "decode", "storage_bits"))


def _is_plan(obj) -> bool:
    return callable(getattr(obj, "codec", None)) and hasattr(obj, "linear_layers")


def check_plan_fits(plan, config, linear_layers: Sequence[int]) -> None:
    """ValueError unless a plan fits the model: a calibration plan by its own ``check_model(config)``
    (which names the model it was calibrated for; serving does not import calibration, so a plan is known
    by its methods), anything else with ``linear_layers`` by those layer indices."""
    if config is not None and callable(getattr(plan, "check_model", None)):
        plan.check_model(config)
        return
    plan_layers, linear_layers = [int(i) for i in plan.linear_layers], list(linear_layers)
    if plan_layers != linear_layers:
        raise ValueError(
            f"the plan covers linear-attention layers {plan_layers} but the model has {linear_layers}; "
            "was it calibrated for another model?"
        )


def resolve_layer_codecs(spec, linear_layers: Sequence[int], config=None) -> dict[int, Codec]:
    """{model layer index: codec} for every linear-attention layer, from one codec spec (module docstring);
    a plan is checked against ``config`` (the model's) when given."""
    linear_layers = list(linear_layers)
    if isinstance(spec, str):
        spec = make_codec(spec)
    if _is_codec(spec):
        return dict.fromkeys(linear_layers, spec)
    if _is_plan(spec):
        check_plan_fits(spec, config, linear_layers)
        return {layer: spec.codec(i) for i, layer in enumerate(linear_layers)}
    if isinstance(spec, Mapping):
        if sorted(spec) != sorted(linear_layers):
            raise ValueError(
                f"a codec dict must have one entry per linear-attention layer {linear_layers}, "
                f"got keys {sorted(spec)}"
            )
        codecs = {int(layer): spec[layer] for layer in linear_layers}
    elif isinstance(spec, Sequence):
        if len(spec) != len(linear_layers):
            raise ValueError(
                f"a codec list must have one codec per linear-attention layer ({len(linear_layers)}: "
                f"{linear_layers}), got {len(spec)}"
            )
        codecs = dict(zip(linear_layers, spec, strict=True))
    else:
        raise TypeError(
            "a codec spec must be a Codec, a codec name (e.g. 'int4'), a calibration plan (with "
            "linear_layers and codec(i)), a list of codecs (one per linear layer) or a {layer: codec} dict; "
            f"got {type(spec).__name__}"
        )
    for layer, codec in codecs.items():
        if isinstance(codec, str):
            codecs[layer] = codec = make_codec(codec)
        if not _is_codec(codec):
            raise TypeError(f"the codec for layer {layer} must be a Codec, got {type(codec).__name__}")
    return codecs


def _per_row_tensors(encoded) -> list[torch.Tensor]:
    """The tensors of an encoded object that hold per-request data (leading dim N)."""
    if isinstance(encoded, ErrorFeedbackState):  # the state and its carried residual
        return _per_row_tensors(encoded.state) + _per_row_tensors(encoded.residual)
    if isinstance(encoded, DeferredState):  # the last fit's codes, and the float state since (its emulation)
        pending = [] if encoded.pending is None else [encoded.pending]
        return _per_row_tensors(encoded.state) + pending
    if isinstance(encoded, torch.Tensor):
        return [encoded]
    if isinstance(encoded, QState):
        tensors = (encoded.codes, encoded.row_scale, encoded.col_scale, encoded.pivots)
        return [t for t in tensors if t is not None]
    if isinstance(encoded, PackedState):
        return [t for t in (encoded.codes, encoded.row_scale, encoded.col_scale) if t is not None]
    raise TypeError(f"cannot account for an encoded state of type {type(encoded).__name__}")


def _map_rows(encoded, fn):
    """Apply fn to every per-request tensor of an encoded object (select rows, move device)."""
    if isinstance(encoded, torch.Tensor):
        return fn(encoded)
    if isinstance(encoded, ErrorFeedbackState):
        return ErrorFeedbackState(_map_rows(encoded.state, fn), _map_rows(encoded.residual, fn))
    if isinstance(encoded, DeferredState):
        pending = None if encoded.pending is None else fn(encoded.pending)
        return DeferredState(_map_rows(encoded.state, fn), pending, encoded.age)
    opt = lambda t: None if t is None else fn(t)
    if isinstance(encoded, QState):
        return dataclasses.replace(
            encoded, codes=fn(encoded.codes), row_scale=fn(encoded.row_scale),
            col_scale=opt(encoded.col_scale), pivots=opt(encoded.pivots),
        )
    if isinstance(encoded, PackedState):
        return PackedState(fn(encoded.codes), fn(encoded.row_scale), opt(encoded.col_scale), encoded.layout,
                           encoded.grid, encoded.format)
    raise TypeError(f"cannot reorder an encoded state of type {type(encoded).__name__}")


def encoded_bytes(encoded) -> int:
    """Bytes of the per-request tensors of one encoded object (codes, scales, pivots / the cast tensor)."""
    return sum(t.numel() * t.element_size() for t in _per_row_tensors(encoded))


class CompressedLinearAttentionLayer(LinearAttentionLayer):
    """A linear-attention cache layer whose recurrent states are stored encoded, one codec per row group.

    codecs:      one codec per row group (this layer's codec of each group's spec)
    group_sizes: rows per group, or None for an equal split of the batch at the first store
    packed:      bit-pack QStates (stepquant.codecs.packing) so the held bytes are the serving bytes
    """

    def __init__(self, codecs: Sequence[Codec], group_sizes: Sequence[int] | None = None, packed: bool = True,
                 number_of_states: int = 1, **kwargs):
        super().__init__(number_of_states=number_of_states, **kwargs)
        if not codecs:
            raise ValueError("codecs must hold at least one codec (one per row group)")
        self.codecs = tuple(codecs)
        self.group_sizes = None if group_sizes is None else tuple(int(s) for s in group_sizes)
        self.packed = bool(packed)
        # state_idx -> [encoded object of each row group] (None until the first store)
        self.encoded: dict[int, list | None] = dict.fromkeys(range(number_of_states))
        self._layouts: dict[int, PackedLayout] = {}

    # ---------------------------------------------------------------- storage
    def _sizes(self, num_rows: int) -> tuple[int, ...]:
        if self.group_sizes is None:
            if num_rows % len(self.codecs):
                raise ValueError(
                    f"a batch of {num_rows} rows cannot be split equally into {len(self.codecs)} codec row "
                    "groups; pass group_sizes= to the cache"
                )
            self.group_sizes = (num_rows // len(self.codecs),) * len(self.codecs)
        if sum(self.group_sizes) != num_rows:
            raise ValueError(f"group_sizes {list(self.group_sizes)} sum to {sum(self.group_sizes)} rows, "
                             f"but the batch has {num_rows}")
        return self.group_sizes

    def _layout(self, key, q: QState) -> PackedLayout:
        layout = self._layouts.get(key)
        if layout is None:
            layout = PackedLayout(q.bits.cpu(), q.codes.shape[-1], has_col_scale=q.col_scale is not None)
            self._layouts[key] = layout
        return layout

    def _pack(self, group, encoded):
        """An encoded object with every QState in it bit-packed (an error-feedback state's two parts)."""
        if isinstance(encoded, ErrorFeedbackState):
            return ErrorFeedbackState(self._pack(group, encoded.state),
                                      self._pack((group, "residual"), encoded.residual))
        if isinstance(encoded, DeferredState):
            return DeferredState(self._pack(group, encoded.state), encoded.pending, encoded.age)
        if isinstance(encoded, QState):
            return pack(encoded, self._layout(group, encoded))
        return encoded

    @staticmethod
    def _unpack(encoded):
        if isinstance(encoded, ErrorFeedbackState):
            return ErrorFeedbackState(CompressedLinearAttentionLayer._unpack(encoded.state),
                                      CompressedLinearAttentionLayer._unpack(encoded.residual))
        if isinstance(encoded, DeferredState):
            return DeferredState(CompressedLinearAttentionLayer._unpack(encoded.state), encoded.pending,
                                 encoded.age)
        return unpack(encoded) if isinstance(encoded, PackedState) else encoded

    def _encode(self, group: int, states: torch.Tensor, previous=None):
        """Encode one group's states; ``previous`` is what the group stored before (a decode token)."""
        codec = self.codecs[group]
        if previous is None or not codec.carries_residual:  # stateless formats: no unpack of the old state
            encoded = codec.encode(states)
        else:
            encoded = codec.requantize(states, self._unpack(previous))
        return self._pack(group, encoded) if self.packed else encoded

    def _decode(self, group: int, encoded) -> torch.Tensor:
        return self.codecs[group].decode(self._unpack(encoded))

    def store(self, states: torch.Tensor, state_idx: int = 0) -> None:
        """Encode FP32 states [N, H, K, V] group by group and keep only the encoded objects.

        A group already holding a state is requantized (Codec.requantize: an error-feedback format adds
        the residual it stored); the first store of a state is the boundary pack (Codec.encode).
        """
        parts = states.split(self._sizes(states.shape[0]), dim=0)
        previous = self.encoded[state_idx] or [None] * len(parts)
        self.encoded[state_idx] = [self._encode(g, part, prev)
                                   for g, (part, prev) in enumerate(zip(parts, previous, strict=True))]

    def load(self, state_idx: int = 0) -> torch.Tensor:
        """The decoded FP32 states [N, H, K, V] of every row (groups in order)."""
        stored = self.encoded[state_idx]
        if stored is None:
            raise RuntimeError(f"recurrent state {state_idx} has not been stored yet")
        decoded = [self._decode(g, enc) for g, enc in enumerate(stored)]
        return decoded[0] if len(decoded) == 1 else torch.cat(decoded, dim=0)

    def decode_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, *, scale: float | None = None, use_qk_l2norm: bool = True,
                    state_idx: int = 0) -> torch.Tensor:
        """One decode token on the stored state: decode, FP32 update, read y, re-encode; y [N, H, V].

        q, k [N, H_k, K] (raw; normalised here when use_qk_l2norm); v [N, H, V]; g [N, H] (GDN) or
        [N, H, K] (KDA) log decays; beta [N, H]. stepquant.kernels.decode.decode_step_packed does the
        same on pool slots (stepquant.integrations.packed_cache routes the model's decode call to it).
        """
        mode = "kda" if g.dim() == 3 else "gdn"
        b_q, b_k = prepare_qk(q, k, scale=scale, use_qk_l2norm=use_qk_l2norm, mode=mode)
        x, y = step(self.load(state_idx), b_q, b_k, v, g, beta)  # y read from X, before requantizing
        self.store(x, state_idx)
        return y

    # ---------------------------------------------------------------- transformers' layer API
    def lazy_initialization(self, conv_states=None, recurrent_states=None, state_idx: int = 0,
                            conv_kernel_size: int | None = None) -> None:
        if conv_states is not None:
            super().lazy_initialization(conv_states=conv_states, state_idx=state_idx,
                                        conv_kernel_size=conv_kernel_size)
        if recurrent_states is not None:
            if self.device is None:
                self.device = recurrent_states.device
            self.is_recurrent_states_initialized[state_idx] = True

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        """Encode the layer's new state: the boundary pack after a prefill, the requantization per token."""
        if not self.is_recurrent_states_initialized[state_idx]:
            self.lazy_initialization(recurrent_states=recurrent_states, state_idx=state_idx)
        self.store(recurrent_states, state_idx)
        return recurrent_states

    def reset(self) -> None:
        for i in range(self.number_of_states):
            if self.is_conv_states_initialized[i]:
                self.conv_states[i].zero_()
            self.encoded[i] = None
            self.has_previous_state[i] = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Select rows for beam search. A group whose rows all come from one group keeps their codes
        (re-encoded only when the source group's codec differs); otherwise its rows are decoded and
        encoded again with the group's codec."""
        for i in range(self.number_of_states):
            if self.is_conv_states_initialized[i]:
                conv = self.conv_states[i]
                self.conv_states[i] = conv.index_select(0, beam_idx.to(conv.device))
            stored = self.encoded[i]
            if stored is None:
                continue
            index = beam_idx.to("cpu", torch.int64)
            sizes = self._sizes(index.numel())
            starts = torch.tensor((0, *sizes)).cumsum(0)  # [G + 1]
            source_group = torch.bucketize(index, starts[1:], right=True)  # [N]
            reordered, decoded_all = [], None
            for g, (start, size) in enumerate(zip(starts[:-1].tolist(), sizes, strict=True)):
                rows, groups = index[start:start + size], source_group[start:start + size]
                h = int(groups[0])
                if bool((groups == h).all()):
                    device_rows = (rows - int(starts[h]))
                    enc = _map_rows(stored[h], lambda t, r=device_rows: t.index_select(0, r.to(t.device)))
                    if self.codecs[h] is not self.codecs[g]:
                        enc = self._encode(g, self._decode(h, enc))
                else:
                    decoded_all = self.load(i) if decoded_all is None else decoded_all
                    enc = self._encode(g, decoded_all.index_select(0, rows.to(decoded_all.device)))
                reordered.append(enc)
            self.encoded[i] = reordered

    def _move(self, device) -> None:
        for i in range(self.number_of_states):
            if self.is_conv_states_initialized[i]:
                self.conv_states[i] = self.conv_states[i].to(device, non_blocking=True)
            if self.encoded[i] is not None:
                move = lambda t: t.to(device, non_blocking=True)
                self.encoded[i] = [_map_rows(enc, move) for enc in self.encoded[i]]

    def offload(self):
        self._move("cpu")

    def prefetch(self):
        if self.device is not None:
            self._move(self.device)

    # ---------------------------------------------------------------- memory
    def group_bytes(self, as_packed: bool = False) -> list[int]:
        """Bytes held by each row group's encoded states (all state indices of this layer).

        as_packed=True counts an unpacked QState as its bit-packed form (packs it once to measure).
        """
        totals = [0] * len(self.codecs)
        for stored in self.encoded.values():
            for g, enc in enumerate(stored or ()):
                totals[g] += encoded_bytes(self._pack(g, enc) if as_packed else enc)
        return totals


def config_model_type(config) -> str:
    """model_type of a config's text part (a multimodal Qwen3.5 config reports its text model's)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return getattr(text, "model_type", None) or getattr(config, "model_type", None)


class CompressedStateCache(DynamicCache):
    """DynamicCache with encoded recurrent states (see the module docstring).

    config:      the model's config (qwen3_next, qwen3_5, qwen3_5_moe or kimi_linear families)
    codec:       one codec spec for every row (default "fp32" when row_codecs is not given)
    row_codecs:  a list of codec specs, one per contiguous row group (instead of codec)
    group_sizes: rows per group (default: the batch split equally at the first forward)
    packed:      bit-pack integer states (held bytes = serving bytes); False keeps uint8 codes
    """

    def __init__(self, config, codec=None, *, row_codecs: Sequence | None = None,
                 group_sizes: Sequence[int] | None = None, packed: bool = True):
        check_transformers_version()
        model_type = config_model_type(config)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"config.model_type={model_type!r} is not supported: the compressed-state cache "
                             f"covers {', '.join(SUPPORTED_MODEL_TYPES)}")
        if codec is not None and row_codecs is not None:
            raise TypeError("pass either codec= (every row) or row_codecs= (one spec per row group), "
                            "not both")
        if row_codecs is not None and not isinstance(row_codecs, (list, tuple)):
            raise TypeError(f"row_codecs must be a list of codec specs (one per row group), got "
                            f"{type(row_codecs).__name__}")
        specs = list(row_codecs) if row_codecs is not None else ["fp32" if codec is None else codec]
        if not specs:
            raise ValueError("row_codecs must hold at least one codec spec")
        if group_sizes is not None:
            group_sizes = [int(s) for s in group_sizes]
            if len(group_sizes) != len(specs) or any(s < 1 for s in group_sizes):
                raise ValueError(f"group_sizes must hold {len(specs)} positive ints (one per row group), "
                                 f"got {group_sizes}")
        super().__init__(config=config)
        self.linear_layers = list(linear_layers(config))
        if not self.linear_layers:
            raise ValueError("the config has no linear-attention layers to compress")
        per_group = [resolve_layer_codecs(spec, self.linear_layers, config) for spec in specs]
        for i in self.linear_layers:
            states = self.layers[i].number_of_states
            layer_codecs = [codecs[i] for codecs in per_group]
            self.layers[i] = CompressedLinearAttentionLayer(layer_codecs, group_sizes, packed, states)
        self.num_groups = len(specs)
        self.packed = bool(packed)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        layer = self.layers[layer_idx]
        if isinstance(layer, CompressedLinearAttentionLayer):
            return layer.load(state_idx) if layer.has_previous_state[state_idx] else None
        return super().get_recurrent_state(layer_idx, state_idx)

    def layer_codecs(self, group: int = 0) -> dict[int, Codec]:
        """{model layer index: codec} of one row group."""
        return {i: self.layers[i].codecs[group] for i in self.linear_layers}

    @property
    def group_sizes(self) -> tuple[int, ...] | None:
        return self.layers[self.linear_layers[0]].group_sizes

    def state_bytes(self) -> dict:
        """Bytes held by the encoded recurrent states, all linear-attention layers.

        held_bytes / group_bytes / bytes_per_request: what the cache holds now, in total, per row group
        and per request of each group; serving_bytes_per_request: the same with integer states counted
        bit-packed (equal to bytes_per_request when packed=True). Counts the per-request tensors of the
        encoded objects (codes, scales, pivots; the cast tensor of a float format); per-layer metadata
        (bit tables, packing layouts) is not per request.
        """
        held, serving = [0] * self.num_groups, [0] * self.num_groups
        for i in self.linear_layers:
            for g, size in enumerate(self.layers[i].group_bytes()):
                held[g] += size
            for g, size in enumerate(self.layers[i].group_bytes(as_packed=True)):
                serving[g] += size
        sizes = self.group_sizes
        per_request = lambda totals: None if sizes is None else [
            b // s for b, s in zip(totals, sizes, strict=True)
        ]
        return {"held_bytes": sum(held), "group_bytes": held, "bytes_per_request": per_request(held),
                "serving_bytes_per_request": per_request(serving),
                "group_sizes": None if sizes is None else list(sizes), "packed": self.packed}

    @classmethod
    def replicate(cls, source, config, row_codecs: Sequence, *, packed: bool = True):
        """A cache holding len(row_codecs) copies of a prefilled float cache, copy m encoded with codec m.

        source is a DynamicCache after a prefill of B rows; the result has B * M rows, rows
        [m B, (m + 1) B) being a copy of the source rows stored with row_codecs[m]. Attention KV and
        convolution states are copied; each group's recurrent state is encoded once (the boundary pack).
        This is how one prefill serves many state formats.
        """
        cache = cls(config, row_codecs=row_codecs, packed=packed)
        copies = len(row_codecs)
        tile = lambda t: t.repeat(copies, *([1] * (t.dim() - 1)))
        for i, (src, dst) in enumerate(zip(source.layers, cache.layers, strict=True)):
            if i in cache.linear_layers:
                for s in range(src.number_of_states):
                    if src.is_conv_states_initialized[s]:
                        dst.update_conv_state(tile(src.conv_states[s]), s,
                                              conv_kernel_size=src.conv_kernel_size[s])
                    if src.is_recurrent_states_initialized[s]:
                        dst.update_recurrent_state(tile(src.recurrent_states[s]), s)
                    dst.has_previous_state[s] = src.has_previous_state[s]
            elif getattr(src, "is_initialized", False) and getattr(src, "keys", None) is not None:
                dst.update(tile(src.keys), tile(src.values))
        return cache

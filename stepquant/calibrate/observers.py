"""Observers: capture the inputs of every linear-attention recurrence while a transformers model runs.

Calibration needs, per linear-attention layer, exactly what the recurrence consumed: q, k (after the
short convolution and its activation, before the in-kernel L2 norm), v, the log-decay g (per head for
GDN, per key channel for KDA) and the write strength beta. The least invasive place to see them is
the module-level kernel function the mixer calls: every supported transformers mixer computes its
inputs and then calls a function of its modeling module by its global name,

    core_attn_out, state = torch_chunk_gated_delta_rule(query, key, value, g=g, beta=beta, ...)

(the chunked function on prefill, the recurrent one for cached single-token decode). The
``use_kernelized_func`` decorator on the mixer class does not rebind those names (without the
``kernels`` package it is a no-op; with it, hub kernels replace the mixer's forward, not the global
lookup), so wrapping the module attribute for the duration of a ``with`` block sees every call,
whichever implementation sits behind it (transformers' torch fallback, fla on GPU, or
``stepquant.models.use_recurrent_prefill``'s token loop). Forward pre/post hooks on the mixer
modules say which layer is calling. Nothing else of the model changes and the wrapped function's
result is returned untouched.

Each call is handed to a consumer at once as a :class:`RecurrenceCapture` whose tensors have been
moved to ``device`` (CPU by default) in FP32, so a model spread over several GPUs with
``device_map="auto"`` or loaded in bf16 is observed layer by layer without holding more than one
layer's inputs: statistics stream, they are never all kept.

:func:`replay` re-runs the FP32 reference recurrence (stepquant.recurrence.gated_delta_rule, with
the model's own q/k L2 norm) on a capture and returns its readouts and state snapshots; tests check
that the readouts equal the model's own core attention outputs.

Where a model type keeps its mixer and recurrence functions comes from its stepquant.families entry.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from stepquant.families import family_for, linear_layers
from stepquant.recurrence import gated_delta_rule


@dataclass(frozen=True, eq=False)
class RecurrenceCapture:
    """One call of a layer's recurrence, as the model made it (tensors FP32 on the observer's device).

    layer:  model layer index (``config.layer_types`` position); index: its number among linear layers
    q, k:   [B, T, H_k, K] as passed to the kernel (before its L2 norm and K^-1/2 scale)
    v:      [B, T, H, V];  g: [B, T, H] (GDN) or [B, T, H, K] (KDA) log-decay;  beta: [B, T, H]
    initial_state: [B, H, K, V] or None;  use_qk_l2norm: the kernel flag the model passed
    output: [B, T, H, V] the model's own core attention output (its dtype's values, in FP32)
    """

    layer: int
    index: int
    family: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    initial_state: torch.Tensor | None
    use_qk_l2norm: bool
    output: torch.Tensor | None

    @property
    def batch(self) -> int:
        return self.v.shape[0]

    @property
    def length(self) -> int:
        return self.v.shape[1]


def linear_attention_modules(model: torch.nn.Module, model_type: str) -> list[tuple[int, torch.nn.Module]]:
    """(layer_idx, mixer module) of every linear-attention layer of ``model``, in layer order."""
    family = family_for(model_type)
    mixer_class = family.model_type(model_type).mixer_class
    mixer_type = getattr(family.modeling_module(model_type), mixer_class)
    found = {int(m.layer_idx): m for m in model.modules() if isinstance(m, mixer_type)}
    expected = linear_layers(model.config)
    if sorted(found) != list(expected):
        raise ValueError(
            f"the model's {mixer_class} modules sit at layers {sorted(found)}, its config lists "
            f"linear-attention layers {list(expected)}; is it a {family.name.upper()} model of "
            f"{family.model_type(model_type).modeling_module}?"
        )
    return [(layer, found[layer]) for layer in expected]


def _model_type(model) -> str:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if not isinstance(model_type, str):
        raise TypeError(
            f"model must be a transformers model with config.model_type, got {type(model).__name__}"
        )
    return model_type


def _argument(args: tuple, kwargs: dict, position: int, names: tuple[str, ...]):
    for name in names:
        if name in kwargs:
            return kwargs[name]
    return args[position] if len(args) > position else None


class RecurrenceObserver:
    """Context manager that hands every recurrence call of ``model`` to ``on_capture`` (module docstring).

        with RecurrenceObserver(model, consume) as observer:
            model(input_ids)            # consume(RecurrenceCapture) once per linear layer

    device: where captured tensors go (FP32); keep_output: also capture the model's core attention
    output (for replay checks). ``linear_layers`` lists the model layer indices observed, in order.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        on_capture: Callable[[RecurrenceCapture], None],
        *,
        device: str | torch.device = "cpu",
        keep_output: bool = True,
    ) -> None:
        if not callable(on_capture):
            raise TypeError(
                f"on_capture must be callable as on_capture(capture), got {type(on_capture).__name__}"
            )
        self.model_type = _model_type(model)
        self.family = family_for(self.model_type).name
        self._mixers = linear_attention_modules(model, self.model_type)
        self.linear_layers = tuple(layer for layer, _ in self._mixers)
        self._on_capture = on_capture
        self._device = torch.device(device)
        self._keep_output = bool(keep_output)
        self._current: tuple[int, int] | None = None  # (layer, index) of the mixer running now
        self._inside_kernel = False
        self._active = False
        self._handles: list = []
        self._patched: list[tuple[object, str, Callable]] = []

    def __enter__(self) -> RecurrenceObserver:
        if self._active:
            raise RuntimeError("this RecurrenceObserver is already active")
        family = family_for(self.model_type)
        module = family.modeling_module(self.model_type)
        for name in family.recurrence_functions:
            original = getattr(module, name)
            wrapper = self._wrap(original)
            setattr(module, name, wrapper)
            self._patched.append((module, name, wrapper))
        for index, (layer, mixer) in enumerate(self._mixers):
            self._handles.append(mixer.register_forward_pre_hook(self._enter_layer(layer, index)))
            self._handles.append(mixer.register_forward_hook(self._leave_layer))
        self._active = True
        return self

    def __exit__(self, *exc_info) -> None:
        self._active = False
        for handle in self._handles:
            handle.remove()
        for module, name, wrapper in self._patched:
            if getattr(module, name) is wrapper:  # leave a later patch of someone else in place
                setattr(module, name, wrapper.__wrapped__)
        self._handles, self._patched, self._current = [], [], None

    def _enter_layer(self, layer: int, index: int):
        def hook(module, args):
            self._current = (layer, index)

        return hook

    def _leave_layer(self, module, args, output):
        self._current = None

    def _wrap(self, original: Callable) -> Callable:
        def observed(*args, **kwargs):
            if not self._active or self._current is None or self._inside_kernel:
                return original(*args, **kwargs)
            self._inside_kernel = True  # a kernel calling another wrapped kernel is one call
            try:
                result = original(*args, **kwargs)
            finally:
                self._inside_kernel = False
            self._record(args, kwargs, result)
            return result

        observed.__wrapped__ = original
        observed.__name__ = getattr(original, "__name__", "observed")
        return observed

    def _to_device(self, x):
        return None if x is None else x.detach().to(device=self._device, dtype=torch.float32)

    def _record(self, args: tuple, kwargs: dict, result) -> None:
        layer, index = self._current
        q, k, v = (
            _argument(args, kwargs, i, names)
            for i, names in enumerate((("query", "q"), ("key", "k"), ("value", "v")))
        )
        g, beta = _argument(args, kwargs, 3, ("g",)), _argument(args, kwargs, 4, ("beta",))
        if any(x is None for x in (q, k, v, g, beta)):
            raise RuntimeError(f"layer {layer}: could not find query/key/value/g/beta in the kernel call")
        output = result[0] if isinstance(result, (tuple, list)) else result
        capture = RecurrenceCapture(
            layer=layer,
            index=index,
            family=self.family,
            q=self._to_device(q),
            k=self._to_device(k),
            v=self._to_device(v),
            g=self._to_device(g),
            beta=self._to_device(beta),
            initial_state=self._to_device(kwargs.get("initial_state")),
            use_qk_l2norm=bool(kwargs.get("use_qk_l2norm_in_kernel", False)),
            output=self._to_device(output) if self._keep_output else None,
        )
        self._on_capture(capture)


@dataclass(frozen=True, eq=False)
class Replay:
    """The FP32 reference recurrence re-run on a capture.

    output:    [B, T, H, V] readouts y_t = S_t^T q_t
    snapshots: [B, S, H, K, V] states S_t after the tokens ``positions`` (0-based), or None
    """

    output: torch.Tensor
    snapshots: torch.Tensor | None
    positions: tuple[int, ...]


def snapshot_positions(length: int, every: int | None) -> tuple[int, ...]:
    """Tokens after which a state is snapshotted: every-1, 2 every-1, ... (< length); () for None."""
    if every is None:
        return ()
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"snapshot_every must be a positive int or None, got {every!r}")
    return tuple(range(every - 1, length, every))


def replay(
    capture: RecurrenceCapture, *, snapshot_every: int | None = None, device: str | torch.device | None = None
) -> Replay:
    """Re-run the FP32 recurrence on ``capture``; snapshot the state after every ``snapshot_every`` tokens.

    Runs chunk by chunk (one gated_delta_rule call per snapshot interval, carrying the state), so the
    readouts are those of one uninterrupted run. device: where to compute (default: the capture's).
    """
    if not isinstance(capture, RecurrenceCapture):
        raise TypeError(f"capture must be a RecurrenceCapture, got {type(capture).__name__}")
    device = capture.v.device if device is None else torch.device(device)
    q, k, v, g, beta = (x.to(device) for x in (capture.q, capture.k, capture.v, capture.g, capture.beta))
    state = None if capture.initial_state is None else capture.initial_state.to(device)
    length = capture.length
    positions = snapshot_positions(length, snapshot_every)
    bounds = [0, *(p + 1 for p in positions)]
    if bounds[-1] != length:
        bounds.append(length)
    outputs, snapshots = [], []
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        o, state = gated_delta_rule(
            q[:, start:stop],
            k[:, start:stop],
            v[:, start:stop],
            g[:, start:stop],
            beta[:, start:stop],
            initial_state=state,
            use_qk_l2norm=capture.use_qk_l2norm,
            mode=capture.family,
        )
        outputs.append(o)
        if stop - 1 in positions:
            snapshots.append(state)
    output = torch.cat(outputs, dim=1)  # [B, T, H, V]
    stacked = torch.stack(snapshots, dim=1) if snapshots else None  # [B, S, H, K, V]
    return Replay(output, stacked, positions)


def replay_error(capture: RecurrenceCapture, replayed: Replay) -> float:
    """Relative RMS difference of replayed and the model's own readouts: ||o - o_model|| / ||o_model||."""
    if capture.output is None:
        raise ValueError("the capture has no model output (observer keep_output=False)")
    expected = capture.output.to(replayed.output.device, torch.float64)
    diff = (replayed.output.to(torch.float64) - expected).pow(2).sum().sqrt()
    norm = expected.pow(2).sum().sqrt().item()
    return diff.item() / norm if norm > 0 else (0.0 if diff.item() == 0 else math.inf)

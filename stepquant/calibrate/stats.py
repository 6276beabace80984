"""Calibration statistics: gate lifetimes, row impact and per-unit distortion, streamed over calibration text.

What calibration measures (docs/method.md section 3), per allocation unit u (a whole head for GDN, one
key row of a head for KDA), over the calibration segments:

- mean log retention l_u = E[g_t,u] (GDN: the head's g; KDA: g of the row's key channel), token
  weighted over all segments, and the half-life tau_u = ln 2 / (-l_u) in tokens;
- row impact omega_i = E[(A_t^T q_t)_i^2] per key row of every head (recurrence.transition_readout_weights),
  and the row-impact factors w_i proportional to omega_i^p (p = ``exponent``, the paper's 1/8) after a
  floor of ``omega_floor`` x the head's largest omega, normalised to geometric mean 1 within each head
  (so w = 1 means "average impact", and a head's scale is not changed by the normalisation);
- distortion d_u(b), b = 2..8: the expected squared reconstruction error sum_{values of u} (X - Q_b(X))^2
  of the unit under the spatial quantizer at b bits, averaged over state snapshots (the FP32 replayed
  states after every ``snapshot_every`` tokens of every segment). Two quantizers are measured:
  "dual_axis" (key-row-aware dual-axis fitting with the calibrated w; STEPQuant and the spatial
  variant) and "absmax" (uniform rowwise absmax; the temporal-only ablations). A KDA unit (key row)
  is measured with its whole head quantized at the same b (the dual-axis column scales are shared by the
  head's rows): the separable approximation the allocation needs. The error is not weighted by w.

Two passes over the model, because the dual-axis distortion depends on w, which needs omega over all
of the calibration data: pass 1 (a forward only) accumulates l and omega; pass 2 replays the FP32
recurrence from the captured inputs (checking its readouts against the model's own, the relative
RMS difference is kept per layer) and accumulates d and the state energy E[||S_u||^2]. Both passes
stream: each layer's captured inputs are consumed as soon as the layer has run and then dropped; only
running sums ([L, H, K]-sized) are kept. The result, :class:`CalibrationStats`, is what every plan of
any variant / budget / horizon / pivot count is allocated from, saved as ``stats.safetensors``.
"""

from __future__ import annotations

import inspect
import json
import math
import uuid
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save
from tqdm.auto import tqdm

import stepquant
from stepquant.codecs import DualAxisCodec, DualAxisConfig, UniformCodec
from stepquant.codecs.base import MAX_BITS, MIN_BITS
from stepquant.codecs.dual_axis import ROW_WEIGHT_RANGE, check_row_weights
from stepquant.families import ModelShape, get_family
from stepquant.recurrence import prepare_qk, transition_readout_weights

from .files import canonical, sha256, write_file
from .observers import RecurrenceCapture, RecurrenceObserver, replay, replay_error
from .quantizer import quantizer_from_json, quantizer_to_json

BIT_WIDTHS = tuple(range(MIN_BITS, MAX_BITS + 1))  # d_u(b) is measured for every b in 2..8
QUANTIZERS = ("dual_axis", "absmax")
DEFAULT_EXPONENT = 0.125  # w ~ omega^(1/8), the paper's exponent
DEFAULT_OMEGA_FLOOR = 1e-6  # omega_i >= 1e-6 x the head's largest omega before the power
DEFAULT_SNAPSHOT_EVERY = 256
DEFAULT_BATCH_SIZE = 4
DEFAULT_REPLAY_TOLERANCE = 2e-2  # relative RMS; bf16 models round their outputs to ~4e-3
STATS_FILE = "stats.safetensors"
STATS_FORMAT_VERSION = 1
_METADATA_KEY = "stepquant_stats"
_TINY = 1e-30
_ROW_IMPACT_CHUNK = 512  # tokens per chunk of the A_t^T q_t computation (bounds its memory)


@dataclass(frozen=True)
class StatsConfig:
    """How statistics are collected (the data itself is the segments given to collect_stats).

    snapshot_every: tokens between state snapshots for d_u(b) (after tokens every-1, 2 every-1, ...)
    exponent:       p in w ~ omega^p (0 gives w = 1); omega_floor: relative floor of omega within a head
    batch_size:     segments per forward pass
    replay_device:  where captured inputs go (FP32) and the replay runs; "cpu" keeps GPU memory free
    replay_tolerance: relative RMS difference of replayed vs model readouts above which a warning is issued
    quantizer:      the dual-axis quantizer d_u(b) is measured with: the one the plans will run
    """

    snapshot_every: int = DEFAULT_SNAPSHOT_EVERY
    exponent: float = DEFAULT_EXPONENT
    omega_floor: float = DEFAULT_OMEGA_FLOOR
    batch_size: int = DEFAULT_BATCH_SIZE
    replay_device: str = "cpu"
    replay_tolerance: float = DEFAULT_REPLAY_TOLERANCE
    quantizer: DualAxisConfig = field(default_factory=DualAxisConfig)

    def __post_init__(self) -> None:
        for name in ("snapshot_every", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        _check_spread(self.exponent, self.omega_floor)
        if not isinstance(self.replay_device, str):
            raise TypeError(
                f"replay_device must be a device string like 'cpu' or 'cuda:0', got {self.replay_device!r}"
            )
        tol = self.replay_tolerance
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol > 0:
            raise ValueError(f"replay_tolerance must be a positive number, got {tol!r}")
        if not isinstance(self.quantizer, DualAxisConfig):
            raise TypeError(f"quantizer must be a DualAxisConfig, got {type(self.quantizer).__name__}")


def _check_exponent(exponent) -> float:
    if isinstance(exponent, bool) or not isinstance(exponent, (int, float)) or not 0 <= exponent < math.inf:
        raise ValueError(
            f"exponent must be a finite number >= 0 (w ~ omega^exponent; default 1/8), got {exponent!r}"
        )
    return float(exponent)


def _check_floor(floor) -> float:
    if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0 < floor <= 1:
        raise ValueError(
            f"omega_floor must be in (0, 1] (relative to the head's largest omega), got {floor!r}"
        )
    return float(floor)


def _check_spread(exponent, floor) -> tuple[float, float]:
    """The exponent and floor, checked alone and together: w then stays within ROW_WEIGHT_RANGE."""
    exponent, floor = _check_exponent(exponent), _check_floor(floor)
    spread = floor**-exponent  # the largest w_max / geomean (and geomean / w_min) they allow
    if spread > ROW_WEIGHT_RANGE[1]:
        raise ValueError(
            f"omega_floor={floor:g} with exponent={exponent:g} lets the row-impact factors w spread by "
            f"{spread:.3g} around their geometric mean, beyond the {ROW_WEIGHT_RANGE[1]:g} the quantizer "
            "accepts: raise --omega-floor or lower --exponent"
        )
    return exponent, floor


def row_impact_factors(
    omega: torch.Tensor, exponent: float = DEFAULT_EXPONENT, floor: float = DEFAULT_OMEGA_FLOOR
) -> torch.Tensor:
    """w [..., K] (FP32) from omega [..., K]: omega floored at ``floor`` x its max over K, to the power
    ``exponent``, divided by its geometric mean over K (so every head's w has geometric mean 1, and
    floor^exponent <= w <= floor^-exponent, which must lie in the codecs' ROW_WEIGHT_RANGE)."""
    if not isinstance(omega, torch.Tensor) or not omega.is_floating_point():
        raise TypeError(f"omega must be a floating-point tensor [..., K], got {type(omega).__name__}")
    exponent, floor = _check_spread(exponent, floor)
    omega = omega.to(torch.float64)
    if not bool(torch.isfinite(omega).all()) or bool((omega < 0).any()):
        raise ValueError("omega must be finite and >= 0")
    floored = torch.maximum(omega, floor * omega.amax(dim=-1, keepdim=True)).clamp_min(_TINY)
    log_w = exponent * floored.log()
    log_w = log_w - log_w.mean(dim=-1, keepdim=True)
    return log_w.exp().to(torch.float32)


def half_lives_from_log_retention(mean_log_retention: torch.Tensor) -> torch.Tensor:
    """tau = ln 2 / (-l) in tokens (float64); inf where l >= 0 (nothing is forgotten)."""
    l = mean_log_retention.to(torch.float64)
    return torch.where(l < 0, math.log(2.0) / (-l).clamp_min(_TINY), torch.full_like(l, math.inf))


def half_life_census(
    half_lives: torch.Tensor | Sequence[torch.Tensor], thresholds=(64, 256, 1024)
) -> dict[int, int]:
    """How many units have a half-life above each threshold (tokens): {64: n, 256: n, 1024: n}."""
    if not isinstance(half_lives, torch.Tensor):
        half_lives = torch.cat([torch.as_tensor(h).reshape(-1) for h in half_lives])
    flat = half_lives.reshape(-1)
    return {int(t): int((flat > t).sum()) for t in thresholds}


@dataclass(frozen=True, eq=False)
class ModelFields:
    """The calibrated model, as :class:`CalibrationStats` and :class:`~stepquant.calibrate.plan.Plan` store it
    field by field (the keys of stats.safetensors' metadata and of plan.json's "model" block), and the
    views derived from it. family: "gdn" / "kda"; linear_layers: the model layer index of each
    linear-attention layer; num_heads, key_dim, value_dim: H, K, V of every layer."""

    model_name: str
    model_type: str
    family: str
    linear_layers: tuple[int, ...]
    num_heads: int
    key_dim: int
    value_dim: int

    def _check_model_fields(self) -> None:
        get_family(self.family)
        object.__setattr__(self, "linear_layers", tuple(int(i) for i in self.linear_layers))

    @property
    def unit_shape(self) -> tuple[int, ...]:
        """[L, H] (GDN heads) or [L, H, K] (KDA key rows)."""
        base = (len(self.linear_layers), self.num_heads)
        return base if get_family(self.family).unit_is_head else (*base, self.key_dim)

    @property
    def num_units(self) -> int:
        return math.prod(self.unit_shape)

    @property
    def unit_values(self) -> int:
        """State values per unit: K x V (GDN head) or V (KDA key row)."""
        return get_family(self.family).unit_values(self.key_dim, self.value_dim)

    @property
    def shape(self) -> ModelShape:
        """The accounting shape of the calibrated model."""
        return ModelShape(self.model_name or self.model_type, get_family(self.family),
                          len(self.linear_layers), self.num_heads, self.key_dim, self.value_dim,
                          model_type=self.model_type, layer_indices=self.linear_layers)


@dataclass(frozen=True, eq=False)
class CalibrationStats(ModelFields):
    """Everything an allocation needs, per linear-attention layer (L of them, in model order).

    Unit tensors are [L, H] for GDN (unit = head) and [L, H, K] for KDA (unit = key row); "unit_shape"
    is that shape. Arrays (CPU, float64 unless noted):
      mean_log_retention  [*unit_shape]       l_u = E[g]
      omega               [L, H, K]           E[(A_t^T q_t)_i^2]
      w                   [L, H, K] float32   row-impact factors (exponent, omega_floor below)
      distortion_dual_axis, distortion_absmax [*unit_shape, 7]  d_u(b) for b = 2..8
      state_energy        [*unit_shape]       E[sum of squared state values of the unit] at snapshots
      replay_error        [L]                 relative RMS of replayed vs model readouts (max over batches)
    tokens: calibration tokens per layer; snapshots: state snapshots per head.
    settings: how the statistics were made (data, segments, length, snapshot_every, dtype, ...).
    run_id: a random id of the calibration run that measured them ("" for statistics written before
    run ids); every plan made from them records it (Plan.load checks a plan against the statistics
    beside it).
    """

    mean_log_retention: torch.Tensor
    omega: torch.Tensor
    w: torch.Tensor
    distortion_dual_axis: torch.Tensor
    distortion_absmax: torch.Tensor
    state_energy: torch.Tensor
    replay_error: torch.Tensor
    tokens: int
    snapshots: int
    exponent: float = DEFAULT_EXPONENT
    omega_floor: float = DEFAULT_OMEGA_FLOOR
    settings: dict = field(default_factory=dict)
    run_id: str = ""

    def __post_init__(self) -> None:
        self._check_model_fields()
        layers = self.linear_layers
        for name in ("num_heads", "key_dim", "value_dim", "tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if isinstance(self.snapshots, bool) or not isinstance(self.snapshots, int) or self.snapshots < 0:
            raise ValueError(f"snapshots must be an int >= 0, got {self.snapshots!r}")
        _check_exponent(self.exponent)
        _check_floor(self.omega_floor)
        unit = self.unit_shape
        rows = (len(layers), self.num_heads, self.key_dim)
        expected = {
            "mean_log_retention": (unit, torch.float64),
            "omega": (rows, torch.float64),
            "w": (rows, torch.float32),
            "distortion_dual_axis": ((*unit, len(BIT_WIDTHS)), torch.float64),
            "distortion_absmax": ((*unit, len(BIT_WIDTHS)), torch.float64),
            "state_energy": (unit, torch.float64),
            "replay_error": ((len(layers),), torch.float64),
        }
        for name, (shape, dtype) in expected.items():
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor {list(shape)}, got {type(value).__name__}")
            if tuple(value.shape) != tuple(shape):
                raise ValueError(f"{name} must have shape {list(shape)}, got {list(value.shape)}")
            object.__setattr__(self, name, value.detach().to("cpu", dtype))
        check_row_weights(self.w.flatten(0, 1), len(layers) * self.num_heads, self.key_dim,
                          name="w of the statistics")
        if not isinstance(self.settings, dict):
            raise TypeError(f"settings must be a dict, got {type(self.settings).__name__}")

    @property
    def half_lives(self) -> torch.Tensor:
        """tau_u = ln 2 / (-l_u) in tokens, [*unit_shape] (inf where l_u >= 0)."""
        return half_lives_from_log_retention(self.mean_log_retention)

    @property
    def quantizer(self) -> DualAxisConfig:
        """The dual-axis quantizer the distortion table was measured with (settings "quantizer";
        statistics written before it was recorded used V1_QUANTIZER)."""
        return quantizer_from_json(self.settings.get("quantizer"), "stats.safetensors settings")

    def distortion(self, quantizer: str) -> torch.Tensor:
        """d_u(b) [*unit_shape, 7] (b = 2..8) under "dual_axis" or "absmax"."""
        if quantizer not in QUANTIZERS:
            raise ValueError(f"quantizer must be one of {list(QUANTIZERS)}, got {quantizer!r}")
        return self.distortion_dual_axis if quantizer == "dual_axis" else self.distortion_absmax

    # ------------------------------------------------------------ files

    def _metadata(self) -> dict:
        return {
            "format": "stepquant-calibration-stats",
            "format_version": STATS_FORMAT_VERSION,
            "model_name": self.model_name,
            "model_type": self.model_type,
            "family": self.family,
            "linear_layers": list(self.linear_layers),
            "num_heads": self.num_heads,
            "key_dim": self.key_dim,
            "value_dim": self.value_dim,
            "tokens": self.tokens,
            "snapshots": self.snapshots,
            "exponent": self.exponent,
            "omega_floor": self.omega_floor,
            "bit_widths": list(BIT_WIDTHS),
            "settings": self.settings,
            **({"run_id": self.run_id} if self.run_id else {}),
        }

    def save(self, path: str | Path) -> Path:
        """Write ``stats.safetensors`` (arrays + JSON metadata with their sha256) into a directory, or to
        a file path, atomically (calibrate/files.py)."""
        path = Path(path)
        if path.suffix != ".safetensors":
            path.mkdir(parents=True, exist_ok=True)
            path = path / STATS_FILE
        tensors = {name: getattr(self, name).contiguous() for name in _ARRAY_FIELDS}
        metadata = self._metadata()
        metadata["sha256"] = _stats_sha256(metadata, tensors)
        write_file(path, save(tensors, metadata={_METADATA_KEY: json.dumps(metadata)}))
        return path

    @classmethod
    def load(cls, path: str | Path) -> CalibrationStats:
        """Read statistics written by :meth:`save` (a directory holding stats.safetensors, or the file)."""
        path = Path(path)
        if path.is_dir():
            path = path / STATS_FILE
        if not path.is_file():
            raise FileNotFoundError(
                f"no calibration statistics at {path} (stepquant calibrate writes {STATS_FILE})"
            )
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = json.loads((f.metadata() or {}).get(_METADATA_KEY, "null"))
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except Exception as err:  # safetensors raises its own error types for damaged files
            raise ValueError(f"{path} is not a readable stats.safetensors ({err}); recalibrate") from err
        if not isinstance(meta, dict) or meta.get("format") != "stepquant-calibration-stats":
            raise ValueError(f"{path} has no stepquant calibration metadata; recalibrate")
        if meta.get("format_version") != STATS_FORMAT_VERSION:
            raise ValueError(
                f"{path} has stats format version {meta.get('format_version')}, this stepquant "
                f"reads version {STATS_FORMAT_VERSION}; recalibrate"
            )
        missing = [name for name in _ARRAY_FIELDS if name not in tensors]
        if missing:
            raise ValueError(f"{path} lacks arrays {missing}; recalibrate")
        recorded = meta.pop("sha256", None)  # absent in statistics written before checksums
        if recorded is not None and recorded != _stats_sha256(meta, tensors):
            raise ValueError(f"{path} changed since calibration (its sha256 does not match: damaged or "
                             "edited); recalibrate")
        return cls(
            model_name=meta["model_name"],
            model_type=meta["model_type"],
            family=meta["family"],
            linear_layers=tuple(meta["linear_layers"]),
            num_heads=meta["num_heads"],
            key_dim=meta["key_dim"],
            value_dim=meta["value_dim"],
            tokens=meta["tokens"],
            snapshots=meta["snapshots"],
            exponent=meta["exponent"],
            omega_floor=meta["omega_floor"],
            settings=meta.get("settings", {}),
            run_id=meta.get("run_id", ""),
            **{name: tensors[name] for name in _ARRAY_FIELDS},
        )


def _stats_sha256(metadata: dict, tensors: dict[str, torch.Tensor]) -> str:
    """sha256 of the canonical metadata (without its own checksum) and the bytes of every array."""
    parts = [canonical(metadata)]
    parts += [tensors[name].contiguous().view(torch.uint8).numpy().tobytes() for name in _ARRAY_FIELDS]
    return sha256(b"".join(parts))


def stats_run_id(path: str | Path) -> str:
    """The run id recorded in a stats.safetensors (its header only; "" when it has none or is unreadable:
    Plan.load only compares run ids that are there)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get(_METADATA_KEY, "null"))
    except Exception:  # safetensors' own error types; CalibrationStats.load reports a damaged file
        return ""
    return meta.get("run_id", "") if isinstance(meta, dict) else ""


_ARRAY_FIELDS = (
    "mean_log_retention",
    "omega",
    "w",
    "distortion_dual_axis",
    "distortion_absmax",
    "state_energy",
    "replay_error",
)


# ---------------------------------------------------------------- running the model


def _input_device(model) -> torch.device:
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embeddings, "weight", None)
    return weight.device if isinstance(weight, torch.Tensor) else next(model.parameters()).device


def _check_segments(segments) -> torch.Tensor:
    if not isinstance(segments, torch.Tensor) or segments.dim() != 2 or segments.dtype != torch.long:
        got = (
            f"{segments.dtype} {list(segments.shape)}"
            if isinstance(segments, torch.Tensor)
            else type(segments).__name__
        )
        raise TypeError(f"segments must be a LongTensor [num_segments, length] of token ids, got {got}")
    if segments.shape[0] < 1 or segments.shape[1] < 2:
        raise ValueError(
            f"segments must hold at least one segment of >= 2 tokens, got {list(segments.shape)}"
        )
    return segments


def run_segments(
    model,
    segments: torch.Tensor,
    on_capture: Callable[[RecurrenceCapture], None],
    *,
    batch_size: int,
    device: str = "cpu",
    keep_output: bool = False,
    progress: bool = True,
    desc: str = "calibrate",
) -> RecurrenceObserver:
    """Run ``model`` over ``segments`` [S, T] in batches with every recurrence call handed to ``on_capture``.

    No KV cache, logits of the last position only (a large vocabulary would otherwise cost B x T x vocab).
    Returns the (closed) observer, whose ``linear_layers``/``family``/``model_type`` describe the model.
    """
    segments = _check_segments(segments)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int (segments per forward pass), got {batch_size!r}")
    input_device = _input_device(model)
    forward_kwargs = {"use_cache": False}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        forward_kwargs["logits_to_keep"] = 1
    starts = range(0, segments.shape[0], batch_size)
    observer = RecurrenceObserver(model, on_capture, device=device, keep_output=keep_output)
    with observer, torch.inference_mode():
        bar = tqdm(total=segments.numel(), desc=desc, unit="tok", unit_scale=True, disable=not progress,
                   leave=False)  # tokens/s
        for start in starts:
            batch = segments[start : start + batch_size]
            model(input_ids=batch.to(input_device), **forward_kwargs)
            bar.update(batch.numel())
        bar.close()
    return observer


class _GateAccumulator:
    """Pass 1: running sums of g per unit and of (A_t^T q_t)^2 per key row, per linear layer."""

    def __init__(self, with_row_impact: bool = True) -> None:
        self.with_row_impact = with_row_impact
        self.g_sum: dict[int, torch.Tensor] = {}
        self.omega_sum: dict[int, torch.Tensor] = {}
        self.tokens: dict[int, int] = {}
        self.dims: tuple[int, int, int] | None = None  # (H, K, V)

    def __call__(self, capture: RecurrenceCapture) -> None:
        i = capture.index
        num_heads, key_dim, value_dim = capture.v.shape[2], capture.q.shape[3], capture.v.shape[3]
        self.dims = (num_heads, key_dim, value_dim)
        g_sum = capture.g.to(torch.float64).sum(dim=(0, 1))  # [H] (GDN) or [H, K] (KDA)
        self.g_sum[i] = self.g_sum.get(i, 0) + g_sum
        self.tokens[i] = self.tokens.get(i, 0) + capture.batch * capture.length
        if not self.with_row_impact:
            return
        omega_sum = torch.zeros(num_heads, key_dim, dtype=torch.float64, device=capture.v.device)
        for start in range(0, capture.length, _ROW_IMPACT_CHUNK):
            part = slice(start, start + _ROW_IMPACT_CHUNK)
            b_q, b_k = prepare_qk(
                capture.q[:, part],
                capture.k[:, part],
                use_qk_l2norm=capture.use_qk_l2norm,
                mode=capture.family,
            )
            impact = transition_readout_weights(
                b_q, b_k, capture.g[:, part], capture.beta[:, part]
            )  # [B, t, H, K]
            omega_sum += impact.to(torch.float64).pow(2).sum(dim=(0, 1))
        self.omega_sum[i] = self.omega_sum.get(i, 0) + omega_sum.cpu()

    def mean_log_retention(self, num_layers: int) -> torch.Tensor:
        return torch.stack([self.g_sum[i].cpu() / self.tokens[i] for i in range(num_layers)])

    def omega(self, num_layers: int) -> torch.Tensor:
        return torch.stack([self.omega_sum[i] / self.tokens[i] for i in range(num_layers)])


class _DistortionAccumulator:
    """Pass 2: replay with snapshots; running sums of d_u(b) under both quantizers and of the unit energy."""

    def __init__(self, w: torch.Tensor, snapshot_every: int, replay_device: str, tolerance: float,
                 quantizer: DualAxisConfig) -> None:
        self.w = w  # [L, H, K]
        self.quantizer = quantizer
        self.snapshot_every = snapshot_every
        self.replay_device = replay_device
        self.tolerance = tolerance
        self.sums: dict[tuple[str, int], torch.Tensor] = {}
        self.energy: dict[int, torch.Tensor] = {}
        self.snapshots: dict[int, int] = {}
        self.replay_error: dict[int, float] = {}

    def __call__(self, capture: RecurrenceCapture) -> None:
        i = capture.index
        replayed = replay(capture, snapshot_every=self.snapshot_every, device=self.replay_device)
        if capture.output is not None:
            error = replay_error(capture, replayed)
            self.replay_error[i] = max(self.replay_error.get(i, 0.0), error)
            if error > self.tolerance:
                warnings.warn(
                    f"layer {capture.layer}: the replayed FP32 recurrence differs from the model's own "
                    f"readouts by {error:.3g} (relative RMS, tolerance {self.tolerance:g}); the "
                    "statistics may not describe what the model computes",
                    RuntimeWarning,
                    stacklevel=2,
                )
        if replayed.snapshots is None:
            return
        x = replayed.snapshots.flatten(0, 1)  # [B*S, H, K, V]
        self.snapshots[i] = self.snapshots.get(i, 0) + x.shape[0]
        self.energy[i] = self.energy.get(i, 0) + self._unit_sum(x.to(torch.float64).pow(2), capture.family)
        w = self.w[i].to(x.device)
        for quantizer in QUANTIZERS:
            errors = []
            for bits in BIT_WIDTHS:
                codec = (DualAxisCodec(bits=bits, w=w, config=self.quantizer) if quantizer == "dual_axis"
                         else UniformCodec(bits=bits))
                diff = (codec.roundtrip(x) - x).to(torch.float64).pow(2)
                errors.append(self._unit_sum(diff, capture.family))
            key = (quantizer, i)
            self.sums[key] = self.sums.get(key, 0) + torch.stack(errors, dim=-1)  # [*unit, 7]

    @staticmethod
    def _unit_sum(values: torch.Tensor, family: str) -> torch.Tensor:
        """[N, H, K, V] -> summed over snapshots and the unit's values: [H] (GDN) or [H, K] (KDA), CPU."""
        per_row = values.sum(dim=(0, 3))  # [H, K]
        return (per_row.sum(dim=1) if family == "gdn" else per_row).cpu()

    def distortion(self, quantizer: str, num_layers: int) -> torch.Tensor:
        return torch.stack([self.sums[(quantizer, i)] / self.snapshots[i] for i in range(num_layers)])

    def state_energy(self, num_layers: int) -> torch.Tensor:
        return torch.stack([self.energy[i] / self.snapshots[i] for i in range(num_layers)])


def _model_description(model) -> dict:
    dtype = getattr(model, "dtype", None)
    device_map = getattr(model, "hf_device_map", None)
    devices = sorted({str(d) for d in device_map.values()}) if isinstance(device_map, dict) else None
    return {
        "dtype": str(dtype).replace("torch.", "") if dtype is not None else None,
        "device_map_devices": devices,
    }


def collect_stats(
    model,
    segments: torch.Tensor,
    config: StatsConfig = StatsConfig(),
    *,
    model_name: str = "",
    data: str = "",
    progress: bool = True,
) -> CalibrationStats:
    """Calibration statistics of ``model`` over ``segments`` [S, T] (module docstring: two streamed passes).

    model_name and data are recorded for the plan (e.g. "gdn", "calib").
    """
    if not isinstance(config, StatsConfig):
        raise TypeError(f"config must be a StatsConfig, got {type(config).__name__}")
    segments = _check_segments(segments)
    if config.snapshot_every > segments.shape[1]:
        raise ValueError(
            f"snapshot_every={config.snapshot_every} exceeds the segment length {segments.shape[1]}: "
            "no state would be snapshotted"
        )
    gates = _GateAccumulator()
    observer = run_segments(
        model,
        segments,
        gates,
        batch_size=config.batch_size,
        device=config.replay_device,
        progress=progress,
        desc="calibrate 1/2: gates, row impact",
    )
    num_layers = len(observer.linear_layers)
    num_heads, key_dim, value_dim = gates.dims
    omega = gates.omega(num_layers)  # [L, H, K]
    w = row_impact_factors(omega, config.exponent, config.omega_floor)
    distortion = _DistortionAccumulator(
        w, config.snapshot_every, config.replay_device, config.replay_tolerance, config.quantizer
    )
    run_segments(
        model,
        segments,
        distortion,
        batch_size=config.batch_size,
        device=config.replay_device,
        keep_output=True,
        progress=progress,
        desc="calibrate 2/2: replay, distortion",
    )
    settings = {
        "data": str(data),
        "num_segments": int(segments.shape[0]),
        "segment_length": int(segments.shape[1]),
        "snapshot_every": config.snapshot_every,
        "batch_size": config.batch_size,
        "quantizer": quantizer_to_json(config.quantizer),
        "stepquant_version": stepquant.__version__,
        **_model_description(model),
    }
    return CalibrationStats(
        model_name=str(model_name),
        model_type=observer.model_type,
        family=observer.family,
        linear_layers=observer.linear_layers,
        num_heads=num_heads,
        key_dim=key_dim,
        value_dim=value_dim,
        mean_log_retention=gates.mean_log_retention(num_layers),
        omega=omega,
        w=w,
        distortion_dual_axis=distortion.distortion("dual_axis", num_layers),
        distortion_absmax=distortion.distortion("absmax", num_layers),
        state_energy=distortion.state_energy(num_layers),
        replay_error=torch.tensor(
            [distortion.replay_error.get(i, math.nan) for i in range(num_layers)], dtype=torch.float64
        ),
        tokens=gates.tokens[0],
        snapshots=distortion.snapshots.get(0, 0),
        exponent=config.exponent,
        omega_floor=config.omega_floor,
        settings=settings,
        run_id=uuid.uuid4().hex,
    )


def unit_half_lives(
    model,
    segments: torch.Tensor,
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    device: str = "cpu",
    progress: bool = True,
) -> list[torch.Tensor]:
    """Per-unit gate half-lives tau_u = ln 2 / (-E[g]) (tokens) of ``model`` over ``segments`` [S, T].

    One forward pass; returns one float64 tensor per linear-attention layer, in layer order: [H] for GDN
    heads, [H, K] for KDA key rows. ``half_life_census`` counts those above 64 / 256 / 1024 tokens.
    """
    gates = _GateAccumulator(with_row_impact=False)
    observer = run_segments(
        model,
        segments,
        gates,
        batch_size=batch_size,
        device=device,
        progress=progress,
        desc="gate half-lives",
    )
    retention = gates.mean_log_retention(len(observer.linear_layers))
    return list(half_lives_from_log_retention(retention))

"""Quantization plans: what calibration decides, as a validated, tamper-evident directory.

A plan directory holds
  plan.json          human-readable and versioned: model type and shape, variant, budget, pivots,
                     per-layer bits (GDN: a list of H widths per layer; KDA: per head one string of K
                     characters, '2'..'8' or 'P' for an FP16 pivot row), summary statistics, the
                     achieved bits/value (analytical and serving), calibration settings and the command
                     that made it, and an "integrity" block;
  (plan.json also pins the quantizer: the DualAxisConfig the codec of every layer runs, so a plan
  keeps quantizing the same way when the library's defaults change. Format version 2 always writes
  it; version-1 plans may lack it and then load with :data:`~stepquant.calibrate.quantizer.V1_QUANTIZER`,
  the defaults they were calibrated with. studies/migrate_plans.py rewrote the committed plans;
  studies/requantize_plans.py gave the STEPQuant ones the CUDA kernel's quantizer, calibration "requantized".)
  plan.safetensors   the arrays: bits [L, H, K] int8, w [L, H, K], half-lives, lifetime weights lambda,
                     the d(b) table of the variant's quantizer, omega, mean log retention;
  half_life_vs_bits.png  (written by the CLI) half-life against allocated bits.

Integrity: plan.json stores the sha256 of the plan.safetensors bytes, of the canonical bits content
(its "bits" block as compact sorted JSON) and of the whole canonical document without the integrity
block. :meth:`Plan.load` recomputes all three and refuses a truncated or edited file, naming which
file changed; it also refuses a plan whose JSON bits disagree with its arrays, and, given a model
config, a plan made for another model type or shape (naming the mismatch). A plan made from statistics
with a run id records it (calibration "stats_run_id", optional); :meth:`Plan.load` refuses a plan whose
directory sits beside a stats.safetensors of another run (a --out directory that mixes two
calibrations). :meth:`Plan.save` writes the directory atomically (calibrate/files.py).

The API the cache / evaluation code uses:

    plan = Plan.load("plans/gdn/stepquant-6", model_config=model.config)
    plan.family, plan.linear_layers, plan.bits[i], plan.w[i], plan.variant, plan.budget_bits
    layer = plan.layer_format(i)           # LayerFormat of linear layer number i: codec, layout, bytes
    codec = plan.codec(i)                  # its MixedCodec, layer.codec()
    plan.bits_per_value(serving=True)
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import save

import stepquant
from stepquant.accounting import PIVOT_REPLACES_BITS, SCALE_BITS, StateBytes, as_layer_formats, plan_bytes
from stepquant.codecs import LayerFormat, MixedCodec
from stepquant.codecs.base import MAX_BITS, MIN_BITS, PIVOT_BITS
from stepquant.codecs.dual_axis import DualAxisConfig
from stepquant.families import ModelShape, family_for, shape_from_config

from .allocate import VARIANTS, Allocation, get_variant
from .files import canonical, sha256, write_directory, write_file
from .quantizer import quantizer_from_json, quantizer_to_json
from .stats import BIT_WIDTHS, STATS_FILE, CalibrationStats, ModelFields, half_life_census, stats_run_id

PLAN_FORMAT = "stepquant-plan"
PLAN_FORMAT_VERSION = 2  # 2: the quantizer block is always written; 1: it may be absent (V1_QUANTIZER)
READABLE_VERSIONS = (1, 2)
ARRAYS_FORMAT_VERSION = 1  # plan.safetensors' layout, unchanged since version 1
PLAN_JSON = "plan.json"
PLAN_ARRAYS = "plan.safetensors"
PLAN_PLOT = "half_life_vs_bits.png"
PIVOT_CHAR = "P"
_ARRAY_NAMES = ("bits", "w", "half_lives", "lifetime", "distortion", "omega", "mean_log_retention")


def _pretty(obj, indent: int = 0, width: int = 100) -> str:
    """Readable JSON: a value whose compact form fits ``width`` stays on one line, else one item a line."""
    compact = json.dumps(obj, separators=(", ", ": "))
    if not isinstance(obj, (dict, list)) or len(compact) + indent <= width:
        return compact
    pad, inner = " " * indent, " " * (indent + 1)
    if isinstance(obj, dict):
        items = [
            f"{inner}{json.dumps(key)}: {_pretty(value, indent + 1, width)}" for key, value in obj.items()
        ]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    items = [inner + _pretty(value, indent + 1, width) for value in obj]
    return "[\n" + ",\n".join(items) + "\n" + pad + "]"


# ---------------------------------------------------------------- model configs


def model_shape(model_config) -> ModelShape:
    """The ModelShape (model_type, family, linear-attention layer indices, heads, K, V) of a transformers
    config (object or dict), a config.json path, a checkpoint directory or a shipped model name ("gdn");
    a ModelShape is returned as it is."""
    if isinstance(model_config, ModelShape):
        return model_config
    if isinstance(model_config, (str, Path)):
        from stepquant.models import resolve

        path = Path(model_config)
        model_config = path if path.is_file() else resolve(model_config)
    elif not (isinstance(model_config, Mapping) or hasattr(model_config, "to_dict")):
        raise TypeError(
            "model_config must be a transformers config, a dict, a config.json path, a checkpoint "
            f"directory or a shipped model name, got {type(model_config).__name__}"
        )
    return shape_from_config(model_config)


# ---------------------------------------------------------------- bits <-> JSON


def _bits_to_json(bits: tuple[torch.Tensor, ...], layers: tuple[int, ...], family: str) -> dict:
    out = {}
    for layer, layer_bits in zip(layers, bits, strict=True):
        if family == "gdn":
            out[str(layer)] = [int(b) for b in layer_bits[:, 0].tolist()]
        else:
            out[str(layer)] = [
                "".join(PIVOT_CHAR if b == PIVOT_BITS else str(b) for b in row) for row in layer_bits.tolist()
            ]
    return out


def _bits_from_json(
    block, layers: tuple[int, ...], family: str, num_heads: int, key_dim: int
) -> list[torch.Tensor]:
    if not isinstance(block, Mapping) or sorted(block, key=int) != [str(i) for i in layers]:
        raise ValueError(f"plan.json 'bits' must have one entry per linear layer {list(layers)}")
    result = []
    for layer in layers:
        entry = block[str(layer)]
        if not isinstance(entry, list) or len(entry) != num_heads:
            raise ValueError(f"plan.json bits of layer {layer} must list {num_heads} heads")
        if family == "gdn":
            rows = [[int(b)] * key_dim for b in entry]
        else:
            if not all(isinstance(s, str) and len(s) == key_dim for s in entry):
                raise ValueError(
                    f"plan.json bits of layer {layer} must be {num_heads} strings of {key_dim} "
                    f"characters ('{MIN_BITS}'..'{MAX_BITS}' or '{PIVOT_CHAR}')"
                )
            rows = [[PIVOT_BITS if ch == PIVOT_CHAR else int(ch) for ch in s] for s in entry]
        result.append(torch.tensor(rows, dtype=torch.int64))  # validated once, by the plan's LayerFormat
    return result


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True, eq=False)
class Plan(ModelFields):
    """A calibrated quantization plan (module docstring); :func:`build_plan` makes one, :meth:`load` reads it.

    bits: one int8 [H, K] tensor per linear-attention layer (2..8, 16 = FP16 pivot row; a GDN head's rows
    share one width); w: one FP32 [H, K] row-impact tensor per layer. Unit arrays are [L, H] (GDN) or
    [L, H, K] (KDA): half_lives (tokens), lifetime (lambda at ``horizon``), distortion [*unit, 7]
    (d(b), b = 2..8, of the variant's quantizer); omega and mean_log_retention as calibrated.
    """

    variant: str
    budget_bits: int
    pivots: int
    candidates: tuple[int, ...]
    horizon: int
    bits: tuple[torch.Tensor, ...]
    w: tuple[torch.Tensor, ...]
    half_lives: torch.Tensor
    lifetime: torch.Tensor
    distortion: torch.Tensor
    omega: torch.Tensor
    mean_log_retention: torch.Tensor
    calibration: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)
    quantizer: DualAxisConfig = field(default_factory=DualAxisConfig)
    formats: tuple[LayerFormat, ...] = field(init=False, repr=False)  # one per layer, from bits and w

    def __post_init__(self) -> None:
        get_variant(self.variant)
        if not isinstance(self.quantizer, DualAxisConfig):
            raise TypeError(f"quantizer must be a DualAxisConfig, got {type(self.quantizer).__name__}")
        self._check_model_fields()
        object.__setattr__(self, "candidates", tuple(int(b) for b in self.candidates))
        num_layers = len(self.linear_layers)
        if len(self.bits) != num_layers or len(self.w) != num_layers:
            raise ValueError(
                f"bits and w must have one [H, K] tensor per linear layer ({num_layers}), "
                f"got {len(self.bits)} and {len(self.w)}"
            )
        formats = []
        for i, (layer_bits, layer_w) in enumerate(zip(self.bits, self.w, strict=True)):
            try:  # the one validation of the layer's bits and w
                layer = LayerFormat(torch.as_tensor(layer_bits), torch.as_tensor(layer_w), self.spatial,
                                    self.quantizer)
            except (TypeError, ValueError) as err:
                raise type(err)(f"layer {i} (bits[{i}], w[{i}]): {err}") from err
            if (layer.num_heads, layer.key_dim) != (self.num_heads, self.key_dim):
                raise ValueError(
                    f"bits[{i}] must be [H, K] = {[self.num_heads, self.key_dim]}, "
                    f"got {list(layer.bits.shape)}"
                )
            if self.family == "gdn" and not bool((layer.bits == layer.bits[:, :1]).all()):
                raise ValueError(f"bits[{i}]: every key row of a GDN head must have the head's width")
            formats.append(layer)
        object.__setattr__(self, "formats", tuple(formats))
        object.__setattr__(self, "bits", tuple(f.bits for f in formats))
        object.__setattr__(self, "w", tuple(f.w for f in formats))
        found = int(sum(int((b == PIVOT_BITS).sum()) for b in self.bits)) // (
            self.key_dim if self.family == "gdn" else 1
        )
        if found != self.pivots:
            raise ValueError(f"pivots={self.pivots} but the bits mark {found} FP16 pivot units")
        unit = self.unit_shape
        for name, shape in (
            ("half_lives", unit),
            ("lifetime", unit),
            ("distortion", (*unit, len(BIT_WIDTHS))),
            ("omega", (num_layers, self.num_heads, self.key_dim)),
            ("mean_log_retention", unit),
        ):
            value = torch.as_tensor(getattr(self, name))
            if tuple(value.shape) != tuple(shape):
                raise ValueError(f"{name} must have shape {list(shape)}, got {list(value.shape)}")
            object.__setattr__(self, name, value.detach().to("cpu", torch.float64))

    # ------------------------------------------------------------ views

    @property
    def spatial(self) -> str:
        """The stored format: "dual_axis" (row + column scales, w) or "absmax" (row scales only)."""
        return VARIANTS[self.variant].spatial

    @property
    def has_col_scale(self) -> bool:
        return VARIANTS[self.variant].has_col_scale

    @property
    def unit_bits(self) -> torch.Tensor:
        """Bits per unit, int8 [L, H] (GDN) or [L, H, K] (KDA); 16 = FP16 pivot."""
        stacked = torch.stack(self.bits)  # [L, H, K]
        return stacked[:, :, 0] if self.family == "gdn" else stacked

    def layer_number(self, model_layer: int) -> int:
        """The linear-layer number i (index into bits / w / codec) of a model layer index."""
        if model_layer not in self.linear_layers:
            raise ValueError(
                f"model layer {model_layer} is not a linear-attention layer of this plan "
                f"({list(self.linear_layers)})"
            )
        return self.linear_layers.index(model_layer)

    def layer_format(self, i: int) -> LayerFormat:
        """The LayerFormat of linear layer number i (0-based among linear layers): bits, w, the plan's
        spatial quantizer and its quantizer config."""
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(self.linear_layers):
            raise ValueError(
                f"i must be a linear-layer number in 0..{len(self.linear_layers) - 1}, got {i!r} "
                "(map a model layer index with plan.layer_number)"
            )
        return self.formats[i]

    def layer_formats(self) -> list[LayerFormat]:
        """The LayerFormat of every linear layer, in order (what a PackedStatePool is built from)."""
        return list(self.formats)

    def codec(self, i: int) -> MixedCodec:
        """The MixedCodec of linear layer number i: ``layer_format(i).codec()`` (dual-axis + w or absmax)."""
        return self.layer_format(i).codec()

    def state_bytes(self) -> StateBytes:
        """Bytes per request of this plan: its LayerFormats' bytes (serving and analytical count)."""
        return plan_bytes(self.layer_formats(), self.shape, label=f"{self.variant}@{self.budget_bits}")

    def bits_per_value(self, serving: bool = True) -> float:
        return self.state_bytes().bits_per_value(serving=serving)

    def accounting(self) -> dict:
        """Budget and bytes: the LayerFormats' bytes against the nominal budget, with the slack."""
        return plan_accounting(self.layer_formats(), self.shape, self.budget_bits, self.pivots)

    # ------------------------------------------------------------ files

    def _document(self) -> dict:
        return {
            "format": PLAN_FORMAT,
            "format_version": PLAN_FORMAT_VERSION,
            "stepquant_version": stepquant.__version__,
            "model": {
                "name": self.model_name,
                "model_type": self.model_type,
                "family": self.family,
                "linear_layers": list(self.linear_layers),
                "num_heads": self.num_heads,
                "key_dim": self.key_dim,
                "value_dim": self.value_dim,
                "unit": "head" if self.family == "gdn" else "key row",
                "num_units": self.num_units,
            },
            "variant": self.variant,
            "spatial": self.spatial,
            "budget_bits": self.budget_bits,
            "pivots": self.pivots,
            "candidates": list(self.candidates),
            "horizon": self.horizon,
            "quantizer": quantizer_to_json(self.quantizer),
            "bits_format": (
                "per layer: bits of each head, 16 = FP16 pivot head"
                if self.family == "gdn"
                else f"per layer: one string per head, the width of each key row ('{MIN_BITS}'..'{MAX_BITS}',"
                f" '{PIVOT_CHAR}' = FP16 pivot row)"
            ),
            "bits": _bits_to_json(self.bits, self.linear_layers, self.family),
            "accounting": self.accounting(),
            "summary": self.summary,
            "calibration": self.calibration,
        }

    def save(self, directory: str | Path) -> Path:
        """Write ``directory`` holding plan.json and plan.safetensors, atomically: an existing directory is
        replaced as a whole, an interrupted save leaves the old one (calibrate/files.py)."""
        arrays = {
            "bits": torch.stack(self.bits).contiguous(),
            "w": torch.stack(self.w).contiguous(),
            # records for study, not used to quantize: FP32 keeps the file small (loading widens to FP64)
            **{name: getattr(self, name).to(torch.float32).contiguous() for name in _ARRAY_NAMES[2:]},
        }
        blob = save(arrays, metadata={"format": PLAN_FORMAT, "format_version": str(ARRAYS_FORMAT_VERSION)})

        def fill(temporary: Path) -> None:
            (temporary / PLAN_ARRAYS).write_bytes(blob)
            self.write_json(temporary, blob)

        return write_directory(directory, fill)

    def write_json(self, directory: str | Path, arrays_blob: bytes) -> Path:
        """Write plan.json (current format version) for the plan.safetensors bytes ``arrays_blob``, with
        the integrity block; studies/migrate_plans.py uses it to rewrite a plan.json alone."""
        document = self._document()
        document["integrity"] = {
            f"{PLAN_ARRAYS}_sha256": sha256(arrays_blob),
            "bits_sha256": sha256(canonical(document["bits"])),
            "plan_sha256": sha256(canonical(document)),
        }
        return write_file(Path(directory) / PLAN_JSON, (_pretty(document) + "\n").encode())

    @classmethod
    def load(cls, path: str | Path, model_config=None) -> Plan:
        """Read and verify a plan directory (or its plan.json); with ``model_config`` check it fits the model.

        model_config: a transformers config (or dict), a config.json path, a checkpoint directory or a shipped
        model name. Raises ValueError naming what is wrong: a truncated or edited file, or a model mismatch.
        """
        path = Path(path)
        directory = path.parent if path.name == PLAN_JSON else path
        json_path, arrays_path = directory / PLAN_JSON, directory / PLAN_ARRAYS
        for p in (json_path, arrays_path):
            if not p.is_file():
                raise FileNotFoundError(
                    f"{p} does not exist: a plan directory holds {PLAN_JSON} and {PLAN_ARRAYS} "
                    "(made by stepquant calibrate)"
                )
        try:
            document = json.loads(json_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{json_path} is truncated or not valid JSON ({err}); recalibrate") from err
        if not isinstance(document, dict) or document.get("format") != PLAN_FORMAT:
            raise ValueError(f"{json_path} is not a stepquant plan (format {PLAN_FORMAT!r} missing)")
        version = document.get("format_version")
        if version not in READABLE_VERSIONS:
            raise ValueError(
                f"{json_path} has plan format version {version!r}; this stepquant reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}; recalibrate"
            )
        if version >= 2 and "quantizer" not in document:
            raise ValueError(f"{json_path}: a version-{version} plan must have a quantizer block; "
                             "recalibrate")
        redo = _recalibrate_hint(document)
        integrity = document.pop("integrity", None)
        if not isinstance(integrity, dict):
            raise ValueError(
                f"{json_path} has no integrity block; it was edited or not written by stepquant{redo}"
            )
        blob = arrays_path.read_bytes()
        if sha256(blob) != integrity.get(f"{PLAN_ARRAYS}_sha256"):
            raise ValueError(
                f"{arrays_path} changed since calibration (its sha256 does not match plan.json: "
                f"truncated, edited or from another plan){redo}"
            )
        if sha256(canonical(document.get("bits"))) != integrity.get("bits_sha256"):
            raise ValueError(f"the bits in {json_path} were edited (their sha256 does not match){redo}")
        if sha256(canonical(document)) != integrity.get("plan_sha256"):
            raise ValueError(f"{json_path} was edited since calibration (its sha256 does not match){redo}")
        arrays = load_safetensors_bytes(blob)
        missing = [name for name in _ARRAY_NAMES if name not in arrays]
        if missing:
            raise ValueError(f"{arrays_path} lacks arrays {missing}{redo}")
        model = document["model"]
        layers = tuple(model["linear_layers"])
        json_bits = _bits_from_json(
            document["bits"], layers, model["family"], model["num_heads"], model["key_dim"]
        )
        if not torch.equal(torch.stack(json_bits), arrays["bits"].to(torch.int64)):
            raise ValueError(f"the bits of {json_path} and {arrays_path} disagree{redo}")
        plan = cls(
            model_name=model["name"],
            model_type=model["model_type"],
            family=model["family"],
            linear_layers=layers,
            num_heads=model["num_heads"],
            key_dim=model["key_dim"],
            value_dim=model["value_dim"],
            variant=document["variant"],
            budget_bits=document["budget_bits"],
            pivots=document["pivots"],
            candidates=tuple(document["candidates"]),
            horizon=document["horizon"],
            bits=tuple(json_bits),
            w=tuple(arrays["w"]),
            half_lives=arrays["half_lives"],
            lifetime=arrays["lifetime"],
            distortion=arrays["distortion"],
            omega=arrays["omega"],
            mean_log_retention=arrays["mean_log_retention"],
            calibration=document.get("calibration", {}),
            summary=document.get("summary", {}),
            quantizer=quantizer_from_json(document.get("quantizer"), json_path),
        )
        _check_run_id(plan, directory)
        if model_config is not None:
            plan.check_model(model_config)
        return plan

    def check_model(self, model_config) -> None:
        """Raise ValueError naming the model the plan was calibrated for and the first difference between
        it and a model config (or a ModelShape: a preset without model_type and layer indices is compared
        by family, layer count, heads, K and V)."""
        model = model_shape(model_config)
        mismatch = (f"the plan was calibrated for {self.model_name or self.model_type!r} ({self.model_type}, "
                    f"{len(self.linear_layers)} {self.family.upper()} layers x {self.num_heads} heads of "
                    f"{self.key_dim}x{self.value_dim}), not for {model.name!r}:")
        redo = "; give a plan calibrated for this model (stepquant calibrate --model MODEL --out NEW_DIR)"
        plan_type = family_for(self.model_type).text_type(self.model_type)
        model_type = model.model_type or model.name
        if model.family.name != self.family or (
            model.model_type and plan_type != model.family.text_type(model.model_type)
        ):
            raise ValueError(f"{mismatch} model_type {self.model_type!r} ({self.family.upper()}) in the "
                             f"plan, {model_type!r} ({model.family.name.upper()}) in the model{redo}")
        layers = ((tuple(self.linear_layers), model.layer_indices) if model.layer_indices
                  else (len(self.linear_layers), model.linear_layers))  # a preset knows only the count
        checks = (
            ("linear-attention layers", *layers),
            ("heads per layer", self.num_heads, model.heads),
            ("key dim K", self.key_dim, model.key_dim),
            ("value dim V", self.value_dim, model.value_dim),
        )
        for what, planned, actual in checks:
            if planned != actual:
                planned_text = list(planned) if isinstance(planned, tuple) else planned
                actual_text = list(actual) if isinstance(actual, tuple) else actual
                raise ValueError(f"{mismatch} {what} {planned_text} in the plan, {actual_text} in the "
                                 f"model{redo}")


def _recalibrate_hint(document: dict) -> str:
    """The command that made the plan, into a new --out directory (calibrate refuses to overwrite), and
    the quantizer rewrite a plan records after it (calibration "requantized", studies/requantize_plans.py)."""
    calibration = document.get("calibration") or {}
    command = calibration.get("command")
    if not command:
        return "; recalibrate (stepquant calibrate)"
    parts = shlex.split(command)
    if "--out" in parts[:-1]:
        parts[parts.index("--out") + 1] = "NEW_DIR"
    hint = f"; recalibrate with: {shlex.join(parts)} (NEW_DIR: a directory of your choice)"
    rewrite = (calibration.get("requantized") or {}).get("command")
    if rewrite:
        parts = shlex.split(rewrite)
        parts[-1] = f"NEW_DIR/{document.get('variant')}-{document.get('budget_bits')}"
        hint += f", then: {shlex.join(parts)} (the same bits with another quantizer)"
    return hint


def _check_run_id(plan: Plan, directory: Path) -> None:
    """ValueError if the plan and the stats.safetensors beside it (the layout of `stepquant calibrate
    --out DIR`) record different calibration runs: the directory mixes two calibrations."""
    stats_path = directory.parent / STATS_FILE
    planned = plan.calibration.get("stats_run_id")
    if not planned or not stats_path.is_file():
        return
    found = stats_run_id(stats_path)
    if found and found != planned:
        raise ValueError(
            f"{directory} was made from the statistics of calibration run {planned}, but {stats_path} is "
            f"from run {found}: the directory mixes two calibrations (a rerun into the same --out that "
            f"stopped early?); remake the plan from these statistics: stepquant calibrate --stats "
            f"{shlex.quote(str(directory.parent))} --variant {plan.variant} --bits {plan.budget_bits} "
            f"--out {shlex.quote(str(directory.parent))} --force"
        )


# ---------------------------------------------------------------- accounting


def plan_accounting(layers, shape: ModelShape, budget_bits: int, pivots: int,
                    has_col_scale: bool = True) -> dict:
    """Budget vs achieved bits of a plan: its LayerFormats' bytes against the nominal formulas.

    layers: the plan's LayerFormats, or its bit tables with has_col_scale (accounting.as_layer_formats).
    code_bits_budget = b̄ N - 8 N_piv (N_piv in values); code_bits_used: the integer codes; slack = the
    difference. nominal_*_bytes: the format at exactly the budget (codes b̄ N - 8 N_piv, FP16 pivots, FP16
    scales: every head analytically, serving without heads that are all pivots); *_bytes: the plan's
    packed layout (``LayerFormat.bytes``). With V a multiple of 32 (rows word-aligned) bytes = nominal -
    slack / 8.
    """
    formats = as_layer_formats(layers, shape, has_col_scale)
    stacked = torch.stack([f.bits.to(torch.int64) for f in formats])  # [L, H, K]
    is_pivot = stacked == PIVOT_BITS
    code_bits_used = int(stacked[~is_pivot].sum()) * shape.value_dim
    pivot_values = int(is_pivot.sum()) * shape.value_dim
    code_bits_budget = budget_bits * shape.values - PIVOT_REPLACES_BITS * pivot_values
    # FP16 scale bits of one head of each layer: K row scales, plus V column scales
    scales = [SCALE_BITS * (shape.key_dim + (shape.value_dim if f.has_col_scale else 0)) for f in formats]
    all_pivot_heads = is_pivot.all(dim=2).sum(dim=1).tolist()  # [L]
    nominal_analytical = code_bits_budget + PIVOT_BITS * pivot_values + shape.heads * sum(scales)
    nominal_serving = nominal_analytical - sum(n * b for n, b in zip(all_pivot_heads, scales, strict=True))
    actual = plan_bytes(formats, shape)
    slack = code_bits_budget - code_bits_used
    return {
        "budget_bits": budget_bits,
        "pivot_units": pivots,
        "code_bits_budget": code_bits_budget,
        "code_bits_used": code_bits_used,
        "slack_bits": slack,
        "within_budget": slack >= 0,
        "nominal_analytical_bytes": nominal_analytical // 8,
        "nominal_serving_bytes": nominal_serving // 8,
        "analytical_bytes": actual.analytical_bytes,
        "serving_bytes": actual.serving_bytes,
        "bits_per_value": actual.bits_per_value(),
        "serving_bits_per_value": actual.bits_per_value(serving=True),
        "fp32_bytes": shape.fp32_bytes,
        "ratio_vs_fp32": actual.ratio_vs_fp32(),
        "serving_ratio_vs_fp32": actual.ratio_vs_fp32(serving=True),
    }


# ---------------------------------------------------------------- building


def _unit_name(index: tuple[int, ...], layers: tuple[int, ...]) -> dict:
    entry = {"layer": layers[index[0]], "head": index[1]}
    if len(index) == 3:
        entry["row"] = index[2]
    return entry


def _finite_quantiles(values: torch.Tensor, qs=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)) -> dict:
    flat = values.reshape(-1).to(torch.float64)
    finite = flat[torch.isfinite(flat)]
    names = {0.0: "min", 1.0: "max"}
    out = {
        names.get(q, f"p{round(q * 100)}"): (
            round(float(torch.quantile(finite, q)), 4) if finite.numel() else None
        )
        for q in qs
    }
    out["infinite"] = int((~torch.isfinite(flat)).sum())
    return out


def plan_summary(stats: CalibrationStats, allocation: Allocation, top: int = 10) -> dict:
    """The summary block of plan.json: histogram, half-life quantiles and census, omega spread, pivots,
    the longest-lived units, mean bits per half-life quartile, and the objective vs uniform b̄."""
    unit_bits = allocation.unit_bits.to(torch.int64)
    half_lives = stats.half_lives
    flat_bits, flat_tau = unit_bits.reshape(-1), half_lives.reshape(-1)
    histogram = {
        str(b): int((flat_bits == b).sum()) for b in range(MIN_BITS, MAX_BITS + 1) if (flat_bits == b).any()
    }
    histogram["fp16"] = int((flat_bits == PIVOT_BITS).sum())
    unit_shape = tuple(unit_bits.shape)

    def unravel(flat_index: int) -> tuple[int, ...]:
        return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat_index), unit_shape))

    pivots = []
    for index in torch.nonzero(flat_bits == PIVOT_BITS).flatten().tolist():
        pivots.append(
            {
                **_unit_name(unravel(index), stats.linear_layers),
                "half_life": round(float(flat_tau[index]), 2),
                "risk": float(allocation.risk.reshape(-1)[index]),
            }
        )
    order = torch.argsort(torch.nan_to_num(flat_tau, posinf=math.inf), descending=True, stable=True)[:top]
    longest = [
        {
            **_unit_name(unravel(int(i)), stats.linear_layers),
            "half_life": round(float(flat_tau[i]), 2),
            "bits": int(flat_bits[i]),
        }
        for i in order
    ]
    integer = flat_bits != PIVOT_BITS
    quartiles = torch.quantile(
        flat_tau[torch.isfinite(flat_tau)], torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)
    )
    bins = torch.bucketize(flat_tau, quartiles)
    mean_bits = {}
    for q, label in enumerate(("shortest quarter", "second", "third", "longest quarter")):
        mask = (bins == q) & integer
        mean_bits[label] = round(float(flat_bits[mask].double().mean()), 4) if mask.any() else None
    omega = stats.omega
    spread = omega.amax(dim=-1) / omega.amin(dim=-1).clamp_min(1e-300)  # [L, H]
    ratio = allocation.objective / allocation.uniform_objective if allocation.uniform_objective > 0 else None
    return {
        "unit": "head" if stats.family == "gdn" else "key row",
        "num_units": stats.num_units,
        "bits_histogram": histogram,
        "pivot_units": pivots,
        "half_life_tokens": _finite_quantiles(half_lives),
        "half_life_above": {str(k): v for k, v in half_life_census(half_lives).items()},
        "mean_bits_by_half_life_quartile": mean_bits,
        "longest_lived": longest,
        "omega_max_over_min_per_head": {"median": float(spread.median()), "max": float(spread.max())},
        "w_range": [float(stats.w.min()), float(stats.w.max())],
        "lifetime_weighted_distortion": {
            "plan": allocation.objective,
            f"uniform_{allocation.budget_bits}_bits": allocation.uniform_objective,
            "ratio": ratio,
        },
        "replay_error_max": float(stats.replay_error.max()),
    }


def build_plan(stats: CalibrationStats, allocation: Allocation, *, command: str = "",
               quantizer: DualAxisConfig | None = None) -> Plan:
    """A Plan from statistics and an allocation made from them (command: how it was made, for the record).

    quantizer: the DualAxisConfig the plan's codecs run (default: the one the statistics' distortion table
    was measured with, ``stats.quantizer``); a dual-axis variant refuses any other, an absmax variant
    (temporal) only records it.
    """
    if not isinstance(stats, CalibrationStats) or not isinstance(allocation, Allocation):
        raise TypeError("build_plan needs a CalibrationStats and an Allocation")
    quantizer = stats.quantizer if quantizer is None else quantizer
    if allocation.variant.spatial == "dual_axis" and quantizer != stats.quantizer:
        raise ValueError(
            f"the plan's quantizer {quantizer} differs from the one the statistics' distortion table was "
            f"measured with ({stats.quantizer}); the allocation would optimise for another quantizer: "
            "collect statistics with the plan's quantizer (stepquant calibrate --model ... --grid ...)"
        )
    if tuple(allocation.unit_bits.shape) != stats.unit_shape:
        raise ValueError(
            f"the allocation is over units {list(allocation.unit_bits.shape)}, the statistics over "
            f"{list(stats.unit_shape)}"
        )
    unit_bits = allocation.unit_bits
    if stats.family == "gdn":
        unit_bits = unit_bits[:, :, None].expand(-1, -1, stats.key_dim)
    calibration = {
        **stats.settings,
        "tokens_per_layer": stats.tokens,
        "snapshots_per_head": stats.snapshots,
        "exponent": stats.exponent,
        "omega_floor": stats.omega_floor,
        "replay_error_per_layer": [float(e) for e in stats.replay_error],
        "command": command,
        **({"stats_run_id": stats.run_id} if stats.run_id else {}),
    }
    return Plan(
        model_name=stats.model_name,
        model_type=stats.model_type,
        family=stats.family,
        linear_layers=stats.linear_layers,
        num_heads=stats.num_heads,
        key_dim=stats.key_dim,
        value_dim=stats.value_dim,
        variant=allocation.variant.name,
        budget_bits=allocation.budget_bits,
        pivots=allocation.pivots,
        candidates=allocation.candidates,
        horizon=allocation.horizon,
        bits=tuple(unit_bits.to(torch.int8).unbind(0)),
        w=tuple(stats.w.unbind(0)),
        half_lives=stats.half_lives,
        lifetime=allocation.lifetime,
        distortion=allocation.distortion,
        omega=stats.omega,
        mean_log_retention=stats.mean_log_retention,
        calibration=calibration,
        summary=plan_summary(stats, allocation),
        quantizer=quantizer,
    )


def load_plan(path: str | Path, model_config=None) -> Plan:
    """Plan.load (a function for callers that prefer one)."""
    return Plan.load(path, model_config)

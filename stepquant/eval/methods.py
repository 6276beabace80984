"""The state formats the evaluation compares ("methods"), resolved to per-layer codecs, with their bytes.

A method is named either by a codec of the registry (stepquant.codecs.make_codec: "fp32", "bf16", "fp16",
"int8", "int6", "int4", "int4-sr", "dsq4", "dual6", ...), used for every linear-attention layer, or by a
calibrated plan "<variant>-<bits>" with variant in stepquant, temporal, temporal-nopivot, spatial: the plan
committed under ``<plans-dir>/<model>/<variant>-<bits>/`` (stepquant.calibrate's ``Plan.load``), whose
``plan.codec(i)`` is the codec of linear layer i. ``--plan PATH`` adds any plan directory as a method.
"<method>@<layer>" (e.g. "int4@4", "stepquant-4@0") applies the method to that one model layer and keeps
FP32 everywhere else: per-layer error attribution. A "-ef<r>" suffix on a codec or a plan name
("int6-ef4", "stepquant-6-ef4") adds error feedback with an r-bit residual (stepquant.codecs.error_feedback;
the residual's bytes are in the method's bits/value); a "-defer<R>" suffix ("stepquant-6-defer4") fits every
R-th decode token only (stepquant.codecs.deferred; the pending updates' bytes are in its bits/value).

:data:`DEFAULT_METHODS` is the paper's comparison (docs/method.md section 3): the float casts, uniform rowwise
absmax INT8/6/4 with and without stochastic rounding, DSQ, and the four STEPQuant variants at 6 and 4 bits.
FP32 is the reference every excess NLL is measured against, so it is always evaluated (first).

Bytes per request come from the codecs' exact ``storage_bits`` summed over the linear-attention layers,
as stepquant.accounting counts them (serving count: pivot heads carry no scale slots; analytical: the
paper's count with scale slots for every head); a plan's layer is counted by its LayerFormat's packed
layout (the MixedCodec's storage_bits, which is ``LayerFormat.bytes``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from stepquant import assets
from stepquant.accounting import StateBytes
from stepquant.calibrate import Plan
from stepquant.codecs import (
    Codec,
    DeferredCodec,
    ErrorFeedbackCodec,
    codec_names,
    is_codec_name,
    make_codec,
    split_deferred,
    split_name,
)
from stepquant.families import ModelShape

REFERENCE = "fp32"
PLAN_VARIANTS = ("stepquant", "temporal", "temporal-nopivot", "spatial")
PLAN_NAME = re.compile(r"^(stepquant|temporal-nopivot|temporal|spatial)-([2-8])(-ef[0-9]+|-defer[0-9]+)?$")
DEFAULT_PLANS_DIR = assets.PLANS  # the shipped plans, stepquant/assets/plans/<model>/<variant>-<bits>/

DEFAULT_METHODS = (
    "fp32", "bf16", "fp16", "int8",
    "int6", "int6-sr", "dsq6", "spatial-6", "temporal-nopivot-6", "temporal-6", "stepquant-6",
    "int4", "int4-sr", "dsq4", "spatial-4", "temporal-nopivot-4", "temporal-4", "stepquant-4",
)

LABELS = {
    "fp32": "FP32 (reference)", "bf16": "BF16", "fp16": "FP16",
    "stepquant": "STEPQuant", "temporal": "temporal only", "temporal-nopivot": "temporal w/o pivots",
    "spatial": "spatial only",
}


@dataclass(frozen=True)
class Method:
    """One state format: its name, a readable label, and the codec of each linear-attention layer.

    name:   what the user typed ("int4", "stepquant-6", or a plan directory for --plan)
    label:  for tables ("INT4", "STEPQuant@6", ...)
    codecs: {model layer index: codec}
    plan:   the plan object for plan-based methods (None otherwise)
    """

    name: str
    label: str
    codecs: dict
    plan: object | None = None

    def state_bytes(self, shape: ModelShape) -> StateBytes:
        """Exact bytes one request's recurrent state takes in this format, all linear-attention layers."""
        dims = (shape.heads, shape.key_dim, shape.value_dim)
        codecs = [codec.for_shape(shape) for codec in self.codecs.values()]  # e.g. GDN's shared pending k_j
        serving = sum(codec.storage_bits(*dims) for codec in codecs)
        analytical = sum(codec.storage_bits(*dims, analytical=True) for codec in codecs)
        return StateBytes(self.label, -(-analytical // 8), -(-serving // 8), shape.values)


def codec_label(name: str) -> str:
    base, every = split_deferred(name.lower())
    if every is not None:
        return f"{codec_label(base)} fit/{every}"
    key, residual_bits = split_name(base)
    if residual_bits is not None:
        return f"{codec_label(key)} EF{residual_bits}"
    if key in LABELS:
        return LABELS[key]
    match = re.match(r"^(int|dsq|dual)([2-8])(-sr)?$", key)
    if match:
        family = {"int": "INT", "dsq": "DSQ", "dual": "dual-axis "}[match.group(1)]
        return f"{family}{match.group(2)}" + (" SR" if match.group(3) else "")
    return name


def plan_path(key: str, model_name: str, plans_dir: str | Path | None = None) -> Path:
    """Where plan "<variant>-<bits>" of a model lives: ``<plans-dir>/<key>`` when that exists (a directory
    `stepquant calibrate --out` wrote for one model), else ``<plans-dir>/<model>/<key>`` (the layout of the
    shipped plans)."""
    plans_dir = Path(DEFAULT_PLANS_DIR if plans_dir is None else plans_dir)
    direct = plans_dir / key
    return direct if direct.exists() else plans_dir / model_name / key


def is_plan_method(name: str) -> bool:
    return PLAN_NAME.match(name.strip().lower().partition("@")[0]) is not None


def plan_key(name: str) -> str:
    """The plan directory a plan method reads: "stepquant-6-ef4@2" -> "stepquant-6" (and "-defer4")."""
    return split_name(split_deferred(name.strip().lower().partition("@")[0])[0])[0]


def load_plan(path: str | Path, model_config=None):
    """A calibrated plan from its directory (stepquant.calibrate's ``Plan.load``), or a FileNotFoundError
    that says how to make one."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no calibrated plan at {path} (run `stepquant calibrate`, or pass "
                                "--plans-dir)")
    return Plan.load(path, model_config=model_config)


def plan_method(plan, name: str, linear_layers: list[int]) -> Method:
    """A Method from a loaded plan: codec(i) of linear layer i, labelled "<Variant>@<bits>"."""
    plan_layers = [int(i) for i in plan.linear_layers]
    if plan_layers != list(linear_layers):
        raise ValueError(f"plan {name!r} covers linear-attention layers {plan_layers}, the model has "
                         f"{list(linear_layers)}; was it calibrated for another model?")
    variant = getattr(plan, "variant", None)
    budget = getattr(plan, "budget_bits", None)
    label = f"{LABELS.get(variant, variant or name)}@{budget:g}" if budget is not None else name
    codecs = {layer: plan.codec(i) for i, layer in enumerate(linear_layers)}
    return Method(name, label, codecs, plan)


def resolve_method(name: str, model_name: str, linear_layers: list[int], *,
                   plans_dir: str | Path | None = None, model_config=None) -> Method:
    """A method name (a registry codec or "<variant>-<bits>") -> Method; clear errors for anything else."""
    if not isinstance(name, str) or not name.strip():
        raise TypeError(f"a method name must be a non-empty str, got {name!r}")
    key = name.strip().lower()
    if "@" in key:
        return _one_layer_method(key, model_name, linear_layers, plans_dir, model_config)
    match = PLAN_NAME.match(key)
    if match:
        plan = load_plan(plan_path(plan_key(key), model_name, plans_dir), model_config)
        method = plan_method(plan, key, linear_layers)
        residual_bits, every = split_name(key)[1], split_deferred(key)[1]
        if every is not None:
            codecs = {layer: DeferredCodec(codec, every) for layer, codec in method.codecs.items()}
            return Method(key, f"{method.label} fit/{every}", codecs, plan)
        if residual_bits is None:
            return method
        codecs = {layer: ErrorFeedbackCodec(codec, residual_bits) for layer, codec in method.codecs.items()}
        return Method(key, f"{method.label} EF{residual_bits}", codecs, plan)
    if not is_codec_name(key):
        variants = ", ".join(f"{v}-<bits>" for v in PLAN_VARIANTS)
        raise ValueError(f"unknown method {name!r}: use a codec name ({', '.join(codec_names()[:-1])}) or a "
                         f"calibrated plan ({variants}; found under --plans-dir/<model>/), either with "
                         "-ef<r> for error feedback (r = 2..8, 16, 32) or -defer<R> for a fit every R-th "
                         "token (R = 2..16)")
    codec: Codec = make_codec(key)
    return Method(key, codec_label(key), dict.fromkeys(linear_layers, codec))


def resolve_methods(names, model_name: str, linear_layers: list[int], *, plans_dir=None, plan_paths=(),
                    model_config=None, skip_missing_plans: bool = False) -> list[Method]:
    """Methods in order, FP32 (the reference) first and exactly once, plus one per --plan path.

    skip_missing_plans: drop "<variant>-<bits>" methods whose plan directory does not exist (used for the
    default method list, so that a plans directory with only some budgets still evaluates)."""
    names = [n.strip().lower() for n in names if n.strip()]
    if skip_missing_plans:
        names = [n for n in names if not is_plan_method(n)
                 or plan_path(plan_key(n), model_name, plans_dir).exists()]
    if REFERENCE in names:
        names.remove(REFERENCE)
    if len(set(names)) != len(names):
        dupes = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"methods listed more than once: {dupes}")
    methods = [resolve_method(REFERENCE, model_name, linear_layers)]
    methods += [resolve_method(n, model_name, linear_layers, plans_dir=plans_dir, model_config=model_config)
                for n in names]
    for path in plan_paths:
        taken = {m.name for m in methods}
        name = Path(path).name
        if name in taken:  # results are keyed by name: a second method of one name would overwrite the first
            raise ValueError(f"--plan {path}: a method named {name!r} is already evaluated (a plan directory "
                             "is named after its folder); copy or rename the plan directory, e.g. to "
                             f"{name}-mine")
        plan = load_plan(path, model_config)
        methods.append(plan_method(plan, name, linear_layers))
    return methods


def _one_layer_method(key: str, model_name: str, linear_layers: list[int], plans_dir, model_config) -> Method:
    """"<method>@<layer>": the method's codec on one model layer, FP32 everywhere else (error attribution)."""
    base_name, _, layer_text = key.partition("@")
    if not layer_text.isdigit() or int(layer_text) not in linear_layers:
        raise ValueError(f"method {key!r}: after '@' give a linear-attention layer index, one of "
                         f"{linear_layers}")
    layer = int(layer_text)
    base = resolve_method(base_name, model_name, linear_layers, plans_dir=plans_dir,
                          model_config=model_config)
    reference = make_codec(REFERENCE)
    codecs = {i: base.codecs[i] if i == layer else reference for i in linear_layers}
    return Method(key, f"{base.label} (layer {layer} only)", codecs, base.plan)

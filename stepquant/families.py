"""Model families: everything stepquant knows about one kind of delta-rule model, in one entry each.

A family is a linear-attention mixer with its own state geometry: Gated DeltaNet (Qwen3-Next, Qwen3.5,
one log-decay per head, allocation unit = a whole head) and Kimi Delta Attention (Kimi-Linear, one
log-decay per key channel, unit = one key row of a head). Its :class:`Family` entry in :data:`FAMILIES`
holds

- the transformers model types it covers, each with its modeling module, mixer class and config defaults,
  and the multimodal wrappers whose language model sits under ``text_config``;
- how a config gives the recurrent state's shape (heads, K, V), the convolution state and the attention
  KV bytes per token, and which layers are linear attention when ``layer_types`` is not listed;
- the module-level recurrence functions the mixer calls by name (chunked prefill, token-by-token decode),
  which calibration observes, the packed cache routes and CPU prefill swaps;
- the paper's FP16 pivot share for the family (the accounting default).

Accounting, calibration, the caches, evaluation and model loading read only this module. Adding a
family is one entry in :data:`FAMILIES` plus a test (tests/test_families.py checks every entry).

    family_for("qwen3_5_text").name           # "gdn"
    shape_from_config("stepquant/assets/models/gdn")  # ModelShape: layers, heads, K, V, conv, KV
    linear_layers(model.config)               # (0, 1, 2, 4, 5, 6): model layer index of each linear layer
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

LINEAR, FULL = "linear_attention", "full_attention"
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "bf16": 2, "fp16": 2, "fp32": 4}


class StateDims(NamedTuple):
    """Per linear-attention layer: recurrent heads x K x V, the short convolution's kernel and channels,
    and the attention KV values per token of one full-attention layer."""

    heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    conv_channels: int
    kv_values_per_layer: int
    key_heads: int  # q/k heads (GDN: linear_num_key_heads, each shared by heads / key_heads; KDA: heads)


@dataclass(frozen=True)
class ModelType:
    """One transformers language-model type: where its mixer lives, and the config defaults stepquant reads
    (those of the transformers 5.23 config class; hub checkpoints sometimes leave fields out)."""

    modeling_module: str
    mixer_class: str
    defaults: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class Family:
    """One model family (module docstring). Compared by identity: there is one object per family.

    name:      "gdn" / "kda", also the recurrence mode (stepquant.recurrence.MODES)
    unit:      the allocation unit, "head" (K x V values) or "key row" (V values)
    types:     language-model model_type -> ModelType; wrappers: multimodal model_type -> its text type
    chunk_function, recurrent_function: the modeling module's recurrence functions, called by global name
    state_dims(config): StateDims of a :class:`LanguageModelConfig`
    default_layer_types(config, num_layers): layer_types as transformers derives it when not listed
    paper_pivot_share / paper_pivot_text: the paper's FP16 pivot share of the family's units
    """

    name: str
    title: str
    unit: str
    types: Mapping[str, ModelType]
    wrappers: Mapping[str, str]
    chunk_function: str
    recurrent_function: str
    state_dims: Callable[[LanguageModelConfig], StateDims]
    default_layer_types: Callable[[LanguageModelConfig, int], list[str]]
    paper_pivot_share: Fraction
    paper_pivot_text: str

    def __post_init__(self) -> None:
        if self.unit not in ("head", "key row"):
            raise ValueError(f"unit must be 'head' or 'key row', got {self.unit!r}")
        unknown = sorted(set(self.wrappers.values()) - set(self.types))
        if unknown:
            raise ValueError(f"{self.name}: wrappers point to types {unknown} that the family does not list")

    @property
    def model_types(self) -> tuple[str, ...]:
        """Every model_type of the family, each wrapper just before the text type it wraps."""
        out: list[str] = []
        for base in self.types:
            out += [wrapper for wrapper, text in self.wrappers.items() if text == base] + [base]
        return tuple(out)

    @property
    def recurrence_functions(self) -> tuple[str, str]:
        return (self.chunk_function, self.recurrent_function)

    @property
    def unit_is_head(self) -> bool:
        return self.unit == "head"

    def unit_values(self, key_dim: int, value_dim: int) -> int:
        """State values in one allocation unit."""
        return key_dim * value_dim if self.unit_is_head else value_dim

    def text_type(self, model_type: str) -> str:
        """The language-model type of a model_type of this family (a wrapper's text_config type)."""
        return self.wrappers.get(model_type, model_type)

    def model_type(self, model_type: str) -> ModelType:
        """The ModelType of a model_type of this family (a wrapper gives its text type's)."""
        return self.types[self.text_type(model_type)]

    def modeling_module(self, model_type: str) -> ModuleType:
        """The imported transformers modeling module of a model_type (it defines the recurrence functions)."""
        return importlib.import_module(self.model_type(model_type).modeling_module)

    def __repr__(self) -> str:
        return f"Family({self.name!r})"


# ---------------------------------------------------------------- config views

@dataclass(frozen=True)
class LanguageModelConfig:
    """The language-model part of a supported config: ``fields`` (text_config of a wrapper, else the config
    itself), the family, the text model type and the outer config (dtype may sit there)."""

    family: Family
    model_type: str  # the config's own model_type (a wrapper's for multimodal configs)
    text_type: str
    fields: Mapping
    outer: Mapping

    def get(self, key: str):
        """A field, or its transformers default; a ValueError names a field that has neither."""
        value = self.fields.get(key, self.family.types[self.text_type].defaults.get(key))
        if value is None:
            raise ValueError(f"config lacks {key!r}, needed for model_type {self.text_type!r}")
        return value


def _config_dict(config) -> tuple[Mapping, str, Path | None]:
    """(config dict, where it came from, its config.json path or None) of a path, a folder holding
    config.json, a dict or a transformers config object."""
    if isinstance(config, (str, Path)):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"config file not found: {path}")
        with open(path) as f:
            return json.load(f), str(path), path
    if hasattr(config, "to_dict") and not isinstance(config, Mapping):
        return config.to_dict(), "transformers config", None
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a path or a dict, got {type(config).__name__}")
    return config, "config dict", None


def language_model(config) -> LanguageModelConfig:
    """The :class:`LanguageModelConfig` of a config (path, folder, dict or transformers config)."""
    outer, _, _ = _config_dict(config)
    model_type = outer.get("model_type")
    family = family_for(model_type)
    text_type = family.text_type(model_type)
    fields = outer
    if model_type in family.wrappers:
        text = outer.get("text_config")
        # a flat config (no text_config) carries the language-model fields at the top level
        fields = text if isinstance(text, Mapping) else outer
    return LanguageModelConfig(family, model_type, text_type, fields, outer)


def layer_types(config) -> list[str]:
    """Every layer's kind, "linear_attention" or "full_attention", as transformers 5.23 derives it."""
    lm = config if isinstance(config, LanguageModelConfig) else language_model(config)
    kinds = lm.fields.get("layer_types")
    num_layers = lm.get("num_hidden_layers")
    if kinds is None:
        kinds = lm.family.default_layer_types(lm, num_layers)
    if not isinstance(kinds, list) or len(kinds) != num_layers:
        raise ValueError(f"config layer_types must list num_hidden_layers={num_layers} entries, "
                         f"got {kinds!r}")
    unknown = sorted({t for t in kinds if t not in (LINEAR, FULL)}, key=str)
    if unknown:
        raise ValueError(f"config layer_types holds {unknown}; expected '{LINEAR}' / '{FULL}'")
    return kinds


def linear_layers(config) -> tuple[int, ...]:
    """The model layer index of every linear-attention layer, in order (the index caches and plans use)."""
    return tuple(i for i, kind in enumerate(layer_types(config)) if kind == LINEAR)


# ---------------------------------------------------------------- the state shape

@dataclass(frozen=True)
class ModelShape:
    """A model as stepquant sees it; None marks a quantity that is not known.

    linear_layers x heads recurrent states of key_dim x value_dim per request; conv_state_bytes and
    kv_bytes_per_token are per request / per context token summed over all layers; weight_bytes lists
    named weight payloads, e.g. (("bf16", 53_791_996_928), ("w4a16", 17_776_688_128)). From a config
    (:func:`shape_from_config`) it also records the model_type and the model layer index of each
    linear-attention layer (``layer_indices``), what a calibration plan must agree with.
    """

    name: str
    family: Family
    linear_layers: int
    heads: int
    key_dim: int
    value_dim: int
    full_attention_layers: int | None = None
    conv_state_bytes: int | None = None
    kv_bytes_per_token: int | None = None
    weight_bytes: tuple[tuple[str, int], ...] = ()
    source: str = ""
    model_type: str = ""
    layer_indices: tuple[int, ...] = ()
    key_heads: int | None = None  # q/k heads per layer (GDN's are shared by heads / key_heads value heads)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"name must be a non-empty str, got {self.name!r}")
        if not isinstance(self.family, Family):
            names = ", ".join(f"Mixer.{name.upper()}" for name in FAMILIES)
            raise TypeError(f"mixer must be a Mixer (a Family: {names}), got {self.family!r}")
        for field_name in ("linear_layers", "heads", "key_dim", "value_dim"):
            check_count(getattr(self, field_name), field_name)
        for field_name in ("full_attention_layers", "conv_state_bytes", "kv_bytes_per_token"):
            if getattr(self, field_name) is not None:
                check_count(getattr(self, field_name), field_name, allow_zero=True)
        if self.key_heads is not None:
            check_count(self.key_heads, "key_heads")
        pairs = self.weight_bytes
        if not isinstance(pairs, tuple) or not all(
            isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) for item in pairs
        ):
            raise TypeError(f"weight_bytes must be a tuple of (name, bytes) pairs, got {self.weight_bytes!r}")
        for label, size in self.weight_bytes:
            check_count(size, f"weight_bytes[{label!r}]")
        if len({label for label, _ in self.weight_bytes}) != len(self.weight_bytes):
            raise ValueError(f"weight_bytes names must be unique, got {[n for n, _ in self.weight_bytes]}")
        object.__setattr__(self, "layer_indices", tuple(int(i) for i in self.layer_indices))
        if self.layer_indices and len(self.layer_indices) != self.linear_layers:
            raise ValueError(f"layer_indices lists {len(self.layer_indices)} layers, linear_layers is "
                             f"{self.linear_layers}")

    @property
    def num_heads(self) -> int:
        """Recurrent heads per request, all layers."""
        return self.linear_layers * self.heads

    @property
    def values(self) -> int:
        """State values per request (N in the paper's budget)."""
        return self.num_heads * self.key_dim * self.value_dim

    @property
    def unit_values(self) -> int:
        """Values in one allocation unit: K x V for a GDN head, V for a KDA key row."""
        return self.family.unit_values(self.key_dim, self.value_dim)

    @property
    def num_units(self) -> int:
        return self.values // self.unit_values

    @property
    def fp32_bytes(self) -> int:
        return self.values * 4


def check_count(value, name: str, allow_zero: bool = False) -> int:
    """value as a positive int (or >= 0 with allow_zero); TypeError / ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '>= 1'}, got {value}")
    return value


def shape_from_config(config, name: str | None = None) -> ModelShape:
    """The ModelShape of a transformers config: a config.json path, its folder, a dict or a config object.

    Heads, K, V and the convolution state come from the family's ``state_dims`` (GDN: heads =
    linear_num_value_heads, K, V = linear_key/value_head_dim, conv channels 2 x key heads x K + heads x V;
    KDA: heads = linear_num_heads, K = V = linear_head_dim, conv channels 3 x heads x K, the checkpoint's
    linear_attn_config winning as in transformers). Conv state = linear layers x (kernel - 1) x channels x
    dtype bytes. KV per token = full layers x the family's KV values per layer (GDN: 2 x
    num_key_value_heads x head_dim; Kimi MLA: kv_lora_rank + qk_rope_head_dim) x dtype bytes. dtype is the
    config's ``dtype`` / ``torch_dtype`` (bfloat16 when absent). Weights are unknown.
    """
    outer, source, path = _config_dict(config)
    if path is not None:
        name = name or path.parent.name or "config"
    lm = language_model(outer)
    fields = lm.fields
    dtype = fields.get("dtype") or fields.get("torch_dtype") or outer.get("dtype") or outer.get("torch_dtype")
    dtype = str(dtype or "bfloat16").replace("torch.", "")
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"config dtype {dtype!r} is not one of {sorted(_DTYPE_BYTES)}")
    elem = _DTYPE_BYTES[dtype]
    kinds = layer_types(lm)
    linear, full = kinds.count(LINEAR), kinds.count(FULL)
    if linear == 0:
        raise ValueError(f"config has no linear_attention layers (layer_types={kinds})")
    dims = lm.family.state_dims(lm)
    return ModelShape(
        name=name or str(outer.get("_name_or_path") or lm.text_type),
        family=lm.family,
        linear_layers=linear,
        heads=dims.heads,
        key_dim=dims.key_dim,
        value_dim=dims.value_dim,
        key_heads=dims.key_heads,
        full_attention_layers=full,
        conv_state_bytes=linear * (dims.conv_kernel - 1) * dims.conv_channels * elem,
        kv_bytes_per_token=full * dims.kv_values_per_layer * elem,
        source=f"{source} (model_type {outer.get('model_type')}, state dtype {dtype})",
        model_type=lm.model_type,
        layer_indices=tuple(i for i, kind in enumerate(kinds) if kind == LINEAR),
    )


# ---------------------------------------------------------------- the families

def _gdn_state(lm: LanguageModelConfig) -> StateDims:
    heads, key_dim = lm.get("linear_num_value_heads"), lm.get("linear_key_head_dim")
    value_dim = lm.get("linear_value_head_dim")
    return StateDims(heads, key_dim, value_dim, lm.get("linear_conv_kernel_dim"),
                     2 * lm.get("linear_num_key_heads") * key_dim + heads * value_dim,
                     2 * lm.get("num_key_value_heads") * lm.get("head_dim"), lm.get("linear_num_key_heads"))


def _gdn_layer_types(lm: LanguageModelConfig, num_layers: int) -> list[str]:
    interval = lm.fields.get("full_attention_interval", 4)
    return [LINEAR if (i + 1) % interval else FULL for i in range(num_layers)]


def _kda_state(lm: LanguageModelConfig) -> StateDims:
    linear_cfg = lm.fields.get("linear_attn_config") or {}  # the checkpoint's sub-dict wins (transformers)
    heads = linear_cfg.get("num_heads", lm.get("linear_num_heads"))
    head_dim = linear_cfg.get("head_dim", lm.get("linear_head_dim"))
    kernel = linear_cfg.get("short_conv_kernel_size", lm.get("linear_conv_kernel_dim"))
    return StateDims(heads, head_dim, head_dim, kernel, 3 * heads * head_dim,
                     lm.get("kv_lora_rank") + lm.get("qk_rope_head_dim"), heads)


def _kda_layer_types(lm: LanguageModelConfig, num_layers: int) -> list[str]:
    linear_cfg = lm.fields.get("linear_attn_config") or {}
    if "full_attn_layers" in linear_cfg and "kda_layers" in linear_cfg:
        kinds = [None] * num_layers
        for i in linear_cfg["full_attn_layers"]:  # 1-indexed in the checkpoint
            kinds[i - 1] = FULL
        for i in linear_cfg["kda_layers"]:
            kinds[i - 1] = LINEAR
        return kinds
    return [FULL if i and i % 4 == 0 else LINEAR for i in range(num_layers)]


_QWEN_LINEAR_DEFAULTS = {
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "head_dim": 256,
}

GDN = Family(
    name="gdn",
    title="Gated DeltaNet",
    unit="head",
    types={
        "qwen3_next": ModelType(
            "transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextGatedDeltaNet",
            {**_QWEN_LINEAR_DEFAULTS, "num_hidden_layers": 48, "num_key_value_heads": 2}),
        "qwen3_5_text": ModelType(
            "transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5GatedDeltaNet",
            {**_QWEN_LINEAR_DEFAULTS, "num_hidden_layers": 32, "num_key_value_heads": 4}),
        "qwen3_5_moe_text": ModelType(
            "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet",
            {**_QWEN_LINEAR_DEFAULTS, "num_hidden_layers": 40, "num_key_value_heads": 2}),
    },
    wrappers={"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"},
    chunk_function="torch_chunk_gated_delta_rule",
    recurrent_function="torch_recurrent_gated_delta_rule",
    state_dims=_gdn_state,
    default_layer_types=_gdn_layer_types,
    paper_pivot_share=Fraction(32, 2304),  # 32 of Qwen3.8-27B's 2,304 GDN heads
    paper_pivot_text="32 of 2,304 heads, 1.39%",
)

KDA = Family(
    name="kda",
    title="Kimi Delta Attention",
    unit="key row",
    types={
        "kimi_linear": ModelType("transformers.models.kimi_linear.modeling_kimi_linear",
                                 "KimiLinearDeltaAttention",
                                 {"num_hidden_layers": 27, "linear_num_heads": 32, "linear_head_dim": 128,
                                  "linear_conv_kernel_dim": 4, "kv_lora_rank": 512, "qk_rope_head_dim": 64}),
    },
    wrappers={},
    chunk_function="chunk_kimi_delta_attention",
    recurrent_function="recurrent_kimi_delta_attention",
    state_dims=_kda_state,
    default_layer_types=_kda_layer_types,
    paper_pivot_share=Fraction(512, 81920),  # 512 of Kimi-Linear-48B's 81,920 KDA key rows
    paper_pivot_text="512 of 81,920 key rows, 0.625%",
)

FAMILIES: dict[str, Family] = {family.name: family for family in (GDN, KDA)}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(t for family in FAMILIES.values() for t in family.model_types)


def family_for(model_type) -> Family:
    """The family of a transformers model_type; a ValueError lists the supported ones."""
    for family in FAMILIES.values():
        if model_type in family.model_types:
            return family
    raise ValueError(
        f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)} "
        "(a new model family is one entry in stepquant/families.py)"
    )


def get_family(name) -> Family:
    """A family by name ("gdn", "kda"); a ValueError lists the names."""
    if name not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(map(repr, FAMILIES))}, got {name!r}")
    return FAMILIES[name]

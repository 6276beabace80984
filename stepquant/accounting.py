"""Memory accounting: bits/value and bytes/request of every state format, and the serving capacity model.

The paper's claims are byte counts (STEPQuant@6 on Qwen3.8-27B: 30,015,488 B analytical, 29,999,104 B
served, 5.03x vs FP32; Kimi-Linear: 4.30 / 6.30 bits/value) and a capacity model for a serving engine
that reserves (5B + 1) persistent-state slots. This module computes them from a model shape, so every
number can be re-derived for any GDN / KDA model and any format, and ``stepquant memory`` prints them.

Conventions (docs/accounting.md explains them with the numbers):

- A request's recurrent state is ``L x H x K x V`` values (L linear-attention layers, H heads each).
- STEPQuant at a nominal budget b̄ with N_piv pivot units: integer codes get b̄ N - 8 N_piv bits (each
  FP16 pivot replaces an 8-bit unit), pivots take 16 bits per value, every head stores an FP16 row-scale
  and column-scale vector. "Analytical" reserves those scale slots for every head; "serving" (the packed
  layout of docs/format.md) drops them for GDN pivot heads. A KDA pivot row keeps its slot.
- A slot of the capacity model is the recurrent state plus the convolution state (kept as is);
  reserved state memory = (r B + 1) slots; total = weights + state + B x context x KV bytes/token.
- MiB = 2**20 bytes, GiB = 2**30 bytes.
"""

from __future__ import annotations

import argparse
import enum
import inspect
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

from stepquant.codecs.base import MAX_BITS, MIN_BITS, PIVOT_BITS

MIB = 2**20
GIB = 2**30
FP32_BITS = 32
FP16_BITS = 16
SCALE_BITS = 16  # row / column scales are FP16
PIVOT_REPLACES_BITS = 8  # the paper's accounting: a pivot replaces an 8-bit unit

# The paper's pivot shares: 32 of Qwen3.8-27B's 2,304 GDN heads (1.39%), 512 of Kimi-Linear's 81,920
# KDA key rows (0.625%). Other models get the same share of their units, rounded half up.
PAPER_GDN_PIVOT_SHARE = Fraction(32, 2304)
PAPER_KDA_PIVOT_SHARE = Fraction(512, 81920)


class Mixer(enum.Enum):
    """The linear-attention mixer, which fixes the allocation unit (docs: DESIGN.md section 3)."""

    GDN = "gdn"  # Gated DeltaNet: unit = a whole head (K x V values)
    KDA = "kda"  # Kimi Delta Attention: unit = one key row of a head (V values)

    @property
    def unit_name(self) -> str:
        return "head" if self is Mixer.GDN else "key row"

    @property
    def paper_pivot_share(self) -> Fraction:
        return PAPER_GDN_PIVOT_SHARE if self is Mixer.GDN else PAPER_KDA_PIVOT_SHARE

    @property
    def paper_pivot_text(self) -> str:
        return "32 of 2,304 heads, 1.39%" if self is Mixer.GDN else "512 of 81,920 key rows, 0.625%"


def _check_positive_int(value, name: str, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '>= 1'}, got {value}")
    return value


def _check_optional_count(value, name: str) -> None:
    if value is not None:
        _check_positive_int(value, name, allow_zero=True)


@dataclass(frozen=True)
class ModelShape:
    """What the accounting needs to know about a model; None marks a quantity that is not known.

    linear_layers x heads recurrent states of key_dim x value_dim per request; conv_state_bytes and
    kv_bytes_per_token are per request / per context token summed over all layers; weight_bytes
    lists named weight payloads, e.g. (("bf16", 53_791_996_928), ("w4a16", 17_776_688_128)).
    """

    name: str
    mixer: Mixer
    linear_layers: int
    heads: int
    key_dim: int
    value_dim: int
    full_attention_layers: int | None = None
    conv_state_bytes: int | None = None
    kv_bytes_per_token: int | None = None
    weight_bytes: tuple[tuple[str, int], ...] = ()
    source: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"name must be a non-empty str, got {self.name!r}")
        if not isinstance(self.mixer, Mixer):
            raise TypeError(f"mixer must be a Mixer (Mixer.GDN or Mixer.KDA), got {self.mixer!r}")
        for field_name in ("linear_layers", "heads", "key_dim", "value_dim"):
            _check_positive_int(getattr(self, field_name), field_name)
        for field_name in ("full_attention_layers", "conv_state_bytes", "kv_bytes_per_token"):
            _check_optional_count(getattr(self, field_name), field_name)
        pairs = self.weight_bytes
        if not isinstance(pairs, tuple) or not all(
            isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) for item in pairs
        ):
            raise TypeError(f"weight_bytes must be a tuple of (name, bytes) pairs, got {self.weight_bytes!r}")
        for label, size in self.weight_bytes:
            _check_positive_int(size, f"weight_bytes[{label!r}]")
        if len({label for label, _ in self.weight_bytes}) != len(self.weight_bytes):
            raise ValueError(f"weight_bytes names must be unique, got {[n for n, _ in self.weight_bytes]}")

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
        return self.key_dim * self.value_dim if self.mixer is Mixer.GDN else self.value_dim

    @property
    def num_units(self) -> int:
        return self.values // self.unit_values

    @property
    def fp32_bytes(self) -> int:
        return self.values * 4


@dataclass(frozen=True)
class StateBytes:
    """Bytes one request's recurrent state occupies in a format, all linear-attention layers.

    analytical_bytes: the paper's compact count (scale slots for every head); serving_bytes: the
    packed serving layout. Equal for every format except STEPQuant with GDN pivot heads.
    """

    label: str
    analytical_bytes: int
    serving_bytes: int
    values: int

    def __post_init__(self) -> None:
        if not isinstance(self.label, str) or not self.label:
            raise TypeError(f"label must be a non-empty str, got {self.label!r}")
        _check_positive_int(self.analytical_bytes, "analytical_bytes")
        _check_positive_int(self.serving_bytes, "serving_bytes")
        _check_positive_int(self.values, "values")

    def bytes(self, serving: bool = False) -> int:
        return self.serving_bytes if serving else self.analytical_bytes

    def bits_per_value(self, serving: bool = False) -> float:
        return self.bytes(serving) * 8 / self.values

    def ratio_vs_fp32(self, serving: bool = False) -> float:
        return self.values * 4 / self.bytes(serving)

    def as_dict(self) -> dict:
        return {
            "format": self.label,
            "analytical_bytes": self.analytical_bytes,
            "serving_bytes": self.serving_bytes,
            "bits_per_value": round(self.bits_per_value(), 6),
            "serving_bits_per_value": round(self.bits_per_value(serving=True), 6),
            "ratio_vs_fp32": round(self.ratio_vs_fp32(), 6),
            "serving_ratio_vs_fp32": round(self.ratio_vs_fp32(serving=True), 6),
        }


def _bits_to_bytes(bits: int) -> int:
    return -(-bits // 8)


def _check_shape(shape) -> ModelShape:
    if not isinstance(shape, ModelShape):
        raise TypeError(f"shape must be a ModelShape (see PRESETS or shape_from_config), "
                        f"got {type(shape).__name__}")
    return shape


def _check_int_bits(bits, name: str = "bits") -> int:
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(f"{name} must be an int in {MIN_BITS}..{MAX_BITS}, got {bits!r}")
    if not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"{name}={bits} is out of range: integer state formats support "
                         f"{MIN_BITS}..{MAX_BITS} bits")
    return bits


# ---------------------------------------------------------------- formats

def float_bytes(shape: ModelShape, bits: int = FP32_BITS) -> StateBytes:
    """A plain float cast: FP32 (SGLang's default) or BF16 / FP16 (16 bits)."""
    _check_shape(shape)
    if bits not in (FP32_BITS, FP16_BITS):
        raise ValueError(f"bits={bits!r}: float states are 32 (FP32) or 16 (BF16/FP16) bits")
    label = "FP32" if bits == FP32_BITS else "BF16/FP16"
    size = _bits_to_bytes(shape.values * bits)
    return StateBytes(label, size, size, shape.values)


def int_rowwise_bytes(shape: ModelShape, bits: int) -> StateBytes:
    """Uniform b-bit codes with one FP16 absmax scale per key row (the paper's INT4/6/8 baseline)."""
    _check_shape(shape)
    _check_int_bits(bits)
    rows = shape.num_heads * shape.key_dim
    size = _bits_to_bytes(shape.values * bits + rows * SCALE_BITS)
    return StateBytes(f"INT{bits} rowwise", size, size, shape.values)


def dsq_bytes(shape: ModelShape, bits: int) -> StateBytes:
    """DSQ (Q-Mamba): uniform b-bit codes with an FP16 row and an FP16 column scale vector per head."""
    _check_shape(shape)
    _check_int_bits(bits)
    scale_bits = shape.num_heads * (shape.key_dim + shape.value_dim) * SCALE_BITS
    size = _bits_to_bytes(shape.values * bits + scale_bits)
    return StateBytes(f"DSQ{bits}", size, size, shape.values)


def max_pivots(shape: ModelShape, bits: int) -> int:
    """Most pivot units the budget b̄ N - 8 N_piv can pay for while integer values keep >= 2 bits."""
    _check_shape(shape)
    _check_int_bits(bits)
    # (b̄ N - 8 N_piv) >= 2 (N - N_piv)  <=>  6 N_piv <= (b̄ - 2) N
    most_values = (bits - MIN_BITS) * shape.values // (PIVOT_REPLACES_BITS - MIN_BITS)
    return min(shape.num_units, most_values // shape.unit_values)


def default_pivots(shape: ModelShape, bits: int | None = None) -> int:
    """The paper's pivot share of ``shape``'s units, rounded half up (Qwen3.8-27B: 32 heads, Kimi: 512 rows).

    With ``bits`` given, capped at what that budget can pay for (no pivots at 2 bits).
    """
    _check_shape(shape)
    share = shape.mixer.paper_pivot_share * shape.num_units
    pivots = math.floor(share + Fraction(1, 2))
    return pivots if bits is None else min(pivots, max_pivots(shape, bits))


def stepquant_bytes(shape: ModelShape, bits: int, pivots: int | None = None) -> StateBytes:
    """STEPQuant at nominal budget b̄ = ``bits`` with ``pivots`` FP16 pivot units (heads / key rows).

    codes: b̄ N - 8 N_piv bits; pivots: 16 N_piv bits; scales: an FP16 row and column vector per head
    (analytical: every head; serving: GDN pivot heads carry none). N_piv counts values. This is the
    nominal budget count, independent of how a plan spreads the bits (rows are assumed word aligned,
    true for V a multiple of 32); :func:`plan_bytes` counts an actual plan's packed layout.
    """
    _check_shape(shape)
    _check_int_bits(bits)
    if pivots is None:
        pivots = default_pivots(shape, bits)
    _check_positive_int(pivots, "pivots", allow_zero=True)
    limit = max_pivots(shape, bits)
    if pivots > limit:
        raise ValueError(
            f"pivots={pivots} {shape.mixer.unit_name}s do not fit a {bits}-bit budget: each replaces an "
            f"8-bit unit and the other units need >= {MIN_BITS} bits, so at most {limit} are possible"
        )
    pivot_values = pivots * shape.unit_values
    code_bits = bits * shape.values - PIVOT_REPLACES_BITS * pivot_values
    pivot_bits = PIVOT_BITS * pivot_values
    head_scale_bits = (shape.key_dim + shape.value_dim) * SCALE_BITS
    analytical = code_bits + pivot_bits + shape.num_heads * head_scale_bits
    pivot_heads = pivots if shape.mixer is Mixer.GDN else 0  # a KDA pivot row keeps its row-scale slot
    serving = analytical - pivot_heads * head_scale_bits
    unit = "head" if shape.mixer is Mixer.GDN else "row"
    label = f"STEPQuant@{bits} ({pivots:,} pivot {unit}{'s' if pivots != 1 else ''})"
    return StateBytes(label, _bits_to_bytes(analytical), _bits_to_bytes(serving), shape.values)


def codec_bytes(codec, shape: ModelShape) -> StateBytes:
    """Bytes of any :class:`~stepquant.codecs.base.Codec`: its ``storage_bits`` per layer x layers.

    Serving bytes come from ``storage_bits(H, K, V)``, analytical bytes from ``analytical=True`` where
    the codec takes that keyword (they differ only for formats with FP16 pivot heads).
    """
    _check_shape(shape)
    storage_bits = getattr(codec, "storage_bits", None)
    if not callable(storage_bits):
        raise TypeError(f"codec must implement storage_bits(num_heads, key_dim, value_dim), got {codec!r}")
    dims = (shape.heads, shape.key_dim, shape.value_dim)
    serving = storage_bits(*dims)
    takes_analytical = "analytical" in inspect.signature(storage_bits).parameters
    analytical = storage_bits(*dims, analytical=True) if takes_analytical else serving
    _check_positive_int(serving, "codec.storage_bits(...)")
    _check_positive_int(analytical, "codec.storage_bits(..., analytical=True)")
    return StateBytes(str(getattr(codec, "name", type(codec).__name__)),
                      _bits_to_bytes(analytical * shape.linear_layers),
                      _bits_to_bytes(serving * shape.linear_layers), shape.values)


def plan_bytes(layer_bits, shape: ModelShape, has_col_scale: bool = True, label: str = "plan") -> StateBytes:
    """Bytes of a concrete plan: bit width per unit of every layer, 2..8 or 16 (FP16 pivot).

    ``layer_bits``: one entry per linear-attention layer, each [H] (bits per GDN head) or [H, K] (bits
    per key row); a tensor [L, H] / [L, H, K] works too. Serving bytes are the packed layout's
    ``bytes_per_slot`` (docs/format.md, word padding included); analytical bytes reserve scale slots
    for every head.
    """
    from stepquant.packing import PackedLayout  # packing imports torch-heavy helpers only when needed

    _check_shape(shape)
    if isinstance(layer_bits, torch.Tensor):
        layer_bits = list(layer_bits)
    if not isinstance(layer_bits, Sequence) or isinstance(layer_bits, str):
        raise TypeError("layer_bits must be a sequence of per-layer bit tensors [H] or [H, K]")
    if len(layer_bits) != shape.linear_layers:
        raise ValueError(f"layer_bits has {len(layer_bits)} layers, the model has {shape.linear_layers}")
    analytical = serving = 0
    for index, bits in enumerate(layer_bits):
        bits = torch.as_tensor(bits)
        if bits.dim() == 1:
            bits = bits[:, None].expand(-1, shape.key_dim)  # a GDN head's rows share its width
        if tuple(bits.shape) != (shape.heads, shape.key_dim):
            raise ValueError(f"layer_bits[{index}] must have shape [H]=[{shape.heads}] or [H, K]="
                             f"[{shape.heads}, {shape.key_dim}], got {tuple(bits.shape)}")
        layout = PackedLayout(bits.to(torch.int8), shape.value_dim, has_col_scale=has_col_scale)
        analytical += layout.analytical_bytes
        serving += layout.bytes_per_slot
    return StateBytes(label, analytical, serving, shape.values)


def measured_bytes(shape: ModelShape, num_bytes: int, label: str = "measured") -> StateBytes:
    """A byte count measured elsewhere, turned into bits/value and a ratio vs FP32 on ``shape``."""
    _check_shape(shape)
    _check_positive_int(num_bytes, "num_bytes")
    return StateBytes(label, num_bytes, num_bytes, shape.values)


# ---------------------------------------------------------------- capacity model

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
        _check_positive_int(self.batch, "batch")
        _check_positive_int(self.slots_per_request, "slots_per_request")
        _check_positive_int(self.state_bytes, "state_bytes")
        _check_positive_int(self.conv_bytes, "conv_bytes", allow_zero=True)
        _check_positive_int(self.context_tokens, "context_tokens", allow_zero=True)
        _check_optional_count(self.kv_bytes_per_token, "kv_bytes_per_token")

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


# ---------------------------------------------------------------- presets and configs

PRESETS: dict[str, ModelShape] = {
    "qwen3.8-27b": ModelShape(
        name="qwen3.8-27b",
        mixer=Mixer.GDN,
        linear_layers=48,
        heads=48,
        key_dim=128,
        value_dim=128,
        full_attention_layers=16,
        conv_state_bytes=2_949_120,
        kv_bytes_per_token=65_536,
        weight_bytes=(("bf16", 53_791_996_928), ("w4a16", 17_776_688_128)),
        source="STEPQuant paper, appendix F (Qwen3.8-27B)",
    ),
    "kimi-linear-48b-a3b": ModelShape(
        name="kimi-linear-48b-a3b",
        mixer=Mixer.KDA,
        linear_layers=20,
        heads=32,
        key_dim=128,
        value_dim=128,
        full_attention_layers=7,
        source="STEPQuant paper (81,920 KDA key rows of 128 values) and the public Kimi-Linear-48B-A3B "
               "config (20 KDA layers x 32 heads, 7 MLA layers); conv state, KV and weights: not given "
               "by the paper, unknown here (read them from config.json with --config)",
    ),
}


def get_preset(name: str) -> ModelShape:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]


# Defaults of the transformers 5.23 config classes for the fields read here (a config.json written by
# save_pretrained lists them all; hub checkpoints sometimes leave some out).
_QWEN_LINEAR_DEFAULTS = {
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "head_dim": 256,
}
CONFIG_DEFAULTS: dict[str, dict] = {
    "qwen3_next": {**_QWEN_LINEAR_DEFAULTS, "num_hidden_layers": 48, "num_key_value_heads": 2},
    "qwen3_5_text": {**_QWEN_LINEAR_DEFAULTS, "num_hidden_layers": 32, "num_key_value_heads": 4},
    "qwen3_5_moe_text": {**_QWEN_LINEAR_DEFAULTS, "num_hidden_layers": 40, "num_key_value_heads": 2},
    "kimi_linear": {"num_hidden_layers": 27, "linear_num_heads": 32, "linear_head_dim": 128,
                    "linear_conv_kernel_dim": 4, "kv_lora_rank": 512, "qk_rope_head_dim": 64},
}
# Multimodal wrappers whose language model sits under "text_config".
_WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
SUPPORTED_MODEL_TYPES = (
    "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "kimi_linear",
)
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "bf16": 2, "fp16": 2, "fp32": 4}


def _language_model_config(config: Mapping) -> tuple[Mapping, str, Callable[[str], Any]]:
    """(the language model's fields, its base model type, get(key) with that type's defaults) of a
    supported config dict: the qwen3_5 wrappers hold the fields in text_config."""
    model_type = config["model_type"]
    if model_type in _WRAPPERS:
        text = config.get("text_config")
        # a flat config (no text_config) carries the language-model fields at the top level
        config = text if isinstance(text, Mapping) else config
        model_type = _WRAPPERS[model_type]
    defaults = CONFIG_DEFAULTS[model_type]

    def get(key: str):
        value = config.get(key, defaults.get(key))
        if value is None:
            raise ValueError(f"config lacks {key!r}, needed for model_type {model_type!r}")
        return value

    return config, model_type, get


def _layer_types(cfg: Mapping, model_type: str, get) -> list[str]:
    """layer_types as transformers 5.23 derives it when the config does not list it."""
    layer_types = cfg.get("layer_types")
    num_layers = get("num_hidden_layers")
    if layer_types is None:
        if model_type == "kimi_linear":
            linear_cfg = cfg.get("linear_attn_config") or {}
            if "full_attn_layers" in linear_cfg and "kda_layers" in linear_cfg:
                layer_types = [None] * num_layers
                for i in linear_cfg["full_attn_layers"]:  # 1-indexed in the checkpoint
                    layer_types[i - 1] = "full_attention"
                for i in linear_cfg["kda_layers"]:
                    layer_types[i - 1] = "linear_attention"
            else:
                layer_types = ["full_attention" if i and i % 4 == 0 else "linear_attention"
                               for i in range(num_layers)]
        else:
            interval = cfg.get("full_attention_interval", 4)
            layer_types = ["linear_attention" if (i + 1) % interval else "full_attention"
                           for i in range(num_layers)]
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise ValueError(f"config layer_types must list num_hidden_layers={num_layers} entries, "
                         f"got {layer_types!r}")
    unknown = sorted({t for t in layer_types if t not in ("linear_attention", "full_attention")}, key=str)
    if unknown:
        raise ValueError(f"config layer_types holds {unknown}; "
                         "expected 'linear_attention' / 'full_attention'")
    return layer_types


def shape_from_config(config: str | Path | Mapping, name: str | None = None) -> ModelShape:
    """The ModelShape of a transformers ``config.json`` (a path, its folder, or the loaded dict).

    Supported model types: qwen3_next, qwen3_5(_text), qwen3_5_moe(_text) (GDN) and kimi_linear (KDA).
    Heads = linear_num_value_heads (GDN) / linear_num_heads (KDA); K, V = linear_key/value_head_dim
    (GDN) / linear_head_dim (KDA). Conv state = linear layers x (conv_kernel - 1) x conv channels x
    dtype bytes (channels: 2 x key heads x K + value heads x V for GDN; 3 x heads x K for KDA). KV per
    token = full layers x 2 x num_key_value_heads x head_dim x dtype bytes (Kimi MLA: full layers x
    (kv_lora_rank + qk_rope_head_dim) x dtype bytes). dtype is the config's ``dtype`` / ``torch_dtype``
    (bfloat16 when absent). Weights are unknown.
    """
    source = "config dict"
    if isinstance(config, (str, Path)):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"config file not found: {path}")
        with open(path) as f:
            config = json.load(f)
        source = str(path)
        name = name or path.parent.name or "config"
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a path or a dict, got {type(config).__name__}")
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r}; "
                         f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    outer = config
    config, model_type, get = _language_model_config(config)
    dtype = config.get("dtype") or config.get("torch_dtype") or outer.get("dtype") or outer.get("torch_dtype")
    dtype = str(dtype or "bfloat16").replace("torch.", "")
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"config dtype {dtype!r} is not one of {sorted(_DTYPE_BYTES)}")
    elem = _DTYPE_BYTES[dtype]
    layer_types = _layer_types(config, model_type, get)
    linear_layers = layer_types.count("linear_attention")
    full_layers = layer_types.count("full_attention")
    if linear_layers == 0:
        raise ValueError(f"config has no linear_attention layers (layer_types={layer_types})")

    if model_type == "kimi_linear":
        # the checkpoint's linear_attn_config sub-dict wins, as in transformers
        linear_cfg = config.get("linear_attn_config") or {}
        heads = linear_cfg.get("num_heads", get("linear_num_heads"))
        key_dim = value_dim = linear_cfg.get("head_dim", get("linear_head_dim"))
        kernel = linear_cfg.get("short_conv_kernel_size", get("linear_conv_kernel_dim"))
        conv_channels = 3 * heads * key_dim
        kv_per_layer = (get("kv_lora_rank") + get("qk_rope_head_dim")) * elem
        mixer = Mixer.KDA
    else:
        heads, key_dim, value_dim = get("linear_num_value_heads"), get("linear_key_head_dim"), get(
            "linear_value_head_dim")
        kernel = get("linear_conv_kernel_dim")
        conv_channels = 2 * get("linear_num_key_heads") * key_dim + heads * value_dim
        kv_per_layer = 2 * get("num_key_value_heads") * get("head_dim") * elem
        mixer = Mixer.GDN
    return ModelShape(
        name=name or str(outer.get("_name_or_path") or model_type),
        mixer=mixer,
        linear_layers=linear_layers,
        heads=heads,
        key_dim=key_dim,
        value_dim=value_dim,
        full_attention_layers=full_layers,
        conv_state_bytes=linear_layers * (kernel - 1) * conv_channels * elem,
        kv_bytes_per_token=full_layers * kv_per_layer,
        source=f"{source} (model_type {outer.get('model_type')}, state dtype {dtype})",
    )


# ---------------------------------------------------------------- report and CLI

def memory_report(shape: ModelShape, bits: int, pivots: int | None = None, batch: int = 64,
                  slots_per_request: int = 5, context_tokens: int = 0,
                  measured: int | None = None, plan: StateBytes | None = None) -> dict:
    """Every number ``stepquant memory`` prints, as a JSON-ready dict."""
    _check_shape(shape)
    _check_int_bits(bits)
    pivots_source = "given"
    if pivots is None:
        pivots = default_pivots(shape, bits)
        pivots_source = f"default: the paper's share ({shape.mixer.paper_pivot_text}), rounded"
        if pivots < default_pivots(shape):
            pivots_source += f", capped at what a {bits}-bit budget pays for"
    formats = [float_bytes(shape, 32), float_bytes(shape, 16), int_rowwise_bytes(shape, bits),
               dsq_bytes(shape, bits), stepquant_bytes(shape, bits, pivots)]
    if plan is not None:
        formats.append(plan)
    if measured is not None:
        formats.append(measured_bytes(shape, measured, f"measured ({measured:,} B)"))
    step = formats[4]
    capacities = [capacity(shape, fmt, batch, slots_per_request, context_tokens) for fmt in formats[:4]]
    capacities.append(capacity(shape, step, batch, slots_per_request, context_tokens))
    capacities.append(capacity(shape, step, batch, slots_per_request, context_tokens, serving=True))
    capacity_rows = []
    for cap, kind in zip(capacities, ["", "", "", "", " analytical", " serving"], strict=True):
        row = cap.as_dict()
        row["format"] = cap.label + kind
        if context_tokens:
            row["kv_bytes"] = cap.kv_bytes
        row["total_bytes"] = {w: cap.total_bytes(size) for w, size in shape.weight_bytes}
        capacity_rows.append(row)
    return {
        "model": shape.name,
        "mixer": shape.mixer.value,
        "linear_layers": shape.linear_layers,
        "heads": shape.heads,
        "key_dim": shape.key_dim,
        "value_dim": shape.value_dim,
        "values_per_request": shape.values,
        "bits": bits,
        "pivots": pivots,
        "pivot_unit": shape.mixer.unit_name,
        "pivots_source": pivots_source,
        "num_units": shape.num_units,
        "formats": [fmt.as_dict() for fmt in formats],
        "capacity": {
            "batch": batch,
            "slots_per_request": slots_per_request,
            "slots": slots_per_request * batch + 1,
            "context_tokens": context_tokens,
            "conv_state_bytes": shape.conv_state_bytes,
            "kv_bytes_per_token": shape.kv_bytes_per_token,
            "weight_bytes": dict(shape.weight_bytes),
            "rows": capacity_rows,
        },
    }


def format_report(report: dict) -> str:
    """The human-readable tables of ``stepquant memory``."""
    lines = []
    n_units, pivots = report["num_units"], report["pivots"]
    unit = report["pivot_unit"]
    lines.append(
        f"model {report['model']}: {report['mixer'].upper()}, {report['linear_layers']} linear-attention "
        f"layers x {report['heads']} heads of {report['key_dim']}x{report['value_dim']} = "
        f"{report['values_per_request']:,} state values/request"
    )
    share = pivots / n_units if n_units else 0.0
    lines.append(f"pivots: {pivots:,} FP16 {unit}s of {n_units:,} ({share * 100:.3g}%; "
                 f"{report['pivots_source']})")
    lines.append("")
    header = (f"{'format (bytes per request)':<34} {'analytical':>15} {'serving':>15} {'bits/value':>10} "
              f"{'serving':>8} {'vs FP32':>8} {'serving':>8}")
    lines += [header, "-" * len(header)]
    for fmt in report["formats"]:
        lines.append(
            f"{fmt['format']:<34} {fmt['analytical_bytes']:>15,} {fmt['serving_bytes']:>15,} "
            f"{fmt['bits_per_value']:>10.4f} {fmt['serving_bits_per_value']:>8.4f} "
            f"{fmt['ratio_vs_fp32']:>7.2f}x {fmt['serving_ratio_vs_fp32']:>7.2f}x"
        )
    step = report["formats"][4]
    fp32 = report["formats"][0]
    lines.append("")
    lines.append(
        f"{step['format']}: {step['bits_per_value']:.2f} bits/value, "
        f"{step['analytical_bytes'] / MIB:.4f} MiB analytical / "
        f"{step['serving_bytes'] / MIB:.4f} MiB serving vs {fp32['analytical_bytes'] / MIB:.4f} MiB FP32 "
        f"({step['ratio_vs_fp32']:.2f}x / {step['serving_ratio_vs_fp32']:.2f}x)"
    )
    for fmt in report["formats"][5:]:
        lines.append(
            f"{fmt['format']}: {fmt['bits_per_value']:.4f} bits/value, {fmt['ratio_vs_fp32']:.4f}x vs FP32 "
            f"({fmt['analytical_bytes'] / MIB:.4f} MiB)"
        )

    cap = report["capacity"]
    lines.append("")
    conv = cap["conv_state_bytes"]
    conv_text = f"conv state {conv:,} B kept as is" if conv is not None else "conv state unknown, left out"
    lines.append(
        f"capacity: ({cap['slots_per_request']} x B + 1) state slots at B={cap['batch']} = "
        f"{cap['slots']:,} slots; slot = recurrent state + {conv_text}"
    )
    weights = cap["weight_bytes"]
    header = f"{'state format':<45} {'slot MiB':>10} {'pool GiB':>10}"
    if cap["context_tokens"]:
        header += f" {'KV GiB':>8}"
    for w in weights:
        header += f" {'total GiB (' + w + ')':>18}"
    lines += [header, "-" * len(header)]
    for row in cap["rows"]:
        line = f"{row['format']:<45} {row['slot_mib']:>10.4f} {row['pool_bytes'] / GIB:>10.2f}"
        if cap["context_tokens"]:
            kv = row.get("kv_bytes")
            line += f" {kv / GIB:>8.2f}" if kv is not None else f" {'unknown':>8}"
        for w in weights:
            total = row["total_bytes"][w]
            line += f" {total / GIB:>18.2f}" if total is not None else f" {'unknown':>18}"
        lines.append(line)
    if weights:
        listed = [f"{w} {size:,} B ({size / GIB:.2f} GiB)" for w, size in weights.items()]
        lines.append("weights: " + "; ".join(listed))
    else:
        lines.append("weights: unknown (not given for this model)")
    kv = cap["kv_bytes_per_token"]
    kv_text = f"{kv:,} B/token" if kv is not None else "unknown"
    lines.append(f"attention KV: {kv_text}; context {cap['context_tokens']:,} tokens/request in the totals")
    return "\n".join(lines)


def load_plan_state_bytes(path: str | Path, shape: ModelShape) -> StateBytes:
    """``--plan``: serving and analytical bytes of a calibrated plan directory (stepquant calibrate) on shape.

    Counted with the plan's own stored format: temporal variants (rowwise absmax) keep row scales
    only, so their column scales must not be counted (``has_col_scale`` of the plan).
    """
    from stepquant.calibrate.plan import Plan  # calibration imports accounting, not the other way round

    plan = Plan.load(path)
    return plan_bytes(list(plan.bits), shape, has_col_scale=plan.has_col_scale,
                      label=f"plan {Path(path).name} ({plan.variant}@{plan.budget_bits})")


def _run_memory(args: argparse.Namespace) -> int:
    if (args.preset is None) == (args.config is None):
        raise ValueError("give exactly one of --preset NAME or --config PATH/config.json")
    shape = get_preset(args.preset) if args.preset is not None else shape_from_config(args.config)
    plan = None
    if args.plan is not None:
        plan = load_plan_state_bytes(args.plan, shape)
    report = memory_report(shape, args.bits, args.pivots, args.batch, args.slots_per_request,
                           args.context, args.measured_bytes, plan)
    if not args.json:
        print(format_report(report))
    print(json.dumps(report, separators=(",", ":")))
    return 0


def add_cli(subparsers) -> None:
    """Register ``stepquant memory``."""
    parser = subparsers.add_parser(
        "memory",
        help="bytes/request, bits/value and serving capacity of every state format",
        description="Recurrent-state memory of FP32 / BF16 / INT-b / DSQ / STEPQuant for a model, and the "
                    "capacity model with (slots-per-request x B + 1) state slots. Prints tables, then one "
                    "JSON line.",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", choices=sorted(PRESETS), help="a model from the paper")
    source.add_argument("--config", metavar="PATH", help="a transformers config.json (or its folder)")
    parser.add_argument("--bits", type=int, default=6,
                        help="nominal budget b̄ in bits/value (2..8, default 6)")
    parser.add_argument("--pivots", type=int, default=None,
                        help="FP16 pivot units (GDN heads / KDA key rows); default: the paper's share "
                             "(32 heads = 1.39%% for Qwen3.8-27B, 512 rows = 0.625%% for Kimi-Linear)")
    parser.add_argument("--batch", type=int, default=64, help="concurrent requests B (default 64)")
    parser.add_argument("--slots-per-request", type=int, default=5,
                        help="state slots reserved per request (default 5: SGLang radix caching, "
                             "(5B+1) slots)")
    parser.add_argument("--context", type=int, default=0,
                        help="context tokens per request for the attention-KV term of the totals (default 0)")
    parser.add_argument("--measured-bytes", type=int, default=None,
                        help="a measured bytes/request to convert to bits/value and ratio (e.g. 21804032)")
    parser.add_argument("--plan", metavar="DIR", default=None,
                        help="a calibrated plan directory (stepquant calibrate --out, e.g. "
                             "plans/gdn/stepquant-6): adds its bytes per request, counted in the plan's "
                             "stored format; give the plan's model with --config")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    parser.set_defaults(func=_run_memory)

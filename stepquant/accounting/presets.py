"""The models of the paper as shapes (``stepquant memory --preset``); any other model: shape_from_config."""

from __future__ import annotations

from stepquant.families import GDN, KDA, ModelShape

PRESETS: dict[str, ModelShape] = {
    "qwen3.8-27b": ModelShape(
        name="qwen3.8-27b",
        family=GDN,
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
        family=KDA,
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

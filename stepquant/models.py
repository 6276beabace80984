"""Loading the shipped small models (or any local checkpoint) offline through transformers.

Two small hybrid LMs ship in models/ (model cards there): "gdn", a Qwen3.5-style Gated DeltaNet
hybrid (Qwen3_5ForCausalLM), and "kda", a Kimi-Linear-style Kimi Delta Attention hybrid
(KimiLinearForCausalLM). Anywhere a model is asked for, a shipped name or a path to a local
transformers checkpoint directory works.

    from stepquant.models import load
    model, tokenizer = load("gdn")
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

MODELS_DIR = Path(__file__).resolve().parent.parent / "models"
SHIPPED = ("gdn", "kda")
GDN_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
KDA_TYPES = ("kimi_linear",)


def resolve(model: str | Path) -> Path:
    """A shipped name ("gdn", "kda") or a checkpoint directory -> the directory."""
    if isinstance(model, str) and model in SHIPPED:
        path = MODELS_DIR / model
    else:
        path = Path(model)
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"no model at {path}: pass a shipped name ({', '.join(SHIPPED)}) or a transformers checkpoint "
            "directory containing config.json"
        )
    return path


def model_type(model: str | Path) -> str:
    return json.loads((resolve(model) / "config.json").read_text())["model_type"]


def family(model_type_name: str) -> str:
    """'gdn' or 'kda' for a supported transformers model_type, else a clear error."""
    if model_type_name in GDN_TYPES:
        return "gdn"
    if model_type_name in KDA_TYPES:
        return "kda"
    raise ValueError(
        f"unsupported model_type {model_type_name!r}: stepquant supports Gated DeltaNet models "
        f"({', '.join(GDN_TYPES)}) and Kimi Delta Attention models ({', '.join(KDA_TYPES)})"
    )


def load(model: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu", device_map=None):
    """(model, tokenizer) from a shipped name or checkpoint path, offline, in eval mode.

    device_map (e.g. "auto") spreads a large checkpoint over several GPUs with accelerate;
    the recurrence itself is always computed in FP32 by stepquant.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve(model)
    family(model_type(path))
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    kwargs = {"dtype": dtype, "local_files_only": True}
    if device_map is not None:
        kwargs["device_map"] = device_map
    lm = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if device_map is None:
        lm.to(device)
    lm.eval()
    return lm, tokenizer

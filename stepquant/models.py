"""Loading the shipped small models (or any local checkpoint) offline through transformers.

Two small hybrid LMs ship in stepquant/assets/models/ (model cards there): "gdn", a Qwen3.5-style Gated
DeltaNet hybrid (Qwen3_5ForCausalLM), and "kda", a Kimi-Linear-style Kimi Delta Attention hybrid
(KimiLinearForCausalLM). Anywhere a model is asked for, a shipped name or a path to a local
transformers checkpoint directory works. A shipped model's weights are unpacked once into a cache
(stepquant.assets.checkpoint: bit-identical, sha256-checked).

    from stepquant.models import load
    model, tokenizer = load("gdn")
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import torch

from stepquant import assets
from stepquant.families import FAMILIES, family_for

SHIPPED = ("gdn", "kda")


def resolve(model: str | Path) -> Path:
    """A shipped name ("gdn", "kda") or a checkpoint directory -> the directory holding its config.json
    (for a shipped model the asset directory; :func:`checkpoint` gives one transformers can load)."""
    if isinstance(model, str) and model in SHIPPED:
        path = assets.MODELS / model
    else:
        path = Path(model)
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"no model at {path}: pass a shipped name ({', '.join(SHIPPED)}) or a transformers checkpoint "
            "directory containing config.json"
        )
    return path


def checkpoint(model: str | Path) -> Path:
    """A directory transformers loads: a shipped model unpacked into the cache, or the checkpoint given."""
    path = resolve(model)
    return assets.checkpoint(path) if path.resolve().parent == assets.MODELS else path


def model_type(model: str | Path) -> str:
    return json.loads((resolve(model) / "config.json").read_text())["model_type"]


_ORIGINAL_CHUNK_FUNCTIONS: dict[str, object] = {}


def _prefill_functions() -> list[tuple[str, str, str]]:
    """(modeling module, chunk function, recurrent function) of every supported model type, once per module:
    the chunked PyTorch function its multi-token path calls, which the token-by-token one computes too."""
    seen = {}
    for family in FAMILIES.values():
        for model_type in family.types.values():
            seen[model_type.modeling_module] = (model_type.modeling_module, *family.recurrence_functions)
    return list(seen.values())


def use_recurrent_prefill(enabled: bool = True) -> None:
    """Make transformers' multi-token GDN/KDA path run token by token (process-wide switch).

    On CPU, transformers' chunked PyTorch fallback is the slow part of a forward pass: the KDA one
    builds a [chunk, chunk, K] decay tensor per chunk and loops 63 times inside each chunk. The
    recurrent fallback computes the same function (same FP32 arithmetic order as the decode path)
    and is ~6x faster for KDA on 2 CPU cores (2 x 2048 tokens: 10.8 s vs 64.6 s, same loss).
    On GPU keep the chunked kernels (enabled=False restores them).
    """
    for module_name, chunk_name, recurrent_name in _prefill_functions():
        module = importlib.import_module(module_name)
        key = f"{module_name}.{chunk_name}"
        original = _ORIGINAL_CHUNK_FUNCTIONS.setdefault(key, getattr(module, chunk_name))
        if not enabled:
            setattr(module, chunk_name, original)
            continue
        recurrent = getattr(module, recurrent_name)

        def chunk_as_recurrent(
            query,
            key,
            value,
            g,
            beta,
            chunk_size=64,
            initial_state=None,
            output_final_state=False,
            use_qk_l2norm_in_kernel=False,
            _recurrent=recurrent,
            **kwargs,
        ):
            kwargs.pop("cu_seqlens", None)
            return _recurrent(
                query,
                key,
                value,
                g=g,
                beta=beta,
                initial_state=initial_state,
                output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            )

        setattr(module, chunk_name, chunk_as_recurrent)


def load(
    model: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    device_map=None,
    recurrent_prefill: bool | None = None,
):
    """(model, tokenizer) from a shipped name or checkpoint path, offline, in eval mode.

    device_map (e.g. "auto") spreads a large checkpoint over several GPUs with accelerate;
    the recurrence itself is always computed in FP32 by stepquant. recurrent_prefill (default:
    on when the model runs on CPU) switches transformers' multi-token path to its token-by-token
    function, see use_recurrent_prefill.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    family_for(model_type(model))
    path = checkpoint(model)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    kwargs = {"dtype": dtype, "local_files_only": True}
    if device_map is not None:
        kwargs["device_map"] = device_map
    lm = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if device_map is None:
        lm.to(device)
    lm.eval()
    if recurrent_prefill is None:
        recurrent_prefill = device_map is None and str(device).startswith("cpu")
    if recurrent_prefill:
        use_recurrent_prefill(True)
    return lm, tokenizer

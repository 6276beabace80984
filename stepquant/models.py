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

import functools
import importlib
import inspect
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


_ORIGINAL_FUNCTIONS: dict[str, object] = {}  # "module.name" -> transformers' function, before any switch


def _prefill_functions() -> list[tuple[str, str, str]]:
    """(modeling module, chunk function, recurrent function) of every supported model type, once per module:
    the chunked PyTorch function its multi-token path calls, which the token-by-token one computes too."""
    seen = {}
    for family in FAMILIES.values():
        for model_type in family.types.values():
            seen[model_type.modeling_module] = (model_type.modeling_module, *family.recurrence_functions)
    return list(seen.values())


def _on_cuda(args, kwargs) -> bool:
    """Whether a recurrence call's query (first argument) is a CUDA tensor."""
    query = args[0] if args else kwargs.get("query")
    return isinstance(query, torch.Tensor) and query.is_cuda


def _torch_implementation(fn):
    """transformers' PyTorch implementation behind a recurrence function (its ``__wrapped__``) for CPU
    tensors, ``fn`` itself for CUDA tensors.

    With fla installed, transformers' GDN/KDA functions call fla's Triton kernels whatever the device,
    which fail on CPU tensors ("Pointer argument cannot be accessed from Triton"); the CPU switch below
    calls the PyTorch function instead, with the keyword arguments it takes (as transformers' wrapper does).
    The choice is made per call, so a CPU model and a CUDA model work side by side in one process (the
    switches are process-wide: the lm-eval wrapper's GPU test compares the two).
    """
    torch_fn = getattr(fn, "__wrapped__", fn)
    accepted = inspect.signature(torch_fn).parameters

    @functools.wraps(torch_fn)
    def torch_only(*args, **kwargs):
        if _on_cuda(args, kwargs):
            return fn(*args, **kwargs)  # the model's kernels (fla's where installed)
        return torch_fn(*args, **{k: v for k, v in kwargs.items() if k in accepted})

    return torch_only


def use_torch_recurrences() -> None:
    """Set transformers' GDN/KDA functions to their PyTorch implementations (process-wide; a CPU model where
    fla is installed). use_recurrent_prefill(False) restores transformers' functions."""
    for module_name, *names in _prefill_functions():
        module = importlib.import_module(module_name)
        for name in names:
            original = _ORIGINAL_FUNCTIONS.setdefault(f"{module_name}.{name}", getattr(module, name))
            setattr(module, name, _torch_implementation(original))


def use_recurrent_prefill(enabled: bool = True) -> None:
    """The CPU switch (process-wide): transformers' PyTorch GDN/KDA functions, multi-token calls one by one.

    On CPU, transformers' chunked PyTorch fallback is the slow part of a forward pass: the KDA one
    builds a [chunk, chunk, K] decay tensor per chunk and loops 63 times inside each chunk. The
    recurrent fallback computes the same function (same FP32 arithmetic order as the decode path)
    and is ~6x faster for KDA on 2 CPU cores (2 x 2048 tokens: 10.8 s vs 64.6 s, same loss). Both
    names are set to the PyTorch implementation even where fla is installed (its kernels do not run on
    CPU tensors). Calls on CUDA tensors always reach transformers' functions (fla's kernels), whatever the
    switch; enabled=False restores transformers' functions.
    """
    for module_name, chunk_name, recurrent_name in _prefill_functions():
        module = importlib.import_module(module_name)
        originals = {name: _ORIGINAL_FUNCTIONS.setdefault(f"{module_name}.{name}", getattr(module, name))
                     for name in (chunk_name, recurrent_name)}
        if not enabled:
            for name, original in originals.items():
                setattr(module, name, original)
            continue
        recurrent = _torch_implementation(originals[recurrent_name])

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
            _chunk=originals[chunk_name],
            **kwargs,
        ):
            if _on_cuda((query,), {}):  # the model's chunk kernel (fla's where installed)
                return _chunk(query, key, value, g=g, beta=beta, chunk_size=chunk_size,
                              initial_state=initial_state, output_final_state=output_final_state,
                              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)
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
        setattr(module, recurrent_name, recurrent)


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
    function, see use_recurrent_prefill (for CPU tensors only: CUDA calls keep the model's kernels).
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
    on_cpu = device_map is None and str(device).startswith("cpu")
    if recurrent_prefill is None:
        recurrent_prefill = on_cpu
    if recurrent_prefill:
        use_recurrent_prefill(True)
    elif on_cpu:
        use_torch_recurrences()  # fla's kernels, where installed, fail on CPU tensors
    # on GPU nothing to switch: CUDA calls reach transformers' functions (fla's kernels) through any
    # switch, and a CPU model loaded before in this process keeps its PyTorch functions
    return lm, tokenizer


# ---------------------------------------------------------------- production-shape models with random weights

# Plausible sizes around the accounting presets' state shapes (stepquant.accounting.PRESETS): the public
# Qwen3.5-27B and Kimi-Linear-48B-A3B configurations. The recurrent state per layer (heads x K x V), the
# number of linear / full-attention layers and the attention KV per token are the presets'; widths not
# fixed by the presets (hidden, MLP, vocabulary) are the public models'.
RANDOM_PRESETS: dict[str, dict] = {
    "qwen3.8-27b": dict(
        model_type="qwen3_5_text", num_hidden_layers=64, vocab_size=248320, hidden_size=5120,
        intermediate_size=17408, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
        linear_num_value_heads=48, linear_num_key_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4, tie_word_embeddings=False, max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        full_attention_layers=(*range(3, 64, 4),),  # 0-indexed: every 4th layer (48 GDN + 16 attention)
    ),
    "kimi-linear-48b-a3b": dict(
        model_type="kimi_linear", num_hidden_layers=27, vocab_size=163840, hidden_size=2304,
        intermediate_size=9216, moe_intermediate_size=1024, num_local_experts=256, num_experts_per_tok=8,
        n_shared_experts=1, num_attention_heads=32, num_key_value_heads=32, kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, linear_num_heads=32, linear_head_dim=128,
        linear_conv_kernel_dim=4, tie_word_embeddings=False,
        full_attention_layers=(3, 7, 11, 15, 19, 23, 26),  # the public config's 1-indexed 4, 8, ..., 24, 27
    ),
}

# the dry-run shapes: the same families and layer mix, every width small (the CPU runs the torch reference)
_TINY = {
    "qwen3_5_text": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=32, linear_num_value_heads=4, linear_num_key_heads=2,
                         linear_key_head_dim=32, linear_value_head_dim=32),
    "kimi_linear": dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                        num_local_experts=8, num_experts_per_tok=2, num_attention_heads=2,
                        num_key_value_heads=2,
                        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                        linear_num_heads=2, linear_head_dim=32),
}


def random_layer_types(preset: str, layers: int | None = None) -> list[str]:
    """The preset's layer kinds; with fewer decoder layers, the same ~3:1 mix (every 4th layer attention)."""
    spec = RANDOM_PRESETS[_random_preset(preset)]
    full_depth = spec["num_hidden_layers"]
    layers = full_depth if layers is None else int(layers)
    if layers < 2:
        raise ValueError(f"layers must be >= 2 (one linear and one attention layer), got {layers}")
    if layers == full_depth:
        full = set(spec["full_attention_layers"])
    else:
        full = set(range(3, layers, 4)) or {layers - 1}
    return ["full_attention" if i in full else "linear_attention" for i in range(layers)]


def _random_preset(preset: str) -> str:
    if preset not in RANDOM_PRESETS:
        raise ValueError(f"unknown preset {preset!r}; available: {', '.join(sorted(RANDOM_PRESETS))}")
    return preset


def random_config(preset: str, layers: int | None = None, tiny: bool = False):
    """A transformers config of a production-shape model (:data:`RANDOM_PRESETS`), ``layers`` decoder layers
    (default the preset's depth) in the preset's layer mix; ``tiny`` shrinks every width for a CPU dry run."""
    from transformers import AutoConfig

    spec = dict(RANDOM_PRESETS[_random_preset(preset)])
    model_type = spec.pop("model_type")
    spec.pop("full_attention_layers")
    kinds = random_layer_types(preset, layers)
    spec.update(num_hidden_layers=len(kinds), layer_types=kinds)
    if tiny:
        spec.update(_TINY[model_type])
    if model_type == "kimi_linear":  # special tokens inside the vocabulary (DESIGN.md section 8)
        spec.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    else:
        spec.update(pad_token_id=0, bos_token_id=0, eos_token_id=0)
    return AutoConfig.for_model(model_type, **spec)


def build_random(preset: str, layers: int | None = None, *, device: str | torch.device = "cuda",
                 dtype: torch.dtype = torch.bfloat16, seed: int = 0, tiny: bool = False):
    """(model, info): a production-shape model (:func:`random_config`), random weights, built on ``device``.

    The weights are created where they live (``torch.device(device)`` is the default device while the modules
    are built, no CPU copy) in ``dtype`` and initialised by the model's own ``_init_weights`` from
    ``torch.manual_seed(seed)``. Timings, memory and capacity of such a model are real; its quality numbers
    are not. ``info``: parameter count, weight bytes, layer mix and the state shape (stepquant.families).
    """
    from transformers import AutoModelForCausalLM

    from stepquant.families import shape_from_config

    config = random_config(preset, layers, tiny)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    return model, random_info(preset, model, tiny, shape_from_config(config.to_dict()))


def random_info(preset: str, model, tiny: bool, shape) -> dict:
    params = sum(p.numel() for p in model.parameters())
    kinds = list(model.config.layer_types)
    full_depth = RANDOM_PRESETS[preset]["num_hidden_layers"]
    return {
        "preset": preset, "tiny": tiny, "model_type": model.config.model_type,
        "layers": len(kinds), "preset_layers": full_depth,
        "linear_layers": kinds.count("linear_attention"),
        "full_attention_layers": kinds.count("full_attention"),
        "heads": shape.heads, "key_dim": shape.key_dim, "value_dim": shape.value_dim,
        "hidden_size": model.config.hidden_size, "parameters": params,
        "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "fp32_state_bytes_per_request": shape.fp32_bytes, "conv_state_bytes": shape.conv_state_bytes,
        "kv_bytes_per_token": shape.kv_bytes_per_token,
        "note": ("random weights (seeded, built on the device): timings, memory and capacity are real, "
                 "quality is not" + ("" if len(kinds) == full_depth else
                                     f"; {len(kinds)} of the preset's {full_depth} decoder layers, same "
                                     "per-layer state shape and ~3:1 linear:attention mix")),
    }


def count_random_parameters(preset: str, layers: int | None = None) -> int:
    """Parameters of :func:`build_random`'s model, counted on the meta device (nothing allocated)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(random_config(preset, layers), dtype=torch.bfloat16)
    return sum(p.numel() for p in model.parameters())

"""GPU check of benchmarks/bench_generate.py's CUDA-graph decode (run on the H200 by benchmarks/h200_run.sh).

For each family (Qwen3.5 GDN + attention, Kimi-Linear KDA + MLA, random weights, small widths but the
recurrent heads of 128 x 128 the packed CUDA kernel serves) and each state format that can be replayed
(DynamicCache FP32, FloatStateCache BF16, PackedStateCache sq6 and its split step): one decode step captured
in a CUDA graph (stepquant.integrations.static_decode.GraphDecodeStep) and replayed gives, step after step,
the tokens and logits of the same steps run eagerly on the same static KV from the same prompt. The CPU side
(the static KV = transformers' DynamicCache path) is tests/test_bench_generate.py.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPT, WARMUP, STEPS, BATCH = 9, 2, 8, 4


def _bench():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_generate.py"
    spec = importlib.util.spec_from_file_location("bench_generate", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_generate", module)
    spec.loader.exec_module(module)
    return module


def small_model(preset: str, device: str = "cuda"):
    """build_random's tiny widths with 128 x 128 recurrent heads (the CUDA kernel's V = 128, K <= 128)."""
    from transformers import AutoModelForCausalLM

    from stepquant.models import random_config

    config = random_config(preset, 4, tiny=True)
    for name in ("linear_key_head_dim", "linear_value_head_dim", "linear_head_dim"):
        if hasattr(config, name):
            setattr(config, name, 128)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


def greedy(bench, model, fmt: str, graph: bool, device: str = "cuda"):
    """(tokens [STEPS, B], logits [STEPS, B, vocab], median host ms per step) of the STEPS greedy steps that
    follow the prefill and WARMUP eager steps (a graph's warm-up steps, before its capture)."""
    device = torch.device(device)
    cache = bench.make_cache(fmt, model, BATCH, device, bench.QUANTIZERS["reciprocal1"],
                             max_cache_len=PROMPT + WARMUP + STEPS + 4)
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, model.config.vocab_size, (BATCH, PROMPT), generator=gen).to(device)
    tokens, logits, host = [], [], []
    with torch.inference_mode():
        token = bench.forward(model, prompt, cache).argmax(-1)
        stepper = bench.Stepper(model, cache, token, graph, WARMUP, None, used=PROMPT)
        if not graph:
            for _ in range(WARMUP):
                stepper()
        for _ in range(STEPS):
            t0 = time.perf_counter()
            tokens.append(stepper().clone())
            host.append((time.perf_counter() - t0) * 1e3)
            if graph:
                logits.append(stepper.graph.logits.float().clone())
            else:  # the eager step's logits: the same forward, kept
                logits.append(stepper.last_logits.float().clone())
    return torch.stack(tokens), torch.stack(logits), sorted(host)[len(host) // 2]


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "sq6", "sq6-split"])
@pytest.mark.parametrize("preset", ["qwen3.8-27b", "kimi-linear-48b-a3b"], ids=["gdn", "kda"])
def test_graph_replays_give_the_eager_steps_tokens(preset, fmt):
    bench = _bench()
    model = small_model(preset)
    eager_tokens, eager_logits, eager_host = greedy(bench, model, fmt, graph=False)
    graph_tokens, graph_logits, graph_host = greedy(bench, model, fmt, graph=True)
    scale = eager_logits.abs().max()
    err = float((graph_logits - eager_logits).abs().max() / scale)
    print(f"{preset} {fmt}: host ms per step eager {eager_host:.2f}, graph replay {graph_host:.3f}; "
          f"max logit difference {err:.2e} of the largest")
    assert torch.equal(graph_tokens, eager_tokens), f"tokens differ (logits by {err:.2e} of the largest)"
    assert err < 1e-2

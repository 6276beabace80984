"""The static-shape decode path of benchmarks/bench_generate.py on CPU (stepquant.integrations.static_decode).

The CUDA graph replays one step of this path; what a graph cannot change is checked here without one: with
the attention KV static (preallocated, masked past the current position), N greedy steps of a tiny random
model of each family give the tokens and logits of transformers' DynamicCache path, for each state format
(DynamicCache FP32, FloatStateCache BF16, PackedStateCache sq6). The GPU side (graph replays = eager steps)
is tests/test_gpu_generate.py.
"""

from __future__ import annotations

import importlib.util
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from stepquant.integrations.static_decode import graph_safe, use_static_attention
from stepquant.models import build_random

PROMPT, STEPS, BATCH = 5, 6, 2


def _bench():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_generate.py"
    spec = importlib.util.spec_from_file_location("bench_generate", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_generate", module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: more threads only contend (100x slower on 2 cores)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["qwen3.8-27b", "kimi-linear-48b-a3b"], ids=["gdn", "kda"])
def model(request, one_thread):
    model, _ = build_random(request.param, 4, device="cpu", dtype=torch.float32, tiny=True)
    return model


def _run(bench, model, fmt: str, max_cache_len: int | None, break_mask: bool = False):
    """Logits [STEPS + 1, B, vocab] of the prefill and STEPS greedy steps through the benchmark's cache."""
    cache = bench.make_cache(fmt, model, BATCH, torch.device("cpu"), bench.QUANTIZERS["reciprocal1"],
                             max_cache_len=max_cache_len)
    if break_mask:  # the negative control: one layer that claims not to be static lets the mask be skipped
        layer = next(layer for layer in cache.layers if hasattr(layer, "max_cache_len"))
        layer.is_compileable = False
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (BATCH, PROMPT), generator=gen)
    logits = []
    with torch.inference_mode():
        for _ in range(STEPS + 1):
            logits.append(bench.forward(model, ids, cache))
            ids = logits[-1].argmax(-1)[:, None]
    return torch.stack(logits)


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "sq6"])
def test_static_kv_decode_matches_the_dynamic_cache(model, fmt):
    bench = _bench()
    dynamic = _run(bench, model, fmt, None)
    static = _run(bench, model, fmt, PROMPT + STEPS + 7)  # zero rows past the last position: masked
    assert torch.equal(static.argmax(-1), dynamic.argmax(-1))
    torch.testing.assert_close(static, dynamic, rtol=1e-4, atol=1e-4)


def test_the_comparison_sees_an_unmasked_static_kv(model):
    """With the single-token mask skipped the queries see the zero keys past their position: different
    logits, so the test above would catch a missing mask."""
    bench = _bench()
    dynamic = _run(bench, model, "fp32", None)
    unmasked = _run(bench, model, "fp32", PROMPT + STEPS + 7, break_mask=True)
    assert (unmasked[1:] - dynamic[1:]).abs().max() > 1e-3


def test_the_benchmark_stepper_counts_against_the_static_length(model):
    bench = _bench()
    args = Namespace(prompt=PROMPT, warmup=1, new_tokens=2, profile_steps=1)
    capacity = bench.positions_needed(args)
    cache = bench.make_cache("fp32", model, BATCH, torch.device("cpu"), bench.QUANTIZERS["reciprocal1"],
                             max_cache_len=capacity)
    token = torch.zeros(BATCH, dtype=torch.long)
    stepper = bench.Stepper(model, cache, token, False, 1, capacity, used=capacity - 1)
    with torch.inference_mode():
        stepper()
        with pytest.raises(RuntimeError, match="static KV holds"):
            stepper()


def test_static_attention_and_graph_safety(model):
    from transformers import DynamicCache
    from transformers.cache_utils import StaticLayer

    from stepquant.integrations.float_cache import FloatStateCache

    dynamic = DynamicCache(config=model.config)
    assert graph_safe(dynamic) is not None  # growing KV
    cache = use_static_attention(DynamicCache(config=model.config), 32)
    kinds = list(model.config.layer_types)
    static = [isinstance(layer, StaticLayer) for layer in cache.layers]
    assert static == [k == "full_attention" for k in kinds]
    assert cache.is_compileable and graph_safe(cache) is None
    assign = use_static_attention(FloatStateCache(model.config, torch.float32, assign=True), 32)
    assert "rebound" in graph_safe(assign)
    with torch.inference_mode():
        model(input_ids=torch.ones(1, 3, dtype=torch.long), past_key_values=dynamic, use_cache=True)
    with pytest.raises(ValueError, match="empty cache"):
        use_static_attention(dynamic, 32)
    with pytest.raises(ValueError, match="no layers"):
        use_static_attention(DynamicCache(), 32)


def test_decode_plan_puts_an_eager_row_beside_the_graph_rows():
    bench = _bench()
    args = Namespace(cuda_graph=True, eager_batches="4", kv="static")
    plan = list(bench.decode_plan([4, 2], ["fp32", "fp32-assign"], args, torch.device("cuda")))
    assert plan == [(4, "fp32", True), (4, "fp32", False), (4, "fp32-assign", True), (2, "fp32", True),
                    (2, "fp32-assign", True)]  # fp32-assign's "graph" row runs eagerly (graph_skip_reason)
    assert bench.graph_skip_reason("fp32-assign", args, torch.device("cuda")) is not None
    assert list(bench.decode_plan([2], ["fp32"], args, torch.device("cpu"))) == [(2, "fp32", False)]

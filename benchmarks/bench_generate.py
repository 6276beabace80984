"""Whole-model greedy decode and serving capacity at production shapes, for one H200 (issue 13, items 2-4).

Models: stepquant.models.build_random: a Qwen3.5-family GDN model with the qwen3.8-27b preset's state shape
(48 value heads of 128 x 128 per GDN layer, 3 GDN : 1 attention) and a Kimi-Linear KDA model with the
kimi-linear-48b-a3b preset's (32 heads of 128 x 128), random BF16 weights built on the GPU, fewer decoder
layers than the real models (--layers; same per-layer shapes and mix). Their timings, memory and capacity are
real; their tokens mean nothing.

Decode: B requests x --prompt tokens prefilled (fla's chunk kernels), then --new-tokens greedy single-token
steps through ``model(input_ids, past_key_values=cache)`` with each state format:

    fp32         transformers' DynamicCache: fla's FP32 recurrent kernel, result copied into the cache buffer
    fp32-assign  the same without the copy (FloatStateCache(assign=True)): the bytes of an in-place kernel
    bf16         FloatStateCache: BF16 buffers, fla's kernel reads BF16 and returns FP32, the cache casts back
    sq6, sq4     PackedStateCache with plan-shaped STEPQuant formats (stepquant.accounting.synthetic; shaped
                 like calibrated plans, not calibrated): readout + fitting + packed writeback in one kernel
    sq6-split    PackedStateCache(split=True): readout on the model's stream, writeback on a side stream

Steps: the eager loop issues a few kernels per layer from Python (and transformers' PyTorch causal-conv
fallback), so at these batches the host, not the state format, sets the step time. On a CUDA device each run
therefore captures ONE decode step (the forward of B tokens + argmax written into the next step's input ids)
in a CUDA graph and replays it (stepquant.integrations.static_decode.GraphDecodeStep, after --warmup eager
steps on a side stream; --no-cuda-graph turns it off). A graph needs static shapes: the attention layers'
KV is preallocated for the run's tokens (static_decode.use_static_attention, transformers' StaticLayer:
index_copy_ at a device-side position counter that also gives the model its positions and the mask its
offset; --kv dynamic keeps DynamicCache's torch.cat, eager only); the linear-attention layers keep their
format's cache. fp32-assign rebinds its state tensor every step, which a graph cannot replay: it runs
eagerly (graph_skipped in its rows). At --eager-batches (default 512) every format is also timed with the
eager loop on the same static KV, so graph and eager rows sit side by side (markdown: "CUDA graph vs the
eager loop"). A graph that fails to capture falls back to the eager loop (graph_error in the row).

Each step is timed with CUDA events (after the warm-up: --warmup eager steps, or a graph's first replay);
the host time to issue a step is timed beside it (a graph: one replay call), and one profiled step per
format and step kind at the largest batch splits the GPU time by kernel family (GEMMs = weights, the
recurrent-state kernels, attention, elementwise) and gives the GPU-busy fraction (1 - launch overhead).
Each row records "step" ("graph" or "eager") and "kv".

Capacity: for each preset at full depth, in the GPU's whole memory: a placeholder of the model's BF16 weight
bytes, then the largest batch whose (--slots-per-request x B + 1) state slots (recurrent state in each format
+ conv state) and B x context tokens of attention KV can be allocated (binary search over real allocations),
next to stepquant.accounting.max_batch (what ``stepquant memory --budget-gib`` prints) for the same budget.

    python benchmarks/bench_generate.py --out benchmarks/results      # H200, about 4 minutes
    python benchmarks/bench_generate.py --dry-run                     # CPU: tiny shapes, static KV, eager
    python benchmarks/bench_generate.py --plot-only benchmarks/results/bench_generate.json

Writes bench_generate.json after every run (a timeout leaves the runs done so far), bench_generate.md and
bench_generate.png (matplotlib) at the end; prints one JSON line last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stepquant.accounting import GIB, MIB, float_bytes, max_batch, stepquant_bytes  # noqa: E402
from stepquant.accounting.synthetic import synthetic_layer_formats  # noqa: E402
from stepquant.codecs.dual_axis import DualAxisConfig  # noqa: E402
from stepquant.eval.report import save_png  # noqa: E402
from stepquant.families import shape_from_config  # noqa: E402
from stepquant.kernels.prefill import untuned_triton_autotune  # noqa: E402
from stepquant.kernels.tables import FormatTables, Pages  # noqa: E402
from stepquant.models import RANDOM_PRESETS, build_random, count_random_parameters, random_config  # noqa: E402

FORMATS = ("fp32", "fp32-assign", "bf16", "sq6", "sq6-r0", "sq4", "sq6-split")
QUANTIZERS = {
    "reciprocal1": DualAxisConfig(division="reciprocal", refit_iters=1),  # the CUDA kernel's contract
    "reciprocal0": DualAxisConfig(division="reciprocal", refit_iters=0),  # sq6-r0: no refit (docs/kernels.md)
    "exact2": DualAxisConfig(division="exact", refit_iters=2),
}  # the committed plans' quantizer
SHORT = {"qwen3.8-27b": "qwen", "kimi-linear-48b-a3b": "kimi"}
START = time.time()
# STEPQUANT_UNTUNED_TRITON=1 (h200_run.sh): autotuned Triton kernels (fla's chunk prefill) run their first
# configuration, so the first prefill compiles in seconds rather than minutes; the decode kernels timed
# here (fla's recurrent steps, stepquant's CUDA kernel) are not autotuned either way
UNTUNED_TRITON = os.environ.get("STEPQUANT_UNTUNED_TRITON") == "1"
if UNTUNED_TRITON:
    untuned_triton_autotune()


def log(*args) -> None:
    print(f"[{time.time() - START:6.1f} s]", *args, flush=True)


class OutOfBudget(RuntimeError):
    """A dry-run stand-in for torch.cuda.OutOfMemoryError: the simulated budget is exceeded."""


# ---------------------------------------------------------------- state formats


def state_shape(model):
    return shape_from_config(model.config.to_dict())


def make_cache(fmt: str, model, batch: int, device: torch.device, quantizer: DualAxisConfig, seed: int = 0,
               max_cache_len: int | None = None):
    """The format's cache; with max_cache_len its attention KV is static (static_decode.use_static_attention:
    preallocated, written in place; what a CUDA graph needs), else transformers' growing DynamicLayer."""
    from stepquant.integrations.static_decode import use_static_attention

    cache = _format_cache(fmt, model, batch, device, quantizer, seed)
    return cache if max_cache_len is None else use_static_attention(cache, max_cache_len)


def _format_cache(fmt: str, model, batch: int, device: torch.device, quantizer: DualAxisConfig, seed: int):
    from transformers import DynamicCache

    from stepquant.integrations.float_cache import FloatStateCache
    from stepquant.integrations.packed_cache import PackedStateCache

    if fmt == "fp32":
        return DynamicCache(config=model.config)
    if fmt == "fp32-assign":
        return FloatStateCache(model.config, torch.float32, assign=True)
    if fmt == "bf16":
        return FloatStateCache(model.config, torch.bfloat16)
    bits = int(fmt[2])
    if fmt.endswith("-r0"):  # no refit: no worse at 6 bits (docs/results/quantizer_check_r0.md)
        quantizer = QUANTIZERS["reciprocal0"]
    formats = synthetic_layer_formats(state_shape(model), bits, seed, quantizer)
    return PackedStateCache(
        model.config, formats, max_batch=batch, device=device, split=fmt.endswith("split")
    )


def state_bytes(fmt: str, cache, shape, batch: int) -> int:
    """Recurrent-state bytes of the batch as held by the cache (all linear layers)."""
    if fmt.startswith("sq"):
        return int(cache.state_bytes()["held_bytes"])
    return shape.values * batch * (2 if fmt == "bf16" else 4)


# ---------------------------------------------------------------- decode


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer:
    """GPU time per step from CUDA events (CPU: wall time after a sync), host issue time beside it."""

    def __init__(self, device):
        self.device, self.marks, self.host = device, [], []

    def start(self):
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append([event, None])
        else:
            self.marks.append([time.perf_counter(), None])
        self.t0 = time.perf_counter()

    def stop(self):
        self.host.append(time.perf_counter() - self.t0)
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks[-1][1] = event
        else:
            self.marks[-1][1] = time.perf_counter()

    def gpu_ms(self) -> list[float]:
        sync(self.device)
        if self.device.type == "cuda":
            return [a.elapsed_time(b) for a, b in self.marks]
        return [(b - a) * 1e3 for a, b in self.marks]


def forward(model, ids, cache):
    return model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]


def positions_needed(args) -> int:
    """Tokens one decode run gives a request's cache: prompt, warm-up and timed steps, the graph's untimed
    first replay and the profiled steps (one warm), with room to spare; the static KV's length (a step past
    it would index out of range on the device)."""
    return args.prompt + args.warmup + 1 + args.new_tokens + 1 + args.profile_steps + 8


class Stepper:
    """One greedy decode step at a time, eager or replayed from a CUDA graph (GraphDecodeStep), counting the
    tokens given to the cache against its static length."""

    def __init__(self, model, cache, token, graph: bool, warmup: int, capacity: int | None, used: int):
        from stepquant.integrations.static_decode import GraphDecodeStep

        self.model, self.cache, self.capacity, self.used = model, cache, capacity, used
        self.token, self.last_logits = token, None
        self.graph = None
        if graph:
            self._count(warmup)  # the eager warm-up steps; the capture itself runs nothing
            self.graph = GraphDecodeStep(lambda ids: forward(model, ids, cache), token, cache, warmup=warmup)

    def _count(self, steps: int) -> None:
        self.used += steps
        if self.capacity is not None and self.used > self.capacity:
            raise RuntimeError(f"the static KV holds {self.capacity} tokens; this run needs more "
                               "(positions_needed)")

    def __call__(self) -> torch.Tensor:
        """One step; the next tokens [B] (a graph's output buffer: clone to keep it past the next step)."""
        self._count(1)
        if self.graph is not None:
            self.token = self.graph.step()
            self.last_logits = self.graph.logits
        else:
            self.last_logits = forward(self.model, self.token[:, None], self.cache)  # [B, vocab]
            self.token = self.last_logits.argmax(-1)
        return self.token


def prefill(model, fmt: str, batch: int, args, device, static_kv: bool):
    """A fresh cache of the format with a prompt of B x --prompt tokens prefilled: (cache, last tokens [B],
    prefill seconds, the cache's static length or None)."""
    gen = torch.Generator().manual_seed(batch)
    prompt = torch.randint(3, model.config.vocab_size, (batch, args.prompt), generator=gen).to(device)
    capacity = positions_needed(args) if static_kv else None
    cache = make_cache(fmt, model, batch, device, QUANTIZERS[args.quantizer], max_cache_len=capacity)
    sync(device)
    t0 = time.perf_counter()
    token = forward(model, prompt, cache).argmax(-1)  # [B]
    sync(device)
    return cache, token, time.perf_counter() - t0, capacity


def graph_skip_reason(fmt: str, args, device) -> str | None:
    """Why a run of this format is eager although CUDA graphs were asked for, or None."""
    if device.type != "cuda":
        return "no CUDA device"
    if args.kv == "dynamic":
        return "--kv dynamic: the attention KV grows by torch.cat every step"
    if fmt == "fp32-assign":
        return "fp32-assign rebinds the state tensor every step (static_decode.graph_safe)"
    return None


def decode_run(model, fmt: str, batch: int, args, device, graph: bool) -> dict:
    shape = state_shape(model)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    skip = graph_skip_reason(fmt, args, device) if graph else None
    graph = graph and skip is None
    with torch.inference_mode():
        cache, token, prefill_s, capacity = prefill(model, fmt, batch, args, device, args.kv == "static")
        t0 = time.perf_counter()
        stepper = Stepper(model, cache, token, graph, args.warmup, capacity, used=args.prompt)
        sync(device)
        capture_s = time.perf_counter() - t0
        timer = StepTimer(device)
        for _ in range((1 if graph else args.warmup) + args.new_tokens):  # a graph's first replay: untimed
            timer.start()
            stepper()
            timer.stop()
        warm = 1 if graph else args.warmup
        gpu = timer.gpu_ms()[warm:]
        host = [h * 1e3 for h in timer.host[warm:]]
        finite = bool(torch.isfinite(stepper.last_logits).all()) if args.check_finite else None
    gpu_sorted = sorted(gpu)
    median = gpu_sorted[len(gpu) // 2]
    row = {
        "format": fmt,
        "batch": batch,
        "step": "graph" if graph else "eager",
        "kv": args.kv,
        "prompt": args.prompt,
        "new_tokens": args.new_tokens,
        "prefill_s": round(prefill_s, 4),
        "ms_per_step": round(median, 4),
        "ms_per_step_mean": round(sum(gpu) / len(gpu), 4),
        "ms_per_step_min": round(gpu_sorted[0], 4),
        "host_issue_ms": round(sorted(host)[len(host) // 2], 4),
        "tokens_per_s": round(batch * 1e3 / median, 1),
        "state_bytes": state_bytes(fmt, cache, shape, batch),
        "state_bytes_per_request": state_bytes(fmt, cache, shape, batch) // batch,
        "finite": finite,
    }
    if graph:
        row["graph_capture_s"] = round(capture_s, 3)  # the eager warm-up steps and the capture
    if skip is not None:
        row["graph_skipped"] = skip
    if capacity is not None:
        row["static_kv_tokens"] = capacity
    if device.type == "cuda":
        row["peak_bytes"] = torch.cuda.max_memory_allocated(device)
        row["peak_above_weights_bytes"] = row["peak_bytes"] - base
    row["host_bound"] = row["host_issue_ms"] > 0.9 * row["ms_per_step"]
    if args.profile and batch == args.profile_batch:
        try:  # a profiler failure must not lose the timed row
            row["profile"] = profile_steps(stepper, device, args.profile_steps)
        except Exception as err:
            row["profile_error"] = repr(err)[:300]
            log(traceback.format_exc())
    del stepper, cache
    gc.collect()
    return row


KERNEL_FAMILIES = (  # first match wins; lower-case substrings of kernel names
    ("packed state kernel", ("packed_step", "packed_decode", "fused_packed", "pack_kernel")),
    ("fla recurrent (FP32/BF16 state)", ("fused_recurrent",)),
    ("attention", ("flash", "fmha", "attention", "sdpa", "efficient")),
    (
        "GEMM (weights)",
        ("gemm", "gemv", "cutlass", "nvjet", "sm90_", "matmul", "grouped", "cublas", "splitk"),
    ),
    ("copy / cast", ("copy", "cast", "convert")),
    ("conv / norm / elementwise", ("elementwise", "reduce", "norm", "conv", "softmax", "index", "cat", "")),
)


def profile_steps(stepper: Stepper, device, steps: int) -> dict:
    """GPU time per step by kernel family, and GPU-busy time / step time, from torch.profiler (the steps as
    the run took them: eager, or graph replays)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.inference_mode():
        stepper()  # warm
        sync(device)
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                stepper()
            sync(device)
            wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    families = {name: 0.0 for name, _ in KERNEL_FAMILIES}
    kernels = 0
    top = []
    for evt in prof.key_averages():
        if device.type == "cuda":
            us = getattr(evt, "self_device_time_total", 0) or 0
            if not us or evt.device_type != torch.autograd.DeviceType.CUDA:
                continue
        else:
            if evt.key.startswith("aten::") is False:
                continue
            us = evt.self_cpu_time_total
        kernels += evt.count
        name = evt.key.lower()
        family = next(f for f, keys in KERNEL_FAMILIES if any(k in name for k in keys))
        families[family] += us / 1e3 / steps
        top.append((us / 1e3 / steps, evt.key[:90]))
    busy = sum(families.values())
    top.sort(reverse=True)
    return {
        "steps": steps,
        "wall_ms_per_step": round(wall_ms, 4),
        "gpu_busy_ms_per_step": round(busy, 4),
        "gpu_busy_fraction": round(busy / wall_ms, 4) if wall_ms else None,
        "kernels_per_step": kernels // max(steps, 1),
        "ms_per_step_by_family": {k: round(v, 4) for k, v in families.items() if v},
        "top_kernels": [{"ms": round(ms, 4), "kernel": name} for ms, name in top[:8]],
        "note": "profiled steps run slower than unprofiled ones; the fractions are what to read",
    }


# ---------------------------------------------------------------- capacity


def capacity_section(preset: str, args, device, record) -> None:
    """Largest batch per state format in the device's memory, measured by allocation and from the model."""
    config = random_config(preset, None if not args.dry_run else 4, tiny=args.dry_run)
    shape = shape_from_config(config.to_dict())
    params = count_random_parameters(preset, None if not args.dry_run else 4) if not args.dry_run else None
    if args.dry_run:
        model, _ = build_random(preset, 4, device="cpu", tiny=True)
        params = sum(p.numel() for p in model.parameters())
        del model
    weight_bytes = params * 2
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)  # after empty_cache: torch holds nothing here
        budget = total
    else:  # the dry run: a simulated device with room for weights and a few dozen requests
        total = free = budget = weight_bytes + 40 * (5 * shape.fp32_bytes + 64 * shape.kv_bytes_per_token)
    formats = {"fp32": float_bytes(shape, 32).serving_bytes, "bf16": float_bytes(shape, 16).serving_bytes}
    layer_formats = {}  # format -> the pool's FormatTables of every layer (built once; a try allocates pages)
    for bits in (6, 4):
        fmts = synthetic_layer_formats(shape, bits, 0, QUANTIZERS[args.quantizer])
        layer_formats[f"sq{bits}"] = [FormatTables(f, shape.value_dim, device) for f in fmts]
        formats[f"sq{bits}"] = sum(f.bytes(shape.value_dim) for f in fmts)
    log(
        f"capacity {preset}: {shape.linear_layers} linear layers x {shape.heads} heads, weights "
        f"{weight_bytes / GIB:.2f} GiB, device total {total / GIB:.2f} GiB, free {free / GIB:.2f} GiB"
    )
    placeholder = None
    try:
        placeholder = allocate(weight_bytes, device, [0], budget)
        for context in args.capacity_context:
            for fmt, slot_state in formats.items():
                nominal = (
                    stepquant_bytes(shape, int(fmt[2])).serving_bytes if fmt.startswith("sq") else slot_state
                )
                analytical = max_batch(shape, nominal, budget, weight_bytes, args.slots_per_request, context)
                used = [weight_bytes]

                def fits(b, fmt=fmt, context=context, used=used):
                    return try_allocate(
                        fmt, b, shape, layer_formats, context, args.slots_per_request, device, budget, used
                    )

                measured = largest(fits, max(analytical * 2, 16))
                row = {
                    "preset": preset,
                    "context_tokens": context,
                    "format": fmt,
                    "slots_per_request": args.slots_per_request,
                    "state_bytes_per_slot": slot_state,
                    "nominal_state_bytes_per_slot": nominal,
                    "conv_bytes_per_slot": shape.conv_state_bytes,
                    "kv_bytes_per_token": shape.kv_bytes_per_token,
                    "weight_bytes": weight_bytes,
                    "budget_bytes": budget,
                    "analytical_max_batch": analytical,
                    "measured_max_batch": measured,
                    "analytical_max_batch_in_free_memory": max_batch(
                        shape, slot_state, free, weight_bytes, args.slots_per_request, context
                    ),
                }
                log(f"  context {context}: {fmt:<5} analytical B = {analytical}, measured B = {measured}")
                record(row)
    finally:
        del placeholder
        if device.type == "cuda":
            torch.cuda.empty_cache()


def allocate(num_bytes: int, device, used: list[int], budget: int):
    if device.type != "cuda":  # the dry run: enforce the simulated budget, allocate nothing large
        used[0] += num_bytes
        if used[0] > budget:
            raise OutOfBudget(f"{used[0]} > {budget}")
        return torch.empty(0)
    return torch.empty(num_bytes, dtype=torch.uint8, device=device)


def try_allocate(fmt, batch, shape, layer_formats, context, slots_per_request, device, budget, used) -> bool:
    """Whether (r B + 1) slots of the format + conv states + B x context KV fit beside the weights.

    A packed format allocates the pages a PackedStatePool of that many slots holds (Pages.empty per layer)."""
    slots = slots_per_request * batch + 1
    held, counter = [], [used[0]]
    try:
        if fmt.startswith("sq") and device.type == "cuda":
            held.append([Pages.empty(tables, slots) for tables in layer_formats[fmt]])
        elif fmt.startswith("sq"):  # dry run: the pages' exact bytes, counted (one slot allocated)
            pages = [Pages.empty(tables, 1) for tables in layer_formats[fmt]]
            pool_bytes = sum(t.numel() * t.element_size() for p in pages for t in p.tensors()) * slots
            held.append(allocate(pool_bytes, device, counter, budget))
        else:
            dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
            dims = (slots, shape.linear_layers, shape.heads, shape.key_dim, shape.value_dim)
            if device.type == "cuda":
                held.append(torch.empty(dims, dtype=dtype, device=device))
            else:
                held.append(
                    allocate(int(torch.tensor(dims).prod()) * dtype.itemsize, device, counter, budget)
                )
        held.append(allocate(slots * (shape.conv_state_bytes or 0), device, counter, budget))
        held.append(allocate(batch * context * (shape.kv_bytes_per_token or 0), device, counter, budget))
        return True
    except (torch.cuda.OutOfMemoryError, OutOfBudget):
        return False
    finally:
        del held
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def largest(fits, hi: int) -> int:
    """The largest b >= 0 with fits(b) (fits monotone), by doubling then bisection."""
    if not fits(1):
        return 0
    lo = 1
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# ---------------------------------------------------------------- report


def step_of(row: dict) -> str:
    """How a row's steps ran: "graph" (CUDA graph replays) or "eager" (results before graphs: eager)."""
    return row.get("step", "eager")


def primary_runs(result: dict) -> dict:
    """(preset, format, batch) -> the row that stands for it: the graph row where one ran, else the eager."""
    runs = {}
    for r in result["runs"]:
        key = (r["preset"], r["format"], r["batch"])
        if "tokens_per_s" in r and (key not in runs or step_of(r) == "graph"):
            runs[key] = r
    return runs


def targets(result: dict) -> dict:
    """Issue 13's targets per model: at the largest batch where fp32 and sq6 both ran the same way (graph
    replays where they could), sq6's tokens/s over fp32's (and fp32-assign's, which runs eagerly only: from
    the eager rows at that batch where both have one); the measured capacity of sq6 over fp32 with no
    context (the pool alone)."""
    out = {}
    runs = primary_runs(result)
    eager = {
        (r["preset"], r["format"], r["batch"]): r
        for r in result["runs"]
        if "tokens_per_s" in r and step_of(r) == "eager"
    }
    for preset in dict.fromkeys(r["preset"] for r in result["runs"]):
        both = [
            b
            for (p, f, b) in runs
            if p == preset
            and f == "sq6"
            and (p, "fp32", b) in runs
            and step_of(runs[(p, "fp32", b)]) == step_of(runs[(p, f, b)])
        ]
        entry = {}
        if both:
            b = max(both)
            sq6 = runs[(preset, "sq6", b)]
            entry = {
                "batch": b,
                "step": step_of(sq6),
                "sq6_over_fp32": round(sq6["tokens_per_s"] / runs[(preset, "fp32", b)]["tokens_per_s"], 3),
            }
            for name, table in (("", runs), ("_eager", eager)):
                pair = table.get((preset, "sq6", b)), table.get((preset, "fp32-assign", b))
                if all(pair) and step_of(pair[0]) == step_of(pair[1]):
                    entry[f"sq6_over_fp32_assign{name}"] = round(
                        pair[0]["tokens_per_s"] / pair[1]["tokens_per_s"], 3
                    )
                    break
        out[preset] = entry
    for c in result["capacity"]:
        if c["context_tokens"] == 0 and c["format"] == "sq6":
            fp32 = next(
                (
                    d
                    for d in result["capacity"]
                    if (d["preset"], d["context_tokens"], d["format"]) == (c["preset"], 0, "fp32")
                ),
                None,
            )
            if fp32 and fp32["measured_max_batch"]:
                out.setdefault(c["preset"], {})["capacity_sq6_over_fp32"] = round(
                    c["measured_max_batch"] / fp32["measured_max_batch"], 3
                )
    return out


def per_billion(result: dict) -> dict:
    """What a model costs per 1e9 parameters: weight GiB, build seconds, prefill seconds per 64K prompt tokens
    (the largest fp32 prefill), decode ms per step at the smallest fp32 batch (weight-bound)."""
    out = {}
    for preset, info in result["models"].items():
        billions = info["parameters"] / 1e9
        fp32 = sorted(
            (r for (p, f, _), r in primary_runs(result).items() if p == preset and f == "fp32"),
            key=lambda r: r["batch"],
        )
        entry = {
            "weights_gib": round(info["weight_bytes"] / GIB / billions, 3),
            "build_s": round(info.get("build_s", 0) / billions, 3),
        }
        if fp32:
            big, small = fp32[-1], fp32[0]
            tokens = big["batch"] * big["prompt"]
            entry["prefill_s_per_64k_tokens"] = round(big["prefill_s"] * 65536 / tokens / billions, 4)
            entry[f"decode_ms_per_step_at_B{small['batch']}"] = round(small["ms_per_step"] / billions, 4)
        out[preset] = entry
    return out


def markdown(result: dict) -> str:
    lines = [
        f"# Whole-model decode and capacity ({result['device']}, {result['date']})",
        "",
        "Random-weight models of the presets' state shapes (stepquant.models.build_random): timings, memory "
        "and capacity are real, quality is not. STEPQuant formats are plan-shaped (accounting.synthetic), "
        "not calibrated.",
        "",
    ]
    for info in result["models"].values():
        lines.append(
            f"- {info['preset']}: {info['layers']} decoder layers ({info['linear_layers']} "
            f"{'GDN' if 'qwen' in info['model_type'] else 'KDA'} + {info['full_attention_layers']} "
            f"attention) of the preset's {info['preset_layers']}, {info['heads']} heads of "
            f"{info['key_dim']}x{info['value_dim']}, hidden {info['hidden_size']}, "
            f"{info['parameters'] / 1e9:.4g} B parameters ({info['weight_bytes'] / GIB:.2f} GiB BF16); "
            f"built in {info.get('build_s', 0):.1f} s"
        )
    lines += ["", "Per billion parameters (for sizing a real checkpoint; README 'On GPUs'):"]
    for preset, entry in per_billion(result).items():
        lines.append(f"- {preset}: " + ", ".join(f"{k} {v}" for k, v in entry.items()))
    lines += [
        "",
        "Targets (issue 13: sq6 >= 1.2x fp32 tokens/s at B = 512 on the 27B shape; capacity >= 4.5x):",
    ]
    for preset, entry in targets(result).items():
        lines.append(f"- {preset}: {json.dumps(entry)}")
    lines += [
        "",
        "## Decode (greedy, prompt + new tokens per request; median GPU time per step)",
        "",
        "step: graph = each step replayed from one CUDA graph (static_decode.GraphDecodeStep), eager = "
        "the Python loop; vs fp32 / fp32-assign: against the row of the same step kind at that batch "
        "(fp32-assign runs eagerly only).",
        "",
        "| model | format | B | step | ms/step | tokens/s | vs fp32 | vs fp32-assign | host issue ms | "
        "state GiB | peak GiB | prefill s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    runs = [r for r in result["runs"] if "ms_per_step" in r]
    ref = {(r["preset"], r["batch"], r["format"], step_of(r)): r for r in runs}
    for r in runs:
        fp32 = ref.get((r["preset"], r["batch"], "fp32", step_of(r)))
        fp32a = ref.get((r["preset"], r["batch"], "fp32-assign", step_of(r)))
        vs = lambda base, r=r: f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"  # noqa: E731
        lines.append(
            f"| {SHORT.get(r['preset'], r['preset'])} | {r['format']} | {r['batch']} | {step_of(r)} | "
            f"{r['ms_per_step']:.2f} | {r['tokens_per_s']:,.0f} | {vs(fp32)} | {vs(fp32a)} | "
            f"{r['host_issue_ms']:.2f} | {r['state_bytes'] / GIB:.2f} | "
            f"{r.get('peak_bytes', 0) / GIB:.2f} | {r['prefill_s']:.2f} |"
        )
    skipped = [r for r in result["runs"] if "ms_per_step" not in r]
    for r in skipped:
        lines.append(
            f"- not run: {r['preset']} {r['format']} B={r['batch']} {r.get('step', '')}: "
            f"{r.get('skipped', '')}"
        )
    for r in runs:
        for key in ("graph_error", "graph_skipped"):
            if key in r:
                lines.append(f"- eager: {r['preset']} {r['format']} B={r['batch']}: {r[key]}")
    pairs = [
        (r, ref[(r["preset"], r["batch"], r["format"], "eager")])
        for r in runs
        if step_of(r) == "graph" and (r["preset"], r["batch"], r["format"], "eager") in ref
    ]
    if pairs:
        lines += [
            "",
            "## CUDA graph vs the eager loop (same format, batch and static KV)",
            "",
            "| model | format | B | graph ms/step | eager ms/step | graph speed-up | eager host issue ms | "
            "graph replay host ms |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for g, e in pairs:
            lines.append(
                f"| {SHORT.get(g['preset'], g['preset'])} | {g['format']} | {g['batch']} | "
                f"{g['ms_per_step']:.2f} | {e['ms_per_step']:.2f} | "
                f"{e['ms_per_step'] / g['ms_per_step']:.2f}x | "
                f"{e['host_issue_ms']:.2f} | {g['host_issue_ms']:.3f} |"
            )
    profiles = [r for r in runs if "profile" in r]
    if profiles:
        lines += [
            "",
            "## Where a step's time goes (torch.profiler, one format at the profiled batch)",
            "",
            "| model | format | B | step | step ms (profiled) | GPU busy | by kernel family (ms/step) |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in profiles:
            p = r["profile"]
            fam = "; ".join(f"{k} {v:.2f}" for k, v in p["ms_per_step_by_family"].items())
            lines.append(
                f"| {SHORT.get(r['preset'], r['preset'])} | {r['format']} | {r['batch']} | {step_of(r)} | "
                f"{p['wall_ms_per_step']:.2f} | {p['gpu_busy_fraction']:.0%} | {fam} |"
            )
    if result["capacity"]:
        lines += [
            "",
            "## Capacity in the whole device memory (weights at full depth, BF16)",
            "",
            "| model | context | format | slot MiB | B analytical | B measured | vs fp32 (measured) |",
            "|---|---|---|---|---|---|---|",
        ]
        fp32 = {(c["preset"], c["context_tokens"]): c for c in result["capacity"] if c["format"] == "fp32"}
        for c in result["capacity"]:
            base = fp32.get((c["preset"], c["context_tokens"]))
            ratio = (
                f"{c['measured_max_batch'] / base['measured_max_batch']:.2f}x"
                if base and base["measured_max_batch"]
                else "-"
            )
            slot = (c["state_bytes_per_slot"] + (c["conv_bytes_per_slot"] or 0)) / MIB
            lines.append(
                f"| {SHORT.get(c['preset'], c['preset'])} | {c['context_tokens']} | {c['format']} | "
                f"{slot:.2f} | {c['analytical_max_batch']} | {c['measured_max_batch']} | {ratio} |"
            )
        lines.append("")
        lines.append(
            "B analytical: stepquant.accounting.max_batch with the device's total memory as the budget "
            "(`stepquant memory --budget-gib`); B measured: real allocations beside a weights-sized "
            "placeholder, so the CUDA context and allocator rounding come off it."
        )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    runs = [r for r in result["runs"] if "ms_per_step" in r]
    presets = list(dict.fromkeys(r["preset"] for r in runs))
    if not presets:
        return False
    fig, axes = plt.subplots(2, len(presets), figsize=(6 * len(presets), 8), squeeze=False)
    for col, preset in enumerate(presets):
        graphs = any(step_of(r) == "graph" for r in runs)
        for number, fmt in enumerate(FORMATS):  # one colour per format; the eager loop dashed, open squares
            for step in ("graph", "eager"):
                rows = sorted(
                    (r for r in runs if r["preset"] == preset and r["format"] == fmt and step_of(r) == step),
                    key=lambda r: r["batch"],
                )
                if not rows:
                    continue
                b = [r["batch"] for r in rows]
                label = f"{fmt} (eager)" if graphs and step == "eager" else fmt
                eager = label != fmt
                style = dict(
                    color=f"C{number}", label=label, linestyle="--" if eager else "-",
                    marker="s" if eager else "o", markerfacecolor="none" if eager else None,
                )
                axes[0][col].plot(b, [r["tokens_per_s"] for r in rows], **style)
                if step == "graph" or not graphs:  # memory: one line per format
                    axes[1][col].plot(b, [r.get("peak_bytes", r["state_bytes"]) / GIB for r in rows], **style)
        memory = "peak GPU memory (GiB)" if "cpu" not in result["device"] else "state (GiB; peak on a GPU)"
        for row, ylabel in ((0, "decode tokens/s"), (1, memory)):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch B")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        axes[0][col].set_title(f"{preset} shape, random weights ({result['device']})")
    fig.tight_layout()
    save_png(fig, path)
    return True


# ---------------------------------------------------------------- main


def run_line(preset: str, row: dict) -> str:
    return (
        f"{SHORT.get(preset, preset)} {row['format']:<11} B={row['batch']:<4} {step_of(row):<5} "
        f"{row['ms_per_step']:8.2f} ms/step "
        f"{row['tokens_per_s']:10,.0f} tok/s  host {row['host_issue_ms']:.2f} ms  state "
        f"{row['state_bytes'] / GIB:.2f} GiB  peak {row.get('peak_bytes', 0) / GIB:.2f} GiB"
    )


def decode_plan(batches: list[int], formats: list[str], args, device):
    """(batch, format, graph) of every decode run in order: per batch and format the graph row (where the
    format can be replayed) and, at --eager-batches, the eager row beside it; eager rows only without
    --cuda-graph or a CUDA device."""
    graphs = args.cuda_graph and device.type == "cuda"
    eager = set(batches) if args.eager_batches == "all" else (
        set() if args.eager_batches in ("none", "") else {int(b) for b in args.eager_batches.split(",")}
    )
    for batch in batches:
        for fmt in formats:
            if not graphs:
                yield batch, fmt, False
                continue
            yield batch, fmt, True
            if batch in eager and graph_skip_reason(fmt, args, device) is None:  # else the row above is eager
                yield batch, fmt, False


def timed_row(model, fmt: str, batch: int, args, device, graph: bool, graph_failed: dict) -> dict:
    """decode_run's row, or the reason it has none; a graph that fails falls back to the eager loop (and the
    format's later rows go eager: graph_failed)."""
    try:
        return decode_run(model, fmt, batch, args, device, graph)
    except torch.cuda.OutOfMemoryError:
        log(f"{fmt} B={batch}: out of memory")
        return {"skipped": "out of memory"}
    except Exception as err:
        log(traceback.format_exc())
        if not graph:
            return {"skipped": f"error: {err!r}"[:300]}
        graph_failed[fmt] = f"graph failed at B={batch}: {err!r}"[:300]
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    row = timed_row(model, fmt, batch, args, device, False, graph_failed)
    return {**row, "step": "eager", "graph_error": graph_failed[fmt]}


DEFAULT_LAYERS = {"qwen3.8-27b": 16, "kimi-linear-48b-a3b": 8}  # 12 GDN + 4 attention; 6 KDA + 2 MLA


def parse_layers(text: str | None, presets: list[str]) -> dict[str, int | None]:
    """--layers: one value for every preset or one per preset ('full' = the preset's depth)."""
    if text is None:
        return {p: DEFAULT_LAYERS.get(p) for p in presets}
    values = [v.strip() for v in text.split(",")]
    if len(values) == 1:
        values = values * len(presets)
    if len(values) != len(presets):
        raise SystemExit(f"--layers needs one value or one per preset ({len(presets)})")
    return {p: (None if v in ("full", "") else int(v)) for p, v in zip(presets, values, strict=True)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--presets",
        default="qwen3.8-27b,kimi-linear-48b-a3b",
        help=f"comma list of {', '.join(RANDOM_PRESETS)}",
    )
    parser.add_argument(
        "--layers",
        default=None,
        help="decoder layers: one value or one per preset, 'full' = the preset's depth (default: qwen 16 = "
        "12 GDN + 4 attention, kimi 8 = 6 KDA + 2 MLA)",
    )
    parser.add_argument("--batches", default="512,256,128,64,32", help="batch sizes, run in this order")
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"comma list of {', '.join(FORMATS)}")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--new-tokens", type=int, default=24, help="timed greedy steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    parser.add_argument(
        "--quantizer",
        choices=sorted(QUANTIZERS),
        default="reciprocal1",
        help="dual-axis quantizer of the STEPQuant formats (default: the CUDA kernel's)",
    )
    parser.add_argument("--profile-batch", type=int, default=512, help="batch whose runs are also profiled")
    parser.add_argument("--profile-steps", type=int, default=2)
    parser.add_argument("--no-profile", dest="profile", action="store_false")
    parser.add_argument("--capacity-context", default="0,4096", help="context tokens of KV per request")
    parser.add_argument(
        "--slots-per-request", type=int, default=5, help="state slots per request (5: radix cache)"
    )
    parser.add_argument("--no-capacity", dest="capacity", action="store_false")
    parser.add_argument("--no-decode", dest="decode", action="store_false")
    parser.add_argument(
        "--time-limit",
        type=float,
        default=170.0,
        help="seconds from the start after which the remaining decode runs are skipped (recorded as "
        "skipped); of the time left after the capacity section the first of two presets gets 60%%, "
        "the second the rest (a preset that finishes early leaves its time to the next)",
    )
    parser.add_argument(
        "--cuda-graph",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="replay each decode step from a CUDA graph (static_decode.GraphDecodeStep; on a CUDA device, "
        "for every format but fp32-assign); --no-cuda-graph: the eager loop only",
    )
    parser.add_argument(
        "--eager-batches",
        default="512",
        help="batches also timed with the eager loop beside the graph rows (comma list, 'all' or 'none'; "
        "ignored with --no-cuda-graph, where every row is eager)",
    )
    parser.add_argument(
        "--kv",
        choices=("static", "dynamic"),
        default="static",
        help="attention KV: static (preallocated for the run's tokens, written in place; what a graph needs) "
        "or dynamic (transformers' DynamicLayer, torch.cat every step; eager only)",
    )
    parser.add_argument("--check-finite", action="store_true", help="the last step's logits are finite")
    parser.add_argument("--out", default=None, help="directory for bench_generate.{json,md,png}")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, every code path")
    parser.add_argument("--plot-only", metavar="JSON", default=None, help="draw the plot of a result file")
    args = parser.parse_args(argv)

    if args.plot_only:
        path = Path(args.plot_only)
        ok = plot(json.loads(path.read_text()), path.with_suffix(".png"))
        print(f"plot {'written' if ok else 'skipped (no matplotlib)'}: {path.with_suffix('.png')}")
        return 0
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    layers = parse_layers(args.layers, presets)
    batches = [int(b) for b in args.batches.split(",")]
    formats = [f.strip() for f in args.formats.split(",")]
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        raise SystemExit(f"unknown formats {unknown}; choose from {', '.join(FORMATS)}")
    args.capacity_context = [int(c) for c in args.capacity_context.split(",")]
    if args.dry_run:
        device = torch.device("cpu")
        layers = {p: 4 for p in presets}
        batches, args.prompt, args.new_tokens, args.warmup = [3, 2], 8, 3, 1
        args.profile_batch, args.profile_steps = 3, 1
        formats = [f for f in formats if not f.endswith("split")]  # two CUDA streams
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA GPU: use --dry-run on a CPU")
        device = torch.device("cuda", torch.cuda.current_device())
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": "bench_generate",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu ({platform.machine()})",
        "torch": torch.__version__,
        "dry_run": args.dry_run,
        "argv": sys.argv[1:],
        "settings": {
            "prompt": args.prompt,
            "new_tokens": args.new_tokens,
            "warmup": args.warmup,
            "batches": batches,
            "formats": formats,
            "quantizer": args.quantizer,
            "slots_per_request": args.slots_per_request,
            "capacity_context": args.capacity_context,
            "untuned_triton_autotune": UNTUNED_TRITON,
            "cuda_graph": args.cuda_graph and device.type == "cuda",
            "eager_batches": args.eager_batches,
            "kv": args.kv,
        },
        "models": {},
        "runs": [],
        "capacity": [],
    }

    def save():
        if out:
            (out / "bench_generate.json").write_text(json.dumps(result, indent=1))

    def record_capacity(row):
        result["capacity"].append(row)
        save()

    if args.capacity:
        for preset in presets:
            try:
                capacity_section(preset, args, device, record_capacity)
            except Exception:
                log(traceback.format_exc())
    if args.decode:
        decode_start = time.time()
        shares = [0.6, 0.4] if len(presets) == 2 else [1 / len(presets)] * len(presets)  # the first gets more
        for number, preset in enumerate(presets):
            share = sum(shares[: number + 1])
            deadline = decode_start + (START + args.time_limit - decode_start) * share
            if time.time() > deadline:
                result["runs"].append(
                    {"preset": preset, "format": "*", "batch": "*", "skipped": "time limit"}
                )
                continue
            t0 = time.time()
            try:
                model, info = build_random(preset, layers[preset], device=device, tiny=args.dry_run)
            except Exception:
                log(traceback.format_exc())
                continue
            sync(device)
            info["build_s"] = round(time.time() - t0, 2)
            result["models"][preset] = info
            log(
                f"built {preset}: {info['layers']} layers, {info['parameters'] / 1e9:.3f} B parameters, "
                f"{info['weight_bytes'] / GIB:.2f} GiB in {info['build_s']} s"
            )
            save()
            graph_failed: dict[str, str] = {}  # format -> why its graph failed: later rows eager
            for batch, fmt, graph in decode_plan(batches, formats, args, device):
                graph = graph and fmt not in graph_failed
                row = {"preset": preset, "format": fmt, "batch": batch, "step": "graph" if graph else "eager"}
                if time.time() > deadline:
                    row["skipped"] = "time limit"
                else:
                    row.update(timed_row(model, fmt, batch, args, device, graph, graph_failed))
                    if "ms_per_step" in row:
                        log(run_line(preset, row))
                result["runs"].append(row)
                save()
            del model
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    text = markdown(result)
    print(text, flush=True)
    if out:
        (out / "bench_generate.md").write_text(text)
        if plot(result, out / "bench_generate.png"):
            log(f"plot: {out / 'bench_generate.png'}")
    save()
    primary = primary_runs(result)
    summary = {  # preset/format/batch: the graph row where one ran; an eager row beside it: .../eager
        "/".join(map(str, (r["preset"], r["format"], r["batch"])))
        + ("" if primary[(r["preset"], r["format"], r["batch"])] is r else "/eager"): r["tokens_per_s"]
        for r in result["runs"]
        if "tokens_per_s" in r
    }
    print(
        json.dumps(
            {
                "targets": targets(result),
                "per_billion_parameters": per_billion(result),
                "bench_generate": summary,
                "capacity": {
                    f"{c['preset']}/{c['context_tokens']}/{c['format']}": [
                        c["analytical_max_batch"],
                        c["measured_max_batch"],
                    ]
                    for c in result["capacity"]
                },
            },
            separators=(",", ":"),
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())

"""One decode token on packed states vs fla's FP32 kernels (GDN and KDA shapes), for the H200.

What is timed, per model shape and batch B (K = V = 128):

- fla baselines: the model's own fused_recurrent kernel on FP32 states (GDN:
  fused_recurrent_gated_delta_rule, out of place; KDA: fused_recurrent_kda, out of place), fla's
  in-place continuous-batching kernel (fused_recurrent_kda_fwd with ssm_state_indices; a GDN gate is
  broadcast over K, which is the same math) on an FP32 and on a BF16 slot pool.
- ours, at 4, 6 and 8 bits with plans shaped like shipped ones (GDN: head widths around b plus ~1.4% FP16
  pivot heads; KDA: mixed row widths plus 0.625% FP16 pivot rows): the CUDA kernel (packed_step.cu) with
  the reciprocal quantizer and one refit and with the first quantizer (exact division, two refits: the
  shipped baseline plans', and the STEPQuant plans' until issue 12); the paper's split (readout alone =
  the latency on the token's critical path; writeback alone);
  the Triton kernel (fused.py); uniform rowwise absmax INT-b (the paper's baseline).
- at batches up to --graph-below, the fused steps and fla's kernel also replayed from a CUDA graph
  ("[graph]" rows): the GPU time without Python's launch overhead, as a captured serving step runs.

Each time is triton.testing.do_bench's median (it flushes the L2 before every call; slots also rotate
over a pool several times the L2 size). Bytes moved count what the step must read and write: the
states of the B slots (packed pages, or FP32/BF16) plus q, k, v, g, beta read and y written. Achieved
bandwidth is compared with a device-to-device copy measured in the same run (read + write counted).

    python benchmarks/bench_decode.py --out benchmarks/results   # full run (a few minutes on an H200)
    python benchmarks/bench_decode.py --quick                     # B in {32, 512}, 4 and 6 bits
    python benchmarks/bench_decode.py --dry-run                   # CPU, Triton interpreter, tiny shapes

Prints a table last, then one JSON line; with --out writes bench_decode.json and bench_decode.md.
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv:  # before anything imports triton
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stepquant.accounting.synthetic import spread_widths  # noqa: E402
from stepquant.codecs import LayerFormat  # noqa: E402
from stepquant.codecs.base import PIVOT_BITS  # noqa: E402
from stepquant.codecs.dual_axis import DualAxisConfig  # noqa: E402
from stepquant.codecs.packing import unpack  # noqa: E402
from stepquant.kernels.decode import cuda, fused_decode, naive_packed_decode  # noqa: E402
from stepquant.kernels.decode.fused import work_buffer  # noqa: E402
from stepquant.pool import PackedLayer  # noqa: E402

KEY_DIM = VALUE_DIM = 128
MODELS = {
    "gdn": dict(heads=48, key_heads=16, kda=False, label="GDN, Qwen3.8 shape (48 heads, 16 q/k heads)"),
    "kda": dict(heads=32, key_heads=32, kda=True, label="KDA, Kimi-Linear shape (32 heads)"),
}
GDN_PIVOT_SHARE = 32 / 2304  # the paper's pivot heads (Qwen3.8-27B)
KDA_PIVOT_SHARE = 512 / 81920  # the paper's pivot rows (Kimi-Linear)
DEVICE = "cuda"


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- plans

def synthetic_plan(model: str, bits: int, heads: int, seed: int = 0) -> torch.Tensor:
    """A plan [H, K] shaped like the paper's at budget ``bits`` (each FP16 pivot replaces an 8-bit unit; the
    draw of the committed runs: accounting.synthetic.synthetic_bits draws whole models for bench_generate)."""
    gen = torch.Generator().manual_seed(seed + bits)
    if model == "gdn":
        pivots = max(1, round(heads * GDN_PIVOT_SHARE))
        choices = [b for b in range(bits - 1, bits + 3) if 2 <= b <= 8]
        head_bits = spread_widths(heads - pivots, bits * heads - 8 * pivots, choices, gen)
        head_bits = torch.cat([head_bits, torch.full((pivots,), PIVOT_BITS)])
        head_bits = head_bits[torch.randperm(heads, generator=gen)]
        return head_bits[:, None].expand(heads, KEY_DIM).to(torch.int8).contiguous()
    rows = heads * KEY_DIM
    pivots = max(1, round(rows * KDA_PIVOT_SHARE))
    choices = [b for b in range(bits - 2, bits + 3) if 2 <= b <= 8]
    row_bits = spread_widths(rows - pivots, bits * rows - 8 * pivots, choices, gen)
    row_bits = torch.cat([row_bits, torch.full((pivots,), PIVOT_BITS)])
    return row_bits[torch.randperm(rows, generator=gen)].reshape(heads, KEY_DIM).to(torch.int8)


# the fused steps the JSON line reports (the tuning variants stay in the tables)
HEADLINE_VARIANTS = ("cuda fused (reciprocal, 1 refit)", "cuda fused (exact, 2 refits)")
# the quantizers timed: the first one (exact division, two refits) and the kernel's contract
EXACT_2 = DualAxisConfig(division="exact", refit_iters=2)
RECIPROCAL_1 = DualAxisConfig(division="reciprocal", refit_iters=1)
RECIPROCAL_0 = DualAxisConfig(division="reciprocal", refit_iters=0)  # no refit: the c init is kept
MIDTREAD_1 = DualAxisConfig(grid="midtread", division="reciprocal", refit_iters=1)  # stepquant-4 before
# the shipped STEPQuant plans' quantizers since the row fill (docs/eval.md section 11): 6 and 4 bits
FILL_0 = DualAxisConfig(division="reciprocal", refit_iters=0, row_fill=True)
FILL_MIDTREAD_1 = DualAxisConfig(grid="midtread", division="reciprocal", refit_iters=1, row_fill=True)


def make_layer(bits: torch.Tensor, spatial: str, num_slots: int, config: DualAxisConfig = EXACT_2,
               seed: int = 0) -> PackedLayer:
    gen = torch.Generator().manual_seed(seed)
    w = torch.exp(0.5 * torch.randn(bits.shape, generator=gen))  # row-impact factors, log-normal
    layer = PackedLayer(LayerFormat(bits, w, spatial, config), num_slots, VALUE_DIM, DEVICE)
    fill_random(layer, seed)
    return layer


def fill_random(layer: PackedLayer, seed: int) -> None:
    """Random codes, sane FP16 scales, finite FP16 pivots: a state the kernel can step forever."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    words = torch.randint(-(2**31), 2**31 - 1, layer.pages.codes.shape, generator=gen, device=DEVICE,
                          dtype=torch.int64)
    layer.pages.codes.copy_(words.to(torch.int32))
    for scales in layer.tensors():
        if scales.dtype == torch.float16:
            scales.copy_(torch.rand(scales.shape, generator=gen, device=DEVICE) * 0.05 + 0.01)
    pivot_rows = torch.nonzero(layer.tables.row_bits.cpu() == PIVOT_BITS).flatten()
    if pivot_rows.numel():
        counts = layer.layout.row_words.to(torch.int64)[pivot_rows].tolist()
        starts = layer.tables.row_word_offset.cpu().to(torch.int64)[pivot_rows].tolist()
        index = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, counts, strict=True)])
        values = torch.randn(layer.num_slots, index.numel() * 2, generator=gen, device=DEVICE) * 0.3
        layer.pages.codes[:, index.to(DEVICE)] = values.half().view(torch.int32)


# ---------------------------------------------------------------- inputs and timing

def token_inputs(batch: int, heads: int, key_heads: int, kda: bool, seed: int = 0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, device=DEVICE)
    q = rand(batch, key_heads, KEY_DIM).bfloat16()
    k = rand(batch, key_heads, KEY_DIM).bfloat16()
    v = rand(batch, heads, VALUE_DIM).bfloat16()
    g_shape = (batch, heads, KEY_DIM) if kda else (batch, heads)
    g = torch.nn.functional.logsigmoid(rand(*g_shape) + 4.0)  # log decay, mostly near 0
    beta = torch.sigmoid(rand(batch, heads))
    return q, k, v, g, beta


def input_bytes(q, k, v, g, beta) -> int:
    """q, k, v, g, beta read and y (v's shape and dtype) written."""
    return sum(t.numel() * t.element_size() for t in (q, k, v, g, beta)) + v.numel() * v.element_size()


def rotating(call, choices: list):
    """A no-argument step that calls ``call(choice)`` with the next of ``choices`` every time."""
    state = {"i": 0}

    def step():
        state["i"] += 1
        return call(choices[state["i"] % len(choices)])

    return step


def bench(fn, warmup: int, rep: int) -> float:
    if DEVICE != "cuda":  # dry run: one call, wall time
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def bench_graph(call, choices: list, warmup: int, rep: int, steps: int = 8) -> float:
    """ms per call of ``call(choice)`` replayed from a CUDA graph of ``steps`` calls over ``choices``: the
    GPU time of a step without the Python launch overhead, as a serving engine's captured decode runs it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compilation, allocations) outside the capture
        for choice in choices[:2]:
            call(choice)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(steps):
            call(choices[i % len(choices)])
    return bench(graph.replay, warmup, rep) / steps


def copy_bandwidth(warmup: int, rep: int, size: int = 2**30) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second."""
    buffers = torch.empty(2, size, dtype=torch.uint8, device=DEVICE)
    ms = bench(lambda: buffers[1].copy_(buffers[0]), warmup, rep)
    return 2 * size / (ms * 1e-3)


def rotation_groups(group_bytes: int, l2_bytes: int = 60 * 2**20) -> int:
    """Disjoint slot groups to rotate over so the working set is at least 4x the L2."""
    return max(2, min(16, math.ceil(4 * l2_bytes / max(group_bytes, 1))))


def slot_groups(groups: int, batch: int) -> list[torch.Tensor]:
    return [torch.arange(i * batch, (i + 1) * batch, device=DEVICE, dtype=torch.int32) for i in range(groups)]


# ---------------------------------------------------------------- fla baselines

class Fla:
    """fla 0.6.0's decode kernels, found by name; missing ones are reported, not fatal."""

    def __init__(self) -> None:
        self.error = self.version = None
        self.gdn = self.kda = self.kda_fwd = None
        try:
            import fla

            self.version = getattr(fla, "__version__", "?")
            from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
            from fla.ops.kda import fused_recurrent_kda

            self.gdn, self.kda = fused_recurrent_gated_delta_rule, fused_recurrent_kda
            try:
                from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

                params = inspect.signature(fused_recurrent_kda_fwd).parameters
                if "inplace_final_state" in params and "ssm_state_indices" in params:
                    self.kda_fwd = fused_recurrent_kda_fwd
                    self.kda_fwd_out = "out" in params
            except Exception as err:  # an fla without the in-place entry point
                log(f"fla in-place KDA entry point unavailable: {err!r}")
        except Exception as err:
            self.error = repr(err)
            log(f"fla unavailable, baselines skipped: {self.error}")

    @staticmethod
    def prepare(q, k, v, g, beta) -> dict:
        """fla's [B, T=1, ...] views of one token's inputs, made once outside the timed region."""
        g_kda = g if g.dim() == 3 else g[..., None].expand(*g.shape, KEY_DIM)  # GDN gate broadcast over K
        return dict(q=q[:, None].contiguous(), k=k[:, None].contiguous(), v=v[:, None].contiguous(),
                    g=g[:, None].float().contiguous(), g_kda=g_kda[:, None].float().contiguous(),
                    beta=beta[:, None].contiguous(), out=torch.empty_like(v[:, None]))

    def inplace_step(self, pool, slots, t):
        """fla's in-place continuous-batching step (KDA kernel; a GDN gate is broadcast over K)."""
        extra = {"out": t["out"]} if self.kda_fwd_out else {}
        return self.kda_fwd(q=t["q"], k=t["k"], v=t["v"], g=t["g_kda"], beta=t["beta"], initial_state=pool,
                            output_final_state=False, inplace_final_state=True, ssm_state_indices=slots,
                            use_qk_l2norm_in_kernel=True, **extra)

    def own_step(self, kda: bool, state, t):
        """The model's own fused_recurrent kernel, reading h0 and writing a new final state."""
        fn = self.kda if kda else self.gdn
        return fn(q=t["q"], k=t["k"], v=t["v"], g=t["g"], beta=t["beta"], initial_state=state,
                  output_final_state=True, use_qk_l2norm_in_kernel=True)


# ---------------------------------------------------------------- the run

class Recorder:
    def __init__(self, copy_bps: float):
        self.copy_bps, self.rows = copy_bps, []

    def add(self, model, variant, bits, batch, ms, moved, **extra) -> None:
        rate = moved / (ms * 1e-3)
        row = dict(model=model, variant=variant, bits=bits, batch=batch, ms=ms, bytes=moved,
                   tbps=rate / 1e12, copy_fraction=rate / self.copy_bps, **extra)
        self.rows.append(row)
        log(f"  {model} {variant:30s} {bits!s:>4s} B={batch:4d} {ms:9.4f} ms {row['tbps']:6.2f} TB/s")


def run_fla(name: str, spec: dict, args, fla: Fla, rec: Recorder) -> None:
    heads, key_heads, kda = spec["heads"], spec["key_heads"], spec["kda"]
    for dtype, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        for batch in args.batches:
            state_bytes = batch * heads * KEY_DIM * VALUE_DIM * torch.finfo(dtype).bits // 8
            groups = rotation_groups(state_bytes)
            pool = (torch.randn(groups * batch, heads, KEY_DIM, VALUE_DIM, device=DEVICE) * 0.1).to(dtype)
            slots = slot_groups(groups, batch)
            inputs = token_inputs(batch, heads, key_heads, kda)
            prepared = fla.prepare(*inputs)
            moved = 2 * state_bytes + input_bytes(*inputs)
            if fla.kda_fwd is not None:
                step = rotating(lambda s, pool=pool, t=prepared: fla.inplace_step(pool, s, t), slots)
                try:
                    ms = bench(step, args.warmup, args.rep)
                    rec.add(name, f"fla in-place {tag}", tag, batch, ms, moved)
                except Exception as err:
                    log(f"  fla in-place {tag} failed: {err!r}")
            if tag == "fp32":  # the model's own kernel, out of place (reads h0, writes a new ht)
                states = [pool[s.long()] for s in slots[:2]]
                step = rotating(lambda h, t=prepared: fla.own_step(kda, h, t), states)
                try:
                    rec.add(name, f"fla {name} fp32", tag, batch, bench(step, args.warmup, args.rep), moved)
                    if batch <= args.graph_below and DEVICE == "cuda":
                        ms = bench_graph(lambda h, t=prepared: fla.own_step(kda, h, t), states, args.warmup,
                                         args.rep)
                        rec.add(name, f"fla {name} fp32 [graph]", tag, batch, ms, moved)
                except Exception as err:
                    log(f"  fla {name} fp32 failed: {err!r}")
                del states
            del pool
            if DEVICE == "cuda":
                torch.cuda.empty_cache()


def run_ours(name: str, spec: dict, args, rec: Recorder) -> None:
    heads, key_heads, kda = spec["heads"], spec["key_heads"], spec["kda"]
    max_batch = max(args.batches)
    use_cuda = DEVICE == "cuda" and cuda.nvcc_path() is not None
    for bits in args.bits:
        plan = synthetic_plan(name, bits, heads)
        uniform = torch.full((heads, KEY_DIM), bits, dtype=torch.int8)
        # (variant, spatial, quantizer, part, backend)
        todo = [("cuda fused (reciprocal, 1 refit)", "dual_axis", RECIPROCAL_1, "fused", "cuda"),
                ("cuda fused (reciprocal, no refit)", "dual_axis", RECIPROCAL_0, "fused", "cuda"),
                ("cuda fused (mid-tread, 1 refit)", "dual_axis", MIDTREAD_1, "fused", "cuda"),
                # the shipped STEPQuant plans' quantizers: 6 bits no refit, 4 bits mid-tread with one
                ("cuda fused (row fill, no refit)", "dual_axis", FILL_0, "fused", "cuda"),
                ("cuda fused (row fill, mid-tread, 1 refit)", "dual_axis", FILL_MIDTREAD_1, "fused", "cuda"),
                ("cuda fused (exact, 2 refits)", "dual_axis", EXACT_2, "fused", "cuda")]
        if bits in args.split_bits:
            todo += [("cuda fused (reciprocal, 1 refit) 16 warps", "dual_axis", RECIPROCAL_1, "fused",
                      "cuda-16w"),
                     ("cuda readout (split) 16 warps", "dual_axis", RECIPROCAL_1, "readout", "cuda-16w"),
                     ("cuda readout (split)", "dual_axis", RECIPROCAL_1, "readout", "cuda"),
                     ("cuda writeback (split)", "dual_axis", RECIPROCAL_1, "writeback", "cuda"),
                     ("triton fused (exact, 2 refits)", "dual_axis", EXACT_2, "fused", "triton")]
        todo += [("cuda rowwise absmax INT", "absmax", EXACT_2, "fused", "cuda")]
        rows = cuda.TUNING["SQ_ROWS"]  # the default, or STEPQUANT_CUDA_ROWS
        for variant, spatial, config, part, backend in todo:
            if backend.startswith("cuda") and not use_cuda:
                continue
            cuda.TUNING["SQ_ROWS"] = 8 if backend == "cuda-16w" else rows  # 16 warps of 8 key rows per CTA
            table = uniform if spatial == "absmax" else plan
            slot_bytes = LayerFormat(table, None, spatial).bytes(VALUE_DIM)
            layer = make_layer(table, spatial, rotation_groups(max_batch * slot_bytes) * max_batch, config)
            for batch in args.batches:
                inputs = token_inputs(batch, heads, key_heads, kda)
                out = torch.empty(batch, heads, VALUE_DIM, device=DEVICE, dtype=torch.bfloat16)  # as fla
                kwargs = dict(use_qk_l2norm=True, out=out, part=part)
                if backend.startswith("cuda"):
                    if part != "fused":  # the split: the readout leaves u in work, the writeback reads it
                        kwargs["work"] = torch.zeros(batch, heads, VALUE_DIM, device=DEVICE)
                    fn = cuda.decode
                else:
                    if part == "writeback":
                        kwargs["work"] = work_buffer(layer.tables, batch).zero_()
                    fn = fused_decode
                tensors = layer.tables, layer.pages
                call = lambda s, fn=fn, t=tensors, x=inputs, kw=kwargs: fn(*t, s, *x, **kw)
                groups = slot_groups(layer.num_slots // batch, batch)
                # every part reads the slots and the token's inputs; readout writes y, writeback the slots
                moved = input_bytes(*inputs) + batch * slot_bytes
                if part == "writeback":
                    moved -= out.numel() * out.element_size()
                if part != "readout":
                    moved += batch * slot_bytes
                extra = dict(part=part, backend=backend, quantizer=f"{config.division}/{config.refit_iters}",
                             bits_per_value=slot_bytes * 8 / (heads * KEY_DIM * VALUE_DIM))
                try:
                    rec.add(name, variant, bits, batch, bench(rotating(call, groups), args.warmup, args.rep),
                            moved, **extra)
                    if batch <= args.graph_below and DEVICE == "cuda" and part == "fused":
                        ms = bench_graph(call, groups, args.warmup, args.rep)
                        rec.add(name, variant + " [graph]", bits, batch, ms, moved, **extra)
                except Exception:
                    log(traceback.format_exc())
            del layer
            cuda.TUNING["SQ_ROWS"] = rows
            if DEVICE == "cuda":
                torch.cuda.empty_cache()


def check(name: str, spec: dict) -> list[dict]:
    """Each kernel vs the torch reference on a small batch: relative RMS of y and of the new states; a
    kernel that fails (e.g. its build) gets an error entry and the others are still checked."""
    kernels = [("triton", EXACT_2, fused_decode)]
    if DEVICE == "cuda" and cuda.nvcc_path() is not None:
        kernels += [("cuda", EXACT_2, cuda.decode), ("cuda", RECIPROCAL_1, cuda.decode),
                    ("cuda-16w", RECIPROCAL_1, cuda.decode)]
    results = []
    for backend, config, fn in kernels:
        quantizer = f"{config.division}/{config.refit_iters}"
        try:
            with cuda.tuning(SQ_ROWS=8 if backend == "cuda-16w" else cuda.TUNING["SQ_ROWS"]):
                results.append(dict(model=name, backend=backend, quantizer=quantizer,
                                    **check_one(name, spec, config, fn)))
        except Exception:
            log(traceback.format_exc())
            results.append(dict(model=name, backend=backend, quantizer=quantizer,
                                error=traceback.format_exc(limit=2)))
    return results


def check_one(name: str, spec: dict, config, fn) -> dict:
    """One kernel (decode function fn, quantizer config) against the torch reference."""
    heads, key_heads, kda = spec["heads"], spec["key_heads"], spec["kda"]
    layer = make_layer(synthetic_plan(name, 6, heads), "dual_axis", 8, config)
    twin = PackedLayer(layer.format, 8, VALUE_DIM, DEVICE)
    for a, b in zip(twin.tensors(), layer.tensors(), strict=True):
        a.copy_(b)
    slots = torch.tensor([5, -1, 0, 3], dtype=torch.int32, device=DEVICE)
    inputs = token_inputs(4, heads, key_heads, kda, seed=1)
    y = torch.zeros(4, heads, VALUE_DIM, device=DEVICE)  # FP32 outputs: no BF16 rounding in the check
    y_ref = torch.zeros_like(y)
    fn(layer.tables, layer.pages, slots, *inputs, use_qk_l2norm=True, out=y)
    naive_packed_decode(twin, slots, *inputs, use_qk_l2norm=True, out=y_ref)
    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())
    index = torch.tensor([5, 0, 3])
    got, want = unpack(layer.gather(index)), unpack(twin.gather(index))
    return dict(y_rel_rms=rel(y[[0, 2, 3]], y_ref[[0, 2, 3]]),
                state_rel_rms=rel(got.dequantize(), want.dequantize()),
                codes_equal_fraction=float((got.codes == want.codes).float().mean()),
                row_scales_equal_fraction=float((got.row_scale == want.row_scale).float().mean()))


def markdown(result: dict) -> str:
    rows, env = result["rows"], result["env"]
    lines = [f"# Decode step on packed states ({env['gpu']})", "",
             f"copy bandwidth (read + write): {result['copy_tbps']:.2f} TB/s; fla {env['fla']}; "
             f"torch {env['torch']}; triton {env['triton']}; {result['seconds']:.0f} s", ""]
    for name in result["models"]:
        own = f"fla {name} fp32"
        base = {r["batch"]: r["ms"] for r in rows if r["model"] == name and r["variant"] == own}
        lines += [f"## {result['labels'][name]}", "", "| variant | bits | B | ms | TB/s | of copy BW | "
                  "x vs fla FP32 |", "|---|---|---|---|---|---|---|"]
        for r in (r for r in rows if r["model"] == name):
            speedup = f"{base[r['batch']] / r['ms']:.2f}" if r["batch"] in base else "-"
            lines.append(f"| {r['variant']} | {r['bits']} | {r['batch']} | {r['ms']:.4f} | {r['tbps']:.2f} | "
                         f"{100 * r['copy_fraction']:.0f}% | {speedup} |")
        lines.append("")
    lines += ["## checks (each kernel vs the torch reference, 6-bit plan)", ""]
    lines += [f"- {json.dumps(c)}" for c in result["checks"]]
    return "\n".join(lines) + "\n"


def summary_table(result: dict) -> str:
    """The short table printed last: the largest batch, every variant."""
    rows, big = result["rows"], max(result["batches"])
    out = [f"{'model':5s} {'variant':30s} {'bits':>5s} {'B':>5s} {'ms':>9s} {'TB/s':>6s} {'copy%':>6s} "
           f"{'x fla':>6s}"]
    for name in result["models"]:
        base = next((r["ms"] for r in rows if r["model"] == name and r["batch"] == big
                     and r["variant"] == f"fla {name} fp32"), None)
        for r in rows:
            if r["model"] == name and r["batch"] == big:
                x = f"{base / r['ms']:.2f}" if base else "-"
                out.append(f"{name:5s} {r['variant']:30s} {r['bits']!s:>5s} {big:5d} {r['ms']:9.4f} "
                           f"{r['tbps']:6.2f} {100 * r['copy_fraction']:5.0f}% {x:>6s}")
    return "\n".join(out)


def main(argv=None) -> int:
    global DEVICE, KEY_DIM, VALUE_DIM
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="directory for bench_decode.json and .md")
    parser.add_argument("--models", default="gdn,kda", help="comma list of gdn, kda")
    parser.add_argument("--batches", default="32,64,128,256,512", help="comma list of batch sizes")
    parser.add_argument("--bits", default="4,6,8", help="comma list of nominal bit budgets")
    parser.add_argument("--split-bits", default="6", help="budgets also timed split and without refit")
    parser.add_argument("--graph-below", type=int, default=64,
                        help="also time fused steps replayed from a CUDA graph at batches up to this")
    parser.add_argument("--warmup", type=int, default=10, help="do_bench warm-up time (ms)")
    parser.add_argument("--rep", type=int, default=40, help="do_bench measuring time (ms)")
    parser.add_argument("--no-fla", action="store_true", help="skip the fla baselines")
    parser.add_argument("--quick", action="store_true", help="B in {32, 512}, 4 and 6 bits")
    parser.add_argument("--dry-run", action="store_true", help="CPU + Triton interpreter, tiny shapes")
    args = parser.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",") if x]
    args.models = [m for m in args.models.split(",") if m]
    args.batches, args.bits, args.split_bits = ints(args.batches), ints(args.bits), ints(args.split_bits)
    models = {m: dict(MODELS[m]) for m in args.models}
    if args.quick:
        args.batches, args.bits = [32, 512], [4, 6]
    if args.dry_run:  # every code path, tiny: 2 heads of 16 x 16, two batch sizes
        DEVICE, KEY_DIM, VALUE_DIM = "cpu", 16, 16
        args.batches, args.bits, args.no_fla = [2, 3], [6], True
        for spec in models.values():
            spec.update(heads=2, key_heads=1 if not spec["kda"] else 2)
    elif not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        print("bench_decode needs a CUDA GPU with TRITON_INTERPRET unset (or --dry-run)", file=sys.stderr)
        return 2

    import triton

    started = time.time()
    fla = Fla() if not args.no_fla else None
    copy_bps = copy_bandwidth(args.warmup, args.rep, 2**30 if DEVICE == "cuda" else 2**20)
    log(f"copy bandwidth {copy_bps / 1e12:.3f} TB/s")
    rec, checks = Recorder(copy_bps), []
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run)"
    fla_version = "skipped" if fla is None else (fla.version or f"unavailable ({fla.error})")

    def snapshot() -> dict:
        result = dict(
            env=dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__, fla=fla_version,
                     python=platform.python_version()),
            copy_tbps=copy_bps / 1e12, models=list(models), labels={m: MODELS[m]["label"] for m in models},
            batches=args.batches, rows=rec.rows, checks=checks, seconds=time.time() - started,
            args={k: v for k, v in vars(args).items() if k != "out"},
        )
        if args.out is not None:  # written after every model, so a time limit still leaves results
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "bench_decode.json").write_text(json.dumps(result, indent=1, default=str))
            (args.out / "bench_decode.md").write_text(markdown(result))
        return result

    for name, spec in models.items():
        try:
            checks.extend(check(name, spec))
        except Exception:
            log(traceback.format_exc())
            checks.append(dict(model=name, error=traceback.format_exc(limit=2)))
        if fla is not None and fla.error is None:
            run_fla(name, spec, args, fla, rec)
        run_ours(name, spec, args, rec)
        result = snapshot()
    print(summary_table(result))
    big = max(args.batches)
    headline = {f"{r['model']}_{r['bits']}b_{r['quantizer'].replace('/', '')}_ms": round(r["ms"], 5)
                for r in rec.rows if r["batch"] == big and r["variant"] in HEADLINE_VARIANTS}
    headline.update({f"{r['model']}_fla_fp32_ms": round(r["ms"], 5) for r in rec.rows
                     if r["batch"] == big and r["variant"] == f"fla {r['model']} fp32"})
    print(json.dumps(dict(bench="decode", gpu=gpu, batch=big, copy_tbps=round(copy_bps / 1e12, 3), **headline,
                          checks=checks, seconds=round(result["seconds"], 1))))
    return 0


if __name__ == "__main__":
    sys.exit(main())

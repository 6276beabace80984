"""Deferred fitting on packed states vs the per-token step and fla's FP32 step (GDN and KDA shapes), on a GPU.

The deferred format (stepquant/codecs/deferred.py, served by stepquant/kernels/decode/deferred.py) reads the
packed codes every token and fits and writes them every R-th token; between fits it keeps the decay and the
rank-1 updates since the last fit (FP16) beside the slot. What is timed, per model shape, batch B and
budget (the shipped STEPQuant quantizers: 6 bits row fill without a refit, 4 bits row fill, mid-tread, one
refit; synthetic plans shaped like the shipped ones, as bench_decode.py's):

- "per-token fused": the shipped step (R = 1), for reference; "readout alone": the split readout (with the
  FP32 FMAs of the other parts, and with its sums on tensor cores, SQ_MMA: "tensor-core sums");
- "deferred R": a cycle of R tokens (R - 1 readouts with the pending updates, then one fit) divided by R:
  the mean per-token cost; "readout token" / "fit token": the two kinds of token alone (R - 2 and R - 1
  pending updates); one launch per token (the kernel sums the gate and decays the held updates; the fit in
  one pass, the fused step with the pending updates); "[split fit]": the fit as the readout then the
  writeback; "[torch gates]": the gate sum and the decay as torch ops before the kernel (b866649's way);
  "[tensor-core readout]" / "[FP32 readout]": the readout tokens' sums the other way from the family's
  default (cuda.mma_for: tensor cores for KDA, FP32 FMAs for GDN);
- fla's own FP32 step in the same run; at batches up to --graph-below, fla, the fused step and a deferred
  cycle also replayed from a CUDA graph ("[graph]": the GPU time without Python's launch overhead);
- with ``--source NAME=PATH`` (repeatable), the deferred rows also for that version of packed_step.cu
  ("[NAME]": one pass, in-kernel gates), timed right after the current source's on the same slots: a
  kernel change is judged within one run (its Params struct must be this version's).

Every time is triton.testing.do_bench's median (L2 flushed before every call; slots rotate over a pool
several times the L2 size). Before timing, the deferred step is checked at the real shape against the
float recurrence that fits every R-th token with the layer's codec (y by relative RMS; the check of
tests/test_cuda_kernel.py::test_deferred_decode_follows_the_deferred_format at K = V = 128).

    python benchmarks/bench_deferred.py --out DIR          # on a GPU, a few minutes
    python benchmarks/bench_deferred.py --dry-run          # CPU: the CUDA kernel's emulation build, tiny
    python benchmarks/bench_deferred.py --source old=/tmp/packed_step_old.cu --out DIR

Prints a table last, then one JSON line; with --out writes bench_deferred.json and bench_deferred.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_decode as bd  # noqa: E402

from stepquant.codecs import DeferredCodec, LayerFormat, make_codec  # noqa: E402
from stepquant.codecs.deferred import pending_layout  # noqa: E402
from stepquant.codecs.packing import unpack  # noqa: E402
from stepquant.kernels.decode import cuda  # noqa: E402
from stepquant.kernels.decode.deferred import DeferredBuffers, decode_deferred  # noqa: E402
from stepquant.kernels.tables import FormatTables  # noqa: E402
from stepquant.recurrence import prepare_qk, step  # noqa: E402

QUANTIZERS = {6: ("row fill, no refit", bd.FILL_0), 4: ("row fill, mid-tread, 1 refit", bd.FILL_MIDTREAD_1)}


def buffer_bits_per_value(every: int, spec: dict, key_dim: int, value_dim: int) -> float:
    """What a deferred state holds beside its codes (DeferredCodec.storage_bits' count for the model's
    layout), per state value."""
    heads, key_heads, kda = spec["heads"], spec["key_heads"], spec["kda"]
    inner, dims = make_codec("fp32"), (heads, key_dim, value_dim)
    codec = DeferredCodec(inner, every, **pending_layout(kda, heads, key_heads))
    return (codec.storage_bits(*dims) - inner.storage_bits(*dims)) / (heads * key_dim * value_dim)


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def check(name: str, spec: dict, bits: int, every: int = 4, batch: int = 8, tokens: int = 9) -> dict:
    """decode_deferred against the float recurrence fitting every R-th token, at the real shape."""
    heads, key_heads, kda = spec["heads"], spec["key_heads"], spec["kda"]
    config = QUANTIZERS[bits][1]
    layer = bd.make_layer(bd.synthetic_plan(name, bits, heads), "dual_axis", batch, config)
    slots = torch.arange(batch, dtype=torch.int32, device=bd.DEVICE)
    state = last_fit = unpack(layer.gather(slots.long())).dequantize()
    codec = layer.format.codec()
    buffers = DeferredBuffers.empty(layer.tables, batch, every, kda, key_heads)
    errors, fit_excess, untouched = [], [], True
    for t in range(tokens):
        q, k, v, g, beta = (x.float() for x in bd.token_inputs(batch, heads, key_heads, kda, seed=t))
        y = decode_deferred(layer.tables, layer.pages, slots, q, k, v, g, beta, buffers, use_qk_l2norm=True)
        b_q, b_k = prepare_qk(q, k, use_qk_l2norm=True, mode="kda" if kda else "gdn")
        x, y_ref = step(state, b_q, b_k, v, g, beta)
        errors.append(rel_rms(y, y_ref))
        stored = unpack(layer.gather(slots.long())).dequantize()
        if t % every == every - 1:
            fit_excess.append(rel_rms(stored, x) / max(rel_rms(codec.roundtrip(x), x), 1e-30))
            state = last_fit = stored
        else:
            untouched &= torch.equal(stored, last_fit)
            state = x
    ok = max(errors) < 1e-3 and max(fit_excess) <= 1.05 and untouched
    return dict(model=name, bits=bits, every=every, batch=batch, tokens=tokens, max_y_rel_rms=max(errors),
                fit_error_vs_codec=max(fit_excess), slots_untouched_between_fits=untouched, passed=ok)


@contextlib.contextmanager
def using_source(path: Path):
    """cuda.decode's libraries built from this packed_step.cu inside the block."""
    current = cuda.SOURCE
    cuda.SOURCE = path
    cuda._load.cache_clear()
    try:
        yield
    finally:
        cuda.SOURCE = current
        cuda._load.cache_clear()


def prebuild(sources: dict, models: dict, bits: list[int]) -> None:
    """The deferred path's libraries (SQ_PENDING: the readout, the writeback, the fused fit) of every
    source, in parallel."""
    jobs = []
    for name, spec in models.items():
        for b in bits:
            fmt = LayerFormat(bd.synthetic_plan(name, b, spec["heads"]), None, "dual_axis", QUANTIZERS[b][1])
            tables = FormatTables(fmt, bd.VALUE_DIM)
            jobs += [(path, cuda.defines_for(tables, part, spec["kda"], False, True))
                     for part in ("readout", "writeback", "fused") for path in sources.values()]
    target = cuda._target(torch.device(bd.DEVICE))
    started = time.time()
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(lambda job: cuda.build(job[1], target, source=job[0]), jobs))
    bd.log(f"built {len(jobs)} deferred-path libraries in {time.time() - started:.0f} s")


def run(name: str, spec: dict, args, fla, rec: bd.Recorder) -> None:
    heads, key_heads, kda = spec["heads"], spec["key_heads"], spec["kda"]
    for batch in args.batches:
        graphs = batch <= args.graph_below and bd.DEVICE == "cuda"
        inputs = bd.token_inputs(batch, heads, key_heads, kda)
        moved_fp32 = 2 * batch * heads * bd.KEY_DIM * bd.VALUE_DIM * 4 + bd.input_bytes(*inputs)
        if fla is not None and fla.error is None:
            prepared = fla.prepare(*inputs)
            states = [torch.randn(batch, heads, bd.KEY_DIM, bd.VALUE_DIM, device=bd.DEVICE) * 0.1
                      for _ in range(2)]
            step_fla = bd.rotating(lambda h, t=prepared: fla.own_step(kda, h, t), states)
            ms = bd.bench(step_fla, args.warmup, args.rep)
            rec.add(name, f"fla {name} fp32", "fp32", batch, ms, moved_fp32)
            if graphs:
                own = lambda h, t=prepared: fla.own_step(kda, h, t)
                ms = bd.bench_graph(own, states, args.warmup, args.rep)
                rec.add(name, f"fla {name} fp32 [graph]", "fp32", batch, ms, moved_fp32)
            del states
        for bits in args.bits:
            label, config = QUANTIZERS[bits]
            plan = bd.synthetic_plan(name, bits, heads)
            slot_bytes = LayerFormat(plan, None, "dual_axis").bytes(bd.VALUE_DIM)
            groups = bd.rotation_groups(batch * slot_bytes)
            layer = bd.make_layer(plan, "dual_axis", groups * batch, config)
            tensors = layer.tables, layer.pages
            slot_groups = bd.slot_groups(groups, batch)
            values = heads * bd.KEY_DIM * bd.VALUE_DIM
            extra = dict(quantizer=label, bits_per_value=slot_bytes * 8 / values)
            moved = bd.input_bytes(*inputs) + 2 * batch * slot_bytes
            work = torch.zeros(batch, heads, bd.VALUE_DIM, device=bd.DEVICE)
            parts = (("per-token fused", "fused", None, moved, {}),  # (variant, part, work, bytes, knobs)
                     ("readout alone (split)", "readout", work, moved - batch * slot_bytes, {"SQ_MMA": 0}),
                     ("readout alone (split, tensor-core sums)", "readout", work,
                      moved - batch * slot_bytes, {"SQ_MMA": 1}))
            try:
                for variant, part, buffer, part_moved, knobs in parts:
                    call = lambda s, t=tensors, x=inputs, p=part, w=buffer: cuda.decode(
                        *t, s, *x, use_qk_l2norm=True, part=p, work=w)
                    with cuda.tuning(**knobs):
                        ms = bd.bench(bd.rotating(call, slot_groups), args.warmup, args.rep)
                    rec.add(name, f"{variant} ({label})", bits, batch, ms, part_moved, every=1, **extra)
                    if graphs and part == "fused":
                        ms = bd.bench_graph(call, slot_groups, args.warmup, args.rep)
                        rec.add(name, f"{variant} ({label}) [graph]", bits, batch, ms, part_moved, every=1,
                                **extra)
            except Exception:
                bd.log(traceback.format_exc())
            for every in args.every:
                buffers = [DeferredBuffers.empty(layer.tables, batch, every, kda, key_heads)
                           for _ in slot_groups]
                pairs = list(zip(slot_groups, buffers, strict=True))

                def cycle(pair, way, every=every, t=tensors, x=inputs):
                    for _ in range(every):
                        decode_deferred(*t, pair[0], *x, pair[1], use_qk_l2norm=True, fit=way[0],
                                        gates=way[1])

                def token(pair, age, way, t=tensors, x=inputs):
                    pair[1].age = age  # R - 2: the last readout-only token of a cycle; R - 1: a fit
                    decode_deferred(*t, pair[0], *x, pair[1], use_qk_l2norm=True, fit=way[0],
                                    gates=way[1])
                    pair[1].clear()

                deferred_extra = dict(extra, every=every, bits_per_value=extra["bits_per_value"]
                                      + buffer_bits_per_value(every, spec, bd.KEY_DIM, bd.VALUE_DIM))
                # (tag, source, (fit, gates), tuning knobs); the readout's sums the other way from the default
                other_sums = ((" [FP32 readout]", {"SQ_MMA": 0}) if cuda.mma_for("readout", kda)
                              else (" [tensor-core readout]", {"SQ_MMA": 1}))
                versions = [("", cuda.SOURCE, ("fused", "kernel"), {}),
                            (" [split fit]", cuda.SOURCE, ("split", "kernel"), {}),
                            (" [torch gates]", cuda.SOURCE, ("fused", "torch"), {}),
                            (other_sums[0], cuda.SOURCE, ("fused", "kernel"), other_sums[1]),
                            *((f" [{source}]", path, ("fused", "kernel"), {})
                              for source, path in args.sources.items() if source != "current")]
                for tag, path, way, knobs in versions:
                    row = f"deferred R={every} ({label}), " + "{}" + tag
                    try:
                        with using_source(path), cuda.tuning(**knobs):
                            ms = bd.bench(bd.rotating(lambda p, w=way: cycle(p, w), pairs), args.warmup,
                                          args.rep) / every
                            rec.add(name, row.format("per token"), bits, batch, ms, moved, **deferred_extra)
                            if graphs:  # a captured cycle of R tokens (each ends with a fit: the ages repeat)
                                ms = bd.bench_graph(lambda p, w=way: cycle(p, w), pairs, args.warmup,
                                                    args.rep) / every
                                rec.add(name, row.format("per token") + " [graph]", bits, batch, ms, moved,
                                        **deferred_extra)
                            for kind, age in (("readout token", every - 2), ("fit token", every - 1)):
                                if kind == "readout token" and tag == " [split fit]":
                                    continue  # the same readout as the one-pass fit's
                                ms = bd.bench(bd.rotating(lambda p, a=age, w=way: token(p, a, w), pairs),
                                              args.warmup, args.rep)
                                rec.add(name, row.format(kind), bits, batch, ms, moved, **deferred_extra)
                    except Exception:
                        bd.log(traceback.format_exc())
                del buffers, pairs
            del layer
            if bd.DEVICE == "cuda":
                torch.cuda.empty_cache()


def markdown(result: dict) -> str:
    env = result["env"]
    lines = [f"# Deferred fitting vs the per-token step ({env['gpu']})", "",
             f"{env['date']}; torch {env['torch']}, triton {env['triton']}, fla {env['fla']}; copy "
             f"{result['copy_tbps']:.2f} TB/s; `python benchmarks/bench_deferred.py`; ms: do_bench's median.",
             "",
             "| model | B | bits | variant | bits/value | ms | x vs fla FP32 |",
             "|---|---|---|---|---|---|---|"]
    fla = {(r["model"], r["batch"], r["variant"].endswith("[graph]")): r["ms"] for r in result["rows"]
           if r["variant"].startswith("fla")}
    for row in result["rows"]:
        if row["variant"].startswith("fla"):
            continue
        base = fla.get((row["model"], row["batch"], row["variant"].endswith("[graph]")))
        speed = f"{base / row['ms']:.2f}" if base else "-"
        lines.append(f"| {row['model']} | {row['batch']} | {row['bits']} | {row['variant']} | "
                     f"{row.get('bits_per_value', 0):.2f} | {row['ms']:.4f} | {speed} |")
    lines += ["", "fla FP32: " + ", ".join(f"{m} B={b}{' [graph]' if g else ''} {ms:.4f} ms"
                                           for (m, b, g), ms in fla.items()), "",
              "Checks: " + json.dumps(result["checks"])]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--models", default="gdn,kda")
    parser.add_argument("--batches", default="32,512")
    parser.add_argument("--bits", default="6,4")
    parser.add_argument("--every", default="2,4,8", help="tokens per fit R")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rep", type=int, default=40)
    parser.add_argument("--no-fla", action="store_true")
    parser.add_argument("--graph-below", type=int, default=64,
                        help="also replay fla, the fused step and deferred cycles from CUDA graphs up to "
                             "this batch")
    parser.add_argument("--source", action="append", default=[], metavar="NAME=PATH",
                        help="also time the deferred rows with this version of packed_step.cu (repeatable; "
                             "it must hold GDN's k_j per q/k head, as the kernel does since 0a25cae)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, the CUDA kernel's emulation build, tiny")
    args = parser.parse_args(argv)
    args.sources = {"current": cuda.SOURCE}
    for item in args.source:
        source, _, path = item.partition("=")
        if not source or source == "current" or not Path(path).is_file():
            parser.error(f"--source {item!r}: give NAME=PATH of an existing packed_step.cu (NAME: not "
                         "'current')")
        if "stores_k" not in Path(path).read_text():  # an older kernel reads k_j per value head: past the end
            parser.error(f"--source {item!r}: this packed_step.cu predates 0a25cae (GDN's k_j per q/k "
                         "head) and would read past the deferred buffers")
        args.sources[source] = Path(path).resolve()
    ints = lambda s: [int(x) for x in s.split(",") if x]
    args.batches, args.bits, args.every = ints(args.batches), ints(args.bits), ints(args.every)
    models = {m: dict(bd.MODELS[m]) for m in args.models.split(",") if m}
    if args.dry_run:  # the emulation serves V = 128 and K a multiple of 16
        bd.DEVICE, bd.KEY_DIM = "cpu", 16
        args.batches, args.bits, args.every, args.no_fla = [2], [6], [2, 3], True
        for spec in models.values():
            spec.update(heads=2, key_heads=1 if not spec["kda"] else 2)
    elif not torch.cuda.is_available():
        print("bench_deferred needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    import triton

    started = time.time()
    if len(args.sources) > 1:
        prebuild(args.sources, models, args.bits)
    fla = None if args.no_fla else bd.Fla()
    copy_bps = bd.copy_bandwidth(args.warmup, args.rep, 2**30 if bd.DEVICE == "cuda" else 2**20)
    rec, checks = bd.Recorder(copy_bps), []
    gpu = torch.cuda.get_device_name() if bd.DEVICE == "cuda" else "cpu (dry run)"
    fla_version = "skipped" if fla is None else (fla.version or f"unavailable ({fla.error})")

    def snapshot() -> tuple[dict, str]:
        result = dict(env=dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__, fla=fla_version,
                               python=platform.python_version(),
                               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())),
                      copy_tbps=copy_bps / 1e12, rows=rec.rows, checks=checks, seconds=time.time() - started,
                      args={k: v for k, v in vars(args).items() if k not in ("out", "sources")},
                      sources={k: str(v) for k, v in args.sources.items()})
        text = markdown(result)
        if args.out is not None:  # after every model, so a time limit still leaves results
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "bench_deferred.json").write_text(json.dumps(result, indent=1, default=str))
            (args.out / "bench_deferred.md").write_text(text)
        return result, text

    for name, spec in models.items():
        for bits in args.bits:
            try:
                checks.append(check(name, spec, bits, every=3 if args.dry_run else 4,
                                    batch=2 if args.dry_run else 8, tokens=4 if args.dry_run else 9))
            except Exception:
                bd.log(traceback.format_exc())
                checks.append(dict(model=name, bits=bits, error=traceback.format_exc(limit=2)))
            bd.log(f"check {checks[-1]}")
        run(name, spec, args, fla, rec)
        result, text = snapshot()
    print(text)
    print(json.dumps(dict(bench="deferred", gpu=gpu, checks_passed=all(c.get("passed") for c in checks),
                          seconds=round(result["seconds"], 1))))
    return 0


if __name__ == "__main__":
    sys.exit(main())

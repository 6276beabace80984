"""Two versions of the CUDA decode kernel's source timed against each other in one run (H200).

A kernel change that should win a few percent cannot be judged from two runs on two machines (a call may
land on another GPU, and timings move between runs): this builds every version given (``--source
NAME=PATH``; the working tree's packed_step.cu is "current"; ``--variant NAME=MACRO=VALUE[,MACRO=VALUE]``
is the current source built with other values of cuda.TUNING's macros) for the same configurations, then
times them interleaved, round after round, at B = 512 on the benchmark's plan-shaped GDN and KDA layers
(the shapes and inputs of bench_decode.py), and prints the median per version and its ratio to the first. With
``--fla`` it times fla's FP32 step (bench_decode's baseline) in the same rounds and prints each version's
speedup over it, so one run gives the issue's x-factors.

    git show <rev>:stepquant/kernels/decode/packed_step.cu > /tmp/old.cu     # where git is at hand
    python benchmarks/ab_cuda_source.py --source old=/tmp/old.cu --out results/ab.json
    python benchmarks/ab_cuda_source.py --variant rows8=SQ_ROWS=8 --fla   # cuda.TUNING macros
    python benchmarks/ab_cuda_source.py --variant rows8=SQ_ROWS=8 --build-only 90   # nvcc, no GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_decode  # noqa: E402
from bench_decode import (  # noqa: E402
    FILL_0,
    FILL_MIDTREAD_1,
    KEY_DIM,
    MIDTREAD_1,
    MODELS,
    RECIPROCAL_0,
    RECIPROCAL_1,
    VALUE_DIM,
    Fla,
    bench,
    make_layer,
    rotating,
    rotation_groups,
    slot_groups,
    synthetic_plan,
    token_inputs,
)

from stepquant.codecs import LayerFormat  # noqa: E402
from stepquant.kernels.decode import cuda  # noqa: E402

CASES = [  # (model, bits, quantizer name, quantizer, part)
    *[(model, 6, "r1", RECIPROCAL_1, part) for model in ("gdn", "kda")
      for part in ("fused", "readout", "writeback")],
    *[(model, 6, "r0", RECIPROCAL_0, "fused") for model in ("gdn", "kda")],
    *[(model, 4, "r1", RECIPROCAL_1, "fused") for model in ("gdn", "kda")],
    # the shipped stepquant-4 plans' quantizer since issue 14 (mid-tread grid): against mid-rise r1 above
    *[(model, 4, "midtread-r1", MIDTREAD_1, "fused") for model in ("gdn", "kda")],
    # the shipped STEPQuant plans' quantizers since the row fill (docs/eval.md section 11)
    *[(model, 6, "fill-r0", FILL_0, "fused") for model in ("gdn", "kda")],
    *[(model, 4, "fill-midtread-r1", FILL_MIDTREAD_1, "fused") for model in ("gdn", "kda")],
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", action="append", default=[], metavar="NAME=PATH",
                        help="a version of packed_step.cu to time beside the current one (repeatable)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=MACRO=VALUE[,MACRO=VALUE]",
                        help="the current source with other values of cuda.TUNING's macros (repeatable)")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rep", type=int, default=60)
    parser.add_argument("--jobs", type=int, default=16, help="parallel nvcc builds")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--fla", action="store_true", help="time fla's FP32 step in the same rounds")
    parser.add_argument("--build-only", metavar="ARCH", help="compile every version and case for this CUDA "
                        "architecture (e.g. 90) and stop: no GPU needed, only nvcc")
    args = parser.parse_args(argv)
    if cuda.nvcc_path() is None or (args.build_only is None and not torch.cuda.is_available()):
        print("needs nvcc, and a CUDA GPU unless --build-only ARCH")
        return 2
    if args.build_only is not None:
        bench_decode.DEVICE = "cpu"  # the layers only give their tables' compile-time macros
    sources = {"current": (cuda.SOURCE, {})}  # name -> (packed_step.cu, macros that replace cuda.TUNING's)
    for item in args.source:
        name, sep, path = item.partition("=")
        if not sep or not Path(path).is_file():
            raise SystemExit(f"--source {item!r}: give NAME=PATH of an existing packed_step.cu")
        sources[name] = (Path(path).resolve(), {})
    for item in args.variant:
        sources[item.partition("=")[0]] = (cuda.SOURCE, parse_variant(item))
    tuning = dict(cuda.TUNING)
    target = args.build_only or "".join(map(str, torch.cuda.get_device_capability()))

    layers = {}
    for model, bits, qname, config, part in CASES:
        spec = MODELS[model]
        plan = synthetic_plan(model, bits, spec["heads"])
        slot_bytes = LayerFormat(plan, None, "dual_axis").bytes(VALUE_DIM)
        slots = rotation_groups(args.batch * slot_bytes) * args.batch if args.build_only is None else 1
        layer = make_layer(plan, "dual_axis", slots, config)
        layers[(model, bits, qname, part)] = layer
    started = time.time()
    jobs = []
    for path, macros in sources.values():
        cuda.TUNING.update(tuning | macros)
        jobs += [(path, cuda.defines_for(layer.tables, part, MODELS[model]["kda"]))
                 for (model, _, _, part), layer in layers.items()]
    cuda.TUNING.update(tuning)
    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(lambda job: cuda.build(job[1], target, source=job[0]), jobs))
    print(f"built {len(jobs)} libraries in {time.time() - started:.0f} s", flush=True)
    if args.build_only is not None:
        return 0

    fla_steps = {}  # model -> fla's FP32 step on rotating states (bench_decode.run_fla's "fla MODEL fp32")
    if args.fla:
        fla = Fla()
        if fla.error:
            raise SystemExit(f"--fla: {fla.error}")
        for model in ("gdn", "kda"):
            spec = MODELS[model]
            states = [torch.randn(args.batch, spec["heads"], KEY_DIM, VALUE_DIM, device="cuda") * 0.1
                      for _ in range(2)]
            prepared = fla.prepare(*token_inputs(args.batch, spec["heads"], spec["key_heads"], spec["kda"]))
            step = lambda h, t=prepared, kda=spec["kda"]: fla.own_step(kda, h, t)  # noqa: E731
            fla_steps[model] = rotating(step, states)

    times: dict = {}
    fla_times: dict = {}
    for round_ in range(args.rounds):
        for model, step in fla_steps.items():
            fla_times.setdefault(model, []).append(bench(step, args.warmup, args.rep))
        for (model, bits, qname, part), layer in layers.items():
            spec = MODELS[model]
            inputs = token_inputs(args.batch, spec["heads"], spec["key_heads"], spec["kda"])
            kwargs = dict(use_qk_l2norm=True, part=part,
                          out=torch.empty(args.batch, spec["heads"], VALUE_DIM, device="cuda",
                                          dtype=torch.bfloat16))
            if part != "fused":
                kwargs["work"] = torch.zeros(args.batch, spec["heads"], VALUE_DIM, device="cuda")
            call = lambda s, t=(layer.tables, layer.pages), x=inputs, kw=kwargs: cuda.decode(*t, s, *x, **kw)
            groups = slot_groups(layer.num_slots // args.batch, args.batch)
            for name, (path, macros) in sources.items():
                cuda.SOURCE = path
                cuda.TUNING.update(tuning | macros)
                cuda._load.cache_clear()
                ms = bench(rotating(call, groups), args.warmup, args.rep)
                times.setdefault(f"{model}@{bits} {qname} {part}", {}).setdefault(name, []).append(ms)
        print(f"round {round_ + 1} done", flush=True)
    cuda.SOURCE = sources["current"][0]
    cuda.TUNING.update(tuning)
    cuda._load.cache_clear()

    names = list(sources)
    fla_ms = {model: statistics.median(ms) for model, ms in fla_times.items()}
    print(f"\nB = {args.batch}, {torch.cuda.get_device_name()}, median of {args.rounds} rounds (ms)")
    if fla_ms:
        print("fla FP32 step: " + ", ".join(f"{model} {ms:.4f} ms" for model, ms in fla_ms.items()))
    speedup_head = " | ".join(f"{n} x fla" for n in names) + " |" if fla_ms else ""
    print("| case | " + " | ".join(names) + " | " + " | ".join(f"{n} / {names[0]}" for n in names[1:])
          + " | " + speedup_head)
    print("|---" * (2 * len(names) + (len(names) if fla_ms else 0)) + "|")
    result = {"gpu": torch.cuda.get_device_name(), "batch": args.batch, "rounds": args.rounds,
              "versions": {name: {"source": str(path), "macros": macros}
                           for name, (path, macros) in sources.items()},
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cases": {},
              "fla_fp32_ms": {"median": fla_ms, "all": fla_times}}
    for case, per in times.items():
        med = {n: statistics.median(per[n]) for n in names}
        result["cases"][case] = {"median_ms": med, "all_ms": per}
        ratios = " | ".join(f"{med[n] / med[names[0]]:.3f}" for n in names[1:])
        model = case.split("@")[0]
        speedups = " | ".join(f"{fla_ms[model] / med[n]:.2f}" for n in names) + " |" if fla_ms else ""
        print(f"| {case} | " + " | ".join(f"{med[n]:.4f}" for n in names) + f" | {ratios} | " + speedups)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


def parse_variant(item: str) -> dict[str, int]:
    """``NAME=MACRO=VALUE[,MACRO=VALUE]`` -> {MACRO: VALUE}; the macros must be cuda.TUNING's."""
    name, sep, rest = item.partition("=")
    macros = {}
    for pair in rest.split(",") if sep else []:
        macro, eq, value = pair.partition("=")
        if not eq or macro not in cuda.TUNING or not value.lstrip("-").isdigit():
            raise SystemExit(f"--variant {item!r}: give NAME=MACRO=VALUE[,MACRO=VALUE] with integer values "
                             f"of cuda.TUNING's macros ({', '.join(cuda.TUNING)})")
        macros[macro] = int(value)
    if not name or not macros:
        raise SystemExit(f"--variant {item!r}: give NAME=MACRO=VALUE[,MACRO=VALUE]")
    return macros


if __name__ == "__main__":
    sys.exit(main())

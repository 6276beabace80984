"""Offline SASS profile of the CUDA decode kernel (packed_step.cu): compile one body for sm_90, no GPU needed.

The step is bound by instruction issue first (docs/kernels.md, "Roofline"), so the number that predicts
its speed is SASS instructions per state value. This compiles the kernel with one head body only (a width
b, or 0 for mixed-width heads; SQ_ONLY_KIND) and a quantizer configuration, and reports registers, stack,
and the instructions per value of the whole body and of each stretch between barriers (the tile loops
are fully unrolled, so static counts are the dynamic ones up to the per-CTA setup; out-of-line slow
paths after the last EXIT are left out; a body of one unclipped width also holds the clamped copy of its
code pass that runs only when a column scale saturates, counted here though it almost never runs: the
stretch after the column maxima' barrier then appears twice). Needs nvcc; uses the cuobjdump of Triton's
wheel.

    python benchmarks/sass_cuda.py                            # 6-bit GDN body, reciprocal quantizer, fused
    python benchmarks/sass_cuda.py --kind 0 --kda --part readout
    python benchmarks/sass_cuda.py --kind -1 --part readout --pending   # the whole library: registers, spills
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stepquant.kernels.decode import cuda  # noqa: E402

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kind", type=int, default=6,
                        help="head body: a width 2..8, or 0 (mixed rows); -1: the library with every body "
                             "(registers and spills only)")
    parser.add_argument("--part", choices=list(cuda.PARTS), default="fused")
    parser.add_argument("--division", choices=["reciprocal", "exact"], default="reciprocal")
    parser.add_argument("--refits", type=int, default=1)
    parser.add_argument("--kda", action="store_true", help="a gate per key row")
    parser.add_argument("--row-fill", action="store_true", help="the row fill (DualAxisConfig.row_fill)")
    parser.add_argument("--rows", type=int, default=cuda.TUNING["SQ_ROWS"],
                        help="key rows per warp (SQ_ROWS: 16 = 8 warps per CTA, 8 = 16 warps)")
    parser.add_argument("--items", type=int, default=None,
                        help="batch rows per CTA (SQ_ITEMS; > 1 stages the next row's inputs; default: what "
                             "cuda.defines_for compiles for the part)")
    parser.add_argument("--pending", action="store_true",
                        help="a deferred state's pending updates (SQ_PENDING: the readout or the writeback)")
    parser.add_argument("--min-blocks", type=int, default=None,
                        help="CTAs per multiprocessor the registers must allow (SQ_MIN_BLOCKS; default: "
                             "cuda.TUNING's; the tensor-core readout compiles for 5 whatever this says)")
    parser.add_argument("--no-mma", action="store_true", help="the readout's sums on FP32 FMAs (SQ_MMA=0)")
    parser.add_argument("--source", type=Path, default=cuda.SOURCE, help="another version of packed_step.cu")
    parser.add_argument("--dump", type=Path, default=None, help="also write the body's disassembly here")
    args = parser.parse_args(argv)
    if args.items is None:
        args.items = cuda.items_for(args.part)
    if args.min_blocks is None:
        args.min_blocks = cuda.TUNING["SQ_MIN_BLOCKS"]
    defines = {"SQ_PART": cuda.PARTS[args.part], "SQ_DUAL": 1, "SQ_MIDRISE": 1,
               "SQ_RECIP": int(args.division == "reciprocal"), "SQ_ROW_STAT": 1, "SQ_KDA": int(args.kda),
               "SQ_CLIPPED": 0x1C, "SQ_REFITS": args.refits, "SQ_ROW_FILL": int(args.row_fill), "SQ_DEBUG": 0,
               **({"SQ_ONLY_KIND": args.kind} if args.kind >= 0 else {}),
               "SQ_ROWS": args.rows, "SQ_MIN_BLOCKS": args.min_blocks, "SQ_ITEMS": args.items,
               "SQ_PENDING": int(args.pending),
               "SQ_MMA": int(args.part in cuda.MMA_PARTS and not args.no_mma and args.rows == 16)}
    values_per_thread = 4 * args.rows  # a rows x 4 tile per thread
    nvcc = cuda.nvcc_path()
    if nvcc is None:
        print("needs nvcc", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "step.cubin"
        flags = ["-O3", "-std=c++20", "-gencode=arch=compute_90,code=sm_90", "-cubin", "-Xptxas", "-v",
                 *[f"-D{k}={v}" for k, v in defines.items()]]
        build = subprocess.run([nvcc, *flags, "-o", str(cubin), str(args.source)], capture_output=True,
                               text=True, check=True)
        sass = subprocess.run([str(CUOBJDUMP), "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    if args.dump is not None:
        args.dump.write_text(sass)
    resources = re.search(r"Used (\d+) registers", build.stderr)
    stack = re.search(r"(\d+) bytes stack frame", build.stderr)
    if args.kind < 0:
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", build.stderr)
        print(json.dumps({"kind": "every body", "part": args.part, "registers": int(resources.group(1)),
                          "stack": int(stack.group(1)), "spill_stores": int(spills.group(1)),
                          "spill_loads": int(spills.group(2))}))
        return 0
    ops = []
    for line in sass.splitlines():
        match = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if match:
            ops.append(re.sub(r"^@!?U?P\w+ ", "", match.group(1)).split()[0])
    last_exit = max(i for i, op in enumerate(ops) if op == "EXIT")
    ops = ops[: last_exit + 1]
    stretches, current = [], []
    for op in ops:
        current.append(op)
        if op.startswith("BAR.SYNC"):
            stretches.append(current)
            current = []
    stretches.append(current)
    print(f"body kind {args.kind}, {args.part}, {args.division}/{args.refits} refits, "
          f"{'kda' if args.kda else 'gdn'}: {resources.group(1)} registers, {stack.group(1)} B stack")
    print(f"{len(ops)} instructions = {len(ops) / values_per_thread:.1f} per state value")
    for i, stretch in enumerate(stretches):
        top = collections.Counter(op.split(".")[0] for op in stretch).most_common(5)
        per_value = len(stretch) / values_per_thread
        print(f"  stretch {i:2d} (to barrier {i + 1}): {per_value:5.1f} per value   {top}")
    print(json.dumps({"kind": args.kind, "part": args.part, "registers": int(resources.group(1)),
                      "instructions": len(ops), "per_value": round(len(ops) / values_per_thread, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

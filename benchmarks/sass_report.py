"""Offline SASS profile of the fused decode kernel: compile for sm_90 without a GPU and count instructions.

The packed decode step is bound by instruction issue, not bandwidth (docs/kernels.md), so the number
that predicts its speed is SASS instructions per state value. Triton compiles for a CUDA target on any
machine (its wheel ships ptxas and cuobjdump), so this script compiles chosen variants at K = V = 128
and reports registers, spills, shared memory, barriers and instructions per value of the main path
(slow-path subroutines after the last EXIT excluded; both sides of runtime branches counted, so
numbers for plane sets with several paths are upper bounds). --lines attributes them to source lines.

    python benchmarks/sass_report.py                       # the standard variant table
    python benchmarks/sass_report.py --variant fused --lines 30
"""

from __future__ import annotations

import argparse
import collections
import inspect
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from stepquant.kernels.decode.fused import packed_step_kernel  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
POINTERS = dict(q="*bf16", k="*bf16", v="*bf16", g="*fp32", beta="*fp32", y="*bf16", x_in="*fp32",
                slots="*i32", heads="*i32", codes="*i32", row_scale="*fp16", col_scale="*fp16",
                plan_rows="*i32",
                plan_heads="*i32", plan_winv="*fp32", plan_w2="*fp32", plan_gain="*fp32", dbg_x="*fp32",
                work="*fp32", dbg_c="*fp32", scale="fp32", slot_stride="i32", num_scaled="i32")
BASE = dict(WORD_ALIGN=4, PLANES=6, UNIFORM_BITS=6, H=48, HQ=16, K=128, V=128, BK=128, BV=128, BKB=16,
            IS_KDA=False, USE_UPDATE=True, READOUT=True, STORE_Y=True, STORE_U=False, WRITEBACK=True,
            USE_QK_L2NORM=True, USE_DUAL_AXIS=True, IS_RMS=True, IS_MIDRISE=True, REFIT_ITERS=2,
            STORE_DEBUG=False, APPROX_RCP=True)
VARIANTS = {  # name: (constexpr overrides, what it is)
    "fused": ({}, "GDN head of 6 bits (planes 4+2), dual-axis, 2 refits (the default codec)"),
    "readout": (dict(WRITEBACK=False, STORE_U=True), "split: readout only"),
    "writeback": (dict(READOUT=False, STORE_Y=False), "split: requantize + write back only"),
    "no-refit": (dict(REFIT_ITERS=0), "dual-axis without the column refit"),
    "absmax": (dict(USE_DUAL_AXIS=False, IS_MIDRISE=False, REFIT_ITERS=0), "rowwise absmax INT6"),
    "4bit": (dict(PLANES=4, UNIFORM_BITS=4), "GDN head of 4 bits (one plane)"),
    "mixed-rows": (dict(UNIFORM_BITS=0), "6-bit planes with per-row widths read at run time (KDA-style)"),
    "pack": (dict(USE_UPDATE=False), "boundary pack from FP32 states"),
    "kda-all-planes": (dict(PLANES=31, UNIFORM_BITS=0, IS_KDA=True), "KDA, every plane path compiled"),
}


def compile_variant(overrides: dict, num_warps: int, workdir: Path, block_rows: int):
    constexprs = dict(BASE, BKB=block_rows, **overrides)
    params = list(inspect.signature(packed_step_kernel.fn).parameters)
    signature = {p: POINTERS.get(p, "constexpr") for p in params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params) if signature[p].startswith("*")}
    src = ASTSource(fn=packed_step_kernel, signature=signature,
                    constexprs={k: v for k, v in constexprs.items() if k in params}, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps, enable_fp_fusion=True))
    cubin = workdir / "kernel.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    return compiled, cubin


def profile(compiled, cubin: Path, num_warps: int, block_rows: int) -> dict:
    tool = lambda *flags: subprocess.run([str(BIN / "cuobjdump"), *flags, str(cubin)], capture_output=True,
                                         text=True).stdout
    sass, usage = tool("-sass"), tool("-res-usage")
    ins = [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+([^;/]*?);", sass)]
    last_exit = max(i for i, s in enumerate(ins) if re.search(r"\bEXIT\b", s))
    main = ins[:last_exit + 1]
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", s).split()[0].split(".")[0] for s in main)
    slow_calls = sum(1 for s in main if "CALL.REL" in s)
    # values per thread per row block: the loops run once per block, so a static count over this is the
    # per-value cost of the loop bodies (the once-per-head prologue is overcounted by K / BKB)
    per_thread = block_rows * 128 / (num_warps * 32)
    count = sum(ops.values()) - ops["NOP"] - 4 * slow_calls  # a slow-path call site: ~4 untaken instructions
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    return dict(regs=int(regs.group(1)) if regs else -1, stack=int(stack.group(1)) if stack else -1,
                smem=compiled.metadata.shared, barriers=ops["BAR"], per_value=count / per_thread,
                top=ops.most_common(8), per_thread=per_thread)


def line_profile(cubin: Path, per_thread: float, limit: int) -> list[str]:
    out = subprocess.run([str(BIN / "nvdisasm"), "--print-line-info", str(cubin)], capture_output=True,
                         text=True).stdout
    source = Path(inspect.getsourcefile(packed_step_kernel.fn)).read_text().splitlines()
    where, counts = None, collections.Counter()
    for line in out.splitlines():
        found = re.search(r'//## File "([^"]+)", line (\d+)', line)
        if found:
            where = (Path(found.group(1)).name, int(found.group(2)))
        elif where and re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+[@A-Z]", line):
            counts[where] += 1
    rows = []
    for (name, number), n in counts.most_common(limit):
        text = source[number - 1].strip()[:88] if name == "fused.py" else ""
        rows.append(f"{n / per_thread:6.2f}/value  {name}:{number:<4d} {text}")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", action="append", choices=list(VARIANTS), help="default: all")
    parser.add_argument("--num-warps", type=int, default=4)
    parser.add_argument("--block-rows", type=int, default=16, help="key rows per tile (BKB)")
    parser.add_argument("--lines", type=int, default=0, help="also attribute N hottest source lines")
    args = parser.parse_args(argv)
    print(f"{'variant':16s} {'regs':>4s} {'spill':>5s} {'smem':>6s} {'bar':>4s} {'SASS/value':>10s}  "
          "top ops per value")
    for name in args.variant or list(VARIANTS):
        with tempfile.TemporaryDirectory() as tmp:
            compiled, cubin = compile_variant(VARIANTS[name][0], args.num_warps, Path(tmp), args.block_rows)
            p = profile(compiled, cubin, args.num_warps, args.block_rows)
            top = " ".join(f"{op}:{n / p['per_thread']:.1f}" for op, n in p["top"] if op != "NOP")
            print(f"{name:16s} {p['regs']:4d} {p['stack']:5d} {p['smem']:6d} {p['barriers']:4d} "
                  f"{p['per_value']:10.1f}  {top}   ({VARIANTS[name][1]})")
            if args.lines:
                print("\n".join(line_profile(cubin, p["per_thread"], args.lines)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

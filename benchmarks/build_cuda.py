"""Compile, in parallel, the CUDA decode-kernel libraries the GPU tests and bench_decode.py use.

Each quantizer configuration is one nvcc build of stepquant/kernels/decode/packed_step.cu (about 30 s on one
core); without this they compile one after another at first use. Run before the tests on a GPU machine:

    python benchmarks/build_cuda.py --jobs 16        # prints one line per library, then the total time
    python benchmarks/build_cuda.py --jobs 16 --serving-only   # only the libraries bench_generate.py uses
    python benchmarks/build_cuda.py --jobs 16 --deferred-only  # only those of bench_deferred.py
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import EXACT_2, FILL_0, FILL_MIDTREAD_1, MIDTREAD_1, RECIPROCAL_0, RECIPROCAL_1  # noqa: E402

from stepquant.codecs import LayerFormat  # noqa: E402
from stepquant.codecs.dual_axis import DualAxisConfig  # noqa: E402
from stepquant.kernels.decode import cuda  # noqa: E402
from stepquant.kernels.tables import FormatTables  # noqa: E402

PACK_EXACT = DualAxisConfig(refit_iters=0, row_stat="absmax")  # test_cuda_kernel's exact pack check
ROWS_PER_CTA_TESTED = (2, 4, 8)  # test_gpu_rows_per_cta's SQ_ITEMS
SERVING = (RECIPROCAL_1, RECIPROCAL_0, MIDTREAD_1, FILL_0, FILL_MIDTREAD_1)  # the plans' fast quantizers

# (spatial, quantizer, part, kda, debug)
DUAL = (*SERVING, EXACT_2)
CONFIGS = (
    [("dual_axis", q, part, kda, False) for q in DUAL for part in ("fused", "readout", "writeback")
     for kda in (False, True)]
    + [("dual_axis", q, "fused", kda, True) for q in DUAL for kda in (False, True)]
    + [("absmax", EXACT_2, "fused", kda, debug) for kda in (False, True) for debug in (False, True)]
    + [("dual_axis", q, "pack", False, debug) for q in (*DUAL, PACK_EXACT) for debug in (False, True)]
)
# the deferred format's parts with pending updates (bench_deferred.py, the GPU tests): the writeback (with its
# plain debug twin, test_gpu_writeback_folds_pending_updates), the readout and the fused fit: (quantizer, kda,
# debug)
PENDING = [(q, kda, debug) for q in (FILL_0, FILL_MIDTREAD_1) for kda in (False, True)
           for debug in (False, True)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=8, help="parallel nvcc processes")
    parser.add_argument("--serving-only", action="store_true",
                        help="only what a serving decode with the kernel's quantizer uses "
                             "(bench_generate.py): fused, readout, writeback (GDN and KDA) and pack, "
                             "the shipped plans' quantizers (reciprocal, one refit or none, mid-rise or "
                             "mid-tread), no debug")
    parser.add_argument("--deferred-only", action="store_true",
                        help="only what bench_deferred.py, the pending-update GPU tests and the deferred "
                             "PackedStateCache's use")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to build (the CPU tests build the emulation on their own)")
        return 0
    major, minor = torch.cuda.get_device_capability()
    target = f"{major}{minor}"
    started = time.time()
    unique = {}
    # the benchmark also times the fused step and the readout compiled for 16 warps of 8 key rows
    configs = CONFIGS + [("dual_axis", RECIPROCAL_1, part, kda, "16 warps") for kda in (False, True)
                         for part in ("fused", "readout")]
    if args.deferred_only:
        configs = [c for c in CONFIGS if c[1] in (FILL_0, FILL_MIDTREAD_1)
                   and c[2] in ("fused", "readout", "pack") and c[4] is False]
    if args.serving_only:
        configs = [c for c in CONFIGS
                   if c[1] in SERVING and c[4] is False
                   and c[0] == "dual_axis"]
    # test_gpu_rows_per_cta: the shipped GDN@6 quantizer with several batch rows per CTA
    items = [] if args.serving_only or args.deferred_only else [
        (("dual_axis", FILL_0, part, kda, part == "fused"), m) for m in ROWS_PER_CTA_TESTED
        for part in ("fused", "readout", "writeback") for kda in (False, True)]
    defaults = dict(cuda.TUNING)  # the defaults, or STEPQUANT_CUDA_ROWS / _ITEMS / _MMA

    def add(tables, part, kda, debug, pending=False):
        # the readout both ways: its sums on tensor cores and on FP32 FMAs (the benchmark times both, the
        # tests that compare the split step with the fused step bit for bit take the FP32 sums)
        for mma in (0, 1) if part in cuda.MMA_PARTS else (defaults["SQ_MMA"],):
            with cuda.tuning(SQ_MMA=mma):
                unique[cuda.defines_for(tables, part, kda, debug, pending)] = None

    for (spatial, quantizer, part, kda, debug), m in [(c, defaults["SQ_ITEMS"]) for c in configs] + items:
        bits = torch.full((1, 16), 6, dtype=torch.int8)
        with cuda.tuning(SQ_ROWS=8 if debug == "16 warps" else defaults["SQ_ROWS"], SQ_ITEMS=m):
            add(FormatTables(LayerFormat(bits, None, spatial, quantizer), 128), part, kda, debug is True)
    if not args.serving_only:
        for quantizer, kda, debug in PENDING:
            tables = FormatTables(LayerFormat(torch.full((1, 16), 6, dtype=torch.int8), None, "dual_axis",
                                              quantizer), 128)
            for pending in (True, False):
                add(tables, "writeback", kda, debug, pending)
            if not debug:  # the readout with the pending terms, and the fit token in one pass
                for part in ("readout", "fused"):
                    add(tables, part, kda, False, True)

    def one(defines):
        t0 = time.time()
        path = cuda.build(defines, target)
        return f"{time.time() - t0:6.1f} s {path.parent.name} {dict(defines)}"

    with ThreadPoolExecutor(args.jobs) as pool:
        for line in pool.map(one, unique):
            print(line, flush=True)
    print(f"built {len(unique)} libraries for sm_{target} in {time.time() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

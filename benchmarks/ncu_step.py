"""Launch the CUDA packed decode kernel a few times at one real shape, for a hardware-counter profile.

    ncu --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats \
        -k regex:packed_step_kernel --launch-skip 4 --launch-count 4 python3 benchmarks/ncu_step.py [kda]

Launch order per round (two rounds; skip the first as warm-up and builds): readout (split), writeback (split,
from the readout's u), fused, all with the reciprocal quantizer and one refit, then fused without a refit
(the shipped 6-bit quantizer). (Until session 11 the last launches were the fused step compiled for 16 warps
of 8 key rows, SQ_ROWS = 8, profiled in session 6 and not kept.)
GDN Qwen3.8 shape (48 heads, 16 q/k heads, K = V = 128), B = 512, a 6-bit plan shaped like the shipped ones;
with the argument ``kda``: the KDA Kimi-Linear shape (32 heads, a gate per key row, rows of 4..8 bits and
FP16 pivot rows), same launch order.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import RECIPROCAL_0, RECIPROCAL_1, make_layer, synthetic_plan, token_inputs  # noqa: E402

from stepquant.kernels.decode import cuda  # noqa: E402


def main(argv: list[str]) -> None:
    batch = 512
    model, heads, key_heads = ("kda", 32, 32) if argv[:1] == ["kda"] else ("gdn", 48, 16)
    plan = synthetic_plan(model, 6, heads)
    layer = make_layer(plan, "dual_axis", batch, RECIPROCAL_1)
    no_refit = make_layer(plan, "dual_axis", batch, RECIPROCAL_0)
    inputs = token_inputs(batch, heads, key_heads, model == "kda")
    slots = torch.arange(batch, dtype=torch.int32, device="cuda")
    work = torch.zeros(batch, heads, 128, device="cuda")
    for _ in range(2):
        state = (layer.tables, layer.pages, slots)
        y = cuda.decode(*state, *inputs, use_qk_l2norm=True, part="readout", work=work)
        cuda.decode(*state, *inputs, use_qk_l2norm=True, out=y, part="writeback", work=work)
        cuda.decode(*state, *inputs, use_qk_l2norm=True)
        cuda.decode(no_refit.tables, no_refit.pages, slots, *inputs, use_qk_l2norm=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1:])

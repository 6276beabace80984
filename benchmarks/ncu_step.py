"""Launch the CUDA packed decode kernel a few times at one real shape, for a hardware-counter profile.

    ncu --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats \
        -k regex:packed_step_kernel --launch-skip 3 --launch-count 5 python3 benchmarks/ncu_step.py [kda]

Launch order per round: readout (split), writeback (split, from the readout's u), fused; the reciprocal
quantizer with one refit; then two fused launches compiled for 16 warps of 8 key rows (SQ_ROWS = 8).
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

from bench_decode import RECIPROCAL_1, make_layer, synthetic_plan, token_inputs  # noqa: E402

from stepquant.kernels.decode import cuda  # noqa: E402


def main(argv: list[str]) -> None:
    batch = 512
    model, heads, key_heads = ("kda", 32, 32) if argv[:1] == ["kda"] else ("gdn", 48, 16)
    layer = make_layer(synthetic_plan(model, 6, heads), "dual_axis", batch, RECIPROCAL_1)
    inputs = token_inputs(batch, heads, key_heads, model == "kda")
    slots = torch.arange(batch, dtype=torch.int32, device="cuda")
    work = torch.zeros(batch, heads, 128, device="cuda")
    for _ in range(2):
        state = (layer.tables, layer.pages, slots)
        y = cuda.decode(*state, *inputs, use_qk_l2norm=True, part="readout", work=work)
        cuda.decode(*state, *inputs, use_qk_l2norm=True, out=y, part="writeback", work=work)
        cuda.decode(*state, *inputs, use_qk_l2norm=True)
    cuda.TUNING["SQ_ROWS"] = 8  # the fused step compiled for 16 warps of 8 key rows: launches 7 and 8
    for _ in range(2):
        cuda.decode(layer.tables, layer.pages, slots, *inputs, use_qk_l2norm=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1:])

"""Tests for the fused packed-state decode / pack kernels against their torch reference (kernels/decode).

On the CPU the Triton kernels run in the interpreter (TRITON_INTERPRET=1 is set below, before anything
imports triton; tests run in one process, so this module must not be the second to import it with a
different setting). Bit-exactness policy (docs/kernels.md):

- Given the same float state X, the kernel's row scales, codes, pivots and packed words equal the
  torch codec's bit for bit; with row_stat="absmax" and refit_iters=0 every output is exact.
- FP32 reductions (rms row statistic, column refit sums) run in a different order in Triton, so column
  scales after a refit may differ by one FP16 step: those are compared with a relative tolerance,
  and the codes are then checked exactly by requantizing the kernel's X in torch with the kernel's
  scales (the debug outputs give X and the column scales the codes were computed against).
- Decode: the kernel's X and readout y match the reference's float step by relative RMS; the stored
  state's error against X is at most 2x (+1e-6) the reference's own quantization error.

GPU tests (@pytest.mark.gpu, real shapes K = V = 128) run on CUDA only: pytest -m gpu tests/test_kernels.py.
"""

from __future__ import annotations

import os
import sys

# The interpreter must be on before triton is first imported (triton.language's own helpers are jit
# functions). If another test module imported triton earlier without it, the CPU tests skip (run this
# file alone, or set TRITON_INTERPRET=1 in a conftest) instead of failing.
if "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from kernel_checks import (
    check_against_codec,
    check_decode_from_zeroed_slots,
    clone_layer,
    gpu_decode_case,
    mixed_bits,
    rel_rms,
)
from kernel_checks import make_layer as _make_layer
from kernel_checks import token_inputs as _token_inputs

from stepquant.codecs.base import PIVOT_BITS
from stepquant.codecs.packing import pack, unpack
from stepquant.kernels.decode import (
    decode_step_packed,
    fused_pack_states,
    fused_packed_decode,
    naive_pack_states,
    naive_packed_decode,
)
from stepquant.kernels.decode.fused import fused_decode, work_buffer
from stepquant.kernels.prefill import prefill_packed
from stepquant.recurrence import gated_delta_rule

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED or not torch.cuda.is_available() else "cuda"
needs_triton_device = pytest.mark.skipif(
    not INTERPRETED and not torch.cuda.is_available(),
    reason="needs CUDA, or TRITON_INTERPRET=1 set before triton was first imported in this process",
)
gpu = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs a CUDA GPU")


def make_layer(bits, *, device=DEVICE, **kwargs):
    return _make_layer(bits, device=device, **kwargs)


def token_inputs(*args, device=DEVICE, **kwargs):
    return _token_inputs(*args, device=device, **kwargs)


CONFIGS = {
    "absmax-refit0-midtread": dict(refit_iters=0, grid="midtread", row_stat="absmax"),
    "absmax-refit1-midrise": dict(refit_iters=1, grid="midrise", row_stat="absmax"),
    "rms-refit2-midrise": dict(refit_iters=2, grid="midrise", row_stat="rms", clip=0.9),
    "default": dict(),
    "reciprocal-refit1": dict(division="reciprocal", refit_iters=1),  # stepquant-4 until issue 14
    "reciprocal-refit0": dict(division="reciprocal", refit_iters=0),  # the shipped stepquant-6 plans'
    "reciprocal-refit1-midtread": dict(division="reciprocal", refit_iters=1, grid="midtread"),  # stepquant-4
    "reciprocal-refit2-midtread": dict(division="reciprocal", refit_iters=2, grid="midtread"),
    "meanabs-refit1-midtread": dict(division="reciprocal", refit_iters=1, grid="midtread",
                                    row_stat="mean_abs"),
    "fill-refit0": dict(division="reciprocal", refit_iters=0, row_fill=True),  # the shipped stepquant-6
    "fill-refit1-midtread": dict(division="reciprocal", refit_iters=1, grid="midtread", row_fill=True),  # -4
}

SHAPES = {  # id: (N, H, H_k, K, V, bit choices, pivot rows, pivot head)
    "N2-H2-K32-V32-6b": (2, 2, 2, 32, 32, (6,), 0, False),
    "N3-H2-K24-V20-mixed": (3, 2, 1, 24, 20, (4, 5, 6, 7, 8), 3, False),
    "N2-H2-K16-V40-mixed-pivothead": (2, 2, 2, 16, 40, (2, 3, 4), 0, True),
    "N2-H2-K32-V32-4b-pivots": (2, 2, 1, 32, 32, (4,), 2, False),
}


@needs_triton_device
@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_pack_kernel_matches_codec(shape, config):
    num_rows, heads, _, key_dim, value_dim, choices, pivot_rows, pivot_head = SHAPES[shape]
    bits = mixed_bits(heads, key_dim, choices, seed=1, pivot_rows=pivot_rows, pivot_head=pivot_head)
    kernel = make_layer(bits, value_dim=value_dim, num_slots=num_rows + 2, **CONFIGS[config])
    ref = clone_layer(kernel)
    # poison: every scale the kernel must write, and every word when rows have no padding bits
    poison = -1 if value_dim % 32 == 0 else 0
    kernel.pages.codes.fill_(poison)
    for scales in kernel.tensors():
        if scales.dtype == torch.float16:
            scales.fill_(float("nan"))
    slots = torch.arange(num_rows, dtype=torch.int32).flip(0) + 1  # not the identity
    x = torch.randn(num_rows, heads, key_dim, value_dim, generator=torch.Generator().manual_seed(3))
    x[0, 0, 1] = 0.0  # an all-zero row: scales clamp to 2^-14
    x = x.to(DEVICE)
    debug = {}
    fused_pack_states(kernel, slots, x, debug=debug)
    naive_pack_states(ref, slots, x)
    cfg = kernel.format.config
    exact = cfg.refit_iters == 0 and cfg.row_stat == "absmax"
    assert torch.equal(debug["x"], x)
    check_against_codec(kernel, ref, slots.tolist(), x, debug["c"], exact_scales=exact,
                        r_before_fill=debug.get("r_before_fill"))
    codes = kernel.pages.codes
    assert bool((codes[0] == poison).all() and (codes[-1] == poison).all())  # untouched


@needs_triton_device
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("config", ["absmax-refit0-midtread", "default", "rms-refit2-midrise",
                                    "reciprocal-refit1", "meanabs-refit1-midtread", "fill-refit0",
                                    "fill-refit1-midtread"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_decode_kernel_matches_reference(shape, config, kda):
    num_rows, heads, q_heads, key_dim, value_dim, choices, pivot_rows, pivot_head = SHAPES[shape]
    bits = mixed_bits(heads, key_dim, choices, seed=2, pivot_rows=pivot_rows, pivot_head=pivot_head)
    kernel = make_layer(bits, value_dim=value_dim, num_slots=num_rows + 3, **CONFIGS[config])
    all_slots = torch.arange(kernel.num_slots, dtype=torch.int32)
    gen = torch.Generator().manual_seed(4)
    start = torch.randn(kernel.num_slots, heads, key_dim, value_dim, generator=gen)
    naive_pack_states(kernel, all_slots, start.to(DEVICE))
    ref = clone_layer(kernel)
    before = kernel.pages.codes.clone(), kernel.pages.row_scale.clone()
    slots = torch.arange(num_rows, dtype=torch.int32) * 2  # gaps: slots 1, 3, .. stay untouched
    slots[1] = -1  # a skipped batch row
    active = [i for i in range(num_rows) if slots[i] >= 0]
    q, k, v, g, beta = token_inputs(num_rows, heads, q_heads, key_dim, value_dim, kda, seed=5)
    y_kernel = torch.full((num_rows, heads, value_dim), float("nan"), device=DEVICE)
    y_ref = y_kernel.clone()
    debug, debug_ref = {}, {}
    fused_packed_decode(kernel, slots, q, k, v, g, beta, use_qk_l2norm=True, out=y_kernel, debug=debug)
    naive_packed_decode(ref, slots, q, k, v, g, beta, use_qk_l2norm=True, out=y_ref, debug=debug_ref)

    assert torch.isnan(y_kernel[1]).all(), "a skipped row's output must stay untouched"
    x_ref = debug_ref["x"]
    x_kernel = debug["x"][active]
    assert rel_rms(x_kernel, x_ref) < 1e-5
    assert rel_rms(y_kernel[active], y_ref[active]) < 1e-5
    # pages of slots nobody decoded are untouched
    untouched = [s for s in range(kernel.num_slots) if s not in slots.tolist()]
    assert torch.equal(kernel.pages.codes[untouched], before[0][untouched])
    assert torch.equal(kernel.pages.row_scale[untouched], before[1][untouched])
    # exact codes given the kernel's own X and scales
    before_fill = debug.get("r_before_fill")
    check_against_codec(kernel, ref, slots[active].tolist(), x_kernel, debug["c"][active], exact_scales=False,
                        r_before_fill=None if before_fill is None else before_fill[active])
    # quantization error within 2x of the reference's
    index = slots[active].to(torch.int64)
    err_kernel = rel_rms(unpack(kernel.gather(index)).dequantize(), x_ref)
    err_ref = rel_rms(unpack(ref.gather(index)).dequantize(), x_ref)
    assert err_kernel <= 2 * err_ref + 1e-6


@needs_triton_device
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_decode_from_zeroed_slots(kda):
    _, heads, q_heads, key_dim, value_dim, choices, pivot_rows, _ = SHAPES["N3-H2-K24-V20-mixed"]
    bits = mixed_bits(heads, key_dim, choices, seed=2, pivot_rows=pivot_rows)
    kernel = make_layer(bits, value_dim=value_dim, num_slots=2, **CONFIGS["reciprocal-refit1-midtread"])

    def decode(layer, slots, q, k, v, g, beta):
        return fused_packed_decode(layer, slots, q, k, v, g, beta, use_qk_l2norm=True)

    check_decode_from_zeroed_slots(decode, kernel, q_heads, kda)


@needs_triton_device
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_rowwise_absmax_decode(kda):
    bits = mixed_bits(2, 24, (4, 6, 8), seed=6, pivot_rows=2)
    kernel = make_layer(bits, spatial="absmax", value_dim=20, num_slots=3)
    slots = torch.tensor([2, 0], dtype=torch.int32)
    naive_pack_states(kernel, slots, torch.randn(2, 2, 24, 20).to(DEVICE))
    ref = clone_layer(kernel)
    q, k, v, g, beta = token_inputs(2, 2, 2, 24, 20, kda, seed=7)
    debug = {}
    y = fused_packed_decode(kernel, slots, q, k, v, g, beta, debug=debug)
    y_ref = naive_packed_decode(ref, slots, q, k, v, g, beta)
    assert rel_rms(y, y_ref) < 1e-5
    assert kernel.pages.col_scale is None
    check_against_codec(kernel, ref, slots.tolist(), debug["x"], None, exact_scales=False)


@needs_triton_device
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_split_readout_then_writeback_equals_fused(kda):
    bits = mixed_bits(2, 24, (4, 5, 6, 7, 8), seed=14, pivot_rows=2)
    fused = make_layer(bits, value_dim=20, num_slots=3)
    slots = torch.tensor([1, -1, 2], dtype=torch.int32)
    naive_pack_states(fused, torch.arange(3, dtype=torch.int32), torch.randn(3, 2, 24, 20).to(DEVICE))
    split, before_layer = clone_layer(fused), clone_layer(fused)
    q, k, v, g, beta = token_inputs(3, 2, 1, 24, 20, kda, seed=15)
    y_fused = fused_packed_decode(fused, slots, q, k, v, g, beta, use_qk_l2norm=True)
    y = torch.full_like(y_fused, float("nan"))
    before = [t.clone() for t in split.tensors()]
    fused_packed_decode(split, slots, q, k, v, g, beta, use_qk_l2norm=True, out=y, part="readout")
    assert all(torch.equal(a, b) for a, b in zip(before, split.tensors(), strict=True))
    # the readout tiles the key rows differently (it is tuned on its own), so y agrees to rounding
    assert rel_rms(y[[0, 2]], y_fused[[0, 2]]) < 1e-6 and torch.isnan(y[1]).all()
    y_before = y.clone()
    fused_packed_decode(split, slots, q, k, v, g, beta, use_qk_l2norm=True, out=y, part="writeback")
    assert torch.equal(y[[0, 2]], y_before[[0, 2]]) and torch.isnan(y[1]).all()
    # a writeback without the readout's work buffer recomputes the update exactly as the fused kernel
    assert all(torch.equal(a, b) for a, b in zip(fused.tensors(), split.tensors(), strict=True))
    # the paper's split: the writeback starts from the u the readout left in the work buffer
    paired = clone_layer(before_layer)
    work = work_buffer(paired.tables, 3)
    y_paired = fused_packed_decode(paired, slots, q, k, v, g, beta, use_qk_l2norm=True, part="readout",
                                   work=work)
    fused_packed_decode(paired, slots, q, k, v, g, beta, use_qk_l2norm=True, out=y_paired, part="writeback",
                        work=work)
    assert torch.equal(y_paired[[0, 2]], y_before[[0, 2]])
    index = torch.tensor([1, 2])
    got, want = unpack(paired.gather(index)).dequantize(), unpack(fused.gather(index)).dequantize()
    assert rel_rms(got, want) < 1e-4  # equal up to codes on rounding ties
    assert torch.equal(paired.pages.codes[0], fused.pages.codes[0])  # the skipped row's slot is untouched
    with pytest.raises(ValueError, match="part"):
        fused_packed_decode(split, slots, q, k, v, g, beta, part="both")


@needs_triton_device
def test_all_rows_skipped_and_dispatch():
    bits = mixed_bits(2, 16, (6,), seed=8)
    layer = make_layer(bits, value_dim=16, num_slots=2)
    naive_pack_states(layer, torch.tensor([0, 1], dtype=torch.int32), torch.randn(2, 2, 16, 16).to(DEVICE))
    before = [t.clone() for t in layer.tensors()]
    q, k, v, g, beta = token_inputs(2, 2, 2, 16, 16, False, seed=9)
    out = torch.full((2, 2, 16), float("nan"), device=DEVICE)
    fused_packed_decode(layer, torch.tensor([-1, -1], dtype=torch.int32), q, k, v, g, beta, out=out)
    assert torch.isnan(out).all()
    assert all(torch.equal(a, b) for a, b in zip(before, layer.tensors(), strict=True))
    # decode_step_packed picks the torch path off CUDA
    y = decode_step_packed(layer, torch.tensor([1, 0], dtype=torch.int32), q, k, v, g, beta)
    assert torch.isfinite(y).all()


@needs_triton_device
def test_decode_rejects_bad_shapes():
    layer = make_layer(mixed_bits(2, 16, (6,), seed=10), value_dim=16)
    q, k, v, g, beta = token_inputs(2, 2, 2, 16, 16, False, seed=11)
    slots = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="v must have shape"):
        fused_packed_decode(layer, slots, q, k, v[:, :1], g, beta)
    with pytest.raises(ValueError, match="g must have shape"):
        fused_packed_decode(layer, slots, q, k, v, g[:, :, None].expand(2, 2, 3), beta)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_prefill_packs_the_boundary_state(kda):
    bits = mixed_bits(2, 16, (4, 6, 8), seed=16, pivot_rows=1)
    layer = make_layer(bits, value_dim=16, num_slots=3, device="cpu")
    gen = torch.Generator().manual_seed(17)
    q, k = torch.randn(2, 5, 1, 16, generator=gen), torch.randn(2, 5, 1, 16, generator=gen)
    v = torch.randn(2, 5, 2, 16, generator=gen)
    g = -torch.rand(2, 5, 2, *((16,) if kda else ()), generator=gen)
    beta = torch.rand(2, 5, 2, generator=gen)
    slots = torch.tensor([2, 0], dtype=torch.int32)
    o = prefill_packed(layer, slots, q, k, v, g, beta, use_qk_l2norm=True, from_state=False)
    o_ref, final = gated_delta_rule(q, k, v, g, beta, None, use_qk_l2norm=True)
    torch.testing.assert_close(o, o_ref)
    want = pack(layer.format.codec().encode(final), layer.layout)
    assert torch.equal(layer.pages.codes[[2, 0]], want.codes)
    # a second chunk continues from the stored (quantized) state
    start = unpack(layer.gather(torch.tensor([2, 0]))).dequantize()
    o2 = prefill_packed(layer, slots, q, k, v, g, beta, use_qk_l2norm=True)
    torch.testing.assert_close(o2, gated_delta_rule(q, k, v, g, beta, start, use_qk_l2norm=True)[0])
    assert not layer.pages.codes[1].any()


def test_prefill_rejects_bad_shapes():
    layer = make_layer(mixed_bits(2, 16, (6,), seed=18), value_dim=16, num_slots=2, device="cpu")
    q = torch.zeros(2, 3, 1, 16)
    v, g, beta = torch.zeros(2, 3, 2, 16), torch.zeros(2, 3, 2), torch.zeros(2, 3, 2)
    slots = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"q and k must have shape \[N, T, H_k, K\]"):
        prefill_packed(layer, slots, q[0], q[0], v, g, beta)
    with pytest.raises(ValueError, match="len\\(slots\\)"):
        prefill_packed(layer, slots[:1], q, q, v, g, beta)
    with pytest.raises(ValueError, match=r"v must have shape \[N, T, H, V\] = \[2, 3, 2, 16\]"):
        prefill_packed(layer, slots, q, q, v[..., :8], g, beta)
    with pytest.raises(ValueError, match="g must have shape"):
        prefill_packed(layer, slots, q, q, v, g[:, :2], beta)
    with pytest.raises(ValueError, match="beta must have shape"):
        prefill_packed(layer, slots, q, q, v, g, beta[:, :, :1])
    with pytest.raises(ValueError, match="multiple of q/k's 3 heads"):
        prefill_packed(layer, slots, q.expand(2, 3, 3, 16), q.expand(2, 3, 3, 16), v, g, beta)


# ---------------------------------------------------------------- GPU: real shapes (run on the H200)

def _gpu_case(heads, key_heads, kda, num_rows, bits, spatial="dual_axis"):
    gpu_decode_case(fused_decode, bits, key_heads, kda, num_rows, spatial)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_rows", [32, 512], ids=["B32", "B512"])
def test_gpu_gdn_qwen_shape(num_rows):
    # 48 heads, 16 key heads (GQA), heads at {5..8} bits plus one FP16 pivot head
    bits = torch.tensor([5, 6, 7, 8] * 12, dtype=torch.int8)[:, None].expand(48, 128).clone()
    bits[7] = PIVOT_BITS
    _gpu_case(48, 16, False, num_rows, bits)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_rows", [32, 256], ids=["B32", "B256"])
def test_gpu_kda_kimi_shape(num_rows):
    _gpu_case(32, 32, True, num_rows, mixed_bits(32, 128, (4, 5, 6, 7, 8), seed=13, pivot_rows=26))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("config", ["fill-refit0", "fill-refit1-midtread"])
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_gpu_row_fill(kda, config):  # the shipped STEPQuant plans' quantizers
    bits = (mixed_bits(32, 128, (4, 5, 6, 7, 8), seed=14, pivot_rows=26) if kda
            else torch.tensor([4, 5, 6, 7, 8, 6] * 8, dtype=torch.int8)[:, None].expand(48, 128).clone())
    gpu_decode_case(fused_decode, bits, 32 if kda else 16, kda, 128, "dual_axis", **CONFIGS[config])


@pytest.mark.gpu
@gpu
def test_gpu_rowwise_absmax_and_pack():
    bits = torch.full((32, 128), 4, dtype=torch.int8)
    _gpu_case(32, 32, True, 64, bits, spatial="absmax")
    layer = make_layer(bits, value_dim=128, num_slots=64, device="cuda", refit_iters=0, row_stat="absmax")
    ref = clone_layer(layer)
    slots = torch.arange(64, dtype=torch.int32, device="cuda")
    x = torch.randn(64, 32, 128, 128, device="cuda")
    fused_pack_states(layer, slots, x)
    naive_pack_states(ref, slots, x)
    check_against_codec(layer, ref, slots.tolist(), x, None, exact_scales=True)


def test_untuned_triton_autotune_runs_the_first_config_only(monkeypatch):
    """GPU runs (STEPQUANT_UNTUNED_TRITON=1) cut every autotuner to its first configuration: same result."""
    import triton
    import triton.language as tl
    from triton.runtime.autotuner import Autotuner

    from stepquant.kernels.prefill import untuned_triton_autotune

    monkeypatch.setattr(Autotuner, "run", Autotuner.run)  # restored after the test

    @triton.autotune(configs=[triton.Config({"BLOCK": b}) for b in (4, 8, 16)], key=["n"])
    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + o, tl.load(x_ptr + o, mask=o < n) + 1, mask=o < n)

    untuned_triton_autotune()
    untuned_triton_autotune()  # idempotent: one wrapper
    x = torch.zeros(37)
    add_one[lambda meta: (triton.cdiv(37, meta["BLOCK"]),)](x, 37)
    assert [c.kwargs["BLOCK"] for c in add_one.configs] == [4]
    assert torch.equal(x, torch.ones(37))

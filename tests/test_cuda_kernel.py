"""The CUDA decode kernel (stepquant/kernels/decode/packed_step.cu) against the torch reference.

On the CPU the kernel's own source runs through its emulation build (cuda_emulation.h: g++, CTAs one after
another, threads as OS threads) at small, awkward shapes: K = 112 and 48 (the kernel takes K in steps of
16), heads of every uniform width with their plane combinations, a mixed-width head with FP16 pivot rows,
a GDN pivot head, grouped keys and skipped batch rows. @pytest.mark.gpu tests repeat the checks at real
shapes on CUDA. The policy is docs/kernels.md's: codes and packed words exact given the kernel's X and
scales, scales within two FP16 steps (exact where the statistic is order-independent), X and y by
relative RMS, and the stored state's error at most 2x the reference's own quantization error.
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from kernel_checks import (
    check_against_codec,
    check_decode_from_zeroed_slots,
    clone_layer,
    gpu_decode_case,
    make_layer,
    rel_rms,
    token_inputs,
)

from stepquant.codecs.base import PIVOT_BITS
from stepquant.codecs.packing import unpack
from stepquant.kernels.decode import cuda, naive_pack_states, naive_packed_decode

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="the CPU emulation build needs a C++20 compiler")

CONFIGS = {
    "reciprocal-refit1": dict(division="reciprocal", refit_iters=1),
    "reciprocal-refit0": dict(division="reciprocal", refit_iters=0),
    "exact-refit2": dict(division="exact", refit_iters=2, clip=0.9),
    "absmax-refit0-midtread": dict(division="exact", refit_iters=0, grid="midtread", row_stat="absmax"),
    "reciprocal-absmax-refit0-midtread": dict(division="reciprocal", refit_iters=0, grid="midtread",
                                              row_stat="absmax"),
    "reciprocal-meanabs-refit1-midtread": dict(division="reciprocal", refit_iters=1, grid="midtread",
                                               row_stat="mean_abs"),
    "reciprocal-refit1-midtread": dict(division="reciprocal", refit_iters=1, grid="midtread"),
    "fill-refit0": dict(division="reciprocal", refit_iters=0, row_fill=True),  # stepquant-6
    "fill-refit1-midtread": dict(division="reciprocal", refit_iters=1, grid="midtread", row_fill=True),  # -4
}
EXACT_SCALES = {"absmax-refit0-midtread", "reciprocal-absmax-refit0-midtread"}


def _plan(name: str) -> tuple[torch.Tensor, int]:
    """bits [H, K] and the number of q/k heads of a test shape."""
    gen = torch.Generator().manual_seed(7)
    if name == "K112-mixed-pivots":
        # a 6-bit head, a head with rows of every width and 4 FP16 pivot rows, a pivot head, a 2-bit head
        bits = torch.full((4, 112), 6)
        bits[1] = torch.randint(2, 9, (112,), generator=gen)
        bits[1, torch.randperm(112, generator=gen)[:4]] = PIVOT_BITS
        bits[2], bits[3] = PIVOT_BITS, 2
        return bits.to(torch.int8), 2
    if name == "K48-uniform-3578":  # every plane combination with a 1-bit plane, and the 8-bit plane
        return torch.tensor([3, 5, 7, 8])[:, None].expand(4, 48).to(torch.int8).clone(), 2
    if name == "K128-4b":  # clip < 1: the codes are clamped to the grid
        return torch.full((2, 128), 4, dtype=torch.int8), 1
    raise KeyError(name)


SHAPES = ["K112-mixed-pivots", "K48-uniform-3578", "K128-4b"]


def _layer(shape: str, config: str, num_slots: int, device="cpu", spatial="dual_axis"):
    bits, q_heads = _plan(shape)
    return make_layer(bits, value_dim=128, num_slots=num_slots, device=device, spatial=spatial,
                      **CONFIGS[config]), q_heads


@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPES)
def test_pack_matches_codec(shape, config):
    kernel, _ = _layer(shape, config, num_slots=4)
    ref = clone_layer(kernel)
    kernel.pages.codes.fill_(-1)  # poison: every word and scale of a packed slot must be written
    for scales in kernel.tensors():
        if scales.dtype == torch.float16:
            scales.fill_(float("nan"))
    slots = torch.tensor([2, 0], dtype=torch.int32)
    x = torch.randn(2, kernel.num_heads, kernel.key_dim, 128, generator=torch.Generator().manual_seed(3))
    x[0, 0, 1] = 0.0  # an all-zero row: its scales clamp to 2^-14
    x[1, 0, 2, 5] = 1e6  # an outlier
    x[0, 0] *= 1e14  # column maxima past FP16's 65504: saturated scales, codes clamped to the grid
    debug = {}
    cuda.pack(kernel.tables, kernel.pages, slots, x, debug=debug)
    naive_pack_states(ref, slots, x)
    assert torch.equal(debug["x"], x)
    check_against_codec(kernel, ref, slots.tolist(), x, debug["c"], exact_scales=config in EXACT_SCALES,
                        r_before_fill=debug.get("r_before_fill"))
    assert bool((kernel.pages.codes[[1, 3]] == -1).all()), "slots nobody packed must stay untouched"


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPES)
def test_decode_matches_reference(shape, config, kda):
    _reference_case(shape, config, kda)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_sixteen_warp_build_matches_reference(monkeypatch, kda):
    # SQ_ROWS = 8 (16 warps of 8 key rows, STEPQUANT_CUDA_ROWS=8): a build the GPU runs time as an
    # alternative; the tensor-core readout's layout check once failed its compilation (session 22's GPU run)
    monkeypatch.setitem(cuda.TUNING, "SQ_ROWS", 8)
    _reference_case("K112-mixed-pivots", "reciprocal-refit1-midtread", kda)


def _reference_case(shape: str, config: str, kda: bool) -> None:
    """One fused decode token against the naive reference: X and y by relative RMS, the codes and scales
    against the codec given the kernel's X, a skipped row and free slots untouched."""
    kernel, q_heads = _layer(shape, config, num_slots=5)
    heads, key_dim = kernel.num_heads, kernel.key_dim
    all_slots = torch.arange(5, dtype=torch.int32)
    start = torch.randn(5, heads, key_dim, 128, generator=torch.Generator().manual_seed(4))
    naive_pack_states(kernel, all_slots, start)
    ref = clone_layer(kernel)
    before = [t.clone() for t in kernel.tensors()]
    slots = torch.tensor([4, -1, 1], dtype=torch.int32)  # a skipped batch row; slots 0, 2, 3 untouched
    q, k, v, g, beta = token_inputs(3, heads, q_heads, key_dim, 128, kda, seed=5)
    y = torch.full((3, heads, 128), float("nan"))
    debug, debug_ref = {}, {}
    cuda.decode(kernel.tables, kernel.pages, slots, q, k, v, g, beta, use_qk_l2norm=True, out=y, debug=debug)
    y_ref = naive_packed_decode(ref, slots, q, k, v, g, beta, use_qk_l2norm=True, debug=debug_ref)
    active = slots >= 0
    assert torch.isnan(y[1]).all(), "a skipped row's output must stay untouched"
    assert rel_rms(debug["x"][active], debug_ref["x"]) < 1e-5
    assert rel_rms(y[active], y_ref[active]) < 1e-5
    for now, then in zip(kernel.tensors(), before, strict=True):
        assert torch.equal(now[[0, 2, 3]], then[[0, 2, 3]])
    # with two refits a code on a rounding tie of the first (summation order) moves the second refit
    far_share = 0.01 if kernel.format.config.refit_iters > 1 else 0.0
    before_fill = debug.get("r_before_fill")
    check_against_codec(kernel, ref, slots[active].tolist(), debug["x"][active], debug["c"][active],
                        exact_scales=False, far_share=far_share,
                        r_before_fill=None if before_fill is None else before_fill[active])
    index = slots[active].to(torch.int64)
    err_kernel = rel_rms(unpack(kernel.gather(index)).dequantize(), debug_ref["x"])
    err_ref = rel_rms(unpack(ref.gather(index)).dequantize(), debug_ref["x"])
    assert err_kernel <= 2 * err_ref + 1e-6


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_decode_from_zeroed_slots(kda):
    kernel, q_heads = _layer("K112-mixed-pivots", "reciprocal-refit1", num_slots=2)

    def decode(layer, slots, q, k, v, g, beta):
        return cuda.decode(layer.tables, layer.pages, slots, q, k, v, g, beta, use_qk_l2norm=True)

    check_decode_from_zeroed_slots(decode, kernel, q_heads, kda)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_rowwise_absmax_decode(kda):
    kernel, q_heads = _layer("K112-mixed-pivots", "absmax-refit0-midtread", num_slots=3, spatial="absmax")
    slots = torch.tensor([2, 0], dtype=torch.int32)
    naive_pack_states(kernel, slots, torch.randn(2, 4, 112, 128))
    ref = clone_layer(kernel)
    q, k, v, g, beta = token_inputs(2, 4, q_heads, 112, 128, kda, seed=7)
    debug = {}
    y = cuda.decode(kernel.tables, kernel.pages, slots, q, k, v, g, beta, debug=debug)
    y_ref = naive_packed_decode(ref, slots, q, k, v, g, beta)
    assert kernel.pages.col_scale is None
    assert rel_rms(y, y_ref) < 1e-5
    check_against_codec(kernel, ref, slots.tolist(), debug["x"], None, exact_scales=False)


def test_bf16_inputs_and_output_are_read_and_written_directly():
    # a serving engine's activations are BF16: the kernel reads them and writes y without conversions
    kernel, q_heads = _layer("K48-uniform-3578", "reciprocal-refit1", num_slots=2)
    naive_pack_states(kernel, torch.arange(2, dtype=torch.int32), torch.randn(2, 4, 48, 128))
    ref = clone_layer(kernel)
    slots = torch.tensor([1, 0], dtype=torch.int32)
    q, k, v, g, beta = (t.bfloat16() for t in token_inputs(2, 4, q_heads, 48, 128, False, seed=9))
    out = torch.full((2, 4, 128), float("nan"), dtype=torch.bfloat16)
    debug, debug_ref = {}, {}
    y = cuda.decode(kernel.tables, kernel.pages, slots, q, k, v, g, beta, use_qk_l2norm=True, out=out,
                    debug=debug)
    y_ref = naive_packed_decode(ref, slots, q, k, v, g, beta, use_qk_l2norm=True, debug=debug_ref,
                                out=torch.zeros(2, 4, 128))
    assert y is out and out.dtype == torch.bfloat16
    assert rel_rms(debug["x"], debug_ref["x"]) < 1e-5  # the same BF16 values in, upcast exactly
    assert rel_rms(out.float(), y_ref.bfloat16().float()) < 1e-3  # rounded once, to nearest even


def test_split_readout_then_writeback(monkeypatch):
    # with the readout's FP32 sums (SQ_MMA=0), those of the fused step; tensor cores: the test below
    monkeypatch.setitem(cuda.TUNING, "SQ_MMA", 0)
    fused, q_heads = _layer("K112-mixed-pivots", "reciprocal-refit1", num_slots=3)
    naive_pack_states(fused, torch.arange(3, dtype=torch.int32), torch.randn(3, 4, 112, 128))
    split = clone_layer(fused)
    slots = torch.tensor([1, -1, 2], dtype=torch.int32)
    q, k, v, g, beta = token_inputs(3, 4, q_heads, 112, 128, True, seed=15)
    y_fused = cuda.decode(fused.tables, fused.pages, slots, q, k, v, g, beta, use_qk_l2norm=True)
    before = [t.clone() for t in split.tensors()]
    work = torch.zeros(3, 4, 128)
    y = torch.full((3, 4, 128), float("nan"))
    tensors = split.tables, split.pages
    cuda.decode(*tensors, slots, q, k, v, g, beta, use_qk_l2norm=True, out=y, part="readout", work=work)
    assert all(torch.equal(a, b) for a, b in zip(before, split.tensors(), strict=True)), "readout wrote"
    assert torch.equal(y[[0, 2]], y_fused[[0, 2]]) and torch.isnan(y[1]).all()
    y_before = y.clone()
    cuda.decode(*tensors, slots, q, k, v, g, beta, use_qk_l2norm=True, out=y, part="writeback", work=work)
    assert torch.equal(y[[0, 2]], y_before[[0, 2]])
    # the writeback from the readout's u stores exactly what the fused step stores
    assert all(torch.equal(a, b) for a, b in zip(fused.tensors(), split.tensors(), strict=True))
    with pytest.raises(ValueError, match="work buffer"):
        cuda.decode(split.tables, split.pages, slots, q, k, v, g, beta, part="writeback")


def _tensor_core_readout_case(device: str, bits: torch.Tensor, q_heads: int, num_rows: int, config: str,
                              kda: bool, pending: bool) -> None:
    """The readout part's sums on tensor cores (SQ_MMA=1, KDA's default) against its FP32 FMAs (SQ_MMA=0,
    GDN's): y and u within 2e-5 relative RMS on the heads of one width b <= 7 (their BF16 levels are exact,
    a k and a q keep ~2^-17 per term as a BF16 high and low part), bit-identical on the heads that keep the
    FP32 path (8 bits, mixed rows, FP16 pivots); free rows and every slot untouched."""
    layer = make_layer(bits, value_dim=128, num_slots=num_rows, device=device, **CONFIGS[config])
    heads, key_dim = layer.num_heads, layer.key_dim
    all_slots = torch.arange(num_rows, dtype=torch.int32, device=device)
    naive_pack_states(layer, all_slots, 3 * torch.randn(num_rows, heads, key_dim, 128,
                                                        generator=torch.Generator().manual_seed(40)).to(device))
    before = [t.clone() for t in layer.tensors()]
    slots = all_slots.flip(0).contiguous()
    slots[1] = -1
    inputs = token_inputs(num_rows, heads, q_heads, key_dim, 128, kda, seed=41, device=device)
    held = None
    if pending:
        gen = torch.Generator().manual_seed(42)
        key_heads = cuda.key_heads_of_pending(layer.tables, q_heads, kda)
        held = ((torch.randn(num_rows, key_heads, 3, key_dim, generator=gen) / 8).half().to(device),
                torch.randn(num_rows, heads, 3, 128, generator=gen).half().to(device))
    out = {}
    for mma in (0, 1):
        work = torch.full((num_rows, heads, 128), float("nan"), device=device)
        y = torch.full_like(work, float("nan"))
        with cuda.tuning(SQ_MMA=mma):
            cuda.decode(layer.tables, layer.pages, slots, *inputs, use_qk_l2norm=True, out=y, part="readout",
                        work=work, pending=held)
        out[mma] = y, work
    assert all(torch.equal(a, b) for a, b in zip(before, layer.tensors(), strict=True)), "the readout wrote"
    active = slots >= 0
    tensor_cores = [h for h in range(heads) if int(bits[h].min()) == int(bits[h].max()) <= 7]
    assert tensor_cores, "no head of one width b <= 7"
    errors = []
    for (fp32, mma) in zip(out[0], out[1], strict=True):
        assert torch.isnan(mma[~active]).all()
        for h in range(heads):
            if h in tensor_cores:
                errors.append(rel_rms(mma[active, h], fp32[active, h]))
                assert 0 < errors[-1] < 2e-5, (h, errors[-1])
            else:
                assert torch.equal(mma[active, h], fp32[active, h]), h
    print(f"tensor-core readout, y and u against the FP32 sums: relative RMS {min(errors):.1e} to "
          f"{max(errors):.1e}")


@pytest.mark.parametrize(("config", "kda", "pending"), [("fill-refit0", False, False),
                                                        ("reciprocal-refit1-midtread", True, True)],
                         ids=["gdn-midrise", "kda-midtread-pending"])
def test_tensor_core_readout_matches_the_fp32_sums(config, kda, pending):
    # K = 48: a head of every width 2..8, a mixed head with FP16 pivot rows, a pivot head; 3 q/k heads
    bits = torch.tensor([2, 3, 4, 5, 6, 7, 8, 6, 6])[:, None].expand(9, 48).to(torch.int8).clone()
    bits[7, ::5] = PIVOT_BITS
    bits[8] = PIVOT_BITS
    _tensor_core_readout_case("cpu", bits, 3, 3, config, kda, pending)


def _rows_per_cta_case(shape, config, kda, num_rows, slots, device="cpu", items=3):
    """Every output of the fused step and of the split readout + writeback, with one batch row per CTA and
    with SQ_ITEMS = items (the staged pipeline), on BF16 inputs that start 2 bytes past a 16-byte boundary."""
    bits, q_heads = _plan(shape) if isinstance(shape, str) else shape
    num_slots = int(slots.max()) + 1
    base = make_layer(bits, value_dim=128, num_slots=num_slots, device=device, **CONFIGS[config])
    heads, key_dim = base.num_heads, base.key_dim
    naive_pack_states(base, torch.arange(num_slots, dtype=torch.int32, device=device),
                      torch.randn(num_slots, heads, key_dim, 128, generator=torch.Generator().manual_seed(22))
                      .to(device))

    def offset(t):  # the same values in a view one BF16 element past an aligned allocation
        buffer = torch.empty(t.numel() + 1, dtype=torch.bfloat16, device=device)
        buffer[1:].copy_(t.reshape(-1))
        return buffer[1:].view(t.shape)

    q, k, v, g, beta = token_inputs(num_rows, heads, q_heads, key_dim, 128, kda, seed=21, device=device)
    q, k, v, beta = (offset(t) for t in (q, k, v, beta))
    outputs = {}
    for rows in (1, items):
        with cuda.tuning(SQ_ITEMS=rows):
            fused, split = clone_layer(base), clone_layer(base)
            y = torch.full((num_rows, heads, 128), float("nan"), device=device)
            debug = {}
            cuda.decode(fused.tables, fused.pages, slots, q, k, v, g, beta, use_qk_l2norm=True, out=y,
                        debug=debug)
            work = offset(torch.zeros(num_rows, heads, 128, device=device)).float()
            y_split = torch.full_like(y, float("nan"))
            tensors = split.tables, split.pages
            cuda.decode(*tensors, slots, q, k, v, g, beta, use_qk_l2norm=True, out=y_split, part="readout",
                        work=work)
            cuda.decode(*tensors, slots, q, k, v, g, beta, use_qk_l2norm=True, out=y_split, part="writeback",
                        work=work)
        outputs[rows] = [y, y_split, *debug.values(), *fused.tensors(), *split.tensors()]
    for one, staged in zip(outputs[1], outputs[items], strict=True):
        torch.testing.assert_close(staged, one, rtol=0, atol=0, equal_nan=True)
    return outputs[1][0]


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("config", ["reciprocal-refit1", "fill-refit0"])
def test_rows_per_cta_store_what_one_row_per_cta_stores(config, kda):
    # CTAs of 3 rows: a free row first, a CTA of free rows only, a last CTA of 2 (8 rows)
    slots = torch.tensor([-1, 4, 1, -1, -1, -1, 6, 0], dtype=torch.int32)
    y = _rows_per_cta_case("K112-mixed-pivots", config, kda, 8, slots)
    assert torch.isnan(y[[0, 3, 4, 5]]).all() and not torch.isnan(y[[1, 2, 6, 7]]).any()


def test_rows_per_cta_refuse_misaligned_pages(monkeypatch):
    # the staged parts copy the pages in 16-byte chunks: a view 2 bytes into an allocation is refused with
    # the fix named, before any library is built or launched (the inputs q, k, v, g, beta are copied instead)
    monkeypatch.setitem(cuda.TUNING, "SQ_ITEMS", 3)
    layer = make_layer(torch.full((2, 16), 6, dtype=torch.int8), value_dim=128, num_slots=2)
    shifted = torch.zeros(layer.pages.row_scale.numel() + 1, dtype=torch.float16)[1:]
    pages = dataclasses.replace(layer.pages, row_scale=shifted.view(layer.pages.row_scale.shape))
    inputs = token_inputs(2, 2, 2, 16, 128, False, seed=1)
    monkeypatch.setattr(cuda, "_load", lambda *a: pytest.fail("built a library for a launch it must refuse"))
    for part in cuda.STAGED_PARTS:
        work = torch.zeros(2, 2, 128) if part == "writeback" else None
        refused = "pages.row_scale starts 2 bytes past a 16-byte boundary.*Pages.empty"
        with pytest.raises(ValueError, match=refused):
            cuda.decode(layer.tables, pages, torch.tensor([0, 1], dtype=torch.int32), *inputs, part=part,
                        work=work)


def test_rows_per_cta_compiled_into_the_staged_parts_only(monkeypatch):
    # the readout and the pack would only loop over a CTA's rows (measured 13-30% slower on the H200): they
    # keep one row per CTA whatever SQ_ITEMS is, the fused step and the writeback take the knob
    monkeypatch.setitem(cuda.TUNING, "SQ_ITEMS", 4)
    tables = make_layer(torch.full((2, 16), 6, dtype=torch.int8), value_dim=128, num_slots=2).tables
    items = {part: dict(cuda.defines_for(tables, part, kda=False))["SQ_ITEMS"] for part in cuda.PARTS}
    assert items == {"fused": 4, "readout": 1, "writeback": 4, "pack": 1}


def test_tensor_core_sums_compiled_into_kdas_readout_by_default(monkeypatch):
    # SQ_MMA None (the default): KDA's readout on tensor cores, GDN's on FP32 FMAs (measured, cuda.mma_for);
    # 0 or 1 (STEPQUANT_CUDA_MMA) sets both; never in the other parts, nor at 8 key rows per warp
    tables = make_layer(torch.full((2, 16), 6, dtype=torch.int8), value_dim=128, num_slots=2).tables
    compiled = lambda: {(part, kda): dict(cuda.defines_for(tables, part, kda))["SQ_MMA"]
                        for part in cuda.PARTS for kda in (False, True)}
    monkeypatch.setitem(cuda.TUNING, "SQ_MMA", None)
    assert {key for key, mma in compiled().items() if mma} == {("readout", True)}
    monkeypatch.setitem(cuda.TUNING, "SQ_MMA", 1)
    assert {key for key, mma in compiled().items() if mma} == {("readout", False), ("readout", True)}
    monkeypatch.setitem(cuda.TUNING, "SQ_ROWS", 8)
    assert not any(compiled().values())
    monkeypatch.setenv("STEPQUANT_CUDA_MMA", "2")
    with pytest.raises(ValueError, match="STEPQUANT_CUDA_MMA='2'"):
        cuda._tuning_from_env("STEPQUANT_CUDA_MMA", None, (0, 1), "sums the readout on tensor cores")


def test_rejects_shapes_it_does_not_serve():
    layer = make_layer(torch.full((2, 16), 6, dtype=torch.int8), value_dim=64, num_slots=2)
    q, k, v, g, beta = token_inputs(2, 2, 2, 16, 64, False, seed=1)
    with pytest.raises(ValueError, match="V = 128"):
        cuda.decode(layer.tables, layer.pages, torch.tensor([0, 1], dtype=torch.int32), q, k, v, g, beta)
    assert not cuda.supported(layer.tables)
    odd = make_layer(torch.full((2, 40), 6, dtype=torch.int8), value_dim=128, num_slots=2)
    with pytest.raises(ValueError, match="multiple of 16"):
        cuda.pack(odd.tables, odd.pages, torch.tensor([0, 1], dtype=torch.int32), torch.zeros(2, 2, 40, 128))


# ---------------------------------------------------------------- GPU: real shapes (run on the H200)

gpu = pytest.mark.skipif(not torch.cuda.is_available() or not cuda.nvcc_path(), reason="needs CUDA and nvcc")


def _gpu_case(bits, key_heads, kda, num_rows, spatial="dual_axis", **config):
    gpu_decode_case(cuda.decode, bits, key_heads, kda, num_rows, spatial, **config)


GPU_QUANTIZERS = ("reciprocal-refit1", "reciprocal-refit0", "reciprocal-refit1-midtread",
                  "reciprocal-meanabs-refit1-midtread", "fill-refit0", "fill-refit1-midtread")
QUANTIZERS = {name: CONFIGS[name] for name in GPU_QUANTIZERS}
QUANTIZERS["exact-refit2"] = dict(refit_iters=2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("quantizer", list(QUANTIZERS), ids=list(QUANTIZERS))
@pytest.mark.parametrize("num_rows", [32, 512], ids=["B32", "B512"])
def test_gpu_gdn_qwen_shape(num_rows, quantizer):
    # 48 heads, 16 key heads (GQA), heads at 4..8 bits plus one FP16 pivot head
    bits = torch.tensor([4, 5, 6, 7, 8, 6] * 8, dtype=torch.int8)[:, None].expand(48, 128).clone()
    bits[7] = PIVOT_BITS
    _gpu_case(bits, 16, False, num_rows, **QUANTIZERS[quantizer])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("quantizer", list(QUANTIZERS), ids=list(QUANTIZERS))
def test_gpu_kda_kimi_shape(quantizer):
    gen = torch.Generator().manual_seed(13)
    bits = torch.randint(4, 9, (32, 128), generator=gen)
    bits.view(-1)[torch.randperm(32 * 128, generator=gen)[:26]] = PIVOT_BITS
    _gpu_case(bits.to(torch.int8), 32, True, 256, **QUANTIZERS[quantizer])


@pytest.mark.gpu
@gpu
def test_gpu_rowwise_absmax_and_pack():
    bits = torch.full((32, 128), 4, dtype=torch.int8)
    _gpu_case(bits, 32, True, 64, spatial="absmax")
    layer = make_layer(bits, value_dim=128, num_slots=64, device="cuda", refit_iters=0, row_stat="absmax")
    ref = clone_layer(layer)
    slots = torch.arange(64, dtype=torch.int32, device="cuda")
    x = torch.randn(64, 32, 128, 128, device="cuda")
    cuda.pack(layer.tables, layer.pages, slots, x)
    naive_pack_states(ref, slots, x)
    check_against_codec(layer, ref, slots.tolist(), x, None, exact_scales=True)


@pytest.mark.gpu
@gpu
def test_gpu_split_step_orders_writebacks(monkeypatch):
    # four tokens in a row, no host sync: the split path (readout on this stream, writeback on a side
    # stream) must store exactly what the fused step stores, token after token (with the readout's FP32 sums,
    # SQ_MMA=0: the streams' order does not depend on them)
    from stepquant.kernels.decode import decode_step_split

    monkeypatch.setitem(cuda.TUNING, "SQ_MMA", 0)
    bits = torch.tensor([4, 5, 6, 7, 8, 6] * 8, dtype=torch.int8)[:, None].expand(48, 128).clone()
    bits[7] = PIVOT_BITS
    fused = make_layer(bits, value_dim=128, num_slots=512, device="cuda", **CONFIGS["reciprocal-refit1"])
    naive_pack_states(fused, torch.arange(512, dtype=torch.int32, device="cuda"),
                      torch.randn(512, 48, 128, 128, device="cuda"))
    split = clone_layer(fused)
    slots = torch.randperm(512, generator=torch.Generator().manual_seed(3)).to("cuda", torch.int32)
    side = torch.cuda.Stream()
    for t in range(4):
        q, k, v, g, beta = token_inputs(512, 48, 16, 128, 128, False, seed=30 + t, device="cuda")
        y_fused = cuda.decode(fused.tables, fused.pages, slots, q, k, v, g, beta, use_qk_l2norm=True)
        y_split = decode_step_split(split, slots, q, k, v, g, beta, stream=side, use_qk_l2norm=True)
        assert torch.equal(y_split, y_fused), f"token {t}: the readout read a slot before its writeback"
    assert split.pending is not None
    split.wait_writes()
    assert all(torch.equal(a, b) for a, b in zip(fused.tensors(), split.tensors(), strict=True))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("items", [2, 4, 8])
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_gpu_rows_per_cta(kda, items):
    # the staged pipeline on the GPU (cp.async groups, two buffers, misaligned BF16 inputs copied): every
    # output bit-identical to one row per CTA, at B = 509 with free rows (the plan shapes of the tests above)
    gen = torch.Generator().manual_seed(17)
    if kda:
        bits = torch.randint(4, 9, (32, 128), generator=gen)
        bits.view(-1)[torch.randperm(32 * 128, generator=gen)[:26]] = PIVOT_BITS
        shape = bits.to(torch.int8), 32
    else:
        bits = torch.tensor([4, 5, 6, 7, 8, 6] * 8, dtype=torch.int8)[:, None].expand(48, 128).clone()
        bits[7] = PIVOT_BITS
        shape = bits, 16
    slots = torch.randperm(600, generator=gen)[:509].to(torch.int32)
    slots[torch.randperm(509, generator=gen)[:40]] = -1
    slots[:items] = -1  # a CTA of free rows only
    _rows_per_cta_case(shape, "fill-refit0", kda, 509, slots.cuda(), device="cuda", items=items)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(("config", "kda", "pending"), [("fill-refit0", False, False),
                                                        ("fill-refit1-midtread", False, True),
                                                        ("fill-refit0", True, True)],
                         ids=["gdn-midrise", "gdn-midtread-pending", "kda-pending"])
def test_gpu_tensor_core_readout_matches_the_fp32_sums(config, kda, pending):
    # the shapes of the GDN test above (48 heads at 4..8 bits, a pivot head, 16 q/k heads) at B = 512
    bits = torch.tensor([4, 5, 6, 7, 8, 6] * 8, dtype=torch.int8)[:, None].expand(48, 128).clone()
    bits[7] = PIVOT_BITS
    _tensor_core_readout_case("cuda", bits, 16, 512, config, kda, pending)


@pytest.mark.skipif(cuda.nvcc_path() is None, reason="needs nvcc")
def test_nvcc_build_exports_the_entry_points(tmp_path, monkeypatch):
    # the library a GPU loads: ctypes must find sq_packed_step and agree on the Params layout (a
    # function taking an internal-linkage type once lost its export in the nvcc host build)
    import ctypes

    monkeypatch.setenv("STEPQUANT_KERNEL_CACHE", str(tmp_path))
    layer = make_layer(torch.full((2, 16), 6, dtype=torch.int8), value_dim=128, num_slots=1,
                       **CONFIGS["reciprocal-refit1"])
    lib = ctypes.CDLL(str(cuda.build(cuda.defines_for(layer.tables, "fused", kda=False), "90")))
    assert lib.sq_params_size() == ctypes.sizeof(cuda._Params)
    assert lib.sq_packed_step and lib.sq_error_string


def _two_copies(shape: str, config: str, num_rows: int, device: str):
    """A layer with random packed states, a copy of it, its slots in reverse with row 1 free, q/k heads."""
    layer, q_heads = _layer(shape, config, num_slots=num_rows, device=device)
    all_slots = torch.arange(num_rows, dtype=torch.int32, device=device)
    states = torch.randn(num_rows, layer.num_heads, layer.key_dim, 128, device=device)
    naive_pack_states(layer, all_slots, states)
    slots = all_slots.flip(0).contiguous()
    slots[1] = -1
    return layer, clone_layer(layer), slots, q_heads


def _pending_case(config: str, device: str = "cpu", num_rows: int = 3, shape: str = "K112-mixed-pivots"):
    """The writeback of a deferred state's fit (SQ_PENDING): X = the plain writeback's X plus sum_j k_j u_j^T
    of the FP16 pending updates, and the codes are the codec's given that X (check_against_codec)."""
    kernel, plain, slots, q_heads = _two_copies(shape, config, num_rows, device)
    heads, key_dim = kernel.num_heads, kernel.key_dim
    q, k, v, g, beta = token_inputs(num_rows, heads, q_heads, key_dim, 128, True, seed=21, device=device)
    gen = torch.Generator().manual_seed(22)
    pend_k = (torch.randn(num_rows, heads, 2, key_dim, generator=gen) / 8).half().to(device)
    pend_u = torch.randn(num_rows, heads, 2, 128, generator=gen).half().to(device)
    work = torch.zeros(num_rows, heads, 128, device=device)
    y = cuda.decode(kernel.tables, kernel.pages, slots, q, k, v, g, beta, use_qk_l2norm=True, part="readout",
                    work=work)
    debug, debug_plain = {}, {}
    cuda.decode(plain.tables, plain.pages, slots, q, k, v, g, beta, use_qk_l2norm=True, out=y.clone(),
                part="writeback", work=work, debug=debug_plain)
    cuda.decode(kernel.tables, kernel.pages, slots, q, k, v, g, beta, use_qk_l2norm=True, out=y,
                part="writeback", work=work, pending=(pend_k, pend_u), debug=debug)
    active = slots >= 0
    added = torch.einsum("nhjk,nhjv->nhkv", pend_k.float(), pend_u.float())
    assert rel_rms(debug["x"][active], (debug_plain["x"] + added)[active]) < 1e-6
    ref = clone_layer(kernel)
    naive_pack_states(ref, slots, debug["x"])
    check_against_codec(kernel, ref, slots[active].tolist(), debug["x"][active], debug["c"][active],
                        exact_scales=False, far_share=1e-3,
                        r_before_fill=debug["r_before_fill"][active] if "r_before_fill" in debug else None)
    return kernel, slots, (q, k, v, g, beta), work, (pend_k, pend_u)


@pytest.mark.parametrize("config", ["fill-refit0", "reciprocal-refit1-midtread"])
def test_writeback_folds_pending_updates(config):
    kernel, slots, inputs, work, (pend_k, pend_u) = _pending_case(config)
    with pytest.raises(ValueError, match="pending must be"):
        cuda.decode(kernel.tables, kernel.pages, slots, *inputs, part="writeback", work=work,
                    pending=(pend_k[:, :, :, :16], pend_u))
    with pytest.raises(ValueError, match="folds all 2"):
        cuda.decode(kernel.tables, kernel.pages, slots, *inputs, part="fused", pending=(pend_k, pend_u),
                    pending_append=0)
    with pytest.raises(ValueError, match="pending_count"):
        cuda.decode(kernel.tables, kernel.pages, slots, *inputs, part="writeback", work=work,
                    pending=(pend_k, pend_u), pending_count=1)
    from stepquant.kernels.decode.deferred import DeferredBuffers

    with pytest.raises(ValueError, match="every 2..16"):  # the kernel holds at most 15 pending updates
        DeferredBuffers.empty(kernel.tables, 3, every=17, kda=True, key_heads=2)
    with pytest.raises(ValueError, match="divisor of its 4 value heads"):
        DeferredBuffers.empty(kernel.tables, 3, every=4, kda=False, key_heads=3)
    with pytest.raises(ValueError, match="HK = 2"):  # GDN's k_j: one per q/k head
        cuda.decode(kernel.tables, kernel.pages, slots, *inputs[:3], inputs[3][..., 0], inputs[4],
                    part="fused", pending=(pend_k, pend_u))
    with pytest.raises(ValueError, match="contiguous FP16"):
        cuda.decode(kernel.tables, kernel.pages, slots, *inputs, part="writeback", work=work,
                    pending=(pend_k.float(), pend_u))
    shifted = torch.empty(pend_k.numel() + 1, dtype=torch.float16)[1:].view(pend_k.shape)  # 2 bytes off
    with pytest.raises(ValueError, match="16-byte aligned"):
        cuda.decode(kernel.tables, kernel.pages, slots, *inputs, part="writeback", work=work,
                    pending=(shifted, pend_u))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("config", ["fill-refit0", "fill-refit1-midtread"])
def test_gpu_writeback_folds_pending_updates(config):
    _pending_case(config, device="cuda", num_rows=67, shape="K128-4b")


def _fused_fit_case(device: str, shape: str, num_rows: int, config: str = "fill-refit0") -> None:
    """A deferred state's fit token in one pass (the fused step with SQ_PENDING) stores and returns exactly
    what the split readout (with FP32 sums, SQ_MMA=0) + writeback with the same pending updates do: y, codes
    and scales."""
    for kda in (True, False):
        fused, split, slots, q_heads = _two_copies(shape, config, num_rows, device)
        heads, key_dim = fused.num_heads, fused.key_dim
        inputs = token_inputs(num_rows, heads, q_heads, key_dim, 128, kda, seed=23, device=device)
        gen = torch.Generator().manual_seed(24)
        key_heads = heads if kda else q_heads  # GDN: one k_j per q/k head
        pending = ((torch.randn(num_rows, key_heads, 3, key_dim, generator=gen) / 8).half().to(device),
                   torch.randn(num_rows, heads, 3, 128, generator=gen).half().to(device))
        y_fused = cuda.decode(fused.tables, fused.pages, slots, *inputs, use_qk_l2norm=True, pending=pending)
        work = torch.zeros(num_rows, heads, 128, device=device)
        y = cuda.decode(split.tables, split.pages, slots, *inputs, use_qk_l2norm=True, part="readout",
                        work=work, pending=pending)
        cuda.decode(split.tables, split.pages, slots, *inputs, use_qk_l2norm=True, out=y, part="writeback",
                    work=work, pending=pending)
        active = slots >= 0
        assert torch.equal(y_fused[active], y[active])
        assert all(torch.equal(a, b) for a, b in zip(fused.tensors(), split.tensors(), strict=True))


def test_fused_fit_matches_the_split_fit(monkeypatch):
    monkeypatch.setitem(cuda.TUNING, "SQ_MMA", 0)
    _fused_fit_case("cpu", "K112-mixed-pivots", num_rows=3)


@pytest.mark.gpu
@gpu
def test_gpu_fused_fit_matches_the_split_fit(monkeypatch):
    monkeypatch.setitem(cuda.TUNING, "SQ_MMA", 0)
    _fused_fit_case("cuda", "K128-4b", num_rows=67)


def _deferred_case(device: str, shape: str, num_rows: int, tokens: int = 7, every: int = 3,
                   fit: str = "fused", gates: str = "kernel") -> None:
    """decode_deferred (the readout every token with the pending terms, a fit every R-th) against the float
    recurrence that fits every R-th token with the layer's codec (codecs/deferred.py's format)."""
    from stepquant.kernels.decode.deferred import DeferredBuffers, decode_deferred
    from stepquant.recurrence import prepare_qk, step

    for kda in (True, False):
        layer, q_heads = _layer(shape, "fill-refit0", num_slots=num_rows, device=device)
        heads, key_dim = layer.num_heads, layer.key_dim
        start = torch.randn(num_rows, heads, key_dim, 128, generator=torch.Generator().manual_seed(5))
        slots = torch.arange(num_rows, dtype=torch.int32, device=device).flip(0).contiguous()
        naive_pack_states(layer, slots, start.to(device))
        state = last_fit = unpack(layer.gather(slots.long())).dequantize()
        codec = layer.format.codec()
        buffers = DeferredBuffers.empty(layer.tables, num_rows, every=every, kda=kda, key_heads=q_heads)
        errors, ages = [], []
        for t in range(tokens):
            q, k, v, g, beta = token_inputs(num_rows, heads, q_heads, key_dim, 128, kda, seed=30 + t,
                                            device=device)
            age = buffers.age
            # what the kernel (or torch) must leave: the gate sum carried on, the held updates decayed by e^g
            gate_sum = buffers.g_sum + g.float()
            decay = torch.exp(g.float())[:, :, None, :] if kda else torch.exp(g.float())[:, :, None, None]
            held = (buffers.pend_k if kda else buffers.pend_u)[:, :, :age]
            decayed = (held.float() * decay).half()
            y = decode_deferred(layer.tables, layer.pages, slots, q, k, v, g, beta, buffers,
                                use_qk_l2norm=True, fit=fit, gates=gates)
            if buffers.age:  # a readout token
                assert torch.equal(buffers.g_sum, gate_sum)
                torch.testing.assert_close(held, decayed, rtol=2e-3, atol=1e-6)  # e^g: expf against torch.exp
            else:
                assert not buffers.g_sum.any()
            b_q, b_k = prepare_qk(q, k, use_qk_l2norm=True, mode="kda" if kda else "gdn")
            x, y_ref = step(state, b_q, b_k, v, g, beta)
            errors.append(rel_rms(y, y_ref))
            stored = unpack(layer.gather(slots.long())).dequantize()
            if t % every == every - 1:  # a fit: the slots hold the codec's fit of (almost) the reference's X
                assert rel_rms(stored, x) <= 1.05 * rel_rms(codec.roundtrip(x), x)
                state = last_fit = stored  # from here both read the kernel's codes (a code on a tie may flip)
            else:
                assert torch.equal(stored, last_fit)  # no write between fits
                state = x
            ages.append(buffers.age)
        assert ages == [(t + 1) % every for t in range(tokens)]
        assert max(errors) < 1e-3, errors  # FP16 pending updates and another summation order


DEFERRED_PATHS = [("fused", "kernel"), ("split", "kernel"), ("fused", "torch"), ("split", "torch")]


@pytest.mark.parametrize(("fit", "gates"), DEFERRED_PATHS)
def test_deferred_decode_follows_the_deferred_format(fit, gates):
    _deferred_case("cpu", "K48-uniform-3578", num_rows=2, fit=fit, gates=gates)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(("fit", "gates"), DEFERRED_PATHS)
def test_gpu_deferred_decode_follows_the_deferred_format(fit, gates):
    _deferred_case("cuda", "K128-4b", num_rows=37, tokens=9, every=4, fit=fit, gates=gates)

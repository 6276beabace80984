"""Shared helpers of the kernel tests (test_kernels.py: Triton, test_cuda_kernel.py: CUDA): formats, layers,
inputs, and the bit-exactness policy of docs/kernels.md as one check (:func:`check_against_codec`).

Kept free of triton imports: test_kernels.py must switch the Triton interpreter on before triton loads.
"""

from __future__ import annotations

import torch

from stepquant.codecs import LayerFormat
from stepquant.codecs.base import PIVOT_BITS, QState, round_to_codes
from stepquant.codecs.dual_axis import DualAxisConfig, codes_for, fill_rows, scale_down
from stepquant.codecs.packing import pack, unpack
from stepquant.pool import PackedLayer

SCALE_RTOL = 2.0**-9  # two FP16 steps: refit sums in another order may move a scale by one step


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def mixed_bits(num_heads: int, key_dim: int, choices: tuple[int, ...], seed: int,
               pivot_rows: int = 0, pivot_head: bool = False) -> torch.Tensor:
    """A plan [H, K]: head 0 uniform (GDN-like), other heads mixed rows (KDA-like), optional pivots."""
    gen = torch.Generator().manual_seed(seed)
    bits = torch.tensor(choices)[torch.randint(len(choices), (num_heads, key_dim), generator=gen)]
    bits[0] = choices[len(choices) // 2]
    if pivot_rows:
        rows = torch.randperm(key_dim, generator=gen)[:pivot_rows]
        bits[-1, rows] = PIVOT_BITS
    if pivot_head:
        bits[-1] = PIVOT_BITS
    return bits.to(torch.int8)


def make_layer(bits, *, seed=0, spatial="dual_axis", num_slots=4, value_dim=32, device="cpu", **config):
    gen = torch.Generator().manual_seed(seed + 100)
    w = torch.rand(bits.shape, generator=gen) + 0.25
    return PackedLayer(LayerFormat(bits, w, spatial, DualAxisConfig(**config)), num_slots, value_dim, device)


def token_inputs(num_rows, heads, q_heads, key_dim, value_dim, kda, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device)
    q, k = rand(num_rows, q_heads, key_dim), rand(num_rows, q_heads, key_dim)
    v = rand(num_rows, heads, value_dim)
    g = -torch.rand(num_rows, heads, *((key_dim,) if kda else ()), generator=gen).to(device)
    beta = torch.rand(num_rows, heads, generator=gen).to(device)
    return q, k, v, g, beta


def clone_layer(layer: PackedLayer) -> PackedLayer:
    twin = PackedLayer(layer.format, layer.num_slots, layer.value_dim, layer.device)
    for dst, src in zip(twin.tensors(), layer.tensors(), strict=True):
        dst.copy_(src)
    return twin


def requantize_with(layer: PackedLayer, x: torch.Tensor, row_scale: torch.Tensor,
                    col_code: torch.Tensor | None, r_before_fill: torch.Tensor | None = None) -> QState:
    """The codes the layer's codec gives X [n, H, K, V] with the kernel's row scales and the column scales
    the kernel's codes were computed against (dual_axis.codes_for; rowwise absmax: true division).

    r_before_fill: with a row_fill quantizer, the kernel's row scales before the fill (its debug output);
    the kernel's row scales must then be exactly dual_axis.fill_rows of them and of col_code (the column
    init: quantizers of at most one refit), and the codes follow from the filled Y."""
    bits = layer.format.bits.to(x.device).to(torch.int64)
    is_pivot = bits == PIVOT_BITS
    row_bits = torch.where(is_pivot, 8, bits)[None, :, :, None]
    r = row_scale.to(torch.float32)
    config = layer.format.config
    if col_code is not None and config.row_fill:
        assert r_before_fill is not None and config.refit_iters <= 1
        y, filled = fill_rows(scale_down(x, r_before_fill[..., None], config), r_before_fill, col_code,
                              layer.format.bits, config)
        assert torch.equal(filled, r), "the kernel's filled row scales differ from fill_rows of its own"
        codes = codes_for(y, col_code, row_bits, config)
    elif col_code is not None:
        codes = codes_for(scale_down(x, r[..., None], config), col_code, row_bits, config)
    else:
        codes = round_to_codes(x / r[..., None], row_bits, layer.grid)
    codes = torch.where(is_pivot[None, :, :, None], 0, codes).to(torch.uint8)
    pivots = None
    if bool(is_pivot.any()):
        pivots = torch.where(is_pivot[None, :, :, None], x.clamp(-65504, 65504), 0).to(torch.float16)
    return QState(codes, layer.format.bits, row_scale, None, pivots, layer.grid)


def check_against_codec(kernel: PackedLayer, ref: PackedLayer, slots: list[int], x: torch.Tensor,
                        col_code: torch.Tensor, exact_scales: bool, far_share: float = 0.0,
                        r_before_fill: torch.Tensor | None = None) -> None:
    """The policy of docs/kernels.md for the slots both layers wrote from the same X.

    far_share: the share of refitted column scales allowed to differ by more than SCALE_RTOL (GPU
    tests at real shapes: a code on a rounding tie that flips with the summation order moves the next
    refit, so over ~10^5 columns a handful can land a few FP16 steps away; codes are still exact)."""
    index = torch.tensor(slots)
    got, want = unpack(kernel.gather(index)), unpack(ref.gather(index))
    if exact_scales:
        assert torch.equal(kernel.pages.codes[index], ref.pages.codes[index])
        assert torch.equal(kernel.pages.row_scale[index], ref.pages.row_scale[index])
        if ref.pages.col_scale is not None:
            assert torch.equal(kernel.pages.col_scale[index], ref.pages.col_scale[index])
        return
    # row scales come from an order-independent statistic (absmax) or an FP32 sum (rms)
    torch.testing.assert_close(got.row_scale.float(), want.row_scale.float(), rtol=SCALE_RTOL, atol=0)
    if want.col_scale is not None:
        near = (got.col_scale.float() - want.col_scale.float()).abs() <= SCALE_RTOL * want.col_scale.float()
        assert 1.0 - near.float().mean().item() <= far_share, f"{int((~near).sum())} column scales differ"
    # codes exactly, given the kernel's X and scales
    again = requantize_with(kernel, x, got.row_scale, None if want.col_scale is None else col_code,
                            r_before_fill)
    is_int = (kernel.format.bits != PIVOT_BITS).to(x.device)[None, :, :, None]
    assert torch.equal(torch.where(is_int, got.codes, 0), again.codes)
    if again.pivots is not None:
        assert torch.equal(got.pivots.view(torch.int16), again.pivots.view(torch.int16))
    # and the words are exactly the packing of those codes and scales
    col = None if want.col_scale is None else got.col_scale
    repacked = pack(QState(again.codes, kernel.format.bits, got.row_scale, col, again.pivots, kernel.grid),
                    kernel.layout)
    assert torch.equal(kernel.pages.codes[index], repacked.codes)


def gpu_decode_case(decode, bits, key_heads, kda, num_rows, spatial="dual_axis", **config) -> None:
    """One decode token on CUDA at a real shape (K = V = 128) by ``decode`` (a kernel's tensor-level entry,
    e.g. cuda.decode) against the torch reference: X and y by relative RMS, codes exact given the kernel's
    scales, the stored state's error at most 2x the reference's own."""
    from stepquant.kernels.decode import naive_pack_states, naive_packed_decode

    heads = bits.shape[0]
    layer = make_layer(bits, spatial=spatial, value_dim=128, num_slots=num_rows + 1, device="cuda", **config)
    all_slots = torch.arange(layer.num_slots, dtype=torch.int32, device="cuda")
    naive_pack_states(layer, all_slots, torch.randn(layer.num_slots, heads, 128, 128, device="cuda"))
    ref = clone_layer(layer)
    slots = all_slots[1:].flip(0).contiguous()
    slots[0] = -1
    q, k, v, g, beta = token_inputs(num_rows, heads, key_heads, 128, 128, kda, seed=12, device="cuda")
    debug, debug_ref = {}, {}
    y = decode(layer.tables, layer.pages, slots, q, k, v, g, beta, use_qk_l2norm=True, debug=debug)
    y_ref = naive_packed_decode(ref, slots, q, k, v, g, beta, use_qk_l2norm=True, debug=debug_ref)
    active = slots >= 0
    assert rel_rms(debug["x"][active], debug_ref["x"]) < 1e-5
    assert rel_rms(y[active], y_ref[active]) < 1e-5
    before_fill = debug.get("r_before_fill")
    check_against_codec(layer, ref, slots[active].tolist(), debug["x"][active], debug["c"][active],
                        exact_scales=False, far_share=1e-3,
                        r_before_fill=None if before_fill is None else before_fill[active])
    index = slots[active].to(torch.int64)
    err = rel_rms(unpack(layer.gather(index)).dequantize(), debug_ref["x"])
    err_ref = rel_rms(unpack(ref.gather(index)).dequantize(), debug_ref["x"])
    assert err <= 2 * err_ref + 1e-6


def check_decode_from_zeroed_slots(decode, kernel: PackedLayer, q_heads: int, kda: bool) -> None:
    """A zeroed slot is the zero state (``Pages.empty``): one decode token on it gives the reference's
    output and stored state, with no NaN (a mixed head's FP16 pivot rows once read 0 * (1 / 0) there).

    ``decode(layer, slots, q, k, v, g, beta) -> y`` runs the kernel under test; every page is zeroed first.
    """
    from stepquant.kernels.decode import naive_packed_decode  # imports triton: not at this module's top

    for tensor in kernel.tensors():
        tensor.zero_()
    ref = clone_layer(kernel)
    slots = torch.arange(kernel.num_slots, dtype=torch.int32, device=kernel.device)
    q, k, v, g, beta = token_inputs(kernel.num_slots, kernel.num_heads, q_heads, kernel.key_dim,
                                    kernel.value_dim, kda, seed=11, device=kernel.device)
    y = decode(kernel, slots, q, k, v, g, beta)
    y_ref = naive_packed_decode(ref, slots, q, k, v, g, beta, use_qk_l2norm=True)
    assert bool(torch.isfinite(y).all()), "decoding a zeroed slot gave non-finite outputs"
    assert rel_rms(y, y_ref) < 1e-5
    index = slots.to(torch.int64)
    state, state_ref = unpack(kernel.gather(index)).dequantize(), unpack(ref.gather(index)).dequantize()
    assert bool(torch.isfinite(state).all())
    assert rel_rms(state, state_ref) < 2e-3  # both quantize the same X = k u^T (scales may differ by a step)

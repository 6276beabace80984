"""Fused packed-state decode step (GDN and KDA) and boundary pack, as Triton kernels.

One program per (request, head) reads that head's packed code words and FP16 scales straight from the
pool slot (docs/format.md), rebuilds the [K, V] state in registers, applies the gate and the delta
update, writes the readout y = X^T q (read BEFORE requantizing), then requantizes X with STEPQuant's
key-row-aware dual-axis fitting (or rowwise absmax) and writes the words and scales back in place. The
FP32 state never exists in global memory, which is what makes the step faster than the FP32 kernel:
decode is bandwidth-bound and the packed slot is 5-7x smaller.

The requantizer reproduces ``stepquant.codecs.dual_axis.fit_dual_axis`` /
``stepquant.codecs.mixed.fit_rowwise_absmax`` exactly given the same X and the same scales:
true FP32 divisions (X / r, Y / c) done as a multiply by the correctly rounded reciprocal plus one
Markstein FMA correction (exact for FP16-valued divisors, docs/kernels.md), round-half-to-even by the
1.5 * 2^23 magic-number trick, clamp-then-FP16 scale rounding. Only FP32 reductions (rms row
statistic, column refit sums) differ from torch in summation order.

Per-row bit widths are runtime data (the plan), not constexprs: each plane width w in {16, 8, 4, 2, 1}
is read for the rows whose b_i has bit w set, at word offset "row offset + words of the wider planes
present", so one compiled kernel serves GDN heads (all rows of a head equal), KDA heads (mixed rows)
and FP16 pivot rows. Planes no row of a head uses are skipped by a head-uniform branch.

Tile layout: the state tile is [BK, BV] (key rows x value columns, the whole head). Packing works on
8-value chunks: the tile is viewed as [BK, NM, 8] (NM = BV / 8), and one chunk of a w-bit plane is
exactly 8w bits, i.e. one uint8 (w=1), uint16 (w=2) or int32 (w=4) load or store; 8-bit planes and
FP16 pivots are read and written per value as bytes / halves. Every access to a row is contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stepquant.codecs.base import Grid
from stepquant.pool import PackedLayer

# 1.5 * 2^23: adding it rounds an FP32 |x| < 2^22 to an integer, half to even (round-to-nearest).
MAGIC_RINT = tl.constexpr(12582912.0)
# 2^23: code | 0x4B000000 reinterpreted as FP32 is 2^23 + code.
MAGIC_CODE = tl.constexpr(8388608.0)
FP16_SCALE_MIN = tl.constexpr(6.103515625e-05)  # 2^-14
FP16_SCALE_MAX = tl.constexpr(65504.0)


@triton.jit
def _fp16_scale(x):
    # base.fp16_scale: clamp in FP32, round to nearest FP16, compute on in FP32
    return tl.minimum(tl.maximum(x, FP16_SCALE_MIN), FP16_SCALE_MAX).to(tl.float16).to(tl.float32)


@triton.jit
def _div(a, b, rcp_b):
    # a / b correctly rounded, given rcp_b = RN(1 / b): one Markstein correction of a * rcp_b
    q0 = a * rcp_b
    res = tl.fma(-q0, b, a)
    return tl.fma(res, rcp_b, q0)


@triton.jit
def _rint(x):
    # round half to even, exact for |x| < 2^22 (torch.round / rintf)
    return (x + MAGIC_RINT) - MAGIC_RINT


@triton.jit
def _codes(b_y, b_c, b_rc, b_zero, b_lo, b_hi, IS_MIDRISE: tl.constexpr):
    # base.round_to_codes(Y / c): float codes in [lo, hi]; [8, BK, NM] against columns [8, NM]
    b_t = _div(b_y, b_c[:, None, :], b_rc[:, None, :])
    if IS_MIDRISE:
        b_u = tl.floor(b_t + (b_zero[None, :, None] + 0.5))
    else:
        b_u = _rint(b_t + b_zero[None, :, None])
    return tl.minimum(tl.maximum(b_u, b_lo[None, :, None]), b_hi[None, :, None])


@triton.jit
def _chunk_ptr(p_slot, o_plane, o_m, W: tl.constexpr):
    # chunk m of the w-bit plane of every row: 8 values in 8w bits -> [BK, NM] pointers
    if W == 4:
        return p_slot + o_plane[:, None] + o_m[None, :]
    elif W == 2:
        return p_slot.to(tl.pointer_type(tl.uint16)) + o_plane[:, None] * 2 + o_m[None, :]
    else:
        return p_slot.to(tl.pointer_type(tl.uint8)) + o_plane[:, None] * 4 + o_m[None, :]


@triton.jit
def _load_plane(p_slot, o_plane, m_plane, o_p, o_m, m_m, W: tl.constexpr):
    # the w-bit plane of every row as codes [8, BK, NM] (value j = 8m + p)
    p_c = _chunk_ptr(p_slot, o_plane, o_m, W)
    b_c = tl.load(p_c, mask=m_plane[:, None] & m_m[None, :], other=0).to(tl.int32)  # [BK, NM]
    return (b_c[None, :, :] >> (o_p * W)[:, None, None]) & ((1 << W) - 1)


@triton.jit
def _store_plane(p_slot, b_code, s_plane, o_plane, m_plane, o_p, o_m, m_m, W: tl.constexpr):
    # inverse of _load_plane for code bits s_plane .. s_plane + W - 1 of b_code [8, BK, NM]
    b_p = (b_code >> s_plane[None, :, None]) & ((1 << W) - 1)
    b_c = tl.sum(b_p << (o_p * W)[:, None, None], 0)  # [BK, NM] the 8 values of a chunk sit in one thread
    p_c = _chunk_ptr(p_slot, o_plane, o_m, W)
    tl.store(p_c, b_c.to(p_c.dtype.element_ty), mask=m_plane[:, None] & m_m[None, :])


@triton.jit
def fused_packed_step_kernel(
    q,
    k,
    v,
    g,
    beta,
    y,
    x_in,
    slots,
    codes,
    row_scale,
    col_scale,
    plan_bits,
    plan_row_off,
    plan_head_slot,
    plan_winv,
    plan_w2,
    plan_gain,
    dbg_x,
    dbg_c,
    scale,
    slot_stride,
    num_scaled,
    WORD_ALIGN: tl.constexpr,
    PLANES: tl.constexpr,
    H: tl.constexpr,
    HQ: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    IS_KDA: tl.constexpr,
    USE_UPDATE: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    USE_DUAL_AXIS: tl.constexpr,
    IS_RMS: tl.constexpr,
    IS_MIDRISE: tl.constexpr,
    REFIT_ITERS: tl.constexpr,
    STORE_DEBUG: tl.constexpr,
):
    i_n, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i_s = tl.load(slots + i_n).to(tl.int64)
    if i_s < 0:
        # a free batch row: leave its output and every slot untouched
        return
    NM: tl.constexpr = BV // 8
    o_k = tl.arange(0, BK)
    o_p = tl.arange(0, 8)
    o_m = tl.arange(0, NM)
    o_j = o_m[None, :] * 8 + o_p[:, None]  # [8, NM] value column of tile element (p, i, m)
    m_k = o_k < K
    m_j = o_j < V
    m_m = o_m * 8 < V
    m_x = m_j[:, None, :] & m_k[None, :, None]  # [8, BK, NM]

    # the plan of this head: bit width, first word and FP32 factors of every key row
    b_bits = tl.load(plan_bits + i_h * K + o_k, mask=m_k, other=0).to(tl.int32)  # [BK]
    b_roff = tl.load(plan_row_off + i_h * K + o_k, mask=m_k, other=0)  # [BK]
    # rows and planes start on WORD_ALIGN-word boundaries (4 at V = 128): vector loads/stores
    b_roff = tl.multiple_of(b_roff, WORD_ALIGN)
    i_hs = tl.load(plan_head_slot + i_h)
    m_int = m_k & (b_bits > 0) & (b_bits <= 8)
    # pivot and padded rows use a placeholder width: their codes are computed but never stored
    b_nb = tl.where(m_int, b_bits, 8)
    b_zero = (1 << (b_nb - 1)).to(tl.float32)  # [BK] code of level 0 (mid-tread)
    if IS_MIDRISE:
        b_zero = b_zero - 0.5
        b_lo = tl.zeros([BK], dtype=tl.float32)
    else:
        b_lo = tl.full([BK], 1.0, dtype=tl.float32)
    b_hi = ((1 << b_nb) - 1).to(tl.float32)
    # planes are laid out widest first; a plane starts after the wider planes present in its row
    m_p16 = (b_bits & 16) != 0
    m_p8 = (b_bits & 8) != 0
    m_p4 = (b_bits & 4) != 0
    m_p2 = (b_bits & 2) != 0
    m_p1 = (b_bits & 1) != 0
    o_p16 = b_roff
    o_p8 = o_p16 + tl.where(m_p16, (V * 16 + 31) // 32, 0)
    o_p4 = o_p8 + tl.where(m_p8, (V * 8 + 31) // 32, 0)
    o_p2 = o_p4 + tl.where(m_p4, (V * 4 + 31) // 32, 0)
    o_p1 = o_p2 + tl.where(m_p2, (V * 2 + 31) // 32, 0)
    s_p4 = b_bits & ~7
    s_p2 = b_bits & ~3
    s_p1 = b_bits & ~1
    # head-uniform plane presence, so a GDN head only touches its own planes
    any16 = tl.max(m_p16.to(tl.int32), 0) > 0
    any8 = tl.max(m_p8.to(tl.int32), 0) > 0
    any4 = tl.max(m_p4.to(tl.int32), 0) > 0
    any2 = tl.max(m_p2.to(tl.int32), 0) > 0
    any1 = tl.max(m_p1.to(tl.int32), 0) > 0
    p_slot = codes + i_s * slot_stride * WORD_ALIGN
    p_c8 = p_slot.to(tl.pointer_type(tl.uint8)) + (o_p8 * 4)[None, :, None] + o_j[:, None, :]
    p_c16 = p_slot.to(tl.pointer_type(tl.float16)) + (o_p16 * 2)[None, :, None] + o_j[:, None, :]
    p_rs = row_scale + (i_s * num_scaled + i_hs) * K + o_k
    p_cs = col_scale + (i_s * num_scaled + i_hs) * V + o_j

    if USE_UPDATE:
        # ---- dequantize: codes -> levels -> S = diag(r) Z diag(c) (pivot rows: FP16 values)
        b_code = tl.zeros([8, BK, NM], dtype=tl.int32)
        if PLANES & 8:
            if any8:
                b_code = tl.load(p_c8, mask=m_p8[None, :, None] & m_j[:, None, :], other=0).to(tl.int32)
        if PLANES & 4:
            if any4:
                b_code |= _load_plane(p_slot, o_p4, m_p4, o_p, o_m, m_m, 4) << s_p4[None, :, None]
        if PLANES & 2:
            if any2:
                b_code |= _load_plane(p_slot, o_p2, m_p2, o_p, o_m, m_m, 2) << s_p2[None, :, None]
        if PLANES & 1:
            if any1:
                b_code |= _load_plane(p_slot, o_p1, m_p1, o_p, o_m, m_m, 1) << s_p1[None, :, None]
        b_f = (b_code | 0x4B000000).to(tl.float32, bitcast=True)  # 2^23 + code, exactly
        if IS_MIDRISE:
            # zero is a half-integer, 2^23 + zero is not representable: subtract in two exact steps
            b_lvl = (b_f - MAGIC_CODE) - b_zero[None, :, None]
        else:
            b_lvl = b_f - (MAGIC_CODE + b_zero[None, :, None])
        if i_hs >= 0:
            b_r = tl.load(p_rs, mask=m_int, other=0).to(tl.float32)  # [BK]
            if USE_DUAL_AXIS:
                b_c = tl.load(p_cs, mask=m_j, other=0).to(tl.float32)  # [8, NM]
            else:
                b_c = tl.where(m_j, 1.0, 0.0)
        else:
            b_r = tl.zeros([BK], dtype=tl.float32)
            b_c = tl.zeros([8, NM], dtype=tl.float32)
        # gate folded into the row factor: D S = diag(exp(g) r) Z diag(c)
        if IS_KDA:
            b_eg = tl.exp(tl.load(g + (i_n * H + i_h) * K + o_k, mask=m_k, other=0).to(tl.float32))
        else:
            b_eg = tl.exp(tl.load(g + i_n * H + i_h).to(tl.float32)) + tl.zeros([BK], dtype=tl.float32)
        b_h = b_lvl * ((b_r * b_eg)[None, :, None] * b_c[:, None, :])  # [8, BK, NM] decayed state D S
        if PLANES & 16:
            if any16:
                b_pv = tl.load(p_c16, mask=m_p16[None, :, None] & m_j[:, None, :], other=0).to(tl.float32)
                b_h = tl.where(m_p16[None, :, None], b_pv * b_eg[None, :, None], b_h)

        # ---- delta update and readout (fla fused_recurrent order; value head h reads q/k head h // G)
        i_hq = i_h // (H // HQ)
        b_q = tl.load(q + (i_n * HQ + i_hq) * K + o_k, mask=m_k, other=0).to(tl.float32)
        b_k = tl.load(k + (i_n * HQ + i_hq) * K + o_k, mask=m_k, other=0).to(tl.float32)
        b_v = tl.load(v + (i_n * H + i_h) * V + o_j, mask=m_j, other=0).to(tl.float32)  # [8, NM]
        b_beta = tl.load(beta + i_n * H + i_h).to(tl.float32)
        if USE_QK_L2NORM:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
        b_q = b_q * scale
        b_u = b_beta * (b_v - tl.sum(b_h * b_k[None, :, None], 1))  # [8, NM]
        b_hq = tl.sum(b_h * b_q[None, :, None], 1)  # [8, NM]
        b_x = b_h + b_k[None, :, None] * b_u[:, None, :]  # X = A S + B
        # y = X^T q = (D S)^T q + (k . q) u, so the readout needs no second pass over X
        b_o = b_hq + tl.sum(b_q * b_k) * b_u
        tl.store(y + (i_n * H + i_h) * V + o_j, b_o.to(y.dtype.element_ty), mask=m_j)
    else:
        # boundary pack: X is a float state [N, H, K, V]
        p_x = x_in + ((i_n * H + i_h) * K + o_k[None, :, None]) * V + o_j[:, None, :]
        b_x = tl.load(p_x, mask=m_x, other=0).to(tl.float32)

    # ---- requantize X
    if USE_DUAL_AXIS:
        if IS_RMS:
            b_m = tl.sqrt_rn(tl.math.div_rn(tl.sum(tl.sum(b_x * b_x, 0), 1), V * 1.0))
        else:
            b_m = tl.max(tl.max(tl.abs(b_x), 0), 1)  # [BK]
        b_winv = tl.load(plan_winv + i_h * K + o_k, mask=m_k, other=1.0)
        b_r = tl.where(m_int, _fp16_scale(tl.sqrt_rn(b_m) * b_winv), 1.0)  # [BK]
        b_rr = tl.math.div_rn(1.0, b_r)
        b_y = _div(b_x, b_r[None, :, None], b_rr[None, :, None])  # Y = X / r
        # pivot and padded rows have gain 0, so they take no part in the column fit
        b_gain = tl.load(plan_gain + i_h * K + o_k, mask=m_int, other=0.0)
        b_c = _fp16_scale(tl.max(tl.abs(b_y) * b_gain[None, :, None], 1))  # [8, NM]
        b_rc = tl.math.div_rn(1.0, b_c)
        b_u = _codes(b_y, b_c, b_rc, b_zero, b_lo, b_hi, IS_MIDRISE)  # [8, BK, NM]
        if REFIT_ITERS > 0:
            b_w2 = tl.load(plan_w2 + i_h * K + o_k, mask=m_int, other=0.0)
            b_w2r = b_w2 * b_r
            b_w2r2 = b_w2r * b_r
            for it in tl.static_range(REFIT_ITERS):
                b_z = b_u - b_zero[None, :, None]  # levels
                b_num = tl.sum((b_w2r[None, :, None] * b_z) * b_x, 1)  # [8, NM]
                b_den = tl.sum(b_w2r2[None, :, None] * (b_z * b_z), 1)
                b_cn = _fp16_scale(tl.math.div_rn(b_num, tl.where(b_den > 0, b_den, 1.0)))
                b_cn = tl.where(b_den > 0, b_cn, b_c)
                if it < REFIT_ITERS - 1:
                    b_c = b_cn
                    b_rc = tl.math.div_rn(1.0, b_c)
                    b_u = _codes(b_y, b_c, b_rc, b_zero, b_lo, b_hi, IS_MIDRISE)
                else:
                    if STORE_DEBUG:
                        tl.store(dbg_c + (i_n * H + i_h) * BV + o_j, b_c)
                    b_c = b_cn
        elif STORE_DEBUG:
            tl.store(dbg_c + (i_n * H + i_h) * BV + o_j, b_c)
    else:
        # rowwise absmax at each row's width: scale = fp16(absmax / qmax), mid-tread codes
        b_qmax = b_hi * 0.5 - 0.5  # 2^(b-1) - 1
        b_m = tl.max(tl.max(tl.abs(b_x), 0), 1)
        b_r = tl.where(m_int, _fp16_scale(tl.math.div_rn(b_m, b_qmax)), 1.0)
        b_rr = tl.math.div_rn(1.0, b_r)
        b_t = _div(b_x, b_r[None, :, None], b_rr[None, :, None])
        b_u = tl.minimum(tl.maximum(_rint(b_t + b_zero[None, :, None]), b_lo[None, :, None]),
                         b_hi[None, :, None])
        b_c = tl.full([8, NM], 1.0, dtype=tl.float32)
        if STORE_DEBUG:
            tl.store(dbg_c + (i_n * H + i_h) * BV + o_j, b_c)
    if STORE_DEBUG:
        tl.store(dbg_x + ((i_n * H + i_h) * BK + o_k[None, :, None]) * BV + o_j[:, None, :], b_x)

    # ---- pack the codes back into the slot (code bits sit in the low mantissa of 2^23 + u)
    b_code = (b_u + MAGIC_CODE).to(tl.int32, bitcast=True) & 0xFFFF
    if V % 8 != 0:
        # the last chunk's values past V are padding and must stay zero bits
        b_code = tl.where(m_j[:, None, :], b_code, 0)
    if PLANES & 8:
        if any8:
            p_c8 = p_slot.to(tl.pointer_type(tl.uint8)) + (o_p8 * 4)[None, :, None] + o_j[:, None, :]
            tl.store(p_c8, b_code.to(tl.uint8), mask=m_p8[None, :, None] & m_j[:, None, :])
    if PLANES & 4:
        if any4:
            _store_plane(p_slot, b_code, s_p4, o_p4, m_p4, o_p, o_m, m_m, 4)
    if PLANES & 2:
        if any2:
            _store_plane(p_slot, b_code, s_p2, o_p2, m_p2, o_p, o_m, m_m, 2)
    if PLANES & 1:
        if any1:
            _store_plane(p_slot, b_code, s_p1, o_p1, m_p1, o_p, o_m, m_m, 1)
    if PLANES & 16:
        if any16:
            b_pv = tl.minimum(tl.maximum(b_x, -FP16_SCALE_MAX), FP16_SCALE_MAX).to(tl.float16)
            tl.store(p_c16, b_pv, mask=m_p16[None, :, None] & m_j[:, None, :])
    if i_hs >= 0:
        tl.store(p_rs, b_r.to(tl.float16), mask=m_k)
        if USE_DUAL_AXIS:
            tl.store(p_cs, b_c.to(tl.float16), mask=m_j)


def _word_align(value_dim: int) -> int:
    # rows and planes start on multiples of V/32 words when 32 | V (4 words = 16 bytes at V = 128)
    if value_dim % 128 == 0:
        return 4
    return 2 if value_dim % 64 == 0 else 1


def _launch(layer, slots, q, k, v, g, beta, y, x_in, *, scale, use_qk_l2norm, use_update, debug,
            num_warps):
    num_rows = slots.shape[0]
    num_heads, key_dim, value_dim = layer.num_heads, layer.key_dim, layer.value_dim
    block_k = triton.next_power_of_2(key_dim)
    block_v = max(triton.next_power_of_2(value_dim), 8)
    align = _word_align(value_dim)
    plan = layer.plan
    dbg_x = dbg_c = layer.row_winv  # unused unless debug
    if debug is not None:
        dbg_x = torch.full((num_rows, num_heads, block_k, block_v), float("nan"), device=layer.device)
        dbg_c = torch.full((num_rows, num_heads, block_v), float("nan"), device=layer.device)
    col_scale = layer.col_scale if layer.col_scale is not None else layer.row_scale
    num_q_heads = q.shape[1] if use_update else num_heads
    if num_warps is None:
        num_warps = 8 if block_k * block_v >= 128 * 128 else 4
    fused_packed_step_kernel[(num_rows, num_heads)](
        q, k, v, g, beta, y, x_in,
        slots,
        layer.codes, layer.row_scale, col_scale,
        layer.row_bits, layer.row_word_offset, layer.head_scale_slot,
        layer.row_winv, layer.row_w2, layer.row_gain,
        dbg_x, dbg_c,
        scale,
        layer.layout.words_per_slot // align,
        layer.layout.num_scaled_heads,
        WORD_ALIGN=align,
        PLANES=layer.planes,
        H=num_heads,
        HQ=num_q_heads,
        K=key_dim,
        V=value_dim,
        BK=block_k,
        BV=block_v,
        IS_KDA=g.dim() == 3 if use_update else False,
        USE_UPDATE=use_update,
        USE_QK_L2NORM=use_qk_l2norm,
        USE_DUAL_AXIS=plan.has_col_scale,
        IS_RMS=plan.config.row_stat == "rms",
        IS_MIDRISE=plan.grid is Grid.MIDRISE,
        REFIT_ITERS=plan.config.refit_iters,
        STORE_DEBUG=debug is not None,
        num_warps=num_warps,
    )
    if debug is not None:
        debug["x"] = dbg_x[:, :, :key_dim, :value_dim]
        debug["c"] = dbg_c[:, :, :value_dim]


def fused_packed_decode(
    layer: PackedLayer,
    slots: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    out: torch.Tensor | None = None,
    debug: dict | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """One decode token for N requests whose states live in ``layer``'s slots; returns y [N, H, V].

    slots int32 [N] (-1: skip the row, its output and every slot untouched); q, k [N, H_k, K];
    v [N, H, V]; g [N, H] (GDN) or [N, H, K] (KDA) log decays; beta [N, H]. Value head h reads q/k head
    h // (H / H_k). scale defaults to K^-1/2, applied to q after the optional in-kernel L2 norm. The
    slots are requantized in place. debug (a dict) receives "x": the float state X [N, H, K, V] the
    kernel requantized, and "c": the column scales [N, H, V] its codes were computed against.
    """
    _check_inputs(layer, slots, q, k, v, g, beta)
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    if out is None:
        out = torch.zeros(v.shape[0], layer.num_heads, layer.value_dim, dtype=v.dtype, device=v.device)
    scale = layer.key_dim**-0.5 if scale is None else float(scale)
    _launch(layer, slots.to(torch.int32).contiguous(), q, k, v, g, beta, out, q, scale=scale,
            use_qk_l2norm=use_qk_l2norm, use_update=True, debug=debug, num_warps=num_warps)
    return out


def fused_pack_states(
    layer: PackedLayer,
    slots: torch.Tensor,
    states: torch.Tensor,
    *,
    debug: dict | None = None,
    num_warps: int | None = None,
) -> None:
    """Quantize float states [N, H, K, V] with the layer's quantizer into ``slots`` (-1: skip a row)."""
    expected = (slots.shape[0], layer.num_heads, layer.key_dim, layer.value_dim)
    if tuple(states.shape) != expected:
        raise ValueError(f"states must have shape [N, H, K, V] = {list(expected)}, got {list(states.shape)}")
    states = states.contiguous()
    dummy = layer.row_winv
    _launch(layer, slots.to(torch.int32).contiguous(), dummy, dummy, dummy, dummy, dummy, dummy, states,
            scale=1.0, use_qk_l2norm=False, use_update=False, debug=debug, num_warps=num_warps)


def _check_inputs(layer, slots, q, k, v, g, beta) -> None:
    num_rows = slots.shape[0]
    heads, key_dim, value_dim = layer.num_heads, layer.key_dim, layer.value_dim
    if q.dim() != 3 or q.shape[0] != num_rows or q.shape[2] != key_dim or k.shape != q.shape:
        raise ValueError(f"q and k must have shape [N, H_k, K] with N={num_rows}, K={key_dim}; "
                         f"got {list(q.shape)} and {list(k.shape)}")
    if heads % q.shape[1] != 0:
        raise ValueError(f"the layer's {heads} value heads must be a multiple of q/k's {q.shape[1]} heads")
    if tuple(v.shape) != (num_rows, heads, value_dim):
        raise ValueError(f"v must have shape [N, H, V] = {[num_rows, heads, value_dim]}, got {list(v.shape)}")
    if tuple(g.shape) not in ((num_rows, heads), (num_rows, heads, key_dim)):
        raise ValueError(f"g must have shape [N, H] (GDN) or [N, H, K] (KDA), got {list(g.shape)}")
    if tuple(beta.shape) != (num_rows, heads):
        raise ValueError(f"beta must have shape [N, H] = {[num_rows, heads]}, got {list(beta.shape)}")

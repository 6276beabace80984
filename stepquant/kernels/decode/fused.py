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

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from stepquant.codecs.base import Grid
from stepquant.pool import PackedLayer

# 1.5 * 2^23: adding it rounds an FP32 |x| < 2^22 to an integer, half to even (round-to-nearest).
MAGIC_RINT = tl.constexpr(12582912.0)
# 2^23: code | 0x4B000000 reinterpreted as FP32 is 2^23 + code.
MAGIC_CODE = tl.constexpr(8388608.0)
# 2^22: (code << 1) | 0x4A800000 reinterpreted as FP32 is 2^22 + code, and 2^22 + zero is exact for
# the half-integer zeros of the mid-rise grid, so a level is one subtraction.
MAGIC_LEVEL = tl.constexpr(4194304.0)
FP16_SCALE_MIN = tl.constexpr(6.103515625e-05)  # 2^-14
FP16_SCALE_MAX = tl.constexpr(65504.0)


@triton.jit
def _fp16_scale(x):
    # base.fp16_scale: clamp in FP32, round to nearest FP16, compute on in FP32
    return tl.minimum(tl.maximum(x, FP16_SCALE_MIN), FP16_SCALE_MAX).to(tl.float16).to(tl.float32)


@triton.jit
def _rcp(x, APPROX: tl.constexpr):
    # 1 / x to a few ulp; _div only needs it within 2^-20 relative (docs/kernels.md)
    if APPROX:
        return libdevice.fast_dividef(1.0, x)
    else:
        return 1.0 / x


@triton.jit
def _div(a, b, rcp_b):
    # a / b correctly rounded for an FP16-valued b > 0 and rcp_b ~ 1 / b: one Markstein correction of
    # a * rcp_b (the quotient is never closer than 2^-12 ulp to a rounding midpoint, the correction
    # error is below 2^-20 ulp; docs/kernels.md)
    q0 = a * rcp_b
    res = tl.fma(-q0, b, a)
    return tl.fma(res, rcp_b, q0)


@triton.jit
def _add2(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _add3(a0, b0, c0, a1, b1, c1):
    return a0 + a1, b0 + b1, c0 + c1


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
def _chunk_ptr(p_slot, o_plane, o_m, i_one, W: tl.constexpr):
    # chunk m of the w-bit plane of every row: 8 values in 8w bits -> [BK, NM] pointers. i_one is a
    # runtime 1 the compiler cannot see through: with no provable alignment it keeps these accesses
    # in the tile's own thread layout (4 or fewer bytes per thread, still coalesced per row) instead of
    # vectorizing them and paying a shared-memory round trip to reach the tile's layout.
    o_w = o_plane * i_one  # the plane's first word, alignment unknown to the compiler
    if W == 4:
        return p_slot + o_w[:, None] + o_m[None, :]
    elif W == 2:
        # 2 * o_w written as a sum so that no factor 2 (an alignment) is visible either
        return p_slot.to(tl.pointer_type(tl.uint16)) + (o_w + o_w)[:, None] + o_m[None, :]
    else:
        return p_slot.to(tl.pointer_type(tl.uint8)) + ((o_w + o_w) + (o_w + o_w))[:, None] + o_m[None, :]


@triton.jit
def _load_plane(p_slot, o_plane, m_plane, o_p, o_m, m_m, i_one, W: tl.constexpr):
    # the w-bit plane of every row as 2 * codes [8, BK, NM] (value j = 8m + p; see MAGIC_LEVEL)
    p_c = _chunk_ptr(p_slot, o_plane, o_m, i_one, W)
    b_c = tl.load(p_c, mask=m_plane[:, None] & m_m[None, :], other=0).to(tl.int32)[None, :, :]  # [1, BK, NM]
    # value p sits at bit p * W; land it one bit higher (p is a register index: the select folds away)
    o_sh = (o_p * W)[:, None, None]
    b_v = tl.where(o_sh == 0, b_c << 1, b_c >> tl.maximum(o_sh - 1, 0))
    return b_v & (((1 << W) - 1) << 1)


@triton.jit
def _store_plane(p_slot, b_code, o_plane, m_plane, o_p, o_m, m_m, i_one, W: tl.constexpr):
    # inverse of _load_plane: the low W bits of b_code [8, BK, NM] (the caller shifts the plane down)
    b_p = b_code & ((1 << W) - 1)
    b_c = tl.sum(b_p << (o_p * W)[:, None, None], 0)  # [BK, NM] the 8 values of a chunk sit in one thread
    p_c = _chunk_ptr(p_slot, o_plane, o_m, i_one, W)
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
    plan_rows,
    plan_heads,
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
    STORE_Y: tl.constexpr,
    WRITEBACK: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    USE_DUAL_AXIS: tl.constexpr,
    IS_RMS: tl.constexpr,
    IS_MIDRISE: tl.constexpr,
    REFIT_ITERS: tl.constexpr,
    STORE_DEBUG: tl.constexpr,
    APPROX_RCP: tl.constexpr,
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

    # the plan of this head: first word << 5 | bit width of every key row, and per head its scale
    # slot (-1: no scales) and the plane widths its rows use
    b_row = tl.load(plan_rows + i_h * K + o_k, mask=m_k, other=0)  # [BK]
    b_bits = b_row & 31
    b_roff = b_row >> 5
    i_hs = tl.load(plan_heads + i_h * 2)
    i_flags = tl.load(plan_heads + i_h * 2 + 1)  # plane widths used | 32 if all rows share one integer width
    i_planes = i_flags & 31
    i_one = (i_flags >> 16) + 1  # flags are < 2^16: a 1 only known at run time (see _chunk_ptr)
    m_int = m_k & (b_bits > 0) & (b_bits <= 8)
    # pivot and padded rows use a placeholder width: their codes are computed but never stored
    b_nb = tl.where(m_int, b_bits, 8)
    b_half = ((b_nb + 126) << 23).to(tl.float32, bitcast=True)  # [BK] 2^(b-1), built from its bits
    b_hi = b_half + b_half - 1.0  # top code 2^b - 1
    if IS_MIDRISE:
        b_zero = b_half - 0.5  # the code of level 0 lies between two codes
        b_lo = tl.zeros([BK], dtype=tl.float32)
    else:
        b_zero = b_half
        b_lo = tl.full([BK], 1.0, dtype=tl.float32)
    # planes are laid out widest first; a plane starts after the wider planes present in its row
    m_p16 = (b_bits & 16) != 0
    m_p8 = (b_bits & 8) != 0
    m_p4 = (b_bits & 4) != 0
    m_p2 = (b_bits & 2) != 0
    m_p1 = (b_bits & 1) != 0
    # a row has at most one of the 16, 8, 4 planes, and the widest plane starts the row
    o_p16 = b_roff
    o_p8 = b_roff
    o_p4 = b_roff
    o_p2 = b_roff + tl.where(m_p4, (V * 4 + 31) // 32, 0)
    o_p1 = o_p2 + tl.where(m_p2, (V * 2 + 31) // 32, 0)
    s_p2 = b_bits & ~3
    s_p1 = b_bits & ~1
    # head-uniform plane presence, so a GDN head only touches its own planes
    any16 = (i_planes & 16) != 0
    any8 = (i_planes & 8) != 0
    any4 = (i_planes & 4) != 0
    any2 = (i_planes & 2) != 0
    any1 = (i_planes & 1) != 0
    p_slot = codes + i_s * slot_stride * WORD_ALIGN
    # per-value planes (bytes, halves) are read as 8 contiguous values per thread: tell the compiler
    # rows start on WORD_ALIGN-word boundaries so it vectorizes; the chunk planes keep unhinted row
    # offsets so their [BK, NM] accesses take the tile's own thread layout (no shared-memory shuffle)
    o_a8 = tl.multiple_of(o_p8 * 4, WORD_ALIGN * 4)
    o_a16 = tl.multiple_of(o_p16 * 2, WORD_ALIGN * 2)
    p_c8 = p_slot.to(tl.pointer_type(tl.uint8)) + o_a8[None, :, None] + o_j[:, None, :]
    p_c16 = p_slot.to(tl.pointer_type(tl.float16)) + o_a16[None, :, None] + o_j[:, None, :]
    p_rs = row_scale + (i_s * num_scaled + i_hs) * K + o_k
    p_cs = col_scale + (i_s * num_scaled + i_hs) * V + o_j

    if USE_UPDATE:
        # ---- dequantize: codes -> levels -> S = diag(r) Z diag(c) (pivot rows: FP16 values)
        b_code = tl.zeros([8, BK, NM], dtype=tl.int32)
        if PLANES & 8:
            if any8:
                b_code = tl.load(p_c8, mask=m_p8[None, :, None] & m_j[:, None, :], other=0).to(tl.int32) << 1
        if PLANES & 4:
            if any4:
                b_code |= _load_plane(p_slot, o_p4, m_p4, o_p, o_m, m_m, i_one, 4)
        if PLANES & 2:
            if any2:
                b_code |= _load_plane(p_slot, o_p2, m_p2, o_p, o_m, m_m, i_one, 2) << s_p2[None, :, None]
        if PLANES & 1:
            if any1:
                b_code |= _load_plane(p_slot, o_p1, m_p1, o_p, o_m, m_m, i_one, 1) << s_p1[None, :, None]
        b_lvl = (b_code | 0x4A800000).to(tl.float32, bitcast=True) - (b_zero + MAGIC_LEVEL)[None, :, None]
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
        # |q|^2, |k|^2 and q . k in one cross-warp reduction; the L2 norms are applied as scalars
        b_qq, b_kk, b_qk = tl.reduce((b_q * b_q, b_k * b_k, b_q * b_k), 0, _add3)
        if USE_QK_L2NORM:
            b_nq = 1.0 / tl.sqrt(b_qq + 1e-6)
            b_nk = 1.0 / tl.sqrt(b_kk + 1e-6)
            b_q = b_q * (b_nq * scale)
            b_k = b_k * b_nk
            b_qk = b_qk * (b_nq * b_nk * scale)
        else:
            b_q = b_q * scale
            b_qk = b_qk * scale
        # k^T (D S) and q^T (D S) in one pass: one cross-warp exchange for both
        b_hk, b_hq = tl.reduce((b_h * b_k[None, :, None], b_h * b_q[None, :, None]), 1, _add2)  # [8, NM]
        b_u = b_beta * (b_v - b_hk)
        b_x = b_h + b_k[None, :, None] * b_u[:, None, :]  # X = A S + B
        # y = X^T q = (D S)^T q + (k . q) u, so the readout needs no second pass over X
        b_o = b_hq + b_qk * b_u
        if STORE_Y:
            tl.store(y + (i_n * H + i_h) * V + o_j, b_o.to(y.dtype.element_ty), mask=m_j)
    else:
        # boundary pack: X is a float state [N, H, K, V]
        p_x = x_in + ((i_n * H + i_h) * K + o_k[None, :, None]) * V + o_j[:, None, :]
        b_x = tl.load(p_x, mask=m_x, other=0).to(tl.float32)

    if WRITEBACK:
        # ---- requantize X
        if USE_DUAL_AXIS:
            if IS_RMS:
                b_m = tl.sqrt_rn(tl.sum(tl.sum(b_x * b_x, 0), 1) * (1.0 / V))
            else:
                b_m = tl.max(tl.max(tl.abs(b_x), 0), 1)  # [BK]
            b_winv = tl.load(plan_winv + i_h * K + o_k, mask=m_k, other=1.0)
            b_r = tl.where(m_int, _fp16_scale(tl.sqrt_rn(b_m) * b_winv), 1.0)  # [BK]
            b_rr = _rcp(b_r, APPROX_RCP)
            b_y = _div(b_x, b_r[None, :, None], b_rr[None, :, None])  # Y = X / r
            # pivot and padded rows have gain 0, so they take no part in the column fit
            b_gain = tl.load(plan_gain + i_h * K + o_k, mask=m_int, other=0.0)
            if (i_flags & 32) != 0:
                # one width (and gain) for the whole head: max_i fl(|Y_ij| g) = fl(max_i |Y_ij| g) exactly
                b_g0 = tl.max(b_gain, 0)
                b_c = _fp16_scale(tl.max(tl.abs(b_y), 1) * b_g0)  # [8, NM]
            else:
                b_c = _fp16_scale(tl.max(tl.abs(b_y) * b_gain[None, :, None], 1))
            b_rc = _rcp(b_c, APPROX_RCP)
            b_u = _codes(b_y, b_c, b_rc, b_zero, b_lo, b_hi, IS_MIDRISE)  # [8, BK, NM]
            if REFIT_ITERS > 0:
                b_w2 = tl.load(plan_w2 + i_h * K + o_k, mask=m_int, other=0.0)
                b_w2r2 = (b_w2 * b_r) * b_r
                for it in tl.static_range(REFIT_ITERS):
                    b_z = b_u - b_zero[None, :, None]  # levels
                    # w^2 r z X = (w^2 r^2 z) Y up to the rounding of Y = X / r: one product serves both
                    # sums (a reordering like the FP32 sums themselves; scales match to tolerance)
                    b_wz = b_w2r2[None, :, None] * b_z
                    b_num, b_den = tl.reduce((b_wz * b_y, b_wz * b_z), 1, _add2)  # [8, NM]
                    b_cn = _fp16_scale(b_num * _rcp(tl.where(b_den > 0, b_den, 1.0), APPROX_RCP))
                    b_cn = tl.where(b_den > 0, b_cn, b_c)
                    if it < REFIT_ITERS - 1:
                        b_c = b_cn
                        b_rc = _rcp(b_c, APPROX_RCP)
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
            b_rr = _rcp(b_r, APPROX_RCP)
            b_t = _div(b_x, b_r[None, :, None], b_rr[None, :, None])
            b_u = tl.minimum(tl.maximum(_rint(b_t + b_zero[None, :, None]), b_lo[None, :, None]),
                             b_hi[None, :, None])
            b_c = tl.full([8, NM], 1.0, dtype=tl.float32)
            if STORE_DEBUG:
                tl.store(dbg_c + (i_n * H + i_h) * BV + o_j, b_c)
        if STORE_DEBUG:
            tl.store(dbg_x + ((i_n * H + i_h) * BK + o_k[None, :, None]) * BV + o_j[:, None, :], b_x)

        # ---- pack the codes back into the slot (code bits sit in the low mantissa of 2^23 + u)
        b_code = (b_u + MAGIC_CODE).to(tl.int32, bitcast=True)  # low bits: the code; masked per plane
        if V % 8 != 0:
            # the last chunk's values past V are padding and must stay zero bits
            b_code = tl.where(m_j[:, None, :], b_code, 0)
        if PLANES & 8:
            if any8:
                tl.store(p_c8, b_code.to(tl.uint8), mask=m_p8[None, :, None] & m_j[:, None, :])
        if PLANES & 4:
            if any4:
                _store_plane(p_slot, b_code, o_p4, m_p4, o_p, o_m, m_m, i_one, 4)
        if PLANES & 2:
            if any2:
                _store_plane(p_slot, b_code >> s_p2[None, :, None], o_p2, m_p2, o_p, o_m, m_m, i_one, 2)
        if PLANES & 1:
            if any1:
                _store_plane(p_slot, b_code >> s_p1[None, :, None], o_p1, m_p1, o_p, o_m, m_m, i_one, 1)
        if PLANES & 16:
            if any16:
                # pivot rows have r = 1, so Y = X / 1 = X exactly (and X need not stay live until here)
                b_src = b_y if USE_DUAL_AXIS else b_t
                b_pv = tl.minimum(tl.maximum(b_src, -FP16_SCALE_MAX), FP16_SCALE_MAX).to(tl.float16)
                tl.store(p_c16, b_pv, mask=m_p16[None, :, None] & m_j[:, None, :])
        if i_hs >= 0:
            tl.store(p_rs, b_r.to(tl.float16), mask=m_k)
            if USE_DUAL_AXIS:
                tl.store(p_cs, b_c.to(tl.float16), mask=m_j)


_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _word_align(value_dim: int) -> int:
    # rows and planes start on multiples of V/32 words when 32 | V (4 words = 16 bytes at V = 128)
    if value_dim % 128 == 0:
        return 4
    return 2 if value_dim % 64 == 0 else 1


def _launch(layer, slots, q, k, v, g, beta, y, x_in, *, scale, use_qk_l2norm, use_update, debug,
            num_warps, part="fused", planes=None):
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
        layer.row_table, layer.head_table,
        layer.row_winv, layer.row_w2, layer.row_gain,
        dbg_x, dbg_c,
        scale,
        layer.layout.words_per_slot // align,
        layer.layout.num_scaled_heads,
        WORD_ALIGN=align,
        PLANES=layer.planes if planes is None else planes,
        H=num_heads,
        HQ=num_q_heads,
        K=key_dim,
        V=value_dim,
        BK=block_k,
        BV=block_v,
        IS_KDA=g.dim() == 3 if use_update else False,
        USE_UPDATE=use_update,
        STORE_Y=use_update and part in ("fused", "readout"),
        WRITEBACK=part in ("fused", "writeback"),
        USE_QK_L2NORM=use_qk_l2norm,
        USE_DUAL_AXIS=plan.has_col_scale,
        IS_RMS=plan.config.row_stat == "rms",
        IS_MIDRISE=plan.grid is Grid.MIDRISE,
        REFIT_ITERS=plan.config.refit_iters,
        STORE_DEBUG=debug is not None,
        APPROX_RCP=not _INTERPRETED,
        num_warps=num_warps,
    )
    if debug is not None:
        debug["x"] = dbg_x[:, :, :key_dim, :value_dim]
        debug["c"] = dbg_c[:, :, :value_dim]


PARTS = ("fused", "readout", "writeback")


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
    part: str = "fused",
    debug: dict | None = None,
    num_warps: int | None = None,
    planes: int | None = None,
) -> torch.Tensor:
    """One decode token for N requests whose states live in ``layer``'s slots; returns y [N, H, V].

    slots int32 [N] (-1: skip the row, its output and every slot untouched); q, k [N, H_k, K];
    v [N, H, V]; g [N, H] (GDN) or [N, H, K] (KDA) log decays; beta [N, H]. Value head h reads q/k head
    h // (H / H_k). scale defaults to K^-1/2, applied to q after the optional in-kernel L2 norm.
    part: "fused" (readout and in-place requantization, one kernel), or the paper's split:
    "readout" (y only, slots untouched) then "writeback" (recomputes X from the same inputs and
    requantizes the slots, y untouched). debug (a dict) receives "x": the float state X [N, H, K, V]
    the kernel requantized, and "c": the column scales [N, H, V] its codes were computed against.
    planes overrides the plane widths compiled in (default: those the layer's plan uses).
    """
    _check_inputs(layer, slots, q, k, v, g, beta)
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    if out is None:
        out = torch.zeros(v.shape[0], layer.num_heads, layer.value_dim, dtype=v.dtype, device=v.device)
    scale = layer.key_dim**-0.5 if scale is None else float(scale)
    _launch(layer, slots.to(torch.int32).contiguous(), q, k, v, g, beta, out, q, scale=scale,
            use_qk_l2norm=use_qk_l2norm, use_update=True, debug=debug, num_warps=num_warps, part=part,
            planes=planes)
    return out


def fused_packed_decode_split(
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
    stream: torch.cuda.Stream | None = None,
) -> tuple[torch.Tensor, torch.cuda.Event]:
    """The paper's split step: readout on the current stream, requantize + writeback on ``stream``.

    Returns (y, done): y is ready in stream order on the current stream; the slots are rewritten when
    ``done`` fires. The caller must ``torch.cuda.current_stream().wait_event(done)`` before the next
    step touches this layer's slots (later layers of the same token need not wait).
    """
    kwargs = dict(scale=scale, use_qk_l2norm=use_qk_l2norm)
    y = fused_packed_decode(layer, slots, q, k, v, g, beta, out=out, part="readout", **kwargs)
    side = torch.cuda.Stream(device=layer.device) if stream is None else stream
    side.wait_stream(torch.cuda.current_stream(layer.device))
    with torch.cuda.stream(side):
        fused_packed_decode(layer, slots, q, k, v, g, beta, out=y, part="writeback", **kwargs)
    for t in (slots, q, k, v, g, beta):
        t.record_stream(side)  # the caller may drop its inputs before the side stream is done
    done = torch.cuda.Event()
    done.record(side)
    return y, done


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

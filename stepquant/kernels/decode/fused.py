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
from stepquant.codecs.dual_axis import ROW_STATS
from stepquant.kernels.tables import FormatTables, Pages

from .naive import check_states, check_token_inputs

# 1.5 * 2^23: adding it rounds an FP32 |x| < 2^22 to an integer, half to even (round-to-nearest).
MAGIC_RINT = tl.constexpr(12582912.0)
# 1.5 * 2^52: the same in FP64
MAGIC_RINT64 = tl.constexpr(6755399441055744.0)
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
def _add3(a0, b0, c0, a1, b1, c1):
    return a0 + a1, b0 + b1, c0 + c1


@triton.jit
def _rint(x):
    # round half to even, exact for |x| < 2^22 (torch.round / rintf)
    return (x + MAGIC_RINT) - MAGIC_RINT


@triton.jit
def _codes(b_y, b_c, b_rc, b_zero, b_lo, b_hi, IS_MIDRISE: tl.constexpr, RECIP: tl.constexpr):
    # dual_axis.codes_for: float codes in [lo, hi]; [8, BK, NM] against columns [8, NM]. RECIP: Y * (1 / c)
    # (b_rc is then the correctly rounded reciprocal) and floor / rint of the exact sum (in FP64)
    if RECIP:
        b_t = (b_y * b_rc[:, None, :]).to(tl.float64)
        if IS_MIDRISE:
            b_u = tl.floor(b_t + (b_zero[None, :, None] + 0.5).to(tl.float64)).to(tl.float32)
        else:
            b_s = b_t + b_zero[None, :, None].to(tl.float64)  # exact; rint by the FP64 magic number
            b_u = ((b_s + MAGIC_RINT64) - MAGIC_RINT64).to(tl.float32)
    else:
        b_t = _div(b_y, b_c[:, None, :], b_rc[:, None, :])
        if IS_MIDRISE:
            b_u = tl.floor(b_t + (b_zero[None, :, None] + 0.5))
        else:
            b_u = _rint(b_t + b_zero[None, :, None])
    return tl.minimum(tl.maximum(b_u, b_lo[None, :, None]), b_hi[None, :, None])


@triton.jit
def _scale_down(b_x, b_r, RECIP: tl.constexpr, APPROX_RCP: tl.constexpr):
    # dual_axis.scale_down(X, r) for row scales b_r [BKB]: X / r, or X * (1 / r) correctly rounded
    if RECIP:
        return b_x * tl.math.div_rn(tl.full(b_r.shape, 1.0, tl.float32), b_r)[None, :, None]
    else:
        return _div(b_x, b_r[None, :, None], _rcp(b_r, APPROX_RCP)[None, :, None])


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
def _row_block(plan_rows, i_h, kb, K: tl.constexpr, BKB: tl.constexpr, IS_MIDRISE: tl.constexpr,
               UNIFORM_BITS: tl.constexpr):
    # the plan of key rows [kb * BKB, (kb + 1) * BKB) of head i_h: per row its bits, first word, grid
    o_r = kb * BKB + tl.arange(0, BKB)  # [BKB]
    m_r = o_r < K
    b_row = tl.load(plan_rows + i_h * K + o_r, mask=m_r, other=0)
    if UNIFORM_BITS > 0:
        b_bits = tl.where(m_r, UNIFORM_BITS, 0)  # a launch for heads of one width: known when compiled
    else:
        b_bits = b_row & 31
    b_roff = b_row >> 5
    m_int = m_r & (b_bits > 0) & (b_bits <= 8)
    # pivot and padded rows use a placeholder width: their codes are computed but never stored
    b_half = ((tl.where(m_int, b_bits, 8) + 126) << 23).to(tl.float32, bitcast=True)  # 2^(b-1) from its bits
    b_hi = b_half + b_half - 1.0  # top code 2^b - 1
    if IS_MIDRISE:
        b_zero = b_half - 0.5  # the code of level 0 lies between two codes
        b_lo = tl.zeros([BKB], dtype=tl.float32)
    else:
        b_zero = b_half
        b_lo = tl.full([BKB], 1.0, dtype=tl.float32)
    return o_r, m_r, b_bits, b_roff, m_int, b_zero, b_lo, b_hi


@triton.jit
def _plane_offsets(b_bits, b_roff, V: tl.constexpr):
    # planes are laid out widest first; a row has at most one of the 16, 8, 4 planes and the widest
    # plane starts the row; the 2- and 1-bit planes follow the wider planes present in that row
    o_p2 = b_roff + tl.where((b_bits & 4) != 0, (V * 4 + 31) // 32, 0)
    o_p1 = o_p2 + tl.where((b_bits & 2) != 0, (V * 2 + 31) // 32, 0)
    return o_p2, o_p1


@triton.jit
def _wide_ptrs(p_slot, b_roff, o_j, WORD_ALIGN: tl.constexpr):
    # per-value planes (bytes, halves): 8 contiguous values per thread; rows start on WORD_ALIGN-word
    # boundaries, which the hint tells the compiler so it vectorizes these accesses
    o_a8 = tl.multiple_of(b_roff * 4, WORD_ALIGN * 4)
    o_a16 = tl.multiple_of(b_roff * 2, WORD_ALIGN * 2)
    p_c8 = p_slot.to(tl.pointer_type(tl.uint8)) + o_a8[None, :, None] + o_j[:, None, :]  # [8, BKB, NM]
    p_c16 = p_slot.to(tl.pointer_type(tl.float16)) + o_a16[None, :, None] + o_j[:, None, :]
    return p_c8, p_c16


@triton.jit
def _plane_shifts(b_bits, UNIFORM_BITS: tl.constexpr):
    # where the 2- and 1-bit planes' code bits go: above the wider planes of the row
    if UNIFORM_BITS > 0:
        return UNIFORM_BITS & ~3, UNIFORM_BITS & ~1
    else:
        return (b_bits & ~3)[None, :, None], (b_bits & ~1)[None, :, None]


@triton.jit
def _unpack_block(p_slot, b_bits, b_roff, o_p, o_m, o_j, m_m, m_j, i_one, i_planes,
                  PLANES: tl.constexpr, V: tl.constexpr, WORD_ALIGN: tl.constexpr, BKB: tl.constexpr,
                  NM: tl.constexpr, UNIFORM_BITS: tl.constexpr):
    # 2 * code of every value of a row block [8, BKB, NM] (pivot rows: 0), see MAGIC_LEVEL
    o_p2, o_p1 = _plane_offsets(b_bits, b_roff, V)
    s_p2, s_p1 = _plane_shifts(b_bits, UNIFORM_BITS)
    b_code = tl.zeros([8, BKB, NM], dtype=tl.int32)
    if PLANES & 8:
        if (i_planes & 8) != 0:
            p_c8, _ = _wide_ptrs(p_slot, b_roff, o_j, WORD_ALIGN)
            m_p8 = (b_bits & 8) != 0
            b_code = tl.load(p_c8, mask=m_p8[None, :, None] & m_j[:, None, :], other=0).to(tl.int32) << 1
    if PLANES & 4:
        if (i_planes & 4) != 0:
            b_code |= _load_plane(p_slot, b_roff, (b_bits & 4) != 0, o_p, o_m, m_m, i_one, 4)
    if PLANES & 2:
        if (i_planes & 2) != 0:
            b_code |= _load_plane(p_slot, o_p2, (b_bits & 2) != 0, o_p, o_m, m_m, i_one, 2) << s_p2
    if PLANES & 1:
        if (i_planes & 1) != 0:
            b_code |= _load_plane(p_slot, o_p1, (b_bits & 1) != 0, o_p, o_m, m_m, i_one, 1) << s_p1
    return b_code


@triton.jit
def _pack_block(p_slot, b_u, b_x, b_bits, b_roff, o_p, o_m, o_j, m_m, m_j, i_one, i_planes,
                PLANES: tl.constexpr, V: tl.constexpr, WORD_ALIGN: tl.constexpr, UNIFORM_BITS: tl.constexpr):
    # store the float codes b_u [8, BKB, NM] plane by plane, and fp16(clamp(X)) of the pivot rows
    o_p2, o_p1 = _plane_offsets(b_bits, b_roff, V)
    s_p2, s_p1 = _plane_shifts(b_bits, UNIFORM_BITS)
    p_c8, p_c16 = _wide_ptrs(p_slot, b_roff, o_j, WORD_ALIGN)
    b_code = (b_u + MAGIC_CODE).to(tl.int32, bitcast=True)  # low mantissa bits: the code
    if V % 8 != 0:
        # the last chunk's values past V are padding and must stay zero bits
        b_code = tl.where(m_j[:, None, :], b_code, 0)
    if PLANES & 8:
        if (i_planes & 8) != 0:
            tl.store(p_c8, b_code.to(tl.uint8), mask=((b_bits & 8) != 0)[None, :, None] & m_j[:, None, :])
    if PLANES & 4:
        if (i_planes & 4) != 0:
            _store_plane(p_slot, b_code, b_roff, (b_bits & 4) != 0, o_p, o_m, m_m, i_one, 4)
    if PLANES & 2:
        if (i_planes & 2) != 0:
            _store_plane(p_slot, b_code >> s_p2, o_p2, (b_bits & 2) != 0, o_p, o_m, m_m, i_one, 2)
    if PLANES & 1:
        if (i_planes & 1) != 0:
            _store_plane(p_slot, b_code >> s_p1, o_p1, (b_bits & 1) != 0, o_p, o_m, m_m, i_one, 1)
    if PLANES & 16:
        if (i_planes & 16) != 0:
            b_pv = tl.minimum(tl.maximum(b_x, -FP16_SCALE_MAX), FP16_SCALE_MAX).to(tl.float16)
            tl.store(p_c16, b_pv, mask=((b_bits & 16) != 0)[None, :, None] & m_j[:, None, :])


@triton.jit
def _state_block(p_slot, p_rs, x_in, g, k, i_n, i_h, kb, b_c3, b_rc, b_eg, b_u3, f_k, i_hs, i_one,
                 i_planes, plan_rows, o_p, o_m, o_j, m_m, m_j,
                 H: tl.constexpr, HQ: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BKB: tl.constexpr,
                 NM: tl.constexpr, PLANES: tl.constexpr, WORD_ALIGN: tl.constexpr, IS_KDA: tl.constexpr,
                 IS_MIDRISE: tl.constexpr, USE_UPDATE: tl.constexpr, UNIFORM_BITS: tl.constexpr):
    # one row block of the state. USE_UPDATE: levels z, the per-row factor a = r e^g of the decayed
    # state D S = diag(a) Z diag(c) (pivot rows: z = value / c, a = e^g), the row-block of normalised k,
    # and X = D S + k u^T. Otherwise X is the float state x_in (boundary pack).
    o_r, m_r, b_bits, b_roff, m_int, b_zero, b_lo, b_hi = _row_block(plan_rows, i_h, kb, K, BKB, IS_MIDRISE,
                                                                      UNIFORM_BITS)
    if USE_UPDATE:
        b_code = _unpack_block(p_slot, b_bits, b_roff, o_p, o_m, o_j, m_m, m_j, i_one, i_planes,
                               PLANES, V, WORD_ALIGN, BKB, NM, UNIFORM_BITS)
        # bits((2u) | 0x4A800000) = 2^22 + u, so a level is one subtraction (exact for half-integer zeros)
        b_lvl = (b_code | 0x4A800000).to(tl.float32, bitcast=True) - (b_zero + MAGIC_LEVEL)[None, :, None]
        if PLANES & 16:
            if (i_planes & 16) != 0:
                m_pv = (b_bits & 16) != 0
                _, p_c16 = _wide_ptrs(p_slot, b_roff, o_j, WORD_ALIGN)
                b_pv = tl.load(p_c16, mask=m_pv[None, :, None] & m_j[:, None, :], other=0).to(tl.float32)
                b_lvl = tl.where(m_pv[None, :, None], b_pv * b_rc[:, None, :], b_lvl)
        # old row scales: 1 for pivot rows and heads without scales, 0 for padded rows
        b_r = tl.load(p_rs + o_r, mask=m_int & ((o_r * 0 + i_hs) >= 0), other=1.0).to(tl.float32)
        if IS_KDA:
            b_eg = tl.exp(tl.load(g + (i_n * H + i_h) * K + o_r, mask=m_r, other=0).to(tl.float32))
        b_a = tl.where(m_r, b_r * b_eg, 0.0)  # [BKB]
        i_hq = i_h // (H // HQ)
        b_k = tl.load(k + (i_n * HQ + i_hq) * K + o_r, mask=m_r, other=0).to(tl.float32) * f_k
        b_x = tl.fma(b_lvl * b_a[None, :, None], b_c3, b_k[None, :, None] * b_u3)
    else:
        b_lvl = tl.zeros([8, BKB, NM], dtype=tl.float32)
        b_a = tl.zeros([BKB], dtype=tl.float32)
        b_k = tl.zeros([BKB], dtype=tl.float32)
        p_x = x_in + ((i_n * H + i_h) * K + o_r[None, :, None]) * V + o_j[:, None, :]
        b_x = tl.load(p_x, mask=m_r[None, :, None] & m_j[:, None, :], other=0).to(tl.float32)
    return b_x, b_lvl, b_a, b_k, o_r, m_r, b_bits, b_roff, m_int, b_zero, b_lo, b_hi


@triton.jit
def packed_step_kernel(
    q,
    k,
    v,
    g,
    beta,
    y,
    x_in,
    slots,
    heads,
    codes,
    row_scale,
    col_scale,
    plan_rows,
    plan_heads,
    plan_winv,
    plan_w2,
    plan_gain,
    work,
    dbg_x,
    dbg_c,
    scale,
    slot_stride,
    num_scaled,
    WORD_ALIGN: tl.constexpr,
    PLANES: tl.constexpr,
    UNIFORM_BITS: tl.constexpr,
    H: tl.constexpr,
    HQ: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BKB: tl.constexpr,
    IS_KDA: tl.constexpr,
    USE_UPDATE: tl.constexpr,
    READOUT: tl.constexpr,
    STORE_Y: tl.constexpr,
    STORE_U: tl.constexpr,
    WRITEBACK: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    USE_DUAL_AXIS: tl.constexpr,
    ROW_STAT: tl.constexpr,  # 0 absmax, 1 rms, 2 mean_abs (dual_axis.ROW_STATS)
    IS_MIDRISE: tl.constexpr,
    REFIT_ITERS: tl.constexpr,
    RECIP: tl.constexpr,
    ROW_FILL: tl.constexpr,  # DualAxisConfig.row_fill (with RECIP)
    STORE_DEBUG: tl.constexpr,
    APPROX_RCP: tl.constexpr,
):
    # one launch per group of heads with the same plane widths (and, for GDN, one bit width), so each
    # compiled kernel holds only the unpack / pack paths its heads use
    i_n, i_h = tl.program_id(0).to(tl.int64), tl.load(heads + tl.program_id(1))
    i_s = tl.load(slots + i_n).to(tl.int64)
    if i_s < 0:
        # a free batch row: leave its output and every slot untouched
        return
    NM: tl.constexpr = BV // 8
    NKB: tl.constexpr = (K + BKB - 1) // BKB
    o_p = tl.arange(0, 8)
    o_m = tl.arange(0, NM)
    o_j = o_m[None, :] * 8 + o_p[:, None]  # [8, NM] value column of tile element (p, i, m)
    m_j = o_j < V
    m_m = o_m * 8 < V

    # the head: its scale slot (-1: no scales) and flags (plane widths used in its low bits)
    i_hs = tl.load(plan_heads + i_h * 2)
    i_flags = tl.load(plan_heads + i_h * 2 + 1)
    i_planes = i_flags & 31
    i_one = (i_flags >> 16) + 1  # flags are < 2^16: a 1 only known at run time (see _chunk_ptr)
    p_slot = codes + i_s * slot_stride * WORD_ALIGN
    p_rs = row_scale + (i_s * num_scaled + i_hs) * K  # + row
    p_cs = col_scale + (i_s * num_scaled + i_hs) * V + o_j  # [8, NM]
    # row scales [BK] (before the fill, with ROW_FILL), u [BV], with ROW_FILL the filled row scales [BK]
    p_work = work + (i_n * H + i_h) * (BK + BV + (BK if ROW_FILL else 0))
    p_fill = p_work + BK + BV

    b_c = tl.full([8, NM], 1.0, dtype=tl.float32)  # old column scales (1: none)
    b_u = tl.zeros([8, NM], dtype=tl.float32)
    b_eg = 1.0
    f_k = 1.0
    if USE_UPDATE:
        if USE_DUAL_AXIS:
            b_c = tl.load(p_cs, mask=m_j & ((o_j * 0 + i_hs) >= 0), other=1.0).to(tl.float32)
        if not IS_KDA:
            b_eg = tl.exp(tl.load(g + i_n * H + i_h).to(tl.float32))
        # |q|^2, |k|^2 and q . k of the head's q/k head (value head h reads q/k head h // (H / HQ))
        i_hq = i_h // (H // HQ)
        o_k = tl.arange(0, BK)
        m_k = o_k < K
        b_q = tl.load(q + (i_n * HQ + i_hq) * K + o_k, mask=m_k, other=0).to(tl.float32)
        b_kf = tl.load(k + (i_n * HQ + i_hq) * K + o_k, mask=m_k, other=0).to(tl.float32)
        b_qq, b_kk, b_qk = tl.reduce((b_q * b_q, b_kf * b_kf, b_q * b_kf), 0, _add3)
        if USE_QK_L2NORM:
            f_q = (1.0 / tl.sqrt(b_qq + 1e-6)) * scale
            f_k = 1.0 / tl.sqrt(b_kk + 1e-6)
            b_qk = b_qk * (f_q * f_k)
        else:
            f_q = scale
            b_qk = b_qk * scale
        # columns past V: c = 0, so X is 0 there and takes no part in any row statistic; 1 / c = 0 wherever
        # c = 0 (past V, or a zeroed slot, whose pivot values are 0 and are read as value * (1 / c))
        b_c = tl.where(m_j, b_c, 0.0)
        m_c = b_c > 0.0
        b_rc = tl.where(m_c, _rcp(tl.where(m_c, b_c, 1.0), APPROX_RCP), 0.0)
    else:
        b_rc = b_c
    o_w = tl.arange(0, BK)
    b_c3 = b_c[:, None, :]  # [8, 1, NM]
    b_u3 = b_u[:, None, :]

    # ---- readout: k^T (D S) and q^T (D S) = c_j sum_i (a_i k_i) z_ij, one pass over the row blocks
    if READOUT:
        acc_k = tl.zeros([8, BKB, NM], dtype=tl.float32)
        acc_q = tl.zeros([8, BKB, NM], dtype=tl.float32)
        for kb in range(NKB):
            _, b_lvl, b_a, b_k, o_r, m_r, _, _, _, _, _, _ = _state_block(
                p_slot, p_rs, x_in, g, k, i_n, i_h, kb, b_c3, b_rc, b_eg, b_u3, f_k, i_hs, i_one,
                i_planes, plan_rows, o_p, o_m, o_j, m_m, m_j, H, HQ, K, V, BKB, NM, PLANES, WORD_ALIGN,
                IS_KDA, IS_MIDRISE, USE_UPDATE, UNIFORM_BITS)
            b_qr = tl.load(q + (i_n * HQ + i_hq) * K + o_r, mask=m_r, other=0).to(tl.float32) * f_q
            acc_k += b_lvl * (b_a * b_k)[None, :, None]
            acc_q += b_lvl * (b_a * b_qr)[None, :, None]
        b_hk = tl.sum(acc_k, 1) * b_c  # [8, NM]
        b_hq = tl.sum(acc_q, 1) * b_c
        b_beta = tl.load(beta + i_n * H + i_h).to(tl.float32)
        b_v = tl.load(v + (i_n * H + i_h) * V + o_j, mask=m_j, other=0).to(tl.float32)
        b_u = b_beta * (b_v - b_hk)  # X = D S + k u^T
        if STORE_Y:
            # y = X^T q = (D S)^T q + (k . q) u: no second pass over X
            tl.store(y + (i_n * H + i_h) * V + o_j, (b_hq + b_qk * b_u).to(y.dtype.element_ty), mask=m_j)
        if STORE_U:
            tl.store(p_work + BK + o_j, b_u, mask=m_j)
    elif USE_UPDATE:
        b_u = tl.load(p_work + BK + o_j, mask=m_j, other=0)
    b_u3 = b_u[:, None, :]

    if WRITEBACK:
        # ---- pass A: X, row statistic -> new row scales r (to the work buffer), column init
        b_cm = tl.zeros([8, BKB, NM], dtype=tl.float32)
        for kb in range(NKB):
            b_x, _, _, _, o_r, m_r, b_bits, _, m_int, b_zero, _, b_hi = _state_block(
                p_slot, p_rs, x_in, g, k, i_n, i_h, kb, b_c3, b_rc, b_eg, b_u3, f_k, i_hs, i_one,
                i_planes, plan_rows, o_p, o_m, o_j, m_m, m_j, H, HQ, K, V, BKB, NM, PLANES, WORD_ALIGN,
                IS_KDA, IS_MIDRISE, USE_UPDATE, UNIFORM_BITS)
            if USE_DUAL_AXIS:
                if ROW_STAT == 1:
                    b_m = tl.sqrt_rn(tl.sum(tl.sum(b_x * b_x, 0), 1) * (1.0 / V))
                elif ROW_STAT == 2:
                    b_m = tl.sum(tl.sum(tl.abs(b_x), 0), 1) * (1.0 / V)
                else:
                    b_m = tl.max(tl.max(tl.abs(b_x), 0), 1)  # [BKB]
                b_winv = tl.load(plan_winv + i_h * K + o_r, mask=m_r, other=1.0)
                b_rn = tl.where(m_int, _fp16_scale(tl.sqrt_rn(b_m) * b_winv), 1.0)
                b_y = _scale_down(b_x, b_rn, RECIP, APPROX_RCP)  # Y = X / r
                # pivot and padded rows have gain 0, so they take no part in the column fit
                b_gain = tl.load(plan_gain + i_h * K + o_r, mask=m_int, other=0.0)
                b_cm = tl.maximum(b_cm, tl.abs(b_y) * b_gain[None, :, None])
            else:
                # rowwise absmax at each row's width: scale = fp16(absmax / qmax)
                b_m = tl.max(tl.max(tl.abs(b_x), 0), 1)
                b_rn = tl.where(m_int, _fp16_scale(tl.math.div_rn(b_m, b_hi * 0.5 - 0.5)), 1.0)
            tl.store(p_work + o_r, b_rn, mask=m_r)
        b_cn = _fp16_scale(tl.max(b_cm, 1))  # [8, NM] column init (dual-axis)
        tl.debug_barrier()  # the work buffer's row scales are read back by other threads

        if ROW_FILL:
            # ---- pass A2 (dual_axis.fill_rows): r' = fp16(r max_j |Y_ij / c_j| gain_b(i)) to p_fill
            b_rci = tl.math.div_rn(tl.full(b_cn.shape, 1.0, tl.float32), b_cn)
            for kb in range(NKB):
                b_x, _, _, _, o_r, m_r, _, _, m_int, _, _, _ = _state_block(
                    p_slot, p_rs, x_in, g, k, i_n, i_h, kb, b_c3, b_rc, b_eg, b_u3, f_k, i_hs, i_one,
                    i_planes, plan_rows, o_p, o_m, o_j, m_m, m_j, H, HQ, K, V, BKB, NM, PLANES, WORD_ALIGN,
                    IS_KDA, IS_MIDRISE, USE_UPDATE, UNIFORM_BITS)
                b_rn = tl.load(p_work + o_r, mask=m_r, other=1.0)
                b_t = _scale_down(b_x, b_rn, RECIP, APPROX_RCP) * b_rci[:, None, :]
                b_gain = tl.load(plan_gain + i_h * K + o_r, mask=m_int, other=0.0)
                b_used = tl.max(tl.max(tl.abs(b_t), 0), 1) * b_gain  # [BKB]
                tl.store(p_fill + o_r, tl.where(m_int, _fp16_scale(b_rn * b_used), 1.0), mask=m_r)
            tl.debug_barrier()

        # ---- passes B: codes against the current column scales; each refit pass refits them; the last
        # pass packs its codes in place (a barrier per block: every thread has read the old words first)
        NP: tl.constexpr = REFIT_ITERS if (USE_DUAL_AXIS and REFIT_ITERS > 0) else 1
        for it in tl.static_range(NP):
            b_cc = b_cn  # the column scales these codes are computed against
            if RECIP:
                b_rcc = tl.math.div_rn(tl.full(b_cc.shape, 1.0, tl.float32), b_cc)
            else:
                b_rcc = _rcp(b_cc, APPROX_RCP)
            acc_n = tl.zeros([8, BKB, NM], dtype=tl.float32)
            acc_d = tl.zeros([8, BKB, NM], dtype=tl.float32)
            for kb in range(NKB):
                b_x, _, _, _, o_r, m_r, b_bits, b_roff, m_int, b_zero, b_lo, b_hi = _state_block(
                    p_slot, p_rs, x_in, g, k, i_n, i_h, kb, b_c3, b_rc, b_eg, b_u3, f_k, i_hs, i_one,
                    i_planes, plan_rows, o_p, o_m, o_j, m_m, m_j, H, HQ, K, V, BKB, NM, PLANES, WORD_ALIGN,
                    IS_KDA, IS_MIDRISE, USE_UPDATE, UNIFORM_BITS)
                b_rn = tl.load(p_work + o_r, mask=m_r, other=1.0)
                b_y = _scale_down(b_x, b_rn, RECIP, APPROX_RCP)
                if ROW_FILL:  # Y' = Y fl(r fl(1 / r')), and r' from here on
                    b_rf = tl.load(p_fill + o_r, mask=m_r, other=1.0)
                    b_fac = b_rn * tl.math.div_rn(tl.full(b_rf.shape, 1.0, tl.float32), b_rf)
                    b_y = b_y * tl.where(m_int, b_fac, 1.0)[None, :, None]
                    b_rn = b_rf
                if USE_DUAL_AXIS:
                    b_q8 = _codes(b_y, b_cc, b_rcc, b_zero, b_lo, b_hi, IS_MIDRISE, RECIP)  # [8, BKB, NM]
                    if REFIT_ITERS > 0:
                        # w^2 r z X = (w^2 r^2 z) Y up to the rounding of Y = X / r: one product, both sums
                        b_w2 = tl.load(plan_w2 + i_h * K + o_r, mask=m_int, other=0.0)
                        b_z = b_q8 - b_zero[None, :, None]
                        b_wz = ((b_w2 * b_rn) * b_rn)[None, :, None] * b_z
                        acc_n += b_wz * b_y
                        acc_d += b_wz * b_z
                else:
                    b_q8 = tl.minimum(tl.maximum(_rint(b_y + b_zero[None, :, None]), b_lo[None, :, None]),
                                      b_hi[None, :, None])
                if it == NP - 1:
                    if STORE_DEBUG:
                        p_dx = dbg_x + ((i_n * H + i_h) * BK + o_r[None, :, None]) * BV + o_j[:, None, :]
                        tl.store(p_dx, b_x, mask=m_r[None, :, None])
                    tl.debug_barrier()
                    _pack_block(p_slot, b_q8, b_y, b_bits, b_roff, o_p, o_m, o_j, m_m, m_j, i_one, i_planes,
                                PLANES, V, WORD_ALIGN, UNIFORM_BITS)
            if USE_DUAL_AXIS and REFIT_ITERS > 0:
                b_num = tl.sum(acc_n, 1)
                b_den = tl.sum(acc_d, 1)
                b_fit = _fp16_scale(tl.math.div_rn(b_num, tl.where(b_den > 0, b_den, 1.0)))
                b_cn = tl.where(b_den > 0, b_fit, b_cc)
        if STORE_DEBUG:
            tl.store(dbg_c + (i_n * H + i_h) * BV + o_j, b_cc if USE_DUAL_AXIS else tl.full([8, NM], 1.0,
                                                                                        tl.float32))
        # ---- new scales last: the passes above read the old ones
        tl.debug_barrier()
        if i_hs >= 0:
            b_rw = tl.load((p_fill if ROW_FILL else p_work) + o_w, mask=o_w < K, other=1.0)
            tl.store(p_rs + o_w, b_rw.to(tl.float16), mask=o_w < K)
            if USE_DUAL_AXIS:
                tl.store(p_cs, b_cn.to(tl.float16), mask=m_j)


_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _word_align(value_dim: int) -> int:
    # rows and planes start on multiples of V/32 words when 32 | V (4 words = 16 bytes at V = 128)
    if value_dim % 128 == 0:
        return 4
    return 2 if value_dim % 64 == 0 else 1


def work_buffer(tables: FormatTables, num_rows: int) -> torch.Tensor:
    """Per (request, head) FP32 scratch: the new row scales [BK], then the readout's u [BV], and with a
    row_fill quantizer the filled row scales [BK] (the first [BK] then hold the scales before the fill)."""
    block_k, block_v = _blocks(tables)
    fill = block_k if tables.row_fill else 0
    return torch.empty(num_rows, tables.num_heads, block_k + block_v + fill, dtype=torch.float32,
                       device=tables.device)



def _blocks(tables: FormatTables) -> tuple[int, int]:
    return triton.next_power_of_2(tables.key_dim), max(triton.next_power_of_2(tables.value_dim), 8)


def _launch(tables, pages, slots, q, k, v, g, beta, y, x_in, *, scale, use_qk_l2norm, use_update, debug,
            num_warps, part="fused", work=None, block_rows=None):
    num_rows = slots.shape[0]
    num_heads, key_dim, value_dim = tables.num_heads, tables.key_dim, tables.value_dim
    block_k, block_v = _blocks(tables)
    align = _word_align(value_dim)
    readout = use_update and (part in ("fused", "readout") or work is None)
    store_u = part == "readout" and work is not None
    if work is None:
        work = work_buffer(tables, num_rows)
    dbg_x = dbg_c = tables.row_winv  # unused unless debug
    if debug is not None:
        dbg_x = torch.full((num_rows, num_heads, block_k, block_v), float("nan"), device=tables.device)
        dbg_c = torch.full((num_rows, num_heads, block_v), float("nan"), device=tables.device)
    col_scale = pages.col_scale if pages.col_scale is not None else pages.row_scale
    num_q_heads = q.shape[1] if use_update else num_heads
    # defaults from the H200 sweep (benchmarks/results, B = 512): every part is latency-bound, so many
    # small programs (8 key rows per tile) win; the readout alone runs best as one warp per head
    if block_rows is None:
        block_rows = min(block_k, 8)
    if num_warps is None:
        num_warps = 1 if part == "readout" else 2
    for heads, group_planes, uniform_bits in tables.head_groups:
        _launch_group(tables, pages, slots, heads, group_planes, uniform_bits, q, k, v, g, beta, y, x_in,
                      work, dbg_x, dbg_c, col_scale, scale=scale, num_q_heads=num_q_heads, align=align,
                      block_k=block_k, block_v=block_v, block_rows=block_rows, use_update=use_update,
                      readout=readout, store_u=store_u, part=part, use_qk_l2norm=use_qk_l2norm,
                      debug=debug is not None, num_warps=num_warps)
    if debug is not None:
        debug["x"] = dbg_x[:, :, :key_dim, :value_dim]
        debug["c"] = dbg_c[:, :, :value_dim]
        if tables.row_fill:
            debug["r_before_fill"] = work[:, :, :key_dim].clone()


def _launch_group(tables, pages, slots, heads, planes, uniform_bits, q, k, v, g, beta, y, x_in, work, dbg_x,
                  dbg_c, col_scale, *, scale, num_q_heads, align, block_k, block_v, block_rows, use_update,
                  readout, store_u, part, use_qk_l2norm, debug, num_warps):
    config = tables.format.config
    packed_step_kernel[(slots.shape[0], heads.shape[0])](
        q, k, v, g, beta, y, x_in,
        slots,
        heads,
        pages.codes, pages.row_scale, col_scale,
        tables.row_table, tables.head_table,
        tables.row_winv, tables.row_w2, tables.row_gain,
        work,
        dbg_x, dbg_c,
        scale,
        tables.words_per_slot // align,
        tables.num_scaled_heads,
        WORD_ALIGN=align,
        PLANES=planes,
        UNIFORM_BITS=uniform_bits,
        H=tables.num_heads,
        HQ=num_q_heads,
        K=tables.key_dim,
        V=tables.value_dim,
        BK=block_k,
        BV=block_v,
        BKB=block_rows,
        IS_KDA=g.dim() == 3 if use_update else False,
        USE_UPDATE=use_update,
        READOUT=readout,
        STORE_Y=use_update and part in ("fused", "readout"),
        STORE_U=store_u,
        WRITEBACK=part in ("fused", "writeback"),
        USE_QK_L2NORM=use_qk_l2norm,
        USE_DUAL_AXIS=tables.has_col_scale,
        ROW_STAT=ROW_STATS.index(config.row_stat),
        IS_MIDRISE=tables.grid is Grid.MIDRISE,
        REFIT_ITERS=config.refit_iters,
        RECIP=tables.has_col_scale and config.division == "reciprocal",
        ROW_FILL=tables.row_fill,
        STORE_DEBUG=debug,
        APPROX_RCP=not _INTERPRETED,
        num_warps=num_warps,
    )


PARTS = ("fused", "readout", "writeback")


def fused_decode(
    tables: FormatTables,
    pages: Pages,
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
    work: torch.Tensor | None = None,
    debug: dict | None = None,
    num_warps: int | None = None,
    block_rows: int | None = None,
) -> torch.Tensor:
    """One decode token for N requests whose states live in ``pages``' slots; returns y [N, H, V].

    slots int32 [N] (-1: skip the row, its output and every slot untouched); q, k [N, H_k, K];
    v [N, H, V]; g [N, H] (GDN) or [N, H, K] (KDA) log decays; beta [N, H]. Value head h reads q/k head
    h // (H / H_k). scale defaults to K^-1/2, applied to q after the optional in-kernel L2 norm.
    part: "fused" (readout and in-place requantization, one kernel), or the paper's split:
    "readout" (y only, slots untouched) then "writeback" (requantizes the slots, y untouched). With
    ``work`` (from :func:`work_buffer`) the readout leaves the update's u there and the
    writeback starts from it; without, the writeback recomputes it. debug (a dict) receives "x": the
    float state X [N, H, K, V] the kernel requantized, and "c": the column scales [N, H, V] its codes
    were computed against. num_warps and block_rows (key rows per tile) are tuning knobs.
    """
    check_token_inputs(tables, pages, slots, q, k, v, g, beta)
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    if out is None:
        out = torch.zeros(v.shape[0], tables.num_heads, tables.value_dim, dtype=v.dtype, device=v.device)
    scale = tables.key_dim**-0.5 if scale is None else float(scale)
    _launch(tables, pages, slots.to(torch.int32).contiguous(), q, k, v, g, beta, out, q, scale=scale,
            use_qk_l2norm=use_qk_l2norm, use_update=True, debug=debug, num_warps=num_warps, part=part,
            work=work, block_rows=block_rows)
    return out


def fused_pack(
    tables: FormatTables,
    pages: Pages,
    slots: torch.Tensor,
    states: torch.Tensor,
    *,
    debug: dict | None = None,
    num_warps: int | None = None,
) -> None:
    """Quantize float states [N, H, K, V] with the format's quantizer into ``slots`` (-1: skip a row)."""
    check_states(tables, pages, slots, states)
    states = states.contiguous()
    dummy = tables.row_winv
    _launch(tables, pages, slots.to(torch.int32).contiguous(), dummy, dummy, dummy, dummy, dummy, dummy,
            states, scale=1.0, use_qk_l2norm=False, use_update=False, debug=debug, num_warps=num_warps)


# ---------------------------------------------------------------- on a pool layer (pool.PackedLayer)

def fused_packed_decode(layer, slots: torch.Tensor, q, k, v, g, beta, **options) -> torch.Tensor:
    """:func:`fused_decode` on a pool.PackedLayer's tables and pages (after its pending writeback)."""
    layer.wait_writes()
    return fused_decode(layer.tables, layer.pages, slots, q, k, v, g, beta, **options)


def fused_pack_states(layer, slots: torch.Tensor, states: torch.Tensor, **options) -> None:
    """:func:`fused_pack` on a pool.PackedLayer."""
    layer.wait_writes()
    fused_pack(layer.tables, layer.pages, slots, states, **options)

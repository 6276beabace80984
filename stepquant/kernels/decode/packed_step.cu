// Packed-state decode step for GDN / KDA in CUDA: one token for N requests whose states live packed in
// pool slots (docs/format.md), read once and written once (docs/kernels.md, "CUDA kernel").
//
// stepquant/kernels/decode/cuda.py builds this file with nvcc at first use, one shared library per
// quantizer configuration (the SQ_* macros below), and calls sq_packed_step through ctypes on the
// caller's stream. The arithmetic reproduces stepquant.codecs.dual_axis.fit_dual_axis (and
// mixed.fit_rowwise_absmax) given the same X: codes and packed bytes bit for bit given the scales;
// FP32 reductions (readout sums, rms statistic, refit sums) run in another order than torch.
//
// One CTA of 256 threads per (request, head); K is a multiple of 16 up to 128 and V = 128. Warp w owns key
// rows [16w, 16w + 16) (a warp past K computes on neutral rows and stores nothing), lane l owns value
// columns [4l, 4l + 4), so each thread holds a 16 x 4 tile of the head in registers (x[16][4]) through
// the whole step:
//   1. load the slot's code words, levels z;          readout sums k^T D S, q^T D S (8 warps -> smem)
//   2. u = beta (v - k^T D S), y = (D S)^T q + (k.q) u (stored before anything is requantized)
//   3. X = D S + k u^T in place;                        row statistic (32 lanes of a warp -> smem)
//   4. Y = X / r in place;                              column maxima (8 warps -> smem) -> c
//   5. codes of Y / c, refit sums (8 warps -> smem) -> refitted c; the last pass packs and stores.
// A row's bit width is the same for the 32 lanes that hold it, so mixed-width (KDA) heads branch per
// row without divergence; heads whose rows share one width b run a body compiled for that b.
// The readout alone (SQ_MMA) takes step 1's sums of heads of one width b <= 7 on tensor cores instead: the
// levels as BF16 pairs, k^T D S and q^T D S as one mma.m16n8k16 per 16 value columns of a warp ("readout on
// tensor cores" below).

#ifdef SQ_EMULATE
#include "cuda_emulation.h"  // the CPU build that the default test suite runs
#else
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#endif
#include <stddef.h>
#include <stdint.h>

#ifndef SQ_PART
#define SQ_PART 0  // 0 fused (readout + writeback), 1 readout only, 2 writeback from the readout's u, 3 pack
#endif
#ifndef SQ_DUAL
#define SQ_DUAL 1  // 1 dual-axis (row and column scales), 0 rowwise absmax (mid-tread, no column scales)
#endif
#ifndef SQ_MIDRISE
#define SQ_MIDRISE 1
#endif
#ifndef SQ_RECIP
#define SQ_RECIP 1  // 1 DualAxisConfig.division == "reciprocal", 0 "exact"
#endif
#ifndef SQ_ROW_STAT
#define SQ_ROW_STAT 1  // row statistic: 0 absmax, 1 rms, 2 mean_abs (DualAxisConfig.row_stat)
#endif
#define SQ_ROW_SUM (SQ_ROW_STAT != 0 && SQ_DUAL)  // the row statistic is a sum (rms, mean_abs)
#ifndef SQ_KDA
#define SQ_KDA 0  // 1: g is [N, H, K] (a gate per key row), 0: g is [N, H]
#endif
#ifndef SQ_REFITS
#define SQ_REFITS 1  // DualAxisConfig.refit_iters
#endif
#ifndef SQ_DEBUG
#define SQ_DEBUG 0  // 1: store X and the column scales of the codes (dbg_x, dbg_c) for the tests
#endif
#ifndef SQ_MIN_BLOCKS
#define SQ_MIN_BLOCKS 2  // CTAs per multiprocessor the register allocation must allow (__launch_bounds__)
#endif
#ifndef SQ_ROWS
#define SQ_ROWS 16  // key rows per warp: 16 (8 warps, a 16 x 4 tile per thread) or 8 (16 warps, 8 x 4)
#endif
#ifndef SQ_CLIPPED
#define SQ_CLIPPED 0x1C  // bit b set: clip_b < 1, codes of the first pass need the clamp
#endif
#ifndef SQ_ROW_FILL
#define SQ_ROW_FILL 0  // 1: DualAxisConfig.row_fill (each row rescaled to reach its grid's top; needs SQ_RECIP)
#endif
#ifndef SQ_PENDING
#define SQ_PENDING 0  // 1: a deferred state's pending rank-1 updates (pend_k, pend_u): the readout adds their terms
                      // to u and y (the readout part also appends this token's k, u), the fit adds them to X
#endif
#ifndef SQ_MMA
#define SQ_MMA 0  // 1: the readout part sums heads of one width b <= 7 on tensor cores (BF16 levels, FP32 sums)
#endif
#ifndef SQ_ITEMS
#define SQ_ITEMS 1  // tuning: batch rows per CTA (one head); > 1 stages the next row's inputs while one computes
#endif
static_assert(!SQ_ROW_FILL || (SQ_DUAL && SQ_RECIP), "row fill is defined for the reciprocal dual-axis fit");
static_assert(!SQ_PENDING || SQ_PART != 3, "pending updates: the fused step, the readout and the writeback");
static_assert(!SQ_MMA || (SQ_PART == 1 && SQ_ROWS == 16), "tensor-core sums: the readout, 16 key rows per warp");

// The launch arguments (cuda.py builds the same struct with ctypes). Outside the anonymous namespace:
// a function taking a type of internal linkage gets internal linkage too, and ctypes could not find
// sq_packed_step.
struct Params {
    const void* q;          // [N, HQ, K]    FP32 or BF16 (bit 0 of bf16_mask)
    const void* k;          // [N, HQ, K]    (bit 1)
    const void* v;          // [N, H, V]     (bit 2)
    const void* g;          // [N, H] or [N, H, K] log decay (bit 3)
    const void* beta;       // [N, H]        (bit 4)
    const float* x_in;      // [N, H, K, V] float states (PACK)
    void* y;                // [N, H, V]     FP32, or BF16 with bit 5
    float* work;            // [N, H, V]: u (READOUT writes it, WRITEBACK reads it) or null
    const int* slots;       // [N], -1: skip the row
    int* codes;             // [S, W] int32 words
    __half* row_scale;      // [S, Hs, K]
    __half* col_scale;      // [S, Hs, V] (dual-axis) or null
    const int* heads;       // [H, 4]: (b in 2..8 when every row has width b, else 0; scale slot or -1;
                            //          first word of the head in a slot; its words, a multiple of 4)
    const int* row_info;    // [H*K]: first word << 5 | bits
    const float* row_winv;  // [H*K]: dual_axis.row_factor
    const float* row_w2;    // [H*K]: dual_axis.refit_weights
    const float* row_gain;  // [H*K]: dual_axis.row_gains
    float* dbg_x;           // [N, H, K, V] or null: X before requantizing
    float* dbg_c;           // [N, H, V] or null: the column scales the stored codes were computed against
    float* dbg_r;           // [N, H, K] or null: the row scales before the row fill (SQ_ROW_FILL)
    float scale;            // q scale (after the optional L2 norm)
    long long slot_words;   // W
    unsigned long long group_magic;  // ceil(2^32 / (H / HQ)): q/k head of head h = (h * group_magic) >> 32
    int H, HQ, K, num_scaled, l2norm;
    int bf16_mask;          // which of q, k, v, g, beta, y are BF16 (the rest FP32)
    int pend_n;             // SQ_PENDING: the pending updates held (read: entries 0 .. pend_n - 1)
    __half* pend_k;         // [N, HK, pend_stride, K] FP16 k_j (L2-normalized), decayed to this token; HK = H
                            // (KDA: decayed per head) or HQ (GDN: k_j is its q/k head's, shared by H / HQ heads)
    __half* pend_u;         // [N, H, pend_stride, V] FP16 u_j
    int pend_stride;        // entries per (row, head): R - 1 (codecs/deferred.py)
    int pend_append;        // the readout stores this token's k (normalized) and u at this entry; -1: none
    float* pend_gate;       // SQ_PENDING, or null: [N, H] (GDN) or [N, H, K] (KDA) FP32, the log decay summed
                            // since the fit, g then being this token's: the codes decay by e^(pend_gate + g),
                            // the held updates by e^g (KDA's k_e, GDN's u_e, FP16 rounded); the readout writes
                            // pend_gate + g back and the held updates decayed, the fused fit writes 0
};

namespace {

constexpr int ROWS = SQ_ROWS;        // key rows per warp
constexpr int MAX_K = 128;
constexpr int NUM_WARPS = MAX_K / ROWS;
constexpr int THREADS = NUM_WARPS * 32;
constexpr int COLS = 4;              // value columns per lane
constexpr int V = 32 * COLS;         // value columns of a head (fixed at 128)
constexpr int ROW_PAD = ROWS + 4;    // floats per lane in the row-partials buffer (conflict-free float4)
constexpr int LANES_PER_ROW = 32 / ROWS;  // lanes that finish one row's statistic
static_assert(ROWS == 8 || ROWS == 16, "a warp holds 8 or 16 key rows");

// threads MAX_K .. MAX_K + V - 1 hold one value column each in the per-column steps
__device__ __forceinline__ bool column_thread(int tid) { return tid >= MAX_K && tid < MAX_K + V; }
constexpr float MAGIC_ROUND = 12582912.0f;  // 1.5 * 2^23: w = MAGIC_ROUND + code, bits(w) low bits = code
constexpr float MAGIC_LEVEL = 4194304.0f;   // 2^22: bits 0x4A800000 | (code << 1) is 2^22 + code
constexpr float FP16_MAX = 65504.0f;
constexpr float SCALE_MIN = 6.103515625e-05f;  // 2^-14

#ifdef SQ_EMULATE
constexpr bool EMULATED = true;
#else
constexpr bool EMULATED = false;
#endif
enum Part { FUSED = 0, READOUT = 1, WRITEBACK = 2, PACK = 3 };
constexpr bool DO_READOUT = SQ_PART == FUSED || SQ_PART == READOUT;
constexpr bool DO_WRITEBACK = SQ_PART != READOUT;
constexpr bool FROM_CODES = SQ_PART != PACK;
// SQ_ITEMS > 1 (fused step and writeback): a CTA steps SQ_ITEMS batch rows of one head in turn, and every
// input of the next row (code words, old scales, k, q, g, v or u, beta) is copied into shared memory by
// cp.async while the current row computes, so a row's setup waits on global memory only for the CTA's first
// row; the plan's row tables (one head) are loaded once per CTA. The readout alone keeps one row per CTA
// (few registers: its occupancy would fall to the two CTAs that the staging buffers leave room for).
constexpr bool STAGED = SQ_ITEMS > 1 && FROM_CODES && SQ_PART != READOUT;
static_assert(SQ_ITEMS >= 1 && SQ_ITEMS <= 32, "SQ_ITEMS: 1 to 32 batch rows per CTA");



constexpr int STAGE_WORDS = MAX_K * V / 2;  // a head of FP16 pivot rows: 128 rows x 64 words (32 KB)
constexpr int MAX_PENDING = 15;  // SQ_PENDING: held updates per (row, head), R - 1 (cuda.MAX_PENDING)

// The scratch buffer (it shares its memory with the stage) holds, one after another, the row partials of
// step 3 [warp][lane][pad] at 0, the column maxima of step 4 [warp][V] at COLMAX_AT and the refit sums of
// step 5 [2][warp][V] at 0. Each lies apart from the one written before it, so a warp may write its
// partials as soon as it is done (no barrier waits for the other warps to finish reading): the column
// maxima do not touch the row partials, and the refit sums are written after the barrier that ends the
// reads of the row partials. The fused step's readout partials [2][warp][V] (step 2) get their own buffer
// when it fits the 48 KB of static shared memory (8 warps), so they need not wait for every warp to have
// read the stage (the readout alone keeps them in the scratch: its CTAs are few registers, and the 8 KB
// would cost it one CTA per multiprocessor, measured 3-7% slower).
constexpr int ROW_PARTIALS = NUM_WARPS * 32 * ROW_PAD;
constexpr int COLMAX_AT = ROW_PARTIALS;
constexpr int SCRATCH = COLMAX_AT + NUM_WARPS * V;
constexpr bool OWN_READOUT_BUFFER = NUM_WARPS == 8 && SQ_PART == FUSED;
static_assert(2 * NUM_WARPS * V <= COLMAX_AT, "refit sums must not reach the column maxima");
static_assert(OWN_READOUT_BUFFER || 2 * NUM_WARPS * V <= SCRATCH, "readout partials fit the scratch");
// SQ_MMA: the tensor-core partials [hi, lo][warp][V][k, q] in the stage's upper half, above any head of b <= 7
// bits' code words (128 rows x 28 words), so a warp writes them while others still read codes
constexpr int MMA_PARTIALS_AT = STAGE_WORDS / 2;
static_assert(!SQ_MMA || (MAX_K * 4 * 7 <= MMA_PARTIALS_AT
                           && MMA_PARTIALS_AT + 2 * NUM_WARPS * 2 * V <= STAGE_WORDS),
              "tensor-core partials above the codes, inside the stage");  // (16 warps: no tensor cores)

struct Shared {
    float4 row[MAX_K];        // (a k, a q, a, k) before the L2 norms: a = r_old e^g (pivot rows: e^g)
    float4 rowp[MAX_K];       // (row factor f, refit weight, gain, Width::round of the row's b)
    float2 rowq[MAX_K];       // (1/r or r, w^2 r^2) of the new row scales
    int rinfo[MAX_K];         // first word << 5 | bits
    float col[4][V];          // old column scales, u, column scales of the current codes, their reciprocals
    float red[12];
    float half_sums[SQ_MMA ? 8 : 1];  // SQ_MMA, 7-bit mid-rise: per row warp sum_i a_i k_i, then sum_i a_i q_i
    float pend_decay;         // SQ_PENDING, GDN: e^g of this token, the decay of the held u_e (1 without pend_gate)
    int item_slot[SQ_ITEMS];  // the slots of the CTA's batch rows (STAGED)
    float pdot[SQ_PENDING && DO_READOUT ? 4 * 2 * MAX_PENDING : 1];  // [row warp][k or q][j]: k.k_j, q.k_j
    alignas(16) float readout[OWN_READOUT_BUFFER ? 2 * NUM_WARPS * V : 1];  // readout partials [k or q][warp][V]
    union {  // STAGED: both live in the staging buffers (below) instead
        uint4 stage[STAGED ? 1 : STAGE_WORDS / 4];  // the head's code words (step 1)
        float scratch[STAGED ? 1 : SCRATCH];        // partials of steps 3-5 (above)
    };
};
static_assert(sizeof(Shared) <= 48 * 1024, "static shared memory");

// STAGED: one batch row's inputs as cp.async leaves them (raw FP32 or BF16 bytes; a scalar as the aligned
// 4-byte word that holds it), followed by its code words; the scratch of steps 3-5 shares a buffer's memory
// (its reads of the inputs end at the first barrier, of the codes at the barrier before step 3, as with
// Shared::stage). Two buffers per CTA in dynamic shared memory: one row computes from one while the next
// row's copies land in the other.
struct Staged {
    uint4 k[32], q[32];   // [K] of the row's q/k head (FP32: K / 4 chunks of 16 bytes, BF16: K / 8)
    uint4 g[32];          // [K] KDA gates
    uint4 v[32];          // [V] v (fused) or u (writeback, FP32)
    uint4 rs[16], cs[16]; // [K], [V] FP16 old row and column scales
    uint32_t beta_word, g_word;  // the words holding beta and a GDN head's gate
    float gate_word, pad;        // SQ_PENDING: a GDN head's pend_gate
    uint4 codes[STAGE_WORDS / 4];
    // SQ_PENDING: the held updates, FP16 [R - 1][K] k_j and [R - 1][V] u_j, after the codes: outside the
    // scratch of steps 3-5, which other warps write while one still folds
    uint4 pend_k[SQ_PENDING ? MAX_PENDING * MAX_K / 8 : 1];
    uint4 pend_u[SQ_PENDING ? MAX_PENDING * V / 8 : 1];
    uint4 gate[SQ_PENDING ? MAX_K / 4 : 1];  // SQ_PENDING, KDA: [K] pend_gate
};
static_assert(!SQ_PENDING || offsetof(Staged, pend_k) >= 4 * SCRATCH, "pending updates outside the scratch");
constexpr int STAGE_BUFFER = sizeof(Staged) > 4 * SCRATCH ? int(sizeof(Staged)) : 4 * SCRATCH;  // bytes
static_assert(STAGE_BUFFER % 16 == 0, "16-byte copies");
constexpr int STAGED_BYTES = STAGED ? 2 * STAGE_BUFFER : 0;  // dynamic shared memory per CTA
// SQ_PENDING without the staging buffers: the held updates' copy, pend_n (K + V) FP16 after STAGED_BYTES
// (launched with the CTA's own count; the opt-in is for the most the kernel holds)
constexpr int PENDING_BYTES_MAX = SQ_PENDING && !STAGED ? MAX_PENDING * (MAX_K + V) * 2 : 0;
constexpr int DYNAMIC_BYTES_MAX = STAGED_BYTES + PENDING_BYTES_MAX;

__device__ __forceinline__ float fp16_scale(float x) {
    // base.fp16_scale: clamp in FP32, round to nearest FP16
    return __half2float(__float2half_rn(fminf(fmaxf(x, SCALE_MIN), 65504.0f)));
}

// a / b correctly rounded for an FP16-valued b > 0 and rb ~ 1 / b (one Markstein correction; the
// proof is in docs/kernels.md): the "exact" quantizer's division
__device__ __forceinline__ float div_fp16(float a, float b, float rb) {
    float q0 = __fmul_rn(a, rb);
    float e = __fmaf_rn(-q0, b, a);
    return __fmaf_rn(e, rb, q0);
}

// (a & MASK) | c in one LOP3 (left to itself the compiler splits it in two when c is a constant too)
template <uint32_t MASK>
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t c) {
#ifdef SQ_EMULATE
    return (a & MASK) | c;
#else
    uint32_t out;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(out) : "r"(a), "n"(MASK), "r"(c));
    return out;
#endif
}

template <int S>
__device__ __forceinline__ uint32_t shift_right(uint32_t x) {  // S < 0 shifts left
    if constexpr (S >= 0) return x >> S; else return x << (-S);
}

// ---------------------------------------------------------------- planes of one row (V = 128)
// A row of b bits is split into planes (widest first, docs/format.md); the lane's 4 values of a
// w-bit plane are 4w bits at byte offset l * w / 2 of the plane.

template <int B> struct Planes;  // word offsets of the planes inside a row, -1 if absent
template <> struct Planes<2> { static constexpr int p8 = -1, p4 = -1, p2 = 0, p1 = -1; };
template <> struct Planes<3> { static constexpr int p8 = -1, p4 = -1, p2 = 0, p1 = 8; };
template <> struct Planes<4> { static constexpr int p8 = -1, p4 = 0, p2 = -1, p1 = -1; };
template <> struct Planes<5> { static constexpr int p8 = -1, p4 = 0, p2 = -1, p1 = 16; };
template <> struct Planes<6> { static constexpr int p8 = -1, p4 = 0, p2 = 16, p1 = -1; };
template <> struct Planes<7> { static constexpr int p8 = -1, p4 = 0, p2 = 16, p1 = 24; };
template <> struct Planes<8> { static constexpr int p8 = 0, p4 = -1, p2 = -1, p1 = -1; };

struct Chunks { uint32_t c8, c4, c2, c1; };  // the lane's bits of each plane

template <int B>
__device__ __forceinline__ Chunks load_chunks(const int* row, int lane) {
    using P = Planes<B>;
    const uint8_t* base = reinterpret_cast<const uint8_t*>(row);
    Chunks c{0, 0, 0, 0};
    if constexpr (P::p8 >= 0) c.c8 = reinterpret_cast<const uint32_t*>(base + 4 * P::p8)[lane];
    if constexpr (P::p4 >= 0) c.c4 = reinterpret_cast<const uint16_t*>(base + 4 * P::p4)[lane];
    if constexpr (P::p2 >= 0) c.c2 = base[4 * P::p2 + lane];
    if constexpr (P::p1 >= 0) c.c1 = (base[4 * P::p1 + (lane >> 1)] >> ((lane & 1) * 4)) & 0xF;
    return c;
}

// bits 0x4A800000 | (2 * code) of column c (the 2^22 magic: that float is 2^22 + code), from the plane
// chunks; the magic is ORed in by the first plane's mask-and-or (one LOP3 per plane and value)
template <int B, int C>
__device__ __forceinline__ uint32_t magic_code(const Chunks& ch) {
    using P = Planes<B>;
    uint32_t u = 0x4A800000u;
    if constexpr (P::p8 >= 0) u = and_or<0x1FEu>(shift_right<8 * C - 1>(ch.c8), u);
    if constexpr (P::p4 >= 0) u = and_or<0x1Eu>(shift_right<4 * C - 1>(ch.c4), u);
    if constexpr (P::p2 >= 0) {
        constexpr int O = B & ~3;  // code bits held by the 2-bit plane start here
        u = and_or<(0x3u << (O + 1))>(shift_right<2 * C - O - 1>(ch.c2), u);
    }
    if constexpr (P::p1 >= 0) {
        constexpr int O = B & ~1;
        u = and_or<(0x1u << (O + 1))>(shift_right<C - O - 1>(ch.c1), u);
    }
    return u;
}

// a level is z = 2^22 + code - level_offset(b) (mid-rise: code - 2^(b-1) + 1/2, mid-tread: code - 2^(b-1))
__host__ __device__ constexpr float level_offset(int b) {
    return MAGIC_LEVEL + (SQ_MIDRISE ? float(1 << (b - 1)) - 0.5f : float(1 << (b - 1)));
}

// the same from a mixed row's Width::round (MAGIC_ROUND + 2^(b-1); MAGIC_ROUND - MAGIC_LEVEL = 2^23): exact
__device__ __forceinline__ float level_offset_from_round(float round) {
    const float o = round - (MAGIC_ROUND - MAGIC_LEVEL);
    return SQ_MIDRISE ? o - 0.5f : o;
}

template <int B>
__device__ __forceinline__ void levels(const Chunks& ch, float* z) {
    constexpr float OFF = level_offset(B);
    z[0] = __uint_as_float(magic_code<B, 0>(ch)) - OFF;
    z[1] = __uint_as_float(magic_code<B, 1>(ch)) - OFF;
    z[2] = __uint_as_float(magic_code<B, 2>(ch)) - OFF;
    z[3] = __uint_as_float(magic_code<B, 3>(ch)) - OFF;
}

__device__ __forceinline__ void pivot_values(const int* row, int lane, float* z) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(row) + 2 * lane;  // 4 halves: 2 words
    uint32_t a = w[0], b = w[1];
    float2 lo = __half22float2(*reinterpret_cast<__half2*>(&a));
    float2 hi = __half22float2(*reinterpret_cast<__half2*>(&b));
    z[0] = lo.x; z[1] = lo.y; z[2] = hi.x; z[3] = hi.y;
}

// The lane's 4 codes of a row, a byte each (value c in byte c: b <= 8), from the FP32 bits of
// w = MAGIC_ROUND + code (their low byte is the code; three byte permutes)
__device__ __forceinline__ uint32_t code_bytes(const uint32_t* code) {
    return __byte_perm(__byte_perm(code[0], code[1], 0x0040), __byte_perm(code[2], code[3], 0x0040), 0x5410);
}

// chunk of plane width W holding code bits O.. of the 4 codes in bytes (value c's bits at W c)
template <int W, int O>
__device__ __forceinline__ uint32_t plane_chunk(uint32_t bytes) {
    if constexpr (W == 8) {
        return bytes;
    } else if constexpr (W == 4) {  // O = 0: bytes 0 and 2 of (low nibble of byte c | low nibble of c+1 << 4)
        const uint32_t pairs = (bytes & 0x0F0F0F0Fu) | ((bytes >> 4) & 0xF0F0F0F0u);
        return __byte_perm(pairs, 0, 0x4420);  // bytes 2, 3: zero
    } else {
        // the W-bit fields at 8c + O moved to W c + S by one multiply: M has bits (3 - c)(8 - W), and
        // the other products land on bits apart from [S, S + 4W) (and from each other: no carries)
        constexpr uint32_t FIELD = ((1u << W) - 1) << O;
        constexpr uint32_t M = 1u | (1u << (8 - W)) | (1u << (2 * (8 - W))) | (1u << (3 * (8 - W)));
        constexpr int S = O + 3 * (8 - W);
        return ((bytes & (FIELD * 0x01010101u)) * M) >> S & ((1u << (4 * W)) - 1);
    }
}

template <int B>
__device__ __forceinline__ void store_codes(int* row, int lane, uint32_t bytes) {
    using P = Planes<B>;
    uint8_t* base = reinterpret_cast<uint8_t*>(row);
    if constexpr (P::p8 >= 0) reinterpret_cast<uint32_t*>(base + 4 * P::p8)[lane] = plane_chunk<8, 0>(bytes);
    if constexpr (P::p4 >= 0) reinterpret_cast<uint16_t*>(base + 4 * P::p4)[lane] = uint16_t(plane_chunk<4, 0>(bytes));
    if constexpr (P::p2 >= 0) base[4 * P::p2 + lane] = uint8_t(plane_chunk<2, (B & ~3)>(bytes));
    if constexpr (P::p1 >= 0) {
        uint32_t nib = plane_chunk<1, (B & ~1)>(bytes);                    // 4 bits
        uint32_t pair = nib | (__shfl_xor_sync(0xffffffffu, nib, 1) << 4);  // with the odd lane's
        if ((lane & 1) == 0) base[4 * P::p1 + (lane >> 1)] = uint8_t(pair);
    }
}

__device__ __forceinline__ void store_pivots(int* row, int lane, const float* x) {
    __half2 lo = __floats2half2_rn(fminf(fmaxf(x[0], -FP16_MAX), FP16_MAX), fminf(fmaxf(x[1], -FP16_MAX), FP16_MAX));
    __half2 hi = __floats2half2_rn(fminf(fmaxf(x[2], -FP16_MAX), FP16_MAX), fminf(fmaxf(x[3], -FP16_MAX), FP16_MAX));
    uint32_t* w = reinterpret_cast<uint32_t*>(row) + 2 * lane;
    w[0] = *reinterpret_cast<uint32_t*>(&lo);
    w[1] = *reinterpret_cast<uint32_t*>(&hi);
}

// The grid constants of a b-bit row: codes are computed as w = MAGIC_ROUND + code (bits(w)'s low bits
// are the code); folded to constants where b is known when compiled
struct Width {
    float round;   // MAGIC_ROUND + 2^(b-1) (2^(b-1): zero(b) on mid-tread, zero(b) + 1/2 on mid-rise)
    float lo, hi;  // the grid's lowest and highest code, plus MAGIC_ROUND
};

constexpr float GRID_LO = MAGIC_ROUND + ((SQ_MIDRISE && SQ_DUAL) ? 0.0f : 1.0f);

__device__ __forceinline__ Width width_of(int b) {
    return {MAGIC_ROUND + float(1 << (b - 1)), GRID_LO, MAGIC_ROUND + float((1 << b) - 1)};
}

// the same from a mixed row's round constant (Shared::rowp[i].w): hi = 2 round - MAGIC_ROUND - 1, exact
__device__ __forceinline__ Width width_from_round(float round) {
    return {round, GRID_LO, __fmaf_rn(2.f, round, -(MAGIC_ROUND + 1.f))};
}

// one code from t = Y / c (the scaled value), as w = MAGIC_ROUND + code; clamped to the grid when CLAMP
// (codec: base.round_to_codes, with exact_sum for the reciprocal quantizer)
template <bool CLAMP>
__device__ __forceinline__ float round_code(float t, const Width& wd) {
    float w;
    if constexpr (SQ_RECIP && SQ_DUAL) {
        // floor / rint of the exact t + 2^(b-1): one add with a directed rounding mode
        w = SQ_MIDRISE ? __fadd_rd(t, wd.round) : __fadd_rn(t, wd.round);
    } else {
        // the FP32 sum first, then floor / rint (torch: floor(t + offset), round(t + zero))
        const float s = __fadd_rn(t, wd.round - MAGIC_ROUND);  // 2^(b-1), exact
        w = (SQ_MIDRISE && SQ_DUAL) ? __fadd_rd(s, MAGIC_ROUND) : __fadd_rn(s, MAGIC_ROUND);
    }
    if constexpr (CLAMP) w = fminf(fmaxf(w, wd.lo), wd.hi);
    return w;
}

__device__ __forceinline__ float level_of(float w, const Width& wd) {  // code - zero(b), exact
    if constexpr (SQ_MIDRISE && SQ_DUAL) return (w - wd.round) + 0.5f;
    else return w - wd.round;
}

// element i of an FP32 or BF16 input (a BF16 value is the high half of its FP32 value)
__device__ __forceinline__ float load_in(const void* base, long long i, bool bf16) {
    if (bf16) return __uint_as_float(uint32_t(static_cast<const uint16_t*>(base)[i]) << 16);
    return static_cast<const float*>(base)[i];
}

// the BF16 bits of a finite x, rounded to nearest even as torch's FP32 -> BF16 conversion
__device__ __forceinline__ uint32_t bf16_bits(float x) {
    const uint32_t u = __float_as_uint(x);
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

__device__ __forceinline__ void store_out(void* base, long long i, float x, bool bf16) {
    if (bf16) {  // NaN stays NaN (quiet)
        const uint32_t r = (x != x) ? (__float_as_uint(x) | 0x00400000u) >> 16 : bf16_bits(x);
        static_cast<uint16_t*>(base)[i] = uint16_t(r);
    } else {
        static_cast<float*>(base)[i] = x;
    }
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
    return x;
}

// ---------------------------------------------------------------- the step of one (request, head)

// an asynchronous copy of BYTES (16: bypassing L1, or 4) from global to shared memory
template <int BYTES>
__device__ __forceinline__ void cp_async(void* smem, const void* gmem) {
    static_assert(BYTES == 16 || BYTES == 4, "cp.async copies 16 or 4 bytes here");
#ifdef SQ_EMULATE
    memcpy(smem, gmem, BYTES);
#else
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    if constexpr (BYTES == 16) asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
    else asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem));
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#ifndef SQ_EMULATE
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}

__device__ __forceinline__ void cp_async_wait() {  // every group this thread committed has landed
#ifndef SQ_EMULATE
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
#endif
}

// Heads of mixed row widths (KDA) branch on each row's width b (warp-uniform) at run time: the planes
// present are b's bits (8, 4, 2, 1, widest first), so their offsets in the row and the code bits of the
// 2- and 1-bit planes are worked out per row, and each value takes one shift and one mask-and-or per
// plane, as in a body compiled for b. (A switch to bodies compiled per width, in each of the 16 unrolled
// rows, made those heads 2.5x slower per value; decoding four rows at a time through a per-lane stash in
// local memory cost ~1.5x; see docs/kernels.md.)

// levels of a mixed-width row of b <= 7 bits (the layout of levels<B>; 8-bit rows take levels<8>): each
// plane present (4, 2, 1 bits, widest first) is spread so that value c's bits land in byte c (two
// shift-and-mask steps per plane and row), the planes are ORed at the code bits they hold, and each value
// is then one byte permute into the FP32 bits 0x4A800000 | (code << 1) (that float is 2^22 + code) and
// one subtraction: per value 2 instructions plus ~1/4 of the row's ~15, against one shift and one
// mask-and-or per plane and value when the planes are merged value by value.
__device__ __forceinline__ void levels_any(const int* row, int b, int lane, float* z, float off) {
    const uint8_t* base = reinterpret_cast<const uint8_t*>(row);
    uint32_t bytes = 0;
    int words = 0;  // the planes before this one
    if (b & 4) {  // code bits 0..3: nibble c of the chunk -> byte c
        uint32_t c4 = reinterpret_cast<const uint16_t*>(base)[lane];
        c4 = (c4 | (c4 << 8)) & 0x00FF00FFu;
        bytes = (c4 | (c4 << 4)) & 0x0F0F0F0Fu;
        words = 16;
    }
    if (b & 2) {  // code bits (b & 4).. : field c (bits 2c, 2c + 1) of the chunk -> byte c
        uint32_t c2 = base[4 * words + lane];
        c2 = (c2 | (c2 << 12)) & 0x000F000Fu;
        bytes |= ((c2 | (c2 << 6)) & 0x03030303u) << (b & 4);
        words += 8;
    }
    if (b & 1) {  // code bit (b & 6): bit c of the lane's nibble -> byte c
        uint32_t c1 = (uint32_t(base[4 * words + (lane >> 1)]) >> ((lane & 1) * 4)) & 0xFu;
        c1 = (c1 | (c1 << 14)) & 0x00030003u;
        bytes |= ((c1 | (c1 << 7)) & 0x01010101u) << (b & 6);
    }
    bytes <<= 1;  // 2 * code per byte (b <= 7 bits: no carry out of a byte)
    z[0] = __uint_as_float(__byte_perm(bytes, 0x4A800000u, 0x7640)) - off;
    z[1] = __uint_as_float(__byte_perm(bytes, 0x4A800000u, 0x7641)) - off;
    z[2] = __uint_as_float(__byte_perm(bytes, 0x4A800000u, 0x7642)) - off;
    z[3] = __uint_as_float(__byte_perm(bytes, 0x4A800000u, 0x7643)) - off;
}

// store the codes (a byte each) of a mixed-width row of b <= 8 bits (the layout of store_codes<B>). The
// planes' byte offsets follow from b directly (the 2-bit plane after a 4-bit one, the 1-bit plane after
// both), every chunk is computed and only the stores depend on b: no branch per plane (each cost a
// convergence barrier and a 64-bit address of its own)
__device__ __forceinline__ void store_codes_any(int* row, int b, int lane, uint32_t bytes) {
    uint8_t* base = reinterpret_cast<uint8_t*>(row);
    if (b == 8) {
        reinterpret_cast<uint32_t*>(base)[lane] = bytes;
        return;
    }
    const int o2 = b & ~3, o1 = b & ~1;  // the code bits the 2- and 1-bit planes hold start here
    const uint32_t c4 = plane_chunk<4, 0>(bytes);
    const uint32_t c2 = ((bytes & (0x03030303u << o2)) * 0x41041u) >> (o2 + 18);     // plane_chunk<2, o2>
    const uint32_t c1 = (((bytes & (0x01010101u << o1)) * 0x204081u) >> (o1 + 21)) & 0xFu;  // <1, o1>
    const uint32_t pair = c1 | (__shfl_xor_sync(0xffffffffu, c1, 1) << 4);  // with the odd lane's
    if (b & 4) reinterpret_cast<uint16_t*>(base)[lane] = uint16_t(c4);
    if (b & 2) base[((b & 4) << 4) + lane] = uint8_t(c2);
    if ((b & 1) && (lane & 1) == 0) base[((b & 6) << 4) + (lane >> 1)] = uint8_t(pair);
}

// ---------------------------------------------------------------- readout on tensor cores (SQ_MMA)
// The readout part's sums k^T D S and q^T D S of a head of one width b <= 7, per warp (its 16 key rows) as
// mma.m16n8k16 D = A B + C with BF16 inputs and FP32 sums: A is the levels transposed (16 value columns x the
// 16 rows), B holds the rows' a k and a q, each split into a BF16 high part and the BF16 rounding of the rest
// (B's columns 0..3: hi(a k), hi(a q), lo(a k), lo(a q); 4..7 the same), so a term keeps ~16 of FP32's 24 bits
// (relative error ~2^-17) over FP32's range. Lane (g, t) = (lane / 4, lane % 4) decodes rows 2t, 2t + 1, 2t
// + 8, 2t + 9 of the warp at value columns [16g, 16g + 16); MMA n takes columns 16g + 2n (A's row g) and
// 16g + 2n + 1 (row g + 8), so a lane's outputs are its own columns (lanes t = 0 the high sums, t = 1 the low).
// A level is exact in BF16: bits 0x4300 | code are 128 + code (b <= 7: code < 128), less 128 + 2^(b-1)
// (mid-rise: below). Per value: one shift and one mask-and-or per plane for a pair of values, one BF16
// subtraction per pair, 1/8 MMA; against one shift and mask-and-or per plane, a subtraction and two FMAs per
// value on the FP32 path.

// Mid-rise levels z = code - 2^(b-1) + 1/2 of b <= 6 bits enter as 2z = 2 code + 1 - 2^b (odd integers
// below 2^b in magnitude: exact), the code one bit up with bit 0 set, and the sums are halved; at b = 7
// (2 code + 1 would need a ninth bit) as code - 2^(b-1), the + 1/2 added as 1/2 sum_i a_i k_i (one warp sum
// per row warp in step 0). Mid-tread levels code - 2^(b-1) are integers.
template <int B> constexpr bool DOUBLED_LEVELS = SQ_MIDRISE && B <= 6;
template <int B> constexpr bool HALF_SUMS = SQ_MIDRISE && B == 7;

// both halves of a pair of BF16 128 + code (or 128 + 2 code + 1) less 128 + 2^(b-1) (or 128 + 2^b): exact
template <int B>
__device__ __forceinline__ uint32_t bf16_levels(uint32_t pair) {
    constexpr uint32_t NEG = 0xC300u | (1u << (DOUBLED_LEVELS<B> ? B : B - 1));  // -(128 + that) in BF16
#ifdef SQ_EMULATE
    auto one = [](uint32_t h) { return bf16_bits(__uint_as_float(h << 16) + __uint_as_float(NEG << 16)); };
    return one(pair & 0xFFFFu) | (one(pair >> 16) << 16);
#else
    uint32_t out;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(out) : "r"(pair), "r"(0x3F803F80u), "r"(NEG * 0x10001u));
    return out;
#endif
}

#ifndef SQ_EMULATE
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                               const float (&c)[4]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %11, %12, %13};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
}
#endif

// the lane's plane chunks (value columns [16g, 16g + 16)) of two rows, paired per 16-bit group: a group's
// bits of the first row in the low half, of the second in the high half (4-bit plane: 4 groups of 4
// columns, 2-bit: 2 of 8, 1-bit: 1 of 16)
struct PairChunks { uint32_t p4[4], p2[2], p1; };

template <int B>
__device__ __forceinline__ PairChunks load_pair_chunks(const int* row_a, const int* row_b, int g) {
    using P = Planes<B>;
    PairChunks c{};
    if constexpr (P::p4 >= 0) {
        const uint2 a = reinterpret_cast<const uint2*>(row_a + P::p4)[g];
        const uint2 b = reinterpret_cast<const uint2*>(row_b + P::p4)[g];
        c.p4[0] = __byte_perm(a.x, b.x, 0x5410);
        c.p4[1] = __byte_perm(a.x, b.x, 0x7632);
        c.p4[2] = __byte_perm(a.y, b.y, 0x5410);
        c.p4[3] = __byte_perm(a.y, b.y, 0x7632);
    }
    if constexpr (P::p2 >= 0) {
        const uint32_t a = uint32_t(row_a[P::p2 + g]), b = uint32_t(row_b[P::p2 + g]);
        c.p2[0] = __byte_perm(a, b, 0x5410);
        c.p2[1] = __byte_perm(a, b, 0x7632);
    }
    if constexpr (P::p1 >= 0) {
        c.p1 = uint32_t(reinterpret_cast<const uint16_t*>(row_a + P::p1)[g]) |
               (uint32_t(reinterpret_cast<const uint16_t*>(row_b + P::p1)[g]) << 16);
    }
    return c;
}

// the levels of column J (of the lane's 16) of both rows, as a BF16 pair: each plane's field moved to the
// code bits it holds in both halves at once
template <int B, int J>
__device__ __forceinline__ uint32_t level_pair(const PairChunks& c) {
    using P = Planes<B>;
    constexpr int S = DOUBLED_LEVELS<B> ? 1 : 0;  // the code's first bit
    uint32_t u = S ? 0x43014301u : 0x43004300u;
    if constexpr (P::p4 >= 0) u = and_or<(0xFu << S) * 0x10001u>(shift_right<4 * (J % 4) - S>(c.p4[J / 4]), u);
    if constexpr (P::p2 >= 0) {
        constexpr int O = (B & ~3) + S;  // where the 2-bit plane's code bits go
        u = and_or<(0x3u << O) * 0x10001u>(shift_right<2 * (J % 8) - O>(c.p2[J / 8]), u);
    }
    if constexpr (P::p1 >= 0) {
        constexpr int O = (B & ~1) + S;
        u = and_or<(0x1u << O) * 0x10001u>(shift_right<J - O>(c.p1), u);
    }
    return bf16_levels<B>(u);
}

// the warp's readout partials on tensor cores, stored to part[p][V][2] (p: 0 the high parts, 1 the low; each
// column's k sum, then its q sum; part + p * stride): codes of row i at words[i * 4 B], rows[i] = (a k, a q, ..)
template <int B>
__device__ __forceinline__ void mma_readout(const float4* rows, const int* words, int row0, int lane, float* part,
                                            int stride) {
    const int g = lane >> 2, t = lane & 3;
    const int ra = row0 + 2 * t, rb = ra + 8;  // the lane's rows: ra, ra + 1, rb, rb + 1
    auto b_half = [&](int i) {  // B[row i][column g]: hi(a k), hi(a q), lo(a k), lo(a q), and again for g >= 4
        const float4 rc = rows[i];
        const float x = (g & 1) ? rc.y : rc.x;
        const uint32_t hi = bf16_bits(x);
        return (g & 2) ? bf16_bits(x - __uint_as_float(hi << 16)) : hi;
    };
    const uint32_t b[2] = {b_half(ra) | (b_half(ra + 1) << 16), b_half(rb) | (b_half(rb + 1) << 16)};
    const PairChunks ca = load_pair_chunks<B>(words + ra * 4 * B, words + (ra + 1) * 4 * B, g);
    const PairChunks cb = load_pair_chunks<B>(words + rb * 4 * B, words + (rb + 1) * 4 * B, g);
    const float zero[4] = {0.f, 0.f, 0.f, 0.f};
    // lanes t = 0 hold B's columns 0, 1 (the high parts), t = 1 columns 2, 3 (the low), t = 2, 3 the same again
    // (columns 4..7 repeat 0..3): d = (k, q) of the MMA's first column, then of its second, stored as they are;
    // lanes t and t + 2 store the same values to the same address (an unconditional store: behind a branch the
    // compiler recomputed the address in each of the eight; the emulation's threads store once)
    float4* out = reinterpret_cast<float4*>(part + (t & 1) * stride + 32 * g);
    const bool stores = !EMULATED || t < 2;
    auto two_columns = [&]<int N>() {  // columns 16g + 2N, 16g + 2N + 1
        float d[4];
        const uint32_t a[4] = {level_pair<B, 2 * N>(ca), level_pair<B, 2 * N + 1>(ca), level_pair<B, 2 * N>(cb),
                               level_pair<B, 2 * N + 1>(cb)};
        mma_bf16_16816(d, a, b, zero);
        if (stores) out[N] = make_float4(d[0], d[1], d[2], d[3]);
    };
    two_columns.template operator()<0>();
    two_columns.template operator()<1>();
    two_columns.template operator()<2>();
    two_columns.template operator()<3>();
    two_columns.template operator()<4>();
    two_columns.template operator()<5>();
    two_columns.template operator()<6>();
    two_columns.template operator()<7>();
}

// One step of the row fill's transposed butterfly: a lane holds partial maxima of 2N rows, keeps rows
// [0, N) or [N, 2N) (bit M of its lane) and sends the others to lane ^ M, so each row's partial covers
// twice the lanes; N a constant at every level, so the rows stay in registers.
template <int N, int M>
__device__ __forceinline__ void fold_row_maxima(float (&part)[ROWS], int lane) {
    if constexpr (N >= 1) {
        const bool upper = lane & M;
#pragma unroll
        for (int j = 0; j < N; ++j) {
            const float send = upper ? part[j] : part[j + N];
            const float keep = upper ? part[j + N] : part[j];
            part[j] = fmaxf(keep, __shfl_xor_sync(0xffffffffu, send, M));
        }
        fold_row_maxima<N / 2, M / 2>(part, lane);
    }
}

// X = D S + k u^T of one row of the tile, in place (levels in: a = r_old e^g, pivot rows' a = e^g)
__device__ __forceinline__ void form_x(const Shared& sm, float (&x)[COLS], bool pivot, const float (&c_old)[COLS],
                                       const float (&u)[COLS], int i) {
    const float4 rc = sm.row[i];
#pragma unroll
    for (int c = 0; c < COLS; ++c) {
        const float ac = pivot ? rc.z : __fmul_rn(rc.z, c_old[c]);
        x[c] = __fmaf_rn(x[c], ac, __fmul_rn(rc.w, u[c]));
    }
}

// Steps 3-5 on the tile x (levels or float state in, nothing out): X, row scales, column scales, codes.
template <int KIND>
__device__ __forceinline__ void requantize(const Params& p, Shared& sm, float (&x)[ROWS][COLS],
                                           const bool (&row_pivot)[ROWS], const float (&c_old)[COLS],
                                           float fk, long long nh, int* slot_codes, long long rs_base,
                                           long long cs_base, bool has_scales, int4 head, float* scratch,
                                           const __half* pend_k, const __half* pend_u) {
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int K = p.K;
    const int row0 = warp * ROWS;
    auto row_offset = [&](int i) { return KIND ? i * 4 * KIND : (sm.rinfo[i] >> 5) - head.z; };
    int* head_codes = slot_codes + head.z;

    // ---- 3. X = D S + k u^T (in place), row statistic -> new row scales
    // (the barrier before this step ended every read of the stage and of the readout partials)
    {
        const float4 u4 = *reinterpret_cast<const float4*>(&sm.col[1][4 * lane]);
        const float u[COLS] = {fk * u4.x, fk * u4.y, fk * u4.z, fk * u4.w};  // k is stored before its norm
        float* mine = scratch + (warp * 32 + lane) * ROW_PAD;  // this lane's partial statistic per row
        if constexpr (SQ_PENDING) {  // a deferred state's fit: X, then X += sum_j k_j u_j^T in order j
#pragma unroll
            for (int r = 0; r < ROWS; ++r) form_x(sm, x[r], row_pivot[r], c_old, u, row0 + r);
            if (row0 < K) {
                for (int j = 0; j < p.pend_n; ++j) {
                    // FP16 pairs read as __half2 from memory (no type punning of registers: the emulation
                    // build's C++ would not see through it)
                    const __half2* u2 = reinterpret_cast<const __half2*>(pend_u + j * V + 4 * lane);
                    const float2 lo = __half22float2(u2[0]), hi = __half22float2(u2[1]);
                    float uj[COLS] = {lo.x, lo.y, hi.x, hi.y};
#pragma unroll
                    for (int c = 0; c < COLS; ++c)  // GDN: decayed by this token's gate (1 in the writeback part)
                        if (!SQ_KDA) uj[c] = __half2float(__float2half_rn(uj[c] * sm.pend_decay));
                    const __half2* k2 = reinterpret_cast<const __half2*>(pend_k + j * K + row0);  // ROWS halves
#pragma unroll
                    for (int m = 0; m < ROWS / 2; ++m) {
                        const float2 kk = __half22float2(k2[m]);
#pragma unroll
                        for (int c = 0; c < COLS; ++c) {
                            x[2 * m][c] = __fmaf_rn(kk.x, uj[c], x[2 * m][c]);
                            x[2 * m + 1][c] = __fmaf_rn(kk.y, uj[c], x[2 * m + 1][c]);
                        }
                    }
                }
            }
        }
#pragma unroll
        for (int r0 = 0; r0 < ROWS; r0 += 4) {
            float stat[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int r = r0; r < r0 + 4; ++r) {
                const int i = row0 + r;
                if constexpr (FROM_CODES && !SQ_PENDING) form_x(sm, x[r], row_pivot[r], c_old, u, i);
                if (SQ_DEBUG && row0 < K)
                    *reinterpret_cast<float4*>(p.dbg_x + ((nh * K + i) * V + 4 * lane)) =
                        make_float4(x[r][0], x[r][1], x[r][2], x[r][3]);
#pragma unroll
                for (int c = 0; c < COLS; ++c) {
                    if (SQ_ROW_SUM && SQ_ROW_STAT == 1) stat[r - r0] = __fmaf_rn(x[r][c], x[r][c], stat[r - r0]);
                    else if (SQ_ROW_SUM) stat[r - r0] = __fadd_rn(stat[r - r0], fabsf(x[r][c]));
                    else stat[r - r0] = fmaxf(stat[r - r0], fabsf(x[r][c]));
                }
            }
            *reinterpret_cast<float4*>(mine + r0) = make_float4(stat[0], stat[1], stat[2], stat[3]);
        }
        __syncwarp();
        // lanes LANES_PER_ROW rho + part (part < LANES_PER_ROW) reduce row rho of the warp
        const int rho = lane / LANES_PER_ROW, part = lane % LANES_PER_ROW;
        const float* theirs = scratch + (warp * 32 + part * (32 / LANES_PER_ROW)) * ROW_PAD + rho;
        float s = 0.f;
#pragma unroll
        for (int l = 0; l < 32 / LANES_PER_ROW; ++l) {
            const float t = theirs[l * ROW_PAD];
            s = SQ_ROW_SUM ? s + t : fmaxf(s, t);
        }
#pragma unroll
        for (int m = 1; m < LANES_PER_ROW; m <<= 1) {
            const float o = __shfl_xor_sync(0xffffffffu, s, m);
            s = SQ_ROW_SUM ? s + o : fmaxf(s, o);
        }
        const int i = row0 + rho;
        if (part == 0 && row0 < K) {
            const int b = KIND ? KIND : (sm.rinfo[i] & 31);
            const float4 rp = sm.rowp[i];
            float r_new = 1.f;  // pivot rows: 1 (unused, as the codec writes)
            if (b <= 8) {
                if constexpr (SQ_DUAL) {
                    const float m = SQ_ROW_STAT == 1 ? __fsqrt_rn(s * (1.f / V))
                                    : SQ_ROW_STAT == 2 ? s * (1.f / V) : s;
                    r_new = fp16_scale(__fmul_rn(__fsqrt_rn(m), rp.x));
                } else {
                    r_new = fp16_scale(__fdiv_rn(s, float((1 << (b - 1)) - 1)));
                }
            }
            if (has_scales && !SQ_ROW_FILL) p.row_scale[rs_base + i] = __float2half_rn(r_new);
            if (SQ_DEBUG && SQ_ROW_FILL) p.dbg_r[nh * K + i] = r_new;
            // with the row fill, rowq.y keeps r itself until step 4b replaces both fields
            const float w2r2 = SQ_ROW_FILL ? r_new : __fmul_rn(__fmul_rn(rp.y, r_new), r_new);
            sm.rowq[i] = make_float2((SQ_RECIP && SQ_DUAL) ? __frcp_rn(r_new) : r_new, w2r2);
        }
        __syncwarp();
    }

    // ---- 4. Y = X / r (dual-axis), column maxima -> column scales of the first codes
    float cc[COLS] = {1.f, 1.f, 1.f, 1.f}, rcc[COLS] = {1.f, 1.f, 1.f, 1.f};
    bool saturated = false;  // a column maximum above FP16's 65504: its scale saturates, codes need the clamp
    auto load_cols = [&]() {
        const float4 c4 = *reinterpret_cast<const float4*>(&sm.col[2][4 * lane]);
        const float4 r4 = *reinterpret_cast<const float4*>(&sm.col[3][4 * lane]);
        cc[0] = c4.x; cc[1] = c4.y; cc[2] = c4.z; cc[3] = c4.w;
        rcc[0] = r4.x; rcc[1] = r4.y; rcc[2] = r4.z; rcc[3] = r4.w;
    };
    if constexpr (SQ_DUAL) {
        float colmax[COLS] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            if (row_pivot[r]) continue;
            const float rq = sm.rowq[row0 + r].x;
            const float gain = KIND ? 1.f : sm.rowp[row0 + r].z;
#pragma unroll
            for (int c = 0; c < COLS; ++c) {
                x[r][c] = SQ_RECIP ? __fmul_rn(x[r][c], rq) : div_fp16(x[r][c], rq, __fdividef(1.f, rq));
                colmax[c] = KIND ? fmaxf(colmax[c], fabsf(x[r][c])) : fmaxf(colmax[c], __fmul_rn(fabsf(x[r][c]), gain));
            }
        }
        float* part = scratch + COLMAX_AT;  // apart from the row partials other warps may still read
        *reinterpret_cast<float4*>(&part[warp * V + 4 * lane]) = make_float4(colmax[0], colmax[1], colmax[2], colmax[3]);
        __syncthreads();
        bool over = false;
        if (column_thread(tid)) {
            const int j = tid - MAX_K;
            float m = 0.f;
#pragma unroll
            for (int w = 0; w < NUM_WARPS; ++w) m = fmaxf(m, part[w * V + j]);
            // one width per head: max(|Y| gain) = max(|Y|) gain (gain > 0 and rounding is monotone)
            if constexpr (KIND) m = __fmul_rn(m, sm.rowp[0].z);
            const float c0 = fp16_scale(m);
            over = m > FP16_MAX;
            sm.col[2][j] = c0;
            sm.col[3][j] = SQ_RECIP ? __frcp_rn(c0) : __fdividef(1.f, c0);
        }
        saturated = __syncthreads_or(over);
        load_cols();
    }

    // ---- 4b. row fill: u_i = max_j |Y_ij / c_j| gain_b(i), r_i <- fp16(r_i u_i), Y_i <- Y_i fl(r_i / r_i')
    // (the factor is applied in the first code pass). The row maxima stay in the warp: a transposed
    // butterfly halves the rows a lane holds at each of the first log2(ROWS) shuffles, so lane l ends with
    // row (l / LANES_PER_ROW) of the warp, and the last shuffles finish it across LANES_PER_ROW lanes.
    if constexpr (SQ_ROW_FILL) {
        float part[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            part[r] = 0.f;
            if (!row_pivot[r]) {
#pragma unroll
                for (int c = 0; c < COLS; ++c) part[r] = fmaxf(part[r], fabsf(__fmul_rn(x[r][c], rcc[c])));
            }
        }
        fold_row_maxima<ROWS / 2, 16>(part, lane);
#pragma unroll
        for (int m = 1; m < LANES_PER_ROW; m <<= 1) part[0] = fmaxf(part[0], __shfl_xor_sync(0xffffffffu, part[0], m));
        const int i = row0 + lane / LANES_PER_ROW;
        if (lane % LANES_PER_ROW == 0 && row0 < K) {
            const int b = KIND ? KIND : (sm.rinfo[i] & 31);
            float fill = 1.f;  // pivot rows: factor and scale 1
            float r_new = 1.f;
            if (b <= 8) {
                const float r_old = sm.rowq[i].y;
                const float gain = KIND ? sm.rowp[0].z : sm.rowp[i].z;
                r_new = fp16_scale(__fmul_rn(r_old, __fmul_rn(part[0], gain)));
                fill = __fmul_rn(r_old, __frcp_rn(r_new));
            }
            if (has_scales) p.row_scale[rs_base + i] = __float2half_rn(r_new);
            sm.rowq[i] = make_float2(fill, __fmul_rn(__fmul_rn(sm.rowp[i].y, r_new), r_new));
        }
        __syncwarp();
    }

    // ---- 5. codes against the current column scales; refits; the last pass packs in place
    constexpr bool REFIT = SQ_DUAL && SQ_REFITS > 0;
    // one pass over the tile: codes (clamped to the grid unless they provably stay on it), refit sums,
    // and in the last pass the packed words. The first codes of a head of one width b whose clip_b is 1
    // stay on the grid: |Y_ij| gain <= c_j (1 + 2^-11) (c_j is max_i |Y_ij| gain rounded to nearest FP16), so
    // |t| <= qmax_b + 2^-11 qmax_b < qmax_b + 1/2, unless a column's maximum passed 65504 and its scale
    // saturated there (SATURATED: an |X| of ~1e11 and more): then they are clamped as every other code.
    // With the row fill the bound holds too: u_i is taken against the rounded c, and r'_i = fp16(r_i u_i)
    // is below r_i u_i by at most 2^-11 relative (or clamped up at 2^-14; clamped down at 65504 it is
    // still within 2^-11 of r_i u_i when u_i <= 1 + 2^-11), so |t'| <= qmax_b (1 + 2^-10) < qmax_b + 1/2.
    constexpr bool MAY_SKIP_CLAMP = KIND && SQ_DUAL && !((SQ_CLIPPED >> KIND) & 1);  // first codes unclamped
    auto code_pass = [&]<bool FIRST, bool LAST, bool SATURATED>() {
        float num[COLS] = {0.f, 0.f, 0.f, 0.f}, den[COLS] = {0.f, 0.f, 0.f, 0.f};
        // a warp past K skips the pass (its rows' refit weights are 0: their sums would add zeros), so the
        // rows' stores below are unconditional and the compiler may interleave rows (a branch per row
        // around each row's block kept them apart)
#pragma unroll
        for (int r = 0; r < (row0 < K ? ROWS : 0); ++r) {
            const int i = row0 + r;
            if (row_pivot[r]) {
                if (LAST) store_pivots(head_codes + row_offset(i), lane, x[r]);
            } else {
                const float2 rq = sm.rowq[i];
                // heads of one width: its grid constants are known when compiled, and the first codes of a
                // width whose clip_b is 1 cannot leave the grid (above); mixed rows clamp always
                const Width wd = KIND ? width_of(KIND) : width_from_round(sm.rowp[i].w);
                constexpr bool CLAMP = SATURATED || !(FIRST && MAY_SKIP_CLAMP);
                uint32_t code[COLS];
#pragma unroll
                for (int c = 0; c < COLS; ++c) {
                    if (SQ_ROW_FILL && FIRST) x[r][c] = __fmul_rn(x[r][c], rq.x);  // step 4b's factor
                    float t;
                    if constexpr (!SQ_DUAL) t = div_fp16(x[r][c], rq.x, __fdividef(1.f, rq.x));
                    else if constexpr (SQ_RECIP) t = __fmul_rn(x[r][c], rcc[c]);
                    else t = div_fp16(x[r][c], cc[c], rcc[c]);
                    const float w = round_code<CLAMP>(t, wd);
                    code[c] = __float_as_uint(w);
                    if constexpr (REFIT) {
                        const float z = level_of(w, wd);
                        const float wz = __fmul_rn(rq.y, z);
                        num[c] = __fmaf_rn(wz, x[r][c], num[c]);  // (w^2 r^2 z) Y
                        den[c] = __fmaf_rn(wz, z, den[c]);
                    }
                }
                if (LAST) {
                    if constexpr (KIND) store_codes<KIND>(head_codes + row_offset(i), lane, code_bytes(code));
                    else store_codes_any(head_codes + row_offset(i), sm.rinfo[i] & 31, lane, code_bytes(code));
                }
            }
        }
        if (SQ_DEBUG && LAST && column_thread(tid)) p.dbg_c[nh * V + tid - MAX_K] = SQ_DUAL ? sm.col[2][tid - MAX_K] : 1.f;
        if constexpr (REFIT) {
            // refit c = sum (w^2 r^2 z) Y / sum (w^2 r^2 z) z over the head's rows (8 warps -> smem); the
            // buffer's row partials were read before the column maxima's barrier, and it lies apart from them
            float* part = scratch;
            *reinterpret_cast<float4*>(&part[warp * V + 4 * lane]) = make_float4(num[0], num[1], num[2], num[3]);
            *reinterpret_cast<float4*>(&part[(NUM_WARPS + warp) * V + 4 * lane]) = make_float4(den[0], den[1], den[2], den[3]);
            __syncthreads();
            if (column_thread(tid)) {
                const int j = tid - MAX_K;
                float sn = 0.f, sd = 0.f;
#pragma unroll
                for (int w = 0; w < NUM_WARPS; ++w) { sn += part[w * V + j]; sd += part[(NUM_WARPS + w) * V + j]; }
                const float c_fit = sd > 0.f ? fp16_scale(__fdiv_rn(sn, sd)) : sm.col[2][j];
                if (LAST) {
                    sm.col[0][j] = c_fit;  // stored below; col[2] keeps the scales the codes were computed against
                } else {
                    sm.col[2][j] = c_fit;
                    sm.col[3][j] = SQ_RECIP ? __frcp_rn(c_fit) : __fdividef(1.f, c_fit);
                }
            }
            __syncthreads();
            if (!LAST) load_cols();
        }
    };
    constexpr bool ONE_PASS = SQ_REFITS <= 1 || !SQ_DUAL;
    if (MAY_SKIP_CLAMP && saturated) {
        code_pass.template operator()<true, ONE_PASS, true>();
    } else {
        code_pass.template operator()<true, ONE_PASS, false>();
    }
    if constexpr (!ONE_PASS) {
#pragma unroll 1
        for (int pass = 1; pass < SQ_REFITS - 1; ++pass) code_pass.template operator()<false, false, false>();
        code_pass.template operator()<false, true, false>();
    }
    // ---- the new column scales: the refitted ones, or the init without refits
    if (SQ_DUAL && has_scales && column_thread(tid)) {
        const int j = tid - MAX_K;
        p.col_scale[cs_base + j] = __float2half_rn(REFIT ? sm.col[0][j] : sm.col[2][j]);
    }
}

// The plan's entries of key row i of head h (the same for every batch row): (first word << 5 | bits) and
// Shared::rowp's (row factor, refit weight, gain, Width::round); rows past K get neutral entries (refit
// weight 0 keeps them out of the fit, a valid width keeps their unused levels finite)
struct RowEntry { int info; float4 rowp; };

template <int KIND>
__device__ __forceinline__ RowEntry row_entry(const Params& p, int h, int i, int4 head) {
    int info = (head.z << 5) | (KIND ? KIND : 2);
    float winv = 1.f, w2 = 0.f, gain = 0.f;
    if (i < p.K) {
        info = p.row_info[h * p.K + i];
        winv = p.row_winv[h * p.K + i];
        w2 = p.row_w2[h * p.K + i];
        gain = p.row_gain[h * p.K + i];
    }
    const int b = info & 31;
    return {info, make_float4(winv, w2, gain, MAGIC_ROUND + float(1 << ((b <= 8 ? b : 2) - 1)))};
}

// the 4-byte word that holds a BF16 or FP32 scalar (cp.async copies aligned words), and its index there
__device__ __forceinline__ const void* word_of(const void* base, long long i, bool bf16) {
    const uintptr_t at = reinterpret_cast<uintptr_t>(base) + uintptr_t(i) * (bf16 ? 2 : 4);
    return reinterpret_cast<const void*>(at & ~uintptr_t(3));
}
__device__ __forceinline__ int index_in_word(long long i, bool bf16) { return bf16 ? int(i & 1) : 0; }

// STAGED: cp.async copies of batch row n's inputs into a staging buffer (the caller commits the group).
// Threads 0..255 copy the code words; then warp 0 k, warp 1 q, warp 2 the KDA gates, warp 3 v (or u),
// warp 4 the old row (lanes 0..15) and column scales (lanes 16..31), warp 5 the words of beta and of a GDN
// gate: one 16-byte chunk per lane (inputs are 16-byte aligned: cuda.launch copies any that is not).
__device__ void stage_row(const Params& p, Staged& in, int n, int h, long long slot, int4 head) {
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int K = p.K;
    const long long nh = (long long)n * p.H + h;
    const long long nq = (long long)n * p.HQ + int((uint64_t(h) * p.group_magic) >> 32), qk = nq * K;
    const uint4* src = reinterpret_cast<const uint4*>(p.codes + slot * p.slot_words + head.z);
#pragma unroll 1
    for (int e = tid; e < head.w / 4; e += THREADS) cp_async<16>(in.codes + e, src + e);
    // elements first.. of base, count of them, element size 2 (bf16) or 4: lane's chunk of 16 bytes
    auto chunk = [&](uint4* dst, const void* base, long long first, int count, bool bf16, int c) {
        const int size = bf16 ? 2 : 4;
        if (16 * c < count * size)
            cp_async<16>(dst + c, static_cast<const char*>(base) + first * size + 16 * c);
    };
    const bool has_scales = head.y >= 0;
    const long long scales = slot * p.num_scaled + head.y;
    if (warp == 0) chunk(in.k, p.k, qk, K, p.bf16_mask & 2, lane);
    else if (warp == 1) chunk(in.q, p.q, qk, K, p.bf16_mask & 1, lane);
    else if (warp == 2 && SQ_KDA) chunk(in.g, p.g, nh * K, K, p.bf16_mask & 8, lane);
    else if (warp == 3) {
        if (DO_READOUT) chunk(in.v, p.v, nh * V, V, p.bf16_mask & 4, lane);
        else chunk(in.v, p.work, nh * V, V, false, lane);
    } else if (warp == 4 && has_scales) {
        if (lane < 16) chunk(in.rs, p.row_scale, scales * K, K, true, lane);
        else if (SQ_DUAL) chunk(in.cs, p.col_scale, scales * V, V, true, lane - 16);
    } else if (warp == 5) {
        if (lane == 0 && DO_READOUT) cp_async<4>(&in.beta_word, word_of(p.beta, nh, p.bf16_mask & 16));
        if (lane == 1 && !SQ_KDA) cp_async<4>(&in.g_word, word_of(p.g, nh, p.bf16_mask & 8));
    } else if (SQ_PENDING && (warp == 6 || warp == 7)) {  // the held updates: warp 6 the k_j, warp 7 the u_j
        const int width = warp == 6 ? K : V;
        const __half* src = warp == 6 ? p.pend_k + (SQ_KDA ? nh : nq) * p.pend_stride * K
                                      : p.pend_u + nh * p.pend_stride * V;
        uint4* dst = warp == 6 ? in.pend_k : in.pend_u;
#pragma unroll 1
        for (int c = lane; c < p.pend_n * width / 8; c += 32) cp_async<16>(dst + c, src + 8 * c);
        if (warp == 7 && p.pend_gate) {  // and the log decay summed since the fit
            if (SQ_KDA) chunk(in.gate, p.pend_gate, nh * K, K, false, lane);
            else if (lane == 0) cp_async<4>(&in.gate_word, p.pend_gate + nh);
        }
    }
}

template <int KIND>  // 2..8: every row of the head has KIND bits; 0: per-row widths (and FP16 pivot rows)
__device__ void head_step(const Params& p, Shared& sm, int n, int h, long long slot, int4 head,
                          Staged* in, uint4* stage, float* scratch, __half* pend_copy) {
    // in: STAGED, batch row n's copied inputs (stage_row; the row tables are in sm already), else null;
    // stage: where the head's code words are staged (in->codes, or Shared::stage); scratch: steps 3-5's
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int K = p.K;
    const int hs = head.y;  // scale slot, -1: the head has no scales (a GDN pivot head)
    const bool has_scales = hs >= 0;
    const int hq = int((uint64_t(h) * p.group_magic) >> 32);  // h / (H / HQ) without a division
    int* slot_codes = p.codes + slot * p.slot_words;
    const long long rs_base = (slot * p.num_scaled + hs) * (long long)K;
    const long long cs_base = (slot * p.num_scaled + hs) * (long long)V;
    const long long nh = (long long)n * p.H + h;
    const int row0 = warp * ROWS;  // this warp's first key row
    // where row i starts, in words from the head's first word (heads of one width: a fixed stride)
    auto row_offset = [&](int i) { return KIND ? i * 4 * KIND : (sm.rinfo[i] >> 5) - head.z; };
    constexpr bool MMA = SQ_MMA && KIND >= 2 && KIND <= 7;  // step 1's sums on tensor cores (mma_readout)
    // SQ_PENDING: the held updates of (n, h), [pend_n][K] k_e and [pend_n][V] u_e, read from shared memory
    // (STAGED: stage_row's copy; else pend_copy, copied beside the code words in step 0), stored back (the
    // readout: decayed, and this token's appended) to global memory
    __half* pend_k = nullptr;  // the shared copies
    __half* pend_u = nullptr;
    __half* pend_k_out = nullptr;  // (n, h)'s entries in global memory (GDN's k_e: its q/k head's)
    __half* pend_u_out = nullptr;
    if constexpr (SQ_PENDING) {
        pend_k_out = p.pend_k + (SQ_KDA ? nh : (long long)n * p.HQ + hq) * p.pend_stride * K;
        pend_u_out = p.pend_u + nh * p.pend_stride * V;
        pend_k = STAGED ? reinterpret_cast<__half*>(in->pend_k) : pend_copy;
        pend_u = STAGED ? reinterpret_cast<__half*>(in->pend_u) : pend_copy + p.pend_n * K;
    }

    // ---- 0. every global input of the step is loaded here, before the first barrier, so that the CTA
    // waits on global memory once (STAGED: on none; the inputs were copied while the previous row computed).
    // First what does not depend on the slot id (in flight while it arrives): per key row (threads 0..127)
    // k, q, the gate and the row's table entries; per value column (threads 128..255) v and beta (or u of
    // the split). Rows past K are neutral: a = k = q = 0 makes their X zero (and row_entry's); nothing of
    // theirs is stored.
    float k_i = 0.f, q_i = 0.f, eg = 1.f, r_old = 1.f;  // row threads
    float g_tok = 0.f;  // SQ_PENDING with pend_gate: this token's log decay (eg: the sum since the fit)
    RowEntry entry{};
    float v_j = 0.f, beta = 0.f;  // column threads (v_j: u in the split writeback)
    if (tid < MAX_K) {
        const int i = tid;
        if constexpr (!STAGED) entry = row_entry<KIND>(p, h, i, head);
        if (i < K) {
            if constexpr (STAGED) {
                k_i = load_in(in->k, i, p.bf16_mask & 2);
                q_i = load_in(in->q, i, p.bf16_mask & 1);
                eg = SQ_KDA ? load_in(in->g, i, p.bf16_mask & 8)
                            : load_in(&in->g_word, index_in_word(nh, p.bf16_mask & 8), p.bf16_mask & 8);
            } else {
                if (SQ_PART != PACK) {
                    k_i = load_in(p.k, ((long long)n * p.HQ + hq) * K + i, p.bf16_mask & 2);
                    q_i = load_in(p.q, ((long long)n * p.HQ + hq) * K + i, p.bf16_mask & 1);
                }
                if (FROM_CODES) eg = load_in(p.g, SQ_KDA ? nh * K + i : nh, p.bf16_mask & 8);
            }
            if (SQ_PENDING && FROM_CODES && p.pend_gate) {
                g_tok = eg;
                eg = __fadd_rn(STAGED ? (SQ_KDA ? reinterpret_cast<const float*>(in->gate)[i] : in->gate_word)
                                      : p.pend_gate[SQ_KDA ? nh * K + i : nh], g_tok);
            }
        }
    } else if (column_thread(tid)) {
        const int j = tid - MAX_K;
        if constexpr (DO_READOUT) {
            v_j = STAGED ? load_in(in->v, j, p.bf16_mask & 4) : load_in(p.v, nh * V + j, p.bf16_mask & 4);
            beta = STAGED ? load_in(&in->beta_word, index_in_word(nh, p.bf16_mask & 16), p.bf16_mask & 16)
                          : load_in(p.beta, nh, p.bf16_mask & 16);
        } else if constexpr (SQ_PART == WRITEBACK) {
            v_j = STAGED ? reinterpret_cast<const float*>(in->v)[j] : p.work[nh * V + j];
        }
    }
    if (slot < 0) return;  // a free batch row: its output and every slot stay untouched (no barrier yet)
    // then the slot's: its code words into shared memory (16-byte copies: rows are 16-byte multiples at
    // V = 128), the old row and column scales
    if constexpr (FROM_CODES && !STAGED) {
        const uint4* src = reinterpret_cast<const uint4*>(slot_codes + head.z);
#pragma unroll 1
        for (int e = tid; e < head.w / 4; e += THREADS) cp_async<16>(stage + e, src + e);
        if constexpr (SQ_PENDING) {  // and the held updates: k_e then u_e, 16-byte chunks (K, V multiples of 8)
            const int k_chunks = p.pend_n * K / 8, chunks = k_chunks + p.pend_n * V / 8;
#pragma unroll 1
            for (int e = tid; e < chunks; e += THREADS)
                cp_async<16>(reinterpret_cast<uint4*>(pend_k) + e,
                             e < k_chunks ? reinterpret_cast<const uint4*>(pend_k_out) + e
                                          : reinterpret_cast<const uint4*>(pend_u_out) + (e - k_chunks));
        }
    }
    if (tid < MAX_K) {
        const int i = tid;
        if (FROM_CODES && has_scales && i < K)  // pivot rows: unused
            r_old = __half2float(STAGED ? reinterpret_cast<const __half*>(in->rs)[i] : p.row_scale[rs_base + i]);
        if constexpr (!STAGED) {
            sm.rinfo[i] = entry.info;
            sm.rowp[i] = entry.rowp;
        }
        const int b = (STAGED ? sm.rinfo[i] : entry.info) & 31;
        sm.rowq[i] = make_float2(1.f, 0.f);
        // D S = diag(a) Z diag(c) (pivot rows: a = e^g, Z = the values, c = 1); rows past K: a = 0. k and q
        // enter before their norms (fk, fq below need every row's k and q; they scale the sums instead)
        const float a = i < K ? ((b <= 8) ? r_old : 1.f) * (FROM_CODES ? expf(eg) : 1.f) : 0.f;
        sm.row[i] = make_float4(a * k_i, a * q_i, a, k_i);
        const float kk = warp_sum(k_i * k_i), qq = warp_sum(q_i * q_i), qk = warp_sum(q_i * k_i);
        if (lane == 0) { sm.red[warp] = kk; sm.red[4 + warp] = qq; sm.red[8 + warp] = qk; }
        if constexpr (MMA && HALF_SUMS<KIND>) {  // the levels' + 1/2 (mma_readout sums code - 2^(b-1))
            const float hk = warp_sum(a * k_i), hq = warp_sum(a * q_i);
            if (lane == 0) { sm.half_sums[warp] = hk; sm.half_sums[4 + warp] = hq; }
        }
        if (SQ_PENDING && i == 0) sm.pend_decay = SQ_KDA ? 1.f : expf(g_tok);
    } else if (column_thread(tid)) {
        const int j = tid - MAX_K;
        float c_old = 1.f;
        if (SQ_DUAL && has_scales && FROM_CODES)
            c_old = __half2float(STAGED ? reinterpret_cast<const __half*>(in->cs)[j] : p.col_scale[cs_base + j]);
        sm.col[0][j] = c_old;
    }
    if constexpr (FROM_CODES && !STAGED) {
        cp_async_commit();
        cp_async_wait();
    }
    __syncthreads();
    const float kn = sm.red[0] + sm.red[1] + sm.red[2] + sm.red[3];
    const float qn = sm.red[4] + sm.red[5] + sm.red[6] + sm.red[7];
    float fq = p.scale, fk = 1.f;  // transformers' in-kernel L2 norm (recurrence.l2norm), then q * scale
    if (p.l2norm) {
        fk = SQ_KDA ? 1.f / sqrtf(kn + 1e-6f) : rsqrtf(kn + 1e-6f);
        fq = (SQ_KDA ? 1.f / sqrtf(qn + 1e-6f) : rsqrtf(qn + 1e-6f)) * p.scale;
    }
    const float kq = (sm.red[8] + sm.red[9] + sm.red[10] + sm.red[11]) * (fk * fq);
    if constexpr (SQ_PENDING && SQ_PART == READOUT) {  // append this token's k, normalized, to the pending
        // (GDN: the first head of each q/k head's group stores the k_e its H / HQ heads share)
        const bool stores_k = SQ_KDA || h == 0 || int((uint64_t(h - 1) * p.group_magic) >> 32) != hq;
        if (p.pend_append >= 0 && tid < K && stores_k)
            pend_k_out[p.pend_append * K + tid] = __float2half_rn(k_i * fk);
    }
    if constexpr (SQ_PENDING && FROM_CODES) {  // the readout carries the gate sum on, a fit restarts it (after
        if (p.pend_gate && (SQ_KDA ? tid < K : tid == 0))  // the barrier: every row thread has read it)
            p.pend_gate[SQ_KDA ? nh * K + tid : nh] = SQ_PART == READOUT ? eg : 0.f;
    }
    if constexpr (SQ_PENDING && DO_READOUT) {  // k . k_e and q . k_e (before the norms of k and q), row threads
        if (tid < MAX_K) {
            const int i = tid;
            const bool decays = SQ_KDA && p.pend_gate && i < K;  // KDA: k_e decayed by this token's gate first
            const float decay = decays ? expf(g_tok) : 1.f;
#pragma unroll 1
            for (int e = 0; e < p.pend_n; ++e) {
                float kj = i < K ? __half2float(pend_k[e * K + i]) : 0.f;
                if (decays) {  // stored back: later tokens read the global entries, the fit's fold the shared copy
                    const __half decayed = __float2half_rn(kj * decay);
                    if (SQ_PART == READOUT) pend_k_out[e * K + i] = decayed;
                    else pend_k[e * K + i] = decayed;
                    kj = __half2float(decayed);
                }
                const float dk = warp_sum(k_i * kj), dq = warp_sum(q_i * kj);
                if (lane == 0) {
                    sm.pdot[(warp * 2) * MAX_PENDING + e] = dk;
                    sm.pdot[(warp * 2 + 1) * MAX_PENDING + e] = dq;
                }
            }
        }
    }

    float x[ROWS][COLS];  // levels, then X, then Y (pivot rows: values, then X)
    bool row_pivot[ROWS];
    const float4 c_old4 = *reinterpret_cast<const float4*>(&sm.col[0][4 * lane]);
    const float c_old[COLS] = {c_old4.x, c_old4.y, c_old4.z, c_old4.w};

    // ---- 1. levels (or the float state) and readout partials
    // k^T D S and q^T D S over the warp's rows, before the factor c_j of the integer rows: a pivot row
    // (c = 1) enters as its values times 1 / c_j (relative error 2^-24 per term, like the sum's own); a
    // column scale of 0 (a zeroed slot, whose pivot values are 0 too) gives 1 / c_j = 0, not inf (0 * inf
    // was NaN)
    float acc[2][COLS];
    float inv_c[COLS] = {1.f, 1.f, 1.f, 1.f};
#pragma unroll
    for (int c = 0; c < COLS; ++c) {
        acc[0][c] = acc[1][c] = 0.f;
        if (KIND == 0) inv_c[c] = c_old[c] > 0.f ? __frcp_rn(c_old[c]) : 0.f;
    }
    const int* stage_words = reinterpret_cast<const int*>(stage);
    float* mma_part = reinterpret_cast<float*>(stage) + MMA_PARTIALS_AT;  // MMA: [hi, lo][NUM_WARPS][V][k, q]
    if constexpr (MMA)
        mma_readout<KIND>(sm.row, stage_words, row0, lane, mma_part + warp * 2 * V, NUM_WARPS * 2 * V);
#pragma unroll
    for (int r = 0; r < (MMA ? 0 : ROWS); ++r) {
        const int i = row0 + r;
        const int b = KIND ? KIND : (sm.rinfo[i] & 31);
        row_pivot[r] = b == 16;
        // the readout sums z = x, or for a pivot row z = x / c (inside each branch: one select per value
        // after the branches cost a copy and a predicated multiply per value on every row)
        auto sum_row = [&](const float* z) {
            if constexpr (DO_READOUT) {
                const float4 rc = sm.row[i];
#pragma unroll
                for (int c = 0; c < COLS; ++c) {
                    acc[0][c] = __fmaf_rn(rc.x, z[c], acc[0][c]);
                    acc[1][c] = __fmaf_rn(rc.y, z[c], acc[1][c]);
                }
            }
        };
        if constexpr (FROM_CODES) {
            if constexpr (KIND) {
                // widths of two or three planes: byte spreading per row (fewer instructions per value
                // than merging the planes value by value); one plane: the per-value merge
                if constexpr (KIND == 5 || KIND == 7) {
                    levels_any(stage_words + row_offset(i), KIND, lane, x[r], level_offset(KIND));
                } else {
                    levels<KIND>(load_chunks<KIND>(stage_words + row_offset(i), lane), x[r]);
                }
                sum_row(x[r]);
            } else {
                const int* row = stage_words + row_offset(i);
                if (row_pivot[r]) {
                    pivot_values(row, lane, x[r]);
                    float z[COLS];
#pragma unroll
                    for (int c = 0; c < COLS; ++c) z[c] = __fmul_rn(x[r][c], inv_c[c]);
                    sum_row(z);
                } else {
                    if (b == 8) levels<8>(load_chunks<8>(row, lane), x[r]);
                    else levels_any(row, b, lane, x[r], level_offset_from_round(sm.rowp[i].w));
                    sum_row(x[r]);
                }
            }
        } else {
            float4 v4 = make_float4(0.f, 0.f, 0.f, 0.f);
            if (row0 < K) v4 = *reinterpret_cast<const float4*>(p.x_in + ((nh * K + i) * V + 4 * lane));
            x[r][0] = v4.x; x[r][1] = v4.y; x[r][2] = v4.z; x[r][3] = v4.w;
            sum_row(x[r]);
        }
    }
    // the readout partials share their memory with the stage when they have no buffer of their own; the
    // other parts' next barrier (below) ends the stage's reads
    if constexpr (DO_READOUT && !OWN_READOUT_BUFFER && !MMA) __syncthreads();

    // ---- 2. u and y: threads 128..255 sum k^T D S and compute u (they hold v and beta), threads 0..127
    // sum q^T D S and store y once u is there
    if constexpr (DO_READOUT) {
        const int j = tid & (V - 1);
        // [k or q][NUM_WARPS][V] (MMA: [hi, lo][NUM_WARPS][V][k, q], stored by mma_readout)
        float* part = MMA ? mma_part : OWN_READOUT_BUFFER ? sm.readout : scratch;
        if constexpr (!MMA) {
#pragma unroll
            for (int a = 0; a < 2; ++a)
                *reinterpret_cast<float4*>(&part[(a * NUM_WARPS + warp) * V + 4 * lane]) =
                    make_float4(acc[a][0], acc[a][1], acc[a][2], acc[a][3]);
        }
        __syncthreads();
        float qds = 0.f;  // q^T (D S)_j (threads 0..127)
        if (tid < 2 * V) {
            const int a = tid < V ? 1 : 0;
            float s = 0.f;
            if constexpr (MMA) {  // the high and low parts, and the mid-rise levels' + 1/2
#pragma unroll
                for (int w = 0; w < 2 * NUM_WARPS; ++w) s += part[w * 2 * V + 2 * j + a];
                if constexpr (DOUBLED_LEVELS<KIND>) s *= 0.5f;
                if constexpr (HALF_SUMS<KIND>) {
                    const float* h = sm.half_sums + 4 * a;
                    s = __fmaf_rn(0.5f, (h[0] + h[1]) + (h[2] + h[3]), s);
                }
            } else {
#pragma unroll
                for (int w = 0; w < NUM_WARPS; ++w) s += part[(a * NUM_WARPS + w) * V + j];
            }
            float ds = __fmul_rn(sm.col[0][j], s) * (a ? fq : fk);  // the norms, after the sums
            if constexpr (SQ_PENDING) {  // + sum_e (k.k_e or q.k_e) u_e[j]
#pragma unroll 1
                for (int e = 0; e < p.pend_n; ++e) {
                    float d = 0.f;
#pragma unroll
                    for (int w = 0; w < 4; ++w) d += sm.pdot[(w * 2 + a) * MAX_PENDING + e];
                    float u_e = __half2float(pend_u[e * V + j]);
                    if (!SQ_KDA) u_e = __half2float(__float2half_rn(u_e * sm.pend_decay));  // GDN: u_e decayed
                    ds = __fmaf_rn(d * (a ? fq : fk), u_e, ds);
                }
            }
            if (a) {
                qds = ds;
            } else {
                const float u = beta * (v_j - ds);  // ds = k^T (D S)_j
                sm.col[1][j] = u;
                if (SQ_PART == READOUT && p.work) p.work[nh * V + j] = u;
                if constexpr (SQ_PENDING && SQ_PART == READOUT) {
                    if (p.pend_append >= 0) pend_u_out[p.pend_append * V + j] = __float2half_rn(u);
                }
            }
        }
        __syncthreads();
        if (tid < V)  // y = X^T q = (D S)^T q + (k.q) u, before anything is requantized
            store_out(p.y, nh * V + j, __fmaf_rn(kq, sm.col[1][j], qds), p.bf16_mask & 32);
        if constexpr (SQ_PENDING && SQ_PART == READOUT && !SQ_KDA) {  // GDN: the held u_e stored decayed
            if (p.pend_gate && column_thread(tid)) {
#pragma unroll 1
                for (int e = 0; e < p.pend_n; ++e)
                    pend_u_out[e * V + j] = __float2half_rn(__half2float(pend_u[e * V + j]) * sm.pend_decay);
            }
        }
    } else if constexpr (SQ_PART == WRITEBACK) {
        if (column_thread(tid)) sm.col[1][tid - MAX_K] = v_j;  // the readout's u
        __syncthreads();
    } else if constexpr (SQ_PART == PACK) {
        if (column_thread(tid)) sm.col[1][tid - MAX_K] = 0.f;
        __syncthreads();
    }
    if constexpr (DO_WRITEBACK) {
        requantize<KIND>(p, sm, x, row_pivot, c_old, fk, nh, slot_codes, rs_base, cs_base, has_scales, head,
                         scratch, pend_k, pend_u);
    }
}

// Batch rows blockIdx.x * SQ_ITEMS .. of head blockIdx.y, one after another (one row per CTA by default).
// STAGED: the row tables once, then a two-buffer pipeline: while row m computes from one buffer, the copies
// of the next row with a slot land in the other (cp.async groups: one per row, waited one row late; one
// barrier per row both ends the previous row's reads of the buffer refilled next and publishes the copies).
template <int KIND>
__device__ void head_rows(const Params& p, Shared& sm, uint4* staged_mem, int num_rows, int rows, int h,
                          int4 head, int first_slot) {
    const int n0 = blockIdx.x * rows;  // rows <= SQ_ITEMS
    __half* pend_copy = reinterpret_cast<__half*>(staged_mem);  // SQ_PENDING, not STAGED: the held updates
    if constexpr (SQ_ITEMS == 1) {  // one row per CTA, as before SQ_ITEMS (a loop cost the readout 21 registers)
        head_step<KIND>(p, sm, n0, h, first_slot, head, nullptr, sm.stage, sm.scratch, pend_copy);
    } else if constexpr (!STAGED) {
#pragma unroll 1
        for (int m = 0; m < rows && n0 + m < num_rows; ++m) {
            if (m > 0) __syncthreads();  // the previous row's reads of shared memory are done
            // slot -1: a free batch row (head_step returns before its first barrier)
            head_step<KIND>(p, sm, n0 + m, h, m ? p.slots[n0 + m] : first_slot, head, nullptr, sm.stage, sm.scratch,
                            pend_copy);
        }
    } else {
        const int tid = threadIdx.x;
        if (tid < rows) sm.item_slot[tid] = n0 + tid < num_rows ? p.slots[n0 + tid] : -1;
        if (tid < MAX_K) {
            const RowEntry entry = row_entry<KIND>(p, h, tid, head);
            sm.rinfo[tid] = entry.info;
            sm.rowp[tid] = entry.rowp;
        }
        __syncthreads();
        auto next_row = [&](int m) {  // the next of the CTA's rows with a slot (free rows stay untouched)
            do ++m; while (m < rows && sm.item_slot[m] < 0);
            return m;
        };
        auto buffer = [&](int which) {  // arithmetic, not an array indexed at run time (local memory)
            return reinterpret_cast<Staged*>(reinterpret_cast<char*>(staged_mem) + which * STAGE_BUFFER);
        };
        int m = next_row(-1);  // the row computed next
        int ahead = m;         // the row whose copies are issued next (one call site: one copy of the code)
        // turn t >= 1 computes the (t-1)-th row after issuing the t-th row's copies; turn 0 issues the first's
#pragma unroll 1
        for (int turn = 0; m < rows; ++turn) {
            if (turn > 0) {
                cp_async_wait();  // row m's copies (issued a row ago) have landed
                __syncthreads();     // ... for every thread, and the previous row is done: its buffer is free
            }
            if (ahead < rows) {
                stage_row(p, *buffer(turn & 1), n0 + ahead, h, sm.item_slot[ahead], head);
                ahead = next_row(ahead);
            }
            cp_async_commit();
            if (turn == 0) continue;
            Staged* in = buffer((turn - 1) & 1);
            head_step<KIND>(p, sm, n0 + m, h, sm.item_slot[m], head, in, in->codes, reinterpret_cast<float*>(in),
                            nullptr);
            m = next_row(m);
        }
    }
}

// SQ_MMA: the readout's CTAs are small (~40 KB of shared memory: five per multiprocessor), and five need 48
// registers; without the bound the compiler took 64-72 registers for the tensor-core sums (four or three CTAs)
// at the same count of instructions (the library with every body and the pending updates then spills 40-64
// bytes; SQ_MMA_MIN_BLOCKS=4 allows 64 registers: not yet timed against each other)
#ifndef SQ_MMA_MIN_BLOCKS
#define SQ_MMA_MIN_BLOCKS 5
#endif
constexpr int MIN_BLOCKS = SQ_MMA ? SQ_MMA_MIN_BLOCKS : SQ_MIN_BLOCKS;

__global__ void __launch_bounds__(THREADS, MIN_BLOCKS) packed_step_kernel(const Params p, int num_rows, int rows) {
    __shared__ Shared sm;
#ifdef SQ_EMULATE
    __shared__ uint4 staged_mem[DYNAMIC_BYTES_MAX / 16 + 1];
#else
    extern __shared__ uint4 staged_mem[];  // STAGED_BYTES: the two staging buffers; or the held updates
#endif
    const int h = blockIdx.y;
    const int4 head = reinterpret_cast<const int4*>(p.heads)[h];  // (kind, scale slot, first word, words)
    // the first row's slot, loaded beside the head entry (not after the switch on it: one round trip)
    const int first_slot = p.slots[blockIdx.x * rows];
#ifdef SQ_ONLY_KIND  // one body alone, for offline instruction counts (benchmarks/sass_cuda.py)
    head_rows<SQ_ONLY_KIND>(p, sm, staged_mem, num_rows, rows, h, head, first_slot);
    return;
#endif
    switch (head.x) {
        case 2: head_rows<2>(p, sm, staged_mem, num_rows, rows, h, head, first_slot); break;
        case 3: head_rows<3>(p, sm, staged_mem, num_rows, rows, h, head, first_slot); break;
        case 4: head_rows<4>(p, sm, staged_mem, num_rows, rows, h, head, first_slot); break;
        case 5: head_rows<5>(p, sm, staged_mem, num_rows, rows, h, head, first_slot); break;
        case 6: head_rows<6>(p, sm, staged_mem, num_rows, rows, h, head, first_slot); break;
        case 7: head_rows<7>(p, sm, staged_mem, num_rows, rows, h, head, first_slot); break;
        case 8: head_rows<8>(p, sm, staged_mem, num_rows, rows, h, head, first_slot); break;
        default: head_rows<0>(p, sm, staged_mem, num_rows, rows, h, head, first_slot); break;
    }
}

}  // namespace

extern "C" int sq_packed_step(const Params* p, int num_rows, int device, void* stream) {
    cudaError_t err = cudaSetDevice(device);
    if (err != cudaSuccess) return int(err);
    if (num_rows == 0) return 0;
    // batch rows per CTA: SQ_ITEMS, fewer where the grid would then fill the GPU's multiprocessors (two
    // CTAs each) fewer than 4 times (a small batch keeps its CTAs; the emulation takes SQ_ITEMS)
    int rows = SQ_ITEMS;
#ifdef SQ_EMULATE
    dim3 grid((num_rows + rows - 1) / rows, p->H);
    emulate_launch(grid, dim3(THREADS), packed_step_kernel, *p, num_rows, rows);
#else
    if (SQ_ITEMS > 1) {
        static int sms[64] = {};
        int count = device < 64 ? sms[device] : 0;
        if (count == 0) {
            err = cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
            if (err != cudaSuccess) return int(err);
            if (device < 64) sms[device] = count;
        }
        const long long per_cta = (long long)num_rows * p->H / (4LL * 2 * count);
        rows = int(per_cta < 1 ? 1 : per_cta < SQ_ITEMS ? per_cta : SQ_ITEMS);
    }
    dim3 grid((num_rows + rows - 1) / rows, p->H);
    if (DYNAMIC_BYTES_MAX > 0) {  // past the 48 KB a launch gets without asking (once per process and device)
        static bool raised[64] = {};
        if (device >= 64 || !raised[device]) {
            err = cudaFuncSetAttribute(packed_step_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       DYNAMIC_BYTES_MAX);
            if (err != cudaSuccess) return int(err);
            if (device < 64) raised[device] = true;
        }
    }
    const int dynamic_bytes = STAGED_BYTES + (PENDING_BYTES_MAX ? p->pend_n * (p->K + V) * 2 : 0);
    packed_step_kernel<<<grid, THREADS, dynamic_bytes, static_cast<cudaStream_t>(stream)>>>(*p, num_rows, rows);
#endif
    return int(cudaGetLastError());
}

extern "C" int sq_params_size() { return int(sizeof(Params)); }

extern "C" const char* sq_error_string(int status) { return cudaGetErrorString(cudaError_t(status)); }

// CPU emulation of the CUDA features packed_step.cu uses, so that the kernel's own source runs (slowly)
// on a machine without a GPU: the default test suite checks it against the torch reference this way
// (tests/test_cuda_kernel.py), and the same source is compiled with nvcc on a GPU.
//
// A launch runs its CTAs one after another; a CTA's threads are OS threads. __syncthreads and __syncwarp
// are barriers, a warp shuffle goes through a per-warp array between two barriers, shared memory is a
// function-static object (one CTA at a time), cp.async is a copy. Arithmetic intrinsics are computed
// exactly as their PTX instructions define them (round-to-nearest, or toward minus infinity for
// __fadd_rd); the approximate ones (__fdividef, rsqrtf) are computed exactly, which the kernel's exactness
// arguments allow (docs/kernels.md). Timing, occupancy and memory ordering between CTAs are not emulated.
#pragma once

#include <barrier>
#include <cmath>
#include <math.h>
#include <memory>
#include <cstdint>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __restrict__

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
    dim3() = default;
    dim3(unsigned a, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
struct int4 { int x, y, z, w; };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline float2 make_float2(float a, float b) { return {a, b}; }

using __half = _Float16;
struct __half2 { _Float16 x, y; };
inline float __half2float(__half h) { return float(h); }
inline __half __float2half_rn(float f) { return __half(f); }
inline __half2 __floats2half2_rn(float a, float b) { return {_Float16(a), _Float16(b)}; }
inline float2 __half22float2(__half2 h) { return {float(h.x), float(h.y)}; }

typedef int cudaError_t;
typedef void* cudaStream_t;
constexpr cudaError_t cudaSuccess = 0;
inline cudaError_t cudaSetDevice(int) { return cudaSuccess; }
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline const char* cudaGetErrorString(cudaError_t) { return "no error (CPU emulation)"; }

namespace emu {
constexpr int kMaxThreads = 1024;
inline thread_local unsigned tid = 0;
struct Cta {
    std::barrier<>* block = nullptr;
    std::vector<std::barrier<>*> warps;
    uint64_t lanes[kMaxThreads];
    uint32_t fragments[kMaxThreads][6];  // mma_bf16_16816: each lane's A and B registers
    int any = 0;  // __syncthreads_or
};
inline Cta* cta = nullptr;
}  // namespace emu

struct EmuIndex {
    unsigned x = 0, y = 0, z = 0;
};
inline thread_local EmuIndex threadIdx, blockIdx;

inline void __syncthreads() { emu::cta->block->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::cta->warps[emu::tid / 32]->arrive_and_wait(); }
inline int __syncthreads_or(int predicate) {  // set, read after every thread set, reset after every read
    if (predicate) __atomic_store_n(&emu::cta->any, 1, __ATOMIC_RELAXED);
    __syncthreads();
    const int out = __atomic_load_n(&emu::cta->any, __ATOMIC_RELAXED);
    __syncthreads();
    if (emu::tid == 0) __atomic_store_n(&emu::cta->any, 0, __ATOMIC_RELAXED);
    __syncthreads();
    return out;
}

template <typename T>
inline T __shfl_xor_sync(unsigned, T value, int mask) {
    static_assert(sizeof(T) <= 8, "shuffle of a value wider than 8 bytes");
    uint64_t bits = 0;
    std::memcpy(&bits, &value, sizeof(T));
    emu::cta->lanes[emu::tid] = bits;
    __syncwarp();
    const unsigned other = (emu::tid & ~31u) | ((emu::tid & 31u) ^ unsigned(mask));
    bits = emu::cta->lanes[other];
    __syncwarp();
    T out;
    std::memcpy(&out, &bits, sizeof(T));
    return out;
}

inline float __uint_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t __float_as_uint(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, d = A B + c, each lane's fragments as PTX lays them
// out (g = lane / 4, t = lane % 4; a register's low half is the lower index): a[0] A[g][2t, 2t + 1], a[1]
// A[g + 8][2t, 2t + 1], a[2] A[g][2t + 8, 2t + 9], a[3] A[g + 8][2t + 8, 2t + 9]; b[0] B[2t, 2t + 1][g], b[1]
// B[2t + 8, 2t + 9][g]; c and d [0] [g][2t], [1] [g][2t + 1], [2] [g + 8][2t], [3] [g + 8][2t + 1]. The
// products of BF16 values are exact in FP32; the sum runs in order of k (the tensor core's order and
// rounding of the sum are its own: tests compare by relative error)
inline void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], const float (&c)[4]) {
    uint32_t* mine = emu::cta->fragments[emu::tid];
    for (int r = 0; r < 4; ++r) mine[r] = a[r];
    mine[4] = b[0];
    mine[5] = b[1];
    __syncwarp();
    const unsigned base = emu::tid & ~31u, lane = emu::tid & 31u;
    auto half = [](uint32_t reg, int hi) { return __uint_as_float((hi ? reg >> 16 : reg & 0xFFFFu) << 16); };
    auto A = [&](int m, int k) {
        const uint32_t* f = emu::cta->fragments[base + (m % 8) * 4 + (k % 8) / 2];
        return half(f[(m >= 8) + 2 * (k >= 8)], k & 1);
    };
    auto B = [&](int k, int n) {
        const uint32_t* f = emu::cta->fragments[base + n * 4 + (k % 8) / 2];
        return half(f[4 + (k >= 8)], k & 1);
    };
    float out[4];
    for (int r = 0; r < 4; ++r) {
        const int m = lane / 4 + 8 * (r >= 2), n = 2 * (lane % 4) + (r & 1);
        float s = c[r];
        for (int k = 0; k < 16; ++k) s += A(m, k) * B(k, n);
        out[r] = s;
    }
    __syncwarp();
    for (int r = 0; r < 4; ++r) d[r] = out[r];
}

inline uint32_t __funnelshift_r(uint32_t lo, uint32_t hi, uint32_t shift) {
    const uint64_t both = (uint64_t(hi) << 32) | lo;
    return uint32_t(both >> (shift & 31u));
}
inline uint32_t __byte_perm(uint32_t x, uint32_t y, uint32_t s) {
    const uint64_t both = (uint64_t(y) << 32) | x;  // bytes 0-3 of x, 4-7 of y
    uint32_t out = 0;
    for (int i = 0; i < 4; ++i) out |= uint32_t((both >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i);
    return out;
}
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __fadd_rd(float a, float b) {
    // the exact sum (both operands are within 2^29 of each other in the kernel, so a double holds it),
    // rounded toward minus infinity
    const double exact = double(a) + double(b);
    float f = float(exact);
    if (double(f) > exact) f = std::nextafter(f, -INFINITY);
    return f;
}
inline float __fsqrt_rn(float x) { return std::sqrt(x); }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

// Runs kernel(args...) over the grid, one CTA at a time, each with block.x OS threads.
template <typename Kernel, typename... Args>
inline void emulate_launch(dim3 grid, dim3 block, Kernel kernel, Args... args) {
    const unsigned threads = block.x;
    for (unsigned by = 0; by < grid.y; ++by) {
        for (unsigned bx = 0; bx < grid.x; ++bx) {
            emu::Cta state;
            std::barrier<> block_barrier(threads);
            std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
            for (unsigned w = 0; w < (threads + 31) / 32; ++w) warp_barriers.push_back(std::make_unique<std::barrier<>>(32));
            state.block = &block_barrier;
            for (auto& b : warp_barriers) state.warps.push_back(b.get());
            emu::cta = &state;
            std::vector<std::thread> pool;
            pool.reserve(threads);
            for (unsigned t = 0; t < threads; ++t) {
                pool.emplace_back([=] {
                    emu::tid = t;
                    threadIdx.x = t;
                    blockIdx.x = bx;
                    blockIdx.y = by;
                    kernel(args...);
                });
            }
            for (auto& th : pool) th.join();
            emu::cta = nullptr;
        }
    }
}

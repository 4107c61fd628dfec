// FP8 (e4m3) K/V cache rows: quantize and dequantize (launched by crates/prism-model/src/cuda_kv_fp8.rs).
//
// The format and its CPU twin are crates/prism-model/src/kv_fp8.rs. One row is one token's key (or value)
// of one KV head, `d` values:
//   amax  = max |x_i| (fmaxf ignores NaN; a warp butterfly of maxima: exact, any order), from 0;
//   scale = amax / 448 (IEEE division, __fdiv_rn), or 1 where that is not positive and finite;
//   q_i   = e4m3(x_i / scale): the quotient correctly rounded (__fdiv_rn), then cvt.rn.satfinite (round to
//           nearest even, ±448 past the range, NaN → 0x7F) — __nv_cvt_float_to_fp8 with __NV_SATFINITE,
//           one instruction on sm_89+;
//   x'_i  = f32(e4m3 q_i) · scale (exact decode through f16, one correctly rounded multiplication).
// Every step is exactly rounded, so the bytes and scales equal the CPU twin's bit for bit (checked by
// `prism cuda-check`). Rows are independent: a row's bytes never depend on the launch or the other rows.
// The explicit __fdiv_rn / __fmul_rn intrinsics keep nvcc from contracting or approximating them.

#include "launch.cuh"
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <float.h>
#include <stdint.h>

namespace {

__device__ __forceinline__ float load_value(const float* x, size_t i) { return x[i]; }
__device__ __forceinline__ float load_value(const __nv_bfloat16* x, size_t i) { return __bfloat162float(x[i]); }

__device__ __forceinline__ float row_scale(float amax) {
    const float s = __fdiv_rn(amax, 448.f);
    return (s > 0.f && s <= FLT_MAX) ? s : 1.f;
}

__device__ __forceinline__ float e4m3_to_float(uint8_t b) {
    __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), __NV_E4M3);
    return __half2float(__half(h));
}

// One warp per row of `d` values: x [rows, d] → q [rows, d] bytes, scales [rows].
template <typename T>
__device__ __forceinline__ void quantize_rows(const T* __restrict__ x, uint8_t* __restrict__ q,
                                              float* __restrict__ scales, int rows, int d) {
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (warp >= rows) return;
    const size_t base = static_cast<size_t>(warp) * d;
    float amax = 0.f;
    for (int i = lane; i < d; i += 32) amax = fmaxf(amax, fabsf(load_value(x, base + i)));
    for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    const float s = row_scale(amax);
    for (int i = lane; i < d; i += 32) {
        const float v = __fdiv_rn(load_value(x, base + i), s);
        q[base + i] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
    }
    if (lane == 0) scales[warp] = s;
}

}  // namespace

extern "C" __global__ void kv_fp8_quantize_f32(const float* __restrict__ x, uint8_t* __restrict__ q,
                                               float* __restrict__ scales, int rows, int d) {
    PRISM_GRID_PROLOGUE();
    quantize_rows(x, q, scales, rows, d);
}

extern "C" __global__ void kv_fp8_quantize_bf16(const __nv_bfloat16* __restrict__ x, uint8_t* __restrict__ q,
                                                float* __restrict__ scales, int rows, int d) {
    PRISM_GRID_PROLOGUE();
    quantize_rows(x, q, scales, rows, d);
}

// One thread per element: q [n / d rows, d] bytes with scales [n / d] → y [n] (f32, or bf16 rounded to
// nearest even from the f32 value when `bf16`).
extern "C" __global__ void kv_fp8_dequantize(const uint8_t* __restrict__ q, const float* __restrict__ scales,
                                             void* __restrict__ y, int bf16, long long n, int d) {
    PRISM_GRID_PROLOGUE();
    const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float v = __fmul_rn(e4m3_to_float(q[i]), scales[i / d]);
    if (bf16) {
        reinterpret_cast<__nv_bfloat16*>(y)[i] = __float2bfloat16_rn(v);
    } else {
        reinterpret_cast<float*>(y)[i] = v;
    }
}

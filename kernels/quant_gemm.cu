// The integer matmul of issue #20's contract on CUDA: the arithmetic of crates/prism-quant/src/lib.rs
// ("The arithmetic, exactly"), bit for bit. A first, simple and correct version (one warp per activation
// run, one thread per output with dp4a); the tensor-core tiles come later and must return the same bits.
//
// Every float operation is an explicit round-to-nearest intrinsic (__fdiv_rn, __fmul_rn, __fmaf_rn,
// __fadd_rn, __int2float_rn), so nvcc cannot contract or reorder them. Integer sums are exact in any
// order.

#include "launch.cuh"
#include <stdint.h>

#define RUN 128

// The parts of a product's reduction (crates/prism-quant/src/kernel.rs `part_bounds`): part p is runs
// part_start<SHARE>(ps, p, R) .. part_start<SHARE>(ps, p + 1, R) of the product's R runs, the parts' sums
// combined as (p0 + p1) + (p2 + p3). A whole product's bounds are ⌊p·R/4⌋ (SHARE false: `ps` unused,
// the code that of a kernel without it). A tensor-parallel share (`PartSpan`: one part, or an aligned
// pair, of a longer reduction, its columns alone; the `*_share` entries) passes its own parts' bounds
// in its runs and leaves the parts it does not hold empty at the end: an empty part sums to +0 and no
// part sum is -0 (each starts at +0, and round-to-nearest gives -0 only for (-0) + (-0)), so the tree
// then gives the share's own combination, p_a or p_a + p_b, bit for bit (crates/prism-quant/src/cuda.rs
// `Parts`).
struct Parts {
    int b1, b2, b3;
};
template <bool SHARE>
__device__ __forceinline__ int part_start(Parts ps, int p, int R) {
    if constexpr (SHARE) {
        return p <= 0 ? 0 : p == 1 ? ps.b1 : p == 2 ? ps.b2 : p == 3 ? ps.b3 : R;
    } else {
        return p * R / 4;
    }
}

// The smallest run maximum that still quantizes: 2^-120 (below it the run is zeros with scale 0).
#define AMAX_MIN 0x1p-120f

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// SiLU as kernels/ops.cu writes it (the same expression, so nvcc forms the same instructions: the fused
// SwiGLU input below must give swiglu_f32's bits).
__device__ __forceinline__ float silu_as_ops(float x) { return x / (1.f + expf(-x)); }

// A run's scale s = amax / 127 and its inverse (both 0 below AMAX_MIN) from each lane's largest
// magnitude `m`; flags the row in `bad_rows` when any lane saw a value that is not finite.
__device__ __forceinline__ float2 run_scale(bool bad, float m, int row, int lane,
                                            unsigned int* __restrict__ bad_rows) {
    if (__any_sync(0xffffffffu, bad) && lane == 0) bad_rows[row] = 1u;
    const float amax = warp_max(m);
    float s = 0.f, inv = 0.f;
    if (amax >= AMAX_MIN) {
        s = __fdiv_rn(amax, 127.f);
        inv = __fdiv_rn(127.f, amax);
    }
    return make_float2(s, inv);
}

// The int8 value of v at the inverse scale inv: rounded half to even, clamped to ±127.
__device__ __forceinline__ int quantize_value(float v, float inv) {
    return (int)fminf(fmaxf(rintf(__fmul_rn(v, inv)), -127.f), 127.f);
}

// One warp per (row, run of 128): lane l holds the run's elements 4l .. 4l + 3 (a shorter last run:
// the missing elements are 0). Writes the int8 values, the run scale sa, the sums of each 32 values
// (want_sums: Q4_K / Q5_K, whose rows are whole 256-blocks) and, for a row holding a NaN or ±inf,
// bad_rows[row] = 1 (the buffer is zeroed before the launch). The scale of (row, run) goes to
// sa[row · sa_row_stride + run · sa_run_stride]: row-major [rows, runs] for the simple kernels,
// run-major [runs, ld] for the Hopper tile. rows · runs warps; the block size is a
// multiple of 32. SWIGLU: the row's values are swiglu_f32's (kernels/ops.cu) of gate | up row `row`
// (x_stride floats apart; gate at column c, up at cols + c), computed here instead of read.
template <bool SWIGLU>
__device__ __forceinline__ void quantize_act_body(const float* __restrict__ x, long long x_stride, int rows,
                                                  int cols, signed char* __restrict__ qa, float* __restrict__ sa,
                                                  int sa_row_stride, int sa_run_stride, int* __restrict__ sums32,
                                                  int want_sums, unsigned int* __restrict__ bad_rows) {
    const int runs = (cols + RUN - 1) / RUN;
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (warp >= (long long)rows * runs) return;  // whole warps: warp is the same for its 32 lanes
    const int row = (int)(warp / runs), run = (int)(warp % runs);
    const int c0 = run * RUN, len = min(RUN, cols - c0);
    const float* xr = x + (size_t)row * x_stride + c0;
    float v[4];
    bool bad = false;
    float m = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int c = 4 * lane + i;
        if constexpr (SWIGLU) {
            v[i] = c < len ? silu_as_ops(xr[c]) * xr[cols + c] : 0.f;
        } else {
            v[i] = c < len ? xr[c] : 0.f;
        }
        bad |= !isfinite(v[i]);
        m = fmaxf(m, fabsf(v[i]));  // the maximum of finite values is exact in any order
    }
    const float2 scale = run_scale(bad, m, row, lane, bad_rows);
    const float s = scale.x, inv = scale.y;
    signed char* qr = qa + (size_t)row * cols + c0;
    int part = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int q = quantize_value(v[i], inv);
        part += q;
        if (4 * lane + i < len) qr[4 * lane + i] = (signed char)q;
    }
    if (lane == 0) sa[(size_t)row * sa_row_stride + (size_t)run * sa_run_stride] = s;
    if (want_sums) {
        // Lanes 8g .. 8g + 7 hold the 32 values of group g of the run.
        part += __shfl_xor_sync(0xffffffffu, part, 1);
        part += __shfl_xor_sync(0xffffffffu, part, 2);
        part += __shfl_xor_sync(0xffffffffu, part, 4);
        const int g = lane / 8;
        if (lane % 8 == 0 && 32 * g < len) sums32[((size_t)row * cols + c0) / 32 + g] = part;
    }
}

extern "C" __global__ void quantize_act_run128(const float* __restrict__ x, int rows, int cols,
                                               signed char* __restrict__ qa, float* __restrict__ sa,
                                               int sa_row_stride, int sa_run_stride,
                                               int* __restrict__ sums32, int want_sums,
                                               unsigned int* __restrict__ bad_rows) {
    PRISM_GRID_PROLOGUE();
    quantize_act_body<false>(x, cols, rows, cols, qa, sa, sa_row_stride, sa_run_stride, sums32, want_sums,
                             bad_rows);
}

// quantize_act_run128 of swiglu(gate | up): gu [rows, 2·cols] with rows gu_stride floats apart.
extern "C" __global__ void quantize_act_swiglu_run128(const float* __restrict__ gu, long long gu_stride, int rows,
                                                      int cols, signed char* __restrict__ qa,
                                                      float* __restrict__ sa, int sa_row_stride,
                                                      int sa_run_stride, int* __restrict__ sums32, int want_sums,
                                                      unsigned int* __restrict__ bad_rows) {
    PRISM_GRID_PROLOGUE();
    quantize_act_body<true>(gu, gu_stride, rows, cols, qa, sa, sa_row_stride, sa_run_stride, sums32, want_sums,
                            bad_rows);
}

// quantize_act_run128 of the DeltaNet output norm (kernels/ops.cu `norm_rows_f32`, mode 1) of x
// [rows · heads, 128] (contiguous) with its gate (row n, head h at gate + n · g_stride + 128 · h) and
// weight w [128]: each head's 128 values are one run, normalized with the operations of norm_rows_f32
// in its order (lane l sums x[l], x[l + 32], x[l + 64], x[l + 96] by fmaf, then the same butterfly),
// so the values, and with them the int8 bytes and scales, are those of the norm followed by
// quantize_act_run128. One warp per (row, head); cols = 128 · heads.
extern "C" __global__ void quantize_act_gated_norm_run128(
    const float* __restrict__ x, const float* __restrict__ gate, long long g_stride, const float* __restrict__ w,
    float eps, int rows, int heads, signed char* __restrict__ qa, float* __restrict__ sa, int sa_row_stride,
    int sa_run_stride, int* __restrict__ sums32, int want_sums, unsigned int* __restrict__ bad_rows) {
    PRISM_GRID_PROLOGUE();
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (warp >= (long long)rows * heads) return;  // whole warps
    const int row = (int)(warp / heads), head = (int)(warp % heads);
    const int cols = RUN * heads;
    const float* xr = x + ((size_t)row * heads + head) * RUN;
    const float* gr = gate + (size_t)row * g_stride + (size_t)head * RUN;
    float v[4];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        v[j] = xr[lane + 32 * j];
        ss = fmaf(v[j], v[j], ss);
    }
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    // norm_rows_f32's ss / D, 1 / sqrt(denom + eps) with D a run time value: IEEE division, sqrt and
    // sum, written out so that nothing is contracted or turned into a product by the constant.
    const float denom = __fdiv_rn(ss, (float)RUN);
    const float inv_norm = __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(denom, eps)));
    bool bad = false;
    float m = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int i = lane + 32 * j;
        float val = __fmul_rn(v[j], inv_norm);
        val = __fmul_rn(val, w[i]);
        val = __fmul_rn(val, silu_as_ops(gr[i]));
        v[j] = val;
        bad |= !isfinite(val);
        m = fmaxf(m, fabsf(val));
    }
    const float2 scale = run_scale(bad, m, row, lane, bad_rows);
    const float s = scale.x, inv = scale.y;
    signed char* qr = qa + (size_t)row * cols + (size_t)head * RUN;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int q = quantize_value(v[j], inv);
        qr[lane + 32 * j] = (signed char)q;
        if (want_sums) {
            // Group j of the run (its 32 values) is element j of every lane.
            int part = q;
            for (int off = 16; off > 0; off >>= 1) part += __shfl_xor_sync(0xffffffffu, part, off);
            if (lane == 0) sums32[((size_t)row * cols + (size_t)head * RUN) / 32 + j] = part;
        }
    }
    if (lane == 0) sa[(size_t)row * sa_row_stride + (size_t)head * sa_run_stride] = s;
}

// Elements i0 .. i0 + 3 of row xr, plus those of rr when it is given (16-byte aligned rows).
__device__ __forceinline__ float4 row4_sum(const float* __restrict__ xr, const float* __restrict__ rr, int i0) {
    float4 v = *reinterpret_cast<const float4*>(xr + i0);
    if (rr) {
        const float4 r = *reinterpret_cast<const float4*>(rr + i0);
        v.x = __fadd_rn(v.x, r.x); v.y = __fadd_rn(v.y, r.y);
        v.z = __fadd_rn(v.z, r.z); v.w = __fadd_rn(v.w, r.w);
    }
    return v;
}

// Threads of quantize_act_add_norm_run128: ops.cu's NORM_THREADS, whose thread order it repeats.
#define ADD_NORM_THREADS 256
// Groups of 4 elements a thread of quantize_act_add_norm_run128 keeps in registers between its two
// passes (rows up to 4 · ADD_NORM_THREADS · 8 = 8,192 wide; a wider row's other groups are read twice).
#define ADD_NORM_GROUPS 8

// One group of 4 elements of the normed row, v = x + res at i0, quantized in its run by the warp: the
// run is warp w's groups of one pass (lane l its elements 4l .. 4l + 3, as the quantizer's lanes).
__device__ __forceinline__ void add_norm_quantize_group(float4 v, const float* __restrict__ w, float inv_norm,
                                                        int i0, int row, int lane, int cols,
                                                        signed char* __restrict__ qa, float* __restrict__ sa,
                                                        int sa_row_stride, int sa_run_stride,
                                                        int* __restrict__ sums32, int want_sums,
                                                        unsigned int* __restrict__ bad_rows) {
    const float4 wv = *reinterpret_cast<const float4*>(w + i0);
    float e[4] = {__fmul_rn(__fmul_rn(v.x, inv_norm), wv.x), __fmul_rn(__fmul_rn(v.y, inv_norm), wv.y),
                  __fmul_rn(__fmul_rn(v.z, inv_norm), wv.z), __fmul_rn(__fmul_rn(v.w, inv_norm), wv.w)};
    bool bad = false;
    float m = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        bad |= !isfinite(e[i]);
        m = fmaxf(m, fabsf(e[i]));
    }
    const int run = i0 / RUN, c0 = run * RUN;
    const float2 scale = run_scale(bad, m, row, lane, bad_rows);
    const float s = scale.x, inv = scale.y;
    signed char* qr = qa + (size_t)row * cols + c0;
    int part = 0;
    char4 q4;
    int q[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        q[i] = quantize_value(e[i], inv);
        part += q[i];
    }
    q4.x = (signed char)q[0]; q4.y = (signed char)q[1]; q4.z = (signed char)q[2]; q4.w = (signed char)q[3];
    *reinterpret_cast<char4*>(qr + 4 * lane) = q4;
    if (lane == 0) sa[(size_t)row * sa_row_stride + (size_t)run * sa_run_stride] = s;
    if (want_sums) {
        // Lanes 8g .. 8g + 7 hold the 32 values of group g of the run.
        part += __shfl_xor_sync(0xffffffffu, part, 1);
        part += __shfl_xor_sync(0xffffffffu, part, 2);
        part += __shfl_xor_sync(0xffffffffu, part, 4);
        if (lane % 8 == 0) sums32[((size_t)row * cols + c0) / 32 + lane / 8] = part;
    }
}

// quantize_act_run128 of the RMS norm of x + res (kernels/ops.cu `norm_rows_block_f32`, mode 0, with the
// residual; res null: the norm of x alone) with weight w [cols], writing the sum x + res to sum_out when
// res is given, as the norm kernel does. One block of ADD_NORM_THREADS per row, cols a multiple of 128,
// x, res and sum_out contiguous [rows, cols]. The norm's operations in its order: thread t takes the
// groups of 4 elements 4t, 4t + 1024, …, the sum of squares by fmaf in that order, the warp butterfly,
// the 8 warp sums added in order, then ss / cols and 1 / sqrt(· + eps), each value (x + res) · inv · w.
// In each of those passes warp w's groups are one run of 128 (run 8·pass + w, lane l its elements 4l ..
// 4l + 3, as the quantizer's lanes), so the warp quantizes its run where the norm kernel would store
// it: the bytes, scales, sums and bad flags are those of the norm followed by quantize_act_run128.
// A thread reads its first ADD_NORM_GROUPS groups all at once and keeps them for the second pass: one
// block on one SM is bound by the latency of its reads, not by their bytes.
extern "C" __global__ void __launch_bounds__(ADD_NORM_THREADS) quantize_act_add_norm_run128(
    const float* __restrict__ x, const float* __restrict__ res, float* __restrict__ sum_out,
    const float* __restrict__ w, float eps, int rows, int cols, signed char* __restrict__ qa,
    float* __restrict__ sa, int sa_row_stride, int sa_run_stride, int* __restrict__ sums32, int want_sums,
    unsigned int* __restrict__ bad_rows) {
    PRISM_GRID_PROLOGUE();
    __shared__ float partial[ADD_NORM_THREADS / 32];
    const int row = blockIdx.x;
    if (row >= rows) return;  // never: one block per row
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const float* xr = x + (size_t)row * cols;
    const float* rr = res ? res + (size_t)row * cols : nullptr;
    float* sr = rr && sum_out ? sum_out + (size_t)row * cols : nullptr;
    const int first = 4 * threadIdx.x, step = 4 * ADD_NORM_THREADS;
    float4 v[ADD_NORM_GROUPS];
#pragma unroll
    for (int p = 0; p < ADD_NORM_GROUPS; ++p) {
        const int i0 = first + p * step;
        v[p] = i0 < cols ? row4_sum(xr, rr, i0) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float ss = 0.f;
#pragma unroll
    for (int p = 0; p < ADD_NORM_GROUPS; ++p) {
        const int i0 = first + p * step;
        if (i0 >= cols) break;
        if (sr) *reinterpret_cast<float4*>(sr + i0) = v[p];
        ss = __fmaf_rn(v[p].x, v[p].x, ss);
        ss = __fmaf_rn(v[p].y, v[p].y, ss);
        ss = __fmaf_rn(v[p].z, v[p].z, ss);
        ss = __fmaf_rn(v[p].w, v[p].w, ss);
    }
    for (int i0 = first + ADD_NORM_GROUPS * step; i0 < cols; i0 += step) {
        const float4 u = row4_sum(xr, rr, i0);
        if (sr) *reinterpret_cast<float4*>(sr + i0) = u;
        ss = __fmaf_rn(u.x, u.x, ss);
        ss = __fmaf_rn(u.y, u.y, ss);
        ss = __fmaf_rn(u.z, u.z, ss);
        ss = __fmaf_rn(u.w, u.w, ss);
    }
    for (int off = 16; off > 0; off >>= 1) ss = __fadd_rn(ss, __shfl_xor_sync(0xffffffffu, ss, off));
    if (lane == 0) partial[warp] = ss;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int k = 0; k < ADD_NORM_THREADS / 32; ++k) total = __fadd_rn(total, partial[k]);
    const float denom = __fdiv_rn(total, (float)cols);
    const float inv_norm = __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(denom, eps)));
    // Whole warps below: cols is a multiple of 128, so i0 < cols alike for a warp's 32 lanes.
#pragma unroll
    for (int p = 0; p < ADD_NORM_GROUPS; ++p) {
        const int i0 = first + p * step;
        if (i0 >= cols) break;
        add_norm_quantize_group(v[p], w, inv_norm, i0, row, lane, cols, qa, sa, sa_row_stride, sa_run_stride,
                                sums32, want_sums, bad_rows);
    }
    for (int i0 = first + ADD_NORM_GROUPS * step; i0 < cols; i0 += step) {
        add_norm_quantize_group(row4_sum(xr, rr, i0), w, inv_norm, i0, row, lane, cols, qa, sa, sa_row_stride,
                                sa_run_stride, sums32, want_sums, bad_rows);
    }
}

// Σ a_i · b_i over n bytes (n a multiple of 4, both 4-byte aligned), exact in int32.
__device__ __forceinline__ int dot_bytes(const signed char* a, const signed char* b, int n) {
    const int* a4 = reinterpret_cast<const int*>(a);
    const int* b4 = reinterpret_cast<const int*>(b);
    int s = 0;
    for (int i = 0; i < n / 4; ++i) s = __dp4a(a4[i], b4[i], s);
    return s;
}

// Formats: 0 Q8_0 (re-blocked, one scale a run), 1 Q4_K / Q5_K (mins), 2 Q6_K.
template <int FMT>
__device__ __forceinline__ float run_terms(const signed char* q, const signed char* qa, const float* sa,
                                           const float* d, const float* dmin, const signed char* sc,
                                           const signed char* mins, const int* sums, int K, int r,
                                           float acc) {
    const int c0 = r * RUN;
    if (FMT == 0) {
        const int len = min(RUN, K - c0);
        const int i = dot_bytes(q + c0, qa + c0, len);
        return __fmaf_rn(__int2float_rn(i), __fmul_rn(sa[r], d[r]), acc);
    } else if (FMT == 1) {
        int i = 0, mn = 0;
#pragma unroll
        for (int j = 4 * r; j < 4 * r + 4; ++j) {
            i += (int)sc[j] * dot_bytes(q + 32 * j, qa + 32 * j, 32);
            mn += (int)mins[j] * sums[j];
        }
        const int b = r / 2;
        acc = __fmaf_rn(__int2float_rn(i), __fmul_rn(sa[r], d[b]), acc);
        return __fmaf_rn(__int2float_rn(mn), __fmul_rn(sa[r], -dmin[b]), acc);
    } else {
        int i = 0;
#pragma unroll
        for (int j = 8 * r; j < 8 * r + 8; ++j) i += (int)sc[j] * dot_bytes(q + 16 * j, qa + 16 * j, 16);
        return __fmaf_rn(__int2float_rn(i), __fmul_rn(sa[r], d[r / 2]), acc);
    }
}

// y[m, n] for one thread per output (grid x over outputs n, y over activation rows m): the runs in the
// four parts ⌊p·R/4⌋ .. ⌊(p+1)·R/4⌋, each from +0 in order, then (p0 + p1) + (p2 + p3). A row flagged
// in bad_rows is NaN. Weight arrays row-major: q [N, K]; d [N, scales a row] (Q8_0: R run scales;
// K-quants: K/256 block scales); dmin [N, K/256]; sc [N, K/sub]; mins [N, K/32].
template <int FMT, bool SHARE>
__device__ void qgemm_simt(const signed char* __restrict__ qa, const float* __restrict__ sa,
                           const int* __restrict__ sums32, const unsigned int* __restrict__ bad_rows,
                           const signed char* __restrict__ wq, const float* __restrict__ wd,
                           const float* __restrict__ wdmin, const signed char* __restrict__ wsc,
                           const signed char* __restrict__ wmins, int M, int N, int K,
                           float* __restrict__ y, Parts ps) {
    const int n = blockIdx.x * blockDim.x + threadIdx.x;
    const int m = blockIdx.y;
    if (n >= N || m >= M) return;
    const int R = (K + RUN - 1) / RUN;
    const int sub = FMT == 2 ? 16 : 32;
    const int scales_per_row = FMT == 0 ? R : K / 256;
    const signed char* q = wq + (size_t)n * K;
    const signed char* a = qa + (size_t)m * K;
    const float* s = sa + (size_t)m * R;
    const float* d = wd + (size_t)n * scales_per_row;
    const float* dm = wdmin + (FMT == 1 ? (size_t)n * (K / 256) : 0);
    const signed char* sc = wsc + (FMT == 0 ? 0 : (size_t)n * (K / sub));
    const signed char* mn = wmins + (FMT == 1 ? (size_t)n * (K / 32) : 0);
    const int* sums = sums32 + (FMT == 1 ? (size_t)m * (K / 32) : 0);
    float p[4];
#pragma unroll
    for (int part = 0; part < 4; ++part) {
        float acc = 0.f;
        for (int r = part_start<SHARE>(ps, part, R); r < part_start<SHARE>(ps, part + 1, R); ++r)
            acc = run_terms<FMT>(q, a, s, d, dm, sc, mn, sums, K, r, acc);
        p[part] = acc;
    }
    const float out = __fadd_rn(__fadd_rn(p[0], p[1]), __fadd_rn(p[2], p[3]));
    y[(size_t)m * N + n] = bad_rows[m] ? __int_as_float(0x7fc00000) : out;
}

#define QGEMM_ENTRY(NAME, FMT)                                                                         \
    extern "C" __global__ void NAME(const signed char* qa, const float* sa, const int* sums32,         \
                                    const unsigned int* bad_rows, const signed char* wq, const float* wd, \
                                    const float* wdmin, const signed char* wsc, const signed char* wmins, \
                                    int M, int N, int K, float* y) {                                   \
        PRISM_GRID_PROLOGUE();                                                                         \
        qgemm_simt<FMT, false>(qa, sa, sums32, bad_rows, wq, wd, wdmin, wsc, wmins, M, N, K, y, Parts{}); \
    }                                                                                                  \
    extern "C" __global__ void NAME##_share(                                                           \
        const signed char* qa, const float* sa, const int* sums32, const unsigned int* bad_rows,       \
        const signed char* wq, const float* wd, const float* wdmin, const signed char* wsc,            \
        const signed char* wmins, int M, int N, int K, float* y, Parts parts) {                        \
        PRISM_GRID_PROLOGUE();                                                                         \
        qgemm_simt<FMT, true>(qa, sa, sums32, bad_rows, wq, wd, wdmin, wsc, wmins, M, N, K, y, parts); \
    }

QGEMM_ENTRY(qgemm_run128_q8_0, 0)
QGEMM_ENTRY(qgemm_run128_k32, 1)
QGEMM_ENTRY(qgemm_run128_q6k, 2)

// ===================================================================================================
// The skinny Q8_0 kernel for a few activation rows (M ≤ MR ≤ 8: a decode step, a follow-up's tail):
// such a product reads every weight byte once and does little arithmetic on it, so it is bound by
// the weight stream, and the tiles' few large CTAs (one per 128 or 256 outputs) leave most SMs idle.
// Here a CTA is 4 warps, warp p runs part p (runs ⌊p·R/4⌋ .. ⌊(p+1)·R/4⌋, in order), and in a warp
// lane group g (8 lanes) owns output n = 4·blockIdx.x + g: lane j reads bytes 16j .. 16j + 15 of each
// run of the output's weight row and of each activation row, the 8 lanes' dp4a sums are added by
// shuffles (exact in int32), and each lane of the group promotes
//   acc[m] = fma(f32(I_r), sa_r · sw_r, acc[m])
// — qgemm_simt's float operations in its order. The parts meet in shared memory as
// (p0 + p1) + (p2 + p3). K is a multiple of 16 (a short last run: lanes past it read zeros); the
// activation scales are row-major [M, R] (sa_row_stride = R, sa_run_stride = 1).
// ===================================================================================================

// 16 weight bytes, streamed (read once: not kept in L1).
__device__ __forceinline__ int4 load_stream16(const signed char* p) {
    return __ldcs(reinterpret_cast<const int4*>(p));
}

__device__ __forceinline__ int dot16(int4 w, int4 a) {
    int s = __dp4a(w.x, a.x, 0);
    s = __dp4a(w.y, a.y, s);
    s = __dp4a(w.z, a.z, s);
    return __dp4a(w.w, a.w, s);
}

// Runs loaded ahead per lane.
#define GEMV_AHEAD 4

// Lane j's 16 bytes of runs r .. r + GEMV_AHEAD - 1 of a weight row and those runs' weight scales (zeros
// past the warp's part r1, past K, or for a lane group past N).
__device__ __forceinline__ void gemv_load_weights(const signed char* __restrict__ wrow,
                                                  const float* __restrict__ d, bool live, int r, int r1,
                                                  int j, int K, int4 (&w)[GEMV_AHEAD],
                                                  float (&sw)[GEMV_AHEAD]) {
#pragma unroll
    for (int u = 0; u < GEMV_AHEAD; ++u) {
        const int c = (r + u) * RUN + 16 * j;
        const bool in = live && r + u < r1;
        w[u] = (in && c < K) ? load_stream16(wrow + c) : make_int4(0, 0, 0, 0);
        sw[u] = in ? d[r + u] : 0.f;
    }
}

// The weights and their scales are written once at load, never by a kernel, so the first runs' are
// read before the grid dependency wait (the entry begins with PRISM_GRID_WAIT_LATER()): the weight
// stream starts while the kernel ahead on the stream (the activation's quantizer) still runs. Only the
// activation rows and their scales are read after PRISM_GRID_WAIT(); each later batch of weights is
// requested after the current batch's arithmetic.
template <int MR, bool SHARE>
__device__ void qgemv_q8_0(const signed char* __restrict__ qa, const float* __restrict__ sa,
                           const unsigned int* __restrict__ bad_rows, const signed char* __restrict__ wq,
                           const float* __restrict__ wd, int M, int N, int K, float* __restrict__ y,
                           Parts ps) {
    __shared__ float parts[4][MR][4];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 8, j = lane % 8;
    const int n = blockIdx.x * 4 + g;
    const bool live = n < N;
    const int R = (K + RUN - 1) / RUN;
    const int r0 = part_start<SHARE>(ps, warp, R), r1 = part_start<SHARE>(ps, warp + 1, R);
    const signed char* wrow = wq + (size_t)(live ? n : 0) * K;
    const float* d = wd + (size_t)(live ? n : 0) * R;
    int4 w[GEMV_AHEAD];
    float sw[GEMV_AHEAD];
    gemv_load_weights(wrow, d, live, r0, r1, j, K, w, sw);
    PRISM_GRID_WAIT();
    float acc[MR];
#pragma unroll
    for (int m = 0; m < MR; ++m) acc[m] = 0.f;
    // Every lane runs every iteration (the shuffles need the whole warp); a lane past N or past K
    // reads zeros.
    for (int r = r0; r < r1; r += GEMV_AHEAD) {
#pragma unroll
        for (int m = 0; m < MR; ++m) {
            if (m >= M) break;  // the same for the whole warp
            int4 a[GEMV_AHEAD];
            float s_a[GEMV_AHEAD];
#pragma unroll
            for (int u = 0; u < GEMV_AHEAD; ++u) {
                const int c = (r + u) * RUN + 16 * j;
                const bool in = r + u < r1;
                a[u] = (in && c < K) ? *reinterpret_cast<const int4*>(qa + (size_t)m * K + c)
                                     : make_int4(0, 0, 0, 0);
                s_a[u] = in ? sa[(size_t)m * R + r + u] : 0.f;
            }
#pragma unroll
            for (int u = 0; u < GEMV_AHEAD; ++u) {
                if (r + u >= r1) break;  // the same for the whole warp
                int s = dot16(w[u], a[u]);
                s += __shfl_xor_sync(0xffffffffu, s, 1);
                s += __shfl_xor_sync(0xffffffffu, s, 2);
                s += __shfl_xor_sync(0xffffffffu, s, 4);
                acc[m] = __fmaf_rn(__int2float_rn(s), __fmul_rn(s_a[u], sw[u]), acc[m]);
            }
        }
        gemv_load_weights(wrow, d, live, r + GEMV_AHEAD, r1, j, K, w, sw);
    }
    if (j == 0) {
#pragma unroll
        for (int m = 0; m < MR; ++m) parts[warp][m][g] = acc[m];
    }
    __syncthreads();
    const int t = threadIdx.x;
    if (t < 4 * MR) {
        const int m = t / 4, gg = t % 4, out_n = blockIdx.x * 4 + gg;
        if (m < M && out_n < N) {
            const float out = __fadd_rn(__fadd_rn(parts[0][m][gg], parts[1][m][gg]),
                                        __fadd_rn(parts[2][m][gg], parts[3][m][gg]));
            y[(size_t)m * N + out_n] = bad_rows[m] ? __int_as_float(0x7fc00000) : out;
        }
    }
}

#define QGEMV_ENTRY(NAME, MR, MIN_BLOCKS)                                                              \
    extern "C" __global__ void __launch_bounds__(128, MIN_BLOCKS) NAME(                                \
        const signed char* qa, const float* sa, const unsigned int* bad_rows, const signed char* wq,    \
        const float* wd, int M, int N, int K, float* y) {                                              \
        PRISM_GRID_WAIT_LATER();                                                                       \
        qgemv_q8_0<MR, false>(qa, sa, bad_rows, wq, wd, M, N, K, y, Parts{});                         \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(128, MIN_BLOCKS) NAME##_share(                        \
        const signed char* qa, const float* sa, const unsigned int* bad_rows, const signed char* wq,    \
        const float* wd, int M, int N, int K, float* y, Parts parts) {                                 \
        PRISM_GRID_WAIT_LATER();                                                                       \
        qgemv_q8_0<MR, true>(qa, sa, bad_rows, wq, wd, M, N, K, y, parts);                            \
    }

// MIN_BLOCKS keeps each entry's registers at what it had when weights were read after the wait (48, 56,
// 72, 72: 10, 9, 7 and 7 blocks an SM).
QGEMV_ENTRY(qgemv_q8_0_m1, 1, 10)
QGEMV_ENTRY(qgemv_q8_0_m2, 2, 9)
QGEMV_ENTRY(qgemv_q8_0_m4, 4, 7)
QGEMV_ENTRY(qgemv_q8_0_m8, 8, 7)

// ===================================================================================================
// The narrow Q8_0 kernel for 3 to 32 activation rows (a batch of a few decode steps): tensor cores
// through mma.sync m16n8k32 (s8 × s8 → exact s32) with the weight as the 16-row operand and the
// activation rows as the 8-column one, so a product of a few rows streams its weight bytes once,
// straight from global memory into the registers that feed the MMA, on every SM (the tiles' few large
// CTAs leave most SMs idle there).
//
// A warp owns WT tiles of 16 outputs (2 for 17 to 32 rows: each activation read feeds both) and MT
// tiles of 8 activation rows; a CTA NARROW_WARPS warps (consecutive outputs); grid y splits the contract's four parts over K into `splits` (1, 2 or 4) CTAs. Per run r,
// four MMAs a tile give the run's exact int32 sums I_r (the bytes of a run enter the MMA in another
// order than 0..127 — lane (g, t) feeds bytes 32t .. 32t + 31 of its rows, the same permutation for
// both operands — and an integer sum is exact in any order), then every output takes
//   acc = fma(f32(I_r), sa_r · sw_r, acc)
// — qgemm_simt's float operations in its order, parts from +0 and combined as (p0 + p1) + (p2 + p3):
// p0 waits in registers, p0 + p1 in shared memory, p2 in registers, then y = slot + (p2 + p3). A split
// CTA stores its share (a part, or the sum of two) in ws [splits, M, N] and the last of an output
// block's CTAs adds the shares in the same tree (the counters as the Hopper tile's: zero between
// launches, reset by the last CTA). A row flagged in bad_rows is NaN. K is a multiple of 32; the
// activation scales row-major [M, R]; the weight bytes row-major [N, K] with run scales wd [N, R].
// ===================================================================================================

#define NARROW_WARPS 4
// Runs of weight loaded ahead per lane: 2 runs of one weight tile, one run of two (the same bytes).
#define NARROW_AHEAD(WT) (WT == 1 ? 2 : 1)

__device__ __forceinline__ void mma_s8_16832(int (&c)[4], int a0, int a1, int a2, int a3, int b0, int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// 32 bytes of a row at p (16-byte aligned) as two int4 (streamed: read once, or through L1); zeros
// where !live.
__device__ __forceinline__ void load32(const signed char* p, bool live, int4& lo, int4& hi, bool stream) {
    if (!live) {
        lo = make_int4(0, 0, 0, 0);
        hi = lo;
    } else if (stream) {
        lo = __ldcs(reinterpret_cast<const int4*>(p));
        hi = __ldcs(reinterpret_cast<const int4*>(p + 16));
    } else {
        lo = __ldg(reinterpret_cast<const int4*>(p));
        hi = __ldg(reinterpret_cast<const int4*>(p + 16));
    }
}

// Word s of the 8 words in (lo, hi) (s known at compile time after unrolling).
__device__ __forceinline__ int word8(const int4& lo, const int4& hi, int s) {
    switch (s) {
        case 0: return lo.x;
        case 1: return lo.y;
        case 2: return lo.z;
        case 3: return lo.w;
        case 4: return hi.x;
        case 5: return hi.y;
        case 6: return hi.z;
        default: return hi.w;
    }
}

template <int MT, int WT, bool SHARE>
__device__ void qgemm_narrow_q8_0(const signed char* __restrict__ qa, const float* __restrict__ sa,
                                  const unsigned int* __restrict__ bad_rows, const signed char* __restrict__ wq,
                                  const float* __restrict__ wd, int M, int N, int K, float* __restrict__ y,
                                  float* __restrict__ ws, int splits, unsigned int* __restrict__ counters,
                                  Parts ps) {
    __shared__ float slot[NARROW_WARPS][WT * MT * 4][32];
    __shared__ int last_of_block;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    // The warp's 16 · WT outputs, in WT weight tiles of 16.
    const int n0 = (blockIdx.x * NARROW_WARPS + warp) * 16 * WT;
    const int R = K / RUN + (K % RUN != 0);
    const int z = blockIdx.y;
    const int part_lo = z * 4 / splits, part_hi = (z + 1) * 4 / splits;
    // This lane's two outputs of weight tile w (rows g and g + 8 of its 16).
    int na[WT], nb[WT];
    bool la[WT], lb[WT];
    const signed char *wa[WT], *wb[WT];
    const float *da[WT], *db[WT];
#pragma unroll
    for (int w = 0; w < WT; ++w) {
        na[w] = n0 + 16 * w + g;
        nb[w] = na[w] + 8;
        la[w] = na[w] < N;
        lb[w] = nb[w] < N;
        wa[w] = wq + (size_t)(la[w] ? na[w] : 0) * K + 32 * t;
        wb[w] = wq + (size_t)(lb[w] ? nb[w] : 0) * K + 32 * t;
        da[w] = wd + (size_t)(la[w] ? na[w] : 0) * R;
        db[w] = wd + (size_t)(lb[w] ? nb[w] : 0) * R;
    }
    float acc[WT][MT][4], hold[WT][MT][4];
#pragma unroll
    for (int w = 0; w < WT; ++w)
#pragma unroll
        for (int j = 0; j < MT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[w][j][e] = 0.f;
    // One run from the weight words of each tile's output g (wv[w][0..1]) and g + 8 (wv[w][2..3]):
    // per tile of 8 activation rows (read through L1, once for all weight tiles) the MMAs, then the
    // promotion of its outputs.
    auto run_once = [&](int r, const int4 (&wv)[WT][4]) {
        const int c = r * RUN + 32 * t;
        const bool in_k = c < K;
        float swa[WT], swb[WT];
#pragma unroll
        for (int w = 0; w < WT; ++w) {
            swa[w] = la[w] ? da[w][r] : 0.f;
            swb[w] = lb[w] ? db[w][r] : 0.f;
        }
#pragma unroll
        for (int j = 0; j < MT; ++j) {
            const int row = 8 * j + g;
            int4 xlo, xhi;
            load32(qa + (size_t)(row < M ? row : 0) * K + (in_k ? c : 0), row < M && in_k, xlo, xhi, false);
            const int m0 = 8 * j + 2 * t;
            const float s0 = m0 < M ? sa[(size_t)m0 * R + r] : 0.f;
            const float s1 = m0 + 1 < M ? sa[(size_t)(m0 + 1) * R + r] : 0.f;
#pragma unroll
            for (int w = 0; w < WT; ++w) {
                int ci[4] = {0, 0, 0, 0};
#pragma unroll
                for (int s = 0; s < 4; ++s)
                    mma_s8_16832(ci, word8(wv[w][0], wv[w][1], 2 * s), word8(wv[w][2], wv[w][3], 2 * s),
                                 word8(wv[w][0], wv[w][1], 2 * s + 1), word8(wv[w][2], wv[w][3], 2 * s + 1),
                                 word8(xlo, xhi, 2 * s), word8(xlo, xhi, 2 * s + 1));
                acc[w][j][0] = __fmaf_rn(__int2float_rn(ci[0]), __fmul_rn(s0, swa[w]), acc[w][j][0]);
                acc[w][j][1] = __fmaf_rn(__int2float_rn(ci[1]), __fmul_rn(s1, swa[w]), acc[w][j][1]);
                acc[w][j][2] = __fmaf_rn(__int2float_rn(ci[2]), __fmul_rn(s0, swb[w]), acc[w][j][2]);
                acc[w][j][3] = __fmaf_rn(__int2float_rn(ci[3]), __fmul_rn(s1, swb[w]), acc[w][j][3]);
            }
        }
    };
    // Output (w, j, e) of this lane: output n0 + 16w + g (+ 8 for e ≥ 2), activation row 8j + 2t + (e & 1).
    auto out_n = [&](int w, int e) { return e < 2 ? na[w] : nb[w]; };
    auto out_m = [&](int j, int e) { return 8 * j + 2 * t + (e & 1); };
    const bool warp_live = n0 < N;  // the same for the whole warp
    float* wz = ws + (size_t)z * M * N;
    if (warp_live) {
#pragma unroll 1
        for (int part = part_lo; part < part_hi; ++part) {
            const int r0 = part_start<SHARE>(ps, part, R), r1 = part_start<SHARE>(ps, part + 1, R);
#pragma unroll 1
            for (int r = r0; r < r1; r += NARROW_AHEAD(WT)) {
                int4 wv[NARROW_AHEAD(WT)][WT][4];
#pragma unroll
                for (int u = 0; u < NARROW_AHEAD(WT); ++u) {
                    const int c = (r + u) * RUN + 32 * t;
                    const bool in = r + u < r1 && c < K;
#pragma unroll
                    for (int w = 0; w < WT; ++w) {
                        load32(wa[w] + (size_t)(r + u) * RUN, in && la[w], wv[u][w][0], wv[u][w][1], true);
                        load32(wb[w] + (size_t)(r + u) * RUN, in && lb[w], wv[u][w][2], wv[u][w][3], true);
                    }
                }
#pragma unroll
                for (int u = 0; u < NARROW_AHEAD(WT); ++u) {
                    if (r + u >= r1) break;  // the same for the whole warp
                    run_once(r + u, wv[u]);
                }
            }
            // The end of part `part`, acc its sum.
#pragma unroll
            for (int w = 0; w < WT; ++w)
#pragma unroll
                for (int j = 0; j < MT; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int n = out_n(w, e), m = out_m(j, e);
                        const bool in = n < N && m < M;
                        float& a = acc[w][j][e];
                        if (splits == 4) {
                            if (in) wz[(size_t)m * N + n] = a;
                        } else if ((part & 1) == 0) {
                            hold[w][j][e] = a;
                        } else {
                            a = __fadd_rn(hold[w][j][e], a);
                            float& kept = slot[warp][(w * MT + j) * 4 + e][lane];
                            if (splits == 2) {
                                if (in) wz[(size_t)m * N + n] = a;
                            } else if (part == 1) {
                                kept = a;
                            } else {
                                const float v = __fadd_rn(kept, a);
                                if (in) y[(size_t)m * N + n] = bad_rows[m] ? __int_as_float(0x7fc00000) : v;
                            }
                        }
                        a = 0.f;
                    }
        }
    }
    if (splits == 1) return;
    // A split block: the last of its CTAs adds the shares in the contract's tree (4 splits:
    // (p0 + p1) + (p2 + p3); 2: the two sums) and resets the block's counter for the next launch.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned int* counter = counters + blockIdx.x;
        const bool last = atomicAdd(counter, 1u) == (unsigned)splits - 1;
        if (last) *counter = 0u;
        last_of_block = last;
    }
    __syncthreads();
    if (!last_of_block || !warp_live) return;
    __threadfence();
    const size_t share = (size_t)M * N;
#pragma unroll
    for (int w = 0; w < WT; ++w)
#pragma unroll
        for (int j = 0; j < MT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int n = out_n(w, e), m = out_m(j, e);
                if (n < N && m < M) {
                    const float* o = ws + (size_t)m * N + n;
                    float v = __fadd_rn(__ldcg(o), __ldcg(o + share));
                    if (splits == 4) v = __fadd_rn(v, __fadd_rn(__ldcg(o + 2 * share), __ldcg(o + 3 * share)));
                    y[(size_t)m * N + n] = bad_rows[m] ? __int_as_float(0x7fc00000) : v;
                }
            }
}

#define QGEMM_NARROW_ENTRY(NAME, MT, WT)                                                                \
    extern "C" __global__ void __launch_bounds__(32 * NARROW_WARPS) NAME(                               \
        const signed char* qa, const float* sa, const unsigned int* bad_rows, const signed char* wq,     \
        const float* wd, int M, int N, int K, float* y, float* ws, int splits, unsigned int* counters) { \
        PRISM_GRID_PROLOGUE();                                                                           \
        qgemm_narrow_q8_0<MT, WT, false>(qa, sa, bad_rows, wq, wd, M, N, K, y, ws, splits, counters,    \
                                         Parts{});                                                       \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(32 * NARROW_WARPS) NAME##_share(                       \
        const signed char* qa, const float* sa, const unsigned int* bad_rows, const signed char* wq,     \
        const float* wd, int M, int N, int K, float* y, float* ws, int splits, unsigned int* counters,   \
        Parts parts) {                                                                                   \
        PRISM_GRID_PROLOGUE();                                                                           \
        qgemm_narrow_q8_0<MT, WT, true>(qa, sa, bad_rows, wq, wd, M, N, K, y, ws, splits, counters,     \
                                        parts);                                                          \
    }

// Rows up to 8 · MT; a warp's outputs 16 · WT (`narrow_kernel` in crates/prism-quant/src/cuda.rs).
QGEMM_NARROW_ENTRY(qgemm_narrow_q8_0_m8, 1, 1)
QGEMM_NARROW_ENTRY(qgemm_narrow_q8_0_m16, 2, 1)
QGEMM_NARROW_ENTRY(qgemm_narrow_q8_0_m32, 4, 2)

// ===================================================================================================
// The Q8_0 tile for Hopper (sm_90a): warpgroup MMA fed by TMA, warp-specialized. The same bits as
// qgemm_run128_q8_0 above; only which thread does which output's work differs, never the order of an
// output's float operations.
//
// CTA tile: 128 activation rows × 128 weight rows; one stage is one run (128 bytes of K) of both, plus
// the run's 128 activation scales and 128 weight scales. Warpgroup 0 is the producer (one thread issues
// the stage's two TMA boxes and two bulk copies of scales); warpgroups 1 and 2 each own 64 activation
// rows × 128 outputs: per run four wgmma m64n128k32 (the first with scale-d = 0) give the run's exact
// int32 sums I_r in 64 registers a thread, then every output takes
//   acc = fma(f32(I_r), sa_r · sw_r, acc)
// (f32(I_r) is exact: |I_r| ≤ 2,080,768 < 2^24). The four
// parts: p0 waits in registers while part 1 runs, p0 + p1 in shared memory (the slot), p2 in registers
// while part 3 runs, then y = slot + (p2 + p3).
//
// Layouts: qa [M, K] and q [N, K] bytes (TMA maps, boxes of 128 bytes × 128 rows, 128-byte swizzle;
// rows and bytes past the tensor read as zero); activation scales sa_t [R, ldsa] (ldsa a multiple of 128
// ≥ M), weight scales sw_t [R, ldsw] (ldsw a multiple of 128 ≥ N, zero past N).
// ===================================================================================================

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define HAVE_WGMMA 1
#endif

struct alignas(64) TmaDesc {
    unsigned long long opaque[16];
};

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

#ifdef HAVE_WGMMA
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
    asm volatile("mbarrier.init.shared.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive_warp(unsigned long long* bar) {
    asm volatile(
        "{\n"
        ".reg .pred leader;\n"
        "elect.sync _|leader, 0xffffffff;\n"
        "@leader mbarrier.arrive.shared.b64 _, [%0];\n"
        "}\n" ::"r"(smem_addr(bar))
        : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n"
        "}\n" ::"r"(smem_addr(bar)),
        "r"(parity)
        : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
}
// One 2-D box of `tmap` at (c0 = byte of K, c1 = row) into shared memory at `dst`.
__device__ __forceinline__ void tma_load_2d(void* dst, const TmaDesc* tmap, int c0, int c1,
                                            unsigned long long* bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
        "[%4];\n" ::"r"(smem_addr(dst)),
        "l"(reinterpret_cast<unsigned long long>(tmap)), "r"(c0), "r"(c1), "r"(smem_addr(bar))
        : "memory");
}
// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to shared memory.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
            smem_addr(dst)),
        "l"(src), "r"(bytes), "r"(smem_addr(bar))
        : "memory");
}
__device__ __forceinline__ void tma_prefetch_desc(const TmaDesc* tmap) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<unsigned long long>(tmap)) : "memory");
}
// A K-major operand in shared memory with the 128-byte swizzle (rows of 128 bytes, 8-row groups 1,024
// bytes apart); a 32-byte K slice of a tile that starts on a 1,024-byte boundary is an offset of it.
__device__ __forceinline__ unsigned long long wgmma_desc(unsigned smem_address) {
    return (unsigned long long)((smem_address & 0x3FFFF) >> 4) | (1ull << 16) | ((1024ull >> 4) << 32) |
           (1ull << 62);
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Keeps the compiler from moving accesses of `acc` across this point (an in-flight wgmma owns them).
__device__ __forceinline__ void fence_acc(int (&acc)[64]) {
#pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+r"(acc[i])::"memory");
}
// d = a·b (scale_d = 0) or d += a·b, m64n128k32 s8 × s8 → s32. Register i of a thread of warp w (of
// the warpgroup), lane l: row 16·w + l/4 + 8·((i >> 1) & 1), column 8·(i >> 2) + 2·(l % 4) + (i & 1).
__device__ __forceinline__ void wgmma_m64n128k32_s8(int (&d)[64], unsigned long long da, unsigned long long db,
                                                    int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p;\n}\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31]), "+r"(d[32]), "+r"(d[33]), "+r"(d[34]), "+r"(d[35]), "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]), "+r"(d[40]), "+r"(d[41]), "+r"(d[42]), "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]), "+r"(d[48]), "+r"(d[49]), "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]), "+r"(d[56]), "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63])
        : "l"(da), "l"(db), "r"(scale_d)
        : "memory");
}
// The first product of a run: d = a·b, the old d not read (so the registers are free until then).
__device__ __forceinline__ void wgmma_m64n128k32_s8_first(int (&d)[64], unsigned long long da, unsigned long long db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p;\n}\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]), "=r"(d[4]), "=r"(d[5]), "=r"(d[6]), "=r"(d[7]), "=r"(d[8]), "=r"(d[9]), "=r"(d[10]), "=r"(d[11]), "=r"(d[12]), "=r"(d[13]), "=r"(d[14]), "=r"(d[15]), "=r"(d[16]), "=r"(d[17]), "=r"(d[18]), "=r"(d[19]), "=r"(d[20]), "=r"(d[21]), "=r"(d[22]), "=r"(d[23]), "=r"(d[24]), "=r"(d[25]), "=r"(d[26]), "=r"(d[27]), "=r"(d[28]), "=r"(d[29]), "=r"(d[30]), "=r"(d[31]), "=r"(d[32]), "=r"(d[33]), "=r"(d[34]), "=r"(d[35]), "=r"(d[36]), "=r"(d[37]), "=r"(d[38]), "=r"(d[39]), "=r"(d[40]), "=r"(d[41]), "=r"(d[42]), "=r"(d[43]), "=r"(d[44]), "=r"(d[45]), "=r"(d[46]), "=r"(d[47]), "=r"(d[48]), "=r"(d[49]), "=r"(d[50]), "=r"(d[51]), "=r"(d[52]), "=r"(d[53]), "=r"(d[54]), "=r"(d[55]), "=r"(d[56]), "=r"(d[57]), "=r"(d[58]), "=r"(d[59]), "=r"(d[60]), "=r"(d[61]), "=r"(d[62]), "=r"(d[63])
        : "l"(da), "l"(db), "r"(0)
        : "memory");
}
// m64n32k32 (the swapped tile below): d = a·b or d += a·b, the register layout of m64n128k32 with
// 16 registers a thread.
__device__ __forceinline__ void wgmma_m64n32k32_s8_first(int (&d)[16], unsigned long long da, unsigned long long db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p;\n}\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]), "=r"(d[4]), "=r"(d[5]), "=r"(d[6]), "=r"(d[7]), "=r"(d[8]), "=r"(d[9]), "=r"(d[10]), "=r"(d[11]), "=r"(d[12]), "=r"(d[13]), "=r"(d[14]), "=r"(d[15])
        : "l"(da), "l"(db), "r"(0)
        : "memory");
}
__device__ __forceinline__ void wgmma_m64n32k32_s8(int (&d)[16], unsigned long long da, unsigned long long db, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p;\n}\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15])
        : "l"(da), "l"(db), "r"(scale_d)
        : "memory");
}
#endif

// The tile's two shapes: BM = 128 activation rows × BN = 128 outputs (each consumer warpgroup 64 rows ×
// 128 outputs), or BM = 64 × BN = 256 (both warpgroups on the same 64 rows, 128 outputs each: for M a little
// over a multiple of 128, where a 128-row tile computes up to twice the rows). A stage: the A box, the B
// box, BM activation scales, BN weight scales, padded to 1,024 bytes (TMA's 128-byte swizzle repeats
// every 1,024). Then the part slot (a float for each consumer thread and output: 64 KiB) and the
// stages' full and empty barriers.
template <int BM>
struct QwTile {
    static constexpr int BN = 128 * 128 / BM;
    static constexpr int STAGES = BM == 128 ? 4 : 3;
    static constexpr int A = 0;
    static constexpr int B = BM * 128;
    static constexpr int SA = B + BN * 128;
    static constexpr int SW = SA + BM * 4;
    static constexpr int BYTES = SW + BN * 4;  // what TMA delivers a stage
    static constexpr int STAGE = (BYTES + 1023) / 1024 * 1024;
    static constexpr int SLOT = STAGES * STAGE;
    static constexpr int BARS = SLOT + 256 * 64 * 4;
    static constexpr int SMEM = BARS + 2 * STAGES * 8 + 1024;
};

// A consumer thread's 64 outputs of a tile: rows r0 and r0 + 8, columns col + 8·j and col + 8·j + 1
// (j < 16); element 4·j + 2·h + e is row r0 + 8·h, column col + 8·j + e.
// Stores v into out [M, N] (rows past M and columns past N skipped); NAN_ROWS: a row with a non-finite
// input (bad_rows) gets NaN.
template <bool NAN_ROWS>
__device__ __forceinline__ void qw_store(float* __restrict__ out, const float (&v)[64],
                                         const unsigned int* __restrict__ bad_rows, int r0, int col, int M,
                                         int N) {
    const bool bad0 = NAN_ROWS && r0 < M && bad_rows[r0];
    const bool bad1 = NAN_ROWS && r0 + 8 < M && bad_rows[r0 + 8];
#pragma unroll
    for (int j = 0; j < 16; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = r0 + 8 * h, cc = col + 8 * j;
            if (row >= M) continue;
            const bool bad = h ? bad1 : bad0;
            const float x0 = bad ? __int_as_float(0x7fc00000) : v[4 * j + 2 * h];
            const float x1 = bad ? __int_as_float(0x7fc00000) : v[4 * j + 2 * h + 1];
            float* o = out + (size_t)row * N + cc;
            if (cc + 1 < N && (N % 2) == 0) {
                *reinterpret_cast<float2*>(o) = make_float2(x0, x1);
            } else {
                if (cc < N) o[0] = x0;
                if (cc + 1 < N) o[1] = x1;
            }
        }
    }
}

// The shares that the split CTAs stored with qw_store<false> in ws [splits, M, N] at this thread's 64
// outputs, read from L2 (other CTAs' stores: ld.global.cg) and added in the contract's tree: 2 splits
// s0 + s1, 4 splits (p0 + p1) + (p2 + p3). Outputs past M or N: 0 (never stored).
__device__ __forceinline__ void qw_combine_cg(const float* __restrict__ ws, int splits, float (&v)[64], int r0,
                                              int col, int M, int N) {
    const size_t share = (size_t)M * N;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int row = r0 + 8 * (i >> 1), cc = col + 8 * j + (i & 1);
            float x = 0.f;
            if (row < M && cc < N) {
                const float* o = ws + (size_t)row * N + cc;
                x = __fadd_rn(__ldcg(o), __ldcg(o + share));
                if (splits == 4) x = __fadd_rn(x, __fadd_rn(__ldcg(o + 2 * share), __ldcg(o + 3 * share)));
            }
            v[4 * j + i] = x;
        }
    }
}

// Named barrier `id` (0 is __syncthreads) for `count` threads.
__device__ __forceinline__ void named_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// The grid is persistent: CTA b takes jobs b, b + gridDim.x, b + 2·gridDim.x, … of `jobs`, a job being
// one output tile's share of the contract's four parts over K (crates/prism-quant/src/cuda.rs
// `TileSchedule::job` is the same mapping, and its tests):
// - jobs 0 .. full − 1: tile j whole (all four parts; the CTA writes y itself);
// - the rest: the tiles from `full` on, each split over K into `splits` (1, 2 or 4) jobs, job z taking
//   parts 4z/splits .. 4(z+1)/splits (their runs in order, each part from +0) and writing, instead of y,
//   its share of the part tree to ws[z] ([splits, M, N]): with 4 splits its part, with 2 (p0 + p1) or
//   (p2 + p3); the last of a tile's jobs to finish (a counter a tile in tile_counters, zero before the
//   launch and left zero) then forms (p0 + p1) + (p2 + p3) and the non-finite rows into y.
// Tile t is activation tile mt and weight tile nt of the gx × gy tiles in the order of `group` (1:
// consecutive tiles share a weight tile; g > 1: g weight tiles for each activation tile, the activation
// tiles of a group in order, so a round of CTAs reuses both operands from L2).
// The stages' barriers run on across a CTA's jobs, so the producer loads the next job's first runs
// while the consumers finish the last one's.
//
// A consumer warpgroup, per run: its four wgmma, a wait for them, the promotion. p0 and p2 wait in
// registers (hold), p0 + p1 in the shared-memory slot; y = slot + (p2 + p3).
struct QwJob {
    int tile, mt, nt, z, splits;
};
__device__ __forceinline__ QwJob qw_job(int j, int full, int splits, int gx, int gy, int group) {
    QwJob job;
    if (j < full) {
        job.tile = j;
        job.z = 0;
        job.splits = 1;
    } else {
        job.tile = full + (j - full) / splits;
        job.z = (j - full) % splits;
        job.splits = splits;
    }
    job.mt = job.tile % gx;
    job.nt = job.tile / gx;
    if (group > 1) {
        const int per = gx * group, g = job.tile / per, within = job.tile % per;
        const int gsize = min(group, gy - g * group);
        job.nt = g * group + within % gsize;
        job.mt = within / gsize;
    }
    return job;
}

template <int BM, bool SHARE>
__device__ __forceinline__ void qgemm_wg_q8_0_body(const TmaDesc* tmap_a, const TmaDesc* tmap_b,
                                                   const float* __restrict__ sa_t, int ldsa,
                                                   const float* __restrict__ sw_t, int ldsw,
                                                   const unsigned int* __restrict__ bad_rows, int M, int N,
                                                   int K, float* __restrict__ y, float* __restrict__ ws,
                                                   int group, unsigned int* __restrict__ tile_counters,
                                                   int gx, int gy, int full, int splits_left, int jobs,
                                                   Parts ps) {
#ifdef HAVE_WGMMA
    extern __shared__ unsigned char smem_raw[];
    using T = QwTile<BM>;
    constexpr int STAGES = T::STAGES;
    unsigned char* smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
    unsigned long long* full_bar = reinterpret_cast<unsigned long long*>(smem + T::BARS);
    unsigned long long* empty = full_bar + STAGES;
    const int R = (K + 127) / 128;
    const int wg = threadIdx.x / 128;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full_bar + s, 1);
            mbar_init(empty + s, 8);  // the 8 consumer warps
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        if (threadIdx.x == 0) {
            tma_prefetch_desc(tmap_a);
            tma_prefetch_desc(tmap_b);
            unsigned it = 0;  // stages used so far, over all of this CTA's jobs
            for (int j = blockIdx.x; j < jobs; j += gridDim.x) {
                const QwJob job = qw_job(j, full, splits_left, gx, gy, group);
                const int m0 = job.mt * BM, n0 = job.nt * T::BN;
                const int r_lo = part_start<SHARE>(ps, job.z * 4 / job.splits, R);
                const int r_hi = part_start<SHARE>(ps, (job.z + 1) * 4 / job.splits, R);
                for (int r = r_lo; r < r_hi; ++r, ++it) {
                    const int s = it % STAGES;
                    mbar_wait(empty + s, ((it / STAGES) & 1) ^ 1);
                    unsigned char* st = smem + s * T::STAGE;
                    mbar_arrive_expect_tx(full_bar + s, T::BYTES);
                    tma_load_2d(st + T::A, tmap_a, r * 128, m0, full_bar + s);
                    tma_load_2d(st + T::B, tmap_b, r * 128, n0, full_bar + s);
                    bulk_load(st + T::SA, sa_t + (size_t)r * ldsa + m0, BM * 4, full_bar + s);
                    bulk_load(st + T::SW, sw_t + (size_t)r * ldsw + n0, T::BN * 4, full_bar + s);
                }
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
        // Consumer warpgroup c: rows 64·c .. 64·c + 63 of a 128-row tile, or outputs 128·c .. 128·c + 127
        // of a 64-row one.
        const int c = wg - 1;
        const int a_off = BM == 128 ? c * 64 * 128 : 0, b_off = BM == 128 ? 0 : c * 128 * 128;
        const int c_rows = BM == 128 ? 64 * c : 0, c_cols = BM == 128 ? 0 : 128 * c;
        const int t = threadIdx.x % 128, warp = t / 32, lane = t % 32;
        float* slot = reinterpret_cast<float*>(smem + T::SLOT) + c * 128 + t;  // element i at slot[256·i]
        const int row_in = c_rows + 16 * warp + lane / 4;  // the thread's rows: row_in, row_in + 8
        const int col_in = c_cols + 2 * (lane % 4);        // its columns: col_in + 8·j (+1)
        __shared__ int last_of_tile;
        unsigned it = 0;  // as the producer's
        // Waits for the next stage (run r's) and issues its four wgmma into acc.
        auto issue = [&](int (&acc)[64]) {
            const int s = it % STAGES;
            mbar_wait(full_bar + s, (it / STAGES) & 1);
            const unsigned char* st = smem + s * T::STAGE;
            const unsigned long long da = wgmma_desc(smem_addr(st + T::A + a_off));
            const unsigned long long db = wgmma_desc(smem_addr(st + T::B + b_off));
            wgmma_fence();
            // The boxes start on 1,024-byte boundaries, so the address field's low bits are free: the
            // K slices 32, 64 and 96 bytes on are ORs.
            wgmma_m64n128k32_s8_first(acc, da, db);
            wgmma_m64n128k32_s8(acc, da | 2, db | 2, 1);
            wgmma_m64n128k32_s8(acc, da | 4, db | 4, 1);
            wgmma_m64n128k32_s8(acc, da | 6, db | 6, 1);
            wgmma_commit();
            fence_acc(acc);
        };
        // Adds the stage's sums (acc, complete) to facc with its scales, then frees the stage.
        auto promote = [&](int (&acc)[64], float (&facc)[64]) {
            fence_acc(acc);
            const int s = it % STAGES;
            const unsigned char* st = smem + s * T::STAGE;
            const float* ssa = reinterpret_cast<const float*>(st + T::SA);
            const float* ssw = reinterpret_cast<const float*>(st + T::SW);
            const float a0 = ssa[row_in], a1 = ssa[row_in + 8];
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const float2 w = *reinterpret_cast<const float2*>(ssw + 8 * j + col_in);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int i = 4 * j + e;
                    const float pw = __fmul_rn((e & 2) ? a1 : a0, (e & 1) ? w.y : w.x);
                    facc[i] = __fmaf_rn(__int2float_rn(acc[i]), pw, facc[i]);
                }
            }
            mbar_arrive_warp(empty + s);
            ++it;
        };
#pragma unroll 1
        for (int j = blockIdx.x; j < jobs; j += gridDim.x) {
            const QwJob job = qw_job(j, full, splits_left, gx, gy, group);
            const int splits = job.splits;
            const int part_lo = job.z * 4 / splits, part_hi = (job.z + 1) * 4 / splits;
            const int r0 = job.mt * BM + row_in, col0 = job.nt * T::BN + col_in;
            float* wz = ws + (size_t)job.z * M * N;
            float facc[64];
            int acc[64];
            float hold[64];
#pragma unroll
            for (int i = 0; i < 64; ++i) facc[i] = 0.f;
#pragma unroll 1
            for (int part = part_lo; part < part_hi; ++part) {
#pragma unroll 1
                for (int r = part_start<SHARE>(ps, part, R); r < part_start<SHARE>(ps, part + 1, R); ++r) {
                    issue(acc);
                    wgmma_wait0();
                    promote(acc, facc);
                }
                // The end of part `part`, facc its sum.
                if (splits == 4) {
                    qw_store<false>(wz, facc, bad_rows, r0, col0, M, N);
                } else if ((part & 1) == 0) {
#pragma unroll
                    for (int i = 0; i < 64; ++i) hold[i] = facc[i];
                } else {
#pragma unroll
                    for (int i = 0; i < 64; ++i) facc[i] = __fadd_rn(hold[i], facc[i]);
                    if (splits == 2) {
                        qw_store<false>(wz, facc, bad_rows, r0, col0, M, N);
                    } else if (part == 1) {
#pragma unroll
                        for (int i = 0; i < 64; ++i) slot[256 * i] = facc[i];
                    } else {
#pragma unroll
                        for (int i = 0; i < 64; ++i) facc[i] = __fadd_rn(slot[256 * i], facc[i]);
                        qw_store<true>(y, facc, bad_rows, r0, col0, M, N);
                    }
                }
#pragma unroll
                for (int i = 0; i < 64; ++i) facc[i] = 0.f;
            }
            // A split tile: the last of its jobs to finish adds the shares in the contract's tree (4
            // splits: (p0 + p1) + (p2 + p3); 2: the two sums), whoever it is, and resets the tile's
            // counter for the next launch.
            if (splits > 1) {
                __threadfence();
                named_sync(1, 256);
                if (threadIdx.x == 128) {
                    unsigned int* counter = tile_counters + job.tile;
                    const bool last = atomicAdd(counter, 1u) == (unsigned)splits - 1;
                    if (last) *counter = 0u;
                    last_of_tile = last;
                }
                named_sync(1, 256);
                const bool last = last_of_tile;
                if (last) {
                    __threadfence();
                    qw_combine_cg(ws, splits, facc, r0, col0, M, N);
                    qw_store<true>(y, facc, bad_rows, r0, col0, M, N);
                }
            }
        }
    }
#endif
}

// A persistent grid of CTAs over the jobs described above qgemm_wg_q8_0_body.
#define QGEMM_WG(NAME, BM)                                                                                  \
    extern "C" __global__ void __launch_bounds__(384, 1)                                                    \
        NAME(const __grid_constant__ TmaDesc tmap_a, const __grid_constant__ TmaDesc tmap_b,                \
             const float* sa_t, int ldsa, const float* sw_t, int ldsw, const unsigned int* bad_rows, int M, \
             int N, int K, float* y, float* ws, int group, unsigned int* tile_counters, int gx, int gy,     \
             int full, int splits, int jobs) {                                                              \
        PRISM_GRID_PROLOGUE();                                                                              \
        qgemm_wg_q8_0_body<BM, false>(&tmap_a, &tmap_b, sa_t, ldsa, sw_t, ldsw, bad_rows, M, N, K, y, ws,  \
                                      group, tile_counters, gx, gy, full, splits, jobs, Parts{});           \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(384, 1)                                                    \
        NAME##_share(const __grid_constant__ TmaDesc tmap_a, const __grid_constant__ TmaDesc tmap_b,        \
                     const float* sa_t, int ldsa, const float* sw_t, int ldsw, const unsigned int* bad_rows, \
                     int M, int N, int K, float* y, float* ws, int group, unsigned int* tile_counters,      \
                     int gx, int gy, int full, int splits, int jobs, Parts parts) {                         \
        PRISM_GRID_PROLOGUE();                                                                              \
        qgemm_wg_q8_0_body<BM, true>(&tmap_a, &tmap_b, sa_t, ldsa, sw_t, ldsw, bad_rows, M, N, K, y, ws,   \
                                     group, tile_counters, gx, gy, full, splits, jobs, parts);              \
    }
QGEMM_WG(qgemm_wg_q8_0, 128)
QGEMM_WG(qgemm_wg_q8_0_m64, 64)

// ===================================================================================================
// The swapped Q8_0 tile for a few dozen activation rows (Hopper, sm_90a): the weight is wgmma's
// 64-row operand and the activation rows its N, so a CTA owns 64 outputs × NA = 32 activation rows
// (more rows: more activation tiles, each streaming the weight tile again, mostly from L2) and a
// product of a few dozen rows is cut into many small jobs: the weight stream of the 27B's
// projections spreads over every SM (the 64-row tile's 256-output tiles give 20 to 136 jobs there,
// for 132 SMs). A 64-row version (m64n64k32, 5 stages) lost to this one at every shape measured. A warp of producers (one thread: the stage's two TMA boxes and two bulk copies of
// scales) and one consumer warpgroup; two CTAs an SM. The same bits as qgemm_run128_q8_0: per run four
// wgmma m64nNAk32 give the exact int32 sums I_r, then every output takes
//   acc = fma(f32(I_r), sa_r · sw_r, acc)
// and the four parts are added as (p0 + p1) + (p2 + p3) (p0 in registers, p0 + p1 in the slot, p2 in
// registers; a split tile's shares through ws and the last of its CTAs, as the 64-row tile does).
// Register i of consumer thread t (warp w, lane l): output 16·w + l/4 + 8·((i >> 1) & 1) of the tile,
// activation row 8·(i >> 2) + 2·(l % 4) + (i & 1).
// ===================================================================================================

template <int NA>
struct QwsTile {
    static constexpr int NR = NA / 2;  // accumulator registers a consumer thread
    static constexpr int STAGES = 6;
    static constexpr int A = 0;                 // 64 weight rows × 128 bytes
    static constexpr int B = 64 * 128;          // NA activation rows × 128 bytes
    static constexpr int SA = B + NA * 128;     // NA activation scales
    static constexpr int SW = SA + NA * 4;      // 64 weight scales
    static constexpr int BYTES = SW + 64 * 4;   // what a stage receives
    static constexpr int STAGE = (BYTES + 1023) / 1024 * 1024;
    static constexpr int SLOT = STAGES * STAGE; // p0 + p1: NR floats a consumer thread
    static constexpr int BARS = SLOT + 128 * NR * 4;
    static constexpr int SMEM = BARS + 2 * STAGES * 8 + 1024;
};

#ifdef HAVE_WGMMA
template <int N>
__device__ __forceinline__ void fence_regs(int (&acc)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(acc[i])::"memory");
}
#endif

// Output and activation row of register i (see above): n = n_base + 8·((i >> 1) & 1), m = m_base + 8·(i >> 2) + (i & 1).
template <int NR, bool NAN_ROWS>
__device__ __forceinline__ void qws_store(float* __restrict__ out, const float (&v)[NR],
                                          const unsigned int* __restrict__ bad_rows, int n_base, int m_base,
                                          int M, int N) {
#pragma unroll
    for (int i = 0; i < NR; ++i) {
        const int n = n_base + 8 * ((i >> 1) & 1), m = m_base + 8 * (i >> 2) + (i & 1);
        if (n < N && m < M) out[(size_t)m * N + n] = NAN_ROWS && bad_rows[m] ? __int_as_float(0x7fc00000) : v[i];
    }
}

template <int NR>
__device__ __forceinline__ void qws_combine_cg(const float* __restrict__ ws, int splits, float (&v)[NR], int n_base,
                                               int m_base, int M, int N) {
    const size_t share = (size_t)M * N;
#pragma unroll
    for (int i = 0; i < NR; ++i) {
        const int n = n_base + 8 * ((i >> 1) & 1), m = m_base + 8 * (i >> 2) + (i & 1);
        float x = 0.f;
        if (n < N && m < M) {
            const float* o = ws + (size_t)m * N + n;
            x = __fadd_rn(__ldcg(o), __ldcg(o + share));
            if (splits == 4) x = __fadd_rn(x, __fadd_rn(__ldcg(o + 2 * share), __ldcg(o + 3 * share)));
        }
        v[i] = x;
    }
}

template <int NA, bool SHARE>
__device__ __forceinline__ void qgemm_wgs_q8_0_body(const TmaDesc* tmap_a, const TmaDesc* tmap_b,
                                                    const float* __restrict__ sa_t, int ldsa,
                                                    const float* __restrict__ sw_t, int ldsw,
                                                    const unsigned int* __restrict__ bad_rows, int M, int N,
                                                    int K, float* __restrict__ y, float* __restrict__ ws,
                                                    unsigned int* __restrict__ tile_counters, int gx, int gy,
                                                    int full, int splits_left, int jobs, Parts ps) {
#ifdef HAVE_WGMMA
    extern __shared__ unsigned char smem_raw[];
    using T = QwsTile<NA>;
    constexpr int STAGES = T::STAGES, NR = T::NR;
    unsigned char* smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
    unsigned long long* full_bar = reinterpret_cast<unsigned long long*>(smem + T::BARS);
    unsigned long long* empty = full_bar + STAGES;
    const int R = (K + 127) / 128;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full_bar + s, 1);
            mbar_init(empty + s, 4);  // the 4 consumer warps
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (warp == 4) {
        if (lane == 0) {
            tma_prefetch_desc(tmap_a);
            tma_prefetch_desc(tmap_b);
            unsigned it = 0;  // stages used so far, over all of this CTA's jobs
            for (int j = blockIdx.x; j < jobs; j += gridDim.x) {
                const QwJob job = qw_job(j, full, splits_left, gx, gy, 1);
                const int m0 = job.mt * NA, n0 = job.nt * 64;
                const int r_lo = part_start<SHARE>(ps, job.z * 4 / job.splits, R);
                const int r_hi = part_start<SHARE>(ps, (job.z + 1) * 4 / job.splits, R);
                for (int r = r_lo; r < r_hi; ++r, ++it) {
                    const int s = it % STAGES;
                    mbar_wait(empty + s, ((it / STAGES) & 1) ^ 1);
                    unsigned char* st = smem + s * T::STAGE;
                    mbar_arrive_expect_tx(full_bar + s, T::BYTES);
                    tma_load_2d(st + T::A, tmap_b, r * 128, n0, full_bar + s);
                    tma_load_2d(st + T::B, tmap_a, r * 128, m0, full_bar + s);
                    bulk_load(st + T::SA, sa_t + (size_t)r * ldsa + m0, NA * 4, full_bar + s);
                    bulk_load(st + T::SW, sw_t + (size_t)r * ldsw + n0, 64 * 4, full_bar + s);
                }
            }
        }
        return;
    }
    const int t = threadIdx.x;
    float* slot = reinterpret_cast<float*>(smem + T::SLOT) + t;  // element i at slot[128·i]
    const int row_in = 16 * warp + lane / 4;  // the thread's outputs in the tile: row_in, row_in + 8
    const int col_in = 2 * (lane % 4);        // its activation rows: col_in + 8·j (+1)
    __shared__ int last_of_tile;
    unsigned it = 0;  // as the producer's
#pragma unroll 1
    for (int j = blockIdx.x; j < jobs; j += gridDim.x) {
        const QwJob job = qw_job(j, full, splits_left, gx, gy, 1);
        const int splits = job.splits;
        const int part_lo = job.z * 4 / splits, part_hi = (job.z + 1) * 4 / splits;
        const int n_base = job.nt * 64 + row_in, m_base = job.mt * NA + col_in;
        float* wz = ws + (size_t)job.z * M * N;
        float facc[NR], hold[NR];
        int acc[NR];
#pragma unroll
        for (int i = 0; i < NR; ++i) facc[i] = 0.f;
#pragma unroll 1
        for (int part = part_lo; part < part_hi; ++part) {
#pragma unroll 1
            for (int r = part_start<SHARE>(ps, part, R); r < part_start<SHARE>(ps, part + 1, R); ++r) {
                const int s = it % STAGES;
                mbar_wait(full_bar + s, (it / STAGES) & 1);
                const unsigned char* st = smem + s * T::STAGE;
                const unsigned long long da = wgmma_desc(smem_addr(st + T::A));
                const unsigned long long db = wgmma_desc(smem_addr(st + T::B));
                wgmma_fence();
                wgmma_m64n32k32_s8_first(acc, da, db);
                wgmma_m64n32k32_s8(acc, da | 2, db | 2, 1);
                wgmma_m64n32k32_s8(acc, da | 4, db | 4, 1);
                wgmma_m64n32k32_s8(acc, da | 6, db | 6, 1);
                wgmma_commit();
                fence_regs(acc);
                wgmma_wait0();
                fence_regs(acc);
                const float* ssa = reinterpret_cast<const float*>(st + T::SA);
                const float* ssw = reinterpret_cast<const float*>(st + T::SW);
                const float w0 = ssw[row_in], w1 = ssw[row_in + 8];
#pragma unroll
                for (int jj = 0; jj < NA / 8; ++jj) {
                    const float2 a = *reinterpret_cast<const float2*>(ssa + 8 * jj + col_in);
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int i = 4 * jj + e;
                        const float pw = __fmul_rn((e & 1) ? a.y : a.x, (e & 2) ? w1 : w0);
                        facc[i] = __fmaf_rn(__int2float_rn(acc[i]), pw, facc[i]);
                    }
                }
                mbar_arrive_warp(empty + s);
                ++it;
            }
            // The end of part `part`, facc its sum.
            if (splits == 4) {
                qws_store<NR, false>(wz, facc, bad_rows, n_base, m_base, M, N);
            } else if ((part & 1) == 0) {
#pragma unroll
                for (int i = 0; i < NR; ++i) hold[i] = facc[i];
            } else {
#pragma unroll
                for (int i = 0; i < NR; ++i) facc[i] = __fadd_rn(hold[i], facc[i]);
                if (splits == 2) {
                    qws_store<NR, false>(wz, facc, bad_rows, n_base, m_base, M, N);
                } else if (part == 1) {
#pragma unroll
                    for (int i = 0; i < NR; ++i) slot[128 * i] = facc[i];
                } else {
#pragma unroll
                    for (int i = 0; i < NR; ++i) facc[i] = __fadd_rn(slot[128 * i], facc[i]);
                    qws_store<NR, true>(y, facc, bad_rows, n_base, m_base, M, N);
                }
            }
#pragma unroll
            for (int i = 0; i < NR; ++i) facc[i] = 0.f;
        }
        // A split tile: the last of its jobs to finish adds the shares in the contract's tree and
        // resets the tile's counter for the next launch.
        if (splits > 1) {
            __threadfence();
            named_sync(1, 128);
            if (t == 0) {
                unsigned int* counter = tile_counters + job.tile;
                const bool last = atomicAdd(counter, 1u) == (unsigned)splits - 1;
                if (last) *counter = 0u;
                last_of_tile = last;
            }
            named_sync(1, 128);
            const bool last = last_of_tile;
            named_sync(1, 128);  // last_of_tile is read before the next job's counter writes it
            if (last) {
                __threadfence();
                qws_combine_cg<NR>(ws, splits, facc, n_base, m_base, M, N);
                qws_store<NR, true>(y, facc, bad_rows, n_base, m_base, M, N);
            }
        }
    }
#endif
}

// Jobs as the 64-row tile's (qw_job, activation tiles of NA rows, weight tiles of 64 outputs); the
// grid is usually one CTA a job (crates/prism-quant/src/cuda.rs `TileSchedule::waves`).
#define QGEMM_WGS(NAME, NA)                                                                                 \
    extern "C" __global__ void __launch_bounds__(160, 2)                                                    \
        NAME(const __grid_constant__ TmaDesc tmap_a, const __grid_constant__ TmaDesc tmap_b,                \
             const float* sa_t, int ldsa, const float* sw_t, int ldsw, const unsigned int* bad_rows, int M, \
             int N, int K, float* y, float* ws, int group, unsigned int* tile_counters, int gx, int gy,     \
             int full, int splits, int jobs) {                                                              \
        PRISM_GRID_PROLOGUE();                                                                              \
        qgemm_wgs_q8_0_body<NA, false>(&tmap_a, &tmap_b, sa_t, ldsa, sw_t, ldsw, bad_rows, M, N, K, y, ws, \
                                       tile_counters, gx, gy, full, splits, jobs, Parts{});                \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(160, 2)                                                    \
        NAME##_share(const __grid_constant__ TmaDesc tmap_a, const __grid_constant__ TmaDesc tmap_b,        \
                     const float* sa_t, int ldsa, const float* sw_t, int ldsw, const unsigned int* bad_rows, \
                     int M, int N, int K, float* y, float* ws, int group, unsigned int* tile_counters,      \
                     int gx, int gy, int full, int splits, int jobs, Parts parts) {                         \
        PRISM_GRID_PROLOGUE();                                                                              \
        qgemm_wgs_q8_0_body<NA, true>(&tmap_a, &tmap_b, sa_t, ldsa, sw_t, ldsw, bad_rows, M, N, K, y, ws,  \
                                      tile_counters, gx, gy, full, splits, jobs, parts);                    \
    }
QGEMM_WGS(qgemm_wgs_q8_0_n32, 32)

// The integer matmul of issue #20's contract on CUDA: the arithmetic of crates/prism-quant/src/lib.rs
// ("The arithmetic, exactly"), bit for bit. A first, simple and correct version (one warp per activation
// run, one thread per output with dp4a); the tensor-core tiles come later and must return the same bits.
//
// Every float operation is an explicit round-to-nearest intrinsic (__fdiv_rn, __fmul_rn, __fmaf_rn,
// __fadd_rn, __int2float_rn), so nvcc cannot contract or reorder them. Integer sums are exact in any
// order.

#include <stdint.h>

#define RUN 128

// The smallest run maximum that still quantizes: 2^-120 (below it the run is zeros with scale 0).
#define AMAX_MIN 0x1p-120f

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// One warp per (row, run of 128): lane l holds the run's elements 4l .. 4l + 3 (a shorter last run:
// the missing elements are 0). Writes the int8 values, the run scale sa, the sums of each 32 values
// (want_sums: Q4_K / Q5_K, whose rows are whole 256-blocks) and, for a row holding a NaN or ±inf,
// bad_rows[row] = 1 (the buffer is zeroed before the launch). rows · runs warps; the block size is a
// multiple of 32.
extern "C" __global__ void quantize_act_run128(const float* __restrict__ x, int rows, int cols,
                                               signed char* __restrict__ qa, float* __restrict__ sa,
                                               int* __restrict__ sums32, int want_sums,
                                               unsigned int* __restrict__ bad_rows) {
    const int runs = (cols + RUN - 1) / RUN;
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (warp >= (long long)rows * runs) return;  // whole warps: warp is the same for its 32 lanes
    const int row = (int)(warp / runs), run = (int)(warp % runs);
    const int c0 = run * RUN, len = min(RUN, cols - c0);
    const float* xr = x + (size_t)row * cols + c0;
    float v[4];
    bool bad = false;
    float m = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int c = 4 * lane + i;
        v[i] = c < len ? xr[c] : 0.f;
        bad |= !isfinite(v[i]);
        m = fmaxf(m, fabsf(v[i]));  // the maximum of finite values is exact in any order
    }
    if (__any_sync(0xffffffffu, bad) && lane == 0) bad_rows[row] = 1u;
    const float amax = warp_max(m);
    float s = 0.f, inv = 0.f;
    if (amax >= AMAX_MIN) {
        s = __fdiv_rn(amax, 127.f);
        inv = __fdiv_rn(127.f, amax);
    }
    signed char* qr = qa + (size_t)row * cols + c0;
    int part = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float t = fminf(fmaxf(rintf(__fmul_rn(v[i], inv)), -127.f), 127.f);
        const int q = (int)t;
        part += q;
        if (4 * lane + i < len) qr[4 * lane + i] = (signed char)q;
    }
    if (lane == 0) sa[(size_t)row * runs + run] = s;
    if (want_sums) {
        // Lanes 8g .. 8g + 7 hold the 32 values of group g of the run.
        part += __shfl_xor_sync(0xffffffffu, part, 1);
        part += __shfl_xor_sync(0xffffffffu, part, 2);
        part += __shfl_xor_sync(0xffffffffu, part, 4);
        const int g = lane / 8;
        if (lane % 8 == 0 && 32 * g < len) sums32[((size_t)row * cols + c0) / 32 + g] = part;
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
template <int FMT>
__device__ void qgemm_simt(const signed char* __restrict__ qa, const float* __restrict__ sa,
                           const int* __restrict__ sums32, const unsigned int* __restrict__ bad_rows,
                           const signed char* __restrict__ wq, const float* __restrict__ wd,
                           const float* __restrict__ wdmin, const signed char* __restrict__ wsc,
                           const signed char* __restrict__ wmins, int M, int N, int K,
                           float* __restrict__ y) {
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
        for (int r = part * R / 4; r < (part + 1) * R / 4; ++r)
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
        qgemm_simt<FMT>(qa, sa, sums32, bad_rows, wq, wd, wdmin, wsc, wmins, M, N, K, y);             \
    }

QGEMM_ENTRY(qgemm_run128_q8_0, 0)
QGEMM_ENTRY(qgemm_run128_k32, 1)
QGEMM_ENTRY(qgemm_run128_q6k, 2)

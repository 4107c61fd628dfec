// Small fused kernels of the decoder: the CUDA twins of crates/prism-model/src/ops.rs (norms, SwiGLU,
// gates), delta_net.rs (`causal_conv`) and attention.rs (`CausalAttention`).
//
// Every output element (or row) is computed by one thread (or one warp, or one block) in a fixed order
// that depends only on its own position and the row length, so results do not depend on how many rows
// or sequences share a launch. Kernels that feed a bf16 GEMM can write their output in bf16 (rounded
// to nearest even, as candle's cast does), sparing the GEMM a separate cast.

#include "launch.cuh"
#include <cuda_bf16.h>


#define WARP 32

__device__ __forceinline__ float warp_sum(float x) {
    // A fixed butterfly: every lane ends with the same sum, in the same order for every row.
    for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
}

// Row r of a view of rows of D contiguous elements: (r / inner)·outer + (r % inner)·inner_stride
// elements from the view's start (a contiguous tensor: inner = 1, outer = D; a head-strided one, e.g.
// the query half of the fused [query | gate] projection: inner = heads).
__device__ __forceinline__ size_t row_offset(int r, long long inner, long long inner_stride, long long outer) {
    return (size_t)(r / inner) * (size_t)outer + (size_t)(r % inner) * (size_t)inner_stride;
}

__device__ __forceinline__ bool aligned16(const void* p) { return ((size_t)p & 15) == 0; }

// Elements i0..i0+3 of a row of D (those past D read as 0): one float4 load when `vec` (D % 4 == 0,
// 16-byte aligned row), else four loads. The values, hence the arithmetic on them, are the same.
__device__ __forceinline__ float4 load4(const float* p, int i0, int D, bool vec) {
    if (vec) return *reinterpret_cast<const float4*>(p + i0);
    float4 v;
    v.x = p[i0];
    v.y = i0 + 1 < D ? p[i0 + 1] : 0.f;
    v.z = i0 + 2 < D ? p[i0 + 2] : 0.f;
    v.w = i0 + 3 < D ? p[i0 + 3] : 0.f;
    return v;
}

// Stores elements i0..i0+3 (those below D) of a row at y (f32, or bf16 rounded to nearest even — the
// rounding of candle's f32 → bf16 cast, so a bf16 GEMM sees the same operand either way).
__device__ __forceinline__ void store4(void* y, size_t row_start, int i0, int D, float4 v, bool vec, int bf16) {
    if (bf16) {
        __nv_bfloat16* yb = reinterpret_cast<__nv_bfloat16*>(y) + row_start + i0;
        if (vec) {
            reinterpret_cast<__nv_bfloat162*>(yb)[0] = __floats2bfloat162_rn(v.x, v.y);
            reinterpret_cast<__nv_bfloat162*>(yb)[1] = __floats2bfloat162_rn(v.z, v.w);
        } else {
            yb[0] = __float2bfloat16_rn(v.x);
            if (i0 + 1 < D) yb[1] = __float2bfloat16_rn(v.y);
            if (i0 + 2 < D) yb[2] = __float2bfloat16_rn(v.z);
            if (i0 + 3 < D) yb[3] = __float2bfloat16_rn(v.w);
        }
    } else {
        float* yf = reinterpret_cast<float*>(y) + row_start + i0;
        if (vec) {
            *reinterpret_cast<float4*>(yf) = v;
        } else {
            yf[0] = v.x;
            if (i0 + 1 < D) yf[1] = v.y;
            if (i0 + 2 < D) yf[2] = v.z;
            if (i0 + 3 < D) yf[3] = v.w;
        }
    }
}

__device__ __forceinline__ void put(void* y, size_t i, float v, int bf16) {
    if (bf16) reinterpret_cast<__nv_bfloat16*>(y)[i] = __float2bfloat16_rn(v);
    else reinterpret_cast<float*>(y)[i] = v;
}

// candle's SiLU and σ, operation for operation (x / (1 + e^{-x}); 1 / (e^{-x} + 1)).
__device__ __forceinline__ float silu(float x) { return x / (1.f + expf(-x)); }
__device__ __forceinline__ float sigmoid(float x) { return 1.f / (expf(-x) + 1.f); }

// mode 0: y = x / sqrt(mean(x²) + eps) · w                 (RMSNorm)
// mode 1: y = x / sqrt(mean(x²) + eps) · w · silu(gate)    (the DeltaNet output norm)
// mode 2: y = x / sqrt(Σx² + eps)                           (l2norm of k)
// mode 3: y = (x / sqrt(Σx² + eps)) · scale + 0              (l2norm of q, then candle's affine by
//         1/√dk: one product rounded, then + 0, which turns a −0 into +0, as `q * s` did)
// With `res`, the row is x + res (res and sum_out contiguous [rows, D]); the sum is also written to
// sum_out (the residual stream), the same f32 additions as a separate add.
// y: contiguous [rows, D], f32 or (y_bf16) bf16.
//
// Two kernels, chosen by D alone (never by the row count), each reducing a row in an order that depends
// only on D, so a row's bits do not depend on the other rows of the call:
// - norm_rows_f32: one warp per row, 4 rows per block (short rows: head-dim norms, D = 128/256);
// - norm_rows_block_f32: one block of NORM_THREADS per row (hidden-size rows).

#define NORM_ARGS                                                                                   \
    const float* __restrict__ x, long long x_inner, long long x_istride, long long x_outer,        \
        const float* __restrict__ res, float* __restrict__ sum_out, const float* __restrict__ w,   \
        const float* __restrict__ gate, long long g_inner, long long g_istride, long long g_outer, \
        void* __restrict__ y, int y_bf16, int rows, int D, float eps, int mode, float scale

extern "C" __global__ void norm_rows_f32(NORM_ARGS) {
    PRISM_GRID_PROLOGUE();
    const int row = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    const int lane = threadIdx.x % WARP;
    if (row >= rows) return;
    const float* xr = x + row_offset(row, x_inner, x_istride, x_outer);
    const float* rr = res ? res + (size_t)row * D : nullptr;
    float* sr = rr && sum_out ? sum_out + (size_t)row * D : nullptr;
    float ss = 0.f;
    for (int i = lane; i < D; i += WARP) {
        float v = xr[i];
        if (rr) {
            v += rr[i];
            if (sr) sr[i] = v;
        }
        ss = fmaf(v, v, ss);
    }
    ss = warp_sum(ss);
    const float denom = mode >= 2 ? ss : ss / (float)D;
    const float inv = 1.f / sqrtf(denom + eps);
    const float* gr = mode == 1 ? gate + row_offset(row, g_inner, g_istride, g_outer) : nullptr;
    for (int i = lane; i < D; i += WARP) {
        float v = xr[i];
        if (rr) v += rr[i];
        float val = v * inv;
        if (mode < 2) val = val * w[i];
        if (mode == 1) val = val * silu(gr[i]);
        if (mode == 3) val = __fadd_rn(__fmul_rn(val, scale), 0.f);
        put(y, (size_t)row * D + i, val, y_bf16);
    }
}

#define NORM_THREADS 256

extern "C" __global__ void __launch_bounds__(NORM_THREADS) norm_rows_block_f32(NORM_ARGS) {
    PRISM_GRID_PROLOGUE();
    __shared__ float partial[NORM_THREADS / WARP];
    const int row = blockIdx.x;
    if (row >= rows) return;  // never: one block per row
    const float* xr = x + row_offset(row, x_inner, x_istride, x_outer);
    const float* rr = res ? res + (size_t)row * D : nullptr;
    float* sr = rr && sum_out ? sum_out + (size_t)row * D : nullptr;
    const float* gr = mode == 1 ? gate + row_offset(row, g_inner, g_istride, g_outer) : nullptr;
    // Thread t takes the groups of 4 elements t, t + NORM_THREADS, … in this order, vector loads or
    // not (alignment decides only how the same values are loaded).
    const bool vec = D % 4 == 0 && aligned16(xr) && (!rr || aligned16(rr)) && (!sr || aligned16(sr)) &&
                     (mode >= 2 || aligned16(w)) && (!gr || aligned16(gr)) &&
                     aligned16(reinterpret_cast<const char*>(y) + (size_t)row * D * (y_bf16 ? 2 : 4));
    float ss = 0.f;
    for (int i0 = 4 * threadIdx.x; i0 < D; i0 += 4 * NORM_THREADS) {
        float4 v = load4(xr, i0, D, vec);
        if (rr) {
            const float4 r = load4(rr, i0, D, vec);
            v.x += r.x; v.y += r.y; v.z += r.z; v.w += r.w;
            if (sr) store4(sr, 0, i0, D, v, vec, 0);
        }
        // Elements past D are 0 and add exactly nothing.
        ss = fmaf(v.x, v.x, ss);
        ss = fmaf(v.y, v.y, ss);
        ss = fmaf(v.z, v.z, ss);
        ss = fmaf(v.w, v.w, ss);
    }
    ss = warp_sum(ss);
    if (threadIdx.x % WARP == 0) partial[threadIdx.x / WARP] = ss;
    __syncthreads();
    // Every thread adds the warp sums in the same order and gets the same total.
    float total = 0.f;
#pragma unroll
    for (int k = 0; k < NORM_THREADS / WARP; ++k) total += partial[k];
    const float denom = mode >= 2 ? total : total / (float)D;
    const float inv = 1.f / sqrtf(denom + eps);
    for (int i0 = 4 * threadIdx.x; i0 < D; i0 += 4 * NORM_THREADS) {
        float4 v = load4(xr, i0, D, vec);
        if (rr) {
            const float4 r = load4(rr, i0, D, vec);
            v.x += r.x; v.y += r.y; v.z += r.z; v.w += r.w;
        }
        v.x = v.x * inv; v.y = v.y * inv; v.z = v.z * inv; v.w = v.w * inv;
        if (mode < 2) {
            const float4 wv = load4(w, i0, D, vec);
            v.x = v.x * wv.x; v.y = v.y * wv.y; v.z = v.z * wv.z; v.w = v.w * wv.w;
        }
        if (mode == 1) {
            const float4 g = load4(gr, i0, D, vec);
            v.x = v.x * silu(g.x); v.y = v.y * silu(g.y); v.z = v.z * silu(g.z); v.w = v.w * silu(g.w);
        }
        if (mode == 3) {
            v.x = __fadd_rn(__fmul_rn(v.x, scale), 0.f);
            v.y = __fadd_rn(__fmul_rn(v.y, scale), 0.f);
            v.z = __fadd_rn(__fmul_rn(v.z, scale), 0.f);
            v.w = __fadd_rn(__fmul_rn(v.w, scale), 0.f);
        }
        store4(y, (size_t)row * D, i0, D, v, vec, y_bf16);
    }
}

// Causal depthwise conv of one segment against the window of its K−1 earlier inputs; the same
// products and sums, in the same order, as the CPU's `causal_conv` (no fused multiply-add), so the
// results are bitwise equal. out: [T, C]; new_window: [K−1, C] (the last K−1 inputs).
extern "C" __global__ void causal_conv_f32(const float* __restrict__ x,       // [T, C]
                                           const float* __restrict__ window,  // [K-1, C]
                                           const float* __restrict__ taps,    // [K, C]
                                           float* __restrict__ out, float* __restrict__ new_window,
                                           int T, int C, int K) {
    PRISM_GRID_PROLOGUE();
    const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const size_t total = (size_t)(T + K - 1) * C;
    if (idx >= total) return;
    const int row = (int)(idx / C), c = (int)(idx % C);
    // padded row p: the window for p < K−1, else x[p − (K−1)]
#define PADDED(p) ((p) < K - 1 ? window[(size_t)(p) * C + c] : x[(size_t)((p) - (K - 1)) * C + c])
    if (row < T) {
        float acc = __fmul_rn(PADDED(row), taps[c]);
        for (int tap = 1; tap < K; ++tap)
            acc = __fadd_rn(acc, __fmul_rn(PADDED(row + tap), taps[(size_t)tap * C + c]));
        out[(size_t)row * C + c] = acc;
    } else {
        const int w = row - T;  // new window row w is padded row T + w
        new_window[(size_t)w * C + c] = PADDED(T + w);
    }
#undef PADDED
}

// Causal attention with an online softmax, keys in increasing order. q: [T, n_h, hd]; k, v:
// [n_kv, past + T, hd]; out: [T, n_h·hd]. Query t (absolute past + t) reads keys 0..=past+t; head h
// reads KV head h / (n_h / n_kv). hd must be a multiple of 32, at most 256.
//
// One block per (ROWS consecutive query rows, HEADS query heads of one KV group), one warp per (row,
// head). The block stages tiles of ATT_KEYS keys and values in shared memory once for all its warps
// (the group's heads and the neighbouring rows read the same keys), instead of each warp streaming
// them from L2. Each warp does, per key and in key order, exactly what the one-warp-per-row version
// did: the score is lane-strided fmaf partial sums, a fixed butterfly, times the scale; then the
// online-softmax update. The scores of a tile are formed first (independent across keys, so they
// overlap) and kept one per lane; the update then walks them in order. The float sequence of an
// output depends only on its (row, head) and its keys, never on T, the tiling or the other rows.
#define ATT_KEYS 32

extern "C" __global__ void causal_attention_f32(const float* __restrict__ q, const float* __restrict__ k,
                                                const float* __restrict__ v, float* __restrict__ out,
                                                int T, int n_h, int n_kv, int hd, int past,
                                                float scale, int rows_per_block, int heads_per_block) {
    PRISM_GRID_PROLOGUE();
    extern __shared__ float att_smem[];
    float* Ks = att_smem;               // [ATT_KEYS][hd]
    float* Vs = att_smem + ATT_KEYS * hd;  // [ATT_KEYS][hd]
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int group = n_h / n_kv;
    const int splits = group / heads_per_block;  // blocks per KV head
    const int kv = blockIdx.y / splits;
    const int h = kv * group + (blockIdx.y % splits) * heads_per_block + warp % heads_per_block;
    const int row0 = blockIdx.x * rows_per_block;
    const int t = row0 + warp / heads_per_block;
    const bool live = t < T;
    const int total = past + T;
    const int per_lane = hd / WARP;
    float qv[8], acc[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) qv[e] = acc[e] = 0.f;
    if (live) {
        const float* qr = q + ((size_t)t * n_h + h) * hd;
#pragma unroll
        for (int e = 0; e < 8; ++e)
            if (e < per_lane) qv[e] = qr[lane + e * WARP];
    }
    const float* kb = k + (size_t)kv * total * hd;
    const float* vb = v + (size_t)kv * total * hd;
    float m = -INFINITY, l = 0.f;
    const int n_keys = past + t + 1;
    const int block_keys = past + min(T, row0 + rows_per_block);  // keys of the block's last row
    for (int j0 = 0; j0 < block_keys; j0 += ATT_KEYS) {
        const int nk = min(ATT_KEYS, block_keys - j0);
        __syncthreads();
        for (int idx = threadIdx.x; idx < nk * hd; idx += blockDim.x) {
            Ks[idx] = kb[(size_t)j0 * hd + idx];
            Vs[idx] = vb[(size_t)j0 * hd + idx];
        }
        __syncthreads();
        if (!live) continue;
        const int mine = min(nk, n_keys - j0);  // keys of this tile that this row reads
        if (mine <= 0) continue;
        // The tile's scores, lane jj keeping key jj's.
        float my_score = 0.f;
#pragma unroll 4
        for (int jj = 0; jj < mine; ++jj) {
            const float* kj = Ks + jj * hd;
            float part = 0.f;
            #pragma unroll
            for (int e = 0; e < 8; ++e)
                if (e < per_lane) part = fmaf(qv[e], kj[lane + e * WARP], part);
            const float s = warp_sum(part) * scale;
            if (lane == jj) my_score = s;
        }
        for (int jj = 0; jj < mine; ++jj) {
            const float s = __shfl_sync(0xffffffffu, my_score, jj);
            const float m_new = fmaxf(m, s);
            const float corr = expf(m - m_new);
            const float p = expf(s - m_new);
            l = l * corr + p;
            const float* vj = Vs + jj * hd;
            #pragma unroll
            for (int e = 0; e < 8; ++e)
                if (e < per_lane) acc[e] = fmaf(p, vj[lane + e * WARP], acc[e] * corr);
            m = m_new;
        }
    }
    if (!live) return;
    float* o = out + ((size_t)t * n_h + h) * hd;
    const float inv = 1.f / l;
    #pragma unroll
    for (int e = 0; e < 8; ++e)
        if (e < per_lane) o[lane + e * WARP] = acc[e] * inv;
}

// SwiGLU on the fused gate | up projection: row r of gu (row stride `stride` elements) holds gate in
// columns 0..f and up in f..2f; y[r, c] = silu(gate) · up (contiguous [rows, f], f32 or bf16). One
// thread per 4 columns; the same two roundings per element as candle's silu then mul.
extern "C" __global__ void swiglu_f32(const float* __restrict__ gu, long long stride, void* __restrict__ y,
                                      int y_bf16, int rows, int f) {
    PRISM_GRID_PROLOGUE();
    const int groups = (f + 3) / 4;
    const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)rows * groups) return;
    const int row = (int)(idx / groups), i0 = (int)(idx % groups) * 4;
    const float* g = gu + (size_t)row * stride;
    const float* u = g + f;
    const bool vec = f % 4 == 0 && aligned16(g) && aligned16(u);
    const float4 a = load4(g, i0, f, vec), b = load4(u, i0, f, vec);
    float4 o;
    o.x = silu(a.x) * b.x;
    o.y = silu(a.y) * b.y;
    o.z = silu(a.z) * b.z;
    o.w = silu(a.w) * b.w;
    store4(y, (size_t)row * f, i0, f, o, vec, y_bf16);
}

// The DeltaNet gates from the fused projection's β and α columns (row strides b_stride, a_stride):
// beta = σ(b), g = softplus(a + dt_bias) · ssm_a, with softplus(x) = max(x, 0) + ln(1 + e^{−|x|});
// both [rows, H] contiguous. The operations of ops::sigmoid and ops::softplus, in their order.
extern "C" __global__ void deltanet_gates_f32(const float* __restrict__ b, long long b_stride,
                                              const float* __restrict__ a, long long a_stride,
                                              const float* __restrict__ dt_bias, const float* __restrict__ ssm_a,
                                              float* __restrict__ beta, float* __restrict__ g, int rows, int H) {
    PRISM_GRID_PROLOGUE();
    const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)rows * H) return;
    const int row = (int)(idx / H), h = (int)(idx % H);
    beta[idx] = sigmoid(b[(size_t)row * b_stride + h]);
    const float x = a[(size_t)row * a_stride + h] + dt_bias[h];
    const float sp = fmaxf(x, 0.f) + logf(expf(-fabsf(x)) + 1.f);
    g[idx] = sp * ssm_a[h];
}

// The attention output gate: y[r, j] = attn[r, j] · σ(gate(r, j)) for attn contiguous [rows, W]; the
// gate of column j is element j % hd of gate row r·(W / hd) + j / hd, a rows-of-hd view (row_offset;
// e.g. the gate halves of the [query | gate] projection, read in place). y: [rows, W], f32 or bf16.
extern "C" __global__ void sigmoid_gate_f32(const float* __restrict__ attn, const float* __restrict__ gate,
                                            long long g_inner, long long g_istride, long long g_outer, int hd,
                                            void* __restrict__ y, int y_bf16, int rows, int W) {
    PRISM_GRID_PROLOGUE();
    const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)rows * W) return;
    const int row = (int)(idx / W), j = (int)(idx % W);
    const int grow = row * (W / hd) + j / hd;
    const float gt = gate[row_offset(grow, g_inner, g_istride, g_outer) + j % hd];
    put(y, idx, attn[idx] * sigmoid(gt), y_bf16);
}

// The DeltaNet conv + SiLU of one segment, reading its q|k|v columns in place: x row t at t·x_stride;
// out: contiguous [T, C] (the segment's rows of the layer's output), new_window: [K−1, C]. Each
// output is the sum of `causal_conv_f32` (same products and sums in the same order, so bitwise the
// CPU's conv) followed by candle's SiLU. blockIdx.y < gridDim.y − 1: rows CONV_ROWS·y.. of the
// segment, the padded inputs kept in registers as they slide; the last row of blocks writes the window,
// and with snap_p ≥ 0 (≤ T) also the window after the segment's first snap_p rows to snap_window
// ([K−1, C]: a snapshot state's window, copied from the same inputs).
#define CONV_ROWS 8

template <int KT>
__device__ __forceinline__ void conv_silu_rows(const float* __restrict__ x, long long x_stride,
                                               const float* __restrict__ window, const float* __restrict__ taps,
                                               float* __restrict__ out, int r0, int T, int C, int c) {
#define PADDED(p) ((p) < KT - 1 ? window[(size_t)(p) * C + c] : x[(size_t)((p) - (KT - 1)) * x_stride + c])
    float tp[KT], win[KT];
#pragma unroll
    for (int tap = 0; tap < KT; ++tap) tp[tap] = taps[(size_t)tap * C + c];
#pragma unroll
    for (int j = 0; j < KT - 1; ++j) win[j] = PADDED(r0 + j);
#pragma unroll
    for (int rr = 0; rr < CONV_ROWS; ++rr) {
        const int r = r0 + rr;
        if (r >= T) break;
        win[KT - 1] = PADDED(r + KT - 1);
        float acc = __fmul_rn(win[0], tp[0]);
#pragma unroll
        for (int tap = 1; tap < KT; ++tap) acc = __fadd_rn(acc, __fmul_rn(win[tap], tp[tap]));
        out[(size_t)r * C + c] = silu(acc);
#pragma unroll
        for (int j = 0; j < KT - 1; ++j) win[j] = win[j + 1];
    }
#undef PADDED
}

extern "C" __global__ void causal_conv_silu_f32(const float* __restrict__ x, long long x_stride,
                                                const float* __restrict__ window,  // [K-1, C]
                                                const float* __restrict__ taps,    // [K, C]
                                                float* __restrict__ out, float* __restrict__ new_window,
                                                float* __restrict__ snap_window, int snap_p,
                                                int T, int C, int K) {
    PRISM_GRID_PROLOGUE();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
#define PADDED(p) ((p) < K - 1 ? window[(size_t)(p) * C + c] : x[(size_t)((p) - (K - 1)) * x_stride + c])
    if (blockIdx.y == gridDim.y - 1) {
        for (int w = 0; w < K - 1; ++w) new_window[(size_t)w * C + c] = PADDED(T + w);
        if (snap_p >= 0)
            for (int w = 0; w < K - 1; ++w) snap_window[(size_t)w * C + c] = PADDED(snap_p + w);
        return;
    }
    const int r0 = blockIdx.y * CONV_ROWS;
    if (K == 4) {
        conv_silu_rows<4>(x, x_stride, window, taps, out, r0, T, C, c);
        return;
    }
    for (int r = r0; r < min(T, r0 + CONV_ROWS); ++r) {
        float acc = __fmul_rn(PADDED(r), taps[c]);
        for (int tap = 1; tap < K; ++tap) acc = __fadd_rn(acc, __fmul_rn(PADDED(r + tap), taps[(size_t)tap * C + c]));
        out[(size_t)r * C + c] = silu(acc);
    }
#undef PADDED
}

// The conv + SiLU of many one-token segments at once (decode steps): segment s reads its input row
// args.row[s] of x (at x_stride), its own window args.window[s] ([K-1, C], anywhere on the device), writes
// output row args.row[s] of out ([N, C]) and its new window to new_windows[s] ([count, K-1, C]). The same
// products and sums in the same order as causal_conv_silu_f32 for T = 1, so bit for bit the same.
#define CONV_DECODE_MAX 64
struct ConvDecodeArgs {
    const float* window[CONV_DECODE_MAX];
    int row[CONV_DECODE_MAX];
    int count;
};

extern "C" __global__ void causal_conv_silu_decode_f32(const float* __restrict__ x, long long x_stride,
                                                       ConvDecodeArgs args, const float* __restrict__ taps,
                                                       float* __restrict__ out, float* __restrict__ new_windows,
                                                       int C, int K) {
    PRISM_GRID_PROLOGUE();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int s = blockIdx.y;
    if (c >= C || s >= args.count) return;
    const float* __restrict__ w = args.window[s];
    const int r = args.row[s];
    const float xv = x[(size_t)r * x_stride + c];
    float acc = __fmul_rn(w[c], taps[c]);
    for (int tap = 1; tap < K; ++tap) {
        const float v = tap < K - 1 ? w[(size_t)tap * C + c] : xv;
        acc = __fadd_rn(acc, __fmul_rn(v, taps[(size_t)tap * C + c]));
    }
    out[(size_t)r * C + c] = silu(acc);
    float* __restrict__ nw = new_windows + (size_t)s * (K - 1) * C;
    for (int j = 0; j + 1 < K - 1; ++j) nw[(size_t)j * C + c] = w[(size_t)(j + 1) * C + c];
    nw[(size_t)(K - 2) * C + c] = xv;
}

// The attention layer's q and k heads: the zero-centred RMSNorm of each head (weights as stored), then
// the partial M-RoPE rotation of its first `rot` dims (NeoX halves: element i pairs with i + rot/2),
// the remaining dims passed through. One warp per head row; q rows (N·n_h) first, then k rows
// (N·n_kv). q and k are rows-of-D views (row_offset; e.g. the query halves of [query | gate] and the
// key columns of the fused projection, read in place); cos, sin: contiguous [N, rot/2] f32, the
// tensors `MRope::cos_sin` made. q_out: [N, n_h, D], k_out: [N, n_kv, D], each f32 or bf16 (RNE).
//
// Bit for bit the chain it replaces: the sum of squares is norm_rows_f32's (lane-strided fmaf, the
// same butterfly) for the same D, the normalised value the same two products, and the rotation
// candle's separate ops (x1·cos − x2·sin, x2·cos + x1·sin), each product and sum rounded on its own
// (the _rn intrinsics keep nvcc from contracting them into fma). The partner element of the rotation
// is normalised again from its input rather than exchanged: the same two products give the same value.
extern "C" __global__ void qk_norm_rope_f32(const float* __restrict__ q, long long q_inner, long long q_istride,
                                            long long q_outer, const float* __restrict__ k, long long k_inner,
                                            long long k_istride, long long k_outer, const float* __restrict__ q_w,
                                            const float* __restrict__ k_w, const float* __restrict__ cos_t,
                                            const float* __restrict__ sin_t, void* __restrict__ q_out, int q_bf16,
                                            void* __restrict__ k_out, int k_bf16, int n_tokens, int n_h, int n_kv,
                                            int D, int rot, float eps) {
    PRISM_GRID_PROLOGUE();
    const int row = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    const int lane = threadIdx.x % WARP;
    const int q_rows = n_tokens * n_h;
    if (row >= q_rows + n_tokens * n_kv) return;
    const bool is_q = row < q_rows;
    const int r = is_q ? row : row - q_rows;
    const int token = is_q ? r / n_h : r / n_kv;
    const float* xr = is_q ? q + row_offset(r, q_inner, q_istride, q_outer) : k + row_offset(r, k_inner, k_istride, k_outer);
    const float* w = is_q ? q_w : k_w;
    void* y = is_q ? q_out : k_out;
    const int y_bf16 = is_q ? q_bf16 : k_bf16;
    float ss = 0.f;
    for (int i = lane; i < D; i += WARP) {
        const float v = xr[i];
        ss = fmaf(v, v, ss);
    }
    ss = warp_sum(ss);
    const float denom = ss / (float)D;
    const float inv = 1.f / sqrtf(denom + eps);
    const int half = rot / 2;
    const float* cr = cos_t + (size_t)token * half;
    const float* sr = sin_t + (size_t)token * half;
    for (int i = lane; i < D; i += WARP) {
        const float a = __fmul_rn(__fmul_rn(xr[i], inv), w[i]);
        float val = a;
        if (i < half) {
            const float b = __fmul_rn(__fmul_rn(xr[i + half], inv), w[i + half]);
            val = __fsub_rn(__fmul_rn(a, cr[i]), __fmul_rn(b, sr[i]));
        } else if (i < rot) {
            const float b = __fmul_rn(__fmul_rn(xr[i - half], inv), w[i - half]);
            val = __fadd_rn(__fmul_rn(a, cr[i - half]), __fmul_rn(b, sr[i - half]));
        }
        put(y, (size_t)r * D + i, val, y_bf16);
    }
}

// =====================================================================================================
// The vision tower's row kernels (crates/prism-model/src/vision.rs on CUDA): each replaces a chain of
// candle's broadcast ops, whose strided indexing dominated the tower's time. One block of ROW_THREADS a
// row; the sums and maxima are block reductions in a fixed order (thread-strided partials, then the
// warps in order), so a row's result depends on that row alone.
// =====================================================================================================

#define ROW_THREADS 256

// The block's sum (op 0) or maximum (op 1) of each thread's v; every thread gets it.
__device__ __forceinline__ float block_reduce(float v, int op, float* scratch) {
    for (int off = 16; off > 0; off >>= 1) {
        const float o = __shfl_xor_sync(0xffffffffu, v, off);
        v = op ? fmaxf(v, o) : v + o;
    }
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    __syncthreads();  // scratch may still be read by a previous reduction
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float total = scratch[0];
    for (int w = 1; w < ROW_THREADS / WARP; ++w) total = op ? fmaxf(total, scratch[w]) : total + scratch[w];
    return total;
}

// LayerNorm of contiguous rows [rows, D]: mean = Σx / D, c = x − mean, var = Σc² / D,
// y = c · (1 / sqrt(var + eps)) · w + b (each operation rounded on its own, as the CPU's chain of ops).
extern "C" __global__ void __launch_bounds__(ROW_THREADS)
layer_norm_rows_f32(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ b, int D,
                    float eps, float* __restrict__ y) {
    PRISM_GRID_PROLOGUE();
    __shared__ float scratch[ROW_THREADS / WARP];
    const float* xr = x + (size_t)blockIdx.x * D;
    float* yr = y + (size_t)blockIdx.x * D;
    float s = 0.f;
    for (int i = threadIdx.x; i < D; i += ROW_THREADS) s += xr[i];
    const float mean = __fdiv_rn(block_reduce(s, 0, scratch), (float)D);
    float s2 = 0.f;
    for (int i = threadIdx.x; i < D; i += ROW_THREADS) {
        const float c = __fsub_rn(xr[i], mean);
        s2 = __fadd_rn(s2, __fmul_rn(c, c));
    }
    const float var = __fdiv_rn(block_reduce(s2, 0, scratch), (float)D);
    const float inv = __frcp_rn(__fsqrt_rn(__fadd_rn(var, eps)));
    for (int i = threadIdx.x; i < D; i += ROW_THREADS) {
        const float c = __fsub_rn(xr[i], mean);
        yr[i] = __fadd_rn(__fmul_rn(__fmul_rn(c, inv), w[i]), b[i]);
    }
}

// Softmax of scale · x over contiguous rows [rows, D], in place: s = x · scale, e = exp(s − max s),
// y = e / Σe.
extern "C" __global__ void __launch_bounds__(ROW_THREADS)
softmax_rows_scaled_f32(float* __restrict__ x, int D, float scale) {
    PRISM_GRID_PROLOGUE();
    __shared__ float scratch[ROW_THREADS / WARP];
    float* xr = x + (size_t)blockIdx.x * D;
    float m = -INFINITY;
    for (int i = threadIdx.x; i < D; i += ROW_THREADS) m = fmaxf(m, __fmul_rn(xr[i], scale));
    m = block_reduce(m, 1, scratch);
    float s = 0.f;
    for (int i = threadIdx.x; i < D; i += ROW_THREADS) {
        const float e = expf(__fsub_rn(__fmul_rn(xr[i], scale), m));
        xr[i] = e;
        s += e;
    }
    const float total = block_reduce(s, 0, scratch);
    for (int i = threadIdx.x; i < D; i += ROW_THREADS) xr[i] = __fdiv_rn(xr[i], total);
}

// The tower's fused q|k|v [n, 3, heads, hd] (contiguous) split into q, k, v [heads, n, hd], the 2-D
// rotary embedding applied to q and k: x · cos + rotate_half(x) · sin with cos, sin [n, hd] and
// rotate_half(x)[d] = −x[d + hd/2] for d < hd/2, x[d − hd/2] after. One thread an output element.
extern "C" __global__ void vision_qkv_rope_f32(const float* __restrict__ qkv, const float* __restrict__ cosv,
                                               const float* __restrict__ sinv, int n, int heads, int hd,
                                               float* __restrict__ q, float* __restrict__ k, float* __restrict__ v) {
    PRISM_GRID_PROLOGUE();
    const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x, per = (size_t)heads * n * hd;
    if (idx >= 3 * per) return;
    const int which = (int)(idx / per);
    const size_t o = idx % per;
    const int h = (int)(o / ((size_t)n * hd)), p = (int)(o / hd % n), d = (int)(o % hd);
    const float* row = qkv + ((size_t)p * 3 + which) * heads * hd + (size_t)h * hd;
    if (which == 2) {
        v[o] = row[d];
        return;
    }
    const int half = hd / 2;
    const float rh = d < half ? -row[d + half] : row[d - half];
    const float val = __fadd_rn(__fmul_rn(row[d], cosv[(size_t)p * hd + d]), __fmul_rn(rh, sinv[(size_t)p * hd + d]));
    (which == 0 ? q : k)[o] = val;
}

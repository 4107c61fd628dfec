// Small fused kernels of the decoder: the CUDA twins of crates/prism-model/src/ops.rs (norms),
// delta_net.rs (`causal_conv`) and attention.rs (`CausalAttention`).
//
// Every output element (or row) is computed by one thread (or one warp) in a fixed order that depends
// only on its own position, so results do not depend on how many rows or sequences share a launch.

#define WARP 32

__device__ __forceinline__ float warp_sum(float x) {
    // A fixed butterfly: every lane ends with the same sum, in the same order for every row.
    for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
}

// mode 0: y = x / sqrt(mean(x²) + eps) · w                 (RMSNorm)
// mode 1: y = x / sqrt(mean(x²) + eps) · w · silu(gate)    (the DeltaNet output norm)
// mode 2: y = x / sqrt(Σx² + eps)                           (l2norm of q and k)
// One warp per row of D elements; 4 rows per block of 128 threads.
extern "C" __global__ void norm_rows_f32(const float* __restrict__ x, const float* __restrict__ w,
                                         const float* __restrict__ gate, float* __restrict__ y,
                                         int rows, int D, float eps, int mode) {
    const int row = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    const int lane = threadIdx.x % WARP;
    if (row >= rows) return;
    const float* xr = x + (size_t)row * D;
    float ss = 0.f;
    for (int i = lane; i < D; i += WARP) ss = fmaf(xr[i], xr[i], ss);
    ss = warp_sum(ss);
    const float denom = mode == 2 ? ss : ss / (float)D;
    const float inv = 1.f / sqrtf(denom + eps);
    float* yr = y + (size_t)row * D;
    for (int i = lane; i < D; i += WARP) {
        float val = xr[i] * inv;
        if (mode != 2) val = val * w[i];
        if (mode == 1) {
            const float gt = gate[(size_t)row * D + i];
            val = val * (gt / (1.f + expf(-gt)));
        }
        yr[i] = val;
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

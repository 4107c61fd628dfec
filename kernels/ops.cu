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

// Causal attention, one warp per (query row, head), keys in increasing order with an online softmax.
// q: [T, n_h, hd]; k, v: [n_kv, past + T, hd]; out: [T, n_h·hd]. Query t (absolute past + t) reads keys
// 0..=past+t; head h reads KV head h / (n_h / n_kv). hd must be a multiple of 32, at most 256.
extern "C" __global__ void causal_attention_f32(const float* __restrict__ q, const float* __restrict__ k,
                                                const float* __restrict__ v, float* __restrict__ out,
                                                int T, int n_h, int n_kv, int hd, int past,
                                                float scale) {
    const int row = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;  // t * n_h + h
    const int lane = threadIdx.x % WARP;
    if (row >= T * n_h) return;
    const int t = row / n_h, h = row % n_h;
    const int kv = h / (n_h / n_kv);
    const int total = past + T;
    const int per_lane = hd / WARP;
    float qv[8], acc[8];
    const float* qr = q + (size_t)row * hd;
    for (int e = 0; e < per_lane; ++e) {
        qv[e] = qr[lane + e * WARP];
        acc[e] = 0.f;
    }
    const float* kb = k + (size_t)kv * total * hd;
    const float* vb = v + (size_t)kv * total * hd;
    float m = -INFINITY, l = 0.f;
    const int n_keys = past + t + 1;
    for (int j = 0; j < n_keys; ++j) {
        const float* kj = kb + (size_t)j * hd;
        float part = 0.f;
        for (int e = 0; e < per_lane; ++e) part = fmaf(qv[e], kj[lane + e * WARP], part);
        const float s = warp_sum(part) * scale;
        const float m_new = fmaxf(m, s);
        const float corr = expf(m - m_new);
        const float p = expf(s - m_new);
        l = l * corr + p;
        const float* vj = vb + (size_t)j * hd;
        for (int e = 0; e < per_lane; ++e) acc[e] = fmaf(p, vj[lane + e * WARP], acc[e] * corr);
        m = m_new;
    }
    float* o = out + (size_t)row * hd;
    const float inv = 1.f / l;
    for (int e = 0; e < per_lane; ++e) o[lane + e * WARP] = acc[e] * inv;
}

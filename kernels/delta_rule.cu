// The gated delta rule, chunked (WY) form in row order: the CUDA twin of
// crates/prism-model/src/delta_rule.rs (`chunked`). See that file for the formulas.
//
// One block per (value head, slice of CW value columns). The columns of the memory S are independent:
// column j of S, of the new values u and of the outputs o only ever read column j (the k·k and q·k
// scalars are shared), so a head splits into dv / CW blocks without any communication. Every chunk of
// 64 tokens (at absolute multiples of 64, as on the CPU) is done in five steps:
//   1. the chunk's rows of k̂ go to shared memory; Γ (cumulative log-decay, f64) and β too;
//   2. A[r][s] = β_r (k̂_r·k̂_s) e^{Γ_r−Γ_s} (s < r) and B[r][s] = (q̂_r·k̂_s) e^{Γ_r−Γ_s} (s ≤ r),
//      RK = K S₀ and RQ = Q S₀ for this block's columns;
//   3. the triangular solve for u (one thread per column, rows in order);
//   4. o_r = e^{Γ_r} RQ_r + Σ_{s≤r} B[r][s] u_s;
//   5. at the chunk's end S ← e^{Γ_63} S + Σ_s e^{Γ_63−Γ_s} k̂_s u_sᵀ.
// A call may start and end inside a chunk: the state carries S at the last boundary plus the pending
// rows (k̂_s, u_s, Γ_s), exactly like the CPU path, so any split of a sequence into calls does the same
// operations on the same values in the same order. Every element is computed by one thread in a fixed
// order that depends only on its position, never on T, the other heads or the other sequences: the
// kernel is batch-invariant and split-invariant (not bitwise equal to the CPU, whose dot products use
// 8 lanes).

#define CHUNK 64
#define CW 32
#define THREADS 256

extern "C" __global__ void __launch_bounds__(THREADS)
delta_rule_chunked_f32(const float* __restrict__ q,      // [T, H, dk]
                       const float* __restrict__ k,      // [T, H, dk]
                       const float* __restrict__ v,      // [T, H, dv]
                       const float* __restrict__ g,      // [T, H]
                       const float* __restrict__ beta,   // [T, H]
                       const float* __restrict__ s_in,   // [H, dk, dv]
                       const float* __restrict__ pk_in,  // [H, CHUNK, dk]
                       const float* __restrict__ pu_in,  // [H, CHUNK, dv]
                       const double* __restrict__ gam_in,// [H, CHUNK]
                       float* __restrict__ out,          // [T, H, dv]
                       float* __restrict__ s_out,
                       float* __restrict__ pk_out,
                       float* __restrict__ pu_out,
                       double* __restrict__ gam_out,
                       int T, int H, int dk, int dv, int pending) {
    extern __shared__ double smem_d[];
    const int h = blockIdx.x;
    const int c0 = blockIdx.y * CW;
    const int tid = threadIdx.x;
    const int ks = dk + 1;  // padded row stride of the staged keys (no bank conflicts)

    double* gam = smem_d;                        // [CHUNK]
    float* S = (float*)(gam + CHUNK);            // [dk][CW]
    float* U = S + dk * CW;                      // [CHUNK][CW]
    float* A = U + CHUNK * CW;                   // [CHUNK][CHUNK]
    float* B = A + CHUNK * CHUNK;                // [CHUNK][CHUNK]
    float* RK = B + CHUNK * CHUNK;               // [CHUNK][CW]
    float* RQ = RK + CHUNK * CW;                 // [CHUNK][CW]
    float* Kc = RQ + CHUNK * CW;                 // [CHUNK][ks]
    float* te = Kc + CHUNK * ks;                 // [CHUNK] decay to the chunk end
    float* bet = te + CHUNK;                     // [CHUNK]

    for (int idx = tid; idx < dk * CW; idx += THREADS) {
        const int i = idx / CW, j = idx % CW;
        S[idx] = s_in[((size_t)h * dk + i) * dv + c0 + j];
    }
    int r0 = pending;
    for (int idx = tid; idx < r0 * dk; idx += THREADS) {
        const int s = idx / dk, i = idx % dk;
        Kc[s * ks + i] = pk_in[((size_t)h * CHUNK + s) * dk + i];
    }
    for (int idx = tid; idx < r0 * CW; idx += THREADS) {
        const int s = idx / CW, j = idx % CW;
        U[idx] = pu_in[((size_t)h * CHUNK + s) * dv + c0 + j];
    }
    for (int s = tid; s < r0; s += THREADS) gam[s] = gam_in[h * CHUNK + s];
    __syncthreads();

    int t = 0;
    while (t < T) {
        const int n = min(CHUNK - r0, T - t);
        const int r1 = r0 + n;
        // 1. stage the new rows
        for (int idx = tid; idx < n * dk; idx += THREADS) {
            const int rr = idx / dk, i = idx % dk;
            Kc[(r0 + rr) * ks + i] = k[((size_t)(t + rr) * H + h) * dk + i];
        }
        if (tid == 0) {
            double acc = r0 == 0 ? 0.0 : gam[r0 - 1];
            for (int r = r0; r < r1; ++r) {
                acc += (double)g[(size_t)(t + r - r0) * H + h];
                gam[r] = acc;
                bet[r] = beta[(size_t)(t + r - r0) * H + h];
            }
        }
        __syncthreads();
        // 2. the pair scalars and the reads of S₀
        for (int idx = tid; idx < n * CHUNK; idx += THREADS) {
            const int r = r0 + idx / CHUNK, s = idx % CHUNK;
            if (s > r) continue;
            const float* qr = q + ((size_t)(t + r - r0) * H + h) * dk;
            const float* kr = Kc + r * ks;
            const float* kk = Kc + s * ks;
            float dq = 0.f, dkk = 0.f;
            for (int i = 0; i < dk; ++i) {
                dq = fmaf(qr[i], kk[i], dq);
                dkk = fmaf(kr[i], kk[i], dkk);
            }
            if (s < r) {
                const float d = (float)exp(gam[r] - gam[s]);
                A[r * CHUNK + s] = bet[r] * dkk * d;
                B[r * CHUNK + s] = dq * d;
            } else {
                B[r * CHUNK + s] = dq;
            }
        }
        for (int idx = tid; idx < n * CW; idx += THREADS) {
            const int r = r0 + idx / CW, j = idx % CW;
            const float* qr = q + ((size_t)(t + r - r0) * H + h) * dk;
            const float* kr = Kc + r * ks;
            float rk = 0.f, rq = 0.f;
            for (int i = 0; i < dk; ++i) {
                const float sij = S[i * CW + j];
                rk = fmaf(kr[i], sij, rk);
                rq = fmaf(qr[i], sij, rq);
            }
            RK[r * CW + j] = rk;
            RQ[r * CW + j] = rq;
        }
        __syncthreads();
        // 3. the new values, row by row (one thread per column)
        if (tid < CW) {
            const int j = tid;
            for (int r = r0; r < r1; ++r) {
                const float decay = (float)exp(gam[r]);
                const float vv = v[((size_t)(t + r - r0) * H + h) * dv + c0 + j];
                float u = bet[r] * fmaf(-decay, RK[r * CW + j], vv);
                for (int s = 0; s < r; ++s) u = fmaf(-A[r * CHUNK + s], U[s * CW + j], u);
                U[r * CW + j] = u;
            }
        }
        __syncthreads();
        // 4. outputs
        for (int idx = tid; idx < n * CW; idx += THREADS) {
            const int r = r0 + idx / CW, j = idx % CW;
            const float decay = (float)exp(gam[r]);
            float o = decay * RQ[r * CW + j];
            for (int s = 0; s <= r; ++s) o = fmaf(B[r * CHUNK + s], U[s * CW + j], o);
            out[((size_t)(t + r - r0) * H + h) * dv + c0 + j] = o;
        }
        // 5. close a full chunk
        if (r1 == CHUNK) {
            const double last = gam[CHUNK - 1];
            for (int s = tid; s < CHUNK; s += THREADS) te[s] = (float)exp(last - gam[s]);
            __syncthreads();
            const float decay_all = (float)exp(last);
            for (int idx = tid; idx < dk * CW; idx += THREADS) {
                const int i = idx / CW, j = idx % CW;
                float acc = decay_all * S[idx];
                for (int s = 0; s < CHUNK; ++s) acc = fmaf(te[s] * Kc[s * ks + i], U[s * CW + j], acc);
                S[idx] = acc;
            }
            r0 = 0;
        } else {
            r0 = r1;
        }
        __syncthreads();
        t += n;
    }

    // The new state: S at the last boundary and the pending rows (unused rows are zero).
    for (int idx = tid; idx < dk * CW; idx += THREADS) {
        const int i = idx / CW, j = idx % CW;
        s_out[((size_t)h * dk + i) * dv + c0 + j] = S[idx];
    }
    for (int idx = tid; idx < CHUNK * CW; idx += THREADS) {
        const int s = idx / CW, j = idx % CW;
        pu_out[((size_t)h * CHUNK + s) * dv + c0 + j] = s < r0 ? U[idx] : 0.f;
    }
    if (blockIdx.y == 0) {
        for (int idx = tid; idx < CHUNK * dk; idx += THREADS) {
            const int s = idx / dk, i = idx % dk;
            pk_out[((size_t)h * CHUNK + s) * dk + i] = s < r0 ? Kc[s * ks + i] : 0.f;
        }
        for (int s = tid; s < CHUNK; s += THREADS) gam_out[h * CHUNK + s] = s < r0 ? gam[s] : 0.0;
    }
}

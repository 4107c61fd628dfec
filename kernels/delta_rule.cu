// The gated delta rule, chunked (WY) form in row order: the CUDA twin of
// crates/prism-model/src/delta_rule.rs (`chunked`, `chunked_batch`). See that file for the formulas.
//
// Launches cover whole chunks of 64 tokens at absolute multiples of 64 (a segment's first chunk may
// continue the pending rows of its state), two kernels each (described below with their batching):
//
//  * the pair kernel, one block per (value head, chunk): the chunk's cumulative log-decays Γ (f64) and
//    the pair scalars A[r][s] = β_r (k̂_r·k̂_s) e^{Γ_r−Γ_s} (s < r) and B[r][s] = (q̂_r·k̂_s) e^{Γ_r−Γ_s}
//    (s ≤ r). They do not depend on the memory, so all chunks of all heads run in parallel; they go to
//    a scratch buffer (transposed: At[s][r], Bt[s][r]).
//  * the scan kernel, one block per (value head, slice of CW value columns), chunks in order: RK = K S₀
//    and RQ = Q S₀ (register tiles), the triangular solve for the new values
//      u_r = β_r (v_r − e^{Γ_r} RK_r) − Σ_{s<r} A[r][s] u_s
//    and the outputs o_r = e^{Γ_r} RQ_r + Σ_{s≤r} B[r][s] u_s (one warp per 4 columns, one lane per
//    row pair, column-oriented: when u_s is final it is broadcast and every later row takes its
//    term), then at a chunk's end S ← e^{Γ_63} S + Σ_s e^{Γ_63−Γ_s} k̂_s u_sᵀ (register tiles).
//
// Invariance. Every float the kernels produce is formed by the same sequence of operations, and that
// sequence depends only on the element's own position (head, chunk-relative row r, column j, i) and
// its own inputs:
//   Γ_r   = ((Γ_{r0−1} + g_{r0}) + …) + g_r in f64, row order (pending rows come from the state);
//   dots  k̂_r·k̂_s, q̂_r·k̂_s, RK_rj, RQ_rj: fmaf over i = 0..dk−1 in order, from 0;
//   A     = (β_r · dot) · (float)exp(Γ_r − Γ_s);  B = dot · (float)exp(Γ_r − Γ_s)  (B[r][r] = dot);
//   u_rj  = β_r · fmaf(−e^{Γ_r}, RK_rj, v_rj), then fmaf(−A[r][s], u_sj, ·) for s = 0..r−1 in order;
//   o_rj  = e^{Γ_r} · RQ_rj, then fmaf(B[r][s], u_sj, ·) for s = 0..r in order;
//   S_ij  = e^{Γ_63} · S_ij, then fmaf(e^{Γ_63−Γ_s} · k̂_si, u_sj, ·) for s = 0..63 in order.
// A call that starts mid-chunk finds the earlier rows' k̂_s, u_s, Γ_s in the state bit for bit, so any
// split of a sequence into calls (and any split of a call into launches, see cuda_delta.rs) gives the
// same bits, whatever T, the grid, the other heads or the other segments of the launch. (Not bitwise
// equal to the CPU, whose dot products use 8 lanes.) The per-segment kernels these replaced (one
// launch per segment, the history in docs/optimization-log.md) formed the same sequences; they were
// deleted once the device checks had compared them bit for bit on every case.

#include "launch.cuh"
#define CHUNK 64
#define CW 32
#define THREADS 256
// Row stride of the transposed key/query tiles Xt[i][r] (16-byte aligned, fewer bank conflicts).
#define XS (CHUNK + 4)
// Row stride of the U and O tiles [r][CW] (rows land on distinct banks for the lane-per-row solve).
#define US (CW + 4)

__device__ __forceinline__ float f4(const float4& x, int e) {
    return e == 0 ? x.x : e == 1 ? x.y : e == 2 ? x.z : x.w;
}

// Rows r0..r1 of chunk c of this launch; row r is token t0 + c·CHUNK − pending + r of the inputs.
__device__ __forceinline__ void chunk_rows(int c, int pending, int T, int* r0, int* r1) {
    *r0 = c == 0 ? pending : 0;
    *r1 = min(CHUNK, pending + T - c * CHUNK);
}

// =====================================================================================================
// The batched kernels: what the model runs (`prism_model::cuda_delta`). Compared with one launch per
// segment:
//  * One launch covers up to MAXSEG independent segments (sequences whose starting state is known),
//    each with its own rows of the packed inputs, its own state and its own pending rows. Blocks pick
//    (value head, chunk of a segment) in the pair kernel and (value head, column slice, segment) in the
//    scan kernel; a segment's arithmetic does not depend on the others in the launch.
//  * q̂ and k̂ may hold fewer heads than v (HK dividing H): value head h reads key head h mod HK, so the
//    GQA tiling needs no copies. v is read through a row stride (a column range of the conv output).
//  * The pair kernel also writes, per (chunk, head), Γ and the f32 factors e^{Γ_r}, e^{Γ_63−Γ_s}, β_r
//    and e^{Γ_63} (the same f64 exp calls, once per chunk instead of once per column slice).
//  * Loads. The per-segment kernels staged k̂/q̂ one float at a time in loops the compiler unrolls by four, each
//    group's stores waiting for its loads (their SASS): 8 dependent trips to memory per chunk in the
//    scan kernel, then one more each for Γ/β, the pair scalars and v; 32 in the pair kernel (its loads
//    sit in branches, so each element's store waits before the next element's load), whose f64 Γ
//    sum also reads g from global memory one dependent load per row (up to 64 trips by one thread
//    while the block waits). ncu measured ~26 µs per chunk step of the scan kernel at 27B shapes,
//    several times its arithmetic. Here every chunk is staged with cp.async in one trip (k̂/q̂
//    row-major, v straight into the U tile, Γ and the factors), the pair scalars are prefetched into
//    registers in the same trip, the pair kernel loads four float4 per thread per trip (two trips at
//    dk = 128), and Γ is summed from shared memory.
//  * The outputs go from the solve's registers to global memory (no O round trip through shared
//    memory, one barrier fewer).
// =====================================================================================================

#define MAXSEG 32
// Row stride of the row-major k̂/q̂ tiles of the scan kernel is dk + KPAD (16-byte rows).
#define KPAD 4

// The segments of one batched launch (a kernel parameter; mirrored by `SegmentArgs` in cuda_delta.rs).
struct DeltaSegments {
    const float* s_in[MAXSEG];    // [H, dk, dv]   memory at the last chunk boundary
    const float* pk_in[MAXSEG];   // [H, CHUNK, dk] pending k̂ rows
    const float* pu_in[MAXSEG];   // [H, CHUNK, dv] pending u rows
    const double* gam_in[MAXSEG]; // [H, CHUNK]     pending Γ
    int start[MAXSEG];            // row of the segment's first token of this launch in q/k/v/g/β/out
    int len[MAXSEG];              // its tokens in this launch (≥ 1)
    int pending[MAXSEG];          // rows of its current chunk before this launch
    int chunk0[MAXSEG + 1];       // its first chunk in the scratch buffers (prefix sums; [count] = total)
    int count;                    // segments in this launch
    int heads;                    // H (value heads)
    int key_heads;                // HK: heads of q and k
    int dk;
    int dv;
    int v_stride;                 // elements between token rows of v (≥ H·dv)
};

// States taken inside the segments of a scan launch (a kernel parameter; mirrored by `SnapshotArgs` in
// cuda_delta.rs): for segment i with chunk[i] ≥ 0, the state after the first rows[i] rows of its chunk
// chunk[i] of this launch — the memory at that chunk's start and those rows' k̂, u and Γ as pending
// rows (the rest zero) — into s[i] [H, dk, dv], pk[i] [H, CHUNK, dk], pu[i] [H, CHUNK, dv] and
// gam[i] [H, CHUNK]. chunk[i] = −1: none.
struct DeltaSnapshots {
    float* s[MAXSEG];
    float* pk[MAXSEG];
    float* pu[MAXSEG];
    double* gam[MAXSEG];
    int chunk[MAXSEG];
    int rows[MAXSEG];
};

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16 bytes global → shared, asynchronously (both addresses 16-byte aligned).
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(dst)), "l"(src));
}

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

__device__ __forceinline__ int segment_of_chunk(const DeltaSegments& sg, int gc) {
    int seg = 0;
    while (seg + 1 < sg.count && sg.chunk0[seg + 1] <= gc) ++seg;
    return seg;
}

// Grid (H, total chunks): the pair scalars of one chunk of one segment for one value head (the pair
// kernel of the header), plus its Γ and decay factors.
extern "C" __global__ void __launch_bounds__(THREADS)
delta_rule_pairs_batch_f32(const float* __restrict__ q,     // [N, HK, dk]
                           const float* __restrict__ k,     // [N, HK, dk]
                           const float* __restrict__ g,     // [N, H]
                           const float* __restrict__ beta,  // [N, H]
                           float* __restrict__ ab,          // [chunks, H, 2, CHUNK, CHUNK]
                           double* __restrict__ gam_s,      // [chunks, H, CHUNK]
                           float* __restrict__ fac,         // [chunks, H, 4, CHUNK]
                           const DeltaSegments sg) {
    PRISM_GRID_PROLOGUE();
    extern __shared__ double smem_d[];
    const int h = blockIdx.x, gc = blockIdx.y, tid = threadIdx.x;
    const int H = sg.heads, HK = sg.key_heads, dk = sg.dk, kh = h % HK;
    const int seg = segment_of_chunk(sg, gc);
    const int c = gc - sg.chunk0[seg];
    int r0, r1;
    chunk_rows(c, sg.pending[seg], sg.len[seg], &r0, &r1);
    const long tok0 = (long)sg.start[seg] + (long)c * CHUNK - sg.pending[seg];
    const float* pk_in = sg.pk_in[seg] + (size_t)h * CHUNK * dk;
    const double* gam_in = sg.gam_in[seg] + (size_t)h * CHUNK;

    double* gam = smem_d;               // [CHUNK]
    float* gs = (float*)(gam + CHUNK);  // [CHUNK] g_r of the new rows
    float* bet = gs + CHUNK;            // [CHUNK]
    float* Kt = bet + CHUNK;            // [dk][XS]
    float* Qt = Kt + dk * XS;           // [dk][XS]

    // k̂ (pending rows from the state) and q̂, transposed. Four float4 loads per thread are in flight
    // before their stores; a warp takes 32 consecutive rows of one group of 4 columns, so the
    // transposed stores land on 32 distinct banks.
    const int d4 = dk >> 2, n4 = CHUNK * d4;
    for (int base = 0; base < n4; base += 4 * THREADS) {
        float4 kv[4], qv[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int idx = base + e * THREADS + tid;
            const int r = idx & (CHUNK - 1), i = (idx >> 6) * 4;
            kv[e] = make_float4(0.f, 0.f, 0.f, 0.f);
            qv[e] = kv[e];
            if (idx < n4) {
                if (r < r0) {
                    kv[e] = *(const float4*)&pk_in[(size_t)r * dk + i];
                } else if (r < r1) {
                    const size_t at = ((size_t)(tok0 + r) * HK + kh) * dk + i;
                    kv[e] = *(const float4*)&k[at];
                    qv[e] = *(const float4*)&q[at];
                }
            }
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int idx = base + e * THREADS + tid;
            const int r = idx & (CHUNK - 1), i = (idx >> 6) * 4;
            if (idx < n4) {
                Kt[(i + 0) * XS + r] = kv[e].x;
                Kt[(i + 1) * XS + r] = kv[e].y;
                Kt[(i + 2) * XS + r] = kv[e].z;
                Kt[(i + 3) * XS + r] = kv[e].w;
                Qt[(i + 0) * XS + r] = qv[e].x;
                Qt[(i + 1) * XS + r] = qv[e].y;
                Qt[(i + 2) * XS + r] = qv[e].z;
                Qt[(i + 3) * XS + r] = qv[e].w;
            }
        }
    }
    for (int r = tid; r < CHUNK; r += THREADS) {
        const bool live = r >= r0 && r < r1;
        gs[r] = live ? g[(size_t)(tok0 + r) * H + h] : 0.f;
        bet[r] = live ? beta[(size_t)(tok0 + r) * H + h] : 0.f;
        gam[r] = r < r0 ? gam_in[r] : 0.0;
    }
    __syncthreads();
    if (tid == 0) {
        double acc = r0 == 0 ? 0.0 : gam[r0 - 1];
        for (int r = r0; r < r1; ++r) {
            acc += (double)gs[r];
            gam[r] = acc;
        }
    }
    __syncthreads();
    {
        const size_t hc = (size_t)gc * H + h;
        const bool full = r1 == CHUNK;
        float* f = fac + hc * 4 * CHUNK;
        for (int r = tid; r < CHUNK; r += THREADS) {
            gam_s[hc * CHUNK + r] = gam[r];
            f[r] = (r >= r0 && r < r1) ? (float)exp(gam[r]) : 0.f;            // e^{Γ_r}
            f[CHUNK + r] = full ? (float)exp(gam[CHUNK - 1] - gam[r]) : 0.f;   // e^{Γ_63 − Γ_s}
            f[2 * CHUNK + r] = bet[r];                                         // β_r
            f[3 * CHUNK + r] = (full && r == 0) ? (float)exp(gam[CHUNK - 1]) : 0.f;  // e^{Γ_63}
        }
    }

    // The dot products and pair scalars (the sequences of the header).
    const int ra = (tid >> 4) * 4, sa = (tid & 15) * 4;
    const bool active = sa <= ra + 3 && ra < r1 && ra + 4 > r0;
    float dq[4][4], dkk[4][4];
#pragma unroll
    for (int m = 0; m < 4; ++m)
#pragma unroll
        for (int n = 0; n < 4; ++n) dq[m][n] = dkk[m][n] = 0.f;
    if (active) {
        for (int i = 0; i < dk; ++i) {
            const float4 kr = *(const float4*)&Kt[i * XS + ra];
            const float4 qr = *(const float4*)&Qt[i * XS + ra];
            const float4 ks = *(const float4*)&Kt[i * XS + sa];
#pragma unroll
            for (int m = 0; m < 4; ++m)
#pragma unroll
                for (int n = 0; n < 4; ++n) {
                    dq[m][n] = fmaf(f4(qr, m), f4(ks, n), dq[m][n]);
                    dkk[m][n] = fmaf(f4(kr, m), f4(ks, n), dkk[m][n]);
                }
        }
    }
    float* At = ab + ((size_t)gc * H + h) * 2 * CHUNK * CHUNK;
    float* Bt = At + CHUNK * CHUNK;
#pragma unroll
    for (int n = 0; n < 4; ++n) {
        const int s = sa + n;
        float a[4], b[4];
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            const int r = ra + m;
            a[m] = 0.f;
            b[m] = 0.f;
            if (active && r >= r0 && r < r1 && s <= r) {
                if (s < r) {
                    const float d = (float)exp(gam[r] - gam[s]);
                    a[m] = bet[r] * dkk[m][n] * d;
                    b[m] = dq[m][n] * d;
                } else {
                    b[m] = dq[m][n];
                }
            }
        }
        *(float4*)&At[s * CHUNK + ra] = make_float4(a[0], a[1], a[2], a[3]);
        *(float4*)&Bt[s * CHUNK + ra] = make_float4(b[0], b[1], b[2], b[3]);
    }
}

// Grid (H, dv / CW, segments): one value head's CW columns of one segment, its chunks in order (the
// scan kernel of the header).
extern "C" __global__ void __launch_bounds__(THREADS, 2)
delta_rule_scan_batch_f32(const float* __restrict__ q,       // [N, HK, dk]
                          const float* __restrict__ k,       // [N, HK, dk]
                          const float* __restrict__ v,       // rows of v_stride, [H, dv] each
                          const float* __restrict__ ab,      // pair kernel
                          const double* __restrict__ gam_s,  // pair kernel
                          const float* __restrict__ fac,     // pair kernel
                          float* __restrict__ out,           // [N, H, dv]
                          float* __restrict__ s_out,         // [segments, H, dk, dv]
                          float* __restrict__ pk_out,        // [segments, H, CHUNK, dk]
                          float* __restrict__ pu_out,        // [segments, H, CHUNK, dv]
                          double* __restrict__ gam_out,      // [segments, H, CHUNK]
                          const DeltaSegments sg, const DeltaSnapshots sn) {
    PRISM_GRID_PROLOGUE();
    extern __shared__ double smem_d[];
    const int h = blockIdx.x, c0 = blockIdx.y * CW, seg = blockIdx.z;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int H = sg.heads, HK = sg.key_heads, kh = h % HK, dk = sg.dk, dv = sg.dv;
    const int KS = dk + KPAD, d4 = dk >> 2;
    const int pending = sg.pending[seg], T = sg.len[seg];
    const int first_chunk = sg.chunk0[seg], nch = sg.chunk0[seg + 1] - first_chunk;
    const long start = sg.start[seg];
    const size_t vs = (size_t)sg.v_stride;

    double* gam = smem_d;                // [CHUNK] Γ
    float* dec = (float*)(gam + CHUNK);  // [CHUNK] e^{Γ_r}     } the pair kernel's four factor rows,
    float* te = dec + CHUNK;             // [CHUNK] e^{Γ_63−Γ_s} } in its order
    float* bet = te + CHUNK;             // [CHUNK] β_r          }
    float* last = bet + CHUNK;           // [CHUNK] e^{Γ_63} in [0]
    float* S = last + CHUNK;             // [dk][CW]
    float* U = S + dk * CW;              // [CHUNK][US]: v, then u
    float* O = U + CHUNK * US;           // [CHUNK][US]: e^{Γ_r} RQ_r
    float* Ks = O + CHUNK * US;          // [CHUNK][KS] k̂ rows
    float* X = Ks + CHUNK * KS;          // q̂ rows [CHUNK][KS], then At, Bt [CHUNK][CHUNK] each
    float* Qs = X;
    float* At = X;
    float* Bt = X + CHUNK * CHUNK;

    // The state: this block's columns of the memory, the pending k̂ and u rows (in flight with the
    // first chunk's loads).
    {
        const float* s_in = sg.s_in[seg] + (size_t)h * dk * dv + c0;
        for (int idx = tid; idx < dk * (CW / 4); idx += THREADS) {
            const int i = idx / (CW / 4), j = (idx % (CW / 4)) * 4;
            cp_async16(&S[i * CW + j], s_in + (size_t)i * dv + j);
        }
        const float* pk_in = sg.pk_in[seg] + (size_t)h * CHUNK * dk;
        for (int idx = tid; idx < pending * d4; idx += THREADS) {
            const int s = idx / d4, i = (idx % d4) * 4;
            cp_async16(&Ks[s * KS + i], pk_in + (size_t)s * dk + i);
        }
        const float* pu_in = sg.pu_in[seg] + (size_t)h * CHUNK * dv + c0;
        for (int idx = tid; idx < pending * (CW / 4); idx += THREADS) {
            const int s = idx / (CW / 4), j = (idx % (CW / 4)) * 4;
            cp_async16(&U[s * US + j], pu_in + (size_t)s * dv + j);
        }
    }

    int r0 = pending, r1 = pending;
    for (int c = 0; c < nch; ++c) {
        chunk_rows(c, pending, T, &r0, &r1);
        const long tok0 = start + (long)c * CHUNK - pending;  // token row of chunk row 0
        const size_t hc = (size_t)(first_chunk + c) * H + h;
        // 1. One trip: k̂ and q̂ rows, v (into U), Γ and the factors by cp.async; the pair scalars
        //    of rows s < r1 into registers (stored once q̂ is no longer needed).
        const int nr = r1 - r0;
        for (int idx = tid; idx < nr * d4; idx += THREADS) {
            const int r = r0 + idx / d4, i = (idx % d4) * 4;
            const size_t at = ((size_t)(tok0 + r) * HK + kh) * dk + i;
            cp_async16(&Ks[r * KS + i], k + at);
            cp_async16(&Qs[r * KS + i], q + at);
        }
        for (int idx = tid; idx < nr * (CW / 4); idx += THREADS) {
            const int r = r0 + idx / (CW / 4), j = (idx % (CW / 4)) * 4;
            cp_async16(&U[r * US + j], v + (size_t)(tok0 + r) * vs + (size_t)h * dv + c0 + j);
        }
        if (tid < CHUNK / 2) {
            cp_async16(&gam[2 * tid], gam_s + hc * CHUNK + 2 * tid);
        } else if (tid < CHUNK / 2 + CHUNK) {
            const int e = tid - CHUNK / 2;
            cp_async16(&dec[4 * e], fac + hc * 4 * CHUNK + 4 * e);
        }
        const float4* abc = (const float4*)(ab + hc * 2 * CHUNK * CHUNK);
        float4 pre[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const int idx = tid + e * THREADS;  // float4 index in [2][CHUNK][CHUNK/4]
            const int s = (idx / (CHUNK / 4)) % CHUNK;
            pre[e] = s < r1 ? abc[idx] : make_float4(0.f, 0.f, 0.f, 0.f);
        }
        cp_async_wait_all();
        __syncthreads();

        // 2. RK (threads 0..127) and RQ (128..255), 4 rows × 4 columns each, i in order, folded into
        //    the solve's start values: U[r] = β_r (v_r − e^{Γ_r} RK_r), O[r] = e^{Γ_r} RQ_r.
        {
            const int which = tid >> 7, tile = tid & 127;
            const int ra = (tile >> 3) * 4, ca = (tile & 7) * 4;
            if (ra < r1 && ra + 4 > r0) {
                const float* Xs = which == 0 ? Ks : Qs;
                float acc[4][4];
#pragma unroll
                for (int m = 0; m < 4; ++m)
#pragma unroll
                    for (int n = 0; n < 4; ++n) acc[m][n] = 0.f;
                for (int i = 0; i < dk; i += 4) {
                    float4 x[4], sv[4];
#pragma unroll
                    for (int m = 0; m < 4; ++m) x[m] = *(const float4*)&Xs[(ra + m) * KS + i];
#pragma unroll
                    for (int e = 0; e < 4; ++e) sv[e] = *(const float4*)&S[(i + e) * CW + ca];
#pragma unroll
                    for (int e = 0; e < 4; ++e)
#pragma unroll
                        for (int m = 0; m < 4; ++m)
#pragma unroll
                            for (int n = 0; n < 4; ++n) acc[m][n] = fmaf(f4(x[m], e), f4(sv[e], n), acc[m][n]);
                }
#pragma unroll
                for (int m = 0; m < 4; ++m) {
                    const int r = ra + m;
                    if (r < r0 || r >= r1) continue;
                    float res[4];
                    if (which == 0) {
                        const float4 vr = *(const float4*)&U[r * US + ca];
#pragma unroll
                        for (int n = 0; n < 4; ++n) res[n] = bet[r] * fmaf(-dec[r], acc[m][n], f4(vr, n));
                        *(float4*)&U[r * US + ca] = make_float4(res[0], res[1], res[2], res[3]);
                    } else {
#pragma unroll
                        for (int n = 0; n < 4; ++n) res[n] = dec[r] * acc[m][n];
                        *(float4*)&O[r * US + ca] = make_float4(res[0], res[1], res[2], res[3]);
                    }
                }
            }
        }
        __syncthreads();
#pragma unroll
        for (int e = 0; e < 8; ++e) ((float4*)X)[tid + e * THREADS] = pre[e];
        __syncthreads();

        // 3. The solve and the outputs (the header's sequences): warp w owns columns 4w..4w+3,
        //    lane l rows l and l + 32; u_s is broadcast once final. Rows s < 32 come from the low
        //    registers, the rest from the high ones (two loops, no per-step select).
        {
            const int ca = warp * 4;
            const int rlo = lane, rhi = lane + 32;
            const bool lo_live = rlo >= r0 && rlo < r1, hi_live = rhi >= r0 && rhi < r1;
            float ulo[4], uhi[4], olo[4], ohi[4];
            {
                const float4 a = *(const float4*)&U[rlo * US + ca];
                const float4 b = *(const float4*)&U[rhi * US + ca];
                const float4 x = *(const float4*)&O[rlo * US + ca];
                const float4 y = *(const float4*)&O[rhi * US + ca];
#pragma unroll
                for (int n = 0; n < 4; ++n) {
                    ulo[n] = f4(a, n);
                    uhi[n] = f4(b, n);
                    olo[n] = f4(x, n);
                    ohi[n] = f4(y, n);
                }
            }
            const int s_lo_end = min(r1, 32);
            for (int s = 0; s < s_lo_end; ++s) {
                const float alo = At[s * CHUNK + rlo], ahi = At[s * CHUNK + rhi];
                const float blo = Bt[s * CHUNK + rlo], bhi = Bt[s * CHUNK + rhi];
                const bool ulo_t = lo_live && rlo > s, olo_t = lo_live && rlo >= s;
#pragma unroll
                for (int n = 0; n < 4; ++n) {
                    const float us = __shfl_sync(0xffffffffu, ulo[n], s);
                    if (ulo_t) ulo[n] = fmaf(-alo, us, ulo[n]);
                    if (hi_live) uhi[n] = fmaf(-ahi, us, uhi[n]);
                    if (olo_t) olo[n] = fmaf(blo, us, olo[n]);
                    if (hi_live) ohi[n] = fmaf(bhi, us, ohi[n]);
                }
            }
            for (int s = 32; s < r1; ++s) {
                const float ahi = At[s * CHUNK + rhi], bhi = Bt[s * CHUNK + rhi];
                const bool uhi_t = hi_live && rhi > s, ohi_t = hi_live && rhi >= s;
#pragma unroll
                for (int n = 0; n < 4; ++n) {
                    const float us = __shfl_sync(0xffffffffu, uhi[n], s - 32);
                    if (uhi_t) uhi[n] = fmaf(-ahi, us, uhi[n]);
                    if (ohi_t) ohi[n] = fmaf(bhi, us, ohi[n]);
                }
            }
            if (lo_live) {
                *(float4*)&U[rlo * US + ca] = make_float4(ulo[0], ulo[1], ulo[2], ulo[3]);
                *(float4*)&out[((size_t)(tok0 + rlo) * H + h) * dv + c0 + ca] =
                    make_float4(olo[0], olo[1], olo[2], olo[3]);
            }
            if (hi_live) {
                *(float4*)&U[rhi * US + ca] = make_float4(uhi[0], uhi[1], uhi[2], uhi[3]);
                *(float4*)&out[((size_t)(tok0 + rhi) * H + h) * dv + c0 + ca] =
                    make_float4(ohi[0], ohi[1], ohi[2], ohi[3]);
            }
        }
        __syncthreads();

        // A snapshot in this chunk: S is still the memory at the chunk's start, and rows s < keep of
        // k̂ (not yet decayed by the close), u and Γ are the pending rows after the snapshot's point.
        if (c == sn.chunk[seg]) {
            const int keep = sn.rows[seg];
            float* so = sn.s[seg] + (size_t)h * dk * dv + c0;
            for (int idx = tid; idx < dk * (CW / 4); idx += THREADS) {
                const int i = idx / (CW / 4), j = (idx % (CW / 4)) * 4;
                *(float4*)&so[(size_t)i * dv + j] = *(const float4*)&S[i * CW + j];
            }
            float* puo = sn.pu[seg] + (size_t)h * CHUNK * dv + c0;
            for (int idx = tid; idx < CHUNK * (CW / 4); idx += THREADS) {
                const int s = idx / (CW / 4), j = (idx % (CW / 4)) * 4;
                *(float4*)&puo[(size_t)s * dv + j] =
                    s < keep ? *(const float4*)&U[s * US + j] : make_float4(0.f, 0.f, 0.f, 0.f);
            }
            if (blockIdx.y == 0) {
                float* pko = sn.pk[seg] + (size_t)h * CHUNK * dk;
                for (int idx = tid; idx < CHUNK * d4; idx += THREADS) {
                    const int s = idx / d4, i = (idx % d4) * 4;
                    *(float4*)&pko[(size_t)s * dk + i] =
                        s < keep ? *(const float4*)&Ks[s * KS + i] : make_float4(0.f, 0.f, 0.f, 0.f);
                }
                double* go = sn.gam[seg] + (size_t)h * CHUNK;
                for (int s = tid; s < CHUNK; s += THREADS) go[s] = s < keep ? gam[s] : 0.0;
            }
            __syncthreads();
        }

        // 4. Close a full chunk: k̃_s = e^{Γ_63−Γ_s} k̂_s in place, then S in 4×4 tiles, s in order.
        if (r1 == CHUNK) {
            for (int idx = tid; idx < CHUNK * d4; idx += THREADS) {
                const int s = idx / d4, i = (idx % d4) * 4;
                float4 x = *(const float4*)&Ks[s * KS + i];
                const float t = te[s];
                x.x = t * x.x;
                x.y = t * x.y;
                x.z = t * x.z;
                x.w = t * x.w;
                *(float4*)&Ks[s * KS + i] = x;
            }
            __syncthreads();
            const float decay_all = last[0];
            for (int tile = tid; tile < d4 * (CW / 4); tile += THREADS) {
                const int ia = (tile / (CW / 4)) * 4, ca = (tile % (CW / 4)) * 4;
                float acc[4][4];
#pragma unroll
                for (int m = 0; m < 4; ++m) {
                    const float4 sv = *(const float4*)&S[(ia + m) * CW + ca];
#pragma unroll
                    for (int n = 0; n < 4; ++n) acc[m][n] = decay_all * f4(sv, n);
                }
#pragma unroll 4
                for (int s = 0; s < CHUNK; ++s) {
                    const float4 kx = *(const float4*)&Ks[s * KS + ia];
                    const float4 uu = *(const float4*)&U[s * US + ca];
#pragma unroll
                    for (int m = 0; m < 4; ++m)
#pragma unroll
                        for (int n = 0; n < 4; ++n) acc[m][n] = fmaf(f4(kx, m), f4(uu, n), acc[m][n]);
                }
#pragma unroll
                for (int m = 0; m < 4; ++m)
                    *(float4*)&S[(ia + m) * CW + ca] = make_float4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]);
            }
            r0 = r1 = 0;
        }
        __syncthreads();
    }

    // The new state: S at the last boundary and the pending rows (unused rows are zero). A segment
    // that closes no chunk keeps its memory (the launcher hands back the input tensor): a decode step
    // writes 64 KiB less per head.
    const int kept = r1;  // rows of the open chunk (0 after a close)
    {
        if (pending + T >= CHUNK) {
            float* so = s_out + ((size_t)seg * H + h) * dk * dv + c0;
            for (int idx = tid; idx < dk * (CW / 4); idx += THREADS) {
                const int i = idx / (CW / 4), j = (idx % (CW / 4)) * 4;
                *(float4*)&so[(size_t)i * dv + j] = *(const float4*)&S[i * CW + j];
            }
        }
        float* puo = pu_out + ((size_t)seg * H + h) * CHUNK * dv + c0;
        for (int idx = tid; idx < CHUNK * (CW / 4); idx += THREADS) {
            const int s = idx / (CW / 4), j = (idx % (CW / 4)) * 4;
            *(float4*)&puo[(size_t)s * dv + j] =
                s < kept ? *(const float4*)&U[s * US + j] : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
    if (blockIdx.y == 0) {
        float* pko = pk_out + ((size_t)seg * H + h) * CHUNK * dk;
        for (int idx = tid; idx < CHUNK * d4; idx += THREADS) {
            const int s = idx / d4, i = (idx % d4) * 4;
            *(float4*)&pko[(size_t)s * dk + i] =
                s < kept ? *(const float4*)&Ks[s * KS + i] : make_float4(0.f, 0.f, 0.f, 0.f);
        }
        double* go = gam_out + ((size_t)seg * H + h) * CHUNK;
        for (int s = tid; s < CHUNK; s += THREADS) go[s] = s < kept ? gam[s] : 0.0;
    }
}

// =====================================================================================================
// One-token segments that do not close their chunk (a decode step: the new row r = pending < 63). The
// pair and scan kernels above stage and solve a whole chunk per segment and write the pair scalars of
// every chunk row to a scratch buffer; for one new row the work is its own: the pair scalars of row r
// against the pending rows, RK_r and RQ_r against the memory, u_r and o_r, and the new pending rows.
// Every float is formed by the operation sequence listed at the top of this file, so the results are
// those of the pair + scan kernels bit for bit (`tests/device` compares them):
//   Γ_r = Γ_{r−1} + g_r (f64);  e_s = (float)exp(Γ_r − Γ_s);  dec = (float)exp(Γ_r);
//   A_s = (β_r · (k̂_r·k̂_s)) · e_s (s < r);  B_s = (q̂_r·k̂_s) · e_s (s < r), B_r = q̂_r·k̂_r;
//   RK_j, RQ_j = fmaf over i in order from 0 of k̂_r[i] · S[i][j], q̂_r[i] · S[i][j];
//   u_j = β_r · fmaf(−dec, RK_j, v_j), then fmaf(−A_s, u_sj, ·) for s = 0 .. r−1;
//   o_j = dec · RQ_j, then fmaf(B_s, u_sj, ·) for s = 0 .. r−1, then fmaf(B_r, u_j, ·).
// Grid (value heads, dv / CW column slices, segments), DECODE_THREADS threads. A block stages every
// operand it reads in one trip (cp.async, all in flight at once): the memory's slice [dk][CW], the
// pending u rows' slice [r][CW], k̂_r, q̂_r, and the pending k̂ rows whose pair scalars it forms. The
// pair scalars do not depend on the column slice, so with NS > 1 (Hopper) the NS column slices of a
// head are one thread-block cluster and each block forms those of CHUNK / NS pending rows — a quarter
// of the keys read, not all of them four times — and stores them into every block of the cluster
// (distributed shared memory); with NS = 1 a block forms all of them. Threads: the pair scalars one a
// chain (A_s on threads 0 .. CH − 1, B_s on CH .. 2CH − 1), B_r on thread 2CH mod 128, RK_j and u_j on
// threads 64 + j, RQ_j and o_j on 96 + j (j < CW); the chains over the memory run while the pair
// scalars are formed. The memory is not written (no chunk closes: the launcher hands back the
// input's); the pending rows go where DecodeOutputs says: row r into the state's own buffers, or the
// whole rows into fresh ones (rows past r zero), as the scan kernel writes them; slice 0 writes the
// keys and decays.
// =====================================================================================================

#define DECODE_THREADS 128

// Where each segment of a decode launch writes its new pending rows (a kernel parameter; mirrored by
// `DecodeOutputs` in cuda_delta.rs): `[H, CHUNK, dk]`, `[H, CHUNK, dv]`, `[H, CHUNK]` each. With
// `in_place` set they are the segment's own input buffers (sg.pk_in, …: the launcher claimed row r of
// them) and only row r is written; otherwise fresh buffers, written whole.
struct DecodeOutputs {
    float* pk[MAXSEG];
    float* pu[MAXSEG];
    double* gam[MAXSEG];
    int in_place[MAXSEG];
};

// Thread-block clusters (sm_90): the block's rank, a split barrier over the cluster's threads, and a
// store into another block's shared memory. Elsewhere they are never reached (the launcher runs the
// cluster entries on compute capability 9.x only) and trap.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define DECODE_CLUSTERS 1
#endif
__device__ __forceinline__ int cluster_rank() {
#ifdef DECODE_CLUSTERS
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return (int)r;
#else
    __trap();
    return 0;
#endif
}
// Every thread of the cluster has arrived (relaxed: orders nothing; the blocks have started).
__device__ __forceinline__ void cluster_arrive_relaxed() {
#ifdef DECODE_CLUSTERS
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
#else
    __trap();
#endif
}
__device__ __forceinline__ void cluster_arrive_release() {
#ifdef DECODE_CLUSTERS
    asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
#else
    __trap();
#endif
}
__device__ __forceinline__ void cluster_wait() {
#ifdef DECODE_CLUSTERS
    asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#else
    __trap();
#endif
}
// v into the float at `p` (a shared address of this block) in the cluster's block `rank`.
__device__ __forceinline__ void st_cluster(float* p, int rank, float v) {
#ifdef DECODE_CLUSTERS
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(smem_u32(p)), "r"(rank));
    asm volatile("st.shared::cluster.f32 [%0], %1;\n" ::"r"(remote), "f"(v) : "memory");
#else
    __trap();
#endif
}

// fmaf over i = 0 .. n − 1 in order, from 0, of x[i] · y[i] (both 16-byte aligned, n a multiple of 4).
__device__ __forceinline__ float dot_in_order(const float* x, const float* y, int n) {
    float d = 0.f;
#pragma unroll 8
    for (int i = 0; i < n; i += 4) {
        const float4 a = *(const float4*)&x[i];
        const float4 b = *(const float4*)&y[i];
        d = fmaf(a.x, b.x, d);
        d = fmaf(a.y, b.y, d);
        d = fmaf(a.z, b.z, d);
        d = fmaf(a.w, b.w, d);
    }
    return d;
}

template <int NS>
__device__ __forceinline__ void delta_rule_decode(const float* __restrict__ q, const float* __restrict__ k,
                                                  const float* __restrict__ v, const float* __restrict__ g,
                                                  const float* __restrict__ beta, float* __restrict__ out,
                                                  const DeltaSegments& sg, const DecodeOutputs& wo) {
    constexpr int CH = CHUNK / NS;  // pending rows whose pair scalars a block forms
    extern __shared__ double decode_smem[];
    const int h = blockIdx.x, c0 = blockIdx.y * CW, seg = blockIdx.z, tid = threadIdx.x;
    const int H = sg.heads, HK = sg.key_heads, kh = h % HK, dk = sg.dk, dv = sg.dv;
    const int r = sg.pending[seg];
    const long tok = sg.start[seg];
    const int KS = dk + KPAD;
    const int rank = NS > 1 ? cluster_rank() : 0;
    const int lo = rank * CH, hi = min(r, lo + CH);  // this block's pending rows lo .. hi − 1

    double* gam = decode_smem;         // [CHUNK]
    float* S = (float*)(gam + CHUNK);  // [dk][CW] the memory's slice
    float* P = S + dk * CW;            // [CHUNK][CW] the pending u rows' slice
    float* kr = P + CHUNK * CW;        // [dk] k̂_r
    float* qr = kr + dk;               // [dk] q̂_r
    float* A = qr + dk;                // [CHUNK]
    float* B = A + CHUNK;              // [CHUNK]
    float* U = B + CHUNK;              // [CW] u_r
    float* Kq = U + CW;                // [CH][KS] the pending k̂ rows lo .. hi − 1

    const float* s_in = sg.s_in[seg] + (size_t)h * dk * dv + c0;
    const float* pk_in = sg.pk_in[seg] + (size_t)h * CHUNK * dk;
    const float* pu_in = sg.pu_in[seg] + (size_t)h * CHUNK * dv + c0;
    const double* gam_in = sg.gam_in[seg] + (size_t)h * CHUNK;
    const size_t at = ((size_t)tok * HK + kh) * dk;

    for (int idx = tid; idx < dk * (CW / 4); idx += DECODE_THREADS) {
        const int i = idx / (CW / 4), j = (idx % (CW / 4)) * 4;
        cp_async16(&S[i * CW + j], s_in + (size_t)i * dv + j);
    }
    for (int idx = tid; idx < r * (CW / 4); idx += DECODE_THREADS) {
        const int s = idx / (CW / 4), j = (idx % (CW / 4)) * 4;
        cp_async16(&P[s * CW + j], pu_in + (size_t)s * dv + j);
    }
    const int d4 = dk >> 2;
    for (int idx = tid; idx < (hi - lo) * d4; idx += DECODE_THREADS) {
        const int s = idx / d4, i = (idx % d4) * 4;
        cp_async16(&Kq[s * KS + i], pk_in + (size_t)(lo + s) * dk + i);
    }
    for (int idx = tid; idx < d4; idx += DECODE_THREADS) {
        cp_async16(&kr[4 * idx], k + at + 4 * idx);
        cp_async16(&qr[4 * idx], q + at + 4 * idx);
    }
    for (int s = tid; s < r; s += DECODE_THREADS) gam[s] = gam_in[s];
    const double g_r = (double)g[(size_t)tok * H + h];
    const float beta_r = beta[(size_t)tok * H + h];
    const bool is_u = tid >= 64 && tid < 64 + CW, is_o = tid >= 64 + CW && tid < 64 + 2 * CW;
    const int j = tid - (is_u ? 64 : 64 + CW);
    const float vj = is_u ? v[(size_t)tok * sg.v_stride + (size_t)h * dv + c0 + j] : 0.f;
    if (NS > 1) cluster_arrive_relaxed();  // this block has started (paired with the wait below)
    cp_async_wait_all();
    __syncthreads();
    const double gam_r = (r == 0 ? 0.0 : gam[r - 1]) + g_r;
    if (NS > 1) cluster_wait();  // every block of the cluster has started: its shared memory is there

    // The pair scalars of rows lo .. hi − 1, into A and B of every block of the cluster.
    for (int p = tid; p < 2 * CH; p += DECODE_THREADS) {
        const bool a = p < CH;
        const int s = lo + (a ? p : p - CH);
        if (s < hi) {
            const float d = dot_in_order(a ? kr : qr, Kq + (s - lo) * KS, dk);
            const float e = (float)exp(gam_r - gam[s]);
            const float x = a ? beta_r * d * e : d * e;
            float* dst = a ? &A[s] : &B[s];
            if (NS == 1) {
                *dst = x;
            } else {
#pragma unroll
                for (int c = 0; c < NS; ++c) st_cluster(dst, c, x);
            }
        }
    }
    if (tid == (2 * CH) % DECODE_THREADS) B[r] = dot_in_order(qr, kr, dk);
    // RK_j (u threads) and RQ_j (o threads) against the memory.
    float acc = 0.f;
    if (is_u || is_o) {
        const float* x = is_u ? kr : qr;
        for (int i = 0; i < dk; ++i) acc = fmaf(x[i], S[i * CW + j], acc);
    }
    if (NS > 1) {
        cluster_arrive_release();  // this block's pair scalars are stored everywhere
        cluster_wait();            // and every other block's here
    } else {
        __syncthreads();
    }

    const float dec = (float)exp(gam_r);
    float o = 0.f;
    if (is_u) {
        float u = beta_r * fmaf(-dec, acc, vj);
        for (int s = 0; s < r; ++s) u = fmaf(-A[s], P[s * CW + j], u);
        U[j] = u;
    } else if (is_o) {
        o = dec * acc;
        for (int s = 0; s < r; ++s) o = fmaf(B[s], P[s * CW + j], o);
    }
    if (tid == 0) gam[r] = gam_r;
    __syncthreads();
    if (is_o) {
        o = fmaf(B[r], U[j], o);
        out[((size_t)tok * H + h) * dv + c0 + j] = o;
    }

    // The new pending rows: in place, row r alone (rows s < r are the input's, read above, and rows
    // past r are read by nobody); otherwise rows s < r as they were, row r new, the rest zero.
    float* puo = wo.pu[seg] + (size_t)h * CHUNK * dv + c0;
    float* pko = wo.pk[seg] + (size_t)h * CHUNK * dk;
    double* go = wo.gam[seg] + (size_t)h * CHUNK;
    if (wo.in_place[seg]) {
        if (tid < CW) puo[(size_t)r * dv + tid] = U[tid];
        if (blockIdx.y == 0) {
            for (int i = tid; i < dk; i += DECODE_THREADS) pko[(size_t)r * dk + i] = kr[i];
            if (tid == 0) go[r] = gam_r;
        }
        return;
    }
    for (int idx = tid; idx < CHUNK * CW; idx += DECODE_THREADS) {
        const int s = idx / CW, jj = idx % CW;
        puo[(size_t)s * dv + jj] = s < r ? P[s * CW + jj] : s == r ? U[jj] : 0.f;
    }
    if (blockIdx.y == 0) {
        for (int idx = tid; idx < CHUNK * dk; idx += DECODE_THREADS) {
            const int s = idx / dk;
            pko[idx] = s < r ? pk_in[idx] : s == r ? kr[idx % dk] : 0.f;
        }
        for (int s = tid; s < CHUNK; s += DECODE_THREADS) go[s] = s <= r ? gam[s] : 0.0;
    }
}

#define DELTA_DECODE_PARAMS                                                                             \
    const float *__restrict__ q, const float *__restrict__ k, const float *__restrict__ v,             \
        const float *__restrict__ g, const float *__restrict__ beta, float *__restrict__ out,           \
        const DeltaSegments sg, const DecodeOutputs wo

// Any GPU: a block forms every pair scalar of its head.
extern "C" __global__ void __launch_bounds__(DECODE_THREADS) delta_rule_decode_batch_f32(DELTA_DECODE_PARAMS) {
    PRISM_GRID_PROLOGUE();
    delta_rule_decode<1>(q, k, v, g, beta, out, sg, wo);
}

// Compute capability 9.x: clusters of NS column slices of a head (dv / CW a multiple of NS).
#ifdef DECODE_CLUSTERS
#define DELTA_DECODE_CLUSTER(NAME, NS)                                                                  \
    extern "C" __global__ void __cluster_dims__(1, NS, 1) __launch_bounds__(DECODE_THREADS)             \
        NAME(DELTA_DECODE_PARAMS) {                                                                     \
        PRISM_GRID_PROLOGUE();                                                                          \
        delta_rule_decode<NS>(q, k, v, g, beta, out, sg, wo);                                           \
    }
#else
#define DELTA_DECODE_CLUSTER(NAME, NS) \
    extern "C" __global__ void NAME(DELTA_DECODE_PARAMS) { PRISM_GRID_PROLOGUE(); __trap(); }
#endif
DELTA_DECODE_CLUSTER(delta_rule_decode_cluster2_f32, 2)
DELTA_DECODE_CLUSTER(delta_rule_decode_cluster4_f32, 4)

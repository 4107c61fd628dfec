// The exact integer matmul of prism-quant (W8A8 for Q8_0 weights, W4A8 for Q4_K / Q5_K / Q6_K) on CUDA:
// the device twins of crates/prism-quant/src/activation.rs (`quantize_rows`) and kernel.rs (`matmul`).
// Every output must have the CPU reference's bits, whatever M, the tile shapes or the grid. The contract
// is the crate docs' "The arithmetic, exactly"; in short, for output (m, n):
//
//   D_b  = exact i32 block sum (Q8_0: Σ q·qa over 32; K-quants: Σ_j sc_j · Σ_{i∈j} q·qa)
//   M_b  = Σ_j m_j · Σ_{i∈j} qa                       (Q4_K / Q5_K only)
//   part p = blocks ⌊p·nb/4⌋ .. ⌊(p+1)·nb/4⌋, from +0.0 in increasing block order:
//            acc = fma(d_b, f32(D_b), acc) [; acc = fma(−dmin_b, f32(M_b), acc)]
//   y    = ((p0 + p1) + (p2 + p3)) · scale
//
// How the kernels keep that order: the integer sums are exact, so the tensor cores may produce them in
// any order; the float work is done per output, by the one thread that holds the output's accumulator
// fragment, one block at a time in increasing block order. Tiles only decide which thread does the work,
// never the order of the float operations of an output.
//
// Weights are the unpacked arrays of `QuantWeight` (one signed byte per weight, row-major [N, K]). The
// per-block tables are block-major (cuda_plan.rs `FlatWeight`): block scales (and min scales) f32
// [K/block, N], integer sub-block scales / mins bytes [K/block, N, sub-blocks a block], so the scales of
// one block for a tile's consecutive columns are consecutive in memory and the stage copies coalesce
// (measured +9–14 % on the chained tile, 2026-11-30, sixth session).
//
// Two tensor-core families compute the same bits: v1 (`qgemm_*_64x64`, the first kernel, kept as the
// comparison and fallback) and v2 (`qgemm2_*`, at the end of this file: larger tiles, part-aligned
// stages, the part tree in memory). crates/prism-quant/src/cuda_plan.rs chooses between them.

#include <stdint.h>
#include "act_quant.cuh"
#include "wgmma.cuh"

#define FMT_Q8_0 0
#define FMT_K32 1  // Q4_K and Q5_K: sub-blocks of 32 with scales and mins (q in 0..15 / 0..31)
#define FMT_Q6K 2  // sub-blocks of 16 with signed scales, q − 32 in −32..31

// ---------------------------------------------------------------------------------------------------
// Activation quantization: 8 lanes per group of 32 (kernels/act_quant.cuh: the formula, the sums and
// the per-row non-finite flags). A non-finite input is recorded per row, never across rows; `poison_rows`
// (or the GEMM's last write, given the flags) then turns the row's outputs into NaN after the GEMM, or the
// host reads the flags and refuses the call (the CPU's error, same element).
// ---------------------------------------------------------------------------------------------------
extern "C" __global__ void quantize_act_i8(const float* __restrict__ x, int8_t* __restrict__ qa,
                                           int* __restrict__ sums, unsigned int* __restrict__ bad_rows,
                                           long long n_groups, int groups_per_row, float inv_scale,
                                           int want_sums) {
    // 8 lanes a group (act_quant.cuh, quantize_group32_lanes); the grid covers 8 · n_groups threads in
    // whole warps.
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long g = t / 8;
    const int j = (int)(t % 8);
    const bool active = g < n_groups;
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    if (active) {
        const float4 v4 = reinterpret_cast<const float4*>(x + g * 32)[j];
        v[0] = v4.x;
        v[1] = v4.y;
        v[2] = v4.z;
        v[3] = v4.w;
    }
    quantize_group32_lanes(v, j, active, reinterpret_cast<signed char*>(qa + (active ? g : 0) * 32), sums,
                           bad_rows, g, groups_per_row, inv_scale, want_sums);
}

// The NaN of a poisoned row, and whether row r is one (bad_rows may be null: no poisoning). The v2
// kernels and the combine kernels apply it in their last write of an output, so their launches need no
// poison_rows after them.
#define POISON_NAN __int_as_float(0x7fc00000)
__device__ __forceinline__ bool row_poisoned(const unsigned int* __restrict__ bad_rows, long long r) {
    return bad_rows != nullptr && bad_rows[r] != 0u;
}

// After the GEMM: every output of a row whose input held a non-finite value becomes NaN, so the
// divergence flows through that sequence's own later operations to its logits, without a host
// synchronization and without touching any other row. One warp per row; clean rows only read their flag.
extern "C" __global__ void poison_rows(const unsigned int* __restrict__ bad_rows, float* __restrict__ y,
                                       long long M, long long N) {
    const long long row = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (row >= M || bad_rows[row] == 0) return;
    float* out = y + row * N;
    for (long long n = threadIdx.x & 31; n < N; n += 32) out[n] = POISON_NAN;
}

// ---------------------------------------------------------------------------------------------------
// The plain reference kernel: one thread per output, integer loops, the contract written out. A second
// oracle for the tensor-core kernel (and the fallback for GPUs without int8 mma).
// ---------------------------------------------------------------------------------------------------
extern "C" __global__ void qgemm_simt(int fmt, const int8_t* __restrict__ qa, const int* __restrict__ asums,
                                      const int8_t* __restrict__ wq, const int8_t* __restrict__ wsc,
                                      const int8_t* __restrict__ wmin, const float* __restrict__ wd,
                                      const float* __restrict__ wdmin, float* __restrict__ y, int M, int N,
                                      int K, float scale) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)M * N) return;
    const int m = (int)(idx / N), n = (int)(idx % N);
    const int blk = fmt == FMT_Q8_0 ? 32 : 256;
    const int sub = fmt == FMT_Q6K ? 16 : 32;
    const int nb = K / blk;
    const int8_t* a = qa + (size_t)m * K;
    const int8_t* w = wq + (size_t)n * K;
    float parts[4];
    for (int p = 0; p < 4; ++p) {
        float acc = 0.f;
        for (int b = p * nb / 4; b < (p + 1) * nb / 4; ++b) {
            int D = 0, Mb = 0;
            for (int j = 0; j < blk / sub; ++j) {
                const int s = b * (blk / sub) + j;
                int isum = 0, asum = 0;
                for (int i = 0; i < sub; ++i) {
                    isum += (int)w[s * sub + i] * (int)a[s * sub + i];
                    asum += (int)a[s * sub + i];
                }
                if (fmt == FMT_Q8_0) {
                    D += isum;
                } else {
                    const size_t at = ((size_t)b * N + n) * (blk / sub) + j;  // block-major tables
                    D += (int)wsc[at] * isum;
                    if (fmt == FMT_K32) Mb += (int)wmin[at] * asum;
                }
            }
            acc = fmaf(wd[(size_t)b * N + n], __int2float_rn(D), acc);
            if (fmt == FMT_K32) acc = fmaf(-wdmin[(size_t)b * N + n], __int2float_rn(Mb), acc);
        }
        parts[p] = acc;
    }
    y[idx] = __fmul_rn(__fadd_rn(__fadd_rn(parts[0], parts[1]), __fadd_rn(parts[2], parts[3])), scale);
}

// ---------------------------------------------------------------------------------------------------
// Tensor-core kernel.
//
// CTA tile BM × BN outputs (BM = WARPS_M·MT·16 activation rows, BN = WARPS_N·NT·8 weight rows), warp
// tile (MT·16) × (NT·8). The K loop runs over stages of BK bytes (Q8_0: 4 blocks of 32; K-quants: one
// block of 256), staged through shared memory by cp.async (zero-filled outside M, N and the CTA's block
// range), STAGES deep. Shared rows are 16-byte chunks XOR-swizzled by (row & 7) so ldmatrix is
// conflict-free.
//
// Per k=32 slice of a stage: Q8_0 issues one m16n8k32 mma per block whose accumulator input is the
// constant 0x4B400000 (the bits of 1.5·2^23), so each i32 result is the float 1.5·2^23 + D_b exactly
// (|D_b| ≤ 520,192 < 2^22); one exact subtraction gives f32(D_b) — the same value as __int2float_rn
// without the slow conversion unit — and one fma folds it into the output's running part. K-quants
// issue one k32 mma (sub-blocks of 32) or two k16 mmas (Q6_K, sub-blocks of 16) from a zero
// accumulator, multiply each sub-block sum by its integer scale in i32 (exact), and after the block's
// last sub-block convert D_b (and M_b, from the 32-element activation sums and the mins in shared
// memory) with __int2float_rn and do the block's fma(s).
//
// Parts: the CTA owns parts [z·4/G, (z+1)·4/G) of the block reduction (G = gridDim.z ∈ {1, 2, 4}). Its
// threads walk those blocks in increasing order; when a part ends the running value is folded by the
// fixed tree: even part → `lo`; odd part → pair = lo + acc; G = 1: s = pair (part 1) or s + pair
// (part 3); G = 2: s = pair; G = 4: s = acc. G = 1 writes s·scale; G = 2/4 write s to a workspace
// [G, M, N] that `qgemm_combine` folds with the same tree. So the arithmetic of an output is the same
// for every G, tile shape and M.
// ---------------------------------------------------------------------------------------------------

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async8(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 8 : 0));
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// mbarriers in shared memory (sm_80+): the warp-specialized kernel's stage hand-off.
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
    asm volatile("mbarrier.init.shared.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
    asm volatile("mbarrier.arrive.shared.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// One lane arrives on `bar` for its (converged) warp: a compute warp's "done with this stage". On sm_90
// `elect.sync` picks the lane without the thread index: with `lane == 0` the compiler rematerialized
// the lane from S2R SR_TID.X at every stage (register pressure), and that S2R → LOP3 → ISETP chain
// was ~10 % of the Q8_0 TMA tiles' compute-warp stall samples at M = 275 (ncu, 2026-11-30). Removing
// it measured +4–6 % on the Q4_K 96-row tile at M = 275 and within ±2 % elsewhere (the other warp of
// the scheduler covered most of that latency).
__device__ __forceinline__ void mbar_arrive_warp(unsigned long long* bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile(
        "{\n"
        ".reg .pred leader;\n"
        "elect.sync _|leader, 0xffffffff;\n"
        "@leader mbarrier.arrive.shared.b64 _, [%0];\n"
        "}\n" ::"r"(smem_addr(bar))
        : "memory");
#else
    if ((threadIdx.x & 31) == 0) mbar_arrive(bar);
#endif
}
// Arrives on `bar` when all of this thread's earlier cp.async copies have landed.
__device__ __forceinline__ void cp_async_mbar_arrive(unsigned long long* bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// Waits until the phase of `bar` with parity `parity` has completed. On sm_90 with try_wait, which
// suspends the waiting warp instead of spinning (a spinning producer took issue slots from the
// compute warps of its scheduler); before sm_90 by polling test_wait.
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
#if __CUDA_ARCH__ >= 900
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n"
        "}\n" ::"r"(smem_addr(bar)),
        "r"(parity)
        : "memory");
#else
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.test_wait.parity.shared.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n"
        "}\n" ::"r"(smem_addr(bar)),
        "r"(parity)
        : "memory");
#endif
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// Hopper's tensor memory accelerator (TMA): a CUtensorMap (built on the host by cuTensorMapEncodeTiled)
// passed as a __grid_constant__ kernel parameter, of which the kernel only takes the address.
struct alignas(64) TmaDesc {
    unsigned long long opaque[16];
};

#if __CUDA_ARCH__ >= 900
// One 2-D box of the tensor `tmap` at (c0 = byte of K, c1 = row) into shared memory at `dst`; its bytes
// count towards the transaction count of `bar` (rows past the tensor are zero-filled).
__device__ __forceinline__ void tma_load_2d(void* dst, const TmaDesc* tmap, int c0, int c1,
                                            unsigned long long* bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
        "[%4];\n" ::"r"(smem_addr(dst)),
        "l"(reinterpret_cast<unsigned long long>(tmap)), "r"(c0), "r"(c1), "r"(smem_addr(bar))
        : "memory");
}
// Arrives on `bar` and adds `bytes` to the transaction count its phase waits for.
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void tma_prefetch_desc(const TmaDesc* tmap) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<unsigned long long>(tmap)) : "memory");
}
#endif

// d = a·b + c, 16×8 outputs, k = 32, int8 → int32 (exact: nothing here can overflow).
__device__ __forceinline__ void mma_k32(int (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1, int c) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(c), "r"(c), "r"(c), "r"(c));
}

// k = 16 (Q6_K's sub-blocks of 16).
__device__ __forceinline__ void mma_k16(int (&d)[4], unsigned a0, unsigned a1, unsigned b0) {
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%7,%7,%7};\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a0), "r"(a1), "r"(b0), "r"(0));
}

// Warpgroup MMA (sm_90a only; the K-quant weight-plane tile): wgmma.mma_async m64n64k32 s8 × u8 → s32
// with both operands in shared memory, K-major with the 128-byte swizzle: the TMA stages' own layout
// (descriptors and fences in kernels/wgmma.cuh; the stage halves start on 1,024-byte boundaries). d is
// the warpgroup's 64×64 tile, 32 registers a thread: register i is row 16·(warp % 4) + lane / 4 +
// 8·((i >> 1) & 1), column 8·(i >> 2) + 2·(lane % 4) + (i & 1), the layout of mma.sync's m16n8
// fragments side by side. Measured in kernels/bench/imma_rate.cu
// (2026-11-30): the K-quant loop's ceiling rises from 363 TOPS (mma.sync, 64×32 warp tiles) to 495–575.
// d = a·b (scale_d = 0) or d += a·b (1) with b unsigned (u8): the K-quant weight planes.
__device__ __forceinline__ void wgmma_m64n64k32_u8(int (&d)[32], unsigned long long da, unsigned long long db,
                                                   int scale_d) {
#ifdef HAVE_WGMMA
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.u8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p;\n}\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31])
        : "l"(da), "l"(db), "r"(scale_d)
        : "memory");
#endif
}

// The chained Q8_0 tile's MMA: m64n128k32 s8 × s8 → s32, always accumulating (d += a·b): the
// accumulators run over a chain group of up to 8 blocks from the bias 0x4B400000 (crates/prism-quant
// src/chain.rs). 64 registers a thread, in the layout of the m64n64 tile above with 16 n8 tiles.
__device__ __forceinline__ void wgmma_m64n128k32_s8_acc(int (&d)[64], unsigned long long da,
                                                       unsigned long long db) {
#ifdef HAVE_WGMMA
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, 1;\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31]), "+r"(d[32]), "+r"(d[33]), "+r"(d[34]), "+r"(d[35]), "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]), "+r"(d[40]), "+r"(d[41]), "+r"(d[42]), "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]), "+r"(d[48]), "+r"(d[49]), "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]), "+r"(d[56]), "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63])
        : "l"(da), "l"(db)
        : "memory");
#endif
}

// The same with 64 columns (32 registers), for the chained tile's two column halves.
__device__ __forceinline__ void wgmma_m64n64k32_s8_acc(int (&d)[32], unsigned long long da,
                                                      unsigned long long db) {
#ifdef HAVE_WGMMA
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, 1;\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31])
        : "l"(da), "l"(db)
        : "memory");
#endif
}

// The i32 accumulator's bits 0x4B400000 + D are the float 1.5·2^23 + D (exact for |D| < 2^22).
// A copy of a value the compiler cannot see through (so it cannot hoist what is derived from it out
// of a loop).
__device__ __forceinline__ int opaque_int(int x) {
    int y;
    asm volatile("mov.b32 %0, %1;" : "=r"(y) : "r"(x));
    return y;
}
template <typename T>
__device__ __forceinline__ const T* opaque_ptr(const T* p) {
    unsigned long long y;
    asm volatile("mov.b64 %0, %1;" : "=l"(y) : "l"(reinterpret_cast<unsigned long long>(p)));
    return reinterpret_cast<const T*>(y);
}

// A compile-time int as a type (for generic lambdas specialized per case).
template <int V>
struct IntC {
    static constexpr int value = V;
};

#define MAGIC_I 0x4B400000
#define MAGIC_F 12582912.0f

template <int FMT>
struct Layout {
    static constexpr int BK = FMT == FMT_Q8_0 ? 128 : 256;  // bytes of K per stage
    static constexpr int BLK = FMT == FMT_Q8_0 ? 32 : 256;  // elements per block
    static constexpr int BPS = BK / BLK;                     // blocks per stage
    static constexpr int SUB = FMT == FMT_Q6K ? 16 : 32;     // elements per sub-block
    static constexpr int SPB = BLK / SUB;                    // sub-blocks per block (Q8_0: 1)
};

// The chained Q8_0 reduction (crates/prism-quant/src/chain.rs): within each of the four parts, groups of
// up to CHAIN blocks from the part's start. Stages of 4 blocks never straddle a part, so a group ends at
// a stage's end. chain_group_end: the index of the group that a stage of blocks [b, b + cnt) closes, or
// −1 (groups numbered part by part, the row index of the block-major corrections [group][N]).
#define CHAIN 8
__device__ __forceinline__ int chain_group_end(int nb, int b, int cnt) {
    int base = 0;
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        const int s = p * nb / 4, e = (p + 1) * nb / 4;
        if (b >= s && b < e) {
            const int end = b + cnt;
            return (end - s) % CHAIN == 0 || end == e ? base + (end - 1 - s) / CHAIN : -1;
        }
        base += (e - s + CHAIN - 1) / CHAIN;
    }
    return -1;
}

// ALIGN: the stage size's granularity (TMA stages start on 1,024-byte boundaries).
// WG (the wgmma tiles, see qgemm_tc2): K-quant stages also hold the second weight plane (`PLO`, a B tile,
// on a 1,024-byte boundary); chained Q8_0 stages the corrections of a chain group that ends there
// (`DMIN`, f32 [BN]).
template <int FMT, int BM, int BN, int ALIGN = 128, bool WG = false>
struct Smem {
    using L = Layout<FMT>;
    static constexpr int A = 0;
    static constexpr int B = A + BM * L::BK;
    static constexpr int D = B + BN * L::BK;                                      // f32 [BPS][BN]
    static constexpr int DMIN = D + 4 * L::BPS * BN;                              // f32 [BN]
    // K-quants: the block's min scales; the chained Q8_0 tile (WG): the group corrections.
    static constexpr int SC = DMIN + (FMT == FMT_K32 || (FMT == FMT_Q8_0 && WG) ? 4 * BN : 0);  // i8 [BN][SPB]
    static constexpr int MIN = SC + (FMT == FMT_Q8_0 ? 0 : BN * L::SPB);          // i8 [BN][8]
    static constexpr int ASUM = MIN + (FMT == FMT_K32 ? BN * 8 : 0);              // i32 [BM][8]
    static constexpr int ASUM_END = ASUM + (FMT == FMT_K32 ? 4 * BM * 8 : 0);
    static constexpr int PLO = (ASUM_END + 1023) / 1024 * 1024;                   // u8 [BN][BK] (WG)
    static constexpr int END = WG && FMT != FMT_Q8_0 ? PLO + BN * L::BK : ASUM_END;
    static constexpr int STAGE = (END + ALIGN - 1) / ALIGN * ALIGN;
};

template <int FMT, int WARPS_M, int WARPS_N, int MT, int NT, int STAGES>
__device__ __forceinline__ void qgemm_tc(const int8_t* __restrict__ qa, const int* __restrict__ asums,
                                         const int8_t* __restrict__ wq, const int8_t* __restrict__ wsc,
                                         const int8_t* __restrict__ wmin, const float* __restrict__ wd,
                                         const float* __restrict__ wdmin, float* __restrict__ out, int M,
                                         int N, int K, float scale) {
    using L = Layout<FMT>;
    constexpr int BM = WARPS_M * MT * 16, BN = WARPS_N * NT * 8, THREADS = WARPS_M * WARPS_N * 32;
    constexpr int BK = L::BK, CHUNKS = BK / 16;
    using S = Smem<FMT, BM, BN>;
    static_assert(NT % 2 == 0, "B fragments are loaded two n-tiles at a time");
    extern __shared__ __align__(128) unsigned char smem[];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;
    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
    const int G = gridDim.z, z = blockIdx.z;
    const int nb = K / L::BLK, n32 = K / 32;
    const int p_begin = z * 4 / G, p_end = (z + 1) * 4 / G;
    const int b_begin = p_begin * nb / 4, b_end = p_end * nb / 4;
    const int n_stages = (b_end - b_begin + L::BPS - 1) / L::BPS;

    auto load_stage = [&](int buf, int bs) {
        unsigned char* st = smem + buf * S::STAGE;
        const int valid_bytes = min(L::BPS, b_end - bs) * L::BLK;
        const size_t k0 = (size_t)bs * L::BLK;
        for (int i = tid; i < BM * CHUNKS; i += THREADS) {
            const int r = i / CHUNKS, c = i % CHUNKS;
            const bool ok = m0 + r < M && c * 16 < valid_bytes;
            const int8_t* src = ok ? qa + (size_t)(m0 + r) * K + k0 + c * 16 : qa;
            cp_async16(st + S::A + r * BK + ((c ^ (r & 7)) << 4), src, ok);
        }
        for (int i = tid; i < BN * CHUNKS; i += THREADS) {
            const int r = i / CHUNKS, c = i % CHUNKS;
            const bool ok = n0 + r < N && c * 16 < valid_bytes;
            const int8_t* src = ok ? wq + (size_t)(n0 + r) * K + k0 + c * 16 : wq;
            cp_async16(st + S::B + r * BK + ((c ^ (r & 7)) << 4), src, ok);
        }
        for (int i = tid; i < L::BPS * BN; i += THREADS) {
            const int blk = i / BN, col = i % BN;
            const bool ok = n0 + col < N && bs + blk < b_end;
            const float* src = ok ? wd + (size_t)(bs + blk) * N + n0 + col : wd;
            cp_async4(st + S::D + 4 * i, src, ok);
        }
        if constexpr (FMT == FMT_K32) {
            for (int i = tid; i < BN; i += THREADS) {
                const bool ok = n0 + i < N;
                const size_t row = (size_t)(ok ? n0 + i : 0);
                cp_async4(st + S::DMIN + 4 * i, wdmin + (size_t)bs * N + row, ok);
                cp_async8(st + S::SC + 8 * i, wsc + ((size_t)bs * N + row) * 8, ok);
                cp_async8(st + S::MIN + 8 * i, wmin + ((size_t)bs * N + row) * 8, ok);
            }
            for (int i = tid; i < BM * 2; i += THREADS) {
                const int r = i / 2, half = i % 2;
                const bool ok = m0 + r < M;
                const int* src = asums + (size_t)(ok ? m0 + r : 0) * n32 + (size_t)bs * 8 + half * 4;
                cp_async16(st + S::ASUM + 16 * i, src, ok);
            }
        }
        if constexpr (FMT == FMT_Q6K) {
            for (int i = tid; i < BN; i += THREADS) {
                const bool ok = n0 + i < N;
                const size_t row = (size_t)(ok ? n0 + i : 0);
                cp_async16(st + S::SC + 16 * i, wsc + ((size_t)bs * N + row) * 16, ok);
            }
        }
    };

    float acc[MT][NT][4], lo[MT][NT][4], s[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = lo[i][j][e] = s[i][j][e] = 0.f;

    // Close part `p` of every output this thread holds (see the header comment for the tree).
    auto finish_part = [&](int p) {
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float a = acc[i][j][e];
                    if (G == 4) {
                        s[i][j][e] = a;
                    } else if ((p & 1) == 0) {
                        lo[i][j][e] = a;
                    } else {
                        const float pair = __fadd_rn(lo[i][j][e], a);
                        s[i][j][e] = (G == 1 && p == 3) ? __fadd_rn(s[i][j][e], pair) : pair;
                    }
                    acc[i][j][e] = 0.f;
                }
    };

    // Row / column of this thread's fragment elements inside the CTA tile.
    const int a_row = wm * MT * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;  // ldmatrix A address row
    const int a_chunk = lane >> 4;
    const int b_row = wn * NT * 8 + (lane & 7) + ((lane >> 4) << 3);      // ldmatrix B address row
    const int b_chunk = (lane >> 3) & 1;
    const int c_col = wn * NT * 8 + 2 * (lane & 3);                       // + nt·8 (+1)
    const int c_row = wm * MT * 16 + (lane >> 2);                         // + mt·16 (+8)

    // Loads the A and B fragments of the k=32 slice `kc` of a stage.
    auto load_frags = [&](const unsigned char* st, int kc, unsigned (&af)[MT][4], unsigned (&bf)[NT][2]) {
#pragma unroll
        for (int i = 0; i < MT; ++i) {
            const int r = a_row + i * 16, c = 2 * kc + a_chunk;
            ldmatrix_x4(af[i], st + S::A + r * BK + ((c ^ (r & 7)) << 4));
        }
#pragma unroll
        for (int j = 0; j < NT; j += 2) {
            const int r = b_row + j * 8, c = 2 * kc + b_chunk;
            unsigned t[4];
            ldmatrix_x4(t, st + S::B + r * BK + ((c ^ (r & 7)) << 4));
            bf[j][0] = t[0];
            bf[j][1] = t[1];
            bf[j + 1][0] = t[2];
            bf[j + 1][1] = t[3];
        }
    };

    int part = p_begin;
    for (int st_i = 0; st_i < STAGES - 1; ++st_i) {
        if (st_i < n_stages) load_stage(st_i, b_begin + st_i * L::BPS);
        cp_async_commit();
    }
    for (int it = 0; it < n_stages; ++it) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        {
            const int nxt = it + STAGES - 1;
            if (nxt < n_stages) load_stage(nxt % STAGES, b_begin + nxt * L::BPS);
            cp_async_commit();
        }
        const unsigned char* st = smem + (it % STAGES) * S::STAGE;
        const int bs = b_begin + it * L::BPS;
#pragma unroll
        for (int blk = 0; blk < L::BPS; ++blk) {
            const int b = bs + blk;
            if (b >= b_end) break;
            while (b >= (part + 1) * nb / 4) {  // parts that end before block b (empty ones included)
                finish_part(part);
                ++part;
            }
            if constexpr (FMT == FMT_Q8_0) {
                unsigned af[MT][4], bf[NT][2];
                load_frags(st, blk, af, bf);
                const float* dsm = reinterpret_cast<const float*>(st + S::D) + blk * BN;
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    const float2 dv = *reinterpret_cast<const float2*>(dsm + c_col + j * 8);
#pragma unroll
                    for (int i = 0; i < MT; ++i) {
                        int c[4];
                        mma_k32(c, af[i], bf[j][0], bf[j][1], MAGIC_I);
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const float db = __fsub_rn(__int_as_float(c[e]), MAGIC_F);  // = f32(D_b), exact
                            acc[i][j][e] = fmaf((e & 1) ? dv.y : dv.x, db, acc[i][j][e]);
                        }
                    }
                }
            } else {
                int dsum[MT][NT][4];
#pragma unroll
                for (int i = 0; i < MT; ++i)
#pragma unroll
                    for (int j = 0; j < NT; ++j)
#pragma unroll
                        for (int e = 0; e < 4; ++e) dsum[i][j][e] = 0;
                const int8_t* scs = reinterpret_cast<const int8_t*>(st + S::SC);
#pragma unroll 2
                for (int kc = 0; kc < BK / 32; ++kc) {
                    unsigned af[MT][4], bf[NT][2];
                    load_frags(st, kc, af, bf);
#pragma unroll
                    for (int j = 0; j < NT; ++j) {
                        const int col = c_col + j * 8;
                        if constexpr (FMT == FMT_K32) {
                            const int sc0 = scs[col * 8 + kc], sc1 = scs[(col + 1) * 8 + kc];
#pragma unroll
                            for (int i = 0; i < MT; ++i) {
                                int c[4];
                                mma_k32(c, af[i], bf[j][0], bf[j][1], 0);
                                dsum[i][j][0] += sc0 * c[0];
                                dsum[i][j][1] += sc1 * c[1];
                                dsum[i][j][2] += sc0 * c[2];
                                dsum[i][j][3] += sc1 * c[3];
                            }
                        } else {
                            // Two sub-blocks of 16: A regs {0,1} / B reg 0 are k 0..15, {2,3} / 1 are k 16..31.
                            const int sa0 = scs[col * 16 + 2 * kc], sa1 = scs[(col + 1) * 16 + 2 * kc];
                            const int sb0 = scs[col * 16 + 2 * kc + 1], sb1 = scs[(col + 1) * 16 + 2 * kc + 1];
#pragma unroll
                            for (int i = 0; i < MT; ++i) {
                                int c[4], d[4];
                                mma_k16(c, af[i][0], af[i][1], bf[j][0]);
                                mma_k16(d, af[i][2], af[i][3], bf[j][1]);
                                dsum[i][j][0] += sa0 * c[0] + sb0 * d[0];
                                dsum[i][j][1] += sa1 * c[1] + sb1 * d[1];
                                dsum[i][j][2] += sa0 * c[2] + sb0 * d[2];
                                dsum[i][j][3] += sa1 * c[3] + sb1 * d[3];
                            }
                        }
                    }
                }
                const float* dsm = reinterpret_cast<const float*>(st + S::D);
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    const int col = c_col + j * 8;
                    const float2 dv = *reinterpret_cast<const float2*>(dsm + col);
                    if constexpr (FMT == FMT_K32) {
                        const float2 dm = *reinterpret_cast<const float2*>(
                            reinterpret_cast<const float*>(st + S::DMIN) + col);
                        const int8_t* mins = reinterpret_cast<const int8_t*>(st + S::MIN);
                        const int* as = reinterpret_cast<const int*>(st + S::ASUM);
#pragma unroll
                        for (int i = 0; i < MT; ++i) {
                            const int r0 = c_row + i * 16, r1 = r0 + 8;
                            int mb[4] = {0, 0, 0, 0};
#pragma unroll
                            for (int q = 0; q < 8; ++q) {
                                const int m_c0 = mins[col * 8 + q], m_c1 = mins[(col + 1) * 8 + q];
                                const int s0 = as[r0 * 8 + q], s1 = as[r1 * 8 + q];
                                mb[0] += m_c0 * s0;
                                mb[1] += m_c1 * s0;
                                mb[2] += m_c0 * s1;
                                mb[3] += m_c1 * s1;
                            }
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                const float dd = (e & 1) ? dv.y : dv.x, dmn = (e & 1) ? dm.y : dm.x;
                                float a = fmaf(dd, __int2float_rn(dsum[i][j][e]), acc[i][j][e]);
                                acc[i][j][e] = fmaf(-dmn, __int2float_rn(mb[e]), a);
                            }
                        }
                    } else {
#pragma unroll
                        for (int i = 0; i < MT; ++i)
#pragma unroll
                            for (int e = 0; e < 4; ++e)
                                acc[i][j][e] = fmaf((e & 1) ? dv.y : dv.x, __int2float_rn(dsum[i][j][e]),
                                                    acc[i][j][e]);
                    }
                }
            }
        }
    }
    cp_async_wait<0>();
    while (part < p_end) {  // the last part, and any empty parts after the last block
        finish_part(part);
        ++part;
    }

    float* dst = G == 1 ? out : out + (size_t)z * M * N;
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = m0 + c_row + i * 16 + (e >> 1) * 8, c = n0 + c_col + j * 8 + (e & 1);
                if (r < M && c < N) {
                    const float v = s[i][j][e];
                    dst[(size_t)r * N + c] = G == 1 ? __fmul_rn(v, scale) : v;
                }
            }
}

// Folds the G partial results of a split launch with the fixed tree and applies the scale (rows of N
// outputs; a row flagged in bad_rows, if given, becomes NaN).
extern "C" __global__ void qgemm_combine(const float* __restrict__ ws, float* __restrict__ y, long long count,
                                         int G, float scale, long long N,
                                         const unsigned int* __restrict__ bad_rows) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    if (row_poisoned(bad_rows, i / N)) {
        y[i] = POISON_NAN;
        return;
    }
    float t;
    if (G == 4)
        t = __fadd_rn(__fadd_rn(ws[i], ws[count + i]), __fadd_rn(ws[2 * count + i], ws[3 * count + i]));
    else
        t = __fadd_rn(ws[i], ws[count + i]);
    y[i] = __fmul_rn(t, scale);
}

// Folds the tail of a tail-split launch (see qgemm_tc2): the [4, M − r0, N − c0] workspace into the
// outputs (r0.., c0..) of y, with qgemm_combine's G = 4 tree.
extern "C" __global__ void qgemm_combine_tail(const float* __restrict__ ws, float* __restrict__ y, int M, int N,
                                              int r0, int c0, float scale,
                                              const unsigned int* __restrict__ bad_rows) {
    const long long cols = N - c0, count = (long long)(M - r0) * cols;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    const long long r = r0 + i / cols;
    const float t = __fadd_rn(__fadd_rn(ws[i], ws[count + i]), __fadd_rn(ws[2 * count + i], ws[3 * count + i]));
    y[(size_t)r * N + (c0 + i % cols)] = row_poisoned(bad_rows, r) ? POISON_NAN : __fmul_rn(t, scale);
}

// Device checks: how many of n f32 elements of a and b differ in their bits (NaNs and signed zeros
// included), added to *count.
extern "C" __global__ void count_bit_differences(const float* __restrict__ a, const float* __restrict__ b,
                                                 long long n, unsigned long long* __restrict__ count) {
    unsigned local = 0;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        local += __float_as_uint(a[i]) != __float_as_uint(b[i]);
    for (int o = 16; o > 0; o >>= 1) local += __shfl_down_sync(0xffffffffu, local, o);
    if ((threadIdx.x & 31) == 0 && local != 0) atomicAdd(count, (unsigned long long)local);
}

// The instantiations the host launches (names in crates/prism-quant/src/cuda_plan.rs). 4 warps of 32×32
// outputs: CTA tile 64×64; Q8_0 4 stages of 17 KiB, K-quants 3 stages of ~34 KiB (dynamic shared memory).
#define QGEMM_ARGS                                                                                          \
    const int8_t *__restrict__ qa, const int *__restrict__ asums, const int8_t *__restrict__ wq,          \
        const int8_t *__restrict__ wsc, const int8_t *__restrict__ wmin, const float *__restrict__ wd,    \
        const float *__restrict__ wdmin, float *__restrict__ out, int M, int N, int K, float scale
#define QGEMM_PASS qa, asums, wq, wsc, wmin, wd, wdmin, out, M, N, K, scale

extern "C" __global__ void __launch_bounds__(128) qgemm_q8_0_64x64(QGEMM_ARGS) {
    qgemm_tc<FMT_Q8_0, 2, 2, 2, 4, 4>(QGEMM_PASS);
}
extern "C" __global__ void __launch_bounds__(128) qgemm_k32_64x64(QGEMM_ARGS) {
    qgemm_tc<FMT_K32, 2, 2, 2, 4, 3>(QGEMM_PASS);
}
extern "C" __global__ void __launch_bounds__(128) qgemm_q6k_64x64(QGEMM_ARGS) {
    qgemm_tc<FMT_Q6K, 2, 2, 2, 4, 3>(QGEMM_PASS);
}

// ===================================================================================================
// v2: the second tensor-core family (larger CTA tiles, rasterized grid, tree state in memory).
//
// Same arithmetic and the same per-output float sequence as the v1 kernel above (and so as the CPU
// reference); what changes is only how the work is spread:
//
// * CTA tiles of 64×128, 128×128 or 128×256 outputs, 8 warps (256 threads) in a 2 × 4 grid, warp tiles
//   of 32×32, 64×32 or 64×64 outputs (MT m16 tiles × NT n8 tiles). Fragments come from XOR-swizzled
//   shared memory by ldmatrix exactly as in v1; the stage loads are cp.async, STAGES deep.
// * Stages never straddle a part: the K loop walks the group's parts in order and each part in stages
//   of at most BPS blocks, so a part closes between two stages (no check per block), and a full stage
//   (the common case) runs unrolled with the next k=32 slice's fragments loaded while the current one
//   is in the tensor cores.
// * The part tree keeps one float per output in registers (`acc`, the running part). The closed parts
//   go to memory, each written and read back by the one thread that owns the output (no other thread
//   ever touches it, so no synchronization is needed):
//     G = 1: p0 → scratch; p1: out = scratch + acc; p2 → scratch; p3: out = (out + (scratch + acc))·scale
//     G = 2: even part → ws[z]; odd part: ws[z] = ws[z] + acc            (qgemm_combine folds)
//     G = 4: ws[z] = acc                                                 (qgemm_combine folds)
//   These are v1's `lo` / pair / `s` operations with the same operands in the same order, so every
//   output has the same bits for every family, tile and G. `scratch` is an [M, N] f32 buffer (G = 1
//   only); `out` is y (G = 1) or the [G, M, N] workspace (G > 1).
// * The grid is one-dimensional over the output tiles (z = part group), rasterized in groups of
//   `group_m` tile rows: tile rows first within a group, so the CTAs running at one time share the
//   same weight tiles and a bounded set of activation rows (L2 reuse when M is large).
// ===================================================================================================

template <int FMT, int WARPS_M, int WARPS_N, int MT, int NT, int STAGES, bool WS = false, bool TMA = false,
          bool WG = false>
__device__ __forceinline__ void qgemm_tc2(const int8_t* __restrict__ qa, const int* __restrict__ asums,
                                          const int8_t* __restrict__ wq, const int8_t* __restrict__ wsc,
                                          const int8_t* __restrict__ wmin, const float* __restrict__ wd,
                                          const float* __restrict__ wdmin, float* __restrict__ out,
                                          int M, int N, int K, float scale, float* __restrict__ scratch,
                                          int group_m, int tail_base, float* __restrict__ tail_ws,
                                          const unsigned int* __restrict__ bad_rows,
                                          const TmaDesc* tmap_a = nullptr,
                                          const TmaDesc* tmap_b = nullptr) {
    using L = Layout<FMT>;
    constexpr int BM = WARPS_M * MT * 16, BN = WARPS_N * NT * 8, THREADS = WARPS_M * WARPS_N * 32;
    constexpr int BK = L::BK, CHUNKS = BK / 16, BPS = L::BPS;
    using S = Smem<FMT, BM, BN, TMA ? 1024 : 128, WG>;
    static_assert(NT % 2 == 0, "B fragments are loaded two n-tiles at a time");
    static_assert(THREADS % CHUNKS == 0, "a thread copies the same 16-byte column of every row it loads");
    static_assert(!TMA || WS, "the TMA copies are the warp-specialized loop's");
    // The weight-plane wgmma tile (WG, see planes_make): two consumer warpgroups of 64 rows × all 64
    // columns; a warp's fragments are one m16 row tile × eight n8 column tiles (so the part tree and the
    // block end below are unchanged).
    // The chained Q8_0 tile (WG with Q8_0): two consumer warpgroups of 64 rows × all 128 columns, warp
    // tiles of 16 × 128 (one m16 row tile × sixteen n8 column tiles).
    static_assert(!WG || (TMA && WARPS_M == 8 && WARPS_N == 1 && MT == 1 &&
                          ((FMT == FMT_K32 && NT == 8) || (FMT == FMT_Q8_0 && NT == 16))),
                  "the wgmma tiles: K-quant 128×64 or Q8_0 128×128 TMA tiles as 8 × 1 warps of 16 × BN");
    // TMA with 256-byte K-quant stages: each matrix arrives as two boxes of 128 bytes of K (the 128-byte
    // swizzle spans one box row), so 16-byte chunk c of row r sits in half c >> 3, at chunk
    // (c & 7) ^ (r & 7) of row r of that half. Otherwise rows are BK bytes with chunk c ^ (r & 7).
    constexpr bool SPLIT = TMA && BK > 128;
    static_assert(!SPLIT || BK == 256, "two boxes of 128 bytes a stage");
    extern __shared__ __align__(128) unsigned char smem_raw[];
    // TMA's 128-byte swizzle repeats every 1,024 bytes: its stages start on a 1,024-byte boundary (the
    // host asks for 1 KiB more). The swizzle is the kernel's own: 16-byte chunk c of row r at chunk
    // c ^ (r & 7) of a 128-byte row.
    unsigned char* const smem =
        TMA ? smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u) : smem_raw;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;

    // Rasterized tile coordinates (see the header): group_m tile rows × all tile columns per group.
    const int m_tiles = (M + BM - 1) / BM, n_tiles = (N + BN - 1) / BN;
    const int gm = max(1, min(group_m, m_tiles));
    const int per_group = gm * n_tiles;
    auto tile_origin = [&](int t, int& tm0, int& tn0) {
        const int grp = t / per_group, first_m = grp * gm;
        const int gsize = min(m_tiles - first_m, gm), in_grp = t - grp * per_group;
        tm0 = (first_m + in_grp % gsize) * BM;
        tn0 = (in_grp / gsize) * BN;
    };
    // The tail split (G = 1 launches only): tiles from `tail_base` on (in raster order: the last
    // columns of the last group, a rectangle of whole tiles from the first tail tile's origin to
    // (M, N)) each run as four CTAs, one per part, as a G = 4 launch would, writing a [4, M − r0,
    // N − c0] workspace that qgemm_combine_tail folds. So the grid's last wave is made of quarter-length
    // CTAs instead of a few full ones. Without a tail, tail_base ≥ the grid.
    int pid = blockIdx.x, G = gridDim.z, z = blockIdx.z;
    const bool tail = pid >= tail_base;
    if (tail) {
        const int t = pid - tail_base;
        pid = tail_base + t / 4;
        z = t % 4;
        G = 4;
    }
    int m0, n0;
    tile_origin(pid, m0, n0);
    // Where the G > 1 partial results go: part z at ws_base + z · ws_part, row r at (r − ws_r0) · ws_ld,
    // column c at c − ws_c0.
    int ws_r0 = 0, ws_c0 = 0, ws_ld = N;
    float* ws_base = out;
    size_t ws_part = (size_t)M * N;
    if (tail) {
        tile_origin(tail_base, ws_r0, ws_c0);
        ws_ld = N - ws_c0;
        ws_base = tail_ws;
        ws_part = (size_t)(M - ws_r0) * ws_ld;
    }

    const int nb = K / L::BLK, n32 = K / 32;
    const int p_begin = z * 4 / G, p_end = (z + 1) * 4 / G;
    auto part_end = [&](int p) { return (p + 1) * nb / 4; };
    // Persistent CTAs (the Q8_0 mma.sync warp-specialized tiles, G = 1 without a tail, a grid smaller
    // than the tile count): CTA i walks tiles i, i + grid, i + 2·grid, … in raster order, its producers
    // loading the next tile's first stages while the compute warps close the current tile's parts.
    // Otherwise the walk is the one tile `pid`. Only Q8_0 (PERSIST): the tile loop made the K-quant TMA
    // tile spill (156 bytes instead of 32) and run 8–11 % slower when not persistent.
    constexpr bool PERSIST = WS && !WG && FMT == FMT_Q8_0;
    const int total_tiles = m_tiles * n_tiles;
    const bool persistent = PERSIST && G == 1 && tail_base >= (int)gridDim.x && (int)gridDim.x < total_tiles;
    const int tile_step = persistent ? (int)gridDim.x : total_tiles;

    // ---- stage loads -------------------------------------------------------------------------------
    // A and B: thread `tid` copies 16-byte column c = tid % CHUNKS of rows tid / CHUNKS + it · ROWS_PER_IT.
    // Rows past M / N and bytes past the stage's `count` blocks are zero-filled (cp.async with src-size
    // 0, from a valid dummy address). The swizzle (c ^ (r & 7)) is the same for all of a thread's rows
    // (ROWS_PER_IT is a multiple of 8), so the shared addresses are one base plus constants.
    //
    // The per-thread bases go through `opaque` inside the loops: without it the compiler hoists every
    // derived address (and the output indices of finish_part) out of the K loop and keeps them in
    // registers for its whole length, which costs more registers than the accumulators.
    constexpr int ROWS_PER_IT = THREADS / CHUNKS;
    static_assert(ROWS_PER_IT % 8 == 0, "one swizzle per thread");
    const int ld_row = tid / CHUNKS, ld_chunk = tid % CHUNKS;
    const int ld_swz = ld_row * BK + ((ld_chunk ^ (ld_row & 7)) << 4);
    const int a_rows = M - m0 - ld_row, b_rows = N - n0 - ld_row;  // row `it` valid iff it·RPI < rows
    const int8_t* a_base = qa + (size_t)max(0, min(m0 + ld_row, M - 1)) * K + ld_chunk * 16;
    const int8_t* b_base = wq + (size_t)max(0, min(n0 + ld_row, N - 1)) * K + ld_chunk * 16;
    const size_t row_step = (size_t)ROWS_PER_IT * K;

    auto load_stage = [&](int buf, int bs, int count) {
        unsigned char* st = smem + buf * S::STAGE;
        const bool chunk_ok = ld_chunk * 16 < count * L::BLK;
        const size_t k0 = (size_t)bs * L::BLK;
        {
            const int8_t* src = opaque_ptr(a_base) + k0;
#pragma unroll
            for (int it = 0; it < (BM + ROWS_PER_IT - 1) / ROWS_PER_IT; ++it) {
                if (BM % ROWS_PER_IT == 0 || ld_row + it * ROWS_PER_IT < BM) {
                    const bool ok = chunk_ok && it * ROWS_PER_IT < a_rows;
                    cp_async16(st + S::A + ld_swz + it * ROWS_PER_IT * BK, ok ? src : qa, ok);
                }
                src += row_step;
            }
        }
        {
            const int8_t* src = opaque_ptr(b_base) + k0;
#pragma unroll
            for (int it = 0; it < (BN + ROWS_PER_IT - 1) / ROWS_PER_IT; ++it) {
                if (BN % ROWS_PER_IT == 0 || ld_row + it * ROWS_PER_IT < BN) {
                    const bool ok = chunk_ok && it * ROWS_PER_IT < b_rows;
                    cp_async16(st + S::B + ld_swz + it * ROWS_PER_IT * BK, ok ? src : wq, ok);
                }
                src += row_step;
            }
        }
        // Block scales, smem [BPS][BN]: element i = blk · BN + col.
        const int n0o = opaque_int(n0);
#pragma unroll
        for (int it = 0; it < (BPS * BN + THREADS - 1) / THREADS; ++it) {
            const int i = tid + it * THREADS;
            if ((BPS * BN) % THREADS == 0 || i < BPS * BN) {
                const int blk = i / BN, col = n0o + i % BN;
                const bool ok = col < N && blk < count;
                const float* src = ok ? wd + (size_t)(bs + blk) * N + col : wd;
                cp_async4(st + S::D + 4 * i, src, ok);
            }
        }
        if constexpr (FMT == FMT_K32) {
            const int m0o = opaque_int(m0);
            for (int i = tid; i < BN; i += THREADS) {
                const bool ok = n0o + i < N;
                const size_t row = (size_t)(ok ? n0o + i : 0);
                cp_async4(st + S::DMIN + 4 * i, wdmin + (size_t)bs * N + row, ok);
                cp_async8(st + S::SC + 8 * i, wsc + ((size_t)bs * N + row) * 8, ok);
                cp_async8(st + S::MIN + 8 * i, wmin + ((size_t)bs * N + row) * 8, ok);
            }
            for (int i = tid; i < BM * 2; i += THREADS) {
                const int r = i / 2, half = i % 2;
                const bool ok = m0o + r < M;
                const int* src = asums + (size_t)(ok ? m0o + r : 0) * n32 + (size_t)bs * 8 + half * 4;
                cp_async16(st + S::ASUM + 16 * i, src, ok);
            }
        }
        if constexpr (FMT == FMT_Q6K) {
            for (int i = tid; i < BN; i += THREADS) {
                const bool ok = n0o + i < N;
                const size_t row = (size_t)(ok ? n0o + i : 0);
                cp_async16(st + S::SC + 16 * i, wsc + ((size_t)bs * N + row) * 16, ok);
            }
        }
    };

    // ---- the part tree (one running float per output; closed parts in memory) ----------------------
    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

    const int c_col = wn * NT * 8 + 2 * (lane & 3);  // + j·8 (+1)
    const int c_row = wm * MT * 16 + (lane >> 2);    // + i·16 (+8)

    // Closes part p: the operation depends only on (G, p), uniform over the grid; each output is then
    // one or two memory operations by its owner thread.
    //
    // The reads of a row's outputs are all issued before any of its writes (the compiler cannot tell
    // that `out` and `scratch` never overlap: written element by element, every read waited for the
    // previous write). Reads go through L2 only (`__ldcg`). A tile wholly inside the output with N even
    // (the common case) takes the fast path: the operation chosen once, each thread's two adjacent
    // columns as one float2, no bounds checks; on the 5120-wide 27B shapes the element-wise version
    // was a quarter of the kernel's issued instructions.
    // Warp-specialized tiles keep G = 1's closed part (`scratch`) in shared memory after the stages and
    // barriers when it fits (227 KiB a CTA with the TMA alignment): rows of BN + 8 floats, the tile's
    // outputs, private to their threads like the global buffer. The part tree's global traffic drops
    // from seven accesses an output and tile to three; same operations on the same values, so the
    // same bits. cuda_plan.rs's `scratch_slot_bytes` makes the same choice.
    constexpr int SLOT_LD = BN + 8;
    constexpr int SLOT_OFF = (STAGES * S::STAGE + 16 * STAGES + 127) / 128 * 128;
    constexpr bool SLOT = WS && SLOT_OFF + 4 * BM * SLOT_LD + (TMA ? 1024 : 0) <= 227 * 1024;
    float* const slot = reinterpret_cast<float*>(smem + SLOT_OFF);
    // Row r's closed part at column n0 + c is scratch_row(r)[c].
    auto scratch_row = [&](int r) -> float* {
        return SLOT ? slot + (r - m0) * SLOT_LD : scratch + (size_t)r * N + n0;
    };
    auto scratch_ld = [](const float2* q) -> float2 { return SLOT ? *q : __ldcg(q); };
    auto finish_part = [&](int p) {
        const int r_base = opaque_int(m0 + c_row), c_base = opaque_int(n0 + c_col);
        const int op = G == 4 ? 0 : G == 2 ? ((p & 1) ? 2 : 1) : ((p & 1) == 0 ? 3 : p == 1 ? 4 : 5);
        float* ws = G == 1 ? out : ws_base + (size_t)z * ws_part;
        const int w_r0 = G == 1 ? 0 : ws_r0, w_c0 = G == 1 ? 0 : ws_c0, w_ld = G == 1 ? N : ws_ld;
        const bool full = m0 + BM <= M && n0 + BN <= N && (N & 1) == 0;
        if (full) {
            auto rows = [&](auto op_c) {
                constexpr int OP = decltype(op_c)::value;
#pragma unroll
                for (int i = 0; i < MT; ++i)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int r = r_base + i * 16 + h * 8;
                        float2* wr = reinterpret_cast<float2*>(ws + (size_t)(r - w_r0) * w_ld + (c_base - w_c0));
                        float2* sr = reinterpret_cast<float2*>(scratch_row(r) + (c_base - n0));
                        float2 xw[NT], xs[NT];
#pragma unroll
                        for (int j = 0; j < NT; ++j) {
                            if (OP == 2 || OP == 5) xw[j] = __ldcg(wr + j * 4);
                            if (OP == 4 || OP == 5) xs[j] = scratch_ld(sr + j * 4);
                        }
                        const bool poison = OP == 5 && row_poisoned(bad_rows, r);
#pragma unroll
                        for (int j = 0; j < NT; ++j) {
                            const float a0 = acc[i][j][2 * h], a1 = acc[i][j][2 * h + 1];
                            if (OP == 0 || OP == 1) wr[j * 4] = make_float2(a0, a1);
                            if (OP == 2) wr[j * 4] = make_float2(__fadd_rn(xw[j].x, a0), __fadd_rn(xw[j].y, a1));
                            if (OP == 3) sr[j * 4] = make_float2(a0, a1);
                            if (OP == 4) wr[j * 4] = make_float2(__fadd_rn(xs[j].x, a0), __fadd_rn(xs[j].y, a1));
                            if (OP == 5)
                                wr[j * 4] = poison ? make_float2(POISON_NAN, POISON_NAN)
                                                   : make_float2(__fmul_rn(__fadd_rn(xw[j].x, __fadd_rn(xs[j].x, a0)), scale),
                                                                 __fmul_rn(__fadd_rn(xw[j].y, __fadd_rn(xs[j].y, a1)), scale));
                        }
                    }
            };
            switch (op) {
                case 0:
                case 1: rows(IntC<0>{}); break;
                case 2: rows(IntC<2>{}); break;
                case 3: rows(IntC<3>{}); break;
                case 4: rows(IntC<4>{}); break;
                default: rows(IntC<5>{});
            }
        } else {
            const bool read_ws = op == 2 || op == 5, read_sc = op == 4 || op == 5;
#pragma unroll
            for (int i = 0; i < MT; ++i)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = r_base + i * 16 + h * 8;
                    // Row r of the target, indexed by c − w_c0 (rows past M are never touched).
                    float* ws_row = ws + (size_t)(r < M ? r - w_r0 : 0) * w_ld;
                    // Rows past M are never read or written (their slot rows exist; the global rows
                    // do not): the pointer is only formed.
                    float* sc_row = scratch_row(r) - n0;
                    float xw[NT][2], xs[NT][2];
#pragma unroll
                    for (int j = 0; j < NT; ++j)
#pragma unroll
                        for (int e1 = 0; e1 < 2; ++e1) {
                            const int c = c_base + j * 8 + e1;
                            const bool ok = r < M && c < N;
                            xw[j][e1] = ok && read_ws ? __ldcg(ws_row + (c - w_c0)) : 0.f;
                            xs[j][e1] = ok && read_sc ? (SLOT ? sc_row[c] : __ldcg(sc_row + c)) : 0.f;
                        }
                    if (r >= M) continue;
#pragma unroll
                    for (int j = 0; j < NT; ++j)
#pragma unroll
                        for (int e1 = 0; e1 < 2; ++e1) {
                            const int c = c_base + j * 8 + e1;
                            if (c >= N) continue;
                            const float a = acc[i][j][2 * h + e1];
                            const float w = xw[j][e1], s = xs[j][e1];
                            switch (op) {
                                case 0: ws_row[c - w_c0] = a; break;                                // G=4: p
                                case 1: ws_row[c - w_c0] = a; break;                                // G=2: lo
                                case 2: ws_row[c - w_c0] = __fadd_rn(w, a); break;                  // lo + acc
                                case 3: sc_row[c] = a; break;                                       // G=1: lo
                                case 4: ws_row[c - w_c0] = __fadd_rn(s, a); break;                  // s = lo + acc
                                default:                                                            // (s + pair)·scale
                                    ws_row[c - w_c0] = row_poisoned(bad_rows, r)
                                                           ? POISON_NAN
                                                           : __fmul_rn(__fadd_rn(w, __fadd_rn(s, a)), scale);
                            }
                        }
                }
        }
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;
    };

    // ---- fragments ---------------------------------------------------------------------------------
    const int a_row = wm * MT * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;  // ldmatrix A address row
    const int a_chunk = lane >> 4;
    const int b_row = wn * NT * 8 + (lane & 7) + ((lane >> 4) << 3);      // ldmatrix B address row
    const int b_chunk = (lane >> 3) & 1;

    // Byte offset of 16-byte chunk c of row r in a stage's matrix of `rows` rows (see SPLIT).
    auto chunk_at = [](int r, int c, int rows) {
        return SPLIT ? (c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4)
                     : r * BK + ((c ^ (r & 7)) << 4);
    };
    auto load_frags = [&](const unsigned char* st, int kc, unsigned (&af)[MT][4], unsigned (&bf)[NT][2]) {
#pragma unroll
        for (int i = 0; i < MT; ++i) {
            const int r = a_row + i * 16, c = 2 * kc + a_chunk;
            ldmatrix_x4(af[i], st + S::A + chunk_at(r, c, BM));
        }
#pragma unroll
        for (int j = 0; j < NT; j += 2) {
            const int r = b_row + j * 8, c = 2 * kc + b_chunk;
            unsigned t[4];
            ldmatrix_x4(t, st + S::B + chunk_at(r, c, BN));
            bf[j][0] = t[0];
            bf[j][1] = t[1];
            bf[j + 1][0] = t[2];
            bf[j + 1][1] = t[3];
        }
    };

    // The warp-specialized compute warps (224–232 registers) keep each slice's fragment offsets in
    // registers: a thread's fragment rows differ by multiples of 8, so the swizzle (r & 7) is one per
    // thread and slice kc's address is a per-thread offset plus a constant per row tile. Otherwise the
    // compiler re-derived them from the thread index (S2R and five more instructions a load) in every
    // stage. Only for calls with a compile-time kc (fully unrolled loops): a register array indexed at
    // run time would live in local memory.
    //
    // Q8_0: the 128-row tiles only. On an H200 (2026-11-30, seventh session) offsets in registers
    // measured +3–9 % on the 128-row Q8_0 tiles (M = 512–16,384) and −1–4 % on the 96-row tile at
    // M = 275 (docs/benchmarks.md); the third session had found 0–3 % slower for all Q8_0 tiles.
    constexpr bool OFFSETS_IN_REGS = WS && !WG && (FMT != FMT_Q8_0 || MT == 4);
    constexpr int KC = BK / 32;
    constexpr int ROW_BYTES = SPLIT ? 128 : BK;
    int a_off[OFFSETS_IN_REGS ? KC : 1], b_off[OFFSETS_IN_REGS ? KC : 1];
    if constexpr (OFFSETS_IN_REGS) {
#pragma unroll
        for (int kc = 0; kc < KC; ++kc) {
            a_off[kc] = opaque_int(chunk_at(a_row, 2 * kc + a_chunk, BM));
            b_off[kc] = opaque_int(chunk_at(b_row, 2 * kc + b_chunk, BN));
        }
    }
    auto load_frags_ws = [&](const unsigned char* st, int kc, unsigned (&af)[MT][4], unsigned (&bf)[NT][2]) {
#pragma unroll
        for (int i = 0; i < MT; ++i) ldmatrix_x4(af[i], st + S::A + a_off[kc] + i * 16 * ROW_BYTES);
#pragma unroll
        for (int j = 0; j < NT; j += 2) {
            unsigned t[4];
            ldmatrix_x4(t, st + S::B + b_off[kc] + j * 8 * ROW_BYTES);
            bf[j][0] = t[0];
            bf[j][1] = t[1];
            bf[j + 1][0] = t[2];
            bf[j + 1][1] = t[3];
        }
    };
    // Fragments of slice kc, with kc known at compile time after unrolling.
    auto load_frags_c = [&](const unsigned char* st, int kc, unsigned (&af)[MT][4], unsigned (&bf)[NT][2]) {
        if constexpr (OFFSETS_IN_REGS)
            load_frags_ws(st, kc, af, bf);
        else
            load_frags(st, kc, af, bf);
    };

    // Q8_0, block `blk` of a stage: one mma per 16×8 tile from the 1.5·2^23 accumulator, f32(D_b) by one
    // exact subtraction, one fma into the running part.
    auto q8_block = [&](const unsigned char* st, int blk, const unsigned (&af)[MT][4],
                        const unsigned (&bf)[NT][2]) {
        const float* dsm = reinterpret_cast<const float*>(st + S::D) + blk * BN;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const float2 dv = *reinterpret_cast<const float2*>(dsm + c_col + j * 8);
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                int c[4];
                mma_k32(c, af[i], bf[j][0], bf[j][1], MAGIC_I);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float db = __fsub_rn(__int_as_float(c[e]), MAGIC_F);  // = f32(D_b), exact
                    acc[i][j][e] = fmaf((e & 1) ? dv.y : dv.x, db, acc[i][j][e]);
                }
            }
        }
    };

    // The same block in two halves, for the rotated loop below: q8_mmas issues the block's mmas into
    // `c`; q8_fold later turns them into its fmas with the block's scales `dv`.
    auto q8_mmas = [&](int (&c)[MT][NT][4], const unsigned (&af)[MT][4], const unsigned (&bf)[NT][2]) {
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int i = 0; i < MT; ++i) mma_k32(c[i][j], af[i], bf[j][0], bf[j][1], MAGIC_I);
    };
    auto q8_scales = [&](const unsigned char* st, int blk, float2 (&dv)[NT]) {
        const float* dsm = reinterpret_cast<const float*>(st + S::D) + blk * BN;
#pragma unroll
        for (int j = 0; j < NT; ++j) dv[j] = *reinterpret_cast<const float2*>(dsm + c_col + j * 8);
    };
    auto q8_fold = [&](const int (&c)[MT][NT][4], const float2 (&dv)[NT]) {
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int i = 0; i < MT; ++i)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float db = __fsub_rn(__int_as_float(c[i][j][e]), MAGIC_F);  // = f32(D_b), exact
                    acc[i][j][e] = fmaf((e & 1) ? dv[j].y : dv[j].x, db, acc[i][j][e]);
                }
    };

    // K-quants: the integer sub-block sums of k=32 slice `kc` of the block, times their integer scales,
    // into dsum (exact i32).
    auto kq_slice = [&](const unsigned char* st, int kc, const unsigned (&af)[MT][4],
                        const unsigned (&bf)[NT][2], int (&dsum)[MT][NT][4]) {
        const int8_t* scs = reinterpret_cast<const int8_t*>(st + S::SC);
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const int col = c_col + j * 8;
            if constexpr (FMT == FMT_K32) {
                const int sc0 = scs[col * 8 + kc], sc1 = scs[(col + 1) * 8 + kc];
#pragma unroll
                for (int i = 0; i < MT; ++i) {
                    int c[4];
                    mma_k32(c, af[i], bf[j][0], bf[j][1], 0);
                    dsum[i][j][0] += sc0 * c[0];
                    dsum[i][j][1] += sc1 * c[1];
                    dsum[i][j][2] += sc0 * c[2];
                    dsum[i][j][3] += sc1 * c[3];
                }
            } else {
                // Two sub-blocks of 16: A regs {0,1} / B reg 0 are k 0..15, {2,3} / 1 are k 16..31.
                const int sa0 = scs[col * 16 + 2 * kc], sa1 = scs[(col + 1) * 16 + 2 * kc];
                const int sb0 = scs[col * 16 + 2 * kc + 1], sb1 = scs[(col + 1) * 16 + 2 * kc + 1];
#pragma unroll
                for (int i = 0; i < MT; ++i) {
                    int c[4], d[4];
                    mma_k16(c, af[i][0], af[i][1], bf[j][0]);
                    mma_k16(d, af[i][2], af[i][3], bf[j][1]);
                    dsum[i][j][0] += sa0 * c[0] + sb0 * d[0];
                    dsum[i][j][1] += sa1 * c[1] + sb1 * d[1];
                    dsum[i][j][2] += sa0 * c[2] + sb0 * d[2];
                    dsum[i][j][3] += sa1 * c[3] + sb1 * d[3];
                }
            }
        }
    };

    int wg_d[WG ? 2 : 1][32];  // the weight-plane tile's accumulators: planes hi and lo

    // Weight planes (WG): with sub-block scale sc = 8·hi + lo (hi, lo in 0..7), the block sum
    // D_b = Σ_j sc_j Σ_{i∈j} q_i·a_i is 8·Σ_i (q_i·hi)·a_i + Σ_i (q_i·lo)·a_i, and q·hi, q·lo ≤ 31·7
    // fit a u8: the tensor cores sum the whole block, no IMAD a slice. A stage goes through three
    // steps, which the consumer loop pipelines (the next stage's planes are made while this stage's
    // wgmmas run):
    //   planes_make: the consumers turn the stage's weights into the two planes, hi in place and lo
    //     into `PLO` (each thread its own 16-byte chunks; 4 packed q ≤ 31 times a factor ≤ 7 never
    //     carry from byte to byte), make them visible to the async proxy and meet at a named barrier
    //     of the 256 consumer threads;
    //   planes_issue: warpgroup g = warp / 4 issues the 16 wgmmas of its 64 rows (8 slices × 2 planes,
    //     each plane accumulating over the block), one commit group;
    //   planes_sums: waits for them and writes dsum = 8·hi + lo.
    auto planes_make = [&](const unsigned char* st) {
        if constexpr (WG) {
            unsigned char* stw = const_cast<unsigned char*>(st);
            const unsigned char* scb = st + S::SC;
#pragma unroll
            for (int it = 0; it < BN * BK / 16 / THREADS; ++it) {
                const int o = (tid + it * THREADS) * 16;  // byte of the B tile (SPLIT halves)
                const int h = o / (BN * 128), r = (o % (BN * 128)) / 128;
                const int c = ((o % 128) / 16) ^ (r & 7);  // logical 16-byte chunk of the half row
                const unsigned sc = scb[r * 8 + 4 * h + (c >> 1)];
                const unsigned hi = sc >> 3, lo = sc & 7u;
                const uint4 q = *reinterpret_cast<const uint4*>(stw + S::B + o);
                *reinterpret_cast<uint4*>(stw + S::PLO + o) = make_uint4(q.x * lo, q.y * lo, q.z * lo, q.w * lo);
                *reinterpret_cast<uint4*>(stw + S::B + o) = make_uint4(q.x * hi, q.y * hi, q.z * hi, q.w * hi);
            }
#ifdef HAVE_WGMMA
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
            asm volatile("bar.sync 1, %0;\n" ::"n"(THREADS) : "memory");
        }
    };
    auto planes_issue = [&](const unsigned char* st) {
        if constexpr (WG) {
            const unsigned a_base = smem_addr(st + S::A) + (warp >> 2) * 64 * 128;
            const unsigned b_base = smem_addr(st + S::B), p_base = smem_addr(st + S::PLO);
            wgmma_fence();
#pragma unroll
            for (int kc = 0; kc < 8; ++kc) {
                const unsigned ka = a_base + (kc >> 2) * BM * 128 + (kc & 3) * 32;
                const unsigned kb = (kc >> 2) * BN * 128 + (kc & 3) * 32;
                wgmma_m64n64k32_u8(wg_d[0], wgmma_desc(ka), wgmma_desc(b_base + kb), kc > 0);
                wgmma_m64n64k32_u8(wg_d[1], wgmma_desc(ka), wgmma_desc(p_base + kb), kc > 0);
            }
            wgmma_commit();
        }
    };
    auto planes_sums = [&](int (&dsum)[MT][NT][4]) {
        if constexpr (WG) {
            wgmma_wait<0>();
            wgmma_fence_regs(wg_d[0]);
            wgmma_fence_regs(wg_d[1]);
#pragma unroll
            for (int i = 0; i < 32; ++i) dsum[0][i >> 2][i & 3] = 8 * wg_d[0][i] + wg_d[1][i];
        }
    };

    // K-quants, end of a block: f32(D_b) (and for Q4_K/Q5_K M_b = Σ_q m_q · Σ qa over sub-block q) and
    // the block's fma(s).
    //
    // M_b on the tensor cores: an activation sum s ∈ [−4064, 4064] is 64·h + l with h = s >> 6 ∈
    // [−64, 63] and l = s & 63, both int8, so M_b = 64 · Σ_q m_q·h_q + Σ_q m_q·l_q (m_q ∈ [0, 63]), the
    // two m16n8k16 products of A = [h_0..h_7 | l_0..l_7] (per activation row) with B_h = [m_0..m_7 | 0]
    // and B_l = [0 | m_0..m_7] (per output column); all exact in i32. In the k16 fragments thread
    // (g = lane / 4, t = lane % 4) holds k = 4t..4t+3 of row g / g + 8 (A) and of column g (B), so
    // threads t < 2 carry h_{4t..4t+3} and m_{4t..4t+3}, threads t ≥ 2 l_{4(t−2)..} and m_{4(t−2)..}.
    const int kq_t = lane & 3, kq_g = lane >> 2, kq_q0 = 4 * (kq_t & 1);
    const int kq_shift = kq_t < 2 ? 6 : 0, kq_mask = kq_t < 2 ? 0xff : 0x3f;
    auto kq_block_end = [&](const unsigned char* st, const int (&dsum)[MT][NT][4]) {
        const float* dsm = reinterpret_cast<const float*>(st + S::D);
        if constexpr (FMT == FMT_K32) {
            const int* as = reinterpret_cast<const int*>(st + S::ASUM);
            unsigned ahl[MT][2];
#pragma unroll
            for (int i = 0; i < MT; ++i)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int4 v = *reinterpret_cast<const int4*>(as + (c_row + i * 16 + h * 8) * 8 + kq_q0);
                    const unsigned b0 = (unsigned)((v.x >> kq_shift) & kq_mask);
                    const unsigned b1 = (unsigned)((v.y >> kq_shift) & kq_mask);
                    const unsigned b2 = (unsigned)((v.z >> kq_shift) & kq_mask);
                    const unsigned b3 = (unsigned)((v.w >> kq_shift) & kq_mask);
                    ahl[i][h] = __byte_perm(__byte_perm(b0, b1, 0x0040), __byte_perm(b2, b3, 0x0040), 0x5410);
                }
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const int col = c_col + j * 8;
                const float2 dv = *reinterpret_cast<const float2*>(dsm + col);
                const float2 dm = *reinterpret_cast<const float2*>(
                    reinterpret_cast<const float*>(st + S::DMIN) + col);
                // Mins m_{q0..q0+3} of B column g of this n-tile (bytes, in k order).
                const unsigned w = *reinterpret_cast<const unsigned*>(
                    st + S::MIN + (wn * NT * 8 + j * 8 + kq_g) * 8 + kq_q0);
                const unsigned bh = kq_t < 2 ? w : 0u, bl = kq_t < 2 ? 0u : w;
#pragma unroll
                for (int i = 0; i < MT; ++i) {
                    int sh[4], sl[4];
                    mma_k16(sh, ahl[i][0], ahl[i][1], bh);
                    mma_k16(sl, ahl[i][0], ahl[i][1], bl);
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int mb = sh[e] * 64 + sl[e];
                        const float dd = (e & 1) ? dv.y : dv.x, dmn = (e & 1) ? dm.y : dm.x;
                        const float a = fmaf(dd, __int2float_rn(dsum[i][j][e]), acc[i][j][e]);
                        acc[i][j][e] = fmaf(-dmn, __int2float_rn(mb), a);
                    }
                }
            }
        } else {
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const float2 dv = *reinterpret_cast<const float2*>(dsm + c_col + j * 8);
#pragma unroll
                for (int i = 0; i < MT; ++i)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        acc[i][j][e] =
                            fmaf((e & 1) ? dv.y : dv.x, __int2float_rn(dsum[i][j][e]), acc[i][j][e]);
            }
        }
    };

    // Q8_0: `af[0]` / `bf[0]` hold the first block's fragments of a full stage, loaded by the caller
    // (see the K loop).
    auto compute_stage = [&](const unsigned char* st, int count, unsigned (&af)[2][MT][4],
                             unsigned (&bf)[2][NT][2]) {
        if constexpr (FMT == FMT_Q8_0) {
            if (count == BPS) {
                // Full stage: the next slice's fragments load while this slice's mmas run.
#pragma unroll
                for (int blk = 0; blk < BPS; ++blk) {
                    if (blk + 1 < BPS) load_frags_c(st, blk + 1, af[(blk + 1) & 1], bf[(blk + 1) & 1]);
                    q8_block(st, blk, af[blk & 1], bf[blk & 1]);
                }
            } else {
                // The last stage of a part whose length is not a multiple of BPS.
#pragma unroll 1
                for (int blk = 0; blk < count; ++blk) {
                    unsigned af[MT][4], bf[NT][2];
                    load_frags(st, blk, af, bf);
                    q8_block(st, blk, af, bf);
                }
            }
        } else {
            int dsum[MT][NT][4];
#pragma unroll
            for (int i = 0; i < MT; ++i)
#pragma unroll
                for (int j = 0; j < NT; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) dsum[i][j][e] = 0;
            if constexpr (WS) {
                // The warp-specialized compute warps have 224–232 registers: the next slice's
                // fragments load while this slice's mmas run (as for Q8_0).
                unsigned afp[2][MT][4], bfp[2][NT][2];
                load_frags_c(st, 0, afp[0], bfp[0]);
#pragma unroll
                for (int kc = 0; kc < BK / 32; ++kc) {
                    if (kc + 1 < BK / 32) load_frags_c(st, kc + 1, afp[(kc + 1) & 1], bfp[(kc + 1) & 1]);
                    kq_slice(st, kc, afp[kc & 1], bfp[kc & 1], dsum);
                }
            } else {
#pragma unroll 1  // unrolling makes the compiler hoist the scale loads and spill
                for (int kc = 0; kc < BK / 32; ++kc) {
                    unsigned af[MT][4], bf[NT][2];
                    load_frags(st, kc, af, bf);
                    kq_slice(st, kc, af, bf, dsum);
                }
            }
            kq_block_end(st, dsum);
        }
    };

    // ---- the warp-specialized K loop (WS, Q8_0) ------------------------------------------------------
    // One more warpgroup (the producers) issues every stage's copies; the THREADS consumer threads
    // only compute. Stage s is handed over by two mbarriers: full[s] completes when the producers'
    // copies of a stage have landed (each producer thread arrives when its own cp.asyncs complete),
    // empty[s] when every consumer warp is done reading it. No CTA-wide barrier in the loop, so the two
    // warps of a scheduler are not held in step, and the consumers run no address arithmetic for the
    // loads. Both sides walk the same stages: part by part, BPS blocks at a time; the consumers close
    // each part (empty ones too) after its stages, as in the v2 loop below.
    if constexpr (WS) {
        static_assert(FMT == FMT_Q8_0 || TMA, "the cp.async warp-specialized loop is for Q8_0");
        constexpr int PRODUCERS = 128;  // one warpgroup
        // The registers a CTA is launched with (`__launch_bounds__(THREADS + PRODUCERS, 1)`: the file
        // divided by the threads, in steps of 8) are handed from the producers (TMA: 40, cp.async: 56)
        // to the compute warps: 8 compute warps get 232 / 224. (With 12 or 16 compute warps of 32 × 32
        // outputs, 152 / 104 registers each, the TMA tiles measured 0.97–1.03× on an H200: more warps a
        // scheduler do not lift them; docs/benchmarks.md, 2026-11-30, seventh session.)
        constexpr int LAUNCH_REGS = (65536 / (THREADS + PRODUCERS)) / 8 * 8;
        constexpr int PRODUCER_REGS = TMA ? 40 : 56;
        constexpr int CONSUMER_FREE =
            (LAUNCH_REGS * (THREADS + PRODUCERS) - PRODUCER_REGS * PRODUCERS) / THREADS / 8 * 8;
        constexpr int CONSUMER_REGS = CONSUMER_FREE < 256 ? CONSUMER_FREE : 256;
        static_assert(LAUNCH_REGS <= 168 && CONSUMER_REGS >= LAUNCH_REGS,
                      "setmaxnreg moves registers to the compute warps");
        unsigned long long* bars = reinterpret_cast<unsigned long long*>(smem + STAGES * S::STAGE);
        unsigned long long* full = bars;
        unsigned long long* empty = bars + STAGES;
        if (tid == 0) {
            for (int s = 0; s < STAGES; ++s) {
                mbar_init(full + s, PRODUCERS + (TMA ? 1 : 0));
                mbar_init(empty + s, WARPS_M * WARPS_N);
            }
        }
        __syncthreads();
        auto part_begin = [&](int p) { return p * nb / 4; };
        // The producers' walk: the CTA's stages in order, part by part, BPS blocks at a time; for each,
        // wait until its slot is free, then copy_stage(b, cnt, s, st) fills slot s (shared memory st)
        // with blocks b .. b + cnt.
        // The stage counter runs on across a persistent CTA's tiles (the barriers' phases follow it);
        // `tile_begin` (re)computes the per-tile state before each tile's stages.
        auto producer_stages = [&](auto&& tile_begin, auto&& copy_stage) {
            int t = 0;
            auto tile_stages = [&] {
                tile_begin();
                for (int p = p_begin; p < p_end; ++p)
                    for (int b = part_begin(p); b < part_end(p); b += BPS, ++t) {
                        const int cnt = min(BPS, part_end(p) - b), s = t % STAGES;
                        if (t >= STAGES) mbar_wait(empty + s, ((t / STAGES) - 1) & 1);
                        copy_stage(b, cnt, s, smem + s * S::STAGE);
                    }
            };
            if constexpr (PERSIST) {
                for (int tile = pid; tile < total_tiles; tile += tile_step) {
                    if (tile != pid) tile_origin(tile, m0, n0);
                    tile_stages();
                }
            } else {
                tile_stages();
            }
        };
        // Producer thread q's share of a stage's block scales: elements q + 128·j of [BPS][BN] (the
        // 64-column wgmma tiles' K-quant stages have fewer than 128).
        auto copy_block_scales = [&](int q, int b, int cnt, unsigned char* st) {
#pragma unroll
            for (int j = 0; j < (BPS * BN + PRODUCERS - 1) / PRODUCERS; ++j) {
                const int i = q + PRODUCERS * j, blk = i / BN, col = n0 + i % BN;
                const bool ok = col < N && blk < cnt;
                if ((BPS * BN) % PRODUCERS == 0 || i < BPS * BN)
                    cp_async4(st + S::D + 4 * i, ok ? wd + (size_t)(b + blk) * N + col : wd, ok);
            }
        };
        if (tid >= THREADS) {
            if constexpr (TMA) {
#if __CUDA_ARCH__ >= 900
                // Producers with TMA: thread 0 of the warpgroup issues one tensor copy each for the
                // stage's A and B tiles (zero rows past M / N; bytes past the part's last block are
                // never read), every producer thread copies scales q + 128·j as below. The full
                // barrier waits for the 128 threads' scale copies plus thread 0's arrival with the
                // TMA byte count.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
                asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS) : "memory");
#endif
                const int q = tid - THREADS;
                if (q == 0) {
                    tma_prefetch_desc(tmap_a);
                    tma_prefetch_desc(tmap_b);
                }
                producer_stages([] {}, [&](int b, int cnt, int s, unsigned char* st) {
                        if (q == 0) {
                            mbar_arrive_expect_tx(full + s, (BM + BN) * BK);
#pragma unroll
                            for (int h = 0; h < BK / 128; ++h) {
                                const int k = b * L::BLK + h * 128;
                                tma_load_2d(st + S::A + h * BM * 128, tmap_a, k, m0, full + s);
                                tma_load_2d(st + S::B + h * BN * 128, tmap_b, k, n0, full + s);
                            }
                        }
                        copy_block_scales(q, b, cnt, st);
                        // Chained Q8_0: the corrections of column q's group if this stage closes one
                        // (`wd` holds the chain coefficients [nb][N], `wdmin` the corrections
                        // [groups][N]).
                        if constexpr (WG && FMT == FMT_Q8_0) {
                            const int g = chain_group_end(nb, b, cnt);
                            if (g >= 0 && (BN == PRODUCERS || q < BN)) {
                                const bool ok = n0 + q < N;
                                const float* src = ok ? wdmin + (size_t)g * N + n0 + q : wdmin;
                                cp_async4(st + S::DMIN + 4 * q, src, ok);
                            }
                        }
                        // K-quants (one block a stage): the block's min scales, the sub-block scales
                        // and mins of column q (q < BN), the activation sums of the tile's rows.
                        if constexpr (FMT == FMT_K32) {
                            const bool ok = n0 + q < N;
                            const size_t row = (size_t)(ok ? n0 + q : 0);
                            if (BN == PRODUCERS || q < BN) {
                                cp_async4(st + S::DMIN + 4 * q, wdmin + (size_t)b * N + row, ok);
                                cp_async8(st + S::SC + 8 * q, wsc + ((size_t)b * N + row) * 8, ok);
                                cp_async8(st + S::MIN + 8 * q, wmin + ((size_t)b * N + row) * 8, ok);
                            }
#pragma unroll
                            for (int i = q; i < BM * 2; i += PRODUCERS) {
                                const int r = i / 2, half = i % 2;
                                const bool rok = m0 + r < M;
                                const int* src =
                                    asums + (size_t)(rok ? m0 + r : 0) * n32 + (size_t)b * 8 + half * 4;
                                cp_async16(st + S::ASUM + 16 * i, src, rok);
                            }
                        }
                        if constexpr (FMT == FMT_Q6K) {
                            const bool ok = n0 + q < N;
                            const size_t row = (size_t)(ok ? n0 + q : 0);
                            cp_async16(st + S::SC + 16 * q, wsc + ((size_t)b * N + row) * 16, ok);
                        }
                        cp_async_mbar_arrive(full + s);
                    });
                cp_async_wait<0>();
#else
                __trap();  // never launched before sm_90 (the plan's `hopper_only`)
#endif
                return;
            }
            // Producers (the last warpgroup): thread q copies 16-byte column (q & 7) of rows (q >> 3) +
            // 16·i of A and B, and scales q + 128·j of the stage's [BPS][BN] block. On sm_90a they
            // give registers back to the compute warpgroups.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
            asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS) : "memory");
#endif
            const int q = tid - THREADS, chunk = q & 7, r0 = q >> 3;
            int a_left, b_left;  // row i valid iff 16·i < left
            const int8_t *a0, *b0;
            const size_t step16 = (size_t)16 * K;
            const int swz = (chunk ^ (r0 & 7)) << 4;
            auto tile_begin = [&] {
                a_left = M - m0 - r0;
                b_left = N - n0 - r0;
                a0 = qa + (size_t)max(0, min(m0 + r0, M - 1)) * K + chunk * 16;
                b0 = wq + (size_t)max(0, min(n0 + r0, N - 1)) * K + chunk * 16;
            };
            producer_stages(tile_begin, [&](int b, int cnt, int s, unsigned char* st) {
                    const bool chunk_ok = chunk * 16 < cnt * L::BLK;
                    const size_t k0 = (size_t)b * L::BLK;
#pragma unroll
                    for (int i = 0; i < BM / 16; ++i) {
                        const bool ok = chunk_ok && 16 * i < a_left;
                        cp_async16(st + S::A + (r0 + 16 * i) * BK + swz, ok ? a0 + i * step16 + k0 : qa, ok);
                    }
#pragma unroll
                    for (int i = 0; i < BN / 16; ++i) {
                        const int r = r0 + 16 * i;
                        const bool ok = chunk_ok && 16 * i < b_left;
                        cp_async16(st + S::B + r * BK + swz, ok ? b0 + i * step16 + k0 : wq, ok);
                    }
                    copy_block_scales(q, b, cnt, st);
                    cp_async_mbar_arrive(full + s);
                });
            cp_async_wait<0>();
            return;
        }
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
        // 128·56 + 256·224 = 128·40 + 256·232 = 384·168, the CTA's registers at launch.
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS) : "memory");
#endif
        if constexpr (WG && FMT == FMT_Q8_0) {
            // The chained Q8_0 tile: warpgroup g = warp / 4 owns rows 64·g .. 64·g + 63 and all 128
            // columns, as two halves of 64 columns with their own chain registers (`cd[h]`: bias
            // 0x4B400000 + the group's prefix sum, float bits). Each block is one wgmma a half, each
            // accumulating onto its chain, then one FFMA an output by the block's coefficient of its
            // column: the first half's FFMAs run while the second half's wgmma is in the tensor cores
            // (and the other warpgroup's). A stage that closes a chain group adds the group's
            // correction and resets the chains. Each block ends with nothing in flight (a wgmma in
            // flight across the loop's back edge makes ptxas serialize them all, C7514).
            int cd[2][32];
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int i = 0; i < 32; ++i) cd[h][i] = MAGIC_I;
            const unsigned a_off = (warp >> 2) * 64 * 128;
            // The FFMAs of half h of block blk: coefficients of columns c_col + 64·h + 8·j (+1).
            auto chain_ffma = [&](int h, const float2 (&cv)[8]) {
#pragma unroll
                for (int j = 0; j < 8; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        acc[0][8 * h + j][e] = fmaf((e & 1) ? cv[j].y : cv[j].x, __int_as_float(cd[h][4 * j + e]),
                                                    acc[0][8 * h + j][e]);
            };
            auto chain_coef = [&](const float* dsm, int blk, int h, float2 (&cv)[8]) {
#pragma unroll
                for (int j = 0; j < 8; ++j)
                    cv[j] = *reinterpret_cast<const float2*>(dsm + blk * BN + 64 * h + c_col + j * 8);
            };
            int t = 0;
            for (int p = p_begin; p < p_end; ++p) {
                for (int b = part_begin(p); b < part_end(p); b += BPS, ++t) {
                    const int cnt = min(BPS, part_end(p) - b), s = t % STAGES;
                    const unsigned char* st = smem + s * S::STAGE;
                    const unsigned sa = smem_addr(st + S::A) + a_off, sb = smem_addr(st + S::B);
                    const float* dsm = reinterpret_cast<const float*>(st + S::D);
                    mbar_wait(full + s, (t / STAGES) & 1);
#pragma unroll
                    for (int blk = 0; blk < BPS; ++blk) {
                        if (blk < cnt) {
                            wgmma_fence();
                            wgmma_m64n64k32_s8_acc(cd[0], wgmma_desc(sa + blk * 32), wgmma_desc(sb + blk * 32));
                            wgmma_commit();
                            wgmma_m64n64k32_s8_acc(cd[1], wgmma_desc(sa + blk * 32),
                                                   wgmma_desc(sb + 64 * 128 + blk * 32));
                            wgmma_commit();
                            float2 cv[8];
                            chain_coef(dsm, blk, 0, cv);
                            wgmma_wait<1>();
                            wgmma_fence_regs(cd[0]);
                            chain_ffma(0, cv);
                            chain_coef(dsm, blk, 1, cv);
                            wgmma_wait<0>();
                            wgmma_fence_regs(cd[1]);
                            chain_ffma(1, cv);
                        }
                    }
                    if (chain_group_end(nb, b, cnt) >= 0) {
                        const float* cr = reinterpret_cast<const float*>(st + S::DMIN);
#pragma unroll
                        for (int j = 0; j < NT; ++j) {
                            const float2 c = *reinterpret_cast<const float2*>(cr + c_col + j * 8);
#pragma unroll
                            for (int e = 0; e < 4; ++e)
                                acc[0][j][e] = __fadd_rn(acc[0][j][e], (e & 1) ? c.y : c.x);
                        }
#pragma unroll
                        for (int h = 0; h < 2; ++h)
#pragma unroll
                            for (int i = 0; i < 32; ++i) cd[h][i] = MAGIC_I;
                    }
                    __syncwarp();
                    mbar_arrive_warp(empty + s);
                }
                // A part's end closes its last group: the chains are at their bias already; saying
                // so lets the compiler keep no chain register live through finish_part.
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int i = 0; i < 32; ++i) cd[h][i] = MAGIC_I;
                finish_part(p);
            }
            return;
        }
        if constexpr (WG) {
            // The weight-plane tile (K-quant stages of one block): stage t's wgmmas run while the
            // planes of stage t + 1 are made; then stage t's sums and block end.
            const int t_end = part_end(p_end - 1) - part_begin(p_begin);  // the CTA's stages
            if (t_end > 0) {
                mbar_wait(full, 0);
                planes_make(smem);
            }
            int t = 0;
            for (int p = p_begin; p < p_end; ++p) {
                for (int b = part_begin(p); b < part_end(p); ++b, ++t) {
                    const int s = t % STAGES;
                    const unsigned char* st = smem + s * S::STAGE;
                    planes_issue(st);
                    if (t + 1 < t_end) {
                        const int s1 = (t + 1) % STAGES;
                        mbar_wait(full + s1, ((t + 1) / STAGES) & 1);
                        planes_make(smem + s1 * S::STAGE);
                    }
                    int dsum[MT][NT][4];
                    planes_sums(dsum);
                    kq_block_end(st, dsum);
                    __syncwarp();
                    mbar_arrive_warp(empty + s);
                }
                finish_part(p);
            }
            return;
        }
        int t = 0;
        // Q8_0, 96-row tile: the loop rotated by one block. Block b's fmas run after block b + 1's
        // mmas are issued, and a stage's last block's fmas after the next stage's first mmas, so each
        // warp's stream mixes mmas and float work all through instead of a burst of mmas at a stage's
        // start and ~100 float instructions at its end (when the scheduler's other compute warp, held
        // near the same stage by the barriers, is in the same phase). The pending block lives in
        // registers (`pc`, its scales `pd`). Each output still gets its fmas in block order, so the
        // bits are those of the plain loop. A part starts with a pending block of D = 0 and scale 0:
        // fma(0, +0, acc) = acc, as acc is never −0: it starts each part at +0, every exact sum is a
        // multiple of 2^-24 (the scales are f16), so a nonzero one never rounds to a zero, and an
        // exact zero is +0 unless both terms are −0. (A NaN stays the GPU's one NaN.) The 128-row
        // TMA tile compiles rotated without spills too, but ran 2–5 % slower that way on an H200
        // (docs/benchmarks.md, ninth session), so it keeps the plain loop.
        constexpr bool ROTATE = FMT == FMT_Q8_0 && MT == 3;
        // The pending block of nothing: D = 0 (the bias alone) at scale 0.
        auto no_pending_block = [&](int (&pc)[MT][NT][4], float2 (&pd)[NT]) {
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                pd[j] = make_float2(0.f, 0.f);
#pragma unroll
                for (int i = 0; i < MT; ++i)
#pragma unroll
                    for (int e = 0; e < 4; ++e) pc[i][j][e] = MAGIC_I;
            }
        };
        auto tile_parts_rotated = [&] {
            for (int p = p_begin; p < p_end; ++p) {
                int pc[MT][NT][4];
                float2 pd[NT];
                no_pending_block(pc, pd);
                for (int b = part_begin(p); b < part_end(p); b += BPS, ++t) {
                    const int cnt = min(BPS, part_end(p) - b), s = t % STAGES;
                    const unsigned char* st = smem + s * S::STAGE;
                    mbar_wait(full + s, (t / STAGES) & 1);
                    if (cnt == BPS) {
                        unsigned af[2][MT][4], bf[2][NT][2];
                        load_frags_c(st, 0, af[0], bf[0]);
#pragma unroll
                        for (int blk = 0; blk < BPS; ++blk) {
                            if (blk + 1 < BPS) load_frags_c(st, blk + 1, af[(blk + 1) & 1], bf[(blk + 1) & 1]);
                            int c[MT][NT][4];
                            q8_mmas(c, af[blk & 1], bf[blk & 1]);
                            float2 dv[NT];
                            q8_scales(st, blk, dv);
                            q8_fold(pc, pd);
#pragma unroll
                            for (int j = 0; j < NT; ++j) {
                                pd[j] = dv[j];
#pragma unroll
                                for (int i = 0; i < MT; ++i)
#pragma unroll
                                    for (int e = 0; e < 4; ++e) pc[i][j][e] = c[i][j][e];
                            }
                        }
                    } else {
                        // A part's short last stage: the pending block first, then the plain loop.
                        q8_fold(pc, pd);
                        no_pending_block(pc, pd);
#pragma unroll 1
                        for (int blk = 0; blk < cnt; ++blk) {
                            unsigned af[MT][4], bf[NT][2];
                            load_frags(st, blk, af, bf);
                            q8_block(st, blk, af, bf);
                        }
                    }
                    __syncwarp();
                    mbar_arrive_warp(empty + s);
                }
                q8_fold(pc, pd);
                finish_part(p);
            }
        };
        auto tile_parts = [&] {
            if constexpr (ROTATE) {
                tile_parts_rotated();
                return;
            }
            // (nvcc warns that this loop is unreachable in the rotated tiles' instantiation; an
            // `else` around it renames registers in the 128-row tiles' SASS, which ran as it is.)
            for (int p = p_begin; p < p_end; ++p) {
                for (int b = part_begin(p); b < part_end(p); b += BPS, ++t) {
                    const int cnt = min(BPS, part_end(p) - b), s = t % STAGES;
                    const unsigned char* st = smem + s * S::STAGE;
                    mbar_wait(full + s, (t / STAGES) & 1);
                    unsigned af[2][MT][4], bf[2][NT][2];
                    if constexpr (FMT == FMT_Q8_0) {
                        if (cnt == BPS) load_frags_c(st, 0, af[0], bf[0]);
                    }
                    compute_stage(st, cnt, af, bf);
                    __syncwarp();
                    mbar_arrive_warp(empty + s);
                }
                finish_part(p);
            }
        };
        if constexpr (PERSIST) {
            for (int tile = pid; tile < total_tiles; tile += tile_step) {
                if (tile != pid) tile_origin(tile, m0, n0);
                tile_parts();
            }
        } else {
            tile_parts();
        }
        return;
    }

    // ---- the K loop --------------------------------------------------------------------------------
    // Both cursors visit the same stages: part by part, BPS blocks at a time, skipping empty parts. The
    // first STAGES − 1 iterations (it < 0) only issue loads; every call site of a lambda above is single,
    // so they inline and the accumulators stay in registers.
    auto stage_count = [&](int p, int b) { return min(BPS, part_end(p) - b); };
    int ld_p = p_begin, ld_b = p_begin * nb / 4;  // next stage to load
    int cc_p = p_begin, cc_b = ld_b;              // next stage to compute
    while (ld_p < p_end && ld_b == part_end(ld_p)) ++ld_p;
#pragma unroll 1
    for (int it = -(STAGES - 1);; ++it) {
        if (it >= 0) {
            // Close the parts that end here (also empty ones, and the leading empty ones at it = 0).
            while (cc_p < p_end && cc_b == part_end(cc_p)) finish_part(cc_p++);
            if (cc_p >= p_end) break;
            cp_async_wait<STAGES - 2>();
            __syncthreads();  // stage `it` is visible; everyone is done with the buffer loaded next
        }
        // A full Q8_0 stage's first fragments are read from shared memory before the next stage's
        // copies are issued, so those instructions cover the ldmatrix latency that otherwise stalled
        // every warp right after the barrier (a sixth of the kernel's stall samples under ncu).
        const int c_cnt = it >= 0 ? stage_count(cc_p, cc_b) : 0;
        const unsigned char* c_st = smem + (it >= 0 ? it % STAGES : 0) * S::STAGE;
        unsigned af[2][MT][4], bf[2][NT][2];
        if constexpr (FMT == FMT_Q8_0) {
            if (c_cnt == BPS) load_frags(c_st, 0, af[0], bf[0]);
        }
        if (ld_p < p_end) {
            const int cnt = stage_count(ld_p, ld_b);
            load_stage((it + STAGES - 1) % STAGES, ld_b, cnt);
            ld_b += cnt;
            while (ld_p < p_end && ld_b == part_end(ld_p)) ++ld_p;
        }
        cp_async_commit();
        if (it >= 0) {
            compute_stage(c_st, c_cnt, af, bf);
            cc_b += c_cnt;
        }
    }
    cp_async_wait<0>();
}

#define QGEMM2_ARGS                                                                                         \
    QGEMM_ARGS, float *__restrict__ scratch, int group_m, int tail_base, float *__restrict__ tail_ws,      \
        const unsigned int *__restrict__ bad_rows
#define QGEMM2_PASS QGEMM_PASS, scratch, group_m, tail_base, tail_ws, bad_rows

// The v2 instantiations (names and shapes mirrored in crates/prism-quant/src/cuda_plan.rs, `V2Tile`).
// 2 × 4 warps each; the second __launch_bounds__ argument is the CTAs per SM the tile is sized for.
extern "C" __global__ void __launch_bounds__(256, 2) qgemm2_q8_0_64x128(QGEMM2_ARGS) {
    qgemm_tc2<FMT_Q8_0, 2, 4, 2, 4, 4>(QGEMM2_PASS);
}
extern "C" __global__ void __launch_bounds__(256, 1) qgemm2_q8_0_128x128(QGEMM2_ARGS) {
    qgemm_tc2<FMT_Q8_0, 2, 4, 4, 4, 4>(QGEMM2_PASS);
}
extern "C" __global__ void __launch_bounds__(256, 2) qgemm2_k32_64x128(QGEMM2_ARGS) {
    qgemm_tc2<FMT_K32, 2, 4, 2, 4, 2>(QGEMM2_PASS);
}
extern "C" __global__ void __launch_bounds__(256, 1) qgemm2_k32_128x128(QGEMM2_ARGS) {
    qgemm_tc2<FMT_K32, 2, 4, 4, 4, 2>(QGEMM2_PASS);
}
extern "C" __global__ void __launch_bounds__(256, 2) qgemm2_q6k_64x128(QGEMM2_ARGS) {
    qgemm_tc2<FMT_Q6K, 2, 4, 2, 4, 2>(QGEMM2_PASS);
}
extern "C" __global__ void __launch_bounds__(256, 1) qgemm2_q6k_128x128(QGEMM2_ARGS) {
    qgemm_tc2<FMT_Q6K, 2, 4, 4, 4, 2>(QGEMM2_PASS);
}

// Q8_0 128×128, warp-specialized: the 8 compute warps of qgemm2_q8_0_128x128 plus a producer
// warpgroup (384 threads; on sm_90a the producers hand their registers to the compute warps),
// mbarrier stage hand-off instead of CTA barriers (see the WS loop in qgemm_tc2).
extern "C" __global__ void __launch_bounds__(384, 1) qgemm2_q8_0_128x128ws(QGEMM2_ARGS) {
    qgemm_tc2<FMT_Q8_0, 2, 4, 4, 4, 4, true>(QGEMM2_PASS);
}
// The same with 96 activation rows (warp tiles 48×32): at the model's M (a few hundred rows a pass) a
// 128-row tile grid leaves more rows empty (M = 275: 384 rows computed, 288 with this tile).
extern "C" __global__ void __launch_bounds__(384, 1) qgemm2_q8_0_96x128ws(QGEMM2_ARGS) {
    qgemm_tc2<FMT_Q8_0, 2, 4, 3, 4, 4, true>(QGEMM2_PASS);
}

// The warp-specialized Q8_0 tiles with TMA copies of A and B (sm_90 only): one thread issues a stage's
// two tensor copies instead of 16 cp.async per producer thread with their address arithmetic (the
// producers were a sixth of the instructions issued), and the producers keep 40 registers instead
// of 56, the compute warps 232 instead of 224.
#define QGEMM2_TMA_ARGS QGEMM2_ARGS, const __grid_constant__ TmaDesc tmap_a, const __grid_constant__ TmaDesc tmap_b
#define QGEMM2_TMA_PASS QGEMM2_PASS, &tmap_a, &tmap_b
// One TMA tile: format, m16 tiles per warp (4: 128 rows, 3: 96 rows), stages; 2 × 4 compute warps.
#define QGEMM2_TMA_TILE(name, fmt, mt, stages)                                          \
    extern "C" __global__ void __launch_bounds__(384, 1) name(QGEMM2_TMA_ARGS) {      \
        qgemm_tc2<fmt, 2, 4, mt, 4, stages, true, true>(QGEMM2_TMA_PASS);               \
    }
QGEMM2_TMA_TILE(qgemm2_q8_0_128x128tma, FMT_Q8_0, 4, 4)
QGEMM2_TMA_TILE(qgemm2_q8_0_96x128tma, FMT_Q8_0, 3, 4)
// The K-quant tiles: 2 stages of one 256-element block (two boxes of 128 bytes of K per matrix), the
// scales, mins and activation sums copied by the producer warpgroup; 96-row twins as for Q8_0. Two
// stages leave room for the closed part's slot (SLOT): 2–17 % faster than 3 stages without it
// (2026-11-30, sixth session).
QGEMM2_TMA_TILE(qgemm2_k32_128x128tma, FMT_K32, 4, 2)
QGEMM2_TMA_TILE(qgemm2_q6k_128x128tma, FMT_Q6K, 4, 2)
QGEMM2_TMA_TILE(qgemm2_k32_96x128tma, FMT_K32, 3, 2)
QGEMM2_TMA_TILE(qgemm2_q6k_96x128tma, FMT_Q6K, 3, 2)

// Q4_K / Q5_K with warpgroup MMA on weight planes (sm_90a only): the TMA tiles' producers and stages,
// 128 activation rows × 64 weight rows, two consumer warpgroups of 64 × 64 (planes_make / planes_issue /
// planes_sums), the same part tree and block end with the warps seen as 8 × 1 warp tiles of 16 × 64.
#if defined(HAVE_WGMMA)
#define QGEMM2_WG_TILE(name, mode, stages)                                           \
    extern "C" __global__ void __launch_bounds__(384, 1) name(QGEMM2_TMA_ARGS) {     \
        qgemm_tc2<FMT_K32, 8, 1, 1, 8, stages, true, true, mode>(QGEMM2_TMA_PASS);  \
    }
#else
#define QGEMM2_WG_TILE(name, mode, stages)                                           \
    extern "C" __global__ void __launch_bounds__(384, 1) name(QGEMM2_TMA_ARGS) {     \
        __trap(); /* never launched before sm_90a (the plan's `hopper_only`) */      \
    }
#endif
// 3 stages of 70 KiB (with the second weight plane); cuda_plan.rs's `v2_tile_plan`.
QGEMM2_WG_TILE(qgemm2_k32_128x64wgp, true, 3)

// Q8_0 by the chained reduction on warpgroup MMA (sm_90a only; explicit, checked against
// prism_quant::chain's reference, not the engine's contract): the TMA tiles' producers and 4 stages of
// 4 blocks, 128 activation rows × 128 weight rows, two consumer warpgroups of 64 × 128. `wd` holds the
// chain coefficients, `wdmin` the group corrections (prism_quant::chain::ChainTables), both block-major
// ([block][N], [group][N]).
#if defined(HAVE_WGMMA)
extern "C" __global__ void __launch_bounds__(384, 1) qgemm2_q8_0_128x128wgc(QGEMM2_TMA_ARGS) {
    qgemm_tc2<FMT_Q8_0, 8, 1, 1, 16, 4, true, true, true>(QGEMM2_TMA_PASS);
}
#else
extern "C" __global__ void __launch_bounds__(384, 1) qgemm2_q8_0_128x128wgc(QGEMM2_TMA_ARGS) {
    __trap(); /* never launched before sm_90a (the plan's `hopper_only`) */
}
#endif

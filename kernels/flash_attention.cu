// Causal attention on the tensor cores (flash-attention style), batch-invariant.
//
// Interface (launched by crates/prism-model/src/cuda_flash.rs): q [T, n_h, HD], k and v [n_kv, past + T, HD],
// all bf16 (rounded from the model's f32 activations by the launcher), contiguous; out [T, n_h·HD] f32.
// Query row t sits at absolute position past + t and reads keys 0..=past + t; query head h reads KV head
// h / (n_h / n_kv).
//
// Work split. A block takes one query head and 64 consecutive *absolute* positions
// [64·b, 64·b + 64) (blocks start at multiples of 64 whatever `past` is; positions of the block outside
// [past, past + T) are dead rows: computed on zeros or real but unused data, never written). Each of its
// 4 warps owns 16 positions [64·b + 16·w, +16) as the M dimension of m16n8k16 mma tiles. Key tiles of
// BK keys are aligned to absolute key positions too: tile j covers keys [j·BK, (j+1)·BK). The block
// streams tiles 0, 1, … through shared memory (cp.async, double-buffered: tile j + 1 is in flight while
// tile j is used; keys at or past the end are zero-filled), and each warp uses tiles 0..=⌊(64·b + 16·w)/BK⌋.
// Q stays in shared memory for the whole block (HD = 256 leaves no registers for it next to the
// 16×256 f32 output accumulator) and is re-read with ldmatrix for every key tile.
//
// Per warp and key tile:  S = Q·Kᵀ (mma, bf16 × bf16 → f32, accumulators start at 0, k-steps over HD
// in increasing order);  s = S · (scale·log2 e) in f32, −∞ where key > position;  running max
// m' = max(m, max s) (quad shuffles);  c = 2^(m − m'),  p = 2^(s − m') (ex2.approx, −∞ → +0);
// l = l·c + Σ p (per-thread partial sums in a fixed column order);  O = O·c;  O += bf16(P)·V (mma,
// k-steps over the tile's keys in increasing order). At the end the quad's partial sums are added by a
// fixed butterfly and O / l is written in f32.
//
// Why a row's result is a function of its q, its absolute position and keys/values 0..=pos only (so
// bit-identical whatever T, past, the grid or the other rows of its block):
//  1. Every tensor-core product D[i][n] = C[i][n] + Σ_k A[i][k]·B[k][n] involves only row i of A and
//     column n of B; no value of another query row enters a row's scores, probabilities or output.
//  2. The sequence of operations on a row's state depends only on its position: tiles are aligned to
//     absolute key positions, so a key always sits at the same tile and the same k-slot of the same
//     mma. A warp goes through tiles 0..=⌊w0/BK⌋, w0 = 16·⌊pos/16⌋ its first position (blocks and
//     warps are aligned to absolute positions); as 16 divides BK that is 0..=⌊pos/BK⌋ for each of its
//     rows — exactly the tiles holding the row's keys, ending with the one holding the row itself.
//     Every tile a row goes through holds its key j·BK ≤ pos: a row never meets a fully masked tile,
//     its running max is finite from the first tile on, and no tile is skipped or added by T or past.
//  3. Inside its last (diagonal) tile, the keys after a row's position are masked: their scores become
//     −∞ by assignment (not addition, so whatever the zero-filled or real key held does not matter),
//     their probabilities exactly +0, and their products with V (finite: real values or the zero fill)
//     are ±0, which add nothing to the exact sum the tensor core rounds. Which of those keys exist
//     (real or zero-filled) depends on T, but not what they contribute. (The only way a ±0 term could
//     show is the sign of an output element that is exactly zero with every real term zero — equal as a
//     number either way.)
//  4. The scale, the masks, the max/exp/sum sequence and the final division are the same f32
//     operations for every row, in a fixed order; nothing depends on gridDim, on T or on past except
//     through which rows are written.
// The CPU twin (attention.rs, CausalAttention) computes the same quantity in f32; this kernel differs
// from it by the bf16 rounding of q, k, v and p (≈ 2⁻⁹ relative each), checked by `prism cuda-check`.
//
// Registers per thread (HD = 256, BK = 32): output accumulator 16×256 f32 / 32 lanes = 128, scores
// 16×32 / 32 = 16, running max and sums 4, fragments and addresses; Q is not held in registers.
// Shared memory: (64 + 4·BK) rows of HD + 8 bf16 (the 16-byte pad per row keeps ldmatrix free of bank
// conflicts): 99 KiB for HD = 256 (two blocks per H100/H200 SM), 85 KiB for 128, 45 KiB for 64.

#include "launch.cuh"
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

namespace {

constexpr int FA_WARPS = 4;
constexpr int FA_THREADS = 32 * FA_WARPS;
constexpr int FA_ROWS = 16 * FA_WARPS;  // absolute positions per block
constexpr int FA_PAD = 8;               // bf16 elements of padding per shared-memory row

__device__ __forceinline__ uint32_t shared_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global → shared, asynchronously; zero-filled (nothing read) when !valid.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
    const int bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}

// 4 bytes global → shared, asynchronously; zero-filled when !valid.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool valid) {
    const int bytes = valid ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// d += a·b for one m16n8k16 tile (bf16 inputs, f32 accumulators).
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 2^x (ex2.approx: a fixed function of x; 2^−∞ = +0).
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// Two f32 as a bf16 pair (round to nearest even), `lo` in the low half: the order of mma fragments.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

// One key tile for a warp's 16 query rows (positions pos0 = warp_pos + g, pos1 = pos0 + 8 of lane's
// group g): S = Q·Kᵀ, scale, causal mask, online-softmax update of (m, l, O) and O += bf16(P)·V. Qs is
// the block's [FA_ROWS][HD + FA_PAD] query tile, Kt and Vt the tile's [BK][HD + FA_PAD] keys and values
// (bf16, keys j·BK.. of the tile j).
template <int HD, int BK>
__device__ __forceinline__ void attend_tile(const __nv_bfloat16* Qs, const __nv_bfloat16* Kt,
                                            const __nv_bfloat16* Vt, int warp, int lane, int j, int pos0,
                                            int pos1, float scale_log2, float (&o)[HD / 8][4], float& m0,
                                            float& m1, float& l0, float& l1) {
    constexpr int STRIDE = HD + FA_PAD;
    const int col = 2 * (lane % 4);

    // S = Q·Kᵀ for the warp's 16 rows and the tile's BK keys.
    float s[BK / 8][4];
#pragma unroll
    for (int nt = 0; nt < BK / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
        uint32_t a[4];
        ldmatrix_x4(a, shared_addr(Qs + (16 * warp + lane % 16) * STRIDE + kk * 16 + (lane / 16) * 8));
#pragma unroll
        for (int nt = 0; nt < BK / 8; nt += 2) {
            uint32_t b[4];
            ldmatrix_x4(b, shared_addr(Kt + (nt * 8 + (lane / 16) * 8 + lane % 8) * STRIDE + kk * 16 +
                                       ((lane / 8) % 2) * 8));
            mma_bf16(s[nt], a, b[0], b[1]);
            mma_bf16(s[nt + 1], a, b[2], b[3]);
        }
    }

    // Scale (log2 domain), causal mask, running max.
    const int key0 = j * BK + col;
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < BK / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int key = key0 + nt * 8 + (e & 1);
            const int pos = e < 2 ? pos0 : pos1;
            s[nt][e] = key <= pos ? s[nt][e] * scale_log2 : -INFINITY;
        }
        mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
        mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    const float new0 = fmaxf(m0, mx0), new1 = fmaxf(m1, mx1);
    const float c0 = exp2_approx(m0 - new0), c1 = exp2_approx(m1 - new1);
    m0 = new0;
    m1 = new1;

    // Probabilities and their partial row sums.
    float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
    for (int nt = 0; nt < BK / 8; ++nt) {
        s[nt][0] = exp2_approx(s[nt][0] - new0);
        s[nt][1] = exp2_approx(s[nt][1] - new0);
        s[nt][2] = exp2_approx(s[nt][2] - new1);
        s[nt][3] = exp2_approx(s[nt][3] - new1);
        sum0 += s[nt][0];
        sum0 += s[nt][1];
        sum1 += s[nt][2];
        sum1 += s[nt][3];
    }
    l0 = l0 * c0 + sum0;
    l1 = l1 * c1 + sum1;
#pragma unroll
    for (int dt = 0; dt < HD / 8; ++dt) {
        o[dt][0] *= c0;
        o[dt][1] *= c0;
        o[dt][2] *= c1;
        o[dt][3] *= c1;
    }

    // O += bf16(P)·V: the score accumulators of key columns 16·kt.. are the A fragment of step kt.
#pragma unroll
    for (int kt = 0; kt < BK / 16; ++kt) {
        const uint32_t a[4] = {pack_bf16(s[2 * kt][0], s[2 * kt][1]), pack_bf16(s[2 * kt][2], s[2 * kt][3]),
                               pack_bf16(s[2 * kt + 1][0], s[2 * kt + 1][1]),
                               pack_bf16(s[2 * kt + 1][2], s[2 * kt + 1][3])};
#pragma unroll
        for (int dt = 0; dt < HD / 8; dt += 2) {
            uint32_t b[4];
            ldmatrix_x4_trans(b, shared_addr(Vt + (kt * 16 + lane % 8 + ((lane / 8) % 2) * 8) * STRIDE +
                                             dt * 8 + (lane / 16) * 8));
            mma_bf16(o[dt], a, b[0], b[1]);
            mma_bf16(o[dt + 1], a, b[2], b[3]);
        }
    }
}

// The end of a live warp: the quad's row sums, O / l written for its rows inside [past, total).
template <int HD>
__device__ __forceinline__ void write_rows(const float (&o)[HD / 8][4], float l0, float l1, float* __restrict__ out,
                                           int pos0, int pos1, int past, int total, int n_h, int h, int col) {
    // The quad's partial sums (a butterfly: every lane of the quad gets the same bits).
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float inv0 = 1.f / l0, inv1 = 1.f / l1;
    const size_t row_stride = static_cast<size_t>(n_h) * HD;
    if (pos0 >= past && pos0 < total) {
        float* dst = out + static_cast<size_t>(pos0 - past) * row_stride + static_cast<size_t>(h) * HD + col;
#pragma unroll
        for (int dt = 0; dt < HD / 8; ++dt)
            *reinterpret_cast<float2*>(dst + dt * 8) = make_float2(o[dt][0] * inv0, o[dt][1] * inv0);
    }
    if (pos1 >= past && pos1 < total) {
        float* dst = out + static_cast<size_t>(pos1 - past) * row_stride + static_cast<size_t>(h) * HD + col;
#pragma unroll
        for (int dt = 0; dt < HD / 8; ++dt)
            *reinterpret_cast<float2*>(dst + dt * 8) = make_float2(o[dt][2] * inv1, o[dt][3] * inv1);
    }
}

template <int HD, int BK>
__device__ __forceinline__ void flash_attention(const __nv_bfloat16* __restrict__ q,
                                                const __nv_bfloat16* __restrict__ k,
                                                const __nv_bfloat16* __restrict__ v, float* __restrict__ out,
                                                int T, int n_h, int n_kv, int past, float scale_log2,
                                                int first_block, int n_blocks, int kv_rows, int y) {
    static_assert(HD % 16 == 0 && BK % 16 == 0, "tiles are made of 16×16 mma steps");
    static_assert((FA_ROWS * HD / 8) % FA_THREADS == 0 && (BK * HD / 8) % FA_THREADS == 0,
                  "every thread copies the same number of 16-byte pieces");
    constexpr int STRIDE = HD + FA_PAD;  // bf16 elements per shared-memory row
    constexpr int CHUNKS = HD / 8;       // 16-byte pieces per row

    extern __shared__ __align__(16) unsigned char fa_smem[];
    __nv_bfloat16* Qs = reinterpret_cast<__nv_bfloat16*>(fa_smem);  // [FA_ROWS][STRIDE]
    __nv_bfloat16* Ks = Qs + FA_ROWS * STRIDE;                      // [2][BK][STRIDE]
    __nv_bfloat16* Vs = Ks + 2 * BK * STRIDE;                       // [2][BK][STRIDE]

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    // The blocks with the most key tiles first (they would finish last otherwise), all heads of a
    // position block next to each other (the heads of a KV group then read its tiles from L2 together).
    const int blk = first_block + (n_blocks - 1 - y);
    const int h = blockIdx.x;
    const int kv = h / (n_h / n_kv);
    const int total = past + T;
    const int block_pos = blk * FA_ROWS;
    const int warp_pos = block_pos + 16 * warp;
    const bool warp_live = warp_pos + 15 >= past && warp_pos < total;
    const int warp_tiles = warp_pos / BK + 1;
    const int last_pos = min(block_pos + FA_ROWS, total) - 1;
    const int n_tiles = (block_pos + 16 * ((last_pos - block_pos) / 16)) / BK + 1;

    // KV head kv starts kv_rows rows after head kv − 1 (kv_rows ≥ total: a cache with room to grow).
    const __nv_bfloat16* kb = k + static_cast<size_t>(kv) * kv_rows * HD;
    const __nv_bfloat16* vb = v + static_cast<size_t>(kv) * kv_rows * HD;

    // Q rows of the block's positions (zeros for dead rows).
#pragma unroll
    for (int i = 0; i < FA_ROWS * CHUNKS / FA_THREADS; ++i) {
        const int idx = threadIdx.x + i * FA_THREADS;
        const int r = idx / CHUNKS, c = idx % CHUNKS;
        const int pos = block_pos + r;
        const bool valid = pos >= past && pos < total;
        const __nv_bfloat16* src = valid ? q + (static_cast<size_t>(pos - past) * n_h + h) * HD + c * 8 : q;
        cp_async_16(shared_addr(Qs + r * STRIDE + c * 8), src, valid);
    }
    auto load_tile = [&](int j, int buf) {
#pragma unroll
        for (int i = 0; i < BK * CHUNKS / FA_THREADS; ++i) {
            const int idx = threadIdx.x + i * FA_THREADS;
            const int r = idx / CHUNKS, c = idx % CHUNKS;
            const int key = j * BK + r;
            const bool valid = key < total;
            const size_t off = valid ? static_cast<size_t>(key) * HD + c * 8 : 0;
            const int dst = (buf * BK + r) * STRIDE + c * 8;
            cp_async_16(shared_addr(Ks + dst), kb + off, valid);
            cp_async_16(shared_addr(Vs + dst), vb + off, valid);
        }
    };
    load_tile(0, 0);
    cp_async_commit();

    float o[HD / 8][4];
#pragma unroll
    for (int dt = 0; dt < HD / 8; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
    // Rows g and g + 8 of the warp's 16 (the mma accumulator layout): running max, partial sums.
    const int g = lane / 4, col = 2 * (lane % 4);
    const int pos0 = warp_pos + g, pos1 = warp_pos + g + 8;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;

    for (int j = 0; j < n_tiles; ++j) {
        if (j + 1 < n_tiles) {
            load_tile(j + 1, (j + 1) & 1);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        if (warp_live && j < warp_tiles) {
            const __nv_bfloat16* Kt = Ks + (j & 1) * BK * STRIDE;
            const __nv_bfloat16* Vt = Vs + (j & 1) * BK * STRIDE;
            attend_tile<HD, BK>(Qs, Kt, Vt, warp, lane, j, pos0, pos1, scale_log2, o, m0, m1, l0, l1);
        }
        __syncthreads();
    }

    if (!warp_live) return;
    write_rows<HD>(o, l0, l1, out, pos0, pos1, past, total, n_h, h, col);
}

// Two e4m3 bytes (the low one first) times `scale`, as a bf16 pair: each value exact through f16 (every
// e4m3 value is an f16 value), one correctly rounded f32 multiplication, then bf16 round to nearest
// even — bit for bit kv_fp8.cu's kv_fp8_dequantize with bf16 output.
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint16_t pair, float scale) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair), __NV_E4M3);
    const float2 f = __half22float2(__half2(h));
    return pack_bf16(__fmul_rn(f.x, scale), __fmul_rn(f.y, scale));
}

// The same attention as flash_attention<HD, BK> on an fp8 K/V cache: k and v [n_kv, past + T, HD] e4m3
// bytes with scales ks, vs [n_kv, past + T] (crates/prism-model/src/kv_fp8.rs). The bytes and scales of
// tile j + 1 stream into a double-buffered staging area (cp.async) while tile j is used; before use, a
// tile is dequantized in shared memory into the bf16 tiles the mma steps read: bf16(e4m3 · scale), the
// values kv_fp8_dequantize writes, so every row's output is bit for bit that of flash_attention<HD, BK>
// on the dequantized bf16 cache (and batch-invariant for the same reasons; keys past the end are
// zero-filled bytes and scales, hence zeros, as there).
template <int HD, int BK>
__device__ __forceinline__ void flash_attention_fp8(const __nv_bfloat16* __restrict__ q,
                                                    const uint8_t* __restrict__ k, const float* __restrict__ ks,
                                                    const uint8_t* __restrict__ v, const float* __restrict__ vs,
                                                    float* __restrict__ out, int T, int n_h, int n_kv, int past,
                                                    float scale_log2, int first_block, int n_blocks) {
    static_assert(HD % 16 == 0 && BK % 16 == 0, "tiles are made of 16×16 mma steps");
    static_assert((FA_ROWS * HD / 8) % FA_THREADS == 0, "every thread copies the same number of Q pieces");
    static_assert((BK * HD / 16) % FA_THREADS == 0 && (BK * HD / 8) % FA_THREADS == 0 && BK <= FA_THREADS,
                  "every thread stages and converts the same number of K/V pieces");
    constexpr int STRIDE = HD + FA_PAD;
    constexpr int CHUNKS = HD / 8;     // 16-byte pieces of a bf16 row
    constexpr int CHUNKS8 = HD / 16;   // 16-byte pieces of an e4m3 row

    extern __shared__ __align__(16) unsigned char fa_smem[];
    __nv_bfloat16* Qs = reinterpret_cast<__nv_bfloat16*>(fa_smem);  // [FA_ROWS][STRIDE]
    __nv_bfloat16* Kb = Qs + FA_ROWS * STRIDE;                      // [BK][STRIDE], the tile in use
    __nv_bfloat16* Vb = Kb + BK * STRIDE;                           // [BK][STRIDE]
    uint8_t* K8 = reinterpret_cast<uint8_t*>(Vb + BK * STRIDE);     // [2][BK][HD] staged bytes
    uint8_t* V8 = K8 + 2 * BK * HD;                                 // [2][BK][HD]
    float* Ksc = reinterpret_cast<float*>(V8 + 2 * BK * HD);        // [2][BK] staged scales
    float* Vsc = Ksc + 2 * BK;                                      // [2][BK]

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int blk = first_block + (n_blocks - 1 - static_cast<int>(blockIdx.y));
    const int h = blockIdx.x;
    const int kv = h / (n_h / n_kv);
    const int total = past + T;
    const int block_pos = blk * FA_ROWS;
    const int warp_pos = block_pos + 16 * warp;
    const bool warp_live = warp_pos + 15 >= past && warp_pos < total;
    const int warp_tiles = warp_pos / BK + 1;
    const int last_pos = min(block_pos + FA_ROWS, total) - 1;
    const int n_tiles = (block_pos + 16 * ((last_pos - block_pos) / 16)) / BK + 1;

    const uint8_t* kb = k + static_cast<size_t>(kv) * total * HD;
    const uint8_t* vb = v + static_cast<size_t>(kv) * total * HD;
    const float* ksb = ks + static_cast<size_t>(kv) * total;
    const float* vsb = vs + static_cast<size_t>(kv) * total;

    // The Q load and the tile loop below repeat flash_attention<HD, BK>'s: the steps both run alike are
    // shared (attend_tile, write_rows); the loop stays per variant since this one converts between staging and use.
#pragma unroll
    for (int i = 0; i < FA_ROWS * CHUNKS / FA_THREADS; ++i) {
        const int idx = threadIdx.x + i * FA_THREADS;
        const int r = idx / CHUNKS, c = idx % CHUNKS;
        const int pos = block_pos + r;
        const bool valid = pos >= past && pos < total;
        const __nv_bfloat16* src = valid ? q + (static_cast<size_t>(pos - past) * n_h + h) * HD + c * 8 : q;
        cp_async_16(shared_addr(Qs + r * STRIDE + c * 8), src, valid);
    }
    auto stage_tile = [&](int j, int buf) {
#pragma unroll
        for (int i = 0; i < BK * CHUNKS8 / FA_THREADS; ++i) {
            const int idx = threadIdx.x + i * FA_THREADS;
            const int r = idx / CHUNKS8, c = idx % CHUNKS8;
            const int key = j * BK + r;
            const bool valid = key < total;
            const size_t off = valid ? static_cast<size_t>(key) * HD + c * 16 : 0;
            const int dst = (buf * BK + r) * HD + c * 16;
            cp_async_16(shared_addr(K8 + dst), kb + off, valid);
            cp_async_16(shared_addr(V8 + dst), vb + off, valid);
        }
        if (threadIdx.x < BK) {
            const int key = j * BK + threadIdx.x;
            const bool valid = key < total;
            const size_t off = valid ? static_cast<size_t>(key) : 0;
            cp_async_4(shared_addr(Ksc + buf * BK + threadIdx.x), ksb + off, valid);
            cp_async_4(shared_addr(Vsc + buf * BK + threadIdx.x), vsb + off, valid);
        }
    };
    // Staged tile `buf` → the bf16 tiles Kb, Vb (8 values a thread and step: 8 bytes in, 16 bytes out).
    auto convert_tile = [&](int buf) {
#pragma unroll
        for (int i = 0; i < BK * CHUNKS / FA_THREADS; ++i) {
            const int idx = threadIdx.x + i * FA_THREADS;
            const int r = idx / CHUNKS, c = idx % CHUNKS;
            const uint2 kr = *reinterpret_cast<const uint2*>(K8 + (buf * BK + r) * HD + c * 8);
            const uint2 vr = *reinterpret_cast<const uint2*>(V8 + (buf * BK + r) * HD + c * 8);
            const float sk = Ksc[buf * BK + r], sv = Vsc[buf * BK + r];
            const uint4 kd = make_uint4(e4m3x2_to_bf16x2(kr.x & 0xFFFFu, sk), e4m3x2_to_bf16x2(kr.x >> 16, sk),
                                        e4m3x2_to_bf16x2(kr.y & 0xFFFFu, sk), e4m3x2_to_bf16x2(kr.y >> 16, sk));
            const uint4 vd = make_uint4(e4m3x2_to_bf16x2(vr.x & 0xFFFFu, sv), e4m3x2_to_bf16x2(vr.x >> 16, sv),
                                        e4m3x2_to_bf16x2(vr.y & 0xFFFFu, sv), e4m3x2_to_bf16x2(vr.y >> 16, sv));
            *reinterpret_cast<uint4*>(Kb + r * STRIDE + c * 8) = kd;
            *reinterpret_cast<uint4*>(Vb + r * STRIDE + c * 8) = vd;
        }
    };
    stage_tile(0, 0);
    cp_async_commit();

    float o[HD / 8][4];
#pragma unroll
    for (int dt = 0; dt < HD / 8; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
    const int g = lane / 4, col = 2 * (lane % 4);
    const int pos0 = warp_pos + g, pos1 = warp_pos + g + 8;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;

    for (int j = 0; j < n_tiles; ++j) {
        if (j + 1 < n_tiles) {
            stage_tile(j + 1, (j + 1) & 1);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // tile j staged (and Q loaded) for every thread
        convert_tile(j & 1);
        __syncthreads();  // Kb, Vb hold tile j
        if (warp_live && j < warp_tiles) {
            attend_tile<HD, BK>(Qs, Kb, Vb, warp, lane, j, pos0, pos1, scale_log2, o, m0, m1, l0, l1);
        }
        __syncthreads();  // Kb, Vb and staging buffer j & 1 free again
    }

    if (!warp_live) return;
    write_rows<HD>(o, l0, l1, out, pos0, pos1, past, total, n_h, h, col);
}

}  // namespace

// Grid: (n_h, n_blocks); block: 128 threads; dynamic shared memory (64 + 4·BK)·(HD + 8)·2 bytes. Blocks
// cover absolute positions [64·first_block, 64·(first_block + n_blocks)) ⊇ [past, past + T). k and v:
// [n_kv, kv_rows, HD] with kv_rows ≥ past + T (rows past the end are never read).
#define FLASH_ATTENTION_ENTRY(NAME, HD, BK)                                                                   \
    extern "C" __global__ void __launch_bounds__(FA_THREADS)                                                  \
        NAME(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,                       \
             const __nv_bfloat16* __restrict__ v, float* __restrict__ out, int T, int n_h, int n_kv, int past, \
             float scale_log2, int first_block, int n_blocks, int kv_rows) {                                  \
        PRISM_GRID_PROLOGUE();                                                                                \
        flash_attention<HD, BK>(q, k, v, out, T, n_h, n_kv, past, scale_log2, first_block, n_blocks, kv_rows, \
                                static_cast<int>(blockIdx.y));                                                \
    }

FLASH_ATTENTION_ENTRY(flash_attention_hd256, 256, 32)
FLASH_ATTENTION_ENTRY(flash_attention_hd128, 128, 64)
FLASH_ATTENTION_ENTRY(flash_attention_hd64, 64, 64)

// Several sequences' segments in one launch: segment z (blockIdx.z) is exactly the single-sequence call
// above on its own q rows, cache and output rows — the same device function with the same arguments, so
// the same bits. Grid: (n_h, the most blocks of any segment, segments); a segment's extra y blocks exit
// at once. Passed by value (kernel parameters), at most FA_BATCH segments a launch.
#define FA_BATCH 64
struct FlashBatch {
    const __nv_bfloat16* k[FA_BATCH];
    const __nv_bfloat16* v[FA_BATCH];
    // Per segment: its first row in q and out, T, past, first_block, n_blocks, kv_rows.
    int row[FA_BATCH];
    int T[FA_BATCH];
    int past[FA_BATCH];
    int first_block[FA_BATCH];
    int n_blocks[FA_BATCH];
    int kv_rows[FA_BATCH];
};

#define FLASH_ATTENTION_BATCH_ENTRY(NAME, HD, BK)                                                              \
    extern "C" __global__ void __launch_bounds__(FA_THREADS)                                                   \
        NAME(const __nv_bfloat16* __restrict__ q, const FlashBatch batch, float* __restrict__ out, int n_h,    \
             int n_kv, float scale_log2) {                                                                     \
        PRISM_GRID_PROLOGUE();                                                                                 \
        const int z = blockIdx.z;                                                                              \
        const int y = blockIdx.y;                                                                              \
        if (y >= batch.n_blocks[z]) return;                                                                    \
        const size_t at = static_cast<size_t>(batch.row[z]) * n_h * HD;                                        \
        flash_attention<HD, BK>(q + at, batch.k[z], batch.v[z], out + at, batch.T[z], n_h, n_kv, batch.past[z], \
                                scale_log2, batch.first_block[z], batch.n_blocks[z], batch.kv_rows[z], y);     \
    }

FLASH_ATTENTION_BATCH_ENTRY(flash_attention_batch_hd256, 256, 32)
FLASH_ATTENTION_BATCH_ENTRY(flash_attention_batch_hd128, 128, 64)
FLASH_ATTENTION_BATCH_ENTRY(flash_attention_batch_hd64, 64, 64)

// The new keys and values of several segments written into their caches in one launch: row t of
// segment z (rows row[z] .. row[z] + T[z] of the packed k_new, v_new: [N, n_kv, HD] bf16, contiguous)
// goes to position at[z] + t of each KV head of its cache ([n_kv, kv_rows[z], HD]). Grid: (n_kv, most
// rows of a segment up to 65,535, segments); block: HD / 8 threads (16 bytes each) — plain copies.
struct KvAppendBatch {
    __nv_bfloat16* k[FA_BATCH];
    __nv_bfloat16* v[FA_BATCH];
    int row[FA_BATCH];
    int T[FA_BATCH];
    int at[FA_BATCH];
    int kv_rows[FA_BATCH];
};

extern "C" __global__ void kv_append_batch_bf16(const __nv_bfloat16* __restrict__ k_new,
                                                const __nv_bfloat16* __restrict__ v_new, const KvAppendBatch batch,
                                                int n_kv, int hd) {
    PRISM_GRID_PROLOGUE();
    const int z = blockIdx.z, head = blockIdx.x;
    for (int t = blockIdx.y; t < batch.T[z]; t += gridDim.y) {
        const size_t src = (static_cast<size_t>(batch.row[z] + t) * n_kv + head) * hd;
        const size_t dst = (static_cast<size_t>(head) * batch.kv_rows[z] + batch.at[z] + t) * hd;
        for (int c = threadIdx.x * 8; c < hd; c += blockDim.x * 8) {
            *reinterpret_cast<uint4*>(batch.k[z] + dst + c) = *reinterpret_cast<const uint4*>(k_new + src + c);
            *reinterpret_cast<uint4*>(batch.v[z] + dst + c) = *reinterpret_cast<const uint4*>(v_new + src + c);
        }
    }
}

// The fp8 variants: grid and block as above; dynamic shared memory (64 + 2·BK)·(HD + 8)·2 bytes (Q and
// the bf16 tile in use) + 4·BK·HD bytes (staged K/V bytes, two buffers) + 16·BK bytes (staged scales).
#define FLASH_ATTENTION_FP8_ENTRY(NAME, HD, BK)                                                                \
    extern "C" __global__ void __launch_bounds__(FA_THREADS)                                                   \
        NAME(const __nv_bfloat16* __restrict__ q, const uint8_t* __restrict__ k, const float* __restrict__ ks, \
             const uint8_t* __restrict__ v, const float* __restrict__ vs, float* __restrict__ out, int T,      \
             int n_h, int n_kv, int past, float scale_log2, int first_block, int n_blocks) {                   \
        PRISM_GRID_PROLOGUE();                                                                                 \
        flash_attention_fp8<HD, BK>(q, k, ks, v, vs, out, T, n_h, n_kv, past, scale_log2, first_block,        \
                                    n_blocks);                                                                 \
    }

FLASH_ATTENTION_FP8_ENTRY(flash_attention_fp8_hd256, 256, 32)
FLASH_ATTENTION_FP8_ENTRY(flash_attention_fp8_hd128, 128, 64)
FLASH_ATTENTION_FP8_ENTRY(flash_attention_fp8_hd64, 64, 64)

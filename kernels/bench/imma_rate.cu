// Micro-benchmark of the pieces of the integer GEMM's inner loop on one GPU (not part of the engine):
// how fast mma.sync int8 runs alone, with the Q8_0 contract's per-block float epilogue (one FADD of the
// magic-number conversion and one FFMA per output), with the fragment loads from shared memory, and
// with the K-quants' (W4A8) integer epilogue instead, and with warpgroup MMA (wgmma) instead of mma.sync.
// It tells which of these bounds kernels/quant_gemm.cu. Build here, run on the device:
//
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o imma_rate kernels/bench/imma_rate.cu
//   ./imma_rate            (prints one line per variant: TOPS counted as 2 ops per multiply-add)
//
// Every variant runs MT × NT m16n8k32 MMAs per "block" per warp (the v2 kernel's warp tile), BLOCKS
// blocks per warp, in CTAs of WARPS warps, several CTAs per SM. Results are folded into one store per
// thread so the compiler keeps the work.

#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>
#include "../wgmma.cuh"  // descriptors, fences (shared with kernels/quant_gemm.cu)

#define CHECK(x)                                                                              \
    do {                                                                                      \
        cudaError_t e = (x);                                                                  \
        if (e != cudaSuccess) {                                                               \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
            return 1;                                                                         \
        }                                                                                     \
    } while (0)

__device__ __forceinline__ void mma_k32(int (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1,
                                        int c0, int c1, int c2, int c3) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(c0), "r"(c1), "r"(c2), "r"(c3));
}

// The same with unsigned B bytes (s8 × u8).
__device__ __forceinline__ void mma_k32_u8(int (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1,
                                           int c0, int c1, int c2, int c3) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.u8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(c0), "r"(c1), "r"(c2), "r"(c3));
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"((unsigned)__cvta_generic_to_shared(p)));
}

// k = 16 from a zero accumulator (the min term's products).
__device__ __forceinline__ void mma_k16(int (&d)[4], unsigned a0, unsigned a1, unsigned b0) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%7,%7,%7};\n"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(a0), "r"(a1), "r"(b0), "r"(0));
}

#define MAGIC_I 0x4B400000
#define MAGIC_F 12582912.0f

// MODE 0: MMAs only, each accumulating into its own tile (i32 chains).
// MODE 1: the Q8_0 block: MMA from the magic constant, FADD, FFMA into a float accumulator.
// MODE 2: MODE 1 plus the fragments of every block from shared memory by ldmatrix (and the scales
//         by LDS), as the v2 kernel does.
// MODE 4: MODE 0 with unsigned B bytes (mma .s8.u8). (Added 2026-11-30, fourth session.)
// MODE 3: the Q4_K / Q5_K slice (W4A8): each MMA from zero, its i32 sums times the sub-block's integer
//         scale into an i32 block sum (one IMAD per output), and every 8 slices (a 256-element block)
//         the block end: two k16 MMAs for the min term, two I2F and two FFMA per output. Fragments
//         stay in registers, as in MODE 1. (Added 2026-11-30, third session; not yet run.)
// MODE 5: the Q8_0 block "chained" (a candidate contract, sixth session): the MMA accumulates onto the
//         previous block's i32 result, so the register holds 1.5·2^23 + S_b (S_b: the prefix sum of the
//         block sums of a group of 8 blocks, |S_b| < 2^22) as float bits; one FFMA by a coefficient
//         per column and block (c_b = d_b − d_{b+1}, c_last = d_last: Σ c_b·S_b = Σ d_b·D_b) folds it
//         in, and every 8 blocks one FADD removes the group's bias and one MOV resets the chain.
// MODE 6: MODE 5 plus the fragments by ldmatrix and the coefficients by LDS, as MODE 2.
template <int MODE, int MT, int NT>
__global__ void imma_kernel(int blocks, float* out, int seed) {
    __shared__ __align__(128) unsigned char sm[2][(MT * 16 + NT * 8) * 128 + 512];
    const int lane = threadIdx.x & 31;
    unsigned af[MT][4], bf[NT][2];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int q = 0; q < 4; ++q) af[i][q] = (unsigned)(seed * 7 + i * 13 + q + lane) * 0x01010101u;
#pragma unroll
    for (int j = 0; j < NT; ++j) bf[j][0] = bf[j][1] = (unsigned)(seed + j + lane) * 0x01010101u;
    for (int i = threadIdx.x; i < (int)sizeof(sm) / 4; i += blockDim.x)
        reinterpret_cast<unsigned*>(sm)[i] = i * 2654435761u;
    __syncthreads();
    float acc[MT][NT][4];
    int iacc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                acc[i][j][e] = 0.f;
                iacc[i][j][e] = (MODE == 5 || MODE == 6) ? MAGIC_I : 0;
            }
    const int warp = threadIdx.x >> 5;
    if (MODE == 3) {
        int dsum[MT][NT][4];
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) dsum[i][j][e] = 0;
        for (int b = 0; b < blocks; ++b) {
            const int slice = b & 7;
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                // The two columns' sub-block scales (bytes in 0..63 in the kernel; any ints here).
                const int sc0 = (lane + j + slice) & 63, sc1 = (lane + 3 * j + slice) & 63;
#pragma unroll
                for (int i = 0; i < MT; ++i) {
                    int c[4];
                    mma_k32(c, af[i], bf[j][0], bf[j][1], 0, 0, 0, 0);
                    dsum[i][j][0] += sc0 * c[0];
                    dsum[i][j][1] += sc1 * c[1];
                    dsum[i][j][2] += sc0 * c[2];
                    dsum[i][j][3] += sc1 * c[3];
                }
            }
            if (slice == 7) {
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    const float2 dv = make_float2(1.0f + j, 0.5f + warp), dm = make_float2(0.25f, 0.125f * j);
#pragma unroll
                    for (int i = 0; i < MT; ++i) {
                        int sh[4], sl[4];
                        mma_k16(sh, af[i][0], af[i][1], bf[j][0]);
                        mma_k16(sl, af[i][2], af[i][3], bf[j][1]);
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int mb = sh[e] * 64 + sl[e];
                            const float a = fmaf((e & 1) ? dv.y : dv.x, __int2float_rn(dsum[i][j][e]), acc[i][j][e]);
                            acc[i][j][e] = fmaf(-((e & 1) ? dm.y : dm.x), __int2float_rn(mb), a);
                            dsum[i][j][e] = 0;
                        }
                    }
                }
            }
        }
    }
    for (int b = 0; b < (MODE == 3 ? 0 : blocks); ++b) {
        if (MODE == 2 || MODE == 6) {
            const unsigned char* st = sm[b & 1];
            const int kc = b & 3;
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                const int r = i * 16 + (lane & 15);
                ldmatrix_x4(af[i], st + r * 128 + (((2 * kc + (lane >> 4)) ^ (r & 7)) << 4));
            }
#pragma unroll
            for (int j = 0; j < NT; j += 2) {
                const int r = MT * 16 + j * 8 + (lane & 7) + ((lane >> 4) << 3);
                unsigned t[4];
                ldmatrix_x4(t, st + r * 128 + (((2 * kc + ((lane >> 3) & 1)) ^ (r & 7)) << 4));
                bf[j][0] = t[0];
                bf[j][1] = t[1];
                bf[j + 1][0] = t[2];
                bf[j + 1][1] = t[3];
            }
        }
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            float2 dv = make_float2(1.0f + j, 0.5f + warp);
            if (MODE == 2 || MODE == 6)
                dv = *reinterpret_cast<const float2*>(sm[b & 1] + (MT * 16 + NT * 8) * 128 + 8 * ((lane & 3) + 4 * j));
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                int c[4];
                if (MODE == 0 || MODE == 4) {
                    if (MODE == 0)
                        mma_k32(c, af[i], bf[j][0], bf[j][1], iacc[i][j][0], iacc[i][j][1], iacc[i][j][2],
                                iacc[i][j][3]);
                    else
                        mma_k32_u8(c, af[i], bf[j][0], bf[j][1], iacc[i][j][0], iacc[i][j][1], iacc[i][j][2],
                                   iacc[i][j][3]);
#pragma unroll
                    for (int e = 0; e < 4; ++e) iacc[i][j][e] = c[e];
                } else if (MODE == 5 || MODE == 6) {
                    mma_k32(c, af[i], bf[j][0], bf[j][1], iacc[i][j][0], iacc[i][j][1], iacc[i][j][2],
                            iacc[i][j][3]);
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        acc[i][j][e] = fmaf((e & 1) ? dv.y : dv.x, __int_as_float(c[e]), acc[i][j][e]);
                        iacc[i][j][e] = c[e];
                    }
                    if ((b & 7) == 7) {
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            acc[i][j][e] = __fadd_rn(acc[i][j][e], (e & 1) ? -dv.x : -dv.y);
                            iacc[i][j][e] = MAGIC_I;
                        }
                    }
                } else {
                    mma_k32(c, af[i], bf[j][0], bf[j][1], MAGIC_I, MAGIC_I, MAGIC_I, MAGIC_I);
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const float db = __fsub_rn(__int_as_float(c[e]), MAGIC_F);
                        acc[i][j][e] = fmaf((e & 1) ? dv.y : dv.x, db, acc[i][j][e]);
                    }
                }
            }
        }
    }
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) s += acc[i][j][e] + (float)iacc[i][j][e];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

template <int MODE, int MT, int NT>
int run(const char* name, int warps, int ctas_per_sm, int sms) {
    const int blocks = 4096;
    const int grid = sms * ctas_per_sm, threads = warps * 32;
    float* out;
    CHECK(cudaMalloc(&out, sizeof(float) * grid * threads));
    cudaEvent_t t0, t1;
    CHECK(cudaEventCreate(&t0));
    CHECK(cudaEventCreate(&t1));
    imma_kernel<MODE, MT, NT><<<grid, threads>>>(16, out, 1);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    float best = 1e30f;
    for (int rep = 0; rep < 5; ++rep) {
        CHECK(cudaEventRecord(t0));
        imma_kernel<MODE, MT, NT><<<grid, threads>>>(blocks, out, rep);
        CHECK(cudaEventRecord(t1));
        CHECK(cudaEventSynchronize(t1));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, t0, t1));
        best = ms < best ? ms : best;
    }
    const double macs = (double)grid * warps * blocks * MT * NT * 16 * 8 * 32;
    printf("%-44s warps/CTA %2d CTAs/SM %d  %8.3f ms  %7.1f TOPS\n", name, warps, ctas_per_sm, best,
           2 * macs / (best * 1e-3) / 1e12);
    CHECK(cudaFree(out));
    return 0;
}

// ---------------------------------------------------------------------------------------------------
// Warpgroup MMA (sm_90a): `wgmma.mma_async` m64nNk32 s8 × s8 → s32, both operands K-major in shared
// memory with the 128-byte swizzle (the layout of the GEMM's TMA stages: rows of 128 bytes of K, 16-byte
// chunk c of row r at c ^ (r & 7)). The mma costs the warps one instruction per 64×N×32 and no
// `ldmatrix`, but the block sum comes out of a wgmma without the magic-number bias that mma.sync takes
// as its C operand, so the Q8_0 epilogue is three instructions per output and block (IADD of the bias,
// FADD, FFMA) instead of two. Measured on an H200 (2026-11-30, fifth session; docs/benchmarks.md):
// wgmma alone 1,850–1,900 TOPS; with the Q8_0 epilogue 412–472 (mma.sync with its fragment loads: 472),
// so wgmma does not lift the Q8_0 contract's ceiling; with the Q4_K epilogue 437–575 (mma.sync, the
// kernel's 64×32 warp tiles: 363).
// d = a·b (scale_d = 0) or d += a·b (scale_d = 1), asynchronously; the registers are the warpgroup's
// 64×128 accumulator, 64 per thread.
__device__ __forceinline__ void wgmma_s8(int (&d)[64], unsigned long long da, unsigned long long db, int scale_d) {
#ifdef HAVE_WGMMA
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p;\n}\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31]), "+r"(d[32]), "+r"(d[33]), "+r"(d[34]), "+r"(d[35]), "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]), "+r"(d[40]), "+r"(d[41]), "+r"(d[42]), "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]), "+r"(d[48]), "+r"(d[49]), "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]), "+r"(d[56]), "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63])
        : "l"(da), "l"(db), "r"(scale_d)
        : "memory");
#endif
}

// The same with a 64×64 tile: 32 accumulator registers a thread.
__device__ __forceinline__ void wgmma_s8(int (&d)[32], unsigned long long da, unsigned long long db, int scale_d) {
#ifdef HAVE_WGMMA
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p;\n}\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31])
        : "l"(da), "l"(db), "r"(scale_d)
        : "memory");
#endif
}

// One block's (EPILOGUE 1) or 32-slice's (EPILOGUE 2) epilogue on one accumulator set. 1, Q8_0: f32(D)
// by the bias and one exact subtraction, one fma. 2, Q4_K: the sum times its column's sub-block scale
// into an i32 block sum (one IMAD per output), and every 8 slices the block end (two conversions and two
// FMAs per output; the min term's own products are left out, 1/8 of a wgmma in the kernel). Accumulator
// register i of a thread is column 8·(i / 4) + 2·(lane % 4) + (i & 1) of the warpgroup's tile.
// 3, Q8_0 chained (MODE 5 of the mma.sync loop): the set accumulates over a group of 8 blocks from the
// bias, so its registers are the floats 1.5·2^23 + S_b; one FFMA by the block's coefficient of the
// thread's row (weights on the wgmma's M side: a thread's 64 outputs are 2 weight rows, so 2
// coefficients a block, loaded by one LDS.64); every 8 blocks one FADD of the group's bias and one MOV
// of the bias back into the set.
template <int EPILOGUE, int R, int S, int T>
__device__ __forceinline__ void wgmma_consume(int (&d)[R], float (&acc)[R], int (&dsum)[S],
                                              const int (&sc)[T], float dv0, float dv1, int b,
                                              const float* coef) {
    if constexpr (EPILOGUE == 3) {
        const float2 cv = *reinterpret_cast<const float2*>(coef + 2 * ((b & 7) * 128 + (threadIdx.x & 127)));
#pragma unroll
        for (int i = 0; i < R; ++i) acc[i] = fmaf((i & 2) ? cv.y : cv.x, __int_as_float(d[i]), acc[i]);
        if ((b & 7) == 7) {
#pragma unroll
            for (int i = 0; i < R; ++i) {
                acc[i] = __fadd_rn(acc[i], (i & 2) ? dv1 : dv0);
                d[i] = MAGIC_I;
            }
        }
    }
    if constexpr (EPILOGUE == 1) {
#pragma unroll
        for (int i = 0; i < R; ++i) {
            const float db = __fsub_rn(__int_as_float(d[i] + MAGIC_I), MAGIC_F);
            acc[i] = fmaf((i & 1) ? dv1 : dv0, db, acc[i]);
        }
    }
    if constexpr (EPILOGUE == 2) {
#pragma unroll
        for (int i = 0; i < R; ++i) dsum[i] += sc[i / 4] * d[i];
        if ((b & 7) == 7) {
#pragma unroll
            for (int i = 0; i < R; ++i) {
                const float a = fmaf((i & 1) ? dv1 : dv0, __int2float_rn(dsum[i]), acc[i]);
                acc[i] = fmaf(-0.25f, __int2float_rn(dsum[i] >> 3), a);
                dsum[i] = 0;
            }
        }
    }
}

// EPILOGUE 0: wgmma alone, every block accumulating into the same set. 1: the Q8_0 contract, a fresh
// sum per block, converted by its warpgroup when it lands. 2: the Q4_K contract (see wgmma_consume).
// SETS accumulator sets a warpgroup: each round issues SETS blocks' wgmmas, one commit group each, then
// waits for them one by one and runs each one's epilogue while the later ones are still in flight. The
// round ends with nothing in flight: ptxas serializes every wgmma of a loop whose back edge carries one
// in flight into a read of another set (C7514, found with a rolling two-set loop), and then a warpgroup
// overlaps nothing. Meanwhile the CTA's other warpgroups keep the tensor cores busy ("ping-pong"). WGS
// warpgroups a CTA, one CTA an SM, tiles of 64 × N a warpgroup (N = 128 or 64), every warpgroup on the
// same 64 × 128 B A and N × 128 B B tiles.
template <int N>
__device__ __forceinline__ void wgmma_wait_n() {
    if constexpr (N == 0) wgmma_wait<0>();
    if constexpr (N == 1) wgmma_wait<1>();
    if constexpr (N == 2) wgmma_wait<2>();
    if constexpr (N == 3) wgmma_wait<3>();
}
template <int EPILOGUE, int R, int S, int T, int SETS, int J = 0>
__device__ __forceinline__ void wgmma_drain(int (&d)[SETS][R], float (&acc)[R], int (&dsum)[S],
                                            const int (&sc)[T], float dv0, float dv1, int b,
                                            const float* coef) {
    if constexpr (J < SETS) {
        wgmma_wait_n<SETS - 1 - J>();
        wgmma_fence_regs(d[J]);
        wgmma_consume<EPILOGUE>(d[J], acc, dsum, sc, dv0, dv1, b + J, coef);
        wgmma_drain<EPILOGUE, R, S, T, SETS, J + 1>(d, acc, dsum, sc, dv0, dv1, b, coef);
    }
}

template <int EPILOGUE, int WGS, int N, int SETS>
__global__ void __launch_bounds__(WGS * 128, 1) wgmma_kernel(int blocks, float* out, int seed) {
    constexpr int R = N / 2, S = EPILOGUE == 2 ? R : 1, T = EPILOGUE == 2 ? R / 4 : 1;
    __shared__ __align__(1024) unsigned char sm[64 * 128 + N * 128];
    for (int i = threadIdx.x; i < (int)sizeof(sm) / 4; i += blockDim.x)
        reinterpret_cast<unsigned*>(sm)[i] = (i + seed) * 2654435761u;
#ifdef HAVE_WGMMA
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // generic writes → wgmma reads
#endif
    __syncthreads();
    const unsigned long long da = wgmma_desc((unsigned)__cvta_generic_to_shared(sm)),
                             db = wgmma_desc((unsigned)__cvta_generic_to_shared(sm + 64 * 128));
    int d[SETS][R];
    float acc[R];
#pragma unroll
    for (int i = 0; i < R; ++i) {
#pragma unroll
        for (int j = 0; j < SETS; ++j) d[j][i] = EPILOGUE == 3 ? MAGIC_I : 0;
        acc[i] = 0.f;
    }
    const float dv0 = 1.0f + (threadIdx.x & 7), dv1 = 0.5f + (threadIdx.x >> 7);
    int dsum[S], sc[T];
#pragma unroll
    for (int i = 0; i < S; ++i) dsum[i] = 0;
#pragma unroll
    for (int j = 0; j < T; ++j) sc[j] = (threadIdx.x + 3 * j + seed) & 63;
    // Block b uses the 32-byte K slice b & 3 of the 128-byte rows: the descriptors advance by 32 bytes.
    for (int b = 0; b < blocks; b += SETS) {
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < SETS; ++j) {
            wgmma_s8(d[j], da + 2 * ((b + j) & 3), db + 2 * ((b + j) & 3),
                     EPILOGUE == 0 ? (b > 0) : EPILOGUE == 3 ? 1 : 0);
            wgmma_commit();
        }
        if constexpr (EPILOGUE != 0)
            wgmma_drain<EPILOGUE>(d, acc, dsum, sc, dv0, dv1, b, reinterpret_cast<const float*>(sm));
    }
    wgmma_wait<0>();
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < SETS; ++j) {
        wgmma_fence_regs(d[j]);
#pragma unroll
        for (int i = 0; i < R; ++i) s += (float)d[j][i];
    }
#pragma unroll
    for (int i = 0; i < R; ++i) s += acc[i];
#pragma unroll
    for (int i = 0; i < S; ++i) s += (float)dsum[i];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

template <int EPILOGUE, int WGS, int N, int SETS>
int run_wgmma(const char* name, int sms) {
    const int blocks = 4096, grid = sms, threads = WGS * 128;
    float* out;
    CHECK(cudaMalloc(&out, sizeof(float) * grid * threads));
    cudaEvent_t t0, t1;
    CHECK(cudaEventCreate(&t0));
    CHECK(cudaEventCreate(&t1));
    wgmma_kernel<EPILOGUE, WGS, N, SETS><<<grid, threads>>>(16, out, 1);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    float best = 1e30f;
    for (int rep = 0; rep < 5; ++rep) {
        CHECK(cudaEventRecord(t0));
        wgmma_kernel<EPILOGUE, WGS, N, SETS><<<grid, threads>>>(blocks, out, rep);
        CHECK(cudaEventRecord(t1));
        CHECK(cudaEventSynchronize(t1));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, t0, t1));
        best = ms < best ? ms : best;
    }
    // WGS warpgroups a CTA, each 64 × N outputs × 32 per block.
    const double macs = (double)grid * WGS * blocks * 64 * N * 32;
    printf("%-40s 64x%-3d sets %d warps/CTA %2d  %8.3f ms  %7.1f TOPS\n", name, N, SETS,
           WGS * 4, best, 2 * macs / (best * 1e-3) / 1e12);
    CHECK(cudaFree(out));
    return 0;
}

int main() {
    cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, 0) != cudaSuccess) {
        fprintf(stderr, "no CUDA device\n");
        return 1;
    }
    const int sms = p.multiProcessorCount;
    printf("%s, %d SMs\n", p.name, sms);
    int rc = 0;
    rc |= run<0, 4, 4>("mma only, warp tile 64x32", 8, 1, sms);
    rc |= run<0, 4, 4>("mma only, warp tile 64x32", 8, 2, sms);
    rc |= run<0, 4, 4>("mma only, warp tile 64x32", 16, 1, sms);
    rc |= run<0, 2, 4>("mma only, warp tile 32x32", 8, 4, sms);
    rc |= run<4, 4, 4>("mma s8 x u8 only, warp tile 64x32", 8, 1, sms);
    rc |= run<4, 2, 4>("mma s8 x u8 only, warp tile 32x32", 8, 4, sms);
    rc |= run<1, 4, 4>("mma + FADD/FFMA, warp tile 64x32", 8, 1, sms);
    rc |= run<1, 4, 4>("mma + FADD/FFMA, warp tile 64x32", 8, 2, sms);
    rc |= run<1, 2, 4>("mma + FADD/FFMA, warp tile 32x32", 16, 1, sms);
    rc |= run<1, 2, 4>("mma + FADD/FFMA, warp tile 32x32", 8, 4, sms);
    rc |= run<2, 4, 4>("mma + FADD/FFMA + ldmatrix, warp tile 64x32", 8, 1, sms);
    rc |= run<2, 4, 4>("mma + FADD/FFMA + ldmatrix, warp tile 64x32", 8, 2, sms);
    rc |= run<2, 2, 4>("mma + FADD/FFMA + ldmatrix, warp tile 32x32", 16, 1, sms);
    rc |= run<2, 2, 4>("mma + FADD/FFMA + ldmatrix, warp tile 32x32", 8, 4, sms);
    rc |= run<5, 4, 4>("Q8_0 chained: mma + FFMA, warp tile 64x32", 8, 1, sms);
    rc |= run<5, 4, 4>("Q8_0 chained: mma + FFMA, warp tile 64x32", 8, 2, sms);
    rc |= run<5, 2, 4>("Q8_0 chained: mma + FFMA, warp tile 32x32", 16, 1, sms);
    rc |= run<6, 4, 4>("Q8_0 chained + ldmatrix, warp tile 64x32", 8, 1, sms);
    rc |= run<6, 4, 4>("Q8_0 chained + ldmatrix, warp tile 64x32", 8, 2, sms);
    rc |= run<6, 2, 4>("Q8_0 chained + ldmatrix, warp tile 32x32", 16, 1, sms);
    rc |= run<6, 2, 4>("Q8_0 chained + ldmatrix, warp tile 32x32", 8, 4, sms);
    rc |= run<3, 4, 4>("Q4_K: mma + IMAD, block end, warp tile 64x32", 8, 1, sms);
    rc |= run<3, 3, 4>("Q4_K: mma + IMAD, block end, warp tile 48x32", 8, 1, sms);
    rc |= run<3, 2, 4>("Q4_K: mma + IMAD, block end, warp tile 32x32", 16, 1, sms);
    rc |= run_wgmma<0, 2, 128, 1>("wgmma alone", sms);
    rc |= run_wgmma<0, 2, 128, 2>("wgmma alone", sms);
    rc |= run_wgmma<1, 2, 128, 1>("wgmma + IADD/FADD/FFMA (Q8_0)", sms);
    rc |= run_wgmma<1, 3, 128, 1>("wgmma + IADD/FADD/FFMA (Q8_0)", sms);
    rc |= run_wgmma<1, 2, 128, 2>("wgmma + IADD/FADD/FFMA (Q8_0)", sms);
    rc |= run_wgmma<1, 3, 64, 2>("wgmma + IADD/FADD/FFMA (Q8_0)", sms);
    rc |= run_wgmma<1, 4, 64, 2>("wgmma + IADD/FADD/FFMA (Q8_0)", sms);
    rc |= run_wgmma<1, 2, 64, 4>("wgmma + IADD/FADD/FFMA (Q8_0)", sms);
    rc |= run_wgmma<1, 3, 64, 3>("wgmma + IADD/FADD/FFMA (Q8_0)", sms);
    rc |= run_wgmma<3, 2, 128, 1>("wgmma + FFMA, chained (Q8_0)", sms);
    rc |= run_wgmma<3, 3, 128, 1>("wgmma + FFMA, chained (Q8_0)", sms);
    rc |= run_wgmma<3, 2, 128, 2>("wgmma + FFMA, chained (Q8_0)", sms);
    rc |= run_wgmma<3, 3, 64, 2>("wgmma + FFMA, chained (Q8_0)", sms);
    rc |= run_wgmma<3, 4, 64, 2>("wgmma + FFMA, chained (Q8_0)", sms);
    rc |= run_wgmma<3, 2, 64, 4>("wgmma + FFMA, chained (Q8_0)", sms);
    rc |= run_wgmma<3, 3, 64, 3>("wgmma + FFMA, chained (Q8_0)", sms);
    rc |= run_wgmma<3, 4, 64, 1>("wgmma + FFMA, chained (Q8_0)", sms);
    rc |= run_wgmma<3, 3, 64, 1>("wgmma + FFMA, chained (Q8_0)", sms);
    rc |= run_wgmma<2, 2, 128, 1>("wgmma + IMAD, block end (Q4_K)", sms);
    rc |= run_wgmma<2, 4, 64, 1>("wgmma + IMAD, block end (Q4_K)", sms);
    rc |= run_wgmma<2, 2, 64, 2>("wgmma + IMAD, block end (Q4_K)", sms);
    rc |= run_wgmma<2, 3, 64, 2>("wgmma + IMAD, block end (Q4_K)", sms);
    rc |= run_wgmma<2, 2, 64, 4>("wgmma + IMAD, block end (Q4_K)", sms);
    return rc;
}

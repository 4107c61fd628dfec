// Micro-benchmark of the pieces of the integer GEMM's inner loop on one GPU (not part of the engine):
// how fast mma.sync int8 runs alone, with the Q8_0 contract's per-block float epilogue (one FADD of the
// magic-number conversion and one FFMA per output), with the fragment loads from shared memory, and
// with the K-quants' (W4A8) integer epilogue instead.
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
                iacc[i][j][e] = 0;
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
        if (MODE == 2) {
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
            if (MODE == 2)
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
    rc |= run<3, 4, 4>("Q4_K: mma + IMAD, block end, warp tile 64x32", 8, 1, sms);
    rc |= run<3, 3, 4>("Q4_K: mma + IMAD, block end, warp tile 48x32", 8, 1, sms);
    rc |= run<3, 2, 4>("Q4_K: mma + IMAD, block end, warp tile 32x32", 16, 1, sms);
    return rc;
}

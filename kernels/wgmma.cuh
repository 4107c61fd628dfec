// Warpgroup MMA (sm_90a) helpers shared by kernels/quant_gemm.cu and kernels/bench/imma_rate.cu: the
// shared-memory matrix descriptor and the fence / commit / wait of `wgmma.mma_async`. The MMA
// instructions themselves stay with their kernels (their shapes and types differ). Outside sm_90a the
// bodies are empty: callers launch these paths on sm_90a only.
#pragma once

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define HAVE_WGMMA 1
#endif

// A K-major operand in shared memory with the 128-byte swizzle (rows of 128 bytes of K, 16-byte chunk c
// of row r at c ^ (r & 7), 8-row groups 1,024 bytes apart): the start address (a 32-byte K slice inside
// the rows is an offset of it when the tile starts on a 1,024-byte boundary), the 8-row group stride and
// the swizzle mode.
__device__ __forceinline__ unsigned long long wgmma_desc(unsigned smem_address) {
    return (unsigned long long)((smem_address & 0x3FFFF) >> 4) | (1ull << 16) | ((1024ull >> 4) << 32) |
           (1ull << 62);
}
__device__ __forceinline__ void wgmma_fence() {
#ifdef HAVE_WGMMA
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#ifdef HAVE_WGMMA
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#ifdef HAVE_WGMMA
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// After a wait: the accumulators change here, so no read of them moves above it.
template <int R>
__device__ __forceinline__ void wgmma_fence_regs(int (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+r"(d[i])::"memory");
}

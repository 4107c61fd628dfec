// Activation quantization of one group of 32 values, shared by quant_gemm.cu's `quantize_act_i8` and the
// fused producers of ops.cu (which quantize their own outputs), so every path writes the same bytes:
//
//   qa = clamp(rint(x · inv_scale), −127, 127)   (one IEEE multiplication, never contracted; round half
//                                                  to even; clamp after rounding)
//
// with the group's sum of qa (the K-quants' min term) and the row flag of a non-finite input:
// `bad_rows[row]` (zeroed by the host) becomes 0xFFFFFFFF − c for the smallest column c of the row that
// holds a NaN or ±∞ (atomicMax of the complement: 0 stays "clean"). The group's values are written
// anyway (NaN clamps to −127, ±∞ to ±127).
#pragma once

// A group is quantized by 8 consecutive lanes of a warp, 4 values each (lane j of the group holds
// values 4j..4j+3): loads and stores of a warp's 4 groups are then contiguous, where one thread per
// group (until fe90185) made every access of a warp touch 32 places 128 bytes apart. Each value gets
// the formula above; the sum of the group's 32 integers and the smallest bad column do not depend on
// how the lanes combine them, so the bytes, sums and flags are the same either way. All 32 lanes of the
// warp must call it (`active` false for lanes past the last group, whose 8 lanes are then all inactive).
__device__ __forceinline__ void quantize_group32_lanes(const float (&v)[4], int j, bool active,
                                                       signed char* __restrict__ qa_group,
                                                       int* __restrict__ sums,
                                                       unsigned int* __restrict__ bad_rows, long long g,
                                                       int groups_per_row, float inv_scale,
                                                       int want_sums) {
    unsigned int word = 0;
    int sum = 0;
    int first_bad = 32;  // column within the group; 32: none
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        const float x = v[c];
        if (!isfinite(x) && first_bad == 32) first_bad = 4 * j + c;
        const float r = fminf(fmaxf(rintf(__fmul_rn(x, inv_scale)), -127.f), 127.f);
        const int q = (int)r;
        sum += q;
        word |= ((unsigned int)(q & 0xff)) << (8 * c);
    }
    if (active) reinterpret_cast<unsigned int*>(qa_group)[j] = word;
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) {
        sum += __shfl_xor_sync(0xffffffffu, sum, o);
        first_bad = min(first_bad, __shfl_xor_sync(0xffffffffu, first_bad, o));
    }
    if (active && j == 0) {
        if (want_sums) sums[g] = sum;
        if (first_bad < 32) {
            const long long row = g / groups_per_row;
            const unsigned int col = (unsigned int)((g % groups_per_row) * 32 + first_bad);
            atomicMax(bad_rows + row, 0xFFFFFFFFu - col);
        }
    }
}

// Shared helpers of rtxmpi's kernels. Included by every kernels/*.cu through
//   #include "common.cuh"
// and compiled both by nvcc (tests/unit/test_kernels_compile.py) and by NVRTC through
// cupy.RawModule (rtxmpi/kernels.py passes -I<kernels dir>). No host headers: NVRTC has none.
#pragma once

// A float is finite when its exponent bits are not all ones (inf and NaN have them all set).
__device__ __forceinline__ bool rtx_finite(float x) {
    return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u;
}

// float -> IEEE half, round to nearest even (the PTX conversion; no cuda_fp16.h needed).
__device__ __forceinline__ unsigned short rtx_f32_to_f16(float x) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}

// float -> bfloat16 bits, round to nearest even, NaN kept NaN (PTX ISA 7.0, sm_80+).
__device__ __forceinline__ unsigned short rtx_f32_to_bf16(float x) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}

// Sum of `v` over the thread block; every thread gets the total. `shared` holds 32 floats.
// Warps reduce by butterfly shuffles, then warp 0 reduces the per-warp sums.
__device__ __forceinline__ float rtx_block_sum(float v, float* shared) {
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    for (int offset = 16; offset > 0; offset >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    __syncthreads();  // `shared` may still be read by a previous call
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    const unsigned nwarps = (blockDim.x + 31u) >> 5;
    v = (threadIdx.x < nwarps) ? shared[threadIdx.x] : 0.0f;
    if (warp == 0) {
        for (int offset = 16; offset > 0; offset >>= 1)
            v += __shfl_xor_sync(0xffffffffu, v, offset);
        if (lane == 0) shared[0] = v;
    }
    __syncthreads();
    return shared[0];
}

// Maximum of `v` over the thread block (NaN ignored, as fmaxf); every thread gets it. As
// rtx_block_sum; `shared` holds 32 floats.
__device__ __forceinline__ float rtx_block_max(float v, float* shared) {
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    for (int offset = 16; offset > 0; offset >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    const unsigned nwarps = (blockDim.x + 31u) >> 5;
    v = (threadIdx.x < nwarps) ? shared[threadIdx.x] : -__int_as_float(0x7f800000);
    if (warp == 0) {
        for (int offset = 16; offset > 0; offset >>= 1)
            v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
        if (lane == 0) shared[0] = v;
    }
    __syncthreads();
    return shared[0];
}

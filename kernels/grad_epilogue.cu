// Gradient epilogue after the data-parallel all_reduce, in one pass over the buffer:
//   g[i] = g[i] * scale                                  (in place, float32, no FMA)
//   out[i] = cast(g[i])        when cast_kind != 0        (1: float16, 2: bfloat16 bits; RNE)
//   *flag = 1                  when any g[i] (or out[i]) is inf or NaN
// Numpy reference with identical semantics: rtxmpi.kernels.grad_epilogue.
// Launch: any grid; n elements; `flag` must be zeroed before the launch (only ever set to 1).
#include "common.cuh"

__device__ __forceinline__ bool rtx_epilogue_one(float* g, unsigned short* out, long long i,
                                                 float scale, int cast_kind) {
    const float v = __fmul_rn(g[i], scale);
    g[i] = v;
    bool bad = !rtx_finite(v);
    if (cast_kind == 1) {
        const unsigned short h = rtx_f32_to_f16(v);
        out[i] = h;
        bad |= (h & 0x7c00u) == 0x7c00u;  // float16 overflow to inf
    } else if (cast_kind == 2) {
        const unsigned short h = rtx_f32_to_bf16(v);
        out[i] = h;
        bad |= (h & 0x7f80u) == 0x7f80u;  // bfloat16 overflow to inf
    }
    return bad;
}

extern "C" __global__ void grad_epilogue_f32(float* __restrict__ g, unsigned short* __restrict__ out,
                                             int* __restrict__ flag, long long n, float scale,
                                             int cast_kind) {
    bool bad = false;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        bad |= rtx_epilogue_one(g, out, i, scale, cast_kind);
    if (__syncthreads_or(bad) && threadIdx.x == 0) *flag = 1;
}

// Same, four elements per thread with 16-byte loads: g must be 16-byte aligned (out 8-byte
// aligned when casting). The n % 4 tail elements are done one by one.
extern "C" __global__ void grad_epilogue_f32x4(float* __restrict__ g, unsigned short* __restrict__ out,
                                               int* __restrict__ flag, long long n, float scale,
                                               int cast_kind) {
    bool bad = false;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long start = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long n4 = n >> 2;
    float4* g4 = reinterpret_cast<float4*>(g);
    for (long long i = start; i < n4; i += stride) {
        float4 v = g4[i];
        v.x = __fmul_rn(v.x, scale); v.y = __fmul_rn(v.y, scale);
        v.z = __fmul_rn(v.z, scale); v.w = __fmul_rn(v.w, scale);
        g4[i] = v;
        bad |= !(rtx_finite(v.x) && rtx_finite(v.y) && rtx_finite(v.z) && rtx_finite(v.w));
        if (cast_kind != 0) {
            unsigned short h0, h1, h2, h3;
            unsigned short mask;
            if (cast_kind == 1) {
                h0 = rtx_f32_to_f16(v.x); h1 = rtx_f32_to_f16(v.y);
                h2 = rtx_f32_to_f16(v.z); h3 = rtx_f32_to_f16(v.w);
                mask = 0x7c00u;
            } else {
                h0 = rtx_f32_to_bf16(v.x); h1 = rtx_f32_to_bf16(v.y);
                h2 = rtx_f32_to_bf16(v.z); h3 = rtx_f32_to_bf16(v.w);
                mask = 0x7f80u;
            }
            ushort4 h;
            h.x = h0; h.y = h1; h.z = h2; h.w = h3;
            reinterpret_cast<ushort4*>(out)[i] = h;
            bad |= ((h0 & mask) == mask) | ((h1 & mask) == mask) | ((h2 & mask) == mask)
                   | ((h3 & mask) == mask);
        }
    }
    for (long long i = (n4 << 2) + start; i < n; i += stride)
        bad |= rtx_epilogue_one(g, out, i, scale, cast_kind);
    if (__syncthreads_or(bad) && threadIdx.x == 0) *flag = 1;
}

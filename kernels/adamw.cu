// Fused AdamW update (Loshchilov & Hutter 2019; bias correction as Kingma & Ba 2015), one pass:
//   m = b1 (m - g) + g;  v = b2 (v - g^2) + g^2
//   p = p * decay                         (decay_mode 1: no mask; decay = 1 - lr wd)
//   p = p - (mask p) lr_wd                (decay_mode 2: per-element mask)
//   p = p - (m / (sqrt(v) + eps_term)) step_size
// with eps_term = eps sqrt(1 - b2^t) and step_size = lr sqrt(1 - b2^t) / (1 - b1^t) computed on
// the host. Every operation is rounded separately (no FMA), in the order of rtxmpi.nn.AdamW.step,
// so the result equals the numpy reference (rtxmpi.kernels.adamw_step) bit for bit.
#include "common.cuh"

__device__ __forceinline__ void rtx_adamw_one(float& p, const float g, float& m, float& v,
                                              const float mask, float b1, float b2, float decay,
                                              float lr_wd, float eps_term, float step_size,
                                              int decay_mode) {
    m = __fadd_rn(__fmul_rn(__fsub_rn(m, g), b1), g);
    const float gg = __fmul_rn(g, g);
    v = __fadd_rn(__fmul_rn(__fsub_rn(v, gg), b2), gg);
    if (decay_mode == 1) {
        p = __fmul_rn(p, decay);
    } else if (decay_mode == 2) {
        p = __fsub_rn(p, __fmul_rn(__fmul_rn(mask, p), lr_wd));
    }
    const float denom = __fadd_rn(__fsqrt_rn(v), eps_term);
    p = __fsub_rn(p, __fmul_rn(__fdiv_rn(m, denom), step_size));
}

extern "C" __global__ void adamw_f32(float* __restrict__ p, const float* __restrict__ g,
                                     float* __restrict__ m, float* __restrict__ v,
                                     const float* __restrict__ mask, long long n, float b1,
                                     float b2, float decay, float lr_wd, float eps_term,
                                     float step_size, int decay_mode) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float pi = p[i], mi = m[i], vi = v[i];
        rtx_adamw_one(pi, g[i], mi, vi, decay_mode == 2 ? mask[i] : 0.0f, b1, b2, decay, lr_wd,
                      eps_term, step_size, decay_mode);
        p[i] = pi; m[i] = mi; v[i] = vi;
    }
}

// Same, four elements per thread with 16-byte loads: every pointer 16-byte aligned.
extern "C" __global__ void adamw_f32x4(float* __restrict__ p, const float* __restrict__ g,
                                       float* __restrict__ m, float* __restrict__ v,
                                       const float* __restrict__ mask, long long n, float b1,
                                       float b2, float decay, float lr_wd, float eps_term,
                                       float step_size, int decay_mode) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long start = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long n4 = n >> 2;
    for (long long i = start; i < n4; i += stride) {
        float4 p4 = reinterpret_cast<float4*>(p)[i];
        const float4 g4 = reinterpret_cast<const float4*>(g)[i];
        float4 m4 = reinterpret_cast<float4*>(m)[i];
        float4 v4 = reinterpret_cast<float4*>(v)[i];
        float4 k4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (decay_mode == 2) k4 = reinterpret_cast<const float4*>(mask)[i];
        rtx_adamw_one(p4.x, g4.x, m4.x, v4.x, k4.x, b1, b2, decay, lr_wd, eps_term, step_size, decay_mode);
        rtx_adamw_one(p4.y, g4.y, m4.y, v4.y, k4.y, b1, b2, decay, lr_wd, eps_term, step_size, decay_mode);
        rtx_adamw_one(p4.z, g4.z, m4.z, v4.z, k4.z, b1, b2, decay, lr_wd, eps_term, step_size, decay_mode);
        rtx_adamw_one(p4.w, g4.w, m4.w, v4.w, k4.w, b1, b2, decay, lr_wd, eps_term, step_size, decay_mode);
        reinterpret_cast<float4*>(p)[i] = p4;
        reinterpret_cast<float4*>(m)[i] = m4;
        reinterpret_cast<float4*>(v)[i] = v4;
    }
    for (long long i = (n4 << 2) + start; i < n; i += stride) {
        float pi = p[i], mi = m[i], vi = v[i];
        rtx_adamw_one(pi, g[i], mi, vi, decay_mode == 2 ? mask[i] : 0.0f, b1, b2, decay, lr_wd,
                      eps_term, step_size, decay_mode);
        p[i] = pi; m[i] = mi; v[i] = vi;
    }
}

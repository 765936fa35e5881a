// Bias + GELU (tanh approximation, Hendrycks & Gimpel 2016, as GPT-2 and rtxmpi.nn.layers):
// forward  u = h + b[col];  a = 0.5 (1 + tanh(k (u + c u^3)));  y = u a
// backward du = dy * a * (1 + 2 k u (1 + 3 c u^2) (1 - a))        (a recomputed from u)
// h, u, y, dy, du: N x C row-major float32, flattened to n = N * C elements; b: (C,).
// The constants arrive from the host already rounded to float32: kc = k c, k, kc6 = 6 k c,
// k2 = 2 k. Every operation is rounded separately (no FMA), in rtxmpi.nn.layers' order; only
// tanhf differs from numpy's tanh (a few ulp). Numpy references: rtxmpi.kernels.bias_gelu_*.
#include "common.cuh"

__device__ __forceinline__ float rtx_gelu_gate(float u, float kc, float k) {
    float a = __fmul_rn(__fadd_rn(__fmul_rn(__fmul_rn(u, u), kc), k), u);
    a = tanhf(a);
    return __fmul_rn(__fadd_rn(a, 1.0f), 0.5f);
}

extern "C" __global__ void bias_gelu_forward_f32(const float* __restrict__ h,
                                                 const float* __restrict__ b,
                                                 float* __restrict__ u_out, float* __restrict__ y,
                                                 long long n, long long C, float kc, float k) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float u = __fadd_rn(h[i], b[i % C]);
        u_out[i] = u;
        y[i] = __fmul_rn(u, rtx_gelu_gate(u, kc, k));
    }
}

extern "C" __global__ void bias_gelu_backward_f32(const float* __restrict__ dy,
                                                  const float* __restrict__ u_in,
                                                  float* __restrict__ du, long long n, float kc,
                                                  float k, float kc6, float k2) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float u = u_in[i];
        const float a = rtx_gelu_gate(u, kc, k);
        float d = __fmul_rn(u, u);
        d = __fmul_rn(d, kc6);
        d = __fadd_rn(d, k2);
        d = __fmul_rn(d, u);
        d = __fmul_rn(d, __fsub_rn(1.0f, a));
        d = __fadd_rn(d, 1.0f);
        d = __fmul_rn(d, a);
        du[i] = __fmul_rn(d, dy[i]);
    }
}

// Residual add + LayerNorm forward (Ba, Kiros & Hinton 2016), one thread block per row:
//   s = x + r                                   (the new residual stream, written out)
//   mean = sum(s) / C;  var = sum((s - mean)^2) / C + eps;  rstd = 1 / sqrt(var)
//   y = ((s - mean) * rstd) * g + b
// x, r, s, y: N x C row-major float32; g, b: (C,); mean, rstd: (N,). Biased variance, two-pass
// (no E[x^2] - E[x]^2 cancellation). Sums are tree-ordered, so results match the numpy
// reference (rtxmpi.kernels.residual_layernorm_forward) to float32 rounding, not bit for bit.
// Launch: grid = N blocks, block = a multiple of 32 threads (<= 1024); 32 floats shared.
#include "common.cuh"

extern "C" __global__ void residual_layernorm_forward_f32(
        const float* __restrict__ x, const float* __restrict__ r, const float* __restrict__ g,
        const float* __restrict__ b, float* __restrict__ s, float* __restrict__ y,
        float* __restrict__ mean_out, float* __restrict__ rstd_out, int C, float eps) {
    __shared__ float shared[32];
    const long long row = blockIdx.x;
    const float* xr = x + row * C;
    const float* rr = r + row * C;
    float* sr = s + row * C;
    float* yr = y + row * C;
    float sum = 0.0f;
    for (int j = threadIdx.x; j < C; j += blockDim.x) {
        const float v = __fadd_rn(xr[j], rr[j]);
        sr[j] = v;
        sum += v;
    }
    const float mean = __fdiv_rn(rtx_block_sum(sum, shared), (float)C);
    float sq = 0.0f;
    for (int j = threadIdx.x; j < C; j += blockDim.x) {  // each thread re-reads what it wrote
        const float d = __fsub_rn(sr[j], mean);
        sq = __fadd_rn(sq, __fmul_rn(d, d));
    }
    const float var = __fadd_rn(__fdiv_rn(rtx_block_sum(sq, shared), (float)C), eps);
    const float rstd = __frcp_rn(__fsqrt_rn(var));
    for (int j = threadIdx.x; j < C; j += blockDim.x) {
        const float xhat = __fmul_rn(__fsub_rn(sr[j], mean), rstd);
        yr[j] = __fadd_rn(__fmul_rn(xhat, g[j]), b[j]);
    }
    if (threadIdx.x == 0) {
        mean_out[row] = mean;
        rstd_out[row] = rstd;
    }
}

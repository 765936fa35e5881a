// LayerNorm backward (Ba, Kiros & Hinton 2016) from the forward's xhat and rstd, and the column
// sums that give the gain, bias and linear-bias gradients without atomics (deterministic).
//
// layernorm_backward_dx_f32, one thread block per row of C floats:
//   dx = ((dy g - mean(dy g)) - xhat mean(dy xhat g)) rstd
// in rtxmpi.kernels.layernorm_backward's operation order (sums tree-ordered: float32 rounding).
// Launch: grid = rows blocks, block = a multiple of 32 threads (<= 1024); 32 floats shared.
//
// column_sums_f32: partial[chunk, c] = sum over rows r of chunk of a[r, c], and with
// `with_product` also partial[chunks + chunk, c] = sum of a[r, c] * b[r, c]; chunk = blockIdx.y
// covers rows [chunk * rows_per_chunk, +rows_per_chunk). The host sums the chunks. A warp reads
// 32 neighbouring columns of one row (coalesced). Launch: grid = (ceil(C / threads), chunks).
#include "common.cuh"

extern "C" __global__ void layernorm_backward_dx_f32(
        const float* __restrict__ dy, const float* __restrict__ xhat,
        const float* __restrict__ rstd, const float* __restrict__ g, float* __restrict__ dx,
        int C) {
    __shared__ float shared[32];
    const long long row = blockIdx.x;
    const float* dyr = dy + row * C;
    const float* xr = xhat + row * C;
    float s1 = 0.0f, s2 = 0.0f;
    for (int j = threadIdx.x; j < C; j += blockDim.x) {
        const float dg = __fmul_rn(dyr[j], g[j]);
        s1 += dg;
        s2 += __fmul_rn(__fmul_rn(dyr[j], xr[j]), g[j]);
    }
    const float m1 = __fdiv_rn(rtx_block_sum(s1, shared), (float)C);
    const float m2 = __fdiv_rn(rtx_block_sum(s2, shared), (float)C);
    const float r = rstd[row];
    float* dxr = dx + row * C;
    for (int j = threadIdx.x; j < C; j += blockDim.x) {
        const float v = __fsub_rn(__fsub_rn(__fmul_rn(dyr[j], g[j]), m1), __fmul_rn(xr[j], m2));
        dxr[j] = __fmul_rn(v, r);
    }
}

extern "C" __global__ void column_sums_f32(const float* __restrict__ a,
                                           const float* __restrict__ b,
                                           float* __restrict__ partial, long long rows, int C,
                                           long long rows_per_chunk, int with_product) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const long long r0 = (long long)blockIdx.y * rows_per_chunk;
    const long long r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
    float s = 0.0f, sp = 0.0f;
    for (long long r = r0; r < r1; ++r) {
        const float v = a[r * C + c];
        s += v;
        if (with_product) sp += __fmul_rn(v, b[r * C + c]);
    }
    partial[(long long)blockIdx.y * C + c] = s;
    if (with_product) partial[((long long)gridDim.y + blockIdx.y) * C + c] = sp;
}

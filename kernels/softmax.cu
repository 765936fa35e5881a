// Attention softmax over the last dim, forward in place and backward (Vaswani et al. 2017), one
// thread block per row of T floats:
//   forward  att[j] <- exp(att[j] - m) * (1 / sum_k exp(att[k] - m)),  m = max_k att[k]
//            over the kept keys k; with `causal`, row r keeps keys 0..(r % Tq) (query r % Tq of a
//            (Tq, T) block, Tq = T) and the others become 0
//   backward datt[j] <- datt[j] * att[j] - att[j] * sum_k datt[k] * att[k]   (in place)
// att, datt: rows x T row-major float32. Sums are tree-ordered and expf is CUDA's, so results
// match the numpy references (rtxmpi.kernels.softmax_forward / softmax_backward) to float32
// rounding. The row is read from global memory once per pass; it stays in L1/L2 between passes.
// Launch: grid = rows blocks, block = a multiple of 32 threads (<= 1024); 32 floats shared.
#include "common.cuh"

extern "C" __global__ void softmax_forward_f32(float* __restrict__ att, long long rows, int T,
                                               int Tq, int causal) {
    __shared__ float shared[32];
    const long long row = blockIdx.x;
    float* a = att + row * T;
    const int last = causal ? (int)(row % Tq) : T - 1;  // keys 0..last are kept
    float m = -__int_as_float(0x7f800000);
    for (int j = threadIdx.x; j <= last; j += blockDim.x) m = fmaxf(m, a[j]);
    m = rtx_block_max(m, shared);
    float s = 0.0f;
    for (int j = threadIdx.x; j <= last; j += blockDim.x) s += expf(__fsub_rn(a[j], m));
    const float inv = __frcp_rn(rtx_block_sum(s, shared));
    for (int j = threadIdx.x; j < T; j += blockDim.x)
        a[j] = j <= last ? __fmul_rn(expf(__fsub_rn(a[j], m)), inv) : 0.0f;
}

extern "C" __global__ void softmax_backward_f32(float* __restrict__ datt,
                                                const float* __restrict__ att, long long rows,
                                                int T) {
    __shared__ float shared[32];
    const long long row = blockIdx.x;
    float* d = datt + row * T;
    const float* p = att + row * T;
    float s = 0.0f;
    for (int j = threadIdx.x; j < T; j += blockDim.x) s += __fmul_rn(d[j], p[j]);
    s = rtx_block_sum(s, shared);
    for (int j = threadIdx.x; j < T; j += blockDim.x)
        d[j] = __fsub_rn(__fmul_rn(d[j], p[j]), __fmul_rn(p[j], s));
}

// Kernels of kernels/*.cu behind C entry points host_<kernel>(grid_x, grid_y, block_x, the
// kernel's own parameters...) that launch them through host_cuda.h, for
// tests/unit/test_kernels_host.py (ctypes).
#include "host_cuda.h"
#include "bias_gelu.cu"
#include "layernorm_backward.cu"
#include "residual_layernorm.cu"
#include "softmax.cu"

#define RTX_HOST_ENTRY(kernel, params, args)                                        \
    extern "C" void host_##kernel(unsigned gx, unsigned gy, unsigned bx, params) { \
        rtx_launch(kernel, dim3(gx, gy), dim3(bx), args);                          \
    }
#define P(...) __VA_ARGS__

RTX_HOST_ENTRY(softmax_forward_f32, P(float* att, long long rows, int T, int Tq, int causal),
               P(att, rows, T, Tq, causal))
RTX_HOST_ENTRY(softmax_backward_f32, P(float* datt, const float* att, long long rows, int T),
               P(datt, att, rows, T))
RTX_HOST_ENTRY(layernorm_backward_dx_f32,
               P(const float* dy, const float* xhat, const float* rstd, const float* g,
                 float* dx, int C),
               P(dy, xhat, rstd, g, dx, C))
RTX_HOST_ENTRY(column_sums_f32,
               P(const float* a, const float* b, float* partial, long long rows, int C,
                 long long per, int with_product),
               P(a, b, partial, rows, C, per, with_product))
RTX_HOST_ENTRY(residual_layernorm_forward_f32,
               P(const float* x, const float* r, const float* g, const float* b, float* s,
                 float* y, float* mean, float* rstd, int C, float eps),
               P(x, r, g, b, s, y, mean, rstd, C, eps))
RTX_HOST_ENTRY(bias_gelu_forward_f32,
               P(const float* h, const float* b, float* u, float* y, long long n, long long C,
                 float kc, float k),
               P(h, b, u, y, n, C, kc, k))
RTX_HOST_ENTRY(bias_gelu_backward_f32,
               P(const float* dy, const float* u, float* du, long long n, float kc, float k,
                 float kc6, float k2),
               P(dy, u, du, n, kc, k, kc6, k2))

// Host emulation of the CUDA thread model, enough for rtxmpi's kernels (kernels/*.cu) to run on
// a CPU: every thread of a block is a std::thread; __syncthreads is a block-wide barrier,
// __shfl_xor_sync a warp-wide exchange through memory between two warp barriers; blocks run
// one after another; __shared__ variables are static (one block at a time shares them). The
// _rn intrinsics are the IEEE operations they name (compiled with -ffp-contract=off: no FMA).
// Used by tests/unit/test_kernels_host.py; not a CUDA runtime.
#pragma once
#include <barrier>
#include <math.h>  // expf, fmaxf, sqrtf, tanhf: the names CUDA gives them
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

inline thread_local dim3 threadIdx;
inline dim3 blockIdx, blockDim, gridDim;
inline std::barrier<>* rtx_block_barrier = nullptr;
inline std::vector<std::unique_ptr<std::barrier<>>> rtx_warp_barriers;
inline float rtx_shuffle_slots[1024];

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static

inline void __syncthreads() { rtx_block_barrier->arrive_and_wait(); }

inline float __shfl_xor_sync(unsigned, float v, int offset) {
    std::barrier<>& warp = *rtx_warp_barriers[threadIdx.x / 32];
    rtx_shuffle_slots[threadIdx.x] = v;
    warp.arrive_and_wait();
    const float other = rtx_shuffle_slots[threadIdx.x ^ (unsigned)offset];
    warp.arrive_and_wait();
    return other;
}

inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fsqrt_rn(float a) { return sqrtf(a); }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }

// kernel<<<grid, block>>>(args...): every block in turn, blockDim.x threads each
template <class... P, class... A>
void rtx_launch(void (*kernel)(P...), dim3 grid, dim3 block, A... args) {
    gridDim = grid;
    blockDim = block;
    for (unsigned by = 0; by < grid.y; ++by)
        for (unsigned bx = 0; bx < grid.x; ++bx) {
            blockIdx = dim3(bx, by);
            std::barrier<> barrier((std::ptrdiff_t)block.x);
            rtx_block_barrier = &barrier;
            rtx_warp_barriers.clear();
            for (unsigned w = 0; w < (block.x + 31) / 32; ++w)
                rtx_warp_barriers.emplace_back(new std::barrier<>(32));
            std::vector<std::thread> threads;
            for (unsigned t = 0; t < block.x; ++t)
                threads.emplace_back([&, t] { threadIdx = dim3(t); kernel(args...); });
            for (auto& th : threads) th.join();
        }
}

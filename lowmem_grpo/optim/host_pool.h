// host_pool.cpp's parallel loop, for the kernels compiled with it (optim/host_*.cpp; policy/decode_attention.cpp
// where it is built without OpenMP).
#pragma once

#include <cstdint>

// fn(ctx, c) for every chunk c in [0, n) on the caller and up to threads - 1 helper threads.
void host_parallel_for(int64_t n, int threads, void (*fn)(void*, int64_t), void* ctx);

namespace host_pool {

// f(c) for every chunk c in [0, n), in parallel (host_pool.cpp: no wait for a helper that never started).
template <typename F>
void parallel_for(int64_t n, int threads, const F& f) {
  host_parallel_for(n, threads, [](void* ctx, int64_t c) { (*static_cast<const F*>(ctx))(c); },
                    const_cast<F*>(&f));
}

}  // namespace host_pool

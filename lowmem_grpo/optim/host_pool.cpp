// The host kernels' threads (host_adamw.cpp, host_grad_norm.cpp): a pool whose helpers sleep between calls,
// and a parallel loop whose caller never waits for a helper that has not started work. Threads claim chunks
// one at a time from a shared counter; the caller claims too, then waits only for chunks a helper claimed.
// Which thread computes a chunk never changes its bits. One job at a time: a second caller runs its whole
// job on its own thread. After fork() the child makes a pool of its own.
// Why not OpenMP, and the sleep policy: docs/memory-modes.md ("Threads").

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <system_error>
#include <thread>

namespace {

constexpr auto kSpin = std::chrono::microseconds(50);  // a helper's wait for the next job before it sleeps

struct Pool {
  std::mutex run;                    // held by the caller of the job in progress
  std::mutex mutex;                  // guards the job's description below and the sleeps
  std::condition_variable wake;      // a new job (generation changed)
  std::condition_variable finished;  // the last claimed chunk of the job is done
  std::atomic<uint32_t> generation{0};
  void (*fn)(void*, int64_t) = nullptr;
  void* ctx = nullptr;
  int64_t chunks = 0;
  int wanted = 0;                    // helpers that take part in this job (the caller's threads - 1)
  int started = 0;                   // helpers running
  std::atomic<uint64_t> cursor{0};   // generation << 32 | the next unclaimed chunk
  std::atomic<int64_t> done{0};      // chunks of this job finished
  pid_t pid = getpid();

  // Claim and compute chunks of job `gen` until none is left or `gen` is no longer the job.
  void work(uint32_t gen, void (*job_fn)(void*, int64_t), void* job_ctx, int64_t n) {
    uint64_t cur = cursor.load(std::memory_order_relaxed);
    for (;;) {
      if (static_cast<uint32_t>(cur >> 32) != gen || static_cast<int64_t>(cur & 0xffffffffU) >= n) return;
      if (!cursor.compare_exchange_weak(cur, cur + 1, std::memory_order_acq_rel)) continue;
      job_fn(job_ctx, static_cast<int64_t>(cur & 0xffffffffU));
      if (done.fetch_add(1, std::memory_order_acq_rel) + 1 == n) {
        std::lock_guard<std::mutex> lock(mutex);  // (the caller checks `done` under it before it sleeps)
        finished.notify_all();
      }
      cur = cursor.load(std::memory_order_relaxed);
    }
  }

  void helper(int id) {
    uint32_t seen = generation.load(std::memory_order_acquire);
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + kSpin;
      while (generation.load(std::memory_order_acquire) == seen && std::chrono::steady_clock::now() < until)
        std::this_thread::yield();
      uint32_t gen;
      void (*job_fn)(void*, int64_t);
      void* job_ctx;
      int64_t n;
      {
        std::unique_lock<std::mutex> lock(mutex);
        wake.wait(lock, [&] { return generation.load(std::memory_order_relaxed) != seen; });
        seen = gen = generation.load(std::memory_order_relaxed);
        if (id >= wanted) continue;
        job_fn = fn;
        job_ctx = ctx;
        n = chunks;
      }
      work(gen, job_fn, job_ctx, n);
    }
  }

  void parallel_for(int64_t n, int threads, void (*job_fn)(void*, int64_t), void* job_ctx) {
    std::unique_lock<std::mutex> running(run, std::try_to_lock);
    if (!running.owns_lock() || threads <= 1 || n <= 1) {
      for (int64_t c = 0; c < n; ++c) job_fn(job_ctx, c);
      return;
    }
    uint32_t gen;
    {
      std::lock_guard<std::mutex> lock(mutex);
      try {
        for (; started < threads - 1; ++started) std::thread([this, id = started] { helper(id); }).detach();
      } catch (const std::system_error&) {  // no more threads to be had: the job runs on those there are
      }
      gen = generation.load(std::memory_order_relaxed) + 1;
      fn = job_fn;
      ctx = job_ctx;
      chunks = n;
      wanted = std::min(threads - 1, started);
      done.store(0, std::memory_order_relaxed);
      cursor.store(static_cast<uint64_t>(gen) << 32, std::memory_order_relaxed);
      generation.store(gen, std::memory_order_release);
    }
    wake.notify_all();
    work(gen, job_fn, job_ctx, n);
    if (done.load(std::memory_order_acquire) == n) return;
    const auto until = std::chrono::steady_clock::now() + kSpin;
    while (done.load(std::memory_order_acquire) != n && std::chrono::steady_clock::now() < until)
      std::this_thread::yield();
    std::unique_lock<std::mutex> lock(mutex);
    finished.wait(lock, [&] { return done.load(std::memory_order_acquire) == n; });
  }
};

Pool* pool() {
  // Never destroyed: helpers may be asleep in it at exit. A forked child gets a new one.
  static std::atomic<Pool*> current{nullptr};
  static std::mutex making;
  Pool* p = current.load(std::memory_order_acquire);
  if (p != nullptr && p->pid == getpid()) return p;
  std::lock_guard<std::mutex> lock(making);
  p = current.load(std::memory_order_acquire);
  if (p == nullptr || p->pid != getpid()) {
    p = new Pool();
    current.store(p, std::memory_order_release);
  }
  return p;
}

}  // namespace

// fn(ctx, c) for every chunk c in [0, n), on the caller's thread and up to threads - 1 helpers; returns when
// all are done. n < 2^32.
void host_parallel_for(int64_t n, int threads, void (*fn)(void*, int64_t), void* ctx) {
  pool()->parallel_for(n, threads, fn, ctx);
}

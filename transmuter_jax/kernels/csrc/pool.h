// A persistent thread pool for kernels that XLA runs on one thread.
//
// run(n, task, ctx) calls task(ctx, i) for every i in [0, n) on the calling thread and on the
// pool's workers, and returns when all calls are done. Workers spin for a short while after a job
// (yielding now and then) before sleeping, so back-to-back kernels do not pay for waking threads.
// Chunks are claimed with one atomic word holding (job generation, next chunk), so a worker can
// never run a chunk of a finished job, and the caller can always finish a job alone: a call that
// finds the pool busy (XLA running two kernels at once) runs its chunks on its own thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace tj {

using Task = void (*)(void* ctx, int64_t chunk);

class Pool {
 public:
  // The process-wide pool: `threads` counts the caller, so threads - 1 workers.
  static Pool& get();

  int threads() const { return threads_; }

  void run(int64_t n, Task task, void* ctx) {
    if (n <= 0) return;
    if (n == 1 || threads_ == 1 || !busy_.try_lock()) {
      for (int64_t i = 0; i < n; ++i) task(ctx, i);
      return;
    }
    task_.store(task, std::memory_order_relaxed);
    ctx_.store(ctx, std::memory_order_relaxed);
    count_.store(n, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    const uint64_t gen = (state_.load(std::memory_order_relaxed) >> 32) + 1;
    state_.store(gen << 32, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      wake_.notify_all();
    }
    work(gen);
    // Workers still run claimed chunks: spin briefly, then yield (a worker may be preempted).
    for (uint32_t i = 1; done_.load(std::memory_order_acquire) < n; ++i) {
      if (i < 4096) {
        pause();
      } else {
        std::this_thread::yield();
      }
    }
    busy_.unlock();
  }

 private:
  explicit Pool(int threads, int64_t spin_us) : threads_(threads), spin_us_(spin_us) {
    for (int i = 1; i < threads_; ++i) std::thread([this] { loop(); }).detach();
  }

  static void pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }

  // Claims and runs chunks of job `gen` until none is left or the job has changed.
  void work(uint64_t gen) {
    uint64_t state = state_.load(std::memory_order_acquire);
    while ((state >> 32) == gen) {
      const int64_t chunk = static_cast<int64_t>(state & 0xffffffffu);
      if (chunk >= count_.load(std::memory_order_relaxed)) return;
      if (state_.compare_exchange_weak(state, state + 1, std::memory_order_acq_rel,
                                       std::memory_order_acquire)) {
        task_.load(std::memory_order_relaxed)(ctx_.load(std::memory_order_relaxed), chunk);
        done_.fetch_add(1, std::memory_order_release);
        state = state_.load(std::memory_order_acquire);
      }
    }
  }

  void loop() {
    uint64_t seen = state_.load(std::memory_order_acquire) >> 32;
    for (;;) {
      uint64_t gen = wait_for_job(seen);
      seen = gen;
      work(gen);
    }
  }

  // Spins for spin_us_ microseconds, then sleeps, until the generation differs from `seen`.
  uint64_t wait_for_job(uint64_t seen) {
    auto start = std::chrono::steady_clock::now();
    for (uint32_t i = 1;; ++i) {
      uint64_t gen = state_.load(std::memory_order_acquire) >> 32;
      if (gen != seen) return gen;
      pause();
      if ((i & 255) == 0) {  // every few microseconds: let other threads of this core run
        std::this_thread::yield();
        auto spent = std::chrono::steady_clock::now() - start;
        if (spent > std::chrono::microseconds(spin_us_)) break;
      }
    }
    std::unique_lock<std::mutex> lock(sleep_mutex_);
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    uint64_t gen;
    while ((gen = state_.load(std::memory_order_seq_cst) >> 32) == seen) wake_.wait(lock);
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
    return gen;
  }

  const int threads_;
  const int64_t spin_us_;
  std::mutex busy_;
  std::atomic<uint64_t> state_{0};  // job generation << 32 | next chunk
  std::atomic<Task> task_{nullptr};
  std::atomic<void*> ctx_{nullptr};
  std::atomic<int64_t> count_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleepers_{0};
  std::mutex sleep_mutex_;
  std::condition_variable wake_;
};

}  // namespace tj

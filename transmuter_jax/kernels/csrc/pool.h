// A persistent thread pool for kernels that XLA runs on one thread.
//
// run(n, task, ctx) calls task(ctx, i) for every i in [0, n) on the calling thread and on the
// pool's workers, and returns when all calls are done. Workers spin for a short while after a job
// (yielding now and then) before sleeping, so back-to-back kernels do not pay for waking threads.
// Chunks are claimed with one atomic word holding (job generation, next chunk), so a worker can
// never run a chunk of a finished job, and the caller can always finish a job alone: a call that
// finds the pool busy (XLA running two kernels at once) runs its chunks on its own thread.
#pragma once

#include <algorithm>
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

  // Names the weights the next run() streams, in `chunks` equal runs of bytes: the pool learns
  // which weights follow which (a decode step calls its products in the same order each step).
  // Once out of chunks of that run, each thread prefetches into its cache the part of the
  // weights that followed these last time that it is likely to claim first (the caller the
  // first chunk, worker w chunk w), while the others finish and XLA runs what lies between two
  // products. A prefetch changes no result; a wrong guess costs only bandwidth.
  void stream(const void* data, int64_t bytes, int64_t chunks) {
    const void* before = last_.exchange(data, std::memory_order_relaxed);
    if (before != nullptr && before != data) {
      Follow& f = follows_[slot(before)];
      f.key.store(before, std::memory_order_relaxed);
      f.next.store(data, std::memory_order_relaxed);
      f.bytes.store(bytes, std::memory_order_relaxed);
      f.chunks.store(std::max<int64_t>(chunks, 1), std::memory_order_relaxed);
    }
    const Follow& g = follows_[slot(data)];
    const bool known = g.key.load(std::memory_order_relaxed) == data;
    ahead_.store(known ? g.next.load(std::memory_order_relaxed) : nullptr,
                 std::memory_order_relaxed);
    ahead_bytes_.store(known ? g.bytes.load(std::memory_order_relaxed) : 0,
                       std::memory_order_relaxed);
    ahead_chunks_.store(known ? g.chunks.load(std::memory_order_relaxed) : 1,
                        std::memory_order_relaxed);
  }

  void run(int64_t n, Task task, void* ctx) {
    if (n <= 0) return;
    if (n == 1 || threads_ == 1 || n >= static_cast<int64_t>(kNoChunk) || !busy_.try_lock()) {
      for (int64_t i = 0; i < n; ++i) task(ctx, i);
      return;
    }
    // A generation with nothing to claim first: a worker still in the last job's work(), past
    // its last chunk, may read this job's count before its state; its claim must fail then,
    // or it would run a chunk of this job twice and count it done early.
    const uint64_t closed = (state_.load(std::memory_order_relaxed) >> 32) + 1;
    state_.store((closed << 32) | kNoChunk, std::memory_order_seq_cst);
    task_.store(task, std::memory_order_relaxed);
    ctx_.store(ctx, std::memory_order_relaxed);
    count_.store(n, std::memory_order_release);  // read with it: the closed state is seen
    done_.store(0, std::memory_order_relaxed);
    const uint64_t gen = closed + 1;
    state_.store(gen << 32, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      wake_.notify_all();
    }
    work(gen);
    prefetch_ahead(0, [&] { return done_.load(std::memory_order_relaxed) >= n; });
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
  explicit Pool(int threads, int64_t spin_us, int64_t ahead_limit)
      : threads_(threads), spin_us_(spin_us), ahead_limit_(ahead_limit) {
    for (int i = 1; i < threads_; ++i) std::thread([this, i] { loop(i); }).detach();
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
      if (chunk >= count_.load(std::memory_order_acquire)) return;
      if (state_.compare_exchange_weak(state, state + 1, std::memory_order_acq_rel,
                                       std::memory_order_acquire)) {
        task_.load(std::memory_order_relaxed)(ctx_.load(std::memory_order_relaxed), chunk);
        done_.fetch_add(1, std::memory_order_release);
        state = state_.load(std::memory_order_acquire);
      }
    }
  }

  void loop(int index) {
    uint64_t seen = state_.load(std::memory_order_acquire) >> 32;
    for (;;) {
      uint64_t gen = wait_for_job(seen);
      seen = gen;
      work(gen);
      prefetch_ahead(index, [&] { return (state_.load(std::memory_order_relaxed) >> 32) != gen; });
    }
  }

  static size_t slot(const void* p) {
    return (reinterpret_cast<uintptr_t>(p) >> 6) * 0x9E3779B97F4A7C15ull >> 55;  // 512 slots
  }

  // Prefetches chunk `index` of the guessed next weights (at most ahead_limit_ bytes), a page
  // at a time, until `stop()`.
  template <typename Stop>
  void prefetch_ahead(int index, Stop stop) {
    const char* p = static_cast<const char*>(ahead_.load(std::memory_order_relaxed));
    const int64_t chunks = ahead_chunks_.load(std::memory_order_relaxed);
    if (p == nullptr || index >= chunks || ahead_limit_ == 0) return;
    const int64_t each = ahead_bytes_.load(std::memory_order_relaxed) / chunks;
    const int64_t end = index * each + std::min(each, ahead_limit_);
    for (int64_t at = index * each; at < end; at += 4096) {
      if (stop()) return;
      for (int64_t i = at; i < std::min(end, at + 4096); i += 64) __builtin_prefetch(p + i, 0, 2);
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

  struct Follow {
    std::atomic<const void*> key{nullptr};
    std::atomic<const void*> next{nullptr};
    std::atomic<int64_t> bytes{0};
    std::atomic<int64_t> chunks{1};
  };

  const int threads_;
  const int64_t spin_us_;
  const int64_t ahead_limit_;
  std::atomic<const void*> last_{nullptr};
  std::atomic<const void*> ahead_{nullptr};
  std::atomic<int64_t> ahead_bytes_{0};
  std::atomic<int64_t> ahead_chunks_{1};
  Follow follows_[512];
  std::mutex busy_;
  static constexpr uint64_t kNoChunk = 0xffffffffu;  // a state's chunk when none may be claimed
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

// The process-wide pool, sized from the CPUs this process may run on.
#include "pool.h"

#include <sched.h>

#include <cstdlib>

namespace tj {

static int64_t env_int(const char* name, int64_t fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  long long value = std::strtoll(text, &end, 10);
  return (end != text && value > 0) ? value : fallback;
}

// A size from the environment: 0 allowed (turns the feature off), else `fallback`.
static int64_t env_size(const char* name, int64_t fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  long long value = std::strtoll(text, &end, 10);
  return (end != text && value >= 0) ? value : fallback;
}

static int cpu_count() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

Pool& Pool::get() {
  // Never destroyed: workers are detached and may be asleep at exit.
  static Pool* pool = new Pool(static_cast<int>(env_int("TRANSMUTER_JAX_KERNEL_THREADS",
                                                        cpu_count())),
                               env_int("TRANSMUTER_JAX_KERNEL_SPIN_US", 200),
                               env_size("TRANSMUTER_JAX_KERNEL_AHEAD_KB", 256) << 10);
  return *pool;
}

}  // namespace tj


// One job's blocks (a GEMM's column blocks, an attention's rows) on two threads: the caller's and a
// helper that borrows an idle core.
//
// Why: on a 2-core machine the worker runs one intra-op thread and leaves the other core to the
// scheduler and the front, which are asleep most of a step. The AMX GEMMs (cpu_amx.cpp) take a
// third of a step there, and a second thread runs them at full speed beside the first (the
// kernel is bound by tile loads, not by the tile unit); the few-row kernels (cpu_gemm.cpp) are
// bound by the weights' stream, which a second core's loads widen. So the helper takes column
// blocks of the same GEMM while that core is free, and rows of the decode attention
// (cpu_attn.cpp). (MKL's and oneDNN's GEMMs past the few rows do not gain from it:
// docs/decisions/cpu.md.)
//
// Protocol (invariants):
// - A job is published by bumping the generation in the high half of `state`; its low half counts
//   the blocks claimed. Either thread claims a block with a compare-and-swap that also checks the
//   generation, so a helper that wakes late can never claim a block of a later job.
// - The caller never waits for a block nobody has claimed: if the helper is off the CPU (the
//   scheduler or the front holds the core), the caller runs every block itself. It waits only
//   while the helper is inside a block of this job (`active` holds that job's generation).
// - Each output column belongs to one block and each block runs whole on one thread, with the
//   same order of sums as on one thread: the result does not depend on the split.
// - The helper spins (yielding the core) for a while after each job, since a step's GEMMs come
//   tens of microseconds apart, then sleeps on a futex until the next job.
// - A helper taken off the CPU inside a block makes the caller wait a time slice. When a wait runs
//   that long (the core is busy with other work), the caller runs alone for QUIET before it asks
//   for help again: on a busy machine the split costs at most one late wait per QUIET.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <thread>

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace tandem_split {

using Block = void (*)(const void* job, int64_t block);

namespace {

using Clock = std::chrono::steady_clock;
constexpr auto SPIN = std::chrono::microseconds(300);  // helper's spin after a job, before it sleeps
constexpr auto LATE = std::chrono::microseconds(1000);  // a wait past this: the helper lost its core
constexpr auto QUIET = std::chrono::milliseconds(50);  // then the caller runs alone this long

std::atomic<uint64_t> state{0};   // generation << 32 | blocks claimed
std::atomic<uint32_t> active{0};  // the generation whose block the helper is running, else 0
std::atomic<uint32_t> wake{0};    // futex word: bumped with each job
std::atomic<int> sleeping{0};
std::atomic<bool> enabled{false};
std::atomic_flag in_run = ATOMIC_FLAG_INIT;  // one caller at a time; another runs its job alone
// Written before a job's generation is published (relaxed: `state` orders them).
std::atomic<const void*> job_ptr{nullptr};
std::atomic<Block> job_fn{nullptr};
std::atomic<int64_t> job_blocks{0};
uint32_t generation = 0;  // guarded by in_run
Clock::time_point alone_until{};  // guarded by in_run

// The next block of generation `gen`, or -1 when none is left or a later job began.
int64_t claim(uint32_t gen, int64_t blocks) {
  uint64_t s = state.load();
  while ((s >> 32) == gen && static_cast<int64_t>(s & 0xffffffffu) < blocks) {
    if (state.compare_exchange_weak(s, s + 1)) return static_cast<int64_t>(s & 0xffffffffu);
  }
  return -1;
}

void futex_wait(std::atomic<uint32_t>* word, uint32_t seen) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, seen, nullptr, nullptr, 0);
}

void futex_wake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
}

void helper() {
  uint32_t done = 0;  // the last generation this thread worked on
  for (;;) {
    const auto until = Clock::now() + SPIN;
    uint64_t s = state.load();
    while ((s >> 32) == done) {
      if (Clock::now() > until) {
        const uint32_t seen = wake.load();
        sleeping.store(1);
        if ((state.load() >> 32) == done) futex_wait(&wake, seen);
        sleeping.store(0);
      } else {
        sched_yield();  // the core stays the scheduler's and the front's whenever they want it
      }
      s = state.load();
    }
    const uint32_t gen = static_cast<uint32_t>(s >> 32);
    active.store(gen);
    // the job's fields were written before its generation: read them only once a claim succeeds
    for (int64_t b; (b = claim(gen, job_blocks.load(std::memory_order_relaxed))) >= 0;) {
      job_fn.load(std::memory_order_relaxed)(job_ptr.load(std::memory_order_relaxed), b);
    }
    active.store(0);
    done = gen;
  }
}

// Whether this call may ask for help; true holds in_run until run() clears it.
bool may_share(int64_t blocks) {
  if (!enabled.load(std::memory_order_relaxed) || blocks < 2 || in_run.test_and_set()) return false;
  if (Clock::now() < alone_until) {
    in_run.clear();
    return false;
  }
  return true;
}

}  // namespace

// Runs fn(job, b) for every b in [0, blocks): on this thread, and on the helper where enabled.
void run(const void* job, Block fn, int64_t blocks) {
  if (!may_share(blocks)) {
    for (int64_t b = 0; b < blocks; ++b) fn(job, b);
    return;
  }
  job_ptr.store(job, std::memory_order_relaxed);
  job_fn.store(fn, std::memory_order_relaxed);
  job_blocks.store(blocks, std::memory_order_relaxed);
  if (++generation == 0) ++generation;  // 0 is `active`'s "none"
  const uint32_t gen = generation;
  state.store(static_cast<uint64_t>(gen) << 32);
  wake.fetch_add(1);
  if (sleeping.load()) futex_wake(&wake);
  for (int64_t b; (b = claim(gen, blocks)) >= 0;) fn(job, b);
  if (active.load() == gen) {
    const auto start = Clock::now();
    while (active.load() == gen) {
      __builtin_ia32_pause();
    }
    const auto now = Clock::now();
    if (now - start > LATE) alone_until = now + QUIET;
  }
  in_run.clear();
}

// Whether a helper takes blocks: where it does not, a caller may do better with one call.
bool shared() { return enabled.load(std::memory_order_relaxed); }

// Two threads from now on (n >= 2), or the caller's alone (n <= 1). The helper starts once.
void set_threads(int n) {
  static std::once_flag started;
  if (n >= 2) std::call_once(started, [] { std::thread(helper).detach(); });
  enabled.store(n >= 2);
}

}  // namespace tandem_split

// Called by the worker at load (cpu_ops.load_library's caller): 2 lends the GEMMs the idle core.
extern "C" void tandem_cpu_gemm_threads(int n) { tandem_split::set_threads(n); }

// Runtime and work sharing: keeping MLX's CPU worker awake through a call, a kernel's work in parts run by the
// worker and by a waiting caller, and how a call waits.
#pragma once

#include "common.h"

namespace {

// ---- keeping MLX's CPU worker awake through a call's dispatch ---------------------------------------------------
//
// MLX runs CPU work on a worker thread that sleeps whenever its queue is empty, and on a VM a sleeping thread
// takes ~10-30 us to wake (and its waker a syscall). A call opens a hold (`hold`, evaluated first: it wakes the
// worker while the caller still prepares the call) and closes it once everything is queued (`release`). While a
// hold is open the worker polls instead of sleeping: the hold task until the first native primitive is queued,
// and each native task, when done, until another is queued after it -- so the worker starts on the first task
// at once and keeps up while the caller queues the rest. Every poll is bounded by the hold's max_us.

std::atomic<uint64_t> g_holds{0};       // holds opened
std::atomic<uint64_t> g_released{0};    // holds closed: all of them when it equals g_holds
std::atomic<uint64_t> g_queued{0};      // native tasks queued
std::atomic<double> g_hold_us{0.0};

// Poll until done() or max_us have passed; whether done() held. Each round yields the core (sched_yield: at once
// back when nothing else is runnable): on a loaded machine a poller that only paused would hold the core that
// MLX's worker -- the thread it waits for -- needs (measured: a B = 1 call 3x slower beside one busy process).
template <class F>
bool poll(F done, double max_us) {
  const auto start = std::chrono::steady_clock::now();
  while (!done()) {
    if (std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() > max_us) {
      return false;
    }
    std::this_thread::yield();
  }
  return true;
}

bool holding() {
  return g_released.load(std::memory_order_acquire) < g_holds.load(std::memory_order_acquire);
}

// On the worker: while a hold is open and no native task was queued after the `seen`-th, poll.
void linger(uint64_t seen) {
  if (holding()) {
    poll([seen] { return !holding() || g_queued.load(std::memory_order_acquire) != seen; },
         g_hold_us.load(std::memory_order_relaxed));
  }
}

// Queue a native task on MLX's CPU stream: `work`, then its linger. The count moves only once the task is in the
// queue, so a worker that sees it move finds the task there.
template <class F>
void dispatch(mx::cpu::CommandEncoder& encoder, F work) {
  const uint64_t seq = g_queued.load(std::memory_order_acquire) + 1;
  encoder.dispatch([seq, work = std::move(work)]() mutable {
    work();
    linger(seq);
  });
  g_queued.fetch_add(1, std::memory_order_acq_rel);
}

// Close every hold (the call is dispatched, or failed before its dispatch).
void release() {
  g_released.store(g_holds.load(std::memory_order_acquire), std::memory_order_release);
}

// ---- the waiting caller's help: a kernel's work in parts, run by MLX's worker and by whoever waits for it -------
//
// While a call runs, its caller polls in spin_wait for the result: a core doing nothing. A kernel hands its work
// to `split(n, part)`: parts 0..n-1, each taken by the first thread to claim it -- MLX's worker, which opened
// them, and any caller polling meanwhile (`help`, between polls). The worker returns once every part is done. A
// caller that is not there (mx.async_eval, a single core) costs nothing: the worker takes every part itself.
// Parts write disjoint outputs; a reduction keeps one partial per part and combines them in part order, so a
// result never depends on which thread ran which part (or on whether anyone helped). Inside a part `split` runs
// its parts in place (one level of parts at a time: a batch's rows, or a row's spans).

struct Parts {
  std::atomic<uint64_t> gen{0};           // odd while parts are open
  std::atomic<int> helpers{0};            // helpers that saw them open and may still be claiming
  std::atomic<int64_t> next{0}, done{0};
  std::atomic<bool> busy{false};          // a worker owns the slot (another stream's splits run in place)
  int64_t n = 0;
  void (*call)(void*, int64_t) = nullptr;
  void* ctx = nullptr;
  std::exception_ptr error;
  std::atomic<bool> failed{false};
};
Parts g_parts;
thread_local bool t_in_part = false;
std::atomic<uint64_t> g_helped{0};        // parts a waiting caller ran (diagnostics: `helped()`)
std::atomic<double> g_parts_wait_us{0.0};  // (tests: how long a worker waits for a helper to take the first part)

// Claim and run open parts until none is left; how many this thread ran.
int64_t run_parts(Parts& p) {
  t_in_part = true;
  int64_t ran = 0;
  for (int64_t c; (c = p.next.fetch_add(1, std::memory_order_acq_rel)) < p.n; ++ran) {
    try {
      p.call(p.ctx, c);
    } catch (...) {
      if (!p.failed.exchange(true)) p.error = std::current_exception();
    }
    p.done.fetch_add(1, std::memory_order_acq_rel);
  }
  t_in_part = false;
  return ran;
}

template <class F>
void split(int64_t n, F&& part) {
  Parts& p = g_parts;
  if (n <= 1 || t_in_part || p.busy.exchange(true, std::memory_order_acquire)) {
    for (int64_t c = 0; c < n; ++c) part(c);
    return;
  }
  p.n = n;
  p.next.store(0, std::memory_order_relaxed);
  p.done.store(0, std::memory_order_relaxed);
  p.ctx = &part;
  p.call = [](void* f, int64_t c) { (*static_cast<std::remove_reference_t<F>*>(f))(c); };
  p.failed.store(false, std::memory_order_relaxed);
  p.error = nullptr;
  p.gen.fetch_add(1, std::memory_order_seq_cst);          // open
  const double wait = g_parts_wait_us.load(std::memory_order_relaxed);
  if (wait > 0) poll([&p] { return p.next.load(std::memory_order_acquire) > 0; }, wait);
  run_parts(p);
  // (a helper finishing its last part: microseconds; yielding, so that a helper preempted on a loaded machine
  // gets the core back)
  while (p.done.load(std::memory_order_acquire) < n) std::this_thread::yield();
  p.gen.fetch_add(1, std::memory_order_seq_cst);          // closed: no helper starts claiming from here on
  while (p.helpers.load(std::memory_order_seq_cst) != 0) std::this_thread::yield();
  std::exception_ptr error = p.failed.load() ? p.error : nullptr;
  p.busy.store(false, std::memory_order_release);
  if (error) std::rethrow_exception(error);
}

// On a waiting caller: take open parts, if any; whether it ran one.
bool help() {
  Parts& p = g_parts;
  const uint64_t g = p.gen.load(std::memory_order_seq_cst);
  if (!(g & 1) || t_in_part) return false;
  p.helpers.fetch_add(1, std::memory_order_seq_cst);
  int64_t ran = 0;
  if (p.gen.load(std::memory_order_seq_cst) == g) ran = run_parts(p);   // (still the parts seen open: set)
  p.helpers.fetch_sub(1, std::memory_order_seq_cst);
  g_helped.fetch_add(ran, std::memory_order_relaxed);
  return ran > 0;
}

// Spans of a vocabulary pass: fixed (multiples of 64, so of the 64-token blocks), whoever runs them
constexpr int64_t kSpan = 16384;
inline int64_t spans(int64_t n) { return (n + kSpan - 1) / kSpan; }

// f(lo, hi) over [0, n) in spans
template <class F>
void each_span(int64_t n, F f) {
  split(spans(n), [&](int64_t c) { f(c * kSpan, std::min(n, (c + 1) * kSpan)); });
}

// f(lo, hi) for each span of [0, n), in parts: the results in span order (a reduction combines them so)
template <class T, class F>
std::vector<T> per_span(int64_t n, F f) {
  std::vector<T> out(spans(n));
  split(spans(n), [&](int64_t c) { out[c] = f(c * kSpan, std::min(n, (c + 1) * kSpan)); });
  return out;
}

// The sum of f(lo, hi) over [0, n)'s spans, in span order
template <class F>
double sum_spans(int64_t n, F f) {
  double total = 0.0;
  for (double part : per_span<double>(n, f)) total += part;
  return total;
}

// The hold (above): an array whose evaluation polls while the hold is open and no native task was queued after
// it.
class Hold : public mx::Primitive {
 public:
  Hold(mx::Stream stream, uint64_t seen) : mx::Primitive(stream), seen_(seen) {}

  void eval_cpu(const std::vector<mx::array>&, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_output_array(out);
    encoder.dispatch([seen = seen_, out = mx::array::unsafe_weak_copy(out)]() mutable {
      linger(seen);
      *out.data<uint32_t>() = 0;
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("samplec_native.hold runs on the CPU only");
  }

  const char* name() const override {
    return "SamplecHold";
  }

  bool is_equivalent(const mx::Primitive&) const override {
    return false;
  }

 private:
  uint64_t seen_;
};

mx::array hold(double max_us) {
  auto stream = mx::default_stream(mx::Device::cpu);
  g_hold_us.store(max_us, std::memory_order_relaxed);
  g_holds.fetch_add(1, std::memory_order_acq_rel);
  return mx::array({}, mx::uint32, std::make_shared<Hold>(stream, g_queued.load(std::memory_order_acquire)), {});
}

// Wait for arrays being evaluated (mx.async_eval) by polling for up to `spin_us` microseconds before blocking.
// Meanwhile it takes the kernels' open parts (`help`); the time it helped does not count as polling.
void spin_wait(const std::vector<mx::array>& arrays, double spin_us) {
  auto start = std::chrono::steady_clock::now();
  for (const auto& a : arrays) {
    while (true) {
      const double spent =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
      bool helped = false;
      poll([&a, &helped] { return (helped = help()) || a.is_available(); }, spin_us - spent);
      if (!helped) break;
      start = std::chrono::steady_clock::now();
    }
    const_cast<mx::array&>(a).wait();
  }
}

// A call's start and end in one step each: open a hold and queue it; queue the call's arrays, close the hold and
// wait (polling first).
void wake(double max_us) {
  mx::async_eval({hold(max_us)});
}

void evaluate(const std::vector<mx::array>& arrays, double spin_us) {
  try {
    mx::async_eval(arrays);
  } catch (...) {
    release();
    throw;
  }
  release();
  spin_wait(arrays, spin_us);
}

}  // namespace

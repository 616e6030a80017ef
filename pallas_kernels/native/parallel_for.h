// ParallelFor and Team for the native CPU kernels (matmul.cc, paged_attention.cc, decoder_layer.cc).
// ParallelFor runs fn(0..n-1) on the caller and on XLA's intra-op thread pool. Include after
// "xla/ffi/api/ffi.h".
//
// Each runner walks its own contiguous share of the indices from the front, then takes what is
// left of the others' shares from their back. A runner's indices stay in order, so it reads one
// memory stream and its prefetches run on from one task into the next (with a shared counter two
// threads took alternate tasks and every task started cold); a helper that starts late loses
// its tail to the others. The caller is usually not a pool thread (XLA runs the custom call on
// the thread that launched the step), so pool.num_threads() runners keep one per core: faster
// than one helper per pool thread for the packed matmul. Contiguous shares instead of a shared
// counter made the layer matmuls faster at every row count measured; for decode attention they
// are the same within the noise on contiguous pages, and on scattered pages they let a task
// prefetch the next task's first block (decode_attention.h, Prefetcher). The measurements are in
// docs/performance.md.
#ifndef JSERVE_PARALLEL_FOR_H_
#define JSERVE_PARALLEL_FOR_H_

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

namespace jserve_native {

// Runner r's share of n indices over `runners`: (front << 32) | back.
inline void ShareOut(std::atomic<uint64_t>* shares, int64_t runners, int64_t n) {
  for (int64_t r = 0; r < runners; ++r) {
    const uint64_t front = n * r / runners, back = n * (r + 1) / runners;
    shares[r].store((front << 32) | back);
  }
}

// The front (own share) or back index of a share; -1 once it is empty.
inline int64_t Claim(std::atomic<uint64_t>& share, bool front) {
  uint64_t v = share.load();
  while (true) {
    const uint64_t f = v >> 32, b = v & 0xffffffffu;
    if (f >= b) return -1;
    const uint64_t next = front ? ((f + 1) << 32) | b : (f << 32) | (b - 1);
    if (share.compare_exchange_weak(v, next)) return static_cast<int64_t>(front ? f : b - 1);
  }
}

// fn over runner id's own share from the front, then the others' from their back; how many ran.
template <typename F>
int64_t RunShares(std::atomic<uint64_t>* shares, int64_t runners, int64_t id, F& fn) {
  int64_t ran = 0;
  for (int64_t i = Claim(shares[id], true); i >= 0; i = Claim(shares[id], true), ++ran) fn(i);
  for (int64_t o = 1; o < runners; ++o) {
    auto& other = shares[(id + o) % runners];
    for (int64_t i = Claim(other, false); i >= 0; i = Claim(other, false), ++ran) fn(i);
  }
  return ran;
}

// fn(i) for i in 0..n-1; each index once, on some runner; returns when all are done.
template <typename F>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, F fn) {
  const int64_t runners = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), n));
  struct State {
    explicit State(int64_t r) : shares(r) {}
    std::vector<std::atomic<uint64_t>> shares;  // (front << 32) | back, per runner
    std::atomic<int64_t> ids{1};
    std::atomic<int64_t> active{0};
  };
  auto state = std::make_shared<State>(runners);
  ShareOut(state->shares.data(), runners, n);
  auto shared_fn = std::make_shared<F>(std::move(fn));
  auto run = [state, shared_fn, runners](int64_t id) {
    state->active.fetch_add(1);
    RunShares(state->shares.data(), runners, id, *shared_fn);
    state->active.fetch_sub(1);
  };
  for (int64_t h = 1; h < runners; ++h) {
    pool.Schedule([state, run]() { run(state->ids.fetch_add(1)); });
  }
  run(0);
  while (state->active.load() > 0) std::this_thread::yield();
}

// A team for work in phases, one call: body(member) runs on the caller and on up to
// pool.num_threads() - 1 helpers; each member calls member.For(n, fn) for the same phases (at
// most `phases`) in the same order, and every For returns once all n items of its phase are done
// (by whichever members), so a phase may read what the one before wrote. The helpers are
// scheduled once and wait for the next phase spinning (within the call, where nothing else
// runs); a helper that starts late joins the phase the others are in, and one that starts after
// the caller is done runs nothing. For shares items like ParallelFor: contiguous shares, then
// stealing from the back. The body must do all its work inside For: a late helper runs the rest
// of it too.
class TeamMember;

class Team {
 public:
  template <typename Body>
  static void Run(xla::ffi::ThreadPool& pool, int64_t phases, Body body) {
    // Spinning members need a CPU each: no more than the process may run on (a pool can have
    // more threads, e.g. with several XLA CPU devices in one process).
    const int64_t members = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), Cpus()));
    auto team = std::make_shared<Team>(members, phases);
    auto shared_body = std::make_shared<Body>(std::move(body));
    for (int64_t h = 1; h < members; ++h) {
      pool.Schedule([team, shared_body]() {
        team->active_.fetch_add(1);
        if (!team->closed_.load()) team->Join(*shared_body, team->ids_.fetch_add(1));
        team->active_.fetch_sub(1);
      });
    }
    team->Join(*shared_body, 0);
    team->closed_.store(true);
    while (team->active_.load() > 0) std::this_thread::yield();
  }

  static int64_t Cpus() {
    static const int64_t cpus = [] {
      cpu_set_t set;
      if (sched_getaffinity(0, sizeof set, &set) == 0) return static_cast<int64_t>(CPU_COUNT(&set));
      return static_cast<int64_t>(std::max(1u, std::thread::hardware_concurrency()));
    }();
    return cpus;
  }

  Team(int64_t members, int64_t phases)
      : members_(members), num_phases_(phases), phases_(new Phase[phases]),
        shares_(new std::atomic<uint64_t>[phases * members]) {}

 private:
  friend class TeamMember;
  struct Phase {
    std::atomic<int> state{0};  // 0 new, 1 being shared out, 2 ready
    std::atomic<int64_t> done{0};
  };

  template <typename Body>
  void Join(Body& body, int64_t id);

  const int64_t members_;
  const int64_t num_phases_;
  std::unique_ptr<Phase[]> phases_;
  std::unique_ptr<std::atomic<uint64_t>[]> shares_;  // [phase][member]: (front << 32) | back
  std::atomic<int64_t> ids_{1}, active_{0};
  std::atomic<bool> closed_{false};
};

class TeamMember {
 public:
  TeamMember(Team& team, int64_t id) : team_(team), id_(id) {}
  int64_t id() const { return id_; }

  // fn(0..n-1) over the team; returns when all are done.
  template <typename F>
  void For(int64_t n, F fn) {
    if (next_ >= team_.num_phases_) {  // a body that runs more phases than it declared: a bug
      std::fprintf(stderr, "jserve Team: phase %d of %lld declared\n", next_ + 1,
                   static_cast<long long>(team_.num_phases_));
      std::abort();
    }
    Team::Phase& phase = team_.phases_[next_];
    const int64_t members = team_.members_;
    std::atomic<uint64_t>* shares = team_.shares_.get() + next_++ * members;
    int fresh = 0;
    if (phase.state.compare_exchange_strong(fresh, 1)) {
      ShareOut(shares, members, n);
      phase.state.store(2);
    }
    SpinUntil([&phase] { return phase.state.load() == 2; });
    const int64_t ran = RunShares(shares, members, id_ % members, fn);
    if (ran) phase.done.fetch_add(ran);
    SpinUntil([&phase, n] { return phase.done.load() >= n; });
  }

 private:
  // Spins, then yields: a member the OS has descheduled gets its CPU back sooner.
  template <typename Done>
  static void SpinUntil(Done done) {
    for (int spins = 0; !done();) {
      if (spins < 4096) {
        ++spins;
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
      } else {
        std::this_thread::yield();
      }
    }
  }
  Team& team_;
  int64_t id_;
  int next_ = 0;
};

template <typename Body>
void Team::Join(Body& body, int64_t id) {
  TeamMember member(*this, id);
  body(member);
}

}  // namespace jserve_native

#endif  // JSERVE_PARALLEL_FOR_H_

"""Completion times stamped in C++, on the thread that completes a call: a small torch extension.

A call nobody waits on (DDP's buckets, ZeRO's and FSDP's overlapped calls) has its end stamped by the
recorder's poller thread (``commgate.run.recorder.Poller``), which the issue of every call wakes: on two
busy cores that wake, and the poller's turn on the GIL, cost a gloo all-reduce about as much again as the
call itself (``benchmarks/capture_cost.py``). Gloo completes a work's future on its own worker thread, so a
C++ callback on that future (``watch``) stamps the end exactly, with no Python and no GIL; the recorder
reads the stamp (``stamp``) when it next looks, and wakes no thread. Gloo's point-to-point and
reduce-scatter works have no future (torch 2.13) and complete in their ``wait()``: ``watch`` says so, and the
recorder hands such a work back in the extension's wrapper (``stamped``), whose wait stamps the end in C++ as it
returns (a Python subclass of ``Work`` cost a reduce-scatter x1.08-1.14 of its bare host time with calls 5 ms
apart, the wrapper x1.00-1.07: ``benchmarks/capture_cost.py --gap-us 5000``). NCCL's future completes when the
call is enqueued, not when it ends: the interposer watches only gloo's works here.

The same extension holds the allocator an emulated rank computes with (``reuse_memory``, installed by
``commgate.run.emulate.reuse_memory``): one build serves both.

The extension is built with torch's own JIT build, once per environment, into commgate's extension
directory (``commgate.run.extensions``), by the ranks' forkserver as it starts (``build``; every rank
inherits it); elsewhere (a job under its own launcher) it is used if it was built (``loaded``), else the
poller does all the stamping.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import os
import sys
from pathlib import Path
from types import ModuleType

import torch

from commgate.core import env

SOURCE = r"""
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <atomic>
#include <time.h>

namespace {
constexpr int64_t kSlots = 1 << 16;
std::atomic<int64_t> stamps[kSlots];
std::atomic<int64_t> owners[kSlots];

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);  // Python's perf_counter_ns on Linux
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// `token`'s slot, made its own and marked running (a later call's token takes it over: `stamp` then says so).
int64_t claim(int64_t token) {
  const int64_t slot = token & (kSlots - 1);
  stamps[slot].store(-1, std::memory_order_relaxed);
  owners[slot].store(token, std::memory_order_release);
  return slot;
}
}  // namespace

// Stamp `token` when `work`'s future completes (at once if it has), on the thread that completes it; -3
// where it completes with an error (a failed call did not complete). False when the work has no future.
bool watch(c10d::Work& work, int64_t token) {
  c10::intrusive_ptr<c10::ivalue::Future> future;
  try {
    future = work.getFuture();
  } catch (const std::exception&) {
    return false;
  }
  if (!future) return false;
  const int64_t slot = claim(token);
  future->addCallback([token, slot](c10::ivalue::Future& done) {
    const int64_t at = done.hasError() ? -3 : now_ns();
    if (owners[slot].load(std::memory_order_acquire) == token) stamps[slot].store(at, std::memory_order_release);
  });
  return true;
}

namespace {
// A work without a future (gloo's send, recv and reduce-scatter, which complete in their wait), passed through,
// `token` stamped when its wait returns or it says it completed: the first time, on the thread that sees it. A
// wait that throws (a failed call) stamps nothing: the call stays open.
class Stamped : public c10d::Work {
 public:
  Stamped(c10::intrusive_ptr<c10d::Work> inner, int64_t token)
      : c10d::Work(-1, inner->retrieveOpType()), inner_(std::move(inner)), token_(token), slot_(claim(token)) {}
  bool wait(std::chrono::milliseconds timeout) override {
    const bool ok = inner_->wait(timeout);
    mark();
    return ok;
  }
  bool isCompleted() override {
    const bool done = inner_->isCompleted();
    if (done) mark();
    return done;
  }
  bool isSuccess() const override { return inner_->isSuccess(); }
  std::exception_ptr exception() const override { return inner_->exception(); }
  int sourceRank() const override { return inner_->sourceRank(); }
  std::vector<at::Tensor> result() override { return inner_->result(); }
  void synchronize() override { inner_->synchronize(); }
  void blockCurrentStream() override { inner_->blockCurrentStream(); }
  void abort() override { inner_->abort(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return inner_->getFuture(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFutureResult() override { return inner_->getFutureResult(); }
  float getDuration() const override { return inner_->getDuration(); }
  uint64_t getSequencenumber() const override { return inner_->getSequencenumber(); }

 private:
  void mark() {
    int64_t running = -1;
    if (owners[slot_].load(std::memory_order_acquire) == token_)
      stamps[slot_].compare_exchange_strong(running, now_ns(), std::memory_order_acq_rel);
  }
  c10::intrusive_ptr<c10d::Work> inner_;
  const int64_t token_, slot_;
};
}  // namespace

// `work` (one without a future) handed back wrapped, so that its wait stamps `token` (see Stamped).
c10::intrusive_ptr<c10d::Work> stamped(const c10::intrusive_ptr<c10d::Work>& work, int64_t token) {
  return c10::make_intrusive<Stamped>(work, token);
}

// `token`'s completion (CLOCK_MONOTONIC ns); -1 while its call runs; -2 once its slot went to a later call;
// -3 when its call failed.
int64_t stamp(int64_t token) {
  const int64_t slot = token & (kSlots - 1);
  if (owners[slot].load(std::memory_order_acquire) != token) return -2;
  return stamps[slot].load(std::memory_order_acquire);
}

// --- Freed large blocks kept for reuse (an emulated rank's CPU allocator: commgate.run.emulate.reuse_memory) ---
#include <c10/core/CPUAllocator.h>
#include <sys/mman.h>
#include <list>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {
// Allocations of at least `min_bytes` are mapped here and, once freed, kept by exact size for the next request
// of that size: glibc maps each one afresh and unmaps it when freed, so that the kernel zeroes every page of
// it again at its first touch. Never more is mapped (live and kept together) than the most the rank's large
// allocations ever held live at once: a new mapping first unmaps the blocks kept longest.
struct Keep final : c10::Allocator {
  struct Block {
    void* ptr;
    size_t size;
  };
  c10::Allocator* inner = nullptr;
  size_t min_bytes = SIZE_MAX, live = 0, kept = 0, peak = 0;
  int64_t hits = 0, maps = 0, unmaps = 0;
  std::mutex mu;
  std::list<Block> order;  // kept blocks, the longest kept first
  std::unordered_map<size_t, std::vector<std::list<Block>::iterator>> by_size;
  std::unordered_map<void*, size_t> sizes;  // live blocks

  c10::DataPtr allocate(size_t n) override {
    if (n < min_bytes) return inner->allocate(n);
    const size_t size = (n + 4095) & ~size_t(4095);
    void* p = nullptr;
    std::vector<Block> out;
    {
      std::lock_guard<std::mutex> guard(mu);
      auto it = by_size.find(size);
      if (it != by_size.end() && !it->second.empty()) {
        auto b = it->second.back();
        it->second.pop_back();
        p = b->ptr;
        order.erase(b);
        kept -= size;
        hits++;
      } else {
        peak = std::max(peak, live + size);
        while (!order.empty() && live + kept + size > peak) out.push_back(take_oldest());
      }
      if (p) live += size;
    }
    for (auto& b : out) munmap(b.ptr, b.size);
    if (!p) {
      p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) {  // every kept block given back, then once more
        {
          std::lock_guard<std::mutex> guard(mu);
          while (!order.empty()) out.push_back(take_oldest());
        }
        for (auto& b : out) munmap(b.ptr, b.size);
        p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      }
      TORCH_CHECK(p != MAP_FAILED, "commgate's emulated rank: not enough memory: you tried to allocate ", n, " bytes");
      std::lock_guard<std::mutex> guard(mu);
      live += size;
      maps++;
    }
    {
      std::lock_guard<std::mutex> guard(mu);
      sizes[p] = size;
    }
    return {p, p, &release, c10::Device(c10::DeviceType::CPU)};
  }
  Block take_oldest() {  // under mu
    Block b = order.front();
    auto& same = by_size[b.size];
    for (auto i = same.begin(); i != same.end(); ++i)
      if ((*i)->ptr == b.ptr) {
        same.erase(i);
        break;
      }
    order.pop_front();
    kept -= b.size;
    unmaps++;
    return b;
  }
  static void release(void* p);
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};
Keep keep;

void Keep::release(void* p) {
  {
    std::lock_guard<std::mutex> guard(keep.mu);
    auto it = keep.sizes.find(p);
    if (it != keep.sizes.end()) {
      const size_t size = it->second;
      keep.sizes.erase(it);
      keep.order.push_back({p, size});
      keep.by_size[size].push_back(std::prev(keep.order.end()));
      keep.live -= size;
      keep.kept += size;
      return;
    }
  }
  keep.inner->raw_deleter()(p);  // the inner allocator's block, freed raw (raw_deallocate): its own deleter
}
}  // namespace

// From now on this process's CPU tensors of at least `min_bytes` are mapped by `keep` (above); once only.
void reuse_memory(int64_t min_bytes) {
  std::lock_guard<std::mutex> guard(keep.mu);
  if (keep.inner != nullptr) return;
  keep.inner = c10::GetCPUAllocator();
  keep.min_bytes = size_t(min_bytes);
  c10::SetCPUAllocator(&keep, /*priority=*/UINT8_MAX);
}

// hits, new mappings, unmapped kept blocks, bytes live, bytes kept, the most bytes live at once.
std::vector<int64_t> reuse_stats() {
  std::lock_guard<std::mutex> guard(keep.mu);
  return {keep.hits, keep.maps, keep.unmaps, int64_t(keep.live), int64_t(keep.kept), int64_t(keep.peak)};
}
"""

OFF = "COMMGATE_STAMPS"
"""``COMMGATE_STAMPS=0`` (or false, no, off): neither build nor load the extension (the poller stamps every
call)."""

RUNNING, REUSED, FAILED = -1, -2, -3
"""``stamp``'s answers other than a time."""

NAME = "commgate_stamps_" + hashlib.sha256((SOURCE + torch.__version__).encode()).hexdigest()[:10]
"""The extension's name: a new source or torch is a new build, never an old one loaded."""

_MODULE: ModuleType | None = None
TOKENS = itertools.count()
"""The tokens the extension's ``watch`` is given (``commgate.run.recorder``): one sequence for the whole process,
so that several recorders (tests, benchmarks) share the extension's slots."""


def _built(root: Path) -> Path | None:
    so = root / NAME / f"{NAME}.so"
    return so if so.is_file() else None


def build() -> ModuleType | None:
    """Build (once per environment) and load the extension; None where it cannot be built (no compiler:
    the poller stamps everything), with the reason on stderr."""
    global _MODULE
    if not env.switch(OFF, True):
        return None
    from commgate.run.extensions import own_ninja, use_environment_dir

    root = use_environment_dir()
    if loaded() is not None:  # loaded as built: torch's build would rebuild a copied directory
        return _MODULE
    try:
        from torch.utils.cpp_extension import load_inline

        with own_ninja():
            _MODULE = load_inline(  # type: ignore[no-untyped-call]
                NAME,
                cpp_sources=[SOURCE],
                functions=["watch", "stamped", "stamp", "reuse_memory", "reuse_stats"],
                extra_cflags=["-O2"],
            )
    except Exception as exc:  # a missing compiler or a failed build: the capture works without it
        why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        print(f"commgate: completion stamps not built in {root} ({why}); the poller stamps every call", file=sys.stderr)
        return None
    return _MODULE


def loaded() -> ModuleType | None:
    """The extension if this process has it, or can load it already built; never builds."""
    global _MODULE
    if not env.switch(OFF, True):
        return None
    if _MODULE is not None:
        return _MODULE
    from commgate.run.extensions import ENV, environment_dir

    so = _built(Path(os.environ.get(ENV) or environment_dir()))
    if so is not None:
        _MODULE = _load(so)
    return _MODULE


def _load(so: Path) -> ModuleType | None:
    """The built extension loaded (torch's libraries, which it links against, are loaded already); None, said
    on stderr, when it does not load."""
    try:
        spec = importlib.util.spec_from_file_location(NAME, so)
        assert spec is not None and spec.loader is not None, so
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError, AssertionError) as exc:
        print(f"commgate: {so} does not load ({exc}); the poller stamps every call", file=sys.stderr)
        return None
    return module

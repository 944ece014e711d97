// The ops' large CPU outputs: whole 2 MiB pages, advised as transparent huge pages, reused.
//
// An output of a few MiB from at::empty comes from glibc's heap or a fresh mmap, depending on
// what the process freed before; when it is fresh, the kernel's first write to each 4 KiB page
// faults. The packed GEMM makes that worse: its two threads write the two halves of every row
// (docs/inference-shapes.md section 13), so both fault on every page of the output, and a
// 1024 x 768 float32 output took ~1300 faults a call where torch's took 769. Measured with
// every large allocation a fresh mmap (2 threads, Intel Xeon, against F.linear with its own
// fresh output, M = 1024): 768 x 768 0.87x, 1376 x 512 0.92x, 512 x 512 0.81x. A model's
// forward meets that state often: a converted BERT-style encoder at batch 8 took 5,000-7,600
// faults a forward, two thirds of them in the writes of its 3072-wide GELU layer.
//
// So an output of min_bytes or more is a block of whole 2 MiB pages (a 2.1 MB output takes
// 4 MiB of address space, of which it touches what it uses), aligned on them and advised as
// huge pages (one fault per 2 MiB where the kernel grants them, fewer TLB misses for the
// kernels' column-strip writes), and when the tensor is freed its block is kept here for the
// next output of the same size (the last freed first): in a model's steady state no output
// faults at all. Same measurement: 1.10x, 1.22x, 1.23x; with glibc reusing its heap, pool and
// at::empty within 2% of each other. Converted models at batch 8, 8 alternating rounds in one
// process, best / median forward, at::empty -> pool: LLaMA-style 111 / 117 -> 105 / 116 ms,
// BERT-style 184 / 208 -> 191 / 204, GPT-2 474 / 514 -> 447 / 476 (docs/inference-shapes.md
// section 17: indications, the eager column moves as much between runs).
//
// At most limit_bytes of freed blocks are kept (past the limit they go back to the system when
// freed); release_output_pool() empties it. The storage is an ordinary resizable one whose
// allocator is this pool.

#include "output_pool.h"

#include <ATen/EmptyTensor.h>
#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>

#include <pthread.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace tvm_gemm {
namespace {

constexpr size_t kHugePage = size_t{2} << 20;

struct Block {
  void* data;
  size_t bytes;
};

class OutputPool final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    const size_t bytes = (std::max<size_t>(n, 1) + kHugePage - 1) / kHugePage * kHugePage;
    void* data = take(bytes);
    if (data == nullptr) {
      TORCH_CHECK(posix_memalign(&data, kHugePage, bytes) == 0,
                  "tvm_gemm: out of memory for an output of ", bytes, " bytes");
#ifdef MADV_HUGEPAGE
      (void)madvise(data, bytes, MADV_HUGEPAGE);  // a hint: without THP, plain pages
#endif
    }
    live_bytes_ += static_cast<int64_t>(bytes);
    return {data, new Block{data, bytes}, &OutputPool::release, c10::Device(c10::DeviceType::CPU)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  void configure(size_t min_bytes, size_t limit_bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    min_bytes_ = min_bytes;
    limit_bytes_ = limit_bytes;
    trim(limit_bytes);
  }

  size_t min_bytes() const { return min_bytes_.load(std::memory_order_relaxed); }

  // (in a forked child, whose other threads are gone) The same settings and live outputs,
  // nothing kept, a mutex no one holds.
  OutputPool* fresh_copy() const {
    auto* copy = new OutputPool;
    copy->min_bytes_ = min_bytes_.load();
    copy->limit_bytes_ = limit_bytes_;
    copy->live_bytes_ = live_bytes_.load();
    return copy;
  }

  OutputPoolStats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    OutputPoolStats s;
    s.kept_bytes = static_cast<int64_t>(kept_bytes_);
    s.kept_blocks = static_cast<int64_t>(kept_blocks_);
    s.live_bytes = live_bytes_.load();
    s.min_bytes = static_cast<int64_t>(min_bytes_.load());
    s.limit_bytes = static_cast<int64_t>(limit_bytes_);
    return s;
  }

  void release_all() {
    std::lock_guard<std::mutex> lock(mutex_);
    trim(0);
  }

 private:
  // The last kept block of exactly these bytes (a model asks for the same sizes every
  // forward; the last freed is the likeliest still in cache).
  void* take(size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = kept_.find(bytes);
    if (it == kept_.end() || it->second.empty()) return nullptr;
    void* data = it->second.back();
    it->second.pop_back();
    kept_bytes_ -= bytes;
    --kept_blocks_;
    return data;
  }

  void give_back(Block block) {
    live_bytes_ -= static_cast<int64_t>(block.bytes);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (kept_bytes_ + block.bytes <= limit_bytes_) {
        kept_[block.bytes].push_back(block.data);
        kept_bytes_ += block.bytes;
        ++kept_blocks_;
        return;
      }
    }
    std::free(block.data);
  }

  // (mutex_ held) Frees kept blocks until at most `bytes` are kept.
  void trim(size_t bytes) {
    for (auto& [size, blocks] : kept_) {
      while (!blocks.empty() && kept_bytes_ > bytes) {
        std::free(blocks.back());
        blocks.pop_back();
        kept_bytes_ -= size;
        --kept_blocks_;
      }
    }
  }

  static void release(void* ctx);

  std::mutex mutex_;
  std::unordered_map<size_t, std::vector<void*>> kept_;  // bytes -> blocks, last freed last
  size_t kept_bytes_ = 0;
  size_t kept_blocks_ = 0;
  size_t limit_bytes_ = 0;
  std::atomic<size_t> min_bytes_{0};
  std::atomic<int64_t> live_bytes_{0};
};

std::atomic<OutputPool*> g_pool{nullptr};

// Never destroyed: outputs may be freed during interpreter shutdown, after static destructors.
// A child process forked while another thread held the pool's mutex would wait on it forever:
// the child starts from a fresh pool (the parent's is left as it was, its kept blocks unused).
OutputPool& pool() {
  static std::once_flag once;
  std::call_once(once, [] {
    g_pool.store(new OutputPool);
    pthread_atfork(nullptr, nullptr, [] { g_pool.store(g_pool.load()->fresh_copy()); });
  });
  return *g_pool.load();
}

void OutputPool::release(void* ctx) {
  Block* block = static_cast<Block*>(ctx);
  pool().give_back(*block);
  delete block;
}

}  // namespace

void configure_output_pool(int64_t min_bytes, int64_t limit_bytes) {
  TORCH_CHECK(min_bytes >= 0 && limit_bytes >= 0, "tvm_gemm: output pool sizes must be >= 0");
  pool().configure(static_cast<size_t>(min_bytes), static_cast<size_t>(limit_bytes));
}

at::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  const size_t min_bytes = pool().min_bytes();
  if (min_bytes > 0 && options.device().is_cpu()) {
    const size_t bytes =
        static_cast<size_t>(c10::multiply_integers(sizes)) * options.dtype().itemsize();
    if (bytes >= min_bytes) {
      return at::Tensor(at::detail::empty_generic(sizes, &pool(),
                                                  c10::DispatchKeySet(c10::DispatchKey::CPU),
                                                  c10::typeMetaToScalarType(options.dtype()),
                                                  std::nullopt));
    }
  }
  return at::empty(sizes, options);
}

OutputPoolStats output_pool_stats() { return pool().stats(); }

void release_output_pool() { pool().release_all(); }

}  // namespace tvm_gemm

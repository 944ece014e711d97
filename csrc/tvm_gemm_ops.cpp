// C++ implementations of the tvm_gemm ops: the per-call hot path.
//
// The schemas, fake kernels and autograd formulas live in torch_tvm_gemm/ops/; so does the
// Python implementation that this file mirrors (ops/gemm_ops.py: matmul_impl, linear_impl, gemm).
// What moves here is only what runs on every call: validation, the kernel-table lookup, the
// output allocation and the call into the TVM function. Python still decides *which* kernel a
// call needs (ops/gemm_ops.py gemm_spec) and builds or loads it: on a table miss we call back
// once into Python through the tvm-ffi global function "tvm_gemm.get_kernel" with the call's
// shape, and keep the returned function handle. Our own variant rule below only forms the
// table key (a hit must not enter Python); Python checks that it agrees with gemm_spec's.
//
// Why C++ at all: a Python impl registered with torch.library costs ~6 us per call (the
// dispatcher boxes the arguments and enters the interpreter), more than the whole 16x16 GEMM.
//
// Registration is dynamic (a torch::Library object created by register_impls() and destroyed
// by unregister_impls()) rather than a static TORCH_LIBRARY_IMPL block, so that ops/impls.py can
// switch one process between this path and the Python one (tests and the overhead benchmark
// compare both; TVM_GEMM_PYTHON_IMPL=1 selects Python at import). A static block would
// register the moment the library is loaded and could not be taken back.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "output_pool.h"
#include "parallel_launch.h"
#include "transposed_copy.h"

namespace py = pybind11;

namespace tvm_gemm {
namespace {

// ---------------------------------------------------------------------------------------------
// Configuration handed over by ops/impls.py at registration, so that the constants have one home
// (schedules/cpu.py GEMV_MAX_M, GEMV_MIN_B_ELEMENTS, DOT_MAX_M, DOT2_MAX_M, SWAP_* and KSPLIT_*,
// kernels/gemm.py ACTIVATIONS,
// ops/checks.py SUPPORTED_DTYPES, ops/gemm_ops.py KERNEL_ALIGNMENT).

struct DtypeInfo {
  at::ScalarType scalar;
  const char* name;  // GemmSpec.dtype
  DLDataType dl;
};

// Every dtype this file knows how to describe to TVM. Which of them are *accepted* is decided
// by the list ops/impls.py passes in (SUPPORTED_DTYPES); a name missing here fails registration.
constexpr std::array<DtypeInfo, 4> kKnownDtypes{{
    {at::kFloat, "float32", DLDataType{kDLFloat, 32, 1}},
    {at::kDouble, "float64", DLDataType{kDLFloat, 64, 1}},
    {at::kBFloat16, "bfloat16", DLDataType{kDLBfloat, 16, 1}},
    {at::kHalf, "float16", DLDataType{kDLFloat, 16, 1}},
}};

struct Config {
  int64_t gemv_max_m = 0;
  int64_t gemv_min_b_elements = 0;
  int64_t dot_max_m = 0;  // "nk" products with 2 <= M <= this take the "dot" variant
  int64_t dot2_max_m = 0;  // ... and "dot2" (a 2-row tile) up to this M
  // ... but a float32 "dot" (not "dot2") of M rows with K below dot_min_k[M] (N of
  // dot_wide_min_n or more), dot_min_k[dot_max_m + 1 + M] (fewer), takes the packed kernel
  // (schedules/cpu.py dot_min_k); an M past the table: never.
  std::vector<int64_t> dot_min_k;
  int64_t dot_wide_min_n = 0;
  // ... but a bfloat16 one with a static even K up to this M (schedules/cpu.py
  // bf16_dot_max_m); -1: dot_max_m.
  int64_t bf16_dot_max_m = -1;
  // "gemv" up to gemv_max_m rows, but a bfloat16 "kn" one with a symbolic or even K up to this M
  // (schedules/cpu.py bf16_gemv_max_m); -1: gemv_max_m.
  int64_t bf16_gemv_max_m = -1;
  // "nk" with a K off whole multiples of k_multiple (or symbolic): no "dot" (but float32 with a
  // static K past k_multiple); "gemv" up to max_m rows (bf16: bf16_max_m), then "gemm"
  // (schedules/cpu.py DOT_K_MULTIPLE); k_multiple 0: no rule.
  struct {
    int64_t k_multiple = 0, max_m = 0, bf16_max_m = 0;
  } k_tail;
  // bfloat16 "nk", static even K: "dot" up to max_m rows while x (M x K x 2 bytes) is at
  // most max_x_bytes (schedules/cpu.py amx_dot_limits); max_m 0: never past dot_max_m.
  struct {
    int64_t max_m = 0, max_x_bytes = 0;
  } amx_dot;
  // "swap" (float32 "nk", static K): M in [min_m, max_m] (one panel of x), K <= max_k
  // (schedules/cpu.py SWAP_MIN_M, SWAP_MAX_M and swap_max_k); max_m 0: never.
  struct {
    int64_t min_m = 0, max_m = 0, max_k = 0;
  } swap;
  // The one-panel swap variants "swap32" and "swap48" (kVariants[6], [7]; float32 "nk", static
  // K): M in [min_m, max_m], N >= min_n, K <= max_k (schedules/cpu.py ONE_PANEL_SWAPS and
  // one_panel_swap_max_k); max_m 0: never.
  struct OnePanelSwap {
    int64_t min_m = 0, max_m = 0, min_n = 0, max_k = 0;
  };
  std::array<OnePanelSwap, 2> one_panel_swaps{};
  // "swap2" (kVariants[8]; float32 "nk", static K, two panels of x): the same four bounds
  // (schedules/cpu.py SWAP2_*, swap_max_k); max_m 0: never.
  OnePanelSwap swap2{};
  // "rows" (kVariants[9]; float32, either layout, K static or not): N <= max_n, K <= max_k, and
  // M >= min_m or, past dot_max_m, rows_split_wins (schedules/cpu.py ROWS_*, rows_max_k);
  // max_k 0: never.
  struct {
    int64_t min_m = 0, max_n = 0, max_k = 0, panel = 64, pack_rows = 0;
  } rows;
  // "ksplit" (float32 "kn", static K): M in [1, max_m], N >= min_n and a multiple of
  // n_multiple (schedules/cpu.py KSPLIT_*); max_m 0: never.
  struct {
    int64_t max_m = 0, min_n = 0, n_multiple = 1;
  } ksplit;
  // The GEMM kernels' epilogues: first the linear op's (linear_activations of them), then the
  // conv op's others (kernels/conv2d.py ACTIVATIONS), which only the conv's one-pixel route
  // ("linear") asks for.
  std::vector<std::string> activations;
  int64_t linear_activations = 0;
  std::vector<const DtypeInfo*> dtypes;
  int none_activation = 0;  // index of "none" in activations
  // KERNEL_ALIGNMENT["cpu"] - 1 (a power of two): a pointer p is aligned when (p & mask) == 0.
  uintptr_t alignment_mask = 63;
};

// Written only by register_impls() while no impl is registered, read by the impls afterwards.
Config g_config;

const DtypeInfo* find_dtype(at::ScalarType s) {
  for (const DtypeInfo* d : g_config.dtypes) {
    if (d->scalar == s) return d;
  }
  return nullptr;
}

int find_activation(c10::string_view act) {
  for (size_t i = 0; i < g_config.activations.size(); ++i) {
    if (act == g_config.activations[i]) return static_cast<int>(i);
  }
  return -1;
}

// ---------------------------------------------------------------------------------------------
// Validation. These predicates accept exactly what ops/checks.py check_matmul / check_linear accept.
// They only say yes or no: on "no" we call the Python check itself, which raises the error
// (same type, same text as the Python path, with nothing to keep in sync but the predicate).

bool tensor_ok(const at::Tensor& t, int64_t min_rank, int64_t max_rank) {
  return find_dtype(t.scalar_type()) != nullptr && t.dim() >= min_rank && t.dim() <= max_rank;
}

bool same_ok(const at::Tensor& t1, const at::Tensor& t2) {
  return t1.scalar_type() == t2.scalar_type() && t1.device() == t2.device();
}

bool matmul_ok(const at::Tensor& a, const at::Tensor& b) {
  if (!tensor_ok(a, 2, 3) || !tensor_ok(b, 2, 3) || !same_ok(a, b)) return false;
  if (a.size(-1) != b.size(-2)) return false;
  if (b.dim() == 3) {
    const int64_t ba = a.dim() == 3 ? a.size(0) : 1;
    const int64_t bb = b.size(0);
    if (!(ba == bb || ba == 1 || bb == 1)) return false;
  }
  return true;
}

bool linear_ok(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
               int act) {
  if (act < 0 || act >= g_config.linear_activations) return false;
  if (!tensor_ok(x, 1, 8) || !tensor_ok(w, 2, 2) || !same_ok(x, w)) return false;
  if (x.size(-1) != w.size(1)) return false;
  if (bias.has_value()) {
    const at::Tensor& bt = *bias;
    if (!tensor_ok(bt, 1, 1) || !same_ok(x, bt) || bt.size(0) != w.size(0)) return false;
  }
  return true;
}

// Raise the Python check's own error. Only reached on bad input, so its cost does not matter.
template <typename... Args>
[[noreturn]] void raise_python_check(const char* check, Args&&... args) {
  {
    py::gil_scoped_acquire gil;
    // Throws py::error_already_set carrying the Python exception; torch's Python binding
    // restores it, so the caller sees the TypeError / ValueError / RuntimeError of the check.
    py::module_::import("torch_tvm_gemm.ops.checks").attr(check)(std::forward<Args>(args)...);
  }
  TORCH_CHECK(false, "tvm_gemm: internal error: the C++ validation rejected an input that ops.",
              check, " accepts; please report this");
}

// ---------------------------------------------------------------------------------------------
// The kernel table: every field of GemmSpec (plus the device index), mapped to the function
// handle Python gave us.

// GemmSpec.variant names, indexed by KernelKey::variant.
constexpr std::array<const char*, 10> kVariants{
    {"gemm", "gemv", "dot", "dot2", "swap", "ksplit", "swap32", "swap48", "swap2", "rows"}};

// schedules/cpu.py rows_split_wins: tasks of (half of the rows, panel) against whole panels.
bool rows_split_wins(int64_t m, int64_t n, int64_t threads) {
  const auto& rows = g_config.rows;
  const int64_t panels = (n + rows.panel - 1) / rows.panel;
  const int64_t whole_panels = (panels + threads - 1) / threads * (2 * rows.pack_rows + 2 * m);
  const int64_t halves = (2 * panels + threads - 1) / threads * (2 * rows.pack_rows + m);
  return halves < whole_panels;
}

// schedules/cpu.py gemm_variant() for CPU kernels, with its constants and torch's thread
// count: the table key's variant. On a miss, Python computes the spec with ops/gemm_ops.py
// gemm_spec and raises an internal error if its variant differs (tests/test_csrc.py sweeps
// both rules against each other).
int gemm_variant(int64_t m, int64_t n, int64_t k, bool b_nk, bool fp32, bool bf16,
                 bool static_k) {
  const bool big_b = n * k >= g_config.gemv_min_b_elements;
  const auto& rows = g_config.rows;
  if (big_b && fp32 && n <= rows.max_n && k <= rows.max_k &&
      (m >= rows.min_m ||
       (m > g_config.dot_max_m && rows_split_wins(m, n, at::get_num_threads())))) {
    return 9;
  }
  for (size_t i = 0; i < g_config.one_panel_swaps.size(); ++i) {
    const auto& swap = g_config.one_panel_swaps[i];
    if (b_nk && big_b && fp32 && static_k && m >= swap.min_m && m <= swap.max_m &&
        n >= swap.min_n && k <= swap.max_k) {
      return 6 + static_cast<int>(i);
    }
  }
  const bool bf16_pairs = bf16 && static_k && k % 2 == 0;
  const int64_t dot_max_m = bf16_pairs && g_config.bf16_dot_max_m >= 0 ? g_config.bf16_dot_max_m
                                                                       : g_config.dot_max_m;
  const auto& tail = g_config.k_tail;
  const bool whole_k = tail.k_multiple == 0 || (static_k && k % tail.k_multiple == 0);
  // (float32 dot kernels sum K's last values apart: any static K past one vector)
  const bool dot_k = whole_k || (fp32 && static_k && k > tail.k_multiple);
  if (b_nk && big_b && dot_k && m >= 2 && m <= dot_max_m) {
    if (m <= g_config.dot2_max_m) return 3;
    const auto& min_k = g_config.dot_min_k;
    const size_t row = (n >= g_config.dot_wide_min_n ? 0 : g_config.dot_max_m + 1) + m;
    return fp32 && row < min_k.size() && k < min_k[row] ? 0 : 2;
  }
  const auto& amx = g_config.amx_dot;
  if (b_nk && big_b && bf16_pairs && m >= 2 && m <= amx.max_m &&
      m * k * 2 <= amx.max_x_bytes) {
    return 2;
  }
  if (b_nk && big_b && bf16_pairs && m >= 2) return 0;  // the packed kernel, even at M <= 16
  const auto& swap = g_config.swap;
  if (b_nk && big_b && fp32 && static_k && m >= swap.min_m && m <= swap.max_m &&
      k <= swap.max_k) {
    return 4;
  }
  const auto& swap2 = g_config.swap2;
  if (b_nk && big_b && fp32 && static_k && m >= swap2.min_m && m <= swap2.max_m &&
      n >= swap2.min_n && k <= swap2.max_k) {
    return 8;
  }
  const auto& ksplit = g_config.ksplit;
  if (!b_nk && big_b && fp32 && static_k && m >= 1 && m <= ksplit.max_m && n >= ksplit.min_n &&
      n % ksplit.n_multiple == 0) {
    return 5;
  }
  if (b_nk && big_b && !whole_k) return m <= (bf16 ? tail.bf16_max_m : tail.max_m) ? 1 : 0;
  const bool bf16_packed = bf16 && (!static_k || k % 2 == 0);
  const int64_t gemv_max_m = !b_nk && bf16_packed && g_config.bf16_gemv_max_m >= 0
                                 ? g_config.bf16_gemv_max_m
                                 : g_config.gemv_max_m;
  return m <= gemv_max_m && big_b ? 1 : 0;
}

struct KernelKey {
  const DtypeInfo* dtype;
  int64_t n;
  int64_t k;  // -1: symbolic K
  bool b_nk;  // b_layout "nk" (else "kn")
  bool bias;
  int activation;  // index into g_config.activations
  int variant;     // index into kVariants
  bool batched;    // 3-D @ 3-D, the batch a parallel axis (GemmSpec.batched)
  c10::DeviceType device_type;
  c10::DeviceIndex device_index;

  bool operator==(const KernelKey& o) const {
    return dtype == o.dtype && n == o.n && k == o.k && b_nk == o.b_nk && bias == o.bias &&
           activation == o.activation && variant == o.variant && batched == o.batched && device_type == o.device_type &&
           device_index == o.device_index;
  }
};

struct KernelKeyHash {
  size_t operator()(const KernelKey& key) const {
    size_t h = std::hash<const void*>()(key.dtype);
    auto mix = [&h](uint64_t v) {  // boost-style hash_combine
      h ^= std::hash<uint64_t>()(v) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    };
    mix(static_cast<uint64_t>(key.n));
    mix(static_cast<uint64_t>(key.k));
    // (the variant index takes bits 2-5: batched and the activation above it)
    mix((key.b_nk ? 1u : 0u) | (key.bias ? 2u : 0u) | (static_cast<uint64_t>(key.variant) << 2) |
        (key.batched ? 64u : 0u) | (static_cast<uint64_t>(key.activation) << 7));
    mix((static_cast<uint64_t>(key.device_type) << 16) |
        static_cast<uint64_t>(static_cast<uint16_t>(key.device_index)));
    return h;
  }
};

using KernelTable = std::unordered_map<KernelKey, tvm::ffi::Function, KernelKeyHash>;

// Allocated once and never freed: its function handles point into loaded kernel libraries, and
// releasing them from a static destructor at exit could run after tvm-ffi has shut down.
KernelTable& table() {
  static auto* t = new KernelTable();
  return *t;
}
std::shared_mutex& table_mutex() {
  static auto* m = new std::shared_mutex();
  return *m;
}

// A tvm-ffi error raised in Python (a failed build, a cache that forbids compiling) becomes the
// matching torch error, so that Python sees ValueError / TypeError / RuntimeError as usual.
[[noreturn]] void rethrow_ffi_error(const tvm::ffi::Error& err, const char* context) {
  const std::string kind = err.kind();
  const std::string msg = std::string("tvm_gemm: ") + context + ": " + kind + ": " + err.message();
  if (kind == "ValueError") TORCH_CHECK_VALUE(false, msg);
  if (kind == "TypeError") TORCH_CHECK_TYPE(false, msg);
  if (kind == "NotImplementedError") TORCH_CHECK_NOT_IMPLEMENTED(false, msg);
  TORCH_CHECK(false, msg);
}

// The kernel for key; m and k (the call's own, also where the key's K is symbolic) are only
// read on a miss, to hand Python the call as it is.
tvm::ffi::Function lookup_kernel(const KernelKey& key, int64_t m, int64_t k) {
  {
    std::shared_lock<std::shared_mutex> lock(table_mutex());
    auto it = table().find(key);
    if (it != table().end()) return it->second;
  }
  // Miss: ask Python, *without* holding our lock. The callback takes the GIL; a thread that
  // holds the GIL while waiting for our lock would otherwise deadlock with us. Two threads may
  // both miss on one key: Python's runtime.get_kernel builds once under its own lock and hands
  // both the same function, and emplace below keeps the first.
  tvm::ffi::Function fn;
  try {
    tvm::ffi::Function get_kernel = tvm::ffi::Function::GetGlobalRequired("tvm_gemm.get_kernel");
    fn = get_kernel(key.dtype->name, m, key.n, k, key.b_nk ? "nk" : "kn", key.bias,
                    g_config.activations[key.activation], /*static_k=*/key.k >= 0, key.batched,
                    kVariants[key.variant], "cpu")
             .cast<tvm::ffi::Function>();
  } catch (const tvm::ffi::Error& err) {
    // Raise the Python exception itself (kept by the handler), as the Python path would;
    // only if it is gone, a torch error carrying its class name and text.
    {
      py::gil_scoped_acquire gil;
      py::module_::import("torch_tvm_gemm.ops.impls").attr("reraise_kernel_error")();
    }
    rethrow_ffi_error(err, "building or loading the kernel failed");
  }
  std::unique_lock<std::shared_mutex> lock(table_mutex());
  return table().emplace(key, std::move(fn)).first->second;
}

// TVM's CPU thread pool is per calling thread; follow torch.set_num_threads. The pool itself
// is asked how many threads it has (one FFI call, ~0.1 us), so this path and the Python one
// never trust a stale record of what the other set. On a mismatch (rare: after
// torch.set_num_threads), Python's runtime.loader.sync_threads reconfigures it, CPU affinity
// handling included: one implementation.
void sync_threads() {
  // Registered by libtvm_runtime.so, which Python loaded before handing us the first kernel.
  static auto* num_threads =
      new tvm::ffi::Function(tvm::ffi::Function::GetGlobalRequired("runtime.NumThreads"));
  if ((*num_threads)().cast<int>() == at::get_num_threads()) return;
  py::gil_scoped_acquire gil;
  py::module_::import("torch_tvm_gemm.runtime.loader").attr("sync_threads")();
}

// ---------------------------------------------------------------------------------------------
// The kernel call.

// A DLTensor that views a contiguous tensor's memory: no allocation, no copy, no reference
// count (it lives on the caller's stack for the duration of the call, while the tensor does).
// TVM's CPU kernels assume each buffer starts on a 64-byte boundary (seen: a batch slice of B
// at a 660-byte offset crashed the packed kernel); ops/gemm_ops.py aligned() applies the same
// rule, with the KERNEL_ALIGNMENT it passes us at registration.
bool is_aligned(const at::Tensor& t) {
  return (reinterpret_cast<uintptr_t>(t.data_ptr()) & g_config.alignment_mask) == 0;
}

// t, or an aligned contiguous copy of it (at::empty allocates on the boundary).
at::Tensor aligned(const at::Tensor& t) {
  return is_aligned(t) ? t : t.clone(at::MemoryFormat::Contiguous);
}

DLTensor dl_view(const at::Tensor& t, const DtypeInfo& dtype) {
  DLTensor d;
  d.data = t.data_ptr();  // already includes the storage offset, so byte_offset stays 0
  d.device.device_type = kDLCPU;
  d.device.device_id = 0;
  d.ndim = static_cast<int32_t>(t.dim());
  d.dtype = dtype.dl;
  d.shape = const_cast<int64_t*>(t.sizes().data());
  // NULL strides mean compact row-major. Callers pass contiguous tensors only; torch may
  // report any stride for a size-1 dim of a contiguous tensor, which TVM's stride check would
  // reject, so we do not hand torch's strides over.
  d.strides = nullptr;
  d.byte_offset = 0;
  return d;
}

at::Tensor apply_activation(const at::Tensor& t, int act) {
  const std::string& name = g_config.activations[act];
  if (name == "none") return t;
  if (name == "relu") return at::relu(t);
  if (name == "gelu") return at::gelu(t);
  if (name == "gelu_tanh") return at::gelu(t, "tanh");
  if (name == "silu") return at::silu(t);
  if (name == "relu6") return at::hardtanh(t, 0, 6);
  if (name == "hardswish") return at::hardswish(t);
  if (name == "leaky_relu") return at::leaky_relu(t, 0.01);  // (epilogue.LEAKY_RELU_SLOPE)
  if (name == "sigmoid") return at::sigmoid(t);
  if (name == "hardsigmoid") return at::hardsigmoid(t);
  TORCH_CHECK(false, "tvm_gemm: internal error: no C++ formula for activation '", name, "'");
}

// act(a @ B + bias) for a 2-D a; B is b ("kn") or b.T ("nk"). Mirrors gemm_ops.gemm's CPU branch
// (these impls are registered for CPU only).
at::Tensor gemm(const at::Tensor& a, const at::Tensor& b, bool b_nk,
                const std::optional<at::Tensor>& bias, int act, bool static_k,
                std::optional<at::Tensor> out = std::nullopt) {
  const int64_t m = a.size(0);
  const int64_t k = a.size(1);
  const int64_t n = b_nk ? b.size(0) : b.size(1);
  at::Tensor result = out.has_value() ? *out : empty_output({m, n}, a.options());
  if (m == 0 || n == 0) return result;
  if (k == 0) {  // an empty sum: the result is act(bias) or act(0)
    at::Tensor zero = bias.has_value() ? bias->expand({m, n}) : at::zeros_like(result);
    return result.copy_(apply_activation(zero, act));
  }
  const DtypeInfo& dtype = *find_dtype(a.scalar_type());
  const KernelKey key{&dtype,
                      n,
                      static_k ? k : -1,
                      b_nk,
                      bias.has_value(),
                      act,
                      gemm_variant(m, n, k, b_nk, dtype.scalar == at::kFloat,
                                   dtype.scalar == at::kBFloat16, static_k),
                      /*batched=*/false,
                      a.device().type(),
                      c10::DeviceIndex(0)};
  tvm::ffi::Function kernel = lookup_kernel(key, m, k);
  sync_threads();

  // Contiguous (expect_contiguous borrows when it already is: no refcount traffic) and, like
  // ops/gemm_ops.py aligned(), starting on the kernel alignment, else an aligned copy.
  const at::Tensor ac =
      is_transposed_contiguous(a) ? aligned(transposed_copy(a)) : aligned(*a.expect_contiguous());
  const at::Tensor bc = aligned(*b.expect_contiguous());
  // The output: fresh, or a slice of a fresh batch that may start off the boundary.
  const bool out_aligned = is_aligned(result);
  at::Tensor dest = out_aligned ? result : at::empty_like(result);
  DLTensor dl_a = dl_view(ac, dtype);
  DLTensor dl_b = dl_view(bc, dtype);
  DLTensor dl_out = dl_view(dest, dtype);
  const SerialCalls serial(serial_product(m, n, k));
  try {
    if (bias.has_value()) {
      const at::Tensor biasc = aligned(*bias->expect_contiguous());
      DLTensor dl_bias = dl_view(biasc, dtype);
      kernel(&dl_a, &dl_b, &dl_bias, &dl_out);
    } else {
      kernel(&dl_a, &dl_b, &dl_out);
    }
  } catch (const tvm::ffi::Error& err) {
    rethrow_ffi_error(err, "the TVM kernel failed");
  }
  if (!out_aligned) result.copy_(dest);
  return result;
}

// Mirrors gemm_ops._matmul_2d: a transposed contiguous b (x @ w.T) is read in place as "nk", K
// part of the kernel as in a Linear (that file says why).
at::Tensor matmul_2d(const at::Tensor& a, const at::Tensor& b,
                     std::optional<at::Tensor> out = std::nullopt) {
  const int none = g_config.none_activation;
  if (!b.is_contiguous() && b.t().is_contiguous()) {
    return gemm(a, b.t(), /*b_nk=*/true, std::nullopt, none, /*static_k=*/true, std::move(out));
  }
  return gemm(a, b, /*b_nk=*/false, std::nullopt, none, /*static_k=*/false, std::move(out));
}

// ---------------------------------------------------------------------------------------------
// The op impls (mirror gemm_ops.matmul_impl and gemm_ops.linear_impl).

// t as 2-D (rows, last dim), like gemm_ops.rows: reshape(-1, K) would fail for K = 0.
// An n-D result is allocated in its own shape and written through rows(out), never returned as
// a view of a 2-D result: autograd refuses in-place writes into a view made inside an op
// (gemm_ops.shaped_output).
at::Tensor rows(const at::Tensor& t) {
  const c10::IntArrayRef sizes = t.sizes();
  const int64_t k = sizes.back();
  return t.reshape({c10::multiply_integers(sizes.begin(), sizes.end() - 1), k});
}

// Mirrors gemm_ops._matmul_batched: (batch, M, K) @ (batch, K, N), a possibly broadcast, as one
// kernel launch; a batch of transposed contiguous matrices is read in place as "nk".
at::Tensor matmul_batched(const at::Tensor& a, const at::Tensor& b, int64_t batch, int64_t m,
                          int64_t n) {
  const int64_t k = a.size(-1);
  at::Tensor out = empty_output({batch, m, n}, a.options());
  if (out.numel() == 0) return out;
  if (k == 0) return out.zero_();
  const DtypeInfo& dtype = *find_dtype(a.scalar_type());
  const bool nk = !b.is_contiguous() && b.transpose(1, 2).is_contiguous();
  // A static K for "nk" (ops._matmul_batched says why), symbolic (-1) for "kn".
  const KernelKey key{&dtype, n, nk ? k : -1, nk, false, g_config.none_activation, /*variant gemm*/ 0,
                      /*batched=*/true, a.device().type(), c10::DeviceIndex(0)};
  tvm::ffi::Function kernel = lookup_kernel(key, m, k);
  sync_threads();
  const at::Tensor ac = aligned(a.expand({batch, m, k}).contiguous());
  const at::Tensor bc = aligned(nk ? b.transpose(1, 2) : b.contiguous());
  DLTensor dl_a = dl_view(ac, dtype);
  DLTensor dl_b = dl_view(bc, dtype);
  DLTensor dl_out = dl_view(out, dtype);  // fresh, hence aligned
  try {
    kernel(&dl_a, &dl_b, &dl_out);
  } catch (const tvm::ffi::Error& err) {
    rethrow_ffi_error(err, "the TVM kernel failed");
  }
  return out;
}

at::Tensor matmul_impl(const at::Tensor& a, const at::Tensor& b) {
  if (!matmul_ok(a, b)) raise_python_check("check_matmul", a, b);
  const int64_t m = a.size(-2);
  const int64_t n = b.size(-1);
  if (b.dim() == 2) {
    // A plain 2-D product skips the reshapes: each would make a view (~0.2 us) of the same shape.
    if (a.dim() == 2) return matmul_2d(a, b);
    // (B, M, K) @ (K, N): one GEMM over all rows
    at::Tensor out = empty_output({a.size(0), m, n}, a.options());
    matmul_2d(rows(a), b, rows(out));
    return out;
  }
  const int64_t ba = a.dim() == 3 ? a.size(0) : 1;
  const int64_t batch = ba == 1 ? b.size(0) : ba;
  if (b.size(0) == 1) {  // one B for the whole batch: one GEMM over all rows of a
    at::Tensor out = empty_output({batch, m, n}, a.options());
    matmul_2d(rows(a), b.select(0, 0), rows(out));
    return out;
  }
  return matmul_batched(a, b, batch, m, n);
}

at::Tensor linear_impl(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, c10::string_view activation) {
  const int act = find_activation(activation);
  if (!linear_ok(x, weight, bias, act)) {
    raise_python_check("check_linear", x, weight, bias, std::string(activation));
  }
  // Mirrors gemm_ops.linear_impl: a weight that is the transpose of a contiguous (in, out) matrix
  // (transformers' Conv1D passes weight.t()) is read in place with the "kn" layout.
  const bool kn = !weight.is_contiguous() && weight.t().is_contiguous();
  const at::Tensor w = kn ? weight.t() : weight;
  if (x.dim() == 2) return gemm(x, w, /*b_nk=*/!kn, bias, act, /*static_k=*/true);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(weight.size(0));
  at::Tensor out = empty_output(shape, x.options());
  gemm(rows(x), w, /*b_nk=*/!kn, bias, act, /*static_k=*/true, rows(out));
  return out;
}

// ---------------------------------------------------------------------------------------------
// The conv op (mirrors conv_ops._conv2d_impl for the calls it runs most in a model).
//
// Python decides everything about a conv call from its geometry (conv_ops._checked_geometry:
// the checks, the route, the kernel), once per geometry. We keep that decision per geometry
// too, so that a repeated call does not enter Python at all: "conv" (the conv kernel on an NCHW
// x, called here), "linear" (a 1x1 conv with one output pixel: the linear GEMM over that pixel),
// for a channels_last x "nhwc kernel" (a kernel over its pixels, conv_ops._conv_nhwc) and
// "pixels" (a 1x1 conv: one GEMM over all pixels), or "python" (every other route, and empty
// outputs: conv_ops._conv2d_impl, called through pybind). Python answers a miss with conv_ops.cpp_route, which raises the checks' error for
// a bad call. Why: the Python impl costs ~8 us a call hot, ~20 us between a model's other ops
// (RegNetY-400MF's squeeze-and-excitation convs, batch 1), where its kernels take 1-100 us.

enum class ConvRoute : int8_t { kPython = 0, kConv = 1, kLinear = 2, kNhwc = 3, kPixels = 4 };

// Everything _checked_geometry's answer depends on. A call whose tensors are not 4-D (bias:
// 1-D) or whose lists are not 1 or 2 long has no key: it goes to Python, which says why.
struct ConvKey {
  std::array<int64_t, 4> x{}, w{};
  std::array<int64_t, 6> lists{};  // stride, padding, dilation: two values each
  int64_t list_lengths = 0;        // their lengths, two bits each
  int64_t groups = 0;
  int64_t bias_size = -1;          // -1: no bias
  at::ScalarType x_dtype{}, w_dtype{}, b_dtype{};
  c10::DeviceType w_device{}, b_device{};
  int8_t x_layout = 0;  // 0 contiguous, 1 channels_last only, 2 neither
  bool w_channels_last = false;
  bool relu = false;
  bool has_activation = false;
  std::string activation;

  bool operator==(const ConvKey& o) const {
    return x == o.x && w == o.w && lists == o.lists && list_lengths == o.list_lengths &&
           groups == o.groups && bias_size == o.bias_size && x_dtype == o.x_dtype &&
           w_dtype == o.w_dtype && b_dtype == o.b_dtype && w_device == o.w_device &&
           b_device == o.b_device && x_layout == o.x_layout &&
           w_channels_last == o.w_channels_last && relu == o.relu &&
           has_activation == o.has_activation && activation == o.activation;
  }
};

struct ConvKeyHash {
  size_t operator()(const ConvKey& key) const {
    size_t h = std::hash<std::string>()(key.activation);
    auto mix = [&h](uint64_t v) {
      h ^= std::hash<uint64_t>()(v) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    };
    for (int64_t v : key.x) mix(static_cast<uint64_t>(v));
    for (int64_t v : key.w) mix(static_cast<uint64_t>(v));
    for (int64_t v : key.lists) mix(static_cast<uint64_t>(v));
    mix(static_cast<uint64_t>(key.list_lengths));
    mix(static_cast<uint64_t>(key.groups));
    mix(static_cast<uint64_t>(key.bias_size));
    mix((static_cast<uint64_t>(key.x_dtype) << 16) | (static_cast<uint64_t>(key.w_dtype) << 8) |
        static_cast<uint64_t>(key.b_dtype));
    mix((static_cast<uint64_t>(key.w_device) << 8) | static_cast<uint64_t>(key.b_device));
    mix(static_cast<uint64_t>(key.x_layout) | (key.w_channels_last ? 4u : 0u) |
        (key.relu ? 8u : 0u) | (key.has_activation ? 16u : 0u));
    return h;
  }
};

struct ConvPlan {
  ConvRoute route = ConvRoute::kPython;
  tvm::ffi::Function kernel;  // kConv, kNhwc
  std::array<int64_t, 4> out{};
  int activation = 0;  // kLinear, kPixels: the linear op's activation (g_config.activations)
  bool depthwise = false;  // kNhwc: the depthwise kernel (its weight as (R, S, C))
};

using ConvTable = std::unordered_map<ConvKey, ConvPlan, ConvKeyHash>;

// Leaked, as table(): its handles point into loaded kernel libraries.
ConvTable& conv_table() {
  static auto* t = new ConvTable();
  return *t;
}

bool put_list(ConvKey& key, c10::IntArrayRef list, int slot) {
  if (list.size() != 1 && list.size() != 2) return false;
  key.lists[2 * slot] = list[0];
  key.lists[2 * slot + 1] = list.back();
  key.list_lengths |= static_cast<int64_t>(list.size()) << (2 * slot);
  return true;
}

std::optional<ConvKey> conv_key(const at::Tensor& x, const at::Tensor& w,
                                const std::optional<at::Tensor>& bias, c10::IntArrayRef stride,
                                c10::IntArrayRef padding, c10::IntArrayRef dilation,
                                int64_t groups, bool relu,
                                const std::optional<c10::string_view>& activation) {
  if (x.dim() != 4 || w.dim() != 4 || (bias.has_value() && bias->dim() != 1)) return std::nullopt;
  ConvKey key;
  std::copy(x.sizes().begin(), x.sizes().end(), key.x.begin());
  std::copy(w.sizes().begin(), w.sizes().end(), key.w.begin());
  if (!put_list(key, stride, 0) || !put_list(key, padding, 1) || !put_list(key, dilation, 2)) {
    return std::nullopt;
  }
  key.groups = groups;
  key.x_dtype = x.scalar_type();
  key.w_dtype = w.scalar_type();
  key.w_device = w.device().type();
  if (bias.has_value()) {
    key.bias_size = bias->size(0);
    key.b_dtype = bias->scalar_type();
    key.b_device = bias->device().type();
  }
  key.x_layout = x.is_contiguous() ? 0 : x.is_contiguous(at::MemoryFormat::ChannelsLast) ? 1 : 2;
  key.w_channels_last = w.is_contiguous(at::MemoryFormat::ChannelsLast);
  key.relu = relu;
  key.has_activation = activation.has_value();
  if (activation.has_value()) key.activation = std::string(*activation);
  return key;
}

std::vector<int64_t> to_vector(c10::IntArrayRef list) { return {list.begin(), list.end()}; }

std::optional<std::string> to_string(const std::optional<c10::string_view>& s) {
  if (!s.has_value()) return std::nullopt;
  return std::string(*s);
}

// Python's plan for a new geometry (conv_ops.cpp_route); raises its checks' error for a bad call.
ConvPlan conv_miss(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                   c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation,
                   int64_t groups, bool relu, const std::optional<c10::string_view>& activation) {
  ConvPlan plan;
  int64_t kernel_id = -1;
  {
    py::gil_scoped_acquire gil;
    const py::tuple answer = py::module_::import("torch_tvm_gemm.ops.conv_ops")
                                 .attr("cpp_route")(x, w, bias, to_vector(stride),
                                                    to_vector(padding), to_vector(dilation),
                                                    groups, relu, to_string(activation))
                                 .cast<py::tuple>();
    const std::string route = answer[0].cast<std::string>();
    const std::vector<int64_t> out = answer[1].cast<std::vector<int64_t>>();
    TORCH_CHECK(out.size() == 4, "tvm_gemm: internal error: a conv output of rank ", out.size());
    std::copy(out.begin(), out.end(), plan.out.begin());
    kernel_id = answer[2].cast<int64_t>();
    const bool kernel_dtype = find_dtype(x.scalar_type()) != nullptr;
    if (route == "conv" && kernel_dtype) {
      plan.route = ConvRoute::kConv;
    } else if (route == "nhwc kernel" && kernel_dtype) {
      plan.route = ConvRoute::kNhwc;
      plan.depthwise = groups == x.size(1) && groups == w.size(0);
    } else if (route == "linear" || route == "pixels") {
      plan.route = route == "linear" ? ConvRoute::kLinear : ConvRoute::kPixels;
      plan.activation = find_activation(answer[3].cast<std::string>());
      TORCH_CHECK(plan.activation >= 0, "tvm_gemm: internal error: an unknown linear activation");
    }
  }
  if (plan.route == ConvRoute::kConv || plan.route == ConvRoute::kNhwc) {
    // (outside our GIL scope: the global function is Python's and takes the GIL itself)
    tvm::ffi::Function get = tvm::ffi::Function::GetGlobalRequired("tvm_gemm.conv_kernel");
    plan.kernel = get(kernel_id).cast<tvm::ffi::Function>();
  }
  return plan;
}

at::Tensor conv2d_python(const at::Tensor& x, const at::Tensor& w,
                         const std::optional<at::Tensor>& bias, c10::IntArrayRef stride,
                         c10::IntArrayRef padding, c10::IntArrayRef dilation, int64_t groups,
                         bool relu, const std::optional<c10::string_view>& activation) {
  py::gil_scoped_acquire gil;
  py::object y = py::module_::import("torch_tvm_gemm.ops.conv_ops")
                     .attr("_conv2d_impl")(x, w, bias, to_vector(stride), to_vector(padding),
                                           to_vector(dilation), groups, relu, to_string(activation));
  return y.cast<at::Tensor>();
}

at::Tensor conv2d_impl(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, c10::IntArrayRef stride,
                       c10::IntArrayRef padding, c10::IntArrayRef dilation, int64_t groups,
                       bool relu, std::optional<c10::string_view> activation) {
  const std::optional<ConvKey> key =
      conv_key(x, weight, bias, stride, padding, dilation, groups, relu, activation);
  if (!key.has_value()) {
    return conv2d_python(x, weight, bias, stride, padding, dilation, groups, relu, activation);
  }
  ConvPlan plan;
  bool found = false;
  {
    std::shared_lock<std::shared_mutex> lock(table_mutex());
    auto it = conv_table().find(*key);
    if (it != conv_table().end()) {
      plan = it->second;
      found = true;
    }
  }
  if (!found) {  // (our lock not held: the miss takes the GIL, see lookup_kernel)
    plan = conv_miss(x, weight, bias, stride, padding, dilation, groups, relu, activation);
    std::unique_lock<std::shared_mutex> lock(table_mutex());
    conv_table().emplace(*key, plan);
  }
  if (plan.route == ConvRoute::kPython) {
    return conv2d_python(x, weight, bias, stride, padding, dilation, groups, relu, activation);
  }
  const int64_t n = plan.out[0], k = plan.out[1], oh = plan.out[2], ow = plan.out[3];
  const int64_t c = x.size(1);
  if (plan.route == ConvRoute::kPixels) {  // channels_last x, 1x1: (N*H*W, C) @ W^T, no copy
    at::Tensor pixels_out = empty_output({n * oh * ow, k}, x.options());
    gemm(x.permute({0, 2, 3, 1}).reshape({-1, c}), weight.reshape({k, c}), /*b_nk=*/true, bias,
         plan.activation, /*static_k=*/true, pixels_out);
    return pixels_out.view({n, oh, ow, k}).permute({0, 3, 1, 2});
  }
  const bool nhwc = plan.route == ConvRoute::kNhwc;
  // (channels_last x: the kernel writes (N, OH, OW, K), returned as its NCHW-shaped view)
  at::Tensor out = nhwc ? empty_output({n, oh, ow, k}, x.options())
                        : empty_output(plan.out, x.options());
  if (plan.route == ConvRoute::kLinear) {  // (written into the output: never a view of a result)
    gemm(x.select(3, 0).select(2, 0), weight.reshape({k, c}), /*b_nk=*/true, bias,
         plan.activation, /*static_k=*/true, out.view({n, k}));
    return out;
  }
  const DtypeInfo& dtype = *find_dtype(x.scalar_type());
  sync_threads();
  // The kernel reads the weight as it lies and packs it at every call (conv_ops says why).
  // Over channels-last pixels: x as (N, H, W, C) (a view of a channels_last x), the weight
  // as (K, R, S, C/groups) (a view of a channels_last one), or (R, S, C) for the depthwise
  // kernel, as conv_ops._conv_nhwc hands them over.
  at::Tensor wc;
  if (nhwc && plan.depthwise) {
    wc = weight.reshape({k, weight.size(2), weight.size(3)}).permute({1, 2, 0}).contiguous();
  } else if (nhwc) {
    wc = weight.permute({0, 2, 3, 1}).contiguous();
  } else {
    wc = weight.contiguous();
  }
  wc = aligned(wc);
  const at::Tensor xc = aligned(nhwc ? x.permute({0, 2, 3, 1}) : x.contiguous());
  DLTensor dl_x = dl_view(xc, dtype);
  DLTensor dl_w = dl_view(wc, dtype);
  DLTensor dl_out = dl_view(out, dtype);  // fresh, hence aligned
  try {
    if (bias.has_value()) {
      const at::Tensor bc = aligned(bias->contiguous());
      DLTensor dl_b = dl_view(bc, dtype);
      plan.kernel(&dl_x, &dl_w, &dl_b, &dl_out);
    } else {
      plan.kernel(&dl_x, &dl_w, &dl_out);
    }
  } catch (const tvm::ffi::Error& err) {
    rethrow_ffi_error(err, "the TVM kernel failed");
  }
  return nhwc ? out.permute({0, 3, 1, 2}) : out;
}

// ---------------------------------------------------------------------------------------------
// The autograd fast path.
//
// ops/gemm_ops.py registers the autograd formulas (func_autograd.py): a *Python*
// kernel on the Autograd key that every call passes through, grad or not (~5 us, more than the
// rest of the call). We put a C++ kernel in front of it on AutogradCPU: when no
// gradient is needed it does what that Python kernel's no-grad branch does (redispatch below
// autograd); otherwise it hands the call to the Python kernel, captured before we registered
// (torch.library.get_kernel's use case), so the formulas stay in Python.
//
// matmul and linear get unboxed kernels: a boxed one copies every tensor argument onto an
// IValue stack, and the first copy of a tensor that Python holds (and its release) updates
// its Python object, under the GIL: taken back each time where the caller released it (torch.ops
// does; python_entry.cpp does for large products). Measured on a 16x16 matmul: ~2% of the call.

// A gradient is wanted (grad mode on and a tensor requires grad), or a tensor carries a
// forward-mode tangent (torch.autograd.forward_ad): skipping the autograd kernel would drop it.
bool needs_autograd(const at::Tensor& t, bool grad_mode) {
  return t.defined() && ((grad_mode && t.requires_grad()) || t._fw_grad(0).defined());
}

// The captured Python autograd kernel of one op, and the op to redispatch below autograd.
struct AutogradKernels {
  c10::OperatorHandle op;
  c10::SafeKernelFunction python;

  // The Python kernel, called boxed: only when a gradient is wanted, Python's cost anyway.
  at::Tensor call_python(c10::DispatchKeySet keys, torch::jit::Stack stack) const {
    python.callBoxed(op, keys, &stack);
    return std::move(stack.back()).toTensor();
  }
};

class MatmulFastPath {
 public:
  explicit MatmulFastPath(AutogradKernels kernels)
      : kernels_(std::move(kernels)),
        op_(kernels_.op.typed<at::Tensor(const at::Tensor&, const at::Tensor&)>()) {}

  at::Tensor operator()(c10::DispatchKeySet keys, const at::Tensor& a, const at::Tensor& b) const {
    const bool grad_mode = c10::GradMode::is_enabled();
    if (needs_autograd(a, grad_mode) || needs_autograd(b, grad_mode)) {
      return kernels_.call_python(keys, {a, b});
    }
    at::AutoDispatchBelowAutograd guard;
    return op_.redispatch(keys & c10::after_autograd_keyset, a, b);
  }

 private:
  AutogradKernels kernels_;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&)> op_;
};

class LinearFastPath {
  using Signature = at::Tensor(const at::Tensor&, const at::Tensor&,
                               const std::optional<at::Tensor>&, c10::string_view);

 public:
  explicit LinearFastPath(AutogradKernels kernels)
      : kernels_(std::move(kernels)), op_(kernels_.op.typed<Signature>()) {}

  at::Tensor operator()(c10::DispatchKeySet keys, const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias, c10::string_view activation) const {
    const bool grad_mode = c10::GradMode::is_enabled();
    if (needs_autograd(x, grad_mode) || needs_autograd(weight, grad_mode) ||
        (bias.has_value() && needs_autograd(*bias, grad_mode))) {
      return kernels_.call_python(keys, {x, weight, bias, std::string(activation)});
    }
    at::AutoDispatchBelowAutograd guard;
    return op_.redispatch(keys & c10::after_autograd_keyset, x, weight, bias, activation);
  }

 private:
  AutogradKernels kernels_;
  c10::TypedOperatorHandle<Signature> op_;
};

// The same for any op, boxed: the conv op (its many arguments; its calls are not 16x16).
class BoxedFastPath final : public c10::OperatorKernel {
 public:
  explicit BoxedFastPath(AutogradKernels kernels) : kernels_(std::move(kernels)) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                  torch::jit::Stack* stack) {
    const bool grad_mode = c10::GradMode::is_enabled();
    const size_t num_args = op.schema().arguments().size();
    for (const c10::IValue& arg : torch::jit::last(*stack, num_args)) {
      if (arg.isTensor() && needs_autograd(arg.toTensor(), grad_mode)) {
        kernels_.python.callBoxed(op, keys, stack);
        return;
      }
    }
    at::AutoDispatchBelowAutograd guard;
    op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
  }

 private:
  AutogradKernels kernels_;
};

// ---------------------------------------------------------------------------------------------
// Registration, driven from Python (ops.use_impl).

// Leaked on purpose, like the table: deregistering from a static destructor at exit could run
// after the dispatcher itself is gone.
std::unique_ptr<torch::Library>& registrations() {
  static auto* lib = new std::unique_ptr<torch::Library>();
  return *lib;
}
std::vector<std::unique_ptr<torch::Library>>& autograd_registrations() {
  static auto* libs = new std::vector<std::unique_ptr<torch::Library>>();
  return *libs;
}

// The ops whose Python autograd kernel gets the C++ fast path in front. For the conv op too:
// without grad it saves the Python kernel (measured, when its CPU impl was Python: a 1x1 conv
// on 7x7 pixels, fp32, 25.5 -> 19.7 us a call, against 10.5-11.2 us for F.relu(F.conv2d)).

// The C++ autograd kernel for one backend's autograd key, in front of the Python one.
void register_autograd_fast_path(c10::DispatchKey autograd_key) {
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "tvm_gemm", autograd_key,
                                              __FILE__, __LINE__);
  auto captured = [autograd_key](const char* name) {
    const std::string qualified = std::string("tvm_gemm::") + name;
    const c10::OperatorHandle op =
        c10::Dispatcher::singleton().findSchemaOrThrow(qualified.c_str(), "");
    return AutogradKernels{op, op.getComputedKernelForDispatchKey(autograd_key)};
  };
  lib->impl("matmul", [path = MatmulFastPath(captured("matmul"))](
                          c10::DispatchKeySet keys, const at::Tensor& a, const at::Tensor& b) {
    return path(keys, a, b);
  });
  lib->impl("linear", [path = LinearFastPath(captured("linear"))](
                          c10::DispatchKeySet keys, const at::Tensor& x, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias, c10::string_view activation) {
    return path(keys, x, weight, bias, activation);
  });
  lib->impl("conv2d_bias_relu",
            torch::CppFunction::makeFromBoxedFunctor(
                std::make_unique<BoxedFastPath>(captured("conv2d_bias_relu"))));
  autograd_registrations().push_back(std::move(lib));
}

// The dispatch keys this library registers; ops/impls.py registers the Python impls for the others.
// CUDA stays on the Python path: ops.gemm's CUDA branch (static K, 16-byte aligned operands,
// an sm_70 check, the caller's current device and stream) has no C++ twin yet, and no GPU here
// to test one on.
std::vector<std::string> dispatch_keys() { return {"CPU"}; }

void register_impls(int64_t gemv_max_m, int64_t gemv_min_b_elements, int64_t dot_max_m,
                    const std::vector<std::string>& activations,
                    const std::vector<std::string>& dtypes, int64_t kernel_alignment,
                    int64_t dot2_max_m, const std::vector<int64_t>& swap,
                    bool autograd_fast_path,
                    const std::vector<int64_t>& amx_dot, const std::vector<int64_t>& ksplit,
                    const std::vector<int64_t>& one_panel_swaps,
                    const std::vector<int64_t>& swap2, int64_t bf16_dot_max_m,
                    int64_t bf16_gemv_max_m, const std::vector<int64_t>& k_tail,
                    const std::vector<int64_t>& dot_min_k, int64_t dot_wide_min_n,
                    const std::vector<std::string>& conv_epilogues,
                    const std::vector<int64_t>& rows) {
  TORCH_CHECK(!registrations(), "tvm_gemm: the C++ impls are already registered");
  TORCH_CHECK(kernel_alignment > 0 && (kernel_alignment & (kernel_alignment - 1)) == 0,
              "tvm_gemm: the kernel alignment must be a power of two, got ", kernel_alignment);
  Config config;
  config.alignment_mask = static_cast<uintptr_t>(kernel_alignment - 1);
  config.gemv_max_m = gemv_max_m;
  config.gemv_min_b_elements = gemv_min_b_elements;
  config.dot_max_m = dot_max_m;
  config.dot2_max_m = dot2_max_m;
  config.bf16_dot_max_m = bf16_dot_max_m;
  config.bf16_gemv_max_m = bf16_gemv_max_m;
  TORCH_CHECK(k_tail.empty() || k_tail.size() == 3,
              "tvm_gemm: k_tail must be (k_multiple, max_m, bf16_max_m)");
  if (!k_tail.empty()) config.k_tail = {k_tail[0], k_tail[1], k_tail[2]};
  TORCH_CHECK(dot_min_k.empty() || dot_min_k.size() == 2 * static_cast<size_t>(dot_max_m + 1),
              "tvm_gemm: dot_min_k must hold two rows of dot_max_m + 1 values");
  config.dot_min_k = dot_min_k;
  config.dot_wide_min_n = dot_wide_min_n;
  TORCH_CHECK(amx_dot.empty() || amx_dot.size() == 2,
              "tvm_gemm: amx_dot must be (max_m, max_x_bytes)");
  if (!amx_dot.empty()) config.amx_dot = {amx_dot[0], amx_dot[1]};
  TORCH_CHECK(swap.empty() || swap.size() == 3, "tvm_gemm: swap must be (min_m, max_m, max_k)");
  if (!swap.empty()) config.swap = {swap[0], swap[1], swap[2]};
  TORCH_CHECK(ksplit.empty() || (ksplit.size() == 3 && ksplit[2] > 0),
              "tvm_gemm: ksplit must be (max_m, min_n, n_multiple)");
  if (!ksplit.empty()) config.ksplit = {ksplit[0], ksplit[1], ksplit[2]};
  TORCH_CHECK(one_panel_swaps.empty() || one_panel_swaps.size() == 8,
              "tvm_gemm: one_panel_swaps must be (min_m, max_m, min_n, max_k) of swap32, then "
              "swap48");
  for (size_t i = 0; i < one_panel_swaps.size() / 4; ++i) {
    const int64_t* v = one_panel_swaps.data() + 4 * i;
    config.one_panel_swaps[i] = {v[0], v[1], v[2], v[3]};
  }
  TORCH_CHECK(swap2.empty() || swap2.size() == 4,
              "tvm_gemm: swap2 must be (min_m, max_m, min_n, max_k)");
  if (!swap2.empty()) config.swap2 = {swap2[0], swap2[1], swap2[2], swap2[3]};
  TORCH_CHECK(rows.empty() || rows.size() == 5,
              "tvm_gemm: rows must be (min_m, max_n, max_k, panel, pack_rows)");
  if (!rows.empty()) config.rows = {rows[0], rows[1], rows[2], rows[3], rows[4]};
  config.activations = activations;
  config.linear_activations = static_cast<int64_t>(activations.size());
  config.activations.insert(config.activations.end(), conv_epilogues.begin(),
                            conv_epilogues.end());
  TORCH_CHECK(std::find(activations.begin(), activations.end(), "none") != activations.end(),
              "tvm_gemm: the activations must include 'none'");
  for (const std::string& name : dtypes) {
    const DtypeInfo* found = nullptr;
    for (const DtypeInfo& d : kKnownDtypes) {
      if (name == d.name) found = &d;
    }
    TORCH_CHECK(found != nullptr, "tvm_gemm: the C++ extension does not know dtype '", name,
                "' (rebuild it after adding a dtype to ops.SUPPORTED_DTYPES)");
    config.dtypes.push_back(found);
  }
  g_config = std::move(config);
  g_config.none_activation = find_activation("none");

  registrations() = std::make_unique<torch::Library>(torch::Library::IMPL, "tvm_gemm",
                                                     c10::DispatchKey::CPU, __FILE__, __LINE__);
  registrations()->impl("matmul", TORCH_FN(matmul_impl));
  registrations()->impl("linear", TORCH_FN(linear_impl));
  registrations()->impl("conv2d_bias_relu", TORCH_FN(conv2d_impl));
  if (autograd_fast_path) {
    register_autograd_fast_path(c10::DispatchKey::AutogradCPU);
  }
}

void unregister_impls() {
  autograd_registrations().clear();  // destroying a torch::Library removes its registrations
  registrations().reset();
}

void clear_table() {
  std::unique_lock<std::shared_mutex> lock(table_mutex());
  table().clear();
  conv_table().clear();
}

// The variant name the table key of a CPU (m, n, k) product holds (for tests: it must agree
// with schedules/cpu.py gemm_variant, which gemm_spec follows).
std::string key_variant(int64_t m, int64_t n, int64_t k, const std::string& b_layout,
                        const std::string& dtype, bool static_k) {
  TORCH_CHECK(!g_config.activations.empty(), "tvm_gemm: register_impls() has not run yet");
  TORCH_CHECK(b_layout == "kn" || b_layout == "nk", "tvm_gemm: b_layout must be 'kn' or 'nk'");
  return kVariants[gemm_variant(m, n, k, b_layout == "nk", dtype == "float32",
                                dtype == "bfloat16", static_k)];
}

int64_t table_size() {
  std::shared_lock<std::shared_mutex> lock(table_mutex());
  return static_cast<int64_t>(table().size());
}

int64_t conv_table_size() {
  std::shared_lock<std::shared_mutex> lock(table_mutex());
  return static_cast<int64_t>(conv_table().size());
}

}  // namespace
}  // namespace tvm_gemm

namespace tvm_gemm {
void add_python_entries(py::module_& m);  // python_entry.cpp
}  // namespace tvm_gemm

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "C++ impls of the tvm_gemm ops (see csrc/tvm_gemm_ops.cpp)";
  m.def("register_impls", &tvm_gemm::register_impls, py::arg("gemv_max_m"),
        py::arg("gemv_min_b_elements"), py::arg("dot_max_m"), py::arg("activations"),
        py::arg("dtypes"), py::arg("kernel_alignment"), py::arg("dot2_max_m"),
        py::arg("swap") = std::vector<int64_t>{}, py::arg("autograd_fast_path") = true,
        py::arg("amx_dot") = std::vector<int64_t>{},
        py::arg("ksplit") = std::vector<int64_t>{},
        py::arg("one_panel_swaps") = std::vector<int64_t>{},
        py::arg("swap2") = std::vector<int64_t>{}, py::arg("bf16_dot_max_m") = -1,
        py::arg("bf16_gemv_max_m") = -1, py::arg("k_tail") = std::vector<int64_t>{},
        py::arg("dot_min_k") = std::vector<int64_t>{}, py::arg("dot_wide_min_n") = 0,
        py::arg("conv_epilogues") = std::vector<std::string>{},
        py::arg("rows") = std::vector<int64_t>{},
        "Register the C++ impls for dispatch_keys() and, in front of the Python autograd kernel\n"
        "(register_autograd: call after it), a C++ no-grad fast path. The constants come from\n"
        "the Python side.");
  m.def("unregister_impls", &tvm_gemm::unregister_impls, "Remove the C++ registrations.");
  m.def("dispatch_keys", &tvm_gemm::dispatch_keys, "Dispatch keys the C++ impls cover.");
  m.def("clear_table", &tvm_gemm::clear_table, "Forget every cached kernel handle.");
  m.def("table_size", &tvm_gemm::table_size, "Number of cached kernel handles.");
  m.def("conv_table_size", &tvm_gemm::conv_table_size, "Number of conv geometries planned.");
  m.def("key_variant", &tvm_gemm::key_variant, py::arg("m"), py::arg("n"), py::arg("k"),
        py::arg("b_layout"), py::arg("dtype") = "float32", py::arg("static_k") = true,
        "The variant of the kernel-table key of a CPU (m, n, k) product.");
  m.def("configure_output_pool", &tvm_gemm::configure_output_pool, py::arg("min_bytes"),
        py::arg("limit_bytes"),
        "Outputs of min_bytes or more from the pool (0: off), at most limit_bytes kept.");
  m.def(
      "empty_output",
      [](const std::vector<int64_t>& sizes, at::ScalarType dtype) {
        return tvm_gemm::empty_output(sizes, at::TensorOptions().dtype(dtype));
      },
      py::arg("sizes"), py::arg("dtype"), "An uninitialized CPU output, as the C++ impls make.");
  m.def(
      "output_pool_stats",
      [] {
        const tvm_gemm::OutputPoolStats s = tvm_gemm::output_pool_stats();
        py::dict d;
        d["kept_bytes"] = s.kept_bytes;
        d["kept_blocks"] = s.kept_blocks;
        d["live_bytes"] = s.live_bytes;
        d["min_bytes"] = s.min_bytes;
        d["limit_bytes"] = s.limit_bytes;
        return d;
      },
      "What the output pool holds.");
  m.def("release_output_pool", &tvm_gemm::release_output_pool,
        "Return the output pool's kept blocks to the system.");
  m.def("serial_product", &tvm_gemm::serial_product, py::arg("m"), py::arg("n"), py::arg("k"),
        "Whether an (M, N, K) product's kernel runs on the calling thread, not on the pool.");
  m.def("parallel_launch_address", &tvm_gemm::parallel_launch_address,
        "Address of the TVMBackendParallelLaunch replacement that runs on torch's OpenMP pool.");
  tvm_gemm::add_python_entries(m);
}

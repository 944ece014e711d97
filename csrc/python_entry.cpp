// The Python functions torch_tvm_gemm.matmul / linear (and the TVM modules' forward) enter the
// ops here: the same dispatcher call that torch.ops.tvm_gemm.* makes, without torch.ops'
// Python-side overload lookup and schema-driven argument parsing. For a 16x16 matmul that
// parsing is most of the call: ~2.2 us through torch.ops against 1.3 us for torch.matmul.
//
// Only plain calls are taken: every tensor an exact torch.Tensor or nn.Parameter, no
// __torch_function__ override or mode active, an activation given as a str. Anything else
// returns None and Python calls torch.ops, which handles it (tensor subclasses, modes,
// tracing proxies, bad arguments and their error messages). Autograd, autocast, vmap and
// fake tensors work as through torch.ops: they are dispatcher keys, and this is a dispatcher call.

#include <torch/extension.h>

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "parallel_launch.h"

namespace py = pybind11;

namespace tvm_gemm {
namespace {

// An exact torch.Tensor / nn.Parameter: neither has a __torch_function__ override of its own
// (torch's check_has_torch_function says the same for them), so only a mode could intervene.
bool plain_tensor(PyObject* obj) { return THPVariable_CheckExact(obj); }

bool plain_call() { return !at::impl::torch_function_mode_enabled(); }

py::object wrap(at::Tensor t) { return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(t))); }

// The products that run on the calling thread keep the GIL for the call too: releasing it
// costs a lock and an unlock, and each tensor the call copies (a tensor Python holds gains a
// second reference) takes it back to update the Python object, while the kernel runs for a
// few microseconds at most.
bool small_product(int64_t a_elements, int64_t n, int64_t b_elements) {
  return a_elements > 0 && n > 0 && a_elements <= kSerialMaxMacs / n &&
         b_elements < kSerialMaxBElements;
}

using MatmulOp = c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&)>;

// torch.matmul's other ranks (vectors, batch dims other than one) reshaped onto the op exactly
// as ops/matmul_ranks.py does, which takes every call this declines (nullopt) and raises
// there for the bad ones. Here the reshapes cost ~1 us where Python's took ~10 (attention's
// (B, H, S, D) at S = 128 is a ~90 us product).
std::optional<at::Tensor> other_ranks(const MatmulOp& op, const at::Tensor& a,
                                      const at::Tensor& b) {
  if (a.dim() == 0 || b.dim() == 0) return std::nullopt;
  const at::Tensor a2 = a.dim() == 1 ? a.unsqueeze(0) : a;
  const at::Tensor b2 = b.dim() == 1 ? b.unsqueeze(-1) : b;
  if (a2.size(-1) != b2.size(-2)) return std::nullopt;
  const auto a_batch = a2.sizes().slice(0, a2.dim() - 2);
  const auto b_batch = b2.sizes().slice(0, b2.dim() - 2);
  std::vector<int64_t> batch;
  if (a_batch.equals(b_batch)) {
    batch = a_batch.vec();
  } else {
    const size_t rank = std::max(a_batch.size(), b_batch.size());
    for (size_t i = 0; i < rank; ++i) {  // (right-aligned, missing dims are 1)
      const int64_t x = i + a_batch.size() >= rank ? a_batch[i + a_batch.size() - rank] : 1;
      const int64_t y = i + b_batch.size() >= rank ? b_batch[i + b_batch.size() - rank] : 1;
      if (x != y && x != 1 && y != 1) return std::nullopt;
      batch.push_back(x == 1 ? y : x);
    }
  }
  const int64_t count = c10::multiply_integers(batch);
  auto flat = [&](const at::Tensor& t, c10::IntArrayRef own) {
    const int64_t rows = t.size(-2), cols = t.size(-1);
    if (own.equals(batch)) return t.dim() > 3 ? t.flatten(0, -3) : t;
    if (c10::multiply_integers(own) == 1 && count != 0) return t.reshape({rows, cols});
    std::vector<int64_t> full(batch);
    full.insert(full.end(), {rows, cols});
    return t.expand(full).reshape({count, rows, cols});
  };
  at::Tensor out = op.call(flat(a2, a_batch), flat(b2, b_batch));
  batch.insert(batch.end(), {a2.size(-2), b2.size(-1)});
  out = out.reshape(batch);
  if (a.dim() == 1) out = out.squeeze(-2);
  if (b.dim() == 1) out = out.squeeze(-1);
  return out;
}

py::object matmul_entry(py::handle a, py::handle b) {
  if (!plain_call() || !plain_tensor(a.ptr()) || !plain_tensor(b.ptr())) return py::none();
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("tvm_gemm::matmul", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  const at::Tensor& ta = THPVariable_Unpack(a.ptr());
  const at::Tensor& tb = THPVariable_Unpack(b.ptr());
  if (ta.dim() < 2 || ta.dim() > 3 || tb.dim() < 2 || tb.dim() > 3) {
    std::optional<at::Tensor> out;
    {
      py::gil_scoped_release no_gil;
      out = other_ranks(op, ta, tb);
    }
    return out ? wrap(std::move(*out)) : py::none();
  }
  if (small_product(ta.numel(), tb.size(-1), tb.numel())) {
    return wrap(op.call(ta, tb));
  }
  at::Tensor out;
  {
    py::gil_scoped_release no_gil;  // as torch.ops does: other Python threads run meanwhile
    out = op.call(ta, tb);
  }
  return wrap(std::move(out));
}

using LinearOp =
    c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&,
                                        const std::optional<at::Tensor>&, c10::string_view)>;

const LinearOp& linear_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("tvm_gemm::linear", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                                               const std::optional<at::Tensor>&, c10::string_view)>();
  return op;
}

// Whether x, weight and bias (or None) make a plain call (see the top of this file).
bool plain_linear(py::handle x, py::handle weight, py::handle bias) {
  return plain_call() && plain_tensor(x.ptr()) && plain_tensor(weight.ptr()) &&
         (bias.is_none() || plain_tensor(bias.ptr()));
}

std::optional<at::Tensor> unpack_bias(py::handle bias) {
  if (bias.is_none()) return std::nullopt;
  return THPVariable_Unpack(bias.ptr());
}

py::object linear_entry(py::handle x, py::handle weight, py::handle bias, py::handle activation) {
  if (!plain_linear(x, weight, bias) || !PyUnicode_CheckExact(activation.ptr())) {
    return py::none();
  }
  const LinearOp& op = linear_op();
  const std::string act = activation.cast<std::string>();
  const std::optional<at::Tensor> tbias = unpack_bias(bias);
  const at::Tensor& tx = THPVariable_Unpack(x.ptr());
  const at::Tensor& tw = THPVariable_Unpack(weight.ptr());
  if (small_product(tx.numel(), tw.dim() > 0 ? tw.size(0) : 1, tw.numel())) {
    return wrap(op.call(tx, tw, tbias, act));
  }
  at::Tensor out;
  {
    py::gil_scoped_release no_gil;
    out = op.call(tx, tw, tbias, act);
  }
  return wrap(std::move(out));
}

// A mixture-of-experts layer's products (torch_tvm_gemm/moe_experts.py): x's rows taken in
// groups of counts[e] rows, group e times expert e's weight (weight[e], (N, K); its transpose
// when the experts store (K, N)) plus bias[e], the results concatenated. One call for every
// expert: from Python each expert's product cost ~12 us of glue around the op (a slice, a
// select, the call), as much as the product of a row or two itself.
py::object grouped_linear_entry(py::handle x, const std::vector<int64_t>& counts,
                                py::handle weight, py::handle bias, bool transposed) {
  if (!plain_linear(x, weight, bias)) return py::none();
  const LinearOp& op = linear_op();
  const at::Tensor& tx = THPVariable_Unpack(x.ptr());
  const at::Tensor& tw = THPVariable_Unpack(weight.ptr());
  const std::optional<at::Tensor> tbias = unpack_bias(bias);
  int64_t total = 0;
  for (int64_t n : counts) total += n;
  if (tx.dim() != 2 || tw.dim() != 3 || static_cast<int64_t>(counts.size()) != tw.size(0) ||
      total != tx.size(0) || total == 0) {
    return py::none();  // (Python's loop: its errors, or the empty case)
  }
  at::Tensor out;
  {
    py::gil_scoped_release no_gil;
    std::vector<at::Tensor> parts;
    int64_t start = 0;
    for (size_t e = 0; e < counts.size(); ++e) {
      const int64_t n = counts[e];
      if (n == 0) continue;
      const at::Tensor w = transposed ? tw.select(0, e).t() : tw.select(0, e);
      std::optional<at::Tensor> b;
      if (tbias) b = tbias->select(0, e);
      parts.push_back(op.call(tx.narrow(0, start, n), w, b, "none"));
      start += n;
    }
    out = parts.size() == 1 ? parts[0] : at::cat(parts);
  }
  return wrap(std::move(out));
}

}  // namespace

void add_python_entries(py::module_& m) {
  m.def("matmul_entry", &matmul_entry, py::arg("a"), py::arg("b"),
        "tvm_gemm::matmul(a, b) through the dispatcher, or None when the call is not plain\n"
        "(see csrc/python_entry.cpp): then use torch.ops.tvm_gemm.matmul.");
  m.def("linear_entry", &linear_entry, py::arg("x"), py::arg("weight"), py::arg("bias"),
        py::arg("activation"),
        "tvm_gemm::linear(x, weight, bias, activation) through the dispatcher, or None when the\n"
        "call is not plain: then use torch.ops.tvm_gemm.linear.");
  m.def("grouped_linear_entry", &grouped_linear_entry, py::arg("x"), py::arg("counts"),
        py::arg("weight"), py::arg("bias"), py::arg("transposed"),
        "cat([tvm_gemm::linear(rows of group e, weight[e] (or its transpose), bias[e])]) for the\n"
        "groups of counts[e] rows of x, or None when the call is not plain or not well formed.");
}

}  // namespace tvm_gemm

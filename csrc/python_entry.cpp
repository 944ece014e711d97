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

#include <optional>
#include <string>

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

py::object matmul_entry(py::handle a, py::handle b) {
  if (!plain_call() || !plain_tensor(a.ptr()) || !plain_tensor(b.ptr())) return py::none();
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("tvm_gemm::matmul", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  const at::Tensor& ta = THPVariable_Unpack(a.ptr());
  const at::Tensor& tb = THPVariable_Unpack(b.ptr());
  if (small_product(ta.numel(), tb.dim() > 0 ? tb.size(-1) : 1, tb.numel())) {
    return wrap(op.call(ta, tb));
  }
  at::Tensor out;
  {
    py::gil_scoped_release no_gil;  // as torch.ops does: other Python threads run meanwhile
    out = op.call(ta, tb);
  }
  return wrap(std::move(out));
}

py::object linear_entry(py::handle x, py::handle weight, py::handle bias, py::handle activation) {
  const bool has_bias = !bias.is_none();
  if (!plain_call() || !plain_tensor(x.ptr()) || !plain_tensor(weight.ptr()) ||
      (has_bias && !plain_tensor(bias.ptr())) || !PyUnicode_CheckExact(activation.ptr())) {
    return py::none();
  }
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("tvm_gemm::linear", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            c10::string_view)>();
  const std::string act = activation.cast<std::string>();
  std::optional<at::Tensor> tbias;
  if (has_bias) tbias = THPVariable_Unpack(bias.ptr());
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

}  // namespace

void add_python_entries(py::module_& m) {
  m.def("matmul_entry", &matmul_entry, py::arg("a"), py::arg("b"),
        "tvm_gemm::matmul(a, b) through the dispatcher, or None when the call is not plain\n"
        "(see csrc/python_entry.cpp): then use torch.ops.tvm_gemm.matmul.");
  m.def("linear_entry", &linear_entry, py::arg("x"), py::arg("weight"), py::arg("bias"),
        py::arg("activation"),
        "tvm_gemm::linear(x, weight, bias, activation) through the dispatcher, or None when the\n"
        "call is not plain: then use torch.ops.tvm_gemm.linear.");
}

}  // namespace tvm_gemm

"""``torch_tvm_gemm.matmul`` / ``linear`` and the TVM modules enter the ops from C++ (ops/entry.py,
csrc/python_entry.cpp): the same results, errors, gradients and transforms as ``torch.ops``,
and ``torch.ops`` itself for whatever is not a plain call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import randn
from test_csrc import BAD_CALLS
from torch.overrides import TorchFunctionMode

import torch_tvm_gemm as tg
from torch_tvm_gemm import _ext
from torch_tvm_gemm.ops import entry

EXT = _ext.load()
needs_ext = pytest.mark.skipif(EXT is None, reason=f"C++ extension not built ({_ext.load_error})")
mm = torch.ops.tvm_gemm.matmul
lin = torch.ops.tvm_gemm.linear


@needs_ext
def test_entry_takes_plain_calls_only():
    a, b = randn(5, 7), randn(7, 3)
    assert torch.equal(EXT.matmul_entry(a, b), mm(a, b))
    w = torch.nn.Parameter(randn(3, 7))
    assert torch.equal(EXT.linear_entry(a, w, None, "relu"), lin(a, w, None, "relu"))

    class Sub(torch.Tensor):
        pass

    assert EXT.matmul_entry(a.as_subclass(Sub), b) is None
    assert EXT.matmul_entry(a, [[1.0]]) is None
    assert EXT.linear_entry(a, w, 3, "none") is None
    assert EXT.linear_entry(a, w, None, b"none") is None
    with TorchFunctionMode():
        assert EXT.matmul_entry(a, b) is None


@pytest.mark.parametrize(
    "a_shape, b_shape", [((5, 7), (7, 3)), ((2, 5, 7), (2, 7, 3)), ((2, 5, 7), (7, 3))]
)
def test_matmul_same_as_torch_ops(a_shape, b_shape):
    a, b = randn(*a_shape), randn(*b_shape)
    assert torch.equal(tg.matmul(a, b), mm(a, b))


@pytest.mark.parametrize("activation", ["none", "relu", "gelu_tanh"])
def test_linear_same_as_torch_ops(activation):
    x, w, bias = randn(2, 5, 7), randn(3, 7), randn(3)
    assert torch.equal(tg.linear(x, w, bias, activation), lin(x, w, bias, activation))
    assert torch.equal(tg.linear(x, w), lin(x, w, None, "none"))
    assert torch.equal(tg.linear(x, w.t().contiguous().t()), lin(x, w, None, "none"))


# Ranks the op rejects and torch_tvm_gemm.matmul reshapes onto it (test_matmul_ranks.py).
OTHER_RANKS = {"1-D a", "4-D b"}


@needs_ext
@pytest.mark.parametrize("name", [name for name in BAD_CALLS if name not in OTHER_RANKS])
def test_same_errors_as_torch_ops(name, monkeypatch):
    """The bad calls of test_csrc, made through the package functions: the same exception."""

    def error(call) -> tuple[type, str]:
        with pytest.raises(Exception) as info:
            call()
        return info.type, str(info.value)

    want = error(BAD_CALLS[name])
    monkeypatch.setattr("test_csrc.mm", tg.matmul)
    monkeypatch.setattr("test_csrc.lin", tg.linear)
    assert error(BAD_CALLS[name]) == want


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (lambda: tg.matmul(None, randn(2, 2)), lambda: mm(None, randn(2, 2))),
        (lambda: tg.linear(randn(2, 2), None), lambda: lin(randn(2, 2), None)),
        (lambda: tg.linear(randn(2, 2), 3.0), lambda: lin(randn(2, 2), 3.0)),
    ],
)
def test_non_tensor_arguments_get_the_ops_error(ours, theirs):
    with pytest.raises(Exception) as want:
        theirs()
    with pytest.raises(want.type) as got:
        ours()
    assert str(got.value) == str(want.value)
    assert "tvm_gemm" in str(got.value)


def test_torch_function_subclass_and_mode_see_the_op():
    seen = []

    class Logged(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            seen.append(func)
            return super().__torch_function__(func, types, args, kwargs or {})

    a, b = randn(4, 6), randn(6, 2)
    out = tg.matmul(a.as_subclass(Logged), b)
    assert mm in seen or mm.default in seen, seen
    assert torch.equal(out.as_subclass(torch.Tensor), mm(a, b))

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    seen.clear()
    with Mode():
        tg.linear(a, b.t(), None, "relu")
    assert lin in seen or lin.default in seen, seen


def test_autograd_through_the_entry():
    a = randn(3, 4, dtype=torch.float64).requires_grad_()
    w = randn(5, 4, dtype=torch.float64).requires_grad_()
    bias = randn(5, dtype=torch.float64).requires_grad_()
    torch.autograd.gradcheck(lambda a, w, b: tg.linear(a, w, b, "gelu"), (a, w, bias))
    torch.autograd.gradcheck(tg.matmul, (a, w.t()))


def test_func_transforms_through_the_entry():
    a, b = randn(3, 4), randn(4, 2)
    g = torch.func.grad(lambda a: tg.matmul(a, b).sum())(a)
    torch.testing.assert_close(g, torch.ones(3, 2) @ b.T)
    xs = randn(6, 3, 4)
    got = torch.vmap(lambda x: tg.linear(x, b.t(), None, "relu"))(xs)
    torch.testing.assert_close(got, F.relu(xs @ b), rtol=1e-5, atol=1e-5)


def test_compile_fullgraph_puts_the_op_in_the_graph():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    model, b = tg.TVMLinear(4, 3, activation="relu"), randn(3, 2)
    fn = torch.compile(lambda x: tg.matmul(model(x), b), backend=backend, fullgraph=True)
    x = randn(5, 4)
    torch.testing.assert_close(fn(x), tg.matmul(model(x), b))
    targets = {node.target for node in graphs[0].graph.nodes}
    assert torch.ops.tvm_gemm.matmul.default in targets or mm in targets, targets
    assert torch.ops.tvm_gemm.linear.default in targets or lin in targets, targets


def test_entry_present_when_extension_is():
    # The package functions use the C++ entry whenever the extension is built.
    assert (entry._matmul_entry is not None) == (EXT is not None)


def test_threads_through_the_entry():
    """Threads calling the package functions at once each get their own right answer (these
    products are small: the entry keeps the GIL for them)."""
    import threading

    inputs = [(randn(40, 64, seed=s), randn(64, 24, seed=100 + s)) for s in range(4)]
    want = [mm(a, b) for a, b in inputs]
    got, errors = [None] * len(inputs), []

    def work(i):
        try:
            a, b = inputs[i]
            for _ in range(50):
                got[i] = tg.matmul(a, b)
                assert torch.equal(got[i], want[i])
        except Exception as err:  # reported below: an assert in a thread would be lost
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.skipif(EXT is None, reason="needs the C++ extension")
def test_large_products_let_go_of_the_gil():
    """A product past the entry's small-call limit runs without the GIL, as torch.ops does:
    a thread waiting for the GIL wakes while the call is still running. Held through the
    call, the GIL would go to the waiting thread only after the caller had written its end
    time (the next Python line), so "woke before the end" is the test; a bound on how soon
    would depend on the load (other test processes share the cores under ``-n``)."""
    import threading
    import time

    a, b = randn(2048, 2048, seed=1), randn(2048, 2048, seed=2)  # ~50 ms on 2 cores
    tg.matmul(a, b)  # (the kernel's build or load, first)
    started, times = threading.Event(), {}

    def work():
        times["start"] = time.perf_counter()
        started.set()
        tg.matmul(a, b)
        times["end"] = time.perf_counter()

    worker = threading.Thread(target=work)
    worker.start()
    started.wait()
    times["woke"] = time.perf_counter()
    worker.join()
    assert times["woke"] < times["end"], times

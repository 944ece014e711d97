"""torch.func (grad, vmap, jacrev, jvp), forward-mode AD and torch.autocast over the ops,
against the same calls on the torch reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import WeightCasts, assert_close, randn
from torch import nn
from torch.autograd import forward_ad

import torch_tvm_gemm as tg
from torch_tvm_gemm import ops


@pytest.fixture(params=["cpp", "python"])
def impl(request):
    if request.param == "cpp" and tg.ops.impl_path() != "cpp":
        pytest.skip("no C++ extension")
    previous = ops.use_impl(request.param)
    yield request.param
    ops.use_impl(previous)


ACTS = {
    "none": lambda t: t,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "silu": F.silu,
}


def pairs(act: str):
    """(tvm fn, torch fn) of (x, w, b) for each op."""
    conv_w = randn(4, 3, 3, 3, seed=5)
    yield (
        lambda x, w, b: tg.linear(x, w, b, act),
        lambda x, w, b: ACTS[act](F.linear(x, w, b)),
    )
    yield (lambda x, w, b: tg.matmul(x, w.t()) + b, lambda x, w, b: x @ w.t() + b)
    relu = act == "relu"
    yield (
        lambda x, w, b: tg.conv2d_bias_relu(
            x.view(1, 3, 4, 4), conv_w, b[:4], padding=1, relu=relu
        ),
        lambda x, w, b: (F.relu if relu else ACTS["none"])(
            F.conv2d(x.view(1, 3, 4, 4), conv_w, b[:4], padding=1)
        ),
    )


def args():
    return randn(3, 16, seed=1), randn(6, 16, seed=2), randn(6, seed=3)


@pytest.mark.parametrize("act", list(ACTS))
def test_grad_and_jacrev_match_torch(impl, act):
    x, w, b = args()
    for tvm_fn, ref_fn in pairs(act):
        for argnums in (0, 1, 2):
            got = torch.func.grad(lambda *a, f=tvm_fn: f(*a).sum(), argnums=argnums)(x, w, b)
            want = torch.func.grad(lambda *a, f=ref_fn: f(*a).sum(), argnums=argnums)(x, w, b)
            assert_close(got, want, k=16)
        got = torch.func.jacrev(tvm_fn, argnums=(0, 1))(x, w, b)
        want = torch.func.jacrev(ref_fn, argnums=(0, 1))(x, w, b)
        for g, r in zip(got, want, strict=True):
            assert_close(g, r, k=16)


@pytest.mark.parametrize("act", list(ACTS))
def test_jvp_and_forward_ad_give_the_right_tangents(impl, act):
    x, w, b = args()
    tangents = tuple(torch.randn_like(t) for t in (x, w, b))
    for tvm_fn, ref_fn in pairs(act):
        out, tangent = torch.func.jvp(tvm_fn, (x, w, b), tangents)
        ref_out, ref_tangent = torch.func.jvp(ref_fn, (x, w, b), tangents)
        assert_close(out, ref_out, k=16)
        assert_close(tangent, ref_tangent, k=16)
        assert tangent.abs().max() > 0
        with forward_ad.dual_level():
            duals = [forward_ad.make_dual(p, t) for p, t in zip((x, w, b), tangents, strict=True)]
            got = forward_ad.unpack_dual(tvm_fn(*duals)).tangent
        assert got is not None
        assert_close(got, ref_tangent, k=16)


@pytest.mark.parametrize("act", list(ACTS))
def test_second_derivatives_match_torch(impl, act):
    """A backward differentiated again (create_graph: gradient penalties, torch.func.hessian)
    gives torch's second derivatives, for every epilogue (aten::silu_backward has none)."""
    x, w, b = (t.requires_grad_() for t in args())
    for tvm_fn, ref_fn in pairs(act):
        found = []
        for fn in (tvm_fn, ref_fn):
            (gx,) = torch.autograd.grad(fn(x, w, b).square().sum(), x, create_graph=True)
            found.append(torch.autograd.grad(gx.square().sum(), (x, w, b), allow_unused=True))
        for got, want in zip(*found, strict=True):
            assert (got is None) == (want is None)
            if got is not None:
                assert_close(got, want, k=16)


@pytest.mark.parametrize("act", ["silu", "hardswish", "sigmoid", "relu6"])  # (torch has no
# second derivative of hardsigmoid)
def test_conv_second_derivatives_match_torch(impl, act):
    from torch_tvm_gemm.kernels.conv2d import torch_activation

    x, w, b = randn(1, 3, 5, 5).requires_grad_(), randn(4, 3, 3, 3), randn(4)
    found = []
    for fn in (
        lambda x: tg.conv2d_bias_relu(x, w, b, padding=1, activation=act),
        lambda x: torch_activation(act)(F.conv2d(x, w, b, padding=1)),
    ):
        (gx,) = torch.autograd.grad(fn(x).square().sum(), x, create_graph=True)
        found.append(torch.autograd.grad(gx.square().sum(), x)[0])
    assert_close(*found, k=27)


def test_outputs_made_with_gradients_are_freed_without_the_garbage_collector(impl):
    """An op's output made with gradients wanted is freed when its last reference goes, as
    torch's are: the autograd node does not hold its own output (a reference cycle that only
    Python's garbage collector broke kept every output, and its memory, alive until then)."""
    import gc
    import weakref

    x, w, b = args()
    x.requires_grad_()
    gc.disable()
    try:
        for tvm_fn, _ in pairs("relu"):
            out = tvm_fn(x, w, b)
            assert out.grad_fn is not None
            alive = weakref.ref(out)
            del out
            assert alive() is None
    finally:
        gc.enable()


def test_vmap_matches_torch(impl):
    x, w, b = randn(5, 3, 16), randn(6, 16), randn(6)
    got = torch.func.vmap(lambda xi: tg.linear(xi, w, b, "silu"))(x)
    assert_close(got, F.silu(F.linear(x, w, b)), k=16)
    per_sample = torch.func.vmap(
        torch.func.grad(lambda w, xi: tg.linear(xi, w, b, "gelu").sum()), in_dims=(None, 0)
    )(w, x)
    want = torch.func.vmap(
        torch.func.grad(lambda w, xi: F.gelu(F.linear(xi, w, b)).sum()), in_dims=(None, 0)
    )(w, x)
    assert_close(per_sample, want, k=16)


def test_vmap_rules_fold_or_loop_like_torch(impl):
    x, ws, b = randn(3, 16), randn(4, 6, 16), randn(6)
    got = torch.func.vmap(lambda w: tg.linear(x, w, b, "relu"))(ws)  # batched weight: per sample
    assert_close(got, F.relu(torch.einsum("mk,bnk->bmn", x, ws) + b), k=16)
    a3, a4, m = randn(2, 5, 7), randn(3, 2, 5, 7), randn(7, 4)
    assert_close(torch.func.vmap(lambda a: tg.matmul(a, m))(a3), a3 @ m, k=7)  # folded
    assert_close(
        torch.func.vmap(lambda a: tg.matmul(a, m), in_dims=1)(a4), (a4 @ m).movedim(1, 0), k=7
    )
    images, w = randn(2, 3, 3, 6, 6), randn(4, 3, 3, 3)
    got = torch.func.vmap(lambda t: tg.conv2d_bias_relu(t, w, b[:4], padding=1))(images)
    want = F.relu(F.conv2d(images.flatten(0, 1), w, b[:4], padding=1)).unflatten(0, (2, 3))
    assert_close(got, want, k=27)


VMAP_MATMUL_CASES = [  # (a, b, in_dims): every batching of 2-D and 3-D samples
    ((4, 5, 6), (4, 6, 3), (0, 0)),
    ((5, 4, 6), (4, 6, 3), (1, 0)),
    ((5, 6), (4, 6, 3), (None, 0)),
    ((2, 5, 6), (4, 6, 3), (None, 0)),
    ((4, 2, 5, 6), (4, 6, 3), (0, 0)),
    ((4, 5, 6), (4, 2, 6, 3), (0, 0)),
    ((4, 1, 5, 6), (4, 2, 6, 3), (0, 0)),
    ((4, 2, 5, 6), (2, 6, 3), (0, None)),
    ((0, 5, 6), (0, 6, 3), (0, 0)),
]


@pytest.mark.parametrize("a_shape,b_shape,in_dims", VMAP_MATMUL_CASES, ids=str)
def test_vmap_matmul_is_one_call(impl, a_shape, b_shape, in_dims, monkeypatch):
    from torch_tvm_gemm import vmap_rules

    def no_loop(*args):
        raise AssertionError("vmap of matmul ran per sample")

    monkeypatch.setattr(vmap_rules, "_per_sample", no_loop)
    a, b = randn(*a_shape), randn(*b_shape)
    got = torch.func.vmap(tg.matmul, in_dims=in_dims)(a, b)
    want = torch.func.vmap(torch.matmul, in_dims=in_dims)(a, b)
    assert got.shape == want.shape
    assert_close(got, want, k=6)
    grads = torch.func.vmap(torch.func.grad(lambda a, b: tg.matmul(a, b).sum()), in_dims)(a, b)
    ref = torch.func.vmap(torch.func.grad(lambda a, b: torch.matmul(a, b).sum()), in_dims)(a, b)
    assert_close(grads, ref, k=6)


def test_vmap_matmul_errors_name_a_sample(impl):
    with pytest.raises(ValueError, match=r"inner dims differ: a is \(5, 6\), b is \(7, 3\)"):
        torch.func.vmap(tg.matmul)(randn(4, 5, 6), randn(4, 7, 3))


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_autocast_casts_like_torch(impl, dtype):
    x, w, b = args()
    w.requires_grad_()
    with torch.autocast("cpu", dtype=dtype):
        for tvm_fn, ref_fn in pairs("gelu"):
            got, want = tvm_fn(x, w, b), ref_fn(x, w, b)
            assert got.dtype == want.dtype  # (the matmul pair adds an fp32 bias after it)
            assert_close(got.to(dtype), want, k=16)  # at bf16 tolerance
        assert tg.linear(x, w, b).dtype == dtype
        mixed = tg.linear(x.to(dtype), w, b)  # a bf16 activation meets fp32 weights
        assert mixed.dtype == dtype
    mixed.float().sum().backward()
    assert w.grad.dtype == torch.float32


def test_autocast_keeps_a_weights_cast_while_it_is_unchanged():
    """Under autocast a weight (a float32 leaf that requires grad) is cast once and the cast
    kept across autocast regions (torch casts it once per region), made again after each kind
    of write to the weight; the activations are cast at every call. With gradients wanted the
    gradient reaches the fp32 weight; with the autocast cache off every call casts; the kept
    cast goes with its weight."""
    import gc
    import weakref

    from torch_tvm_gemm import autocast

    x, w, b = args()
    w = nn.Parameter(w)

    def bf16():  # (a new context each time: an autocast object is not reentrant)
        return torch.autocast("cpu", dtype=torch.bfloat16)

    def expected():
        with torch.no_grad(), bf16():
            return F.linear(x, w, b)

    with WeightCasts(w.shape) as casts, torch.no_grad():
        for _ in range(3):  # three regions: one cast
            with bf16():
                assert_close(tg.linear(x, w, b), expected(), k=16)
        assert casts.count == 1 + 3  # (and F.linear's, one a region)
        for write in (
            lambda: w.mul_(2.0),  # counted by torch
            lambda: w.data.mul_(0.5),  # through .data
            lambda: w.detach().numpy().__imul__(3.0),  # a numpy view made after the cast
        ):
            write()
            with bf16():
                assert_close(tg.linear(x, w, b), expected(), k=16)
        assert casts.count == 4 + 3 + 3
    with bf16():  # with gradients: through the kept cast, to the fp32 weight
        with WeightCasts(w.shape) as casts:
            tg.linear(x, w, b).float().square().sum().backward()
        assert casts.count == 1  # (the gradient's cast back; the weight is not cast again)
        got, w.grad = w.grad, None
        F.linear(x, w, b).float().square().sum().backward()
    assert got.dtype == torch.float32
    assert_close(got, w.grad, k=64)
    with WeightCasts(w.shape) as casts, torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            for _ in range(2):
                tg.linear(x, w, b)
        assert casts.count == 2

    def _cast_bytes():
        return tg.kept_bytes().get("autocast casts", 0)

    def cast_a_weight_and_drop_it():
        gc.collect()  # (earlier tests' weights left in cycles would go in the count below)
        before = _cast_bytes()
        other = nn.Parameter(randn(60, 16, seed=4))
        with torch.no_grad(), bf16():
            tg.linear(x, other)
        assert _cast_bytes() == before + 60 * 16 * 2  # (its bf16 copy)
        return weakref.ref(other), before

    alive, before = cast_a_weight_and_drop_it()
    gc.collect()
    assert alive() is None and _cast_bytes() == before
    autocast.clear_kept_casts()
    assert _cast_bytes() == 0
    assert not torch.is_autocast_enabled("cpu")


def test_autocast_training_step_of_a_converted_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 4))
    reference = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 4))
    reference.load_state_dict(model.state_dict())
    tg.convert(model)
    x = randn(8, 16)
    for m in (model, reference):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(x)
        assert out.dtype == torch.bfloat16
        out.float().square().mean().backward()
    for p, q in zip(reference.parameters(), model.parameters(), strict=True):
        assert q.grad.dtype == torch.float32
        torch.testing.assert_close(q.grad, p.grad, rtol=5e-2, atol=5e-2 * p.grad.abs().max())

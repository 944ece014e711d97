"""FX fusion of conv -> (BN) -> ReLU6 / hardswish / SiLU / leaky ReLU / sigmoid /
hardsigmoid into the conv op, and convert() on a MobileNetV2-style block and a
squeeze-and-excitation gate."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import WeightCasts, assert_close, randn
from torch import nn

import torch_tvm_gemm as tg
from torch_tvm_gemm import TVMConv2dBiasReLU
from torch_tvm_gemm.fold import TVMConv2dBN

OP = torch.ops.tvm_gemm.conv2d_bias_relu

# Each spelling of each activation, and the epilogue it must become.
ACTS = {
    "ReLU6": (nn.ReLU6(), "relu6"),
    "ReLU6-inplace": (nn.ReLU6(inplace=True), "relu6"),
    "F.relu6": (F.relu6, "relu6"),
    "Hardtanh(0,6)": (nn.Hardtanh(0.0, 6.0), "relu6"),
    "F.hardtanh(0,6)": (lambda t: F.hardtanh(t, 0.0, 6.0), "relu6"),
    "Hardswish": (nn.Hardswish(), "hardswish"),
    "F.hardswish": (F.hardswish, "hardswish"),
    "SiLU": (nn.SiLU(), "silu"),
    "SiLU-inplace": (nn.SiLU(inplace=True), "silu"),
    "F.silu": (F.silu, "silu"),
    "LeakyReLU": (nn.LeakyReLU(), "leaky_relu"),
    "LeakyReLU-inplace": (nn.LeakyReLU(0.01, inplace=True), "leaky_relu"),
    "F.leaky_relu": (F.leaky_relu, "leaky_relu"),
    "F.leaky_relu(0.01)": (lambda t: F.leaky_relu(t, negative_slope=0.01), "leaky_relu"),
    "LeakyReLU(0.1)": (nn.LeakyReLU(0.1), "leaky_relu_0.1"),
    "F.leaky_relu(0.2)": (lambda t: F.leaky_relu(t, 0.2), "leaky_relu_0.2"),
    "F.leaky_relu_(x, 0)": (lambda t: F.leaky_relu_(t, 0), "leaky_relu_0.0"),
    # squeeze-and-excitation gates (timm's nn.Sigmoid, torchvision's scale_activation)
    "Sigmoid": (nn.Sigmoid(), "sigmoid"),
    "torch.sigmoid": (torch.sigmoid, "sigmoid"),
    ".sigmoid()": (lambda t: t.sigmoid(), "sigmoid"),
    "Hardsigmoid": (nn.Hardsigmoid(), "hardsigmoid"),
    "F.hardsigmoid": (F.hardsigmoid, "hardsigmoid"),
}


class ConvAct(nn.Module):
    def __init__(self, act, bias=True, bn=False):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=bias)
        self.bn = nn.BatchNorm2d(8) if bn else nn.Identity()
        self.act = act

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


def _with_stats(model: nn.Module) -> nn.Module:
    for m in model.modules():  # non-trivial BN statistics, as after training
        if isinstance(m, nn.BatchNorm2d):
            with torch.no_grad():
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    return model.eval()


def _epilogues(gm) -> list[str]:
    """The epilogue of every fused conv the traced module runs."""
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is OP:
            args = list(node.args) + [True, None][len(node.args) - 7 :]
            found.append(args[8] or ("relu" if args[7] else "none"))
        elif node.op == "call_module":
            mod = gm.get_submodule(node.target)
            if isinstance(mod, (TVMConv2dBiasReLU, TVMConv2dBN)):
                found.append(mod.activation)
    return found


@pytest.mark.parametrize("bn", [False, True], ids=["conv", "conv-bn"])
@pytest.mark.parametrize("name", ACTS)
def test_conv_act_fuses(name, bn):
    act, epilogue = ACTS[name]
    model = _with_stats(ConvAct(act, bn=bn))
    x = 3 * randn(2, 3, 10, 9)  # (values past 6 and below -3: every branch of the epilogues)
    expected = model(x)
    gm, summary = tg.fuse_conv_bias_relu(model)
    assert len(summary.fused) == 1 and not summary.skipped, summary
    assert _epilogues(gm) == [epilogue]
    assert_close(gm(x), expected, k=200)


@pytest.mark.parametrize("epilogue", ["relu6", "hardswish", "silu"])
def test_functional_conv_add_bias_act_fuses(epilogue):
    act = {"relu6": F.relu6, "hardswish": F.hardswish, "silu": F.silu}[epilogue]

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(randn(8, 3, 3, 3))
            self.b = nn.Parameter(randn(8))

        def forward(self, x):
            return act(F.conv2d(x, self.w, None, 1, 1) + self.b.view(1, -1, 1, 1))

    model = M()
    x = 3 * randn(2, 3, 8, 8)
    gm, summary = tg.fuse_conv_bias_relu(model)
    assert len(summary.fused) == 1 and f"add+{epilogue}" in summary.fused[0], summary
    assert _epilogues(gm) == [epilogue]
    assert_close(gm(x), model(x), k=27)


@pytest.mark.parametrize(
    "act, name",
    [
        (nn.Hardtanh(-1.0, 1.0), "Hardtanh"),
        (nn.LeakyReLU(-0.1), "LeakyReLU"),
        (lambda t: F.leaky_relu(t, -0.5), "leaky_relu"),
    ],
    ids=["Hardtanh(-1,1)", "LeakyReLU(-0.1)", "F.leaky_relu(-0.5)"],
)
def test_other_bounds_and_slopes_are_not_fused(act, name):
    model = _with_stats(ConvAct(act, bn=True))
    x = randn(2, 3, 10, 9)
    gm, summary = tg.fuse_conv_bias_relu(model)
    assert _epilogues(gm) == ["none"]  # the BN is folded, the activation stays
    assert f"{name} after it is not fused" in summary.fused[0]
    assert_close(gm(x), model(x), k=27)


def test_fused_module_repr_and_relu_flag():
    conv = nn.Conv2d(3, 4, 3)
    fused = TVMConv2dBiasReLU.from_conv(conv, activation="hardswish")
    assert "activation='hardswish'" in repr(fused) and not fused.relu
    fused.relu = True
    assert fused.activation == "relu"
    with pytest.raises(ValueError, match="activation must be one of"):
        TVMConv2dBiasReLU.from_conv(conv, activation="gelu")


class InvertedResidual(nn.Module):
    """MobileNetV2's block: 1x1 expand -> BN -> ReLU6, 3x3 depthwise -> BN -> ReLU6, 1x1
    project -> BN (no activation), plus the residual."""

    def __init__(self, c: int, expand: int = 4) -> None:
        super().__init__()
        h = c * expand
        self.conv = nn.Sequential(
            nn.Conv2d(c, h, 1, bias=False),
            nn.BatchNorm2d(h),
            nn.ReLU6(inplace=True),
            nn.Conv2d(h, h, 3, padding=1, groups=h, bias=False),
            nn.BatchNorm2d(h),
            nn.ReLU6(inplace=True),
            nn.Conv2d(h, c, 1, bias=False),
            nn.BatchNorm2d(c),
        )

    def forward(self, x):
        return x + self.conv(x)


def test_mobilenet_v2_block_fused_end_to_end():
    model = _with_stats(nn.Sequential(InvertedResidual(16), InvertedResidual(16)))
    x = 3 * randn(2, 16, 12, 12)
    expected = model(x)
    gm, summary = tg.fuse_conv_bias_relu(model)
    assert len(summary.fused) == 6 and not summary.skipped, summary
    assert _epilogues(gm) == ["relu6", "relu6", "none"] * 2
    assert not any(isinstance(m, (nn.ReLU6, nn.BatchNorm2d)) for m in gm.modules())
    assert_close(gm(x), expected, k=600)

    converted = tg.convert(model, inplace=False)  # the live-folding path of convert()
    layers = converted.conversion_summary.layers
    assert sum(v.startswith("fused") for v in layers.values()) == 6, layers
    # (the traced region's graph is kept beside the model, not as a submodule)
    traced = [
        m.__dict__["_tvm_traced"].gm for m in converted.modules() if "_tvm_traced" in m.__dict__
    ]
    assert [a for gm in traced for a in _epilogues(gm)] == ["relu6", "relu6", "none"] * 2
    assert_close(converted(x), expected, k=600)


class SqueezeExcite(nn.Module):
    """timm's / torchvision's squeeze-and-excitation: pooled, reduced, expanded, a gate."""

    def __init__(self, c, gate):
        super().__init__()
        self.reduce, self.expand = nn.Conv2d(c, c // 4, 1), nn.Conv2d(c // 4, c, 1)
        self.act, self.gate = nn.ReLU(inplace=True), gate

    def forward(self, x):
        s = self.act(self.reduce(x.mean((2, 3), keepdim=True)))
        return x * self.gate(self.expand(s))


@pytest.mark.parametrize(
    "gate, epilogue", [(nn.Sigmoid(), "sigmoid"), (nn.Hardsigmoid(), "hardsigmoid")]
)
def test_squeeze_excitation_gate_fused(gate, epilogue):
    # The expand conv's one user is the gate: fused, on one pixel an image (the GEMM kernel
    # with the gate as its epilogue); the product with x stays torch's.
    model = SqueezeExcite(32, gate).eval()
    x = randn(3, 32, 6, 5)
    expected = model(x)
    converted = tg.convert(model, inplace=False)
    layers = converted.conversion_summary.layers
    assert layers["expand"].startswith("fused") and layers["reduce"].startswith("fused"), layers
    traced = [
        m.__dict__["_tvm_traced"].gm for m in converted.modules() if "_tvm_traced" in m.__dict__
    ]
    assert sorted(a for gm in traced for a in _epilogues(gm)) == sorted(["relu", epilogue])
    assert_close(converted(x), expected, k=32)
    assert_close(converted(x[:1]), expected[:1], k=32)


def test_bn_fold_follows_writes_counted_by_torch_or_not(monkeypatch):
    """A kept fold is redone after every kind of write to the conv's and BN's tensors: one
    torch counts in the version, one through ``.data`` (not counted: seen by the storage's
    copy-on-write mark), one through a numpy view made after the fold; only a numpy view
    kept from before a fold and written after it needs ``refold()``. Nothing else refolds,
    and marking the storage copies nothing (the weight keeps its address)."""
    import torch_tvm_gemm.fold as fold

    folds, real_fold = [], fold.fold_conv_bn
    monkeypatch.setattr(fold, "fold_conv_bn", lambda *a: folds.append(1) or real_fold(*a))
    conv, bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8).eval()
    with torch.no_grad():
        bn.running_var.uniform_(0.5, 2.0)
    address = conv.weight.data_ptr()
    fused = TVMConv2dBN(conv, bn, "relu6")
    x = randn(2, 3, 9, 9)

    def expected():
        return F.relu6(bn(conv(x)))

    with torch.no_grad():
        for _ in range(3):  # folded once, kept
            assert_close(fused(x), expected(), k=200)
        assert len(folds) == 1
        _every_write_seen(fused, x, expected, [conv.weight, bn.running_var, conv.bias], k=200)
        assert len(folds) == 1 + 3 * 3 + 2
        assert conv.weight.data_ptr() == address  # written in place, never copied


def _every_write_seen(fused, x, expected, tensors, k) -> None:
    """Writes each of ``tensors`` three ways and checks ``fused(x)`` against ``expected()``
    after each: counted by torch, through ``.data`` (not counted: seen by the storage's
    copy-on-write mark), through a numpy view made after the kept copy. Then a numpy view
    made before the kept copy and written after it, which ``refold()`` makes seen: two more
    derivations (making the view took the tensor for writing; then ``refold()``)."""
    for t in tensors:
        t.mul_(2.0)  # counted by torch
        assert_close(fused(x), expected(), k=k)
        t.data.mul_(0.5)  # through .data
        assert_close(fused(x), expected(), k=k)
        t.detach().numpy()[...] *= 3.0  # a numpy view made after the kept copy
        assert_close(fused(x), expected(), k=k)
    view = tensors[-1].detach().numpy()
    fused(x)  # (derived again, then kept)
    view += 1.0  # a view from before that: not seen
    fused.refold()
    assert_close(fused(x), expected(), k=k)


def test_bn_fold_follows_a_parametrized_weight_and_replaced_tensors():
    """The fold's check reads the modules' own dicts; a weight that is a parametrization's
    property (no plain parameter: folded at every call) and a BN buffer replaced by another
    tensor are seen too. The parametrization here hands out a fresh tensor of version 0 at
    one address every time (as the allocator often does), which no (version, address) key
    could tell from the last one."""
    import numpy as np
    from torch.nn.utils import parametrize

    class Doubled(nn.Module):
        def __init__(self, shape) -> None:
            super().__init__()
            self.out = np.empty(shape, dtype=np.float32)

        def forward(self, w):
            self.out[...] = (2 * w).detach().numpy()
            return torch.from_numpy(self.out)

    conv, bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8).eval()
    parametrize.register_parametrization(conv, "weight", Doubled(tuple(conv.weight.shape)))
    fused = TVMConv2dBN(conv, bn, "relu")
    x = randn(2, 3, 9, 9)
    with torch.no_grad():
        assert_close(fused(x), F.relu(bn(conv(x))), k=200)
        conv.parametrizations.weight.original.mul_(-1.0)
        assert_close(fused(x), F.relu(bn(conv(x))), k=200)
        bn.running_mean = torch.full_like(bn.running_mean, 0.5)
        assert_close(fused(x), F.relu(bn(conv(x))), k=200)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_bn_fold_kept_in_the_layout_the_conv_reads(dtype):
    """The fold is kept channels_last where the op runs the bf16 implicit GEMM over NHWC
    pixels (which reads a (K, R, S, C) weight: any other it permutes at every call), else
    contiguous; the answer is the same either way, and a counted write still refolds."""
    from torch_tvm_gemm.fold import fold_conv_bn
    from torch_tvm_gemm.ops.conv_ops import conv2d_spec
    from torch_tvm_gemm.schedules.cpu_conv2d import nhwc_kernel

    conv, bn = nn.Conv2d(16, 32, 3, padding=1).to(dtype), nn.BatchNorm2d(32).eval().to(dtype)
    fused = TVMConv2dBN(conv, bn, "relu")
    x = randn(2, 16, 10, 10, dtype=dtype)
    spec = conv2d_spec(x, conv.weight, conv.bias, [1, 1], [1, 1], [1, 1], 1, True)
    nhwc = nhwc_kernel(spec) is not None  # (bf16 on AMX or AVX512-BF16 CPUs)

    def expected():
        w, b = (t.double() for t in fold_conv_bn(conv, bn))
        return F.relu(F.conv2d(x.double(), w, b, padding=1))

    with torch.no_grad():
        assert_close(fused(x), expected(), k=16 * 9)
        folded = fused._kept.value[0]
        assert folded.is_contiguous(memory_format=torch.channels_last) == nhwc
        assert folded.is_contiguous() != nhwc
        conv.weight.mul_(-1.0)
        assert_close(fused(x), expected(), k=16 * 9)


def test_fp32_fold_channels_last_where_few_pixels_and_refolded_for_another_size(monkeypatch):
    """At 7x7 output pixels an fp32 conv is a GEMM over channels-last patches, which reads a
    channels_last weight in place: the fold is kept so; an input of another size (28x28: the
    conv kernel, which reads a contiguous weight) folds again, in that layout. (A small
    conv: the route's least work is lowered.)"""
    from torch_tvm_gemm.fold import fold_conv_bn
    from torch_tvm_gemm.ops import conv_ops
    from torch_tvm_gemm.schedules import cpu_conv2d

    monkeypatch.setattr(cpu_conv2d, "PATCHES_GEMM_MIN_WORK", 0)
    monkeypatch.setattr(conv_ops, "_GEOMETRIES", {})

    conv, bn = nn.Conv2d(16, 24, 3, padding=1), nn.BatchNorm2d(24).eval()
    with torch.no_grad():
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
    fused = TVMConv2dBN(conv, bn, "relu")
    w, b = fold_conv_bn(conv, bn)
    with torch.no_grad():
        for size, channels_last in ((7, True), (28, False), (7, True)):
            x = randn(2, 16, size, size)
            assert_close(fused(x), F.relu(F.conv2d(x, w, b, padding=1)), k=16 * 9)
            folded = fused._kept.value[0]
            assert folded.is_contiguous(memory_format=torch.channels_last) == channels_last
            assert folded.is_contiguous() != channels_last


def test_conv_module_keeps_its_weight_channels_last_and_follows_writes(monkeypatch):
    """A fused conv without BN (VGG's conv + ReLU) on a channels_last input: the op reads a
    channels_last weight in place, so the module keeps a channels_last copy of its own
    weight, made once and again after each kind of write (counted by torch, through
    ``.data``, through a numpy view made after the copy; one made before needs
    ``refold()``), never writing the weight itself; a contiguous input takes the weight as it
    is, and with gradients wanted the kept copy reaches the op as a function of the weight
    (no copy per call)."""
    import torch_tvm_gemm.conv_module as conv_module

    relayouts, real = [], conv_module.weight_layout
    monkeypatch.setattr(conv_module, "weight_layout", lambda *a: relayouts.append(1) or real(*a))
    conv = nn.Conv2d(16, 32, 3, padding=1)
    fused = TVMConv2dBiasReLU.from_conv(conv)
    x = randn(2, 16, 9, 9).contiguous(memory_format=torch.channels_last)
    assert real(x, conv.weight, [1, 1], [1, 1], [1, 1], 1) == torch.channels_last
    address = conv.weight.data_ptr()

    def expected(x=x):
        return F.relu(conv(x))

    with torch.no_grad():
        for _ in range(3):  # copied once, kept
            assert_close(fused(x), expected(), k=16 * 9)
        assert len(relayouts) == 1
        kept = fused._kept.value[0]
        assert kept.is_contiguous(memory_format=torch.channels_last)
        assert kept.data_ptr() != conv.weight.data_ptr()
        _every_write_seen(fused, x, expected, [conv.weight], k=16 * 9)
        assert len(relayouts) == 1 + 3 + 2
        assert conv.weight.data_ptr() == address  # written in place, never copied
        plain = x.contiguous()  # the conv kernel reads the contiguous weight itself
        assert_close(fused(plain), expected(plain), k=16 * 9)
        assert fused._kept.value[0] is conv.weight
    fused(x)  # (copied again: the contiguous input's copy was the weight itself)
    count = len(relayouts)
    for _ in range(2):  # with gradients: the kept copy, which the gradient goes through
        y = fused(x)
        (grad,) = torch.autograd.grad(y.sum(), conv.weight)
        (want,) = torch.autograd.grad(expected().sum(), conv.weight)
        assert_close(grad, want, k=2 * 81)
    assert len(relayouts) == count


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last], ids=str)
def test_bn_fold_kept_with_gradients_wanted(monkeypatch, layout):
    """An eval-mode model called with gradients wanted (outside ``no_grad()``): the kept fold
    reaches the op as a function of the conv's and BN's parameters, folded once, not at every
    call. The gradients of the input and of the four parameters are torch's, a double backward
    too; an optimizer step refolds."""
    import torch_tvm_gemm.fold as fold

    folds, real_fold = [], fold.fold_conv_bn
    monkeypatch.setattr(fold, "fold_conv_bn", lambda *a: folds.append(1) or real_fold(*a))
    conv, bn = nn.Conv2d(3, 8, 3, padding=1), _with_stats(nn.BatchNorm2d(8)).eval()
    fused = TVMConv2dBN(conv, bn, "relu")
    params = [conv.weight, conv.bias, bn.weight, bn.bias]
    x = randn(2, 3, 7, 7).contiguous(memory_format=layout).requires_grad_()
    for step in range(3):
        for module in (fused, fused, lambda x: F.relu(bn(conv(x)))):  # (fused: twice)
            y = module(x)
            grads = torch.autograd.grad(y.square().sum(), [x, *params], create_graph=True)
            # (and through the gradients: a second derivative, by the BN's scale)
            second = torch.autograd.grad(grads[1].square().sum(), bn.weight)
            if module is fused:
                got = (y, *grads, *second)
            else:
                for g, want in zip(got, (y, *grads, *second), strict=True):
                    assert_close(g, want, k=200)
        assert len(folds) == 1 + step
        with torch.no_grad():
            for p, g in zip(params, grads[1:], strict=True):
                p -= 0.01 * g


def test_bn_fold_kept_in_the_autocast_dtype(monkeypatch):
    """Under autocast the fold is kept in the dtype the op runs in (its autocast kernel would
    cast it at every call): folded once across regions, again outside autocast; outputs as
    torch's under autocast, gradients in fp32 on the parameters."""
    import torch_tvm_gemm.fold as fold

    folds, real_fold = [], fold.fold_conv_bn
    monkeypatch.setattr(fold, "fold_conv_bn", lambda *a: folds.append(1) or real_fold(*a))
    conv, bn = nn.Conv2d(8, 16, 3, padding=1), _with_stats(nn.BatchNorm2d(16)).eval()
    fused = TVMConv2dBN(conv, bn, "relu")
    x = randn(1, 8, 9, 9)
    for _ in range(3):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            got, want = fused(x), F.relu(bn(conv(x)))
        assert got.dtype == torch.bfloat16
        assert_close(got, want, k=72)
    assert len(folds) == 1 and fused._kept.value[0].dtype == torch.bfloat16
    with torch.no_grad():
        assert_close(fused(x), F.relu(bn(conv(x))), k=72)  # (fp32 again: folded again)
    assert len(folds) == 2
    grads = []
    for module in (fused, lambda x: F.relu(bn(conv(x)))):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = module(x)
        grads.append(torch.autograd.grad(y.float().square().sum(), [conv.weight, bn.weight]))
    for got, want in zip(*grads, strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2 * want.abs().max().item())


def test_conv_module_keeps_its_copy_in_the_autocast_dtype():
    """Under autocast the fused conv's kept channels_last copy (VGG's conv + ReLU in a
    channels_last region) is kept in the dtype the op runs in, cast once across regions
    (the op's autocast kernel would cast a copy, not a leaf, at every call), again after a
    write; outputs as torch's under autocast, the gradient in fp32 on the weight."""
    conv = nn.Conv2d(32, 64, 3, padding=1)  # (in bf16: read channels_last)
    fused = TVMConv2dBiasReLU.from_conv(conv)
    x = randn(1, 32, 9, 9).contiguous(memory_format=torch.channels_last)

    def bf16():  # (a new context each time: an autocast object is not reentrant)
        return torch.autocast("cpu", dtype=torch.bfloat16)

    def check():
        with bf16():
            got, want = fused(x), F.relu(conv(x))
        assert got.dtype == torch.bfloat16
        assert_close(got, want, k=32 * 9)

    with WeightCasts(conv.weight.shape) as casts, torch.no_grad():
        for _ in range(3):
            check()
        kept = fused._kept.value[0]
        assert kept.dtype == torch.bfloat16 and kept.is_contiguous(
            memory_format=torch.channels_last
        )
        assert casts.count == 1 + 3  # (and F.conv2d's, one a region)
        conv.weight.mul_(0.5)
        check()
        assert casts.count == 4 + 2
    grads = []
    for module in (fused, lambda x: F.relu(conv(x))):
        with bf16():
            y = module(x)
        grads.append(torch.autograd.grad(y.float().square().sum(), conv.weight)[0])
    assert grads[0].dtype == torch.float32
    torch.testing.assert_close(*grads, rtol=5e-2, atol=5e-2 * grads[1].abs().max().item())


def test_kept_bytes_counts_the_kept_copies_by_kind():
    """``kept_bytes()`` counts each kept copy once a call made it, by kind, not a weight handed
    to the op as it is, and drops it with its module (a copy or a pickle keeps the kind)."""
    import copy
    import gc

    def kept(kind):
        return tg.kept_bytes().get(kind, 0)

    conv, bn = nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32).eval()
    relaid, folded = TVMConv2dBiasReLU.from_conv(conv), TVMConv2dBN(conv, bn, "relu")
    x = randn(1, 16, 9, 9)
    gc.collect()  # (other tests' modules that are garbage now: not counted below)
    before = {kind: kept(kind) for kind in ("relaid conv weights", "bn folds")}
    with torch.no_grad():
        relaid(x)  # (a contiguous input: the weight itself, no copy)
        assert kept("relaid conv weights") == before["relaid conv weights"]
        relaid(x.contiguous(memory_format=torch.channels_last))
        folded(x)
    weight_bytes = conv.weight.numel() * 4
    assert kept("relaid conv weights") == before["relaid conv weights"] + weight_bytes
    assert kept("bn folds") == before["bn folds"] + weight_bytes + 32 * 4  # (and the bias)
    assert copy.deepcopy(relaid)._kept.kind == "relaid conv weights"
    del relaid, folded
    gc.collect()
    assert {kind: kept(kind) for kind in before} == before


def test_conv_modules_pickled_without_kept_weights_still_run():
    """A fused conv pickled by a version that kept no weights (no ``_kept``) loads and runs."""
    import pickle

    conv, bn = nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8).eval()
    x = randn(1, 4, 6, 6).contiguous(memory_format=torch.channels_last)
    for module, expected in (
        (TVMConv2dBiasReLU.from_conv(conv), lambda: F.relu(conv(x))),
        (TVMConv2dBN(conv, bn, "relu"), lambda: F.relu(bn(conv(x)))),
    ):
        del module.__dict__["_kept"]
        loaded = pickle.loads(pickle.dumps(module))
        with torch.no_grad():
            assert_close(loaded(x), expected(), k=36)

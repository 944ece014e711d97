"""convert() on transformers' mixture-of-experts models: the experts' 3-D weights run on the
linear op (moe_experts.py), outputs and gradients as eager."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import torch_tvm_gemm as tg
from torch_tvm_gemm import moe_experts
from torch_tvm_gemm.moe_experts import experts_forward

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
moe = pytest.importorskip("transformers.integrations.moe")


def mixtral():
    config = transformers.MixtralConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=50,
    )
    return transformers.MixtralModel(config)


def gpt_oss():
    # experts stored (in, out) with biases, gate and up interleaved, a clamped SwiGLU gate
    config = transformers.GptOssConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=48,
        head_dim=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=50,
        layer_types=["full_attention", "full_attention"],
    )
    return transformers.GptOssModel(config)


def qwen2_moe():
    # a shared expert (nn.Linear layers) beside the routed ones
    config = transformers.Qwen2MoeConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=2,
        vocab_size=50,
    )
    return transformers.Qwen2MoeModel(config)


FAMILIES = {"mixtral": mixtral, "gpt_oss": gpt_oss, "qwen2_moe": qwen2_moe}


def _randomize(model: nn.Module) -> nn.Module:
    # Some inits leave biases (and gpt-oss's sinks) at zero: give every parameter values.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1 and not p.abs().max() > 0:
                p.uniform_(-0.1, 0.1)
    return model.eval()


def _ids():
    return torch.randint(0, 50, (2, 12))


def _linear_calls(fn) -> int:
    # (no_grad: with autograd the op's entry is recorded twice)
    with torch.profiler.profile() as prof, torch.no_grad():
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == "tvm_gemm::linear")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_moe_family_converts_and_matches_eager(family):
    torch.manual_seed(0)
    model = _randomize(FAMILIES[family]())
    reference = copy.deepcopy(model)
    keys = list(model.state_dict())
    ids = _ids()
    with torch.no_grad():
        expected = reference(input_ids=ids).last_hidden_state
        tg.convert(model)
        got = model(input_ids=ids).last_hidden_state
    summary = model.conversion_summary
    experts = {f: w for f, w in summary.layers.items() if summary.kinds[f] == "experts"}
    assert len(experts) == 2 and all(w.startswith("swapped") for w in experts.values()), summary
    assert "experts" in summary.line()
    assert summary.converted("linear") == summary.found("linear") - _routers(model), summary
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()
    assert list(model.state_dict()) == keys


def _routers(model: nn.Module) -> int:
    # routers that are nn.Linear subclasses with their own forward stay on torch (and say so)
    return sum(1 for w in model.conversion_summary.layers.values() if "overrides" in w)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("gate_once", [True, False], ids=["gate-once", "gate-per-expert"])
def test_moe_family_training_step(family, gate_once, monkeypatch):
    monkeypatch.setattr(moe_experts, "GATE_ONCE_MAX", 1 << 30 if gate_once else 0)
    torch.manual_seed(0)
    model = _randomize(FAMILIES[family]())
    converted = tg.convert(copy.deepcopy(model))
    ids = _ids()
    weights = torch.randn(2, 12, 32)
    for m in (model, converted):
        (m(input_ids=ids).last_hidden_state * weights).sum().backward()
    scale = max(p.grad.abs().max() for p in model.parameters() if p.grad is not None)
    named = dict(converted.named_parameters())
    grads = 0
    for name, p in model.named_parameters():
        q = named[name]
        if p.grad is None:
            assert q.grad is None, name
            continue
        grads += "experts" in name
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-5 * scale, msg=name)
    assert grads >= 4  # the experts' 3-D weights got their gradients too


def test_experts_run_on_the_linear_op():
    """Two linear calls per expert that has tokens, none for an expert without any."""
    torch.manual_seed(0)
    model = tg.convert(mixtral().eval())
    experts = model.layers[0].mlp.experts
    hidden = torch.randn(6, 32)
    index = torch.tensor([[0, 2], [2, 0], [0, 2], [2, 0], [0, 0], [2, 2]])  # experts 1 and 3 idle
    weights = torch.rand(6, 2)
    with torch.no_grad():
        assert _linear_calls(lambda: experts(hidden, index, weights)) == 4
        got = experts(hidden, index, weights)
        expected = type(experts).forward(experts, hidden, index, weights)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


class _Config(transformers.PretrainedConfig):
    pass


def _plain_experts(**flags):
    """A hand-made experts class with the decorator's flags (and no model around it)."""

    @moe.use_experts_implementation(**flags)
    class Experts(nn.Module):
        def __init__(self, config):
            super().__init__()
            shape_up = (3, 16, 40) if flags.get("is_transposed") else (3, 40, 16)
            shape_down = (3, 40, 16) if flags.get("is_transposed") else (3, 16, 40)
            self.num_experts = 3
            self.up_proj = nn.Parameter(torch.randn(shape_up) / 4)
            self.down_proj = nn.Parameter(torch.randn(shape_down) / 6)
            if flags.get("has_bias"):
                self.up_proj_bias = nn.Parameter(torch.randn(3, 40))
                self.down_proj_bias = nn.Parameter(torch.randn(3, 16))
            self.act_fn = nn.GELU()
            self.post_expert_norm = nn.LayerNorm(16)

        def forward(self, hidden_states, top_k_index, top_k_weights):
            raise AssertionError("dispatched through the experts implementation")

    config = _Config()
    config._experts_implementation = "grouped_mm"
    return Experts(config)


def _exact(experts, hidden, index, weights):
    """The experts' sum token by token (the module in float64)."""
    out = torch.zeros_like(hidden)
    for t, (x, chosen) in enumerate(zip(hidden, index.tolist(), strict=True)):
        for j, e in enumerate(chosen):
            h = x
            for w, b in ((experts.up_proj[e], "up"), (experts.down_proj[e], "down")):
                h = h @ w if experts.is_transposed else w @ h
                if experts.has_bias:
                    h = h + getattr(experts, f"{b}_proj_bias")[e]
                h = experts.act_fn(h) if b == "up" else h
            if experts.has_post_expert_norm:
                h = experts.post_expert_norm(h)
            out[t] += weights[t, j].double() * h
    return out


@pytest.mark.parametrize(
    "flags",
    [
        dict(has_gate=False),
        dict(has_gate=False, is_transposed=True, has_bias=True),
        dict(has_gate=False, has_post_expert_norm=True),
    ],
    ids=["ungated", "transposed-bias", "post-norm"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate_once", [True, False], ids=["gate-once", "gate-per-expert"])
def test_experts_layouts_and_dtypes(flags, dtype, gate_once, monkeypatch):
    # (a few tokens run the gate once on every expert's output, many tokens per expert)
    monkeypatch.setattr(moe_experts, "GATE_ONCE_MAX", 1 << 30 if gate_once else 0)
    torch.manual_seed(0)
    experts = _plain_experts(**flags).to(dtype)
    hidden = torch.randn(9, 16, dtype=dtype)
    index = torch.randint(0, 3, (9, 2))
    weights = torch.rand(9, 2)
    with torch.no_grad():
        expected = experts(hidden, index, weights)  # transformers' grouped_mm
        got = experts_forward(experts, hidden, index, weights)
        exact = _exact(copy.deepcopy(experts).double(), hidden.double(), index, weights)
    assert got.dtype == expected.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2 * (expected.double() - exact).abs().max() + 1e-2
    assert (got.double() - exact).abs().max() <= tol * max(1.0, float(exact.abs().max()))


def test_experts_no_tokens_and_bad_routing():
    experts = _plain_experts(has_gate=False)
    tg.convert(experts)
    empty = experts(torch.randn(0, 16), torch.zeros(0, 2, dtype=torch.long), torch.rand(0, 2))
    assert empty.shape == (0, 16)
    for bad in (3, -1):
        index = torch.tensor([[0, bad]])
        with pytest.raises(
            ValueError, match=r"Experts: top_k_index holds an expert outside 0\.\.2"
        ):
            experts(torch.randn(1, 16), index, torch.rand(1, 2))


def test_experts_filter_copy_pickle_and_unswap():
    torch.manual_seed(0)
    model = mixtral().eval()
    ids = _ids()
    with torch.no_grad():
        expected = model(input_ids=ids).last_hidden_state

    def no_experts(module, fqn):
        return not fqn.endswith("experts")

    left = tg.convert(copy.deepcopy(model), linear_filter=no_experts).conversion_summary
    assert left.layers["layers.0.mlp.experts"] == "left alone: filter_fn said no"

    def raises(module, fqn):
        return module.in_features > 0  # (an experts module has none)

    with pytest.raises(RuntimeError, match="linear_filter raised on 'layers.0.mlp.experts'"):
        tg.convert(copy.deepcopy(model), linear_filter=raises)

    tg.convert(model)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        experts = clone.layers[1].mlp.experts
        assert experts.forward.module is experts  # bound to the copy, not the original
        with torch.no_grad():
            got = clone(input_ids=ids).last_hidden_state
        assert _linear_calls(lambda c=clone: c(input_ids=ids)) > model.conversion_summary.found(
            "linear"
        )
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    # the user's later choice of experts implementation is honoured
    calls = _linear_calls(lambda: model(input_ids=ids))
    model.set_experts_implementation("eager")
    assert _linear_calls(lambda: model(input_ids=ids)) == model.conversion_summary.found("linear")
    model.set_experts_implementation("grouped_mm")
    assert _linear_calls(lambda: model(input_ids=ids)) == calls
    tg.unswap_linear(model)
    assert "forward" not in model.layers[0].mlp.experts.__dict__
    assert _linear_calls(lambda: model(input_ids=ids)) == 0


def test_converted_moe_block_under_compile_and_autocast():
    torch.manual_seed(0)
    model = tg.convert(mixtral().eval())
    block = model.layers[0].mlp
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        expected = block(x)
        compiled = torch.compile(block, fullgraph=True, backend="aot_eager")(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed = block(x)
    torch.testing.assert_close(compiled, expected, rtol=1e-5, atol=1e-6)
    assert mixed.dtype == torch.float32  # the block's own cast back, as eager's
    assert (mixed - expected).abs().max() <= 0.05 * expected.abs().max()


def test_bench_models_builds_the_mixtral_stack():
    """``bench-models --models mixtral``: the LLaMA-style stack with 8 experts, 2 per token,
    every experts module converted (no kernel is built by ``convert``)."""
    from torch_tvm_gemm.cli.bench_models import DECODERS, build

    model, make = build("mixtral", 1)
    assert (model.config.num_local_experts, model.config.num_experts_per_tok) == (8, 2)
    assert set(make(2, 8, 0, torch.float32)) == {"input_ids"} and "mixtral" in DECODERS
    summary = tg.convert(model).conversion_summary
    assert summary.converted("experts") == summary.found("experts") == 1


@pytest.mark.parametrize("transposed", [False, True])
def test_grouped_linear_entry_and_its_python_loop(transposed, monkeypatch):
    """The experts' products in one call (the C++ entry's loop) and the package's Python loop
    give the same values and gradients, idle experts and a bias included."""
    from torch_tvm_gemm.ops import entry

    torch.manual_seed(0)
    counts = [3, 0, 5, 1]
    shape = (4, 24, 40) if transposed else (4, 40, 24)  # 4 experts, K = 24, N = 40
    results = []
    for path in ("entry", "python"):
        if path == "python":
            monkeypatch.setattr(entry, "_grouped_linear_entry", None)
        torch.manual_seed(0)
        x = torch.randn(9, 24, requires_grad=True)
        weight = torch.randn(shape, requires_grad=True)
        bias = torch.randn(4, 40, requires_grad=True)
        out = entry.grouped_linear(x, counts, weight, bias, transposed)
        out.square().sum().backward()
        results.append((out.detach(), x.grad, weight.grad, bias.grad))
    expected, start = [], 0
    for e, n in enumerate(counts):
        w = weight[e].T if transposed else weight[e]
        expected.append(torch.nn.functional.linear(x[start : start + n], w, bias[e]))
        start += n
    torch.testing.assert_close(results[0][0], torch.cat(expected).detach(), rtol=1e-5, atol=1e-5)
    for a, b in zip(results[0], results[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert all(r[2][1].abs().max() == 0 for r in results)  # the idle expert's weight

"""convert() on transformers models (small configs, random weights, no downloads): every
Linear / Conv1D / Conv2d accounted for, outputs and gradients as eager."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import torch_tvm_gemm as tg

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def bert():
    config = transformers.BertConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=50,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertModel(config), {"input_ids": torch.randint(0, 50, (2, 12))}


def gpt2():
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=50,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config), {"input_ids": torch.randint(0, 50, (2, 12))}


def llama():
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        vocab_size=50,
    )
    return transformers.LlamaModel(config), {"input_ids": torch.randint(0, 50, (2, 12))}


def falcon():
    # FalconLinear overrides nn.Linear.forward with the same function written out
    config = transformers.FalconConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, vocab_size=50
    )
    return transformers.FalconModel(config), {"input_ids": torch.randint(0, 50, (2, 12))}


def resnet():
    config = transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[16, 32], depths=[1, 1], layer_type="bottleneck"
    )
    return transformers.ResNetModel(config), {"pixel_values": torch.randn(2, 3, 32, 32)}


def mobilenet():
    config = transformers.MobileNetV2Config(depth_multiplier=0.35, image_size=32, tf_padding=False)
    return transformers.MobileNetV2Model(config), {"pixel_values": torch.randn(2, 3, 32, 32)}


def mobilenet_tf_padding():
    # The default config (that of the released checkpoints): TensorFlow-style padding, a
    # helper that branches on the input's size before every conv. 33 x 33: uneven padding.
    config = transformers.MobileNetV2Config(depth_multiplier=0.35, image_size=33)
    return transformers.MobileNetV2Model(config), {"pixel_values": torch.randn(2, 3, 33, 33)}


# family -> (model factory, {fqn suffix: what it must have become})
FAMILIES = {
    "bert": (bert, {"intermediate.dense": "(gelu)", "attention.self.query": "swapped"}),
    "gpt2": (gpt2, {"mlp.c_fc": "(gelu_tanh)", "attn.c_attn": "swapped", "lm_head": "swapped"}),
    "llama": (llama, {"mlp.gate_proj": "(silu)", "mlp.down_proj": "swapped"}),
    "falcon": (falcon, {"mlp.dense_h_to_4h": "(gelu)", "self_attention.dense": "swapped"}),
    "resnet": (resnet, {"shortcut.convolution": "(folded)", "layer.0.convolution": "activation"}),
    "mobilenet": (mobilenet, {"reduce_1x1.convolution": "(folded)"}),
    "mobilenet_tf_padding": (
        mobilenet_tf_padding,
        {"conv_3x3.convolution": "(folded)", "reduce_1x1.convolution": "(folded)"},
    ),
}


def first(output) -> torch.Tensor:
    return output[0] if not isinstance(output, torch.Tensor) else output


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_converts_and_matches_eager(family):
    torch.manual_seed(0)
    make, expect = FAMILIES[family]
    model, inputs = make()
    model.eval()
    reference = copy.deepcopy(model)
    keys = list(model.state_dict())
    with torch.no_grad():
        expected = reference(**inputs)
        assert tg.convert(model) is model
        got = model(**inputs)
    assert type(got) is type(expected)  # ModelOutput stays ModelOutput
    summary = model.conversion_summary
    assert summary.converted() == summary.found() > 0, summary  # every layer on TVM
    for suffix, what in expect.items():
        matches = [w for fqn, w in summary.layers.items() if fqn.endswith(suffix)]
        assert matches and all(what in w for w in matches), (suffix, matches)
    scale = first(expected).abs().max()
    assert (first(got) - first(expected)).abs().max() <= 1e-4 * scale
    assert list(model.state_dict()) == keys
    model.load_state_dict(reference.state_dict())  # round trip


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama", "resnet"])
def test_family_training_step(family):
    torch.manual_seed(0)
    model, inputs = FAMILIES[family][0]()
    model.eval()  # BN folded with running stats; dropout is 0 in the configs
    converted = tg.convert(copy.deepcopy(model))
    # A fixed random projection: the sum of squares of a LayerNorm output is ~constant, its
    # gradients cancel to rounding noise.
    weights = torch.randn_like(first(model(**inputs)))
    for m in (model, converted):
        (first(m(**inputs)) * weights).sum().backward()
    # fp32 sums in another order: errors relative to the largest gradient (some, e.g. a
    # key bias under softmax, are zero in exact arithmetic: rounding noise only).
    scale = max(p.grad.abs().max() for p in model.parameters() if p.grad is not None)
    for (name, p), q in zip(model.named_parameters(), converted.parameters(), strict=True):
        if p.grad is None:
            assert q.grad is None, name
            continue
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-5 * scale, msg=name)


def test_gpt2_tied_lm_head_and_conv1d():
    model, inputs = gpt2()
    model.eval()
    tg.convert(model)
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    attn = model.transformer.h[0].attn.c_attn
    assert type(attn).__name__ == "TVMConv1D" and (attn.nx, attn.nf) == (32, 96)
    model.tie_weights()  # transformers re-tying works on the swapped module too
    assert model.lm_head.weight is model.transformer.wte.weight


def test_mobilevit_silu_activation_fused_into_convs():
    """transformers' SiLUActivation module (MobileViT's "silu") after conv -> BN is fused into
    the conv like nn.SiLU, and into the Linear before it; the plain 1x1 convs (no BN, no
    activation) stay on torch, and say so."""
    torch.manual_seed(0)
    config = transformers.MobileViTConfig(
        image_size=32,
        hidden_sizes=[16, 24, 32],
        neck_hidden_sizes=[8, 8, 16, 16, 16, 24, 32],
        num_attention_heads=2,
        mlp_ratio=2.0,
    )
    model = transformers.MobileViTModel(config).eval()
    # Running statistics away from (0, 1): the folded BN has something to get wrong.
    for bn in (m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)):
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5), bn.bias.uniform_(-0.5, 0.5)
            bn.running_mean.uniform_(-0.2, 0.2), bn.running_var.uniform_(0.5, 1.5)
    pixels = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = model(pixel_values=pixels)[0]
        tg.convert(model)
        got = model(pixel_values=pixels)[0]
    layers = model.conversion_summary.layers
    expand = [w for fqn, w in layers.items() if fqn.endswith("expand_1x1.convolution")]
    assert expand and all(
        "(folded) -> " in w and w.endswith("expand_1x1_activation") for w in expand
    ), expand
    dense = [w for fqn, w in layers.items() if fqn.endswith("intermediate.dense")]
    assert dense and all("(silu)" in w for w in dense), dense
    plain = [w for fqn, w in layers.items() if fqn.endswith("conv_1x1.convolution")]
    assert plain and all(w.startswith("left alone: no BN or ReLU") for w in plain), plain
    assert expected.abs().max() > 0.1
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()


def test_bert_bf16_forward():
    torch.manual_seed(0)
    model, inputs = bert()
    model.eval()
    reference = copy.deepcopy(model)
    model, reference = model.to(torch.bfloat16), reference.to(torch.bfloat16)
    with torch.no_grad():
        expected = reference(**inputs)[0].float()
        tg.convert(model)
        got = model(**inputs)[0].float()
        exact = copy.deepcopy(reference).float()(**inputs)[0]
    # bf16 on TVM is as far from fp32 as torch's own bf16 is.
    assert (got - exact).abs().max() <= 2 * (expected - exact).abs().max() + 1e-2


def test_bench_models_cli_runs(tmp_path):
    """The model benchmark's command line works (a smoke test: one small model, one call)."""
    from torch_tvm_gemm.__main__ import main

    out = tmp_path / "models.json"
    argv = ["bench-models", "--models", "llama", "--layers", "1", "--seq", "8", "--batch", "1"]
    argv += ["--decode", "2"]
    assert main([*argv, "--reps", "1", "--rounds", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    prefill, decode = result["rows"]
    assert (prefill["phase"], decode["phase"], decode["decode_steps"]) == ("prefill", "decode", 2)
    for row in (prefill, decode):
        assert row["converted_layers"] == row["found_layers"] == 7
        assert row["max_rel_err"] < 1e-4 and row["converted_s"] > 0
        # one round: its median is its best
        assert row["median_ratio"] == pytest.approx(row["ratio"])
    ratios = [prefill["ratio"], decode["ratio"]]
    assert result["median_by_dtype"]["float32"][1] == pytest.approx(min(ratios))


@pytest.mark.parametrize("call", ["grad", "autocast", "train"])
def test_bench_models_calls(tmp_path, monkeypatch, call):
    """``--call``: every call of both sides made with gradients left on, in an autocast region
    of its own under no_grad, or as a training step of a model in train mode; the row says
    which."""
    import torch

    from torch_tvm_gemm.__main__ import main
    from torch_tvm_gemm.cli import bench_models

    seen = []
    build = bench_models.build

    def state(module, _):
        seen.append((torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), module.training))

    def watched(*args):
        model, make = build(*args)
        model.register_forward_pre_hook(state)  # (deep-copied with the model: both sides)
        return model, make

    monkeypatch.setattr(bench_models, "build", watched)
    out = tmp_path / "models.json"
    argv = ["bench-models", "--models", "llama", "--layers", "1", "--seq", "8", "--batch", "1"]
    assert main([*argv, "--reps", "1", "--rounds", "1", "--call", call, "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["call"] == call
    assert row["max_rel_err"] < (5e-2 if call == "autocast" else 1e-4)
    grad = call in ("grad", "train")
    assert len(seen) >= 6 and set(seen) == {(grad, call == "autocast", call == "train")}


def test_bench_models_channels_last(monkeypatch):
    """``--channels-last`` hands the CNN and its pixels over in channels_last, eager too."""
    import torch

    from torch_tvm_gemm.__main__ import main
    from torch_tvm_gemm.cli import bench_models

    seen = []
    build = bench_models.build

    def watched(name, layers, channels_last=False):
        model, make = build(name, layers, channels_last)
        weight = next(p for p in model.parameters() if p.dim() == 4)
        seen.append(weight.is_contiguous(memory_format=torch.channels_last))

        def pixels(*args):
            inputs = make(*args)
            x = inputs["pixel_values"]
            seen.append(x.is_contiguous(memory_format=torch.channels_last) and x.stride()[1] == 1)
            return inputs

        return model, pixels

    monkeypatch.setattr(bench_models, "build", watched)
    argv = ["bench-models", "--models", "mobilenet", "--image", "32", "--batch", "1"]
    assert main([*argv, "--reps", "1", "--rounds", "1", "--channels-last"]) == 0
    assert seen == [True, True]


def test_bench_models_ratio_summary():
    """The benchmark's closing line: a geometric mean and lowest ratio over all rows and over
    each dtype's rows on their own."""
    from torch_tvm_gemm.cli.bench_models import ratio_summary

    rows = [{"dtype": d, "ratio": r} for d, r in (("float32", 0.5), ("float32", 2.0))]
    rows.append({"dtype": "bfloat16", "ratio": 8.0})
    summary = ratio_summary(rows)
    assert list(summary) == ["all", "float32", "bfloat16"]
    assert summary["float32"] == pytest.approx((1.0, 0.5))
    assert summary["bfloat16"] == pytest.approx((8.0, 8.0))
    assert summary["all"] == pytest.approx((2.0, 0.5))


def test_bench_models_alone(tmp_path, monkeypatch):
    """``--alone`` times each side in a child process of its own and reports both ways; a
    child that fails is an error naming the row, not a missing number."""
    from types import SimpleNamespace

    from torch_tvm_gemm.__main__ import main
    from torch_tvm_gemm.cli import bench_models_alone

    monkeypatch.setattr(bench_models_alone, "ALONE_RUNS", 1)
    out = tmp_path / "models.json"
    argv = ["bench-models", "--models", "llama", "--layers", "1", "--seq", "8", "--batch", "1"]
    png = tmp_path / "models.png"
    argv += ["--reps", "1", "--rounds", "1", "--alone", "--json", str(out), "--png", str(png)]
    assert main(argv) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"  # (both bars of the row)
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert row["alone_eager_s"] > 0 and row["alone_converted_s"] > 0
    assert row["alone_ratio"] == pytest.approx(row["alone_eager_s"] / row["alone_converted_s"])
    assert result["alone_by_dtype"]["all"] == pytest.approx([row["alone_ratio"]] * 2)

    args = SimpleNamespace(
        seq=8,
        image=32,
        layers=1,
        reps=1,
        rounds=1,
        threads=None,
        channels_last=False,
        call="no_grad",
    )
    with pytest.raises(RuntimeError, match="the eager process for no-such-model"):
        bench_models_alone.time_alone("no-such-model", "float32", 1, args)

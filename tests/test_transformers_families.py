"""convert() across many transformers architectures, as a user brings them (small configs
from each model type's own defaults, random weights, no downloads): every Linear / Conv1D
swapped, outputs as eager, and a training step in train mode (dropout drawn as eager draws it)
with the same gradients."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import torch_tvm_gemm as tg

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

# Sizes shrunk on each config that has the attribute (the others keep their defaults).
SMALL = dict(
    hidden_size=64,
    hidden_dim=128,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rotary_dim=8,
    vocab_size=512,
    max_position_embeddings=128,
    d_model=64,
    d_ff=128,
    d_kv=16,
    num_layers=2,
    num_heads=4,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=128,
    decoder_ffn_dim=128,
    max_source_positions=32,
    max_target_positions=32,
    image_size=32,
    patch_size=8,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    decoder_start_token_id=0,
)

# model type -> what its forward takes besides input_ids; layers left alone on purpose
FAMILIES = {
    "distilbert": {},
    "albert": {},  # one layer's weights shared by every layer
    "deberta-v2": {},
    "modernbert": {},
    "t5": {"decoder": True},
    "bart": {"decoder": True},
    "opt": {},
    "gpt_neox": {},
    "gptj": {},
    "bloom": {},
    "qwen2": {},
    "gemma2": {},
    "phi3": {},  # fused qkv and gate-up projections
    "clip_text_model": {},
    "whisper": {"audio": "input_features", "decoder": True},
    "wav2vec2": {"audio": "input_values"},  # its feature extractor's Conv1d are not candidates
    "vit": {"image": True, "left_alone": 1},  # the patch embedding: a conv with nothing after
}


def build(model_type: str):
    if model_type not in transformers.CONFIG_MAPPING:  # (an older transformers)
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    config = transformers.AutoConfig.for_model(model_type)
    for name, value in SMALL.items():
        if hasattr(config, name):
            try:
                setattr(config, name, value)
            except AttributeError:  # (a derived property, e.g. Falcon's head_dim)
                pass
    model = transformers.AutoModel.from_config(config)
    what = FAMILIES[model_type]
    if what.get("audio") == "input_features":
        inputs = {"input_features": torch.randn(2, config.num_mel_bins, 64)}
    elif what.get("audio"):
        inputs = {"input_values": torch.randn(2, 4000)}
    elif what.get("image"):
        inputs = {"pixel_values": torch.randn(2, 3, 32, 32)}
    else:
        inputs = {"input_ids": torch.randint(3, 512, (2, 16))}
    if what.get("decoder"):
        inputs["decoder_input_ids"] = torch.randint(3, 512, (2, 8))
    return model, inputs


def first(output) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    hidden = getattr(output, "last_hidden_state", None)
    return hidden if hidden is not None else output[0]


def seeded(model, inputs):
    # wav2vec2's time masking in train mode draws from numpy
    torch.manual_seed(1)
    np.random.seed(1)
    return first(model(**inputs))


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_family_converts_matches_and_trains(model_type):
    torch.manual_seed(0)
    model, inputs = build(model_type)
    model.eval()
    eager = copy.deepcopy(model)
    keys = list(model.state_dict())
    assert tg.convert(model) is model

    summary = model.conversion_summary
    left_alone = FAMILIES[model_type].get("left_alone", 0)
    assert summary.found() > 0 and summary.converted() == summary.found() - left_alone, summary
    assert list(model.state_dict()) == keys
    with torch.no_grad():
        want, got = first(eager(**inputs)), first(model(**inputs))
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()

    # Gradients in eval mode (through the fused regions) and in train mode (dropout on, the
    # same draws on both sides; a fused region runs its module's own forward there). The loss:
    # a fixed random projection of the output (a LayerNorm's sum of squares would have ~zero
    # gradients).
    for train in (False, True):
        eager.train(train)
        model.train(train)
        eager.zero_grad()
        model.zero_grad()
        out = seeded(eager, inputs)
        projection = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
        (out * projection).sum().backward()
        (seeded(model, inputs) * projection).sum().backward()
        assert_same_grads(eager, model, f"{model_type} train={train}")


def assert_same_grads(eager, model, what: str) -> None:
    # errors relative to the largest gradient (some are zero in exact arithmetic, e.g. a key
    # bias under softmax: rounding noise only)
    scale = max(p.grad.abs().max() for p in eager.parameters() if p.grad is not None)
    params = dict(model.named_parameters())
    for name, p in eager.named_parameters():
        if p.grad is None:
            assert params[name].grad is None, (what, name)
            continue
        torch.testing.assert_close(params[name].grad, p.grad, rtol=1e-3, atol=1e-5 * scale,
                                   msg=f"{what}: {name}")  # fmt: skip

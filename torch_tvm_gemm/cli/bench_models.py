"""``bench-models``: real architectures end to end, eager PyTorch vs after ``convert``.

Models are built from transformers configs with random weights (nothing is downloaded): a
BERT-style encoder, GPT-2, a LLaMA-style decoder stack, ResNet-50 (``ResNetModel``) and a
MobileNetV2; on request (``--models mixtral``) a Mixtral-style stack, the LLaMA-style one
with a mixture of 8 experts. For each model, dtype and batch size: eager time, converted
time (same run, alternating rounds, best of each), their ratio (above 1: converted faster),
the same ratio over each side's median round (on a busy machine a typical call can trail
the best by 10% or more, and not by as much on both sides), layers on TVM ops / found, max
error vs eager relative to the output's largest value, and the first call after
``convert`` (kernel builds or cache loads included). With ``--decode STEPS`` the decoder
models (GPT-2, LLaMA, Mixtral) also get a "decode" row: seconds per generated token on a KV
cache after a prefill of ``--seq`` tokens, where every Linear runs at M = batch. With
``--alone`` each row is also timed with eager and converted each in a process of its own,
as a user's script runs one model (``bench_models_alone`` says why that can differ). Needs
``pip install torch_tvm_gemm[models]`` (transformers).
"""

from __future__ import annotations

import copy
import json
import math
import statistics
import time

from . import bench_models_alone

MODELS = ("bert", "gpt2", "llama", "resnet50", "mobilenet")  # the default set
MORE_MODELS = ("mixtral",)  # on request
DECODERS = ("gpt2", "llama", "mixtral")  # the models with a KV cache
# The LLaMA-style stack's shape (and the Mixtral-style one's, with experts of this width)
LLAMA_STYLE = dict(
    hidden_size=512,
    intermediate_size=1376,
    num_attention_heads=8,
    num_key_value_heads=8,
    vocab_size=32000,
)


def _call_context(call: str):
    """A new context manager for one call made the ``--call`` way."""
    import contextlib

    import torch

    if call in ("grad", "train"):
        return torch.enable_grad()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.no_grad())
    if call == "autocast":
        stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
    return stack


CALLS = ("no_grad", "grad", "autocast", "train")


def _called(call: str, model, inputs: dict):
    with _call_context(call):
        if call != "train":
            return model(**inputs)
        model.zero_grad(set_to_none=True)  # (as a training loop's optimizer.zero_grad())
        output = model(**inputs)
        first_tensor(output).float().square().mean().backward()
        return output


def register(sub) -> None:
    p = sub.add_parser("bench-models", help="transformers models: eager vs convert(), end to end")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS + MORE_MODELS)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    p.add_argument("--seq", type=int, default=128, help="sequence length of the text models")
    p.add_argument("--image", type=int, default=224, help="image size of the CNNs")
    p.add_argument(
        "--channels-last",
        action="store_true",
        help="the CNNs and their inputs in channels_last (eager too)",
    )
    p.add_argument("--layers", type=int, default=4, help="layers of the text models")
    p.add_argument("--threads", type=int, default=None, help="torch and TVM threads")
    p.add_argument("--reps", type=int, default=3, help="calls per timing round")
    p.add_argument(
        "--rounds", type=int, default=5, help="timing rounds (the best and the median are kept)"
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="also time torch.compile(original) and torch.compile(converted)",
    )
    p.add_argument(
        "--decode",
        type=int,
        default=0,
        metavar="STEPS",
        help="also time STEPS one-token calls on a KV cache (GPT-2, LLaMA, Mixtral): per token",
    )
    p.add_argument(
        "--call",
        default="no_grad",
        choices=list(CALLS),
        help="how each call is made: under torch.no_grad() (default); with gradients left on "
        "(an eval-mode model called outside no_grad); in a torch.autocast(bfloat16) region "
        "of its own under no_grad (as training frameworks call a model); or as a training "
        "step (train mode, forward and backward of a squared mean, grads reset each step)",
    )
    bench_models_alone.add_arguments(p)
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--png", metavar="PATH", help="write a bar chart of the ratios (matplotlib)")
    p.set_defaults(func=run)


def build(name: str, layers: int, channels_last: bool = False):
    """(model in eval mode, input maker ``(batch, seq, image, dtype) -> kwargs``) for ``name``
    (``dtype``: the CNNs' pixels, the model's dtype; token ids stay integers). With
    ``channels_last`` a CNN and its pixels are channels_last, the usual recipe on oneDNN."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    if name == "bert":
        config = transformers.BertConfig(num_hidden_layers=layers)  # hidden 768, 12 heads
        model = transformers.BertModel(config)
    elif name == "gpt2":
        config = transformers.GPT2Config(n_layer=layers)  # 768, 12 heads, tied lm_head
        model = transformers.GPT2LMHeadModel(config)
    elif name == "llama":
        config = transformers.LlamaConfig(**LLAMA_STYLE, num_hidden_layers=layers)
        model = transformers.LlamaModel(config)
    elif name == "mixtral":  # the LLaMA-style stack with a mixture of 8 experts, 2 per token
        config = transformers.MixtralConfig(
            **LLAMA_STYLE, num_hidden_layers=layers, num_local_experts=8, num_experts_per_tok=2
        )
        model = transformers.MixtralModel(config)
    elif name == "resnet50":
        model = transformers.ResNetModel(transformers.ResNetConfig())  # the ResNet-50 layout
    else:
        # the default config, as the released checkpoints: TensorFlow-style padding
        model = transformers.MobileNetV2Model(transformers.MobileNetV2Config())
    if name in ("bert", "gpt2", "llama", "mixtral"):
        vocab = model.config.vocab_size
        return model.eval(), lambda b, s, i, dtype: {"input_ids": torch.randint(0, vocab, (b, s))}
    layout = torch.channels_last if channels_last else torch.contiguous_format

    def pixels(b, s, i, dtype):
        return {"pixel_values": torch.randn(b, 3, i, i).to(dtype, memory_format=layout)}

    return model.eval().to(memory_format=layout), pixels


def first_tensor(output):
    import torch

    return output if isinstance(output, torch.Tensor) else output[0]


def decode(model, inputs: dict, steps: int):
    """(seconds per token, last output) of ``steps`` one-token calls on the KV cache of a
    prefill of ``inputs`` (not timed). Each step feeds the prompt's last token again: the
    work of greedy decoding, the same tokens for both models whatever random weights pick."""
    import torch

    ids = inputs["input_ids"]
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
        token = ids[:, -1:]
        start = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
        return (time.perf_counter() - start) / steps, first_tensor(out)


def rel_err(got, want) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def run(args) -> int:
    import torch

    import torch_tvm_gemm as tg

    from ..measure import keep_freed_memory

    try:
        import transformers  # noqa: F401
    except ImportError:
        print("bench-models needs transformers: pip install 'torch_tvm_gemm[models]'")
        return 1
    if args.side:
        return bench_models_alone.run_side(args, build, _called)
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()
    torch.manual_seed(0)
    rows = []
    header = (
        f"{'model':<12} {'dtype':<9} {'batch':>5} {'eager ms':>9} {'conv ms':>9} {'ratio':>6} "
        f"{'median':>6} {'layers':>9} {'max err':>8} {'1st call s':>10}"
    )
    print(
        f"threads {torch.get_num_threads()}; calls: {args.call}; ratio = eager / converted "
        "(above 1: faster), best rounds; median: over each side's median round"
    )
    extra = f" {'cmp(eager)':>10} {'cmp(conv)':>10}" if args.compile else ""
    extra += f" {'alone ratio':>11}" if args.alone else ""
    print(header + extra)
    for name in args.models:
        for dtype_name in args.dtype:
            dtype = getattr(torch, dtype_name)
            eager, make = build(name, args.layers, args.channels_last)
            eager = eager.to(dtype).train(args.call == "train")
            converted = copy.deepcopy(eager)  # (converted in the mode it runs in)
            start = time.perf_counter()
            tg.convert(converted)
            convert_s = time.perf_counter() - start
            summary = converted.conversion_summary
            first_call = None
            for batch in args.batch:
                inputs = make(batch, args.seq, args.image, dtype)
                torch.manual_seed(0)  # (in train mode: both sides draw the same dropout)
                start = time.perf_counter()
                got = first_tensor(_called(args.call, converted, inputs))
                call_s = time.perf_counter() - start
                first_call = call_s if first_call is None else first_call
                torch.manual_seed(0)
                with torch.no_grad():
                    err = rel_err(got, first_tensor(_called(args.call, eager, inputs)))
                rounds_conv, rounds_eager = time_rounds(
                    lambda i=inputs, m=converted: _called(args.call, m, i),
                    lambda i=inputs, m=eager: _called(args.call, m, i),
                    args,
                )
                t_conv, t_eager = min(rounds_conv), min(rounds_eager)
                typical = statistics.median(rounds_eager) / statistics.median(rounds_conv)
                if args.compile:
                    c_conv, c_eager = torch.compile(converted), torch.compile(eager)
                    compiled_rounds = time_rounds(
                        lambda i=inputs, m=c_conv: _called(args.call, m, i),
                        lambda i=inputs, m=c_eager: _called(args.call, m, i),
                        args,
                    )
                    t_c_conv, t_c_eager = map(min, compiled_rounds)
                row = {
                    "model": name,
                    "phase": "prefill",
                    "call": args.call,
                    "dtype": dtype_name,
                    "batch": batch,
                    "eager_s": t_eager,
                    "converted_s": t_conv,
                    "ratio": t_eager / t_conv,
                    "median_ratio": typical,
                    "converted_layers": summary.converted(),
                    "found_layers": summary.found(),
                    "fused": len(summary.fused),
                    "max_rel_err": err,
                    "first_call_s": call_s,
                    "convert_s": convert_s,
                }
                columns = ""
                if args.compile:
                    row |= {"compiled_eager_s": t_c_eager, "compiled_converted_s": t_c_conv}
                    columns = f" {t_c_eager * 1e3:10.2f} {t_c_conv * 1e3:10.2f}"
                if args.alone:
                    a_eager, a_conv = bench_models_alone.time_alone(name, dtype_name, batch, args)
                    row |= {"alone_eager_s": a_eager, "alone_converted_s": a_conv}
                    row["alone_ratio"] = a_eager / a_conv
                    columns += f" {row['alone_ratio']:11.2f}"
                rows.append(row)
                print(
                    f"{name:<12} {dtype_name:<9} {batch:>5} {t_eager * 1e3:9.2f} "
                    f"{t_conv * 1e3:9.2f} {row['ratio']:6.2f} {row['median_ratio']:6.2f} "
                    f"{f'{summary.converted()}/{summary.found()}':>9} {err:8.1e} {call_s:10.2f}"
                    + columns
                )
                if args.decode and name in DECODERS:
                    rows.append(decode_row(eager, converted, inputs, args, row))
    summary = ratio_summary(rows)
    means = (f"{key} {geomean:.2f} ({lowest:.2f})" for key, (geomean, lowest) in summary.items())
    print("geometric mean ratio (lowest): " + ", ".join(means))
    medians = ratio_summary(rows, "median_ratio")
    means = (f"{key} {geomean:.2f} ({lowest:.2f})" for key, (geomean, lowest) in medians.items())
    print("the same over the median rounds: " + ", ".join(means))
    alone = ratio_summary(rows, "alone_ratio") if args.alone else None
    if alone:
        means = (f"{key} {geomean:.2f} ({lowest:.2f})" for key, (geomean, lowest) in alone.items())
        print("each side in a process of its own: " + ", ".join(means))
    if args.png:
        plot(rows, args.png, torch.get_num_threads())
    if args.json:
        with open(args.json, "w") as f:
            result = {"threads": torch.get_num_threads(), "rows": rows}
            result |= {"geomean": summary["all"][0], "by_dtype": summary}
            result["median_by_dtype"] = medians
            if alone:
                result["alone_by_dtype"] = alone
            json.dump(result, f, indent=1)
    return 0


def time_rounds(converted_call, eager_call, args) -> tuple[list[float], list[float]]:
    """Each side's seconds per call in each of ``--rounds`` alternating rounds of ``--reps``
    back-to-back calls, after a warm-up call of each (kernel builds, loads, caches)."""
    from ..measure import mean_call, time_interleaved

    return time_interleaved(
        [converted_call, eager_call],
        args.rounds,
        sample=lambda fn: mean_call(fn, args.reps),
        keep=list,
    )


def ratio_summary(rows: list[dict], column: str = "ratio") -> dict[str, tuple[float, float]]:
    """(geometric mean, lowest) of the eager / converted ratios (``column`` of the rows that
    have it): "all" rows, then each dtype's rows on their own (the fp32 and bf16 targets are
    separate: one mean over both hides a weak fp32 behind bf16's larger ratios)."""
    rows = [row for row in rows if column in row]
    groups = {"all": [r[column] for r in rows]}
    for row in rows:
        groups.setdefault(row["dtype"], []).append(row[column])
    nan = float("nan")
    return {
        key: (math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else nan,
              min(ratios, default=nan))
        for key, ratios in groups.items()
    }  # fmt: skip


def decode_row(eager, converted, inputs: dict, args, prefill: dict) -> dict:
    """The "decode" row of one (model, dtype, batch): eager and converted per token, timed in
    alternating rounds (a fresh prefill each, not timed), best and median of each; printed."""
    from ..measure import time_interleaved

    steps = args.decode
    rounds_conv, rounds_eager = time_interleaved(
        [lambda: decode(converted, inputs, steps)[0], lambda: decode(eager, inputs, steps)[0]],
        args.rounds,
        sample=lambda fn: fn(),
        keep=list,
    )
    t_conv, t_eager = min(rounds_conv), min(rounds_eager)
    err = rel_err(decode(converted, inputs, 1)[1], decode(eager, inputs, 1)[1])
    row = prefill | {
        "phase": "decode",
        "decode_steps": steps,
        "eager_s": t_eager,
        "converted_s": t_conv,
        "ratio": t_eager / t_conv,
        "median_ratio": statistics.median(rounds_eager) / statistics.median(rounds_conv),
        "max_rel_err": err,
        "first_call_s": None,
    }
    for key in ("compiled_eager_s", "compiled_converted_s", "alone_eager_s", "alone_converted_s",
                "alone_ratio"):  # fmt: skip
        row.pop(key, None)
    label = f"{row['model']}-decode"
    layers = f"{row['converted_layers']}/{row['found_layers']}"
    print(
        f"{label:<12} {row['dtype']:<9} {row['batch']:>5} {t_eager * 1e3:9.2f} "
        f"{t_conv * 1e3:9.2f} {row['ratio']:6.2f} {row['median_ratio']:6.2f} {layers:>9} "
        f"{err:8.1e}"
    )
    return row


def plot(rows: list[dict], path: str, threads: int) -> None:
    """One bar per (model, dtype, batch): eager time / converted time, 1.0 as a line; with
    ``--alone`` ratios, a second (hatched) bar beside each: each side in its own process."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    short = {"float32": "fp32", "bfloat16": "bf16"}
    labels = [
        f"{r['model']}{'-dec' if r['phase'] == 'decode' else ''}\n{short[r['dtype']]} b{r['batch']}"
        for r in rows
    ]
    ratios = [r["ratio"] for r in rows]
    alone = [r.get("alone_ratio") for r in rows]
    width = 0.4 if any(alone) else 0.8
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.8), 4))
    colors = ["tab:green" if x >= 1 else "tab:red" for x in ratios]
    ax.bar([i - width / 2 * bool(any(alone)) for i in range(len(rows))], ratios, width,
           color=colors, label="one process")  # fmt: skip
    if any(alone):
        at = [i + width / 2 for i, x in enumerate(alone) if x is not None]
        shown = [x for x in alone if x is not None]
        ax.bar(at, shown, width, color=["tab:green" if x >= 1 else "tab:red" for x in shown],
               hatch="//", alpha=0.6, label="each side alone")  # fmt: skip
        ax.legend(fontsize=7)
    ax.axhline(1.0, color="k", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("eager / converted (above 1: faster)")
    ax.set_title(f"convert() end to end, {threads} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

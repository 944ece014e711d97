"""``compile``: cross-compile CUDA kernels into a pack, on a machine without a GPU.

    python -m torch_tvm_gemm compile --target cuda --arch sm_80,sm_90a \\
        --ops linear:bfloat16:4096:4096:bias+relu matmul:float16:1024:1024 --out pack/
    python -m torch_tvm_gemm compile --target cuda --preset bench --out pack/

An op is ``OP:DTYPE:N:K[:EPILOGUE]``: OP ``matmul`` (B is (K, N)) or ``linear`` (weight
(N, K)); DTYPE ``float16``, ``bfloat16``, ``float32``, ``float64`` or ``tf32`` (float32
tensors on tensor cores, the kernel used when ``torch.backends.cuda.matmul.allow_tf32`` is
set; sm_80+); EPILOGUE (linear only) ``bias``, ``relu``, ``gelu``, ``bias+relu``, ``bias+gelu``.
Each op is built for each M range of ``--variants`` (default both: ``gemv``, small M <= 16, and
``gemm``, any larger M), as the op would pick its kernel there (``ops.gemm_spec``): a B of
fewer than 4096 elements has no gemv kernel, so it gets one kernel. A conv2d + bias + relu kernel (groups 1, any batch) is
``conv2d:DTYPE:C:K:RxS:HxW[:OPTION...]``, OPTIONs ``sN`` / ``sNxM`` (stride), ``pN`` / ``pNxM``
(padding), ``dN`` / ``dNxM`` (dilation), ``nobias``, ``norelu``, or an activation in place
of relu: ``relu6``, ``hardswish``, ``silu``, ``leaky_relu`` (slope 0.01), ``leaky_relu_0.1``
(another slope), ``sigmoid``, ``hardsigmoid``; e.g.
``conv2d:float16:64:64:3x3:56x56:p1``. A GPU process loads the pack with
``TVM_GEMM_PACK=pack/`` (runtime only).
"""

from __future__ import annotations

import time

DTYPES = ("float16", "bfloat16", "float32", "float64", "tf32")


def register(sub) -> None:
    p = sub.add_parser("compile", help="cross-compile CUDA kernels (nvcc, no GPU) into a pack")
    p.add_argument("--target", default="cuda", choices=["cuda"])
    p.add_argument("--arch", default="sm_80,sm_90a", help="comma-separated, e.g. sm_80,sm_90a")
    p.add_argument(
        "--ops", nargs="*", default=[], help="OP:DTYPE:N:K[:EPILOGUE] or conv2d:... (see above)"
    )
    p.add_argument(
        "--preset", choices=["test", "bench", "all"], help="kernels of the GPU tests/bench"
    )
    p.add_argument("--variants", default="gemm,gemv", help="M ranges for --ops (gemm,gemv)")
    p.add_argument("--out", required=True, help="pack folder to write")
    p.set_defaults(func=run)


def variant_m() -> dict[str, int]:
    """An M inside each variant's range on CUDA (``schedules/cpu.py`` ``gemm_variant``)."""
    from ..schedules.cpu import DOT_MAX_M, GEMV_MAX_M

    return {"gemv": 1, "gemm": max(GEMV_MAX_M, DOT_MAX_M) + 1}


def parse_op(text: str, variants: list[str]) -> list:
    """``linear:bfloat16:4096:4096:bias+relu`` -> the GemmSpecs its calls ask for, one per M
    range of ``variants`` (fewer where two ranges share a kernel), from ``ops.gemm_spec``."""
    from ..ops import gemm_spec

    parts = text.split(":")
    if len(parts) not in (4, 5) or parts[0] not in ("matmul", "linear") or parts[1] not in DTYPES:
        raise SystemExit(
            f"compile: bad op {text!r}; expected OP:DTYPE:N:K[:EPILOGUE], OP matmul|linear, "
            f"DTYPE one of {', '.join(DTYPES)}"
        )
    op, dtype, n, k = parts[0], parts[1], int(parts[2]), int(parts[3])
    tf32 = dtype == "tf32"  # float32 tensors, TF32 tensor-core math
    epilogue = set(parts[4].split("+")) if len(parts) == 5 else set()
    if epilogue - {"bias", "relu", "gelu"} or {"relu", "gelu"} <= epilogue:
        raise SystemExit(f"compile: bad epilogue in {text!r} (bias, relu, gelu, bias+relu, ...)")
    if epilogue and op == "matmul":
        raise SystemExit(f"compile: {text!r}: matmul has no epilogue (use linear)")
    ms = variant_m()
    unknown = [v for v in variants if v not in ms]
    if unknown:
        raise SystemExit(f"compile: unknown variant {unknown[0]!r} ({', '.join(ms)})")
    activation = next((a for a in ("relu", "gelu") if a in epilogue), "none")
    specs = [
        gemm_spec(
            "float32" if tf32 else dtype,
            ms[variant],
            n,
            k,
            "kn" if op == "matmul" else "nk",
            bias="bias" in epilogue,
            activation=activation,
            device="cuda",
            static_k=op == "linear",
            tf32=tf32,
        )
        for variant in variants
    ]
    return list(dict.fromkeys(specs))


def parse_conv_op(text: str):
    """``conv2d:float16:64:64:3x3:56x56:s2:p1`` -> a CUDA Conv2dSpec."""
    from ..kernels.conv2d import Conv2dSpec, is_activation

    def pair(value: str) -> tuple[int, int]:
        a, _, b = value.partition("x")
        return int(a), int(b or a)

    parts = text.split(":")
    try:
        if len(parts) < 6 or parts[0] != "conv2d" or parts[1] not in DTYPES:
            raise ValueError
        (r, s), (h, w) = pair(parts[4]), pair(parts[5])
        geometry = {"s": (1, 1), "p": (0, 0), "d": (1, 1)}
        flags, activation = set(), None
        for option in parts[6:]:
            if option in ("nobias", "norelu"):
                flags.add(option)
            elif is_activation(option) and option not in ("none", "relu"):  # (before "sN")
                activation = option
            elif option[:1] in geometry:
                geometry[option[0]] = pair(option[1:])
            else:
                raise ValueError
        return Conv2dSpec(
            dtype=parts[1],
            c=int(parts[2]),
            k=int(parts[3]),
            r=r,
            s=s,
            h=h,
            w=w,
            stride=geometry["s"],
            padding=geometry["p"],
            dilation=geometry["d"],
            bias="nobias" not in flags,
            relu="norelu" not in flags,
            device="cuda",
            activation=activation,
        )
    except ValueError:
        raise SystemExit(
            f"compile: bad conv {text!r}; expected conv2d:DTYPE:C:K:RxS:HxW[:sN][:pN][:dN]"
            "[:nobias][:norelu|relu6|hardswish|silu|leaky_relu|leaky_relu_SLOPE|sigmoid"
            "|hardsigmoid], "
            "e.g. conv2d:float16:64:64:3x3:56x56:p1"
        ) from None


def run(args) -> int:
    from ..compiler import cuda_pack, pack_writer
    from ..schedules.cuda import MIN_ARCH, arch_number

    arches = cuda_pack.normalize_arches(args.arch)
    old = [a for a in arches if arch_number(a) < MIN_ARCH]
    if old:
        raise SystemExit(f"compile: {', '.join(old)} not supported (sm_70 or newer)")
    cuda_pack.find_nvcc()  # fail early, with the message saying how to get nvcc
    try:
        cuda_pack.check_nvcc_arches(arches)  # e.g. sm_70 with CUDA 13's nvcc
    except cuda_pack.NvccArchError as err:
        raise SystemExit(f"compile: {err}") from None
    variants = [v for v in args.variants.split(",") if v]
    specs = []
    if args.preset:
        from ..tools.cuda_cases import pack_specs

        specs += pack_specs(args.preset)
    for text in args.ops:
        parsed = [parse_conv_op(text)] if text.startswith("conv2d:") else parse_op(text, variants)
        specs += [s for s in parsed if s not in specs]
    if not specs:
        raise SystemExit("compile: nothing to build (give --ops or --preset)")
    print(f"building {len(specs)} CUDA kernels for {', '.join(arches)} into {args.out}")
    start = time.perf_counter()
    manifest = pack_writer.write_pack(specs, arches, args.out)
    print(f"wrote {manifest} in {time.perf_counter() - start:.0f} s")
    return 0

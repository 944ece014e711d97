"""``cache``: what is cached, a size cap, and moving a cache to another machine.

python -m torch_tvm_gemm cache list | info | prune --max-size 500M | clear
python -m torch_tvm_gemm cache export cache.tar.gz | import cache.tar.gz
"""

from __future__ import annotations

import time
from pathlib import Path

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def register(sub) -> None:
    p = sub.add_parser("cache", help="list, prune, clear, export or import the kernel cache")
    actions = p.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="one line per kernel: op, shapes, target, size, last use")
    actions.add_parser("info", help="where the cache is and how big")
    prune = actions.add_parser("prune", help="drop least-recently-used kernels over a cap")
    prune.add_argument("--max-size", required=True, type=parse_size, help="e.g. 500M, 2G")
    clear = actions.add_parser("clear", help="remove every kernel and tuning record")
    clear.add_argument("--keep-tuning", action="store_true", help="remove kernels only")
    export = actions.add_parser("export", help="write kernels + tuning records to a .tar.gz")
    export.add_argument("path", type=Path)
    imp = actions.add_parser("import", help="add an exported cache to this one")
    imp.add_argument("path", type=Path)
    imp.add_argument("--force", action="store_true", help="also kernels of another CPU target")
    p.set_defaults(func=run)


def parse_size(text: str) -> int:
    """'500M' -> bytes (K, M, G are powers of 1024; a trailing B is allowed)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1] if t and t[-1] in _UNITS else ""
    number = t[: len(t) - len(unit)]
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"bad size {text!r}: expected e.g. 500M or 2G") from None
    if value < 0:
        raise ValueError(f"bad size {text!r}: negative")
    return int(value * _UNITS[unit])


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def describe(key: dict) -> tuple[str, str]:
    """(op, shapes) of a kernel key, as a user would name them."""
    if key.get("family") == "conv2d":
        return _describe_conv(key)
    op = "matmul" if key.get("b_layout") == "kn" else "linear"
    k = key.get("k") or "K"
    epi = (" +bias" if key.get("bias") else "") + (
        f" +{key['activation']}" if key.get("activation", "none") != "none" else ""
    )
    tuned = " tuned" if key.get("tuned") else ""
    shapes = f"(M,{k})x({k},{key.get('n')}) {key.get('dtype', '?')}"
    return f"{op}/{key.get('variant', '?')}{epi}{tuned}", shapes


def _describe_conv(key: dict) -> tuple[str, str]:
    """A conv kernel: ``conv2d 3x3 +bias +relu``, ``(N,16,10,10)->32 s1 p1 float32``."""

    def pair(name: str, default: int) -> str:
        a, b = key.get(name) or (default, default)
        return str(a) if a == b else f"{a}x{b}"

    act = key.get("activation") or ("relu" if key.get("relu") else "none")
    epi = (" +bias" if key.get("bias") else "") + ("" if act == "none" else f" +{act}")
    groups = f" g{key['groups']}" if key.get("groups", 1) != 1 else ""
    op = f"conv2d {key.get('r', '?')}x{key.get('s', '?')}{groups}{epi}"
    geo = f"s{pair('stride', 1)} p{pair('padding', 0)}"
    if tuple(key.get("dilation") or (1, 1)) != (1, 1):
        geo += f" d{pair('dilation', 1)}"
    shapes = (
        f"(N,{key.get('c')},{key.get('h')},{key.get('w')})->{key.get('k')} {geo} "
        f"{key.get('dtype', '?')}"
    )
    return op, shapes


def run(args) -> int:
    return ACTIONS[args.action](args)


def _list(args) -> int:
    from torch_tvm_gemm import config
    from torch_tvm_gemm.runtime import cache_admin

    rows = cache_admin.entries()
    if not rows:
        print(f"no kernels in {config.kernels_dir()}")
        return 0
    print(f"{'op':<28} {'shapes':<34} {'target':<24} {'size':>10}  last use")
    for e in sorted(rows, key=lambda e: -e["last_use"]):
        op, shapes = describe(e["key"])
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(e["last_use"]))
        flag = "" if e["intact"] else "  (incomplete)"
        print(
            f"{op:<28} {shapes:<34} {e['key'].get('target', '?'):<24} "
            f"{human(e['size']):>10}  {when}{flag}"
        )
    return 0


def _info(args) -> int:
    from torch_tvm_gemm import config
    from torch_tvm_gemm.runtime import cache_admin
    from torch_tvm_gemm.target import device_key

    rows = cache_admin.entries()
    tuned = list(config.tuning_root().glob("*/best.json")) if config.tuning_root().exists() else []
    print(f"cache dir:      {config.cache_dir()}")
    print(f"kernels:        {len(rows)} ({human(sum(e['size'] for e in rows))})")
    print(f"tuning records: {len(tuned)} kernel(s) tuned")
    print(f"total size:     {human(cache_admin.total_size())}")
    print(f"this CPU:       {device_key('cpu')}")
    return 0


def _prune(args) -> int:
    from torch_tvm_gemm.runtime import cache_admin

    before = cache_admin.total_size()
    removed = cache_admin.prune(args.max_size)
    after = cache_admin.total_size()
    print(f"removed {len(removed)} kernel(s): {human(before)} -> {human(after)}")
    if after > args.max_size:
        print(f"still over {human(args.max_size)}: tuning records are kept (clear removes them)")
    return 0


def _clear(args) -> int:
    from torch_tvm_gemm import config
    from torch_tvm_gemm.runtime import cache_admin

    n, busy = cache_admin.clear(tuning=not args.keep_tuning)
    print(f"removed {n} file(s) from {config.cache_dir()}")
    if busy:
        print(f"left {busy} kernel(s) that another process is building or loading right now")
    return 0


def _export(args) -> int:
    from torch_tvm_gemm.runtime import cache_admin

    n = cache_admin.export_cache(args.path)
    print(f"wrote {n} file(s) to {args.path}")
    return 0


def _import(args) -> int:
    from torch_tvm_gemm import config
    from torch_tvm_gemm.runtime import cache_admin

    if not args.path.exists():
        print(f"cache import: {args.path} does not exist")
        return 2
    try:
        added, skipped = cache_admin.import_cache(args.path, force=args.force)
    except cache_admin.CacheImportError as err:
        print(f"cache import: {err}")
        return 2
    print(f"added {added} file(s) to {config.cache_dir()}")
    for s in skipped:
        print(f"skipped {s}")
    return 0


ACTIONS = {
    "list": _list,
    "info": _info,
    "prune": _prune,
    "clear": _clear,
    "export": _export,
    "import": _import,
}

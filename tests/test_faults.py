"""Fault injection: stale weights, NaN/inf through epilogues, failing disks and file-size
limits, cache management racing with builds and loads, damaged and planted cache files,
unsafe archives, inference tensors, and the memory-map limit."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import tolerance

import torch_tvm_gemm as tg
from torch_tvm_gemm import config
from torch_tvm_gemm.__main__ import main
from torch_tvm_gemm.compiler import build
from torch_tvm_gemm.kernels.gemm import GemmSpec, torch_activation
from torch_tvm_gemm.runtime import build_worker, cache, cache_admin, loader, records, table

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """An empty cache of this test's own, and an empty in-memory kernel table."""
    root = tmp_path / "cache"
    monkeypatch.setenv("TVM_GEMM_CACHE_DIR", str(root))
    table.clear_table()
    yield root
    table.clear_table()


def _spec(n: int = 8, k: int = 8) -> GemmSpec:
    return GemmSpec("float32", n, k, "nk")


def _check_kernel(fn, n: int = 8, k: int = 8) -> None:
    a, w, out = torch.randn(3, k), torch.randn(n, k), torch.empty(3, n)
    fn(a, w, out)
    torch.testing.assert_close(out, a @ w.T)


def _caught(f):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = f()
    return value, [str(w.message) for w in caught]


# --- 1. weights written behind autograd's back ---------------------------------------------


@pytest.mark.parametrize("write", ["data", "numpy"])
@pytest.mark.parametrize("via", ["op", "module"])
def test_conv_sees_weight_writes_that_bump_no_version(write, via):
    x, w, b = torch.randn(2, 16, 10, 10), torch.randn(32, 16, 3, 3), torch.randn(32)
    if via == "module":
        conv = torch.nn.Conv2d(16, 32, 3, padding=1)
        with torch.no_grad():
            conv.weight.copy_(w)
            conv.bias.copy_(b)
        mod = tg.TVMConv2dBiasReLU.from_conv(conv)
        w, b = mod.weight, mod.bias

        def run():
            return mod(x)
    else:

        def run():
            return tg.conv2d_bias_relu(x, w, b, padding=1)

    run()  # a first call, which may keep whatever it likes about the weight
    version = w._version
    if write == "data":
        w.data.mul_(-1)
    else:
        w.detach().numpy()[:] = 0
    assert w._version == version  # (the case: no version counter sees the write)
    with torch.no_grad():
        torch.testing.assert_close(
            run(), F.relu(F.conv2d(x, w, b, padding=1)), **tolerance(x.dtype, 144)
        )


# --- 2. NaN and inf through the fused epilogues ------------------------------------------


def _special_rows(m: int, k: int, dtype) -> torch.Tensor:
    """Rows whose sums are NaN, +inf, -inf, then ordinary values."""
    x = torch.randn(m, k)
    x[0, 3] = float("nan")
    x[1] = x[1].abs()
    x[1, 5] = float("inf")
    x[2] = -x[2].abs()
    x[2, 7] = -float("inf")
    return x.to(dtype)


@pytest.mark.parametrize("m", [4, 40], ids=["dot", "gemm"])
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_linear_epilogue_keeps_nan_and_inf(dtype, activation, m):
    k = n = 64  # a 4096-element weight: M <= 32 takes the dot kernel
    x = _special_rows(m, k, dtype)
    w = torch.rand(n, k).add(0.1).to(dtype)  # positive: row 1 sums to +inf, row 2 to -inf
    b = torch.randn(n).to(dtype)
    # The reference in float64: torch's float32 CPU GELU gives NaN for +inf (its vectorized
    # erf), where the formula and its float64 path give +inf.
    expected = torch_activation(activation)(F.linear(x.double(), w.double(), b.double()))
    y = tg.linear(x, w, b, activation)
    assert y[0].isnan().all() and y[1].isposinf().all()
    assert (y[2] == 0).all() if activation == "relu" else y[2].isnan().all()
    torch.testing.assert_close(y, expected.to(dtype), equal_nan=True, **tolerance(dtype, k))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_epilogue_keeps_nan_and_inf(dtype):
    x = torch.randn(1, 8, 6, 6)
    x[0, 0, 1, 1] = float("nan")
    x[0, 1, 4, 4] = float("inf")
    x = x.to(dtype)
    w = torch.rand(16, 8, 3, 3).add(0.1).to(dtype)
    y = tg.conv2d_bias_relu(x, w, None, padding=1)
    expected = F.relu(F.conv2d(x.double(), w.double(), None, padding=1)).to(dtype)
    assert y.isnan().any() and y.isposinf().any()
    torch.testing.assert_close(y, expected, equal_nan=True, **tolerance(dtype, 72))


@pytest.mark.parametrize("family", ["gemm", "conv2d"])
def test_cuda_epilogue_source_keeps_nan(family):
    """CUDA's fmaxf(x, 0) returns 0 for NaN: the generated relu must be a comparison."""
    from torch_tvm_gemm.kernels.conv2d import Conv2dSpec

    if family == "gemm":
        spec = GemmSpec("float32", 64, 64, "nk", True, "relu", "gemm", "cuda")
    else:
        spec = Conv2dSpec("float32", 16, 16, 3, 3, 8, 8, padding=(1, 1), device="cuda")
    executable, _ = build.compile_spec(spec, arch="sm_80")
    body = executable.source.split('extern "C" __global__', 1)[1]
    assert not re.search(r"max\([^;]*0x0p\+0f", body), "relu as max(x, 0): NaN becomes 0"
    assert "< 0x0p+0f" in body


# --- 3. a build that cannot write its files ----------------------------------------------

FSIZE_CHILD = textwrap.dedent(
    """
    import json, resource, torch
    import torch_tvm_gemm as tg
    resource.setrlimit(resource.RLIMIT_FSIZE, (20 * 1024, 20 * 1024))
    x, w = torch.randn(37, 96), torch.randn(80, 96)
    try:
        ok = torch.allclose(tg.linear(x, w), x @ w.T, atol=1e-4)
        print(json.dumps({"result": "ok" if ok else "wrong"}))
    except Exception as err:
        print(json.dumps({"result": "raised", "error": repr(err)[:300]}))
    """
)


def test_file_size_limit_during_a_build_is_an_exception(tmp_path):
    """Under a 20 KB file-size limit a build cannot write its object files; the process
    must get an exception it can catch (or a working kernel), never exit."""
    env = {**os.environ, "TVM_GEMM_CACHE_DIR": str(tmp_path / "cache"), "TMPDIR": str(tmp_path)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", FSIZE_CHILD], env=env, capture_output=True, text=True, timeout=300
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0, proc.stderr  # the build ran in a worker: only it may die
    assert json.loads(lines[-1])["result"] in ("ok", "raised"), lines


# --- 4. cache clear / prune racing with other processes --------------------------------------

CHURN_CHILD = textwrap.dedent(
    """
    import sys, time
    action, seconds, pause = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    print("started", flush=True)
    end = time.time() + seconds
    while time.time() < end:
        cache_admin.clear() if action == "clear" else cache_admin.prune(0)
        time.sleep(pause)
    """
)


def _churn(root: Path, action: str, seconds: float, pause: float) -> subprocess.Popen:
    env = {**os.environ, "TVM_GEMM_CACHE_DIR": str(root)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [sys.executable, "-c", CHURN_CHILD, action, str(seconds), str(pause)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "started"
    return proc


@pytest.mark.parametrize("action", ["clear", "prune"])
def test_builds_and_loads_survive_a_concurrent_clear_or_prune(private_cache, monkeypatch, action):
    import shutil

    sizes = [(8 + 8 * i, 16) for i in range(6)]
    for n, k in sizes[:3]:  # some cached already: those are loads, the rest builds
        cache.load_or_build(_spec(n, k))
    table.clear_table()
    # Loads from a copy: libraries this process has not loaded yet (see the test below).
    root = private_cache.with_name("copy")
    shutil.copytree(private_cache, root)
    monkeypatch.setenv("TVM_GEMM_CACHE_DIR", str(root))
    churn = _churn(root, action, seconds=120, pause=0.002)
    try:
        for n, k in sizes:
            _check_kernel(cache.load_or_build(_spec(n, k)), n, k)
    finally:
        churn.kill()
        churn.wait()


def test_clear_leaves_a_kernel_being_built_and_removes_leftovers(private_cache):
    from filelock import FileLock

    path = cache.kernel_path(_spec())
    cache.load_or_build(_spec())
    other = cache.kernel_path(_spec(16))
    stale = other.parent / f"{other.name}.deadbeef.tmp"  # a killed process's leftover
    stale.write_bytes(b"")
    in_flight = path.parent / f"{path.name}.cafe1234.tmp"
    in_flight.write_bytes(b"partial")
    with FileLock(str(path) + ".lock"):  # another process is building this kernel
        removed, busy = cache_admin.clear()
    assert busy == 1 and in_flight.exists() and path.exists()
    assert not stale.exists()
    assert cache_admin.clear() == (3, 0) and not path.exists() and not in_flight.exists()


def test_a_kernel_removed_just_before_its_load_is_rebuilt(private_cache, monkeypatch):
    import shutil

    cache.load_or_build(_spec())
    table.clear_table()
    # A copy under another path: this process has not loaded that library yet (a loaded
    # one is found by its path without opening the file).
    shutil.copytree(private_cache, private_cache.with_name("copy"))
    monkeypatch.setenv("TVM_GEMM_CACHE_DIR", str(private_cache.with_name("copy")))
    load = cache.load_kernel_file
    calls = []

    def prune_first(path, name, device="cpu"):
        if not calls:  # a prune in another process wins the race once
            Path(path).unlink()
        calls.append(path)
        return load(path, name, device)

    monkeypatch.setattr(cache, "load_kernel_file", prune_first)
    _check_kernel(cache.load_or_build(_spec()))
    assert len(calls) == 2 and cache.is_intact(cache.kernel_path(_spec()))


# --- 5. damaged cache files ---------------------------------------------------------------


def _damage(path: Path, how: str) -> None:
    meta = path.with_suffix(".json")
    if how in ("list", "string"):
        meta.write_text(json.dumps([1, 2] if how == "list" else "hello"))
    elif how == "so_is_dir":
        path.unlink()
        (path / "inside").mkdir(parents=True)
    elif how == "json_is_dir":
        meta.unlink()
        meta.mkdir()


@pytest.mark.parametrize("how", ["list", "string", "so_is_dir", "json_is_dir"])
def test_damaged_sidecar_or_directory_is_rebuilt(private_cache, how, capsys):
    cache.load_or_build(_spec())
    table.clear_table()
    path = cache.kernel_path(_spec())
    _damage(path, how)
    assert main(["cache", "list"]) == 0
    fn, caught = _caught(lambda: cache.load_or_build(_spec()))
    _check_kernel(fn)
    assert any("rebuilding" in w for w in caught), caught
    assert cache.is_intact(path)
    _damage(path, how)
    assert main(["cache", "clear"]) == 0
    assert cache_admin.entries() == [] and not os.path.lexists(path)


# --- 6. a full cache disk -----------------------------------------------------------------


class _FailingExecutable:
    """A built kernel whose export into the cache fails as a full disk makes it fail (its
    export elsewhere, the fallback's private temporary dir, works)."""

    def __init__(self, real, mode: str) -> None:
        self.real, self.mode = real, mode

    def __getitem__(self, name):
        return self.real[name]

    def export_library(self, path):
        if not str(path).startswith(str(config.kernels_dir())):
            return self.real.export_library(path)
        if self.mode == "enospc":
            raise OSError(errno.ENOSPC, "No space left on device")
        self.real.export_library(path)
        if self.mode == "truncated":  # the linker "succeeded" but the disk kept 24 KB
            with open(path, "r+b") as f:
                f.truncate(min(24 * 1024, os.path.getsize(path) // 2))


@pytest.mark.parametrize("mode", ["enospc", "truncated", "metadata"])
def test_full_cache_disk_falls_back_to_memory(private_cache, monkeypatch, mode):
    monkeypatch.setenv(build_worker.ENV_IN_PROCESS, "1")  # the patched compile_spec below
    compile_spec = build.compile_spec

    def compile_then_fail(spec, *args, **kwargs):
        executable, seconds = compile_spec(spec, *args, **kwargs)
        return _FailingExecutable(executable, mode), seconds

    monkeypatch.setattr(build, "compile_spec", compile_then_fail)
    if mode == "metadata":  # the library fits, its .json does not
        write = cache._atomic_write_text

        def full(path, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(cache, "_atomic_write_text", full)
    fn, caught = _caught(lambda: cache.load_or_build(_spec()))
    _check_kernel(fn)
    assert any("from memory" in w for w in caught), caught
    left = sorted(p.name for p in (private_cache / "kernels").iterdir())
    assert all(name.endswith(".lock") for name in left), left  # no library, no temp file
    if mode == "metadata":
        monkeypatch.setattr(cache, "_atomic_write_text", write)
    monkeypatch.setattr(build, "compile_spec", compile_spec)
    table.clear_table()
    _check_kernel(cache.load_or_build(_spec()))  # space again: built and cached
    assert cache.is_intact(cache.kernel_path(_spec()))


@pytest.fixture
def tiny_disk(tmp_path, monkeypatch):
    """A cache on a tmpfs of a few KB (needs root and mount); yields (root, mount point)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()

    def mount(kib: int) -> Path:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={kib}k,mode=700", "tmpfs", str(mnt)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip()}")
        monkeypatch.setenv("TVM_GEMM_CACHE_DIR", str(mnt / "cache"))
        table.clear_table()
        return mnt / "cache"

    yield mount
    table.clear_table()
    # (lazily: the kernel library loaded from it stays mapped until the process ends)
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.parametrize("kib", [8, 24, 28, 32, 36, 64])
def test_a_real_full_disk_never_leaves_a_broken_kernel(tiny_disk, kib):
    """Whatever fits (here: nothing or part of the library up to 24 KiB, the library but
    not its .json at 28, all from 32): the call works, and the cache holds a whole kernel
    or none of it afterwards."""
    root = tiny_disk(kib)
    spec = GemmSpec("float32", 48, 40, "nk", True, "relu")
    fn, caught = _caught(lambda: cache.load_or_build(spec))
    a, w, b, out = torch.randn(3, 40), torch.randn(48, 40), torch.randn(48), torch.empty(3, 48)
    fn(a, w, b, out)
    torch.testing.assert_close(out, F.relu(F.linear(a, w, b)))
    path = cache.kernel_path(spec)
    left = sorted(p.name for p in (root / "kernels").iterdir() if not p.name.endswith(".lock"))
    if cache.is_intact(path):
        assert left == sorted([path.name, path.with_suffix(".json").name])
    else:
        assert left == [], left  # no truncated library, no temporary file
        assert any("from memory" in w for w in caught), caught


def test_leftover_temp_files_are_removed_by_the_next_build(private_cache):
    path = cache.kernel_path(_spec())
    path.parent.mkdir(parents=True)
    leftovers = [path.parent / f"{path.name}.x1y2z3.tmp", path.parent / f"{path.stem}abc.so.tmp"]
    for p in leftovers:
        p.write_bytes(b"")  # what kill -9 during a build leaves
    cache.load_or_build(_spec())
    assert not any(p.exists() for p in leftovers)


# --- 7. who may put code in the cache ------------------------------------------------------

PLANTED_C = """
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen("%s", "w");
    if (f) { fputs("ran", f); fclose(f); }
}
"""


def _plant(path: Path, marker: Path, tmp_path: Path) -> None:
    """A library at kernel ``path`` whose constructor writes ``marker``, with a sidecar
    holding its true SHA-256: only permissions can tell it from a kernel."""
    src = tmp_path / "planted.c"
    src.write_text(PLANTED_C % marker)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(path), str(src)], check=True)
    data = path.read_bytes()
    meta = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "name": "x"}
    path.with_suffix(".json").write_text(json.dumps(meta))


def test_new_cache_dirs_are_private(private_cache):
    cache.load_or_build(_spec())
    for d in (private_cache, private_cache / "kernels"):
        assert d.stat().st_mode & 0o777 == 0o700
    path = cache.kernel_path(_spec())
    assert path.stat().st_mode & 0o077 == 0


@pytest.mark.parametrize("where", ["dir_mode", "file_mode", "file_owner", "dir_owner"])
def test_code_others_can_write_is_not_loaded(private_cache, tmp_path, where):
    if where.endswith("owner") and os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    path = cache.kernel_path(_spec())
    (private_cache / "kernels").mkdir(parents=True)
    marker = tmp_path / "constructor-ran"
    _plant(path, marker, tmp_path)
    target = private_cache / "kernels" if where.startswith("dir") else path
    if where.endswith("mode"):
        target.chmod(0o777 if where.startswith("dir") else 0o666)
    else:
        os.chown(target, 4321, 4321)
    fn, caught = _caught(lambda: cache.load_or_build(_spec()))
    _check_kernel(fn)
    assert not marker.exists(), "a planted library was loaded"
    assert any("not using the kernel cache" in w or "not loading" in w for w in caught), caught


@pytest.mark.parametrize("where", ["record_dir", "record_file"])
def test_tuning_records_others_can_write_are_ignored(private_cache, where):
    """A tuning record is a schedule trace that is replayed and compiled: code, too."""

    spec = _spec()
    record = records.tuning_dir(spec) / records.BEST
    dirs = [private_cache, config.tuning_root(), record.parent]
    for d in dirs:
        d.mkdir(mode=0o700, exist_ok=True)
    record.write_text(json.dumps({"trace": [], "kept": True}))
    record.chmod(0o600)
    assert records.read_best(spec) is not None
    (record.parent if where == "record_dir" else record).chmod(0o777)
    best, caught = _caught(lambda: records.read_best(spec))
    assert best is None and any("ignoring tuning record" in w for w in caught), caught


def _archive(tmp_path: Path, members: list[tuple[tarfile.TarInfo, bytes]]) -> Path:
    path = tmp_path / "pack.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for info, data in members:
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if info.isfile() else None)
    return path


def _file(name: str, data: bytes = b"x") -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), data


def _link(name: str, target: str, kind=tarfile.SYMTYPE) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info, b""


@pytest.mark.parametrize(
    "bad",
    [
        _file("kernels/../../evil.so"),
        _file("/tmp/evil.so"),
        _link("kernels/a.so", "/etc/passwd"),
        _link("kernels/b.so", "kernels/ok.json", tarfile.LNKTYPE),
    ],
    ids=["dotdot", "absolute", "symlink", "hardlink"],
)
def test_import_refuses_unsafe_archives_whole(private_cache, tmp_path, bad, capsys):
    archive = _archive(tmp_path, [_file("kernels/ok.json", b"{}"), bad])
    with pytest.raises(cache_admin.CacheImportError, match="nothing was imported"):
        cache_admin.import_cache(archive)
    assert not (private_cache / "kernels" / "ok.json").exists()
    assert main(["cache", "import", str(archive)]) == 2
    assert "refusing" in capsys.readouterr().out


def test_import_takes_only_known_folders_and_lists_the_rest(private_cache, tmp_path):
    archive = _archive(
        tmp_path, [_file("kernels/k.json", b"{}"), _file("elsewhere/x.so"), _file("kernels/a/b.so")]
    )
    added, skipped = cache_admin.import_cache(archive)
    assert added == 1 and (private_cache / "kernels" / "k.json").exists()
    assert any("elsewhere/x.so" in s for s in skipped) and any("a/b.so" in s for s in skipped)
    assert not (private_cache / "elsewhere").exists()
    assert (private_cache / "kernels" / "k.json").stat().st_mode & 0o077 == 0


# --- 8. inference tensors, saved only where the backward needs them -----------------------


def _inference(*shape):
    with torch.inference_mode():
        return torch.randn(*shape)


@pytest.mark.parametrize("activation", ["none", "relu", "gelu"])
def test_linear_accepts_inference_inputs_where_torch_does(activation):
    x, w = _inference(4, 8), _inference(3, 8)
    bias = torch.zeros(3, requires_grad=True)
    act = {"none": lambda t: t, "relu": F.relu, "gelu": F.gelu}[activation]
    expected_bias = bias.detach().clone().requires_grad_()
    act(F.linear(x, w, expected_bias)).sum().backward()  # torch accepts this
    tg.linear(x, w, bias, activation).sum().backward()
    torch.testing.assert_close(bias.grad, expected_bias.grad)


def test_conv_accepts_inference_inputs_when_only_the_bias_needs_a_gradient():
    # (torch's own conv saves its input and weight whatever is asked: it refuses this)
    x, w = _inference(2, 3, 6, 6), _inference(4, 3, 3, 3)
    bias = torch.randn(4, requires_grad=True)
    expected_bias = bias.detach().clone().requires_grad_()
    F.relu(F.conv2d(x.clone(), w.clone(), expected_bias, padding=1)).sum().backward()
    tg.conv2d_bias_relu(x, w, bias, padding=1).sum().backward()
    torch.testing.assert_close(bias.grad, expected_bias.grad)


def test_conv_grads_with_one_operand_not_saved():
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, requires_grad=True)
    for need_x in (True, False):
        xs, ws = x.detach().requires_grad_(need_x), w.detach().requires_grad_(not need_x)
        tg.conv2d_bias_relu(xs, ws, None, padding=1).sum().backward()
        xr, wr = x.detach().requires_grad_(need_x), w.detach().requires_grad_(not need_x)
        F.relu(F.conv2d(xr, wr, None, padding=1)).sum().backward()
        got, want = (xs.grad, xr.grad) if need_x else (ws.grad, wr.grad)
        torch.testing.assert_close(got, want)


# --- the rest: listing conv kernels, the memory-map limit ----------------------------------


def test_cache_list_describes_conv_kernels(private_cache, capsys):
    tg.conv2d_bias_relu(torch.randn(1, 4, 6, 6), torch.randn(8, 4, 3, 3), torch.randn(8), padding=1)
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert "conv2d 3x3 +bias +relu" in out and "(N,4,6,6)->8 s1 p1 float32" in out
    assert "linear/?" not in out


def test_loading_stops_with_a_clear_error_near_the_map_limit(private_cache, monkeypatch):
    monkeypatch.setattr(loader, "MAP_CHECK_EVERY", 1)
    monkeypatch.setattr(loader, "_max_map_count", lambda: loader._map_count())
    with pytest.raises(RuntimeError, match="vm.max_map_count"):
        cache.load_or_build(_spec())

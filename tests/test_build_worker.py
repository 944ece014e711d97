"""Kernel builds in compile-worker processes: a worker that dies is an exception in the caller,
never the caller's end; the next build starts a new worker; threads and forks are safe.

(That a cold-cache call leaves ``tvm`` out of the caller's process is tested in
test_cache.py, with the other cold/warm start checks.)
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from torch_tvm_gemm.kernels.gemm import GemmSpec
from torch_tvm_gemm.runtime import build_worker, table
from torch_tvm_gemm.runtime.build_worker import KernelBuildError
from torch_tvm_gemm.runtime.precompile import precompile_specs

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty cache dir, builds in workers (whatever the caller's environment says)."""
    monkeypatch.setenv("TVM_GEMM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TVM_GEMM_BUILD_IN_PROCESS", raising=False)
    monkeypatch.delenv("TVM_GEMM_NO_COMPILE", raising=False)
    return tmp_path / "cache"


def spec_of(n: int, k: int) -> GemmSpec:
    return GemmSpec("float32", n=n, k=k, b_layout="kn")


def check_matmul(fn, n: int, k: int) -> None:
    a, b, out = torch.randn(5, k), torch.randn(k, n), torch.empty(5, n)
    fn(a, b, out)
    torch.testing.assert_close(out, a @ b)


def test_killed_worker_raises_and_the_next_call_works(fresh_cache):
    a, b = torch.randn(5, 7), torch.randn(7, 19)  # a kernel no other test builds
    build_worker.shutdown()  # so that the only worker is the one that builds it
    killed = []

    def kill_the_worker_mid_build():
        deadline = time.monotonic() + 120
        while not build_worker.worker_pids() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # the worker is importing the compiler or compiling: seconds
        for pid in build_worker.worker_pids():
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    killer = threading.Thread(target=kill_the_worker_mid_build)
    killer.start()
    with pytest.raises(KernelBuildError, match="SIGKILL") as info:
        torch.ops.tvm_gemm.matmul(a, b)  # through the op: its C++ miss handler included
    killer.join()
    assert killed, "the build ended before the worker could be killed"
    assert "n19" in info.value.kernel and info.value.kernel in str(info.value)
    assert not list((fresh_cache / "kernels").glob("*.tmp")), "a partial library was left"
    torch.testing.assert_close(torch.ops.tvm_gemm.matmul(a, b), a @ b)  # a new worker
    assert killed[0] not in build_worker.worker_pids()


# As a user's script under a file-size limit (or with a full temp disk): LLVM fails to write
# its output and calls exit(1). That must end the worker, not this process.
FSIZE_CHILD = """
import torch, torch_tvm_gemm as tg
try:
    tg.linear(torch.randn(37, 96), torch.randn(80, 96))
except Exception as err:
    print("caught", type(err).__name__, err)
else:
    print("built")
"""


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash for ulimit")
def test_file_size_limit_is_an_exception_in_the_caller(tmp_path):
    env = {**os.environ, "TVM_GEMM_CACHE_DIR": str(tmp_path)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("TVM_GEMM_BUILD_IN_PROCESS", None)
    proc = subprocess.run(
        ["bash", "-c", 'ulimit -f 20 && exec "$0" -c "$1"', sys.executable, FSIZE_CHILD],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "caught KernelBuildError" in proc.stdout, proc.stdout + proc.stderr
    assert "gemm_gemm_float32_nk_n80_k96" in proc.stdout
    assert "exit code 1" in proc.stdout or "SIGXFSZ" in proc.stdout, proc.stdout
    assert not list((tmp_path / "kernels").glob("*.tmp"))


def test_build_error_keeps_its_type_and_names_the_kernel(tmp_path):
    spec = spec_of(8, 8)
    with pytest.raises(RuntimeError, match="cannot open output file") as info:
        build_worker.build(spec, tmp_path / "no_such_dir" / "kernel.so")
    if sys.version_info >= (3, 11):
        assert spec.name() in "".join(info.value.__notes__)


def test_a_reply_cannot_name_compiler_classes():
    # Unpickling a class of ``tvm`` would import the compiler into the caller's process.
    with pytest.raises(Exception, match="not allowed"):
        build_worker._loads(b"ctvm.target\nTarget\n.")


def test_threads_build_each_kernel_once(fresh_cache):
    specs = [spec_of(23, 9), spec_of(29, 9), spec_of(31, 9)]
    before = build_worker.build_count()
    with ThreadPoolExecutor(6) as pool:  # two threads per kernel, at once
        fns = list(pool.map(table.get_kernel, specs + specs))
    assert build_worker.build_count() - before == len(specs)
    for spec, fn in zip(specs + specs, fns, strict=True):
        check_matmul(fn, spec.n, spec.k)


def test_precompile_specs_builds_the_missing_ones(fresh_cache):
    specs = [spec_of(37, 11), spec_of(41, 11)]
    assert precompile_specs(specs + specs[:1]) == 2
    before = build_worker.build_count()
    for spec in specs:  # now in the kernel table
        check_matmul(table.get_kernel(spec), spec.n, spec.k)
    assert build_worker.build_count() == before
    table.clear_table()
    assert precompile_specs(specs, workers=1) == 0  # from the disk cache


def test_precompile_specs_names_every_failed_kernel(fresh_cache, monkeypatch):
    monkeypatch.setenv("TVM_GEMM_NO_COMPILE", "1")
    specs = [spec_of(43, 13), spec_of(47, 13)]
    with pytest.raises(KernelBuildError, match="2 of 2 kernels failed") as info:
        precompile_specs(specs)
    assert set(info.value.errors) == {s.name() for s in specs}
    with pytest.raises(ValueError, match="workers"):
        precompile_specs(specs, workers=0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_starts_its_own_worker(tmp_path, fresh_cache):
    build_worker.build(spec_of(53, 5), tmp_path / "parent1.so")
    (parent_worker,) = build_worker.worker_pids()
    pid = os.fork()
    if pid == 0:  # the child: the parent's worker is not its to use
        ok = False
        try:
            build_worker.build(spec_of(59, 5), tmp_path / "child.so")
            ok = (
                tmp_path / "child.so"
            ).exists() and parent_worker not in build_worker.worker_pids()
        finally:
            build_worker.shutdown()
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    build_worker.build(spec_of(61, 5), tmp_path / "parent2.so")
    assert build_worker.worker_pids() == [parent_worker]  # the parent's worker still serves it


def test_an_idle_worker_stops_after_the_timeout(tmp_path, fresh_cache, monkeypatch):
    monkeypatch.setattr(build_worker, "IDLE_TIMEOUT_S", 0.5)
    if build_worker._reaper is not None:  # a check already planned with the long timeout
        build_worker._reaper.cancel()
        build_worker._reaper = None
    build_worker.build(spec_of(67, 5), tmp_path / "k.so")
    assert build_worker.worker_pids()
    deadline = time.monotonic() + 30
    while build_worker.worker_pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not build_worker.worker_pids(), "the idle worker (and its memory) stayed"


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except (OSError, IndexError):
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_build_stops_when_its_caller_dies(tmp_path):
    # A worker whose caller is killed mid-build removes its half-written library and exits
    # within a poll or two, rather than compile on for nobody. The stand-in: a process with
    # the worker's watch armed, "building" (sleeping) for minutes, its caller then killed.
    half, armed = tmp_path / "half.so", tmp_path / "armed"
    half.write_bytes(b"half a library")
    worker = (
        "import time\n"
        "from torch_tvm_gemm.compiler.worker import _abandon, _when_orphaned\n"
        f"_when_orphaned(lambda: _abandon({str(half)!r}))\n"
        f"open({str(armed)!r}, 'w').close()\n"
        "time.sleep(600)\n"
    )
    caller = (
        "import subprocess, sys, time\n"
        f"w = subprocess.Popen([sys.executable, '-c', {worker!r}], start_new_session=True)\n"
        "print(w.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", caller], stdout=subprocess.PIPE, env=env)
    pid = int(proc.stdout.readline())
    try:
        deadline = time.monotonic() + 120
        while not armed.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert armed.exists() and _running(pid)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(pid), "the orphaned worker went on"
        assert not half.exists()
    finally:
        proc.kill()
        if _running(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow  # a tuning worker imports torch and the compiler: seconds
def test_a_killed_tuning_worker_is_an_exception_naming_the_kernel(fresh_cache):
    import psutil

    from torch_tvm_gemm.runtime import tune_worker

    spec = GemmSpec("float32", n=40, k=24, b_layout="kn")
    before = {child.pid for child in psutil.Process().children()}
    killed = []

    def tuning_worker():
        for child in psutil.Process().children():
            try:
                if child.pid not in before and build_worker.WORKER_MODULE in child.cmdline()[-1]:
                    return child
            except (psutil.Error, IndexError):  # gone meanwhile
                pass
        return None

    def kill_the_tuning_worker():
        deadline = time.monotonic() + 120
        while (worker := tuning_worker()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # importing torch and the compiler, or tuning
        worker.kill()
        killed.append(worker.pid)

    killer = threading.Thread(target=kill_the_tuning_worker)
    killer.start()
    with pytest.raises(KernelBuildError, match="tuning kernel .* died .*SIGKILL") as info:
        tune_worker.tune(spec, 20, trials=200, time_budget_s=60, progress=False)
    killer.join()
    assert killed and info.value.kernel == spec.name() and info.value.exit_code == -9
    assert not psutil.pid_exists(killed[0])  # reaped: no zombie left behind


STOP_CHILD = """
import ctypes, os, signal, time
from torch_tvm_gemm.compiler.worker import _interruptible
from torch_tvm_gemm.runtime.build_worker import STOP_SIGNAL

def run(request):
    stops = []
    signal.signal(signal.SIGINT, lambda signum, frame: stops.append(int(signum)))  # a tuning's flag
    # what the compiler's SMT solver does while it proves: SIGINT taken over at the C level
    ctypes.CDLL(None).signal(signal.SIGINT, ctypes.c_void_p(1))  # SIG_IGN
    os.kill(os.getpid(), signal.SIGINT)  # lost
    os.kill(os.getpid(), STOP_SIGNAL)  # the caller's Ctrl-C, passed on
    deadline = time.monotonic() + 10
    while not stops and time.monotonic() < deadline:
        time.sleep(0.01)
    return stops

print("stops:", _interruptible(run, {}))
"""


def test_the_stop_signal_reaches_the_tuning_loop_while_sigint_is_taken():
    env = {**os.environ}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", STOP_CHILD], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"stops: [{int(signal.SIGINT)}]" in proc.stdout, proc.stdout + proc.stderr

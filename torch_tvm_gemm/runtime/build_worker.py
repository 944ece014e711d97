"""Kernel builds in compile-worker processes: the caller's process never imports the compiler.

``build(spec, path)`` compiles a kernel and writes its library to ``path``, in a worker: a
fresh Python interpreter running ``compiler/worker.py`` (what multiprocessing's "spawn"
starts, without re-running the caller's ``__main__`` script, which spawn does and which would
re-run an unguarded training script). The worker is started on the first build and reused
for the next ones. Why a separate process:

- the compiler (~250 MB of libraries, ~3 s to import) never enters the caller's process;
- a build that ends its process (LLVM's ``exit(1)`` on a full disk or a file-size limit, an
  out-of-memory kill, a signal) ends the worker only: the caller gets a ``KernelBuildError``
  naming the kernel, the cause and the tail of the worker's stderr, and the next build
  starts a new worker;
- several kernels build at once, one per worker (``precompile.precompile_specs``).

Builds of different kernels from several threads run in parallel, up to ``max_workers()``
workers; more wait for a free one. Idle workers beyond the first are stopped when a batch
ends (``trim``), and the last one after ``IDLE_TIMEOUT_S``.

``TVM_GEMM_BUILD_IN_PROCESS=1`` builds in the calling process instead (for debugging: the
compiler's errors and prints appear as they happen, and a debugger sees the build); a build
that exits the process then takes the caller with it.

The cache protocol (file lock, atomic rename, checksums, loading) stays with the caller
(``cache.py``): a worker only writes the library to the path it is given.
"""

from __future__ import annotations

import atexit
import importlib
import io
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

from .worker_pipe import MESSAGE_HEADER, read_exact, write_all

ENV_IN_PROCESS = "TVM_GEMM_BUILD_IN_PROCESS"  # "1": build in the calling process
ENV_WORKERS = "TVM_GEMM_BUILD_WORKERS"  # most workers at once (default: the usable cores)
IDLE_TIMEOUT_S = 300.0  # an idle worker is stopped after this long (its memory freed)
STDERR_TAIL_BYTES = 4096  # how much of a dead worker's stderr its error quotes
# How a caller tells a tuning worker "stop after this round" (its Ctrl-C, passed on). Not
# SIGINT: while the compiler proves a bound with its SMT solver (Z3) it holds SIGINT for
# itself and swallows the first one, so a forwarded SIGINT was sometimes lost and the
# tuning ran to its end.
STOP_SIGNAL = signal.SIGUSR1
# What a reply may name (exception and warning classes): never the compiler's own modules,
# whose unpickling would import ``tvm`` here.
SAFE_MODULES = ("builtins", "torch_tvm_gemm", "tvm_ffi")

# The worker's first lines. It finds modules where the caller does (its sys.path, as
# multiprocessing's spawn passes it) and imports this copy of the package without running
# its __init__ (which registers the torch ops: compiling needs none of that), and without
# torch, which tvm_ffi imports when it can: a worker then starts in about half the time and
# memory (measured: `import tvm` 2.3 s / 200 MB without torch, 6.7 s / 400 MB with it, on a
# loaded 2-core machine).
_PACKAGE_DIR = Path(__file__).resolve().parent.parent
WORKER_MODULE = "torch_tvm_gemm.compiler.worker"
_BOOT = """
import importlib.util, sys
sys.path[:] = {path!r}
{no_torch}
spec = importlib.util.spec_from_file_location(
    "torch_tvm_gemm", {init!r}, submodule_search_locations=[{package!r}])
sys.modules["torch_tvm_gemm"] = importlib.util.module_from_spec(spec)
from torch_tvm_gemm.compiler.worker import main
main(caller={caller})
"""


def _boot(with_torch: bool = False) -> str:
    init = str(_PACKAGE_DIR / "__init__.py")
    no_torch = "" if with_torch else 'sys.modules["torch"] = None'
    return _BOOT.format(
        path=list(sys.path),
        no_torch=no_torch,
        init=init,
        package=str(_PACKAGE_DIR),
        caller=os.getpid(),
    )


class KernelBuildError(RuntimeError):
    """A kernel could not be built: its compile worker died (the exit code or signal and
    its last output are in the message) or could not start, or the build failed with an
    error that could not be passed on as itself. ``kernel``: the kernel's name;
    ``exit_code``: the dead worker's (negative: the signal), None if it did not die."""

    def __init__(self, message: str, kernel: str = "", exit_code: int | None = None) -> None:
        super().__init__(message)
        self.kernel = kernel
        self.exit_code = exit_code


def in_process() -> bool:
    return os.environ.get(ENV_IN_PROCESS, "") not in ("", "0")


def max_workers() -> int:
    """How many workers may build at once: ``TVM_GEMM_BUILD_WORKERS``, else the usable cores."""
    value = os.environ.get(ENV_WORKERS, "")
    if value:
        try:
            if int(value) >= 1:
                return int(value)
        except ValueError:
            pass
        raise ValueError(f"torch_tvm_gemm: {ENV_WORKERS} must be a positive integer, got {value!r}")
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def build(spec, path: str | os.PathLike, arch: str | None = None) -> float:
    """Compile ``spec`` and write its library to ``path`` (for CUDA: built for ``arch``).

    Returns the seconds the build took. An error raised by the build is raised here, with
    its own type; a worker that dies raises ``KernelBuildError``.
    """
    global _builds
    with _cond:
        _builds += 1
    path = os.path.abspath(path)
    if in_process():
        # The one place the runtime reaches the compiler in its own process (debugging).
        worker = importlib.import_module(WORKER_MODULE)
        return worker.build_to_file(spec, path, arch)
    request = pickle.dumps(
        {
            "kind": "build",
            "spec": spec,
            "path": path,
            "arch": arch,
            # What the build reads (cache and tuning dirs, schedule switches) as the caller
            # has it now: tests and users change the environment after the worker started.
            "env": dict(os.environ),
            "cwd": os.getcwd(),
        }
    )
    try:
        worker = _acquire()
    except OSError as err:  # no process to be had (process or memory limits)
        raise KernelBuildError(
            f"torch_tvm_gemm: cannot start a compile worker to build kernel {spec.name()}: "
            f"{err} ({ENV_IN_PROCESS}=1 builds in this process instead)",
            kernel=spec.name(),
        ) from err
    healthy = False
    try:
        reply = worker.ask(request)
        healthy = True
    except _WorkerDied as died:
        raise died.error(
            f"building kernel {spec.name()} died ({died.cause}); the kernel was not built, "
            "the next build starts a new worker",
            spec.name(),
        ) from None
    finally:
        _release(worker, healthy)
    _pass_on(reply, spec)
    return reply["seconds"]


def ask_alone(request: dict, spec, doing: str) -> dict:
    """Run one request in a worker of its own, then stop it: for a tuning (``doing``), which
    takes minutes and needs torch. The worker may import torch and its stderr (progress,
    the compiler's messages) is passed on to ours as it comes. The first Ctrl-C is passed
    to the worker as STOP_SIGNAL (a tuning stops after its round and replies
    ``interrupted``), a second one kills it; either way KeyboardInterrupt is raised here.
    No timeout: the request ends when the worker replies or dies (``KernelBuildError``,
    naming ``doing`` and the cause).
    """
    try:
        worker = _Worker(with_torch=True, echo_stderr=True)
    except OSError as err:
        raise KernelBuildError(
            f"torch_tvm_gemm: cannot start a compile worker for {doing}: {err}",
            kernel=spec.name(),
        ) from err
    ctrl_c = {"hits": 0}

    def on_ctrl_c(signum, frame) -> None:
        ctrl_c["hits"] += 1
        if ctrl_c["hits"] == 1:
            os.kill(worker.proc.pid, STOP_SIGNAL)
        else:
            worker.proc.kill()

    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT) if on_main else signal.SIG_IGN
    if previous != signal.SIG_IGN:
        signal.signal(signal.SIGINT, on_ctrl_c)
    try:
        reply = worker.ask(pickle.dumps(request))
    except _WorkerDied as died:
        if ctrl_c["hits"]:
            raise KeyboardInterrupt from None
        raise died.error(f"for {doing} died ({died.cause})", spec.name()) from None
    finally:
        if previous != signal.SIG_IGN:
            signal.signal(signal.SIGINT, previous)
        worker.stop()
    if reply["interrupted"] or ctrl_c["hits"]:
        raise KeyboardInterrupt
    _pass_on(reply, spec)
    return reply


def _pass_on(reply: dict, spec) -> None:
    """Warn the reply's warnings here; raise its error (``_error_of``)."""
    for category, message in reply["warnings"]:
        warnings.warn(message, category, stacklevel=3)
    if reply["error"] is not None:
        raise _error_of(reply, spec)


def build_count() -> int:
    """Builds this process has asked for (in workers or in process) since it started."""
    return _builds


def trim(keep: int = 1) -> None:
    """Stop idle workers beyond ``keep`` (after a batch of parallel builds)."""
    with _cond:
        cut = max(0, len(_idle) - keep)  # the least recently used go
        extra, _idle[:cut] = _idle[:cut], []
    for worker in extra:
        _retire(worker)


def shutdown() -> None:
    """Stop every idle worker (busy ones stop when their build returns)."""
    trim(keep=0)


def worker_pids() -> list[int]:
    """Process ids of the live workers, idle or building."""
    with _cond:
        return [w.proc.pid for w in _all]


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module.split(".")[0] not in SAFE_MODULES:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a reply")
        return super().find_class(module, name)


def _loads(data: bytes):
    return _SafeUnpickler(io.BytesIO(data)).load()


def _error_of(reply: dict, spec) -> BaseException:
    """The exception the build raised in the worker, or a KernelBuildError telling it."""
    where = f"(raised in the compile worker building kernel {spec.name()})"
    try:
        err = _loads(reply["error"])
    except Exception:
        err = None
    if not isinstance(err, Exception):
        return KernelBuildError(
            f"torch_tvm_gemm: building kernel {spec.name()} failed in the compile worker: "
            f"{reply['error_text']}",
            kernel=spec.name(),
        )
    if hasattr(err, "add_note"):  # Python 3.11+
        err.add_note(f"{where}\n{reply['traceback']}")
    return err


# --- one worker -------------------------------------------------------------------------------


class _WorkerDied(Exception):
    def __init__(self, cause: str, stderr: str, code: int | None) -> None:
        super().__init__(cause)
        self.cause, self.stderr, self.code = cause, stderr, code

    def error(self, what: str, kernel: str) -> KernelBuildError:
        """The caller's exception: "the compile worker <what>", and the worker's last output."""
        return KernelBuildError(
            f"torch_tvm_gemm: the compile worker {what}"
            + (f". The worker's last output:\n{self.stderr}" if self.stderr else ""),
            kernel=kernel,
            exit_code=self.code,
        )


class _Worker:
    """A compile-worker process, its request/reply pipes, and the tail of its stderr."""

    def __init__(self, with_torch: bool = False, echo_stderr: bool = False) -> None:
        self._echo = echo_stderr
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _boot(with_torch)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            # Unbuffered: plain file objects without the locks of buffered ones, which a
            # thread blocked reading would hold across a fork of the caller (its child would
            # hang closing them).
            bufsize=0,
            # Its own session: a Ctrl-C at the terminal interrupts the caller, which then
            # stops the worker, rather than killing a build halfway through its output.
            start_new_session=True,
        )
        self.idle_since = time.monotonic()
        self._tail = bytearray()
        self._drain = threading.Thread(target=self._read_stderr, daemon=True)
        self._drain.start()

    def _read_stderr(self) -> None:
        # Always drained, so that a chatty build never blocks on a full pipe.
        fd = self.proc.stderr.fileno()
        while chunk := os.read(fd, 65536):
            if self._echo:
                _echo(chunk)
            self._tail += chunk
            del self._tail[:-STDERR_TAIL_BYTES]
        self.proc.stderr.close()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ask(self, request: bytes) -> dict:
        """Send a pickled request, wait for the reply; _WorkerDied if the worker dies."""
        try:
            write_all(self.proc.stdin.fileno(), MESSAGE_HEADER.pack(len(request)) + request)
            header = read_exact(self.proc.stdout.fileno(), MESSAGE_HEADER.size)
            if header is not None:
                body = read_exact(self.proc.stdout.fileno(), MESSAGE_HEADER.unpack(header)[0])
                if body is not None:
                    return _loads(body)
        except (BrokenPipeError, ConnectionResetError):
            pass
        raise self._died()

    def _died(self) -> _WorkerDied:
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # it closed its pipe but lives on: end it
            self.kill()
            code = self.proc.returncode
        self._drain.join(timeout=5)
        return _WorkerDied(_describe_exit(code), self._tail.decode(errors="replace").strip(), code)

    def stop(self) -> None:
        """Ask an idle worker to exit (the end of its input); kill it if it does not."""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
        self._close()

    def kill(self) -> None:
        self.proc.kill()
        self._close()

    def _close(self) -> None:
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        self._drain.join(timeout=2)  # it closes stderr at the end of the worker's output


def _echo(chunk: bytes) -> None:
    try:
        out = getattr(sys.stderr, "buffer", None)
        out.write(chunk) if out else sys.stderr.write(chunk.decode(errors="replace"))
        sys.stderr.flush()
    except (OSError, ValueError):  # our stderr is closed: the tail is still kept
        pass


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "it stopped answering"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = {
            "SIGKILL": ": out of memory, or killed by another process",
            "SIGXFSZ": ": the file-size limit (ulimit -f)",
            "SIGSEGV": ": a crash in the compiler",
        }.get(name, "")
        return f"killed by {name}{hint}"
    return f"exit code {code}"


# --- the pool ---------------------------------------------------------------------------------

_cond = threading.Condition()
_idle: list[_Worker] = []  # started and waiting for a request, last used at the end
_all: list[_Worker] = []  # every live worker, idle or busy
_starting = 0  # workers being started (counted against max_workers)
_builds = 0
_reaper: threading.Timer | None = None


def _acquire() -> _Worker:
    global _starting
    with _cond:
        while True:
            while _idle:
                worker = _idle.pop()
                if worker.alive():
                    return worker
                _all.remove(worker)  # died while idle (killed): forget it
            if len(_all) + _starting < max_workers():
                _starting += 1
                break
            _cond.wait()
    try:
        worker = _Worker()
    finally:
        with _cond:
            _starting -= 1
            _cond.notify()
    with _cond:
        _all.append(worker)
    return worker


def _release(worker: _Worker, healthy: bool) -> None:
    """Put a worker back after a request; one that failed or was interrupted is ended."""
    if not healthy:
        with _cond:
            if worker in _all:
                _all.remove(worker)
            _cond.notify()
        worker.kill()
        return
    with _cond:
        worker.idle_since = time.monotonic()
        _idle.append(worker)
        _cond.notify()
    _schedule_reaper()


def _retire(worker: _Worker) -> None:
    with _cond:
        if worker in _all:
            _all.remove(worker)
        _cond.notify()
    worker.stop()


def _schedule_reaper() -> None:
    global _reaper
    with _cond:
        if _reaper is not None:
            return
        _reaper = threading.Timer(IDLE_TIMEOUT_S, _reap)
        _reaper.daemon = True
        _reaper.start()


def _reap() -> None:
    """Stop workers idle for IDLE_TIMEOUT_S; check again later while some remain."""
    global _reaper
    now = time.monotonic()
    with _cond:
        _reaper = None
        stale = [w for w in _idle if now - w.idle_since >= IDLE_TIMEOUT_S]
        _idle[:] = [w for w in _idle if w not in stale]
        more = bool(_idle)
    for worker in stale:
        _retire(worker)
    if more:
        _schedule_reaper()


def _forget_after_fork() -> None:
    """In a forked child: the workers belong to the parent. Start afresh (the lock may have
    been held by another thread at the fork), and close our copies of their request pipes,
    so that the workers still see the end of their input when the parent stops them."""
    global _cond, _idle, _all, _starting, _reaper
    for worker in _all:
        for pipe in (worker.proc.stdin, worker.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass
    _cond, _idle, _all, _starting, _reaper = threading.Condition(), [], [], 0, None


def _stop_all() -> None:
    with _cond:
        workers = list(_all)
    for worker in workers:
        worker.stop() if worker in _idle else worker.kill()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forget_after_fork)
atexit.register(_stop_all)

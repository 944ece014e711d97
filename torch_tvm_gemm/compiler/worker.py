"""The compile worker's side: read build (or tuning) requests, run them, reply.

Started by ``runtime/build_worker.py`` as a fresh interpreter. Requests arrive on stdin and replies leave
on the original stdout, each a length-prefixed pickle; the worker's fd 1 is pointed at its
stderr, so that whatever the compiler prints can never be mistaken for a reply. The worker
exits at the end of its input (the caller stopped it or died), and a build or tuning in
progress stops within ORPHAN_POLL_S of the caller's death.

A build request: ``{"kind": "build", "spec", "path", "arch", "env", "cwd"}``; a tuning
request: ``{"kind": "tune", "spec", "m", "k", "options", "database", "env", "cwd"}`` (the
options of ``compiler.tune.tune_spec``; tuning workers are started with torch, which the
verdict needs). A reply: ``{"seconds", "result", "interrupted", "warnings", "error",
"error_text", "traceback"}`` (``result``: a tuning's ``TuneResult``; ``interrupted``: a
tuning stopped by the caller's STOP_SIGNAL, what it measured kept; ``error``: None, or the
exception pickled, or b"" where it cannot cross as itself: the caller then raises
``KernelBuildError`` with the text).
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
import traceback
import warnings

from ..runtime.build_worker import SAFE_MODULES, STOP_SIGNAL
from ..runtime.worker_pipe import MESSAGE_HEADER, read_exact, write_all

ORPHAN_POLL_S = 1.0  # how often a busy worker checks that its caller is alive
_caller = os.getppid()  # the caller's pid (``main`` is told it: it may be gone already)


def build_to_file(spec, path: str, arch: str | None = None) -> float:
    """Compile ``spec`` (for CUDA: for ``arch``) and write its library to ``path``; seconds."""
    from .build import compile_spec

    start = time.perf_counter()
    executable, _ = compile_spec(spec, arch=arch)
    executable.export_library(path)
    return time.perf_counter() - start


def tune(request: dict):
    """Run one tuning request (``compiler.tune.tune_spec``); its ``TuneResult``."""
    from ..runtime.records import tuning_dir
    from .tune import tune_spec

    spec = request["spec"]
    if str(tuning_dir(spec)) != request["database"]:  # caller and worker must agree
        raise RuntimeError(
            f"torch_tvm_gemm: the tuning worker would write kernel {spec.name()}'s records to "
            f"{tuning_dir(spec)}, not to {request['database']} where the caller reads them"
        )
    return tune_spec(spec, request["m"], request["k"], **request["options"])


def serve(request: dict) -> dict:
    """Run one request; its reply (an error is reported, never raised)."""
    reply = {"seconds": 0.0, "result": None, "interrupted": False, "warnings": []}
    reply |= {"error": None, "error_text": "", "traceback": ""}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # the caller's own filters decide what is shown
        try:
            os.environ.clear()
            os.environ.update(request["env"])
            os.chdir(request["cwd"])
            if request.get("kind") == "tune":
                start = time.perf_counter()
                reply["result"] = _interruptible(tune, request)
                reply["seconds"] = time.perf_counter() - start
            else:
                spec, path, arch = request["spec"], request["path"], request["arch"]
                done = _when_orphaned(lambda: _abandon(path))
                try:
                    reply["seconds"] = build_to_file(spec, path, arch)
                finally:
                    done.set()
        except KeyboardInterrupt:  # the caller's STOP_SIGNAL: tuning stopped between rounds
            reply["interrupted"] = True
        except Exception as err:
            reply["error_text"] = f"{type(err).__name__}: {err}"
            reply["traceback"] = traceback.format_exc()
            reply["error"] = _pickled(err)
    reply["warnings"] = [(_portable_class(w.category, UserWarning), str(w.message)) for w in caught]
    return reply


def _when_orphaned(action) -> threading.Event:
    """Run ``action`` once if the caller dies (this process is re-parented) before the
    returned event is set: nobody would read the reply, so the work should stop."""
    done = threading.Event()

    def watch() -> None:
        while not done.wait(ORPHAN_POLL_S):
            if os.getppid() != _caller:
                action()
                return

    threading.Thread(target=watch, daemon=True).start()
    return done


def _abandon(path: str) -> None:
    """A build whose caller died (killed, say): remove its half-written library and exit
    now rather than compile on for nobody (a large kernel takes a core for seconds)."""
    try:
        os.unlink(path)
    except OSError:
        pass
    os._exit(1)


def _interruptible(run, request: dict):
    """``run(request)`` with STOP_SIGNAL acting as a Ctrl-C (the caller's way to stop a
    tuning: ``compiler.tune`` then stops after the current round), and sent to ourselves if
    the caller dies meanwhile (stop likewise, keeping what was measured).

    STOP_SIGNAL calls whatever Python handler SIGINT has at that moment (KeyboardInterrupt,
    or the tuning loop's stop-after-this-round flag): Python's table, not the process's,
    which the compiler's SMT solver takes over while it proves (see STOP_SIGNAL)."""

    def as_ctrl_c(signum, frame) -> None:
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler):
            handler(signal.SIGINT, frame)

    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started ignoring it
    signal.signal(STOP_SIGNAL, as_ctrl_c)
    done = _when_orphaned(lambda: os.kill(os.getpid(), STOP_SIGNAL))
    try:
        return run(request)
    finally:
        done.set()
        for signum in (signal.SIGINT, STOP_SIGNAL):  # a late one must not kill the reply
            signal.signal(signum, signal.SIG_IGN)


def _portable_class(cls: type, fallback: type) -> type:
    """``cls`` if the caller can unpickle it without importing the compiler, else ``fallback``
    (an exception class of ``tvm`` would import ``tvm`` into the caller's process)."""
    return cls if cls.__module__.split(".")[0] in SAFE_MODULES else fallback


def _pickled(err: Exception) -> bytes:
    """The exception pickled if it crosses to the caller intact, else b"" (told as text)."""
    if _portable_class(type(err), None) is None:
        return b""
    try:
        data = pickle.dumps(err)
        pickle.loads(data)  # some exceptions pickle but do not unpickle
        return data
    except Exception:
        return b""


def main(caller: int | None = None) -> None:
    global _caller
    if caller is not None:
        _caller = caller
    replies = os.dup(1)
    os.dup2(2, 1)
    requests = sys.stdin.fileno()
    while (header := read_exact(requests, MESSAGE_HEADER.size)) is not None:
        body = read_exact(requests, MESSAGE_HEADER.unpack(header)[0])
        if body is None:
            break
        request = pickle.loads(body)
        reply = pickle.dumps(serve(request))
        try:
            write_all(replies, MESSAGE_HEADER.pack(len(reply)) + reply)
        except OSError:  # the caller is gone: nobody will move the library into place
            try:
                os.unlink(request["path"])
            except OSError:
                pass
            break


if __name__ == "__main__":
    main()

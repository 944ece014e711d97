"""MetaSchedule tuning: persistent, resumable, safe with two processes, robust to a corrupt
database, used by builds only when it wins; remote measurement through a TVM RPC tracker.

Tiny kernels and 2-4 trials: these test the machinery, not the speed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_close, randn

from torch_tvm_gemm.compiler import build, tune, tune_db, tune_space
from torch_tvm_gemm.kernels.gemm import GemmSpec
from torch_tvm_gemm.runtime import build_worker, cache, records, tune_worker

pytestmark = pytest.mark.slow  # MetaSchedule searches: not in the fast lane

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    """A private cache dir (tuning records included) for one test."""
    monkeypatch.setenv("TVM_GEMM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def spec_of(n: int = 40, k: int = 24, **kw) -> GemmSpec:
    return GemmSpec("float32", n, k, "kn", **kw)


def run_cli(*args: str, cache_dir: Path) -> str:
    """``python -m torch_tvm_gemm ...`` in a new process; its stdout."""
    env = {**os.environ, "TVM_GEMM_CACHE_DIR": str(cache_dir)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "torch_tvm_gemm", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def record_lines(spec: GemmSpec) -> list[str]:
    path = records.tuning_dir(spec) / "database_tuning_record.json"
    return [line for line in path.read_text().splitlines() if line.strip()]


def test_tuning_persists_and_a_new_process_reuses_it(cache_home):
    first = run_cli(
        "tune", "--op", "matmul", "--shapes", "33x40x24", "--trials", "3", cache_dir=cache_home
    )
    assert "3 trials (3 new)" in first, first
    again = run_cli(
        "tune", "--op", "matmul", "--shapes", "33x40x24", "--trials", "3", cache_dir=cache_home
    )
    assert "3 trials (0 new)" in again, again  # nothing re-measured
    spec = GemmSpec("float32", 40, None, "kn")  # ops.matmul's kernel: symbolic K
    assert len(record_lines(spec)) == 3
    best = json.loads((records.tuning_dir(spec) / "best.json").read_text())
    assert best["m"] == 33 and best["k"] == 24 and best["trials"] == 3


def test_cli_tunes_in_a_worker_and_never_imports_the_compiler(cache_home):
    code = (
        "import sys\n"
        "from torch_tvm_gemm.__main__ import main\n"
        "rc = main(['tune', '--op', 'matmul', '--shapes', '33x40x24', '--trials', '2'])\n"
        "print('compiler imported:', 'tvm' in sys.modules)\n"
        "sys.exit(rc)\n"
    )
    env = {**os.environ, "TVM_GEMM_CACHE_DIR": str(cache_home)}
    env.pop(build_worker.ENV_IN_PROCESS, None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 trials (2 new)" in proc.stdout, proc.stdout
    assert "compiler imported: False" in proc.stdout, proc.stdout
    assert "tune " in proc.stderr  # the worker's progress bar reached the caller's stderr
    spec = GemmSpec("float32", 40, None, "kn")
    assert len(record_lines(spec)) == 2  # the records landed in the caller's database
    assert json.loads((records.tuning_dir(spec) / "best.json").read_text())["trials"] == 2


def test_tuning_in_process_when_asked(cache_home, monkeypatch):
    monkeypatch.setenv(build_worker.ENV_IN_PROCESS, "1")
    spec = spec_of(n=24, k=16)
    res = tune_worker.tune(spec, 20, trials=2, progress=False)
    assert isinstance(res, records.TuneResult) and res.new_trials == 2
    assert len(record_lines(spec)) == 2


def test_resume_adds_only_the_missing_trials(cache_home):
    spec = spec_of()
    assert tune.tune_spec(spec, 20, trials=2, progress=False).new_trials == 2
    res = tune.tune_spec(spec, 20, trials=4, progress=False)  # as after a Ctrl-C at 2 of 4
    assert (res.trials, res.new_trials) == (4, 2)
    assert len(record_lines(spec)) == 4


def test_kept_record_is_used_by_builds_and_changes_the_key(cache_home):
    spec = spec_of(bias=True, activation="relu")
    hand_path = cache.kernel_path(spec)
    tune.tune_spec(spec, 20, trials=2, progress=False)
    best_path = records.tuning_dir(spec) / "best.json"
    best = json.loads(best_path.read_text())
    best["kept"] = True  # whether it won on 2 shared cores is noise: force the verdict
    best_path.write_text(json.dumps(best))
    assert cache.kernel_path(spec) != hand_path  # a tuned build never collides
    assert "tuned" in cache.full_key(spec)
    mod = build.lower(spec)
    assert mod is not None and "M_PAD" not in str(type(mod))
    fn = cache.load_or_build(spec)
    a, b, bias = randn(27, 24), randn(24, 40), randn(40)
    out = torch.empty(27, 40)
    fn(a, b, bias, out)
    assert_close(out, torch.relu(a @ b + bias), 24)
    best["kept"] = False  # a lost verdict: back to the hand schedule and its key
    best_path.write_text(json.dumps(best))
    assert cache.kernel_path(spec) == hand_path
    assert tune_space.tuned_module(spec) is None


def test_corrupt_database_record_is_skipped_with_a_warning(cache_home):
    spec = spec_of()
    tune.tune_spec(spec, 20, trials=2, progress=False)
    path = records.tuning_dir(spec) / "database_tuning_record.json"
    good = record_lines(spec)
    with path.open("a") as f:
        f.write('[0, [["truncated", \n')  # a torn write
        f.write("not json at all\n")
    with pytest.warns(RuntimeWarning, match="skipped 2 corrupt tuning record"):
        res = tune.tune_spec(spec, 20, trials=2, progress=False)
    assert res.trials == 2 and res.new_trials == 0
    assert record_lines(spec) == good


def test_corrupt_verdict_falls_back_to_the_hand_schedule(cache_home):
    spec = spec_of()
    records.tuning_dir(spec).mkdir(parents=True)
    (records.tuning_dir(spec) / "best.json").write_text('{"trace": [[')
    with pytest.warns(RuntimeWarning, match="corrupt"):
        assert tune_space.tuned_module(spec) is None
    assert "tuned" not in cache.full_key(spec)


def test_two_processes_on_one_database(cache_home):
    args = ["tune", "--op", "matmul", "--shapes", "33x40x24", "--trials", "3"]
    env = {**os.environ, "TVM_GEMM_CACHE_DIR": str(cache_home)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "torch_tvm_gemm", *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    spec = GemmSpec("float32", 40, None, "kn")
    lines = record_lines(spec)
    assert len(lines) == 3  # one process tuned, the other waited and found it done
    assert all(json.loads(line) for line in lines)
    assert sum("(0 new)" in out for out in outputs) == 1, outputs


def test_rpc_tuning_on_loopback(cache_home):
    from tvm import rpc
    from tvm.ir import IRModule
    from tvm.rpc.tracker import Tracker

    tracker = Tracker("127.0.0.1", port=9190, port_end=9290, silent=True)
    server = rpc.Server(
        "127.0.0.1",
        port=9300,
        port_end=9400,
        tracker_addr=("127.0.0.1", tracker.port),
        key="tvm-gemm-test",
        silent=True,
    )
    try:
        spec = spec_of()
        res = tune.tune_spec(
            spec, 20, trials=2, rpc=("127.0.0.1", tracker.port, "tvm-gemm-test"), progress=False
        )
        assert res.new_trials == 2, res
        assert (records.tuning_dir(spec) / "best.json").exists()
        # Measured for real over RPC: a failed run is recorded with a 1e10 s sentinel.
        mod = IRModule({"main": tune_space.tuned_compute(spec, 20)})
        found = tune_db.records_of(tune_db.open_database(records.tuning_dir(spec)), mod)
        assert len(found) == 2 and all(tune_db.record_seconds(r) < 1.0 for r in found)
    finally:
        server.terminate()
        tracker.terminate()


def test_tune_every_linear_of_a_model(cache_home, tmp_path, monkeypatch, capsys):
    from torch_tvm_gemm.__main__ import main

    (tmp_path / "tiny_models.py").write_text(
        "import torch\n"
        "def make():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(),\n"
        "                               torch.nn.Linear(40, 8, bias=False))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    rc = main(["tune", "--model", "tiny_models:make", "--input-shape", "20,24", "--trials", "2"])
    assert rc == 0
    out = capsys.readouterr().out
    assert out.count("2 trials (2 new)") == 2, out
    for spec in (GemmSpec("float32", 40, 24, "nk", True), GemmSpec("float32", 8, 40, "nk")):
        assert (records.tuning_dir(spec) / "best.json").exists()


@pytest.mark.slow
def test_ctrl_c_stops_between_rounds_and_the_rerun_resumes(cache_home):
    import signal
    import time

    spec = GemmSpec("float32", 40, None, "kn")
    # Rounds take ~3 s here; a loaded machine may handle the signal a round or two late, so
    # the budget is far from what can be measured before it stops.
    args = ["tune", "--op", "matmul", "--shapes", "33x40x24", "--trials"]
    env = {**os.environ, "TVM_GEMM_CACHE_DIR": str(cache_home)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch_tvm_gemm", *args, "200"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # a background job may inherit SIGINT ignored: give the child the default
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    db = records.tuning_dir(spec) / "database_tuning_record.json"
    deadline = time.monotonic() + 120
    while not (db.exists() and db.read_text().strip()):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, out
    assert "interrupted" in out
    measured = len(record_lines(spec))
    assert 0 < measured < 200, out
    again = run_cli(*args, str(measured + 8), cache_dir=cache_home)
    assert f"{measured + 8} trials (8 new)" in again, again  # resumed, not restarted

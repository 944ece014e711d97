"""CUDA kernels without a GPU: cross-compiled with nvcc for sm_80 and sm_90 (and sm_75 /
sm_70 for the WMMA schedule), SASS checked.

Skipped only when nvcc is missing (SASS checks also need cuobjdump: the pip packages
nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm; sm_70 needs a CUDA 12 nvcc: CUDA 13 dropped
Volta). Two small packs are built per session, through the ``compile`` CLI; each test then
inspects the libraries they wrote.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from torch_tvm_gemm.compiler import cuda_pack, pack_writer
from torch_tvm_gemm.compiler.cuda_pack import NvccNotFoundError
from torch_tvm_gemm.runtime import pack_loader

pytestmark = pytest.mark.slow  # CUDA cross-compiles with nvcc: not in the fast lane

ARCHES = ("sm_80", "sm_90")
# Per-block shared memory a kernel may use (opt-in maximum), per arch.
SMEM_LIMIT = {"sm_70": 96 * 1024, "sm_75": 64 * 1024, "sm_80": 163 * 1024, "sm_90": 227 * 1024}
# Spec strings of the ``compile`` CLI: tensor-core kernels in both dtypes and layouts, with
# each epilogue, an odd K (narrow loads, K padded) and SIMT fp32 kernels.
OPS = [
    "matmul:float16:256:128",
    "matmul:bfloat16:96:72",
    "linear:bfloat16:256:256:bias+relu",
    "linear:float16:200:136:bias+gelu",
    "linear:float16:64:33:bias",
    "matmul:float32:96:72",
    "linear:float32:64:40:bias+gelu",
    "matmul:tf32:96:72",  # fp32 tensors on tensor cores (allow_tf32)
    "linear:tf32:200:136:bias+relu",
]
# Turing and Ampere in one pack: fp16 gets WMMA on sm_75 and mma.sync on sm_80 (one library
# each), bf16 SIMT on sm_75 (no bf16 tensor cores there).
OLD_ARCHES = ("sm_75", "sm_80")
OLD_OPS = [
    "matmul:float16:96:72",
    "linear:float16:200:136:bias+gelu",
    "linear:bfloat16:64:40:bias+relu",
]
# The SASS of each tensor-core schedule (nvdisasm's names: m16n8k16 -> 16816, m16n8k8 ->
# 1688; WMMA's 16x16x16 becomes HMMA.1688 on Turing, HMMA.884 steps on Volta).
HMMA = {
    "mma": r"HMMA\.16816\.F32",
    "tf32": r"HMMA\.1688\.F32\.TF32",
    ("wmma", "sm_75"): r"HMMA\.1688\.F32",
    ("wmma", "sm_70"): r"HMMA\.884\.F32\.F32",
}


def _nvcc_has(arch: str) -> bool:
    return cuda_pack.nvcc_available() and arch in cuda_pack.nvcc_arches(cuda_pack.find_nvcc())


needs_nvcc = pytest.mark.skipif(not cuda_pack.nvcc_available(), reason="nvcc not found")
needs_cuobjdump = pytest.mark.skipif(
    cuda_pack.find_cuobjdump() is None, reason="cuobjdump not found (nvidia-cuda-cuobjdump)"
)


@pytest.fixture(scope="session")
def pack(tmp_path_factory) -> Path:
    from torch_tvm_gemm.__main__ import main

    out = tmp_path_factory.mktemp("cuda_pack")
    argv = ["compile", "--target", "cuda", "--arch", ",".join(ARCHES), "--out", str(out)]
    assert main([*argv, "--ops", *OPS]) == 0
    return out


@pytest.fixture(scope="session")
def old_pack(tmp_path_factory) -> Path:
    from torch_tvm_gemm.__main__ import main

    out = tmp_path_factory.mktemp("cuda_pack_sm75")
    argv = ["compile", "--target", "cuda", "--arch", ",".join(OLD_ARCHES), "--out", str(out)]
    assert main([*argv, "--ops", *OLD_OPS]) == 0
    return out


def _kernel_count(ops: list[str]) -> int:
    """Both M variants of each op, but one kernel for a B too small for the gemv variant
    (fewer than 4096 elements: the op never picks it)."""
    return sum(1 if int(op.split(":")[2]) * int(op.split(":")[3]) < 4096 else 2 for op in ops)


@pytest.fixture(scope="session")
def kernels(pack) -> list[dict]:
    return _entries(pack)


@pytest.fixture(scope="session")
def old_kernels(old_pack) -> list[dict]:
    return _entries(old_pack)


def _entries(pack: Path) -> list[dict]:
    """Manifest entries, each with its spec and the SASS / resource usage per arch."""
    manifest = json.loads((pack / "manifest.json").read_text())
    entries = []
    for entry in manifest["kernels"]:
        fatbin = cuda_pack.fatbin_from_library(pack / entry["file"])
        entry = dict(entry, spec=pack_loader.spec_from_key(entry["key"]), fatbin=fatbin)
        if cuda_pack.find_cuobjdump():
            entry["sass"] = cuda_pack.sass_by_arch(fatbin)
            entry["usage"] = _resource_usage(fatbin)
        entries.append(entry)
    return entries


def _resource_usage(fatbin: bytes) -> dict[str, dict[str, int]]:
    """{arch: {"REG": .., "STACK": .., "SHARED": .., "LOCAL": ..}} from cuobjdump."""
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".fatbin") as f:
        f.write(fatbin)
        f.flush()
        text = subprocess.run(
            [cuda_pack.find_cuobjdump(), "--dump-resource-usage", f.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    usage, arch = {}, None
    for line in text.splitlines():
        if m := re.search(r"arch = (sm_\d+)", line):
            arch = m.group(1)
        elif "REG:" in line and arch:
            usage[arch] = {k: int(v) for k, v in re.findall(r"(\w+(?:\[\d\])?):(\d+)", line)}
    return usage


def _check_sass(entry) -> None:
    """Tensor-core instructions of the entry's schedule (FFMA only for SIMT), no spills."""
    from torch_tvm_gemm.schedules.cuda import schedule_kind

    spec, sass = entry["spec"], entry["sass"]
    assert sorted(sass) == entry["arches"], entry["name"]
    for arch, text in sass.items():
        where = f"{entry['name']} {arch}"
        kind = schedule_kind(spec, arch)
        assert kind == entry.get("schedule", kind), where
        if kind == "simt":
            assert "HMMA" not in text and "FFMA" in text, where
        else:
            assert re.search(HMMA.get(kind) or HMMA[kind, arch], text), where
            aligned = spec.k % 8 == 0 and spec.n % 8 == 0
            if kind == "mma":
                assert "LDSM" in text, where  # ldmatrix
            # cp.async (LDGSTS) on sm_80+ only: WMMA's copies are plain loads and stores.
            assert ("LDGSTS" in text) == (kind != "wmma" and aligned), where
        # No local memory at all (so none in the main loop): no spills, no stack arrays.
        assert not re.search(r"\b(LDL|STL)\b", text), where


# --- no nvcc needed ---------------------------------------------------------------------------


def test_replace_device_source_rewrites_only_the_payload():
    def s(text):
        return struct.pack("<Q", len(text)) + text

    source = b"__global__ void k() {}"
    table = b"\x01" + b"\x00" * 7 + b"TABLE"
    payload = s(b"cuda") + table + s(source)
    body = b"TREE" + s(b"cuda") + struct.pack("<Q", len(payload)) + payload
    blob = struct.pack("<Q", len(body)) + body
    new = cuda_pack.replace_device_source(blob, source.decode(), b"BINARY")
    new_payload = s(b"fatbin") + table + s(b"BINARY")
    expected_body = b"TREE" + s(b"cuda") + struct.pack("<Q", len(new_payload)) + new_payload
    assert new == struct.pack("<Q", len(expected_body)) + expected_body
    with pytest.raises(RuntimeError, match="unexpected TVM module blob"):
        cuda_pack.replace_device_source(blob, "other source", b"BINARY")


def test_normalize_arches():
    assert cuda_pack.normalize_arches("90, sm_80,sm_80") == ["sm_80", "sm_90"]
    assert cuda_pack.normalize_arches(["sm_90a"]) == ["sm_90a"]
    with pytest.raises(ValueError, match="bad CUDA arch"):
        cuda_pack.normalize_arches("hopper")


def test_compile_cli_rejects_bad_ops():
    from torch_tvm_gemm.cli.compile import parse_op

    assert [s.variant for s in parse_op("linear:float16:64:64:bias+relu", ["gemm", "gemv"])] == [
        "gemm",
        "gemv",
    ]
    # the kernels the op picks (ops.gemm_spec): no gemv for a B of under 4096 elements
    assert [s.variant for s in parse_op("linear:float16:64:32:bias+relu", ["gemm", "gemv"])] == [
        "gemm"
    ]
    with pytest.raises(SystemExit, match="unknown variant 'dot'"):
        parse_op("linear:float16:64:64", ["dot"])
    for bad in (
        "conv:float16:1:1",
        "matmul:int8:4:4",
        "matmul:float16:4:4:relu",
        "linear:float16:4",
    ):
        with pytest.raises(SystemExit):
            parse_op(bad, ["gemm"])


def test_compile_cli_rejects_old_arches(tmp_path):
    from torch_tvm_gemm.__main__ import main

    with pytest.raises(SystemExit, match="sm_60 not supported"):
        main(["compile", "--arch", "sm_60", "--ops", "matmul:float16:8:8", "--out", str(tmp_path)])


def test_pack_presets_cover_backward_kernels():
    from torch_tvm_gemm.tools.cuda_cases import GRAD_CASES, record_specs

    specs = record_specs(GRAD_CASES[:1], backward=True)  # bf16 matmul: forward, dA, dB
    assert {s.device for s in specs} == {"cuda"}
    assert all(s.k is not None for s in specs)  # CUDA kernels are specialised on K
    assert len(specs) == 3


def test_missing_nvcc_message(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv("CUDA_HOME", "/nonexistent")
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(cuda_pack, "DEFAULT_CUDA_ROOTS", ())
    with pytest.raises(NvccNotFoundError, match="pip install nvidia-cuda-nvcc"):
        cuda_pack.find_nvcc()


def test_runtime_lib_dir_from_env(monkeypatch, tmp_path):
    from torch_tvm_gemm.runtime import loader

    monkeypatch.setenv(loader.ENV_RUNTIME_LIB_DIR, str(tmp_path))
    assert loader.tvm_lib_dir() == tmp_path


# --- nvcc: every kernel compiles for both arches ----------------------------------------------


@needs_nvcc
def test_every_kernel_built_for_both_arches(kernels):
    assert len(kernels) == _kernel_count(OPS)
    assert _kernel_count(["linear:float16:64:33:bias"]) == 1
    for entry in kernels:
        assert entry["arches"] == list(ARCHES)
        assert entry["fatbin"][:4] == struct.pack("<I", 0xBA55ED50)


@needs_nvcc
@needs_cuobjdump
def test_sass_per_arch_tensor_cores_and_no_spills(kernels):
    for entry in kernels:
        assert entry["arches"] == list(ARCHES)
        _check_sass(entry)
    assert {e["schedule"] for e in kernels} == {"mma", "tf32", "simt"}


@needs_nvcc
def test_one_library_per_schedule_in_a_mixed_pack(old_kernels):
    """sm_75 and sm_80 in one pack: each spec has one library per schedule, never a source
    generated for one arch compiled for the other."""
    by_spec: dict = {}
    for entry in old_kernels:
        by_spec.setdefault(entry["spec"], {})[entry["schedule"]] = entry["arches"]
    assert len(by_spec) == _kernel_count(OLD_OPS)
    for spec, groups in by_spec.items():
        old = "wmma" if spec.dtype == "float16" else "simt"
        assert groups == {old: ["sm_75"], "mma": ["sm_80"]}, spec


@needs_nvcc
@needs_cuobjdump
def test_wmma_sass_on_turing(old_kernels):
    for entry in old_kernels:
        _check_sass(entry)
        if entry["schedule"] == "wmma":  # m16n8k16 (sm_80's mma.sync) must not be there
            assert "HMMA.16816" not in entry["sass"]["sm_75"], entry["name"]


@needs_nvcc
@needs_cuobjdump
@pytest.mark.skipif(not _nvcc_has("sm_70"), reason="this nvcc has no sm_70 (CUDA 13 dropped it)")
def test_wmma_sass_on_volta(tmp_path):
    from torch_tvm_gemm.cli.compile import parse_op

    for spec in parse_op("linear:float16:200:136:bias+gelu", ["gemm", "gemv"]):
        (entry,) = pack_writer.build_kernels(spec, ["sm_70"], tmp_path)
        assert entry["schedule"] == "wmma"
        fatbin = cuda_pack.fatbin_from_library(tmp_path / entry["file"])
        _check_sass(dict(entry, spec=spec, sass=cuda_pack.sass_by_arch(fatbin)))


@needs_nvcc
@needs_cuobjdump
def test_forced_wmma_builds_for_hopper_with_its_own_key(monkeypatch, tmp_path):
    """TVM_GEMM_CUDA_FORCE_WMMA=1 (to check the Volta/Turing schedule on an H200): fp16 gets
    WMMA on sm_90 too, bf16 keeps mma.sync, and the kernels never share a cache key."""
    from torch_tvm_gemm.cli.compile import parse_op
    from torch_tvm_gemm.runtime import cache
    from torch_tvm_gemm.schedules.cuda import ENV_FORCE_WMMA

    (spec,) = parse_op("matmul:float16:256:128", ["gemm"])
    monkeypatch.setattr(cache, "device_key", lambda device: "cuda-sm_90")  # no GPU here
    normal_key = cache.full_key(spec)
    monkeypatch.setenv(ENV_FORCE_WMMA, "1")
    assert cache.full_key(spec) != normal_key
    (entry,) = pack_writer.build_kernels(spec, ["sm_90"], tmp_path)
    assert entry["schedule"] == "wmma"
    fatbin = cuda_pack.fatbin_from_library(tmp_path / entry["file"])
    sass = cuda_pack.sass_by_arch(fatbin)["sm_90"]
    assert "HMMA" in sass and "LDGSTS" not in sass  # WMMA's plain copies, not cp.async
    (bf16,) = parse_op("matmul:bfloat16:256:128", ["gemm"])
    assert pack_writer.schedule_groups(bf16, ["sm_90"]) == {"mma": ["sm_90"]}


def test_sm70_with_cuda13_nvcc_is_a_clear_error(monkeypatch, tmp_path):
    from torch_tvm_gemm.__main__ import main

    monkeypatch.setattr(cuda_pack, "find_nvcc", lambda: "/opt/cuda-13/bin/nvcc")
    known = frozenset({"sm_75", "sm_80", "sm_90"})  # what CUDA 13's nvcc lists (in part)
    monkeypatch.setattr(cuda_pack, "nvcc_arches", lambda nvcc: known)
    argv = ["compile", "--arch", "sm_70,sm_80", "--ops", "matmul:float16:8:8"]
    with pytest.raises(SystemExit, match="cannot compile for sm_70.*CUDA 12 nvcc"):
        main([*argv, "--out", str(tmp_path)])
    cuda_pack.check_nvcc_arches(["sm_80", "sm_90a"])  # arch-specific variants are known


def test_schedule_by_arch_and_dtype():
    from torch_tvm_gemm.kernels.gemm import GemmSpec
    from torch_tvm_gemm.schedules.cuda import pass_config, schedule_kind

    def kind(dtype, arch, tf32=False):
        spec = GemmSpec(dtype, 64, 64, "nk", device="cuda", tf32=tf32)
        return schedule_kind(spec, arch)

    assert [kind("float16", a) for a in ("sm_70", "sm_75", "sm_80", "sm_90")] == [
        "wmma",
        "wmma",
        "mma",
        "mma",
    ]
    assert [kind("bfloat16", a) for a in ("sm_70", "sm_75", "sm_80")] == ["simt", "simt", "mma"]
    assert [kind("float32", a) for a in ("sm_75", "sm_90")] == ["simt", "simt"]
    assert [kind("float32", a, tf32=True) for a in ("sm_75", "sm_80", "sm_90")] == [
        "simt",
        "tf32",
        "tf32",
    ]
    spec = GemmSpec("float16", 64, 64, "nk", device="cuda")
    assert not pass_config(spec, "sm_75")["tirx.use_async_copy"]  # no cp.async before sm_80
    assert pass_config(spec, "sm_80")["tirx.use_async_copy"]


def test_wgmma_on_sm90a_for_linear_shapes(monkeypatch):
    """Hopper's own arch (sm_90a) runs linear-shaped fp16/bf16 products on TMA + wgmma;
    everything else, plain sm_90 and TVM_GEMM_CUDA_WGMMA=0 keep mma.sync."""
    from torch_tvm_gemm.kernels.gemm import GemmSpec
    from torch_tvm_gemm.schedules.cuda import ENV_WGMMA, schedule_kind, tir_pipeline

    def kind(arch="sm_90a", dtype="bfloat16", n=256, k=192, **kw):
        return schedule_kind(
            GemmSpec(dtype, n, k, kw.pop("layout", "nk"), device="cuda", **kw), arch
        )

    assert kind() == kind(dtype="float16") == kind(bias=True, activation="relu") == "wgmma"
    assert kind("sm_90") == kind("sm_80") == "mma"
    assert kind(layout="kn") == kind(n=200) == kind(k=136) == kind(variant="gemv") == "mma"
    assert kind(activation="gelu") == kind(bias=True, bias_axis="m") == "mma"
    assert kind(dtype="float32") == "simt" and kind(dtype="float32", tf32=True) == "tf32"
    spec = GemmSpec("float16", 256, 192, "nk", device="cuda")
    assert tir_pipeline(spec, "sm_90a") == "tirx" and tir_pipeline(spec, "sm_90") is None
    monkeypatch.setenv(ENV_WGMMA, "0")
    assert kind() == "mma"


def test_cache_key_names_the_schedule(monkeypatch):
    from torch_tvm_gemm.kernels.gemm import GemmSpec
    from torch_tvm_gemm.runtime import cache
    from torch_tvm_gemm.schedules.cuda import ENV_WGMMA

    spec = GemmSpec("bfloat16", 256, 192, "nk", device="cuda")
    monkeypatch.setattr(cache, "device_key", lambda device: "cuda-sm_90a")  # no GPU here
    assert cache.full_key(spec)["schedule"] == "wgmma"
    monkeypatch.setenv(ENV_WGMMA, "0")
    assert cache.full_key(spec)["schedule"] == "mma"


def test_pack_lookup_prefers_the_schedule_of_this_gpu(monkeypatch, tmp_path):
    """A pack built for sm_90 and sm_90a holds a linear's mma.sync and wgmma kernels: an
    sm_90a GPU loads the wgmma one (the mma one with TVM_GEMM_CUDA_WGMMA=0), and a pack
    with sm_90 code only still serves it."""
    from torch_tvm_gemm.kernels.gemm import GemmSpec
    from torch_tvm_gemm.schedules.cuda import ENV_WGMMA

    spec = GemmSpec("float16", 256, 192, "nk", device="cuda")
    entries = []
    for kind, arches in (("mma", ["sm_90"]), ("wgmma", ["sm_90a"])):
        (tmp_path / f"{kind}.so").write_bytes(kind.encode())
        digest = hashlib.sha256(kind.encode()).hexdigest()
        entry = {"key": spec.key(), "name": spec.name(), "file": f"{kind}.so", "sha256": digest}
        entries.append({**entry, "arches": arches, "schedule": kind})
    manifest = {"format": 2, "arches": ["sm_90", "sm_90a"], "kernels": entries}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setattr(pack_loader, "_packs", {})
    monkeypatch.setattr(pack_loader, "_env_loaded", True)
    monkeypatch.setattr(pack_loader, "load_kernel_file", lambda path, name, device: path.name)
    pack_loader.load_pack(tmp_path)
    assert pack_loader.lookup(spec, "sm_90a") == "wgmma.so"
    assert pack_loader.lookup(spec, "sm_90") == "mma.so"
    monkeypatch.setenv(ENV_WGMMA, "0")
    assert pack_loader.lookup(spec, "sm_90a") == "mma.so"
    with pytest.raises(RuntimeError, match="not for this GPU"):
        pack_loader.lookup(spec, "sm_80")


def test_tf32_is_its_own_kernel(monkeypatch):
    """The TF32 and exact fp32 kernels never share a cache entry; keys of kernels without
    TF32 are what they were before the field existed."""
    from torch_tvm_gemm.kernels.gemm import GemmSpec
    from torch_tvm_gemm.runtime import cache

    exact = GemmSpec("float32", 64, 32, "nk", device="cuda")
    tf32 = GemmSpec("float32", 64, 32, "nk", device="cuda", tf32=True)
    assert "tf32" not in exact.key() and tf32.key()["tf32"] is True
    assert exact.name() != tf32.name()
    assert pack_loader.spec_from_key(tf32.key()) == tf32
    assert pack_loader.spec_from_key(exact.key()) == exact
    monkeypatch.setattr(cache, "device_key", lambda device: "cuda-sm_80")  # no GPU here
    assert cache.kernel_path(exact) != cache.kernel_path(tf32)
    for bad in (("float16", "cuda"), ("float32", "cpu")):
        with pytest.raises(ValueError, match="TF32"):
            GemmSpec(bad[0], 64, 32, "nk", device=bad[1], tf32=True)


def test_allow_tf32_flag_picks_the_kernel():
    """gemm_ops.gemm reads torch.backends.cuda.matmul.allow_tf32 at every call (here through the
    recorder that pretends to be on an sm_80+ GPU)."""
    from torch_tvm_gemm.tools.cuda_cases import TF32_CASES, record_specs

    exact = record_specs(TF32_CASES[:2])
    fast = record_specs(TF32_CASES[:2], tf32=True)
    assert not any(s.tf32 for s in exact) and all(s.tf32 for s in fast)
    assert [s.dtype for s in fast] == ["float32"] * len(fast)


def test_tf32_allowed_follows_torch():
    import torch

    from torch_tvm_gemm.ops import tf32_allowed

    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_tf32
    try:
        matmul.allow_tf32 = True
        assert tf32_allowed()
        matmul.allow_tf32 = False
        assert not tf32_allowed()
    finally:
        matmul.allow_tf32 = saved


@needs_nvcc
@needs_cuobjdump
def test_registers_and_shared_memory_fit_the_launch(kernels, old_kernels):
    from torch_tvm_gemm.schedules.cuda import launch_config

    for entry in kernels + old_kernels:
        for arch, usage in entry["usage"].items():
            launch = launch_config(entry["spec"], arch)
            where = f"{entry['name']} {arch}: {usage} {launch}"
            assert usage["REG"] <= 255 and usage["REG"] * launch["threads"] <= 65536, where
            assert usage["STACK"] == 0 and usage["LOCAL"] == 0, where
            assert usage["SHARED"] + launch["smem_bytes"] <= SMEM_LIMIT[arch], where
            assert launch["schedule"] == entry["schedule"], where


@needs_nvcc
def test_ptxas_verbose_on_generated_source():
    """``ptxas -v`` on TVM's source: registers within __launch_bounds__, no spills."""
    from torch_tvm_gemm.cli.compile import parse_op
    from torch_tvm_gemm.compiler import build
    from torch_tvm_gemm.schedules.cuda import launch_config

    (spec,) = parse_op("linear:bfloat16:128:64:bias+relu", ["gemm"])
    executable, _ = build.compile_spec(spec, arch="sm_80", arches=ARCHES)
    bounds = int(re.search(r"__launch_bounds__\((\d+)\)", executable.source).group(1))
    assert bounds == launch_config(spec, "sm_80")["threads"]
    for arch in ARCHES:
        info = cuda_pack.ptxas_info(executable.source, arch)
        assert info["spill_stores"] == info["spill_loads"] == info["stack"] == 0, info
        assert 0 < info["registers"] <= 65536 // bounds, info


@needs_nvcc
def test_pack_loads_with_the_cuda_runtime_only(pack, tmp_path):
    """The CUDA runtime (libtvm_runtime_cuda.so) parses our fatbin payload: loaded in a fresh
    process without ``tvm`` on the path, against a stub libcuda (no GPU here: not run)."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc needed for the stub libcuda")
    from torch_tvm_gemm.runtime.loader import tvm_lib_dir

    stub = tmp_path / "libcuda.so.1"
    src = tmp_path / "stub.c"
    src.write_text("void tvm_gemm_stub(void) {}\n")
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", stub, src], check=True
    )
    library = next((pack / "kernels").glob("*.so"))
    script = textwrap.dedent(
        f"""
        import ctypes, os, sys
        sys.modules["tvm"] = None  # the compiler must not be needed
        import tvm_ffi
        lib = {str(tvm_lib_dir())!r}
        ctypes.CDLL(os.path.join(lib, "libtvm_runtime.so"), mode=ctypes.RTLD_GLOBAL)
        ctypes.CDLL(os.path.join(lib, "libtvm_runtime_cuda.so"),
                    mode=os.RTLD_LAZY | os.RTLD_GLOBAL)
        module = tvm_ffi.load_module({str(library)!r})
        assert [m.kind for m in module.imports] == ["cuda"], module.imports
        module["main"]
        print("LOADED")
        """
    )
    env = dict(os.environ, LD_LIBRARY_PATH=f"{tmp_path}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert "LOADED" in proc.stdout, proc.stderr[-2000:]


# --- conv2d + bias + relu: the implicit GEMM ---------------------------------------------------

# A 3x3 pad-1 layer (K <= 64: the narrow block), a 1x1, a strided one with K > 128 (padded
# column blocks), a 7x7 stem with C = 3 (no vector loads), and fp32 / fp64 SIMT kernels.
CONV_OPS = [
    "conv2d:float16:64:64:3x3:14x14:p1",
    "conv2d:bfloat16:64:64:3x3:14x14:p1",
    "conv2d:bfloat16:256:128:1x1:28x28",
    "conv2d:float16:32:136:3x3:15x13:s2:p1",
    "conv2d:bfloat16:3:24:7x7:23x21:s2:p3:norelu",
    "conv2d:float32:16:40:3x3:9x9:p1",
    "conv2d:float64:12:20:3x3:10x9:s1x2:p0x1:d2:nobias",
]


@pytest.fixture(scope="session")
def conv_kernels(tmp_path_factory) -> list[dict]:
    """The conv kernels, built once through the ``compile`` CLI, with SASS and usage."""
    from torch_tvm_gemm.__main__ import main

    out = tmp_path_factory.mktemp("cuda_conv_pack")
    argv = ["compile", "--target", "cuda", "--arch", ",".join(ARCHES), "--out", str(out)]
    assert main([*argv, "--ops", *CONV_OPS]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    entries = []
    for entry in manifest["kernels"]:
        fatbin = cuda_pack.fatbin_from_library(out / entry["file"])
        entry = dict(entry, spec=pack_loader.spec_from_key(entry["key"]), fatbin=fatbin)
        if cuda_pack.find_cuobjdump():
            entry["sass"] = cuda_pack.sass_by_arch(fatbin)
            entry["usage"] = _resource_usage(fatbin)
        entries.append(entry)
    return entries


def test_compile_cli_parses_conv_ops():
    from torch_tvm_gemm.cli.compile import parse_conv_op

    spec = parse_conv_op("conv2d:bfloat16:3:24:7x5:23x21:s2:p3x2:norelu")
    assert (spec.c, spec.k, spec.r, spec.s, spec.h, spec.w) == (3, 24, 7, 5, 23, 21)
    assert (spec.stride, spec.padding, spec.dilation) == ((2, 2), (3, 2), (1, 1))
    assert spec.bias and not spec.relu and spec.device == "cuda"
    for bad in (
        "conv2d:float16:4:4:3x3",
        "conv2d:int8:4:4:1x1:8x8",
        "conv2d:float16:4:4:3x3:8x8:q1",
    ):
        with pytest.raises(SystemExit, match="bad conv"):
            parse_conv_op(bad)


def test_conv_pack_presets_and_keys_round_trip():
    from torch_tvm_gemm.tools.cuda_cases import CONV_TEST_CASES, pack_specs

    specs = [s for s in pack_specs("test") if s.family == "conv2d"]
    assert {s.device for s in specs} == {"cuda"} and all(s.groups == 1 for s in specs)
    assert {case.spec() for case in CONV_TEST_CASES} <= set(specs)
    for spec in specs:  # what a pack manifest stores gives the same spec back
        assert pack_loader.spec_from_key(json.loads(json.dumps(spec.key()))) == spec


@needs_nvcc
def test_conv_kernels_built_for_both_arches(conv_kernels):
    assert len(conv_kernels) == len(CONV_OPS)
    for entry in conv_kernels:
        assert entry["spec"].family == "conv2d" and entry["arches"] == list(ARCHES)


@needs_nvcc
@needs_cuobjdump
def test_conv_sass_tensor_cores_and_no_spills(conv_kernels):
    from torch_tvm_gemm.schedules.cuda_conv2d import uses_tensor_cores

    for entry in conv_kernels:
        spec = entry["spec"]
        for arch, text in entry["sass"].items():
            where = f"{entry['name']} {arch}"
            if uses_tensor_cores(spec, arch):
                assert re.search(r"HMMA\.16816\.F32", text), where
                assert "LDSM" in text, where
                if spec.c % 8 == 0 and spec.k % 8 == 0:  # 16-byte gathers: cp.async
                    assert "LDGSTS" in text, where
            else:
                fma = "DFMA" if spec.dtype == "float64" else "FFMA"
                assert "HMMA" not in text and fma in text, where
            assert not re.search(r"\b(LDL|STL)\b", text), where


@needs_nvcc
@needs_cuobjdump
def test_conv_registers_and_shared_memory_fit_the_launch(conv_kernels):
    from torch_tvm_gemm.schedules.cuda_conv2d import launch_config

    for entry in conv_kernels:
        for arch, usage in entry["usage"].items():
            launch = launch_config(entry["spec"], arch)
            where = f"{entry['name']} {arch}: {usage} {launch}"
            assert usage["REG"] <= 255 and usage["REG"] * launch["threads"] <= 65536, where
            assert usage["STACK"] == 0 and usage["LOCAL"] == 0, where
            assert usage["SHARED"] + launch["smem_bytes"] <= SMEM_LIMIT[arch], where


@needs_nvcc
def test_conv_ptxas_verbose_on_generated_source():
    """``ptxas -v`` on a conv kernel's source: registers within __launch_bounds__, no spills,
    shared memory all dynamic (the launch configuration's)."""
    from torch_tvm_gemm.cli.compile import parse_conv_op
    from torch_tvm_gemm.compiler import build
    from torch_tvm_gemm.schedules.cuda_conv2d import launch_config

    spec = parse_conv_op("conv2d:float16:32:136:3x3:15x13:s2:p1")
    executable, _ = build.compile_spec(spec, arch="sm_80", arches=ARCHES)
    bounds = int(re.search(r"__launch_bounds__\((\d+)\)", executable.source).group(1))
    assert bounds == launch_config(spec, "sm_80")["threads"]
    for arch in ARCHES:
        info = cuda_pack.ptxas_info(executable.source, arch)
        assert info["spill_stores"] == info["spill_loads"] == info["stack"] == 0, info
        assert 0 < info["registers"] <= 65536 // bounds and info["smem"] == 0, info


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_conv_cuda_impl_host_logic_on_cpu(monkeypatch, channels_last):
    """The CUDA impl's layouts (NHWC input, (K, R*S*C) weight, NHWC output given back as NCHW)
    and its spec, run on the CPU: the kernel is the same implicit-GEMM math (unscheduled),
    compiled for LLVM. The GPU tests check the scheduled kernels themselves."""
    import contextlib

    import torch
    import torch.nn.functional as F
    import tvm

    from torch_tvm_gemm.kernels.conv2d_cuda import conv2d_gemm_compute
    from torch_tvm_gemm.ops import conv_ops

    def cpu_kernel(spec):
        assert spec.device == "cuda" and spec.groups == 1
        func = conv2d_gemm_compute(spec, 32, 16, 16, granule=1)  # padded, as on the GPU
        return tvm.compile(tvm.IRModule({"main": func}), target={"kind": "llvm"})["main"]

    monkeypatch.setattr(conv_ops, "get_kernel", cpu_kernel)
    monkeypatch.setattr(conv_ops, "check_cuda_arch", lambda x: None)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    x, w, b = torch.randn(3, 6, 11, 9), torch.randn(10, 6, 3, 3), torch.randn(10)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    for bias, stride, padding in ((b, 1, 1), (None, (2, 1), (0, 2))):
        y = conv_ops._conv2d_cuda_impl(x, w, bias, stride, padding, 1, 1, True)
        expected = F.relu(F.conv2d(x, w, bias, stride, padding))
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
        assert y.is_contiguous(memory_format=torch.channels_last) == channels_last
    with pytest.raises(NotImplementedError, match="argument 'groups' must be 1 on CUDA"):
        conv_ops._conv2d_cuda_impl(x, torch.randn(10, 3, 3, 3), None, 1, 1, 1, 2, True)
    empty = conv_ops._conv2d_cuda_impl(x[:0], w, b, 1, 1, 1, 1, True)
    assert empty.shape == (0, 10, 11, 9)

"""CUDA kernels without a GPU: cross-compiled with nvcc for sm_80 and sm_90, SASS checked.

Skipped only when nvcc is missing (SASS checks also need cuobjdump: the pip packages
nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm). One small pack is built per session, through
the ``compile`` CLI; each test then inspects the libraries it wrote.
"""

from __future__ import annotations

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

from torch_tvm_gemm import cuda_pack
from torch_tvm_gemm.cuda_pack import NvccNotFoundError

ARCHES = ("sm_80", "sm_90")
# Per-block shared memory a kernel may use (opt-in maximum), per arch.
SMEM_LIMIT = {"sm_80": 163 * 1024, "sm_90": 227 * 1024}
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
]


def _have_nvcc() -> bool:
    try:
        cuda_pack.find_nvcc()
    except NvccNotFoundError:
        return False
    return True


needs_nvcc = pytest.mark.skipif(not _have_nvcc(), reason="nvcc not found")
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
def kernels(pack) -> list[dict]:
    """Manifest entries, each with its spec and the SASS / resource usage per arch."""
    manifest = json.loads((pack / "manifest.json").read_text())
    entries = []
    for entry in manifest["kernels"]:
        fatbin = cuda_pack.fatbin_from_library(pack / entry["file"])
        entry = dict(entry, spec=cuda_pack.spec_from_key(entry["key"]), fatbin=fatbin)
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


def _uses_mma(spec) -> bool:
    return spec.dtype in ("float16", "bfloat16")


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

    assert [s.variant for s in parse_op("linear:float16:64:32:bias+relu", ["gemm", "gemv"])] == [
        "gemm",
        "gemv",
    ]
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
    from torch_tvm_gemm.cuda_cases import GRAD_CASES, record_specs

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
    from torch_tvm_gemm import runtime

    monkeypatch.setenv(runtime.ENV_RUNTIME_LIB_DIR, str(tmp_path))
    assert runtime.tvm_lib_dir() == tmp_path


# --- nvcc: every kernel compiles for both arches ----------------------------------------------


@needs_nvcc
def test_every_kernel_built_for_both_arches(kernels):
    assert len(kernels) == 2 * len(OPS)  # both M variants of each op
    for entry in kernels:
        assert entry["arches"] == list(ARCHES)
        assert entry["fatbin"][:4] == struct.pack("<I", 0xBA55ED50)


@needs_nvcc
@needs_cuobjdump
def test_sass_per_arch_tensor_cores_and_no_spills(kernels):
    for entry in kernels:
        spec, sass = entry["spec"], entry["sass"]
        assert sorted(sass) == list(ARCHES), entry["name"]
        for arch, text in sass.items():
            where = f"{entry['name']} {arch}"
            if _uses_mma(spec):
                assert re.search(r"HMMA\.16816\.F32", text), where
                assert "LDSM" in text, where  # ldmatrix
                if spec.k % 8 == 0 and spec.n % 8 == 0:
                    assert "LDGSTS" in text, where  # cp.async
            else:
                assert "HMMA" not in text and "FFMA" in text, where
            # No local memory at all (so none in the main loop): no spills, no stack arrays.
            assert not re.search(r"\b(LDL|STL)\b", text), where


@needs_nvcc
@needs_cuobjdump
def test_registers_and_shared_memory_fit_the_launch(kernels):
    from torch_tvm_gemm.schedules.cuda import launch_config

    for entry in kernels:
        for arch, usage in entry["usage"].items():
            launch = launch_config(entry["spec"], arch)
            where = f"{entry['name']} {arch}: {usage} {launch}"
            assert usage["REG"] <= 255 and usage["REG"] * launch["threads"] <= 65536, where
            assert usage["STACK"] == 0 and usage["LOCAL"] == 0, where
            assert usage["SHARED"] + launch["smem_bytes"] <= SMEM_LIMIT[arch], where


@needs_nvcc
def test_ptxas_verbose_on_generated_source():
    """``ptxas -v`` on TVM's source: registers within __launch_bounds__, no spills."""
    from torch_tvm_gemm import build
    from torch_tvm_gemm.cli.compile import parse_op
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
    from torch_tvm_gemm.runtime import tvm_lib_dir

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

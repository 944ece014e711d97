"""CUDA kernels built without a GPU: nvcc to SASS per arch, exported with the SASS inside.

TVM 0.27 does not compile CUDA at build time: ``tvm.compile`` returns a module holding the
generated CUDA C++ (format "cuda"), and the CUDA runtime compiles it when the library is
loaded, through the Python callback ``tvm_callback_cuda_compile`` (NVRTC or nvcc), i.e. it
needs the TVM compiler's Python package on the GPU machine. We compile the source here
with ``nvcc -fatbin`` (one SASS image per requested arch, no PTX, so nothing is JIT
compiled there) and put the fatbin in place of the source inside the exported library:
the imported device module's payload is ``[fmt][function table][data]``; format "fatbin"
makes the CUDA runtime load ``data`` with ``cuModuleLoadData`` directly. The result loads
with ``tvm_ffi`` + ``libtvm_runtime.so`` + ``libtvm_runtime_cuda.so`` alone.

Packs of such libraries are written by ``compiler/pack_writer.py`` and loaded by
``runtime/pack_loader.py``.
"""

from __future__ import annotations

import functools
import os
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path
from typing import Any

DEFAULT_ARCHES = ("sm_80", "sm_90a")
DEFAULT_CUDA_ROOTS = ("/usr/local/cuda",)
# -maxrregcount=255: the register limit is the kernel's __launch_bounds__ alone. Without an
# explicit limit ptxas 13 applies an occupancy heuristic on sm_75 that capped a WMMA kernel
# (linear fp16 + GELU) at 64 registers and spilled; with it: 72 registers, no spill.
NVCC_FLAGS = ("-O3", "-std=c++17", "-maxrregcount=255")
NVCC_HELP = (
    "torch_tvm_gemm: building CUDA kernels needs nvcc (CUDA 12 or newer), which was not "
    "found on PATH or in $CUDA_HOME/bin. Install the CUDA toolkit "
    "(https://developer.nvidia.com/cuda-downloads, or `pip install nvidia-cuda-nvcc` and put "
    "its nvidia/cu13/bin on PATH), or set CUDA_HOME; or build the kernels on a machine with "
    "nvcc (`python -m torch_tvm_gemm compile --target cuda ...`) and load the pack here "
    "(TVM_GEMM_PACK)."
)


class NvccNotFoundError(RuntimeError):
    """No nvcc on this machine (the message says how to get one)."""


class NvccArchError(RuntimeError):
    """The nvcc found cannot compile for a requested arch (e.g. sm_70 with CUDA 13)."""


# --- nvcc ---------------------------------------------------------------------------------------


def nvcc_available() -> bool:
    """Whether ``find_nvcc`` finds one (tests skip the builds without it)."""
    try:
        find_nvcc()
    except NvccNotFoundError:
        return False
    return True


def find_nvcc() -> str:
    """Path of nvcc: PATH first, then $CUDA_HOME / $CUDA_PATH / /usr/local/cuda."""
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), *DEFAULT_CUDA_ROOTS):
        if root and os.access(os.path.join(root, "bin", "nvcc"), os.X_OK):
            return os.path.join(root, "bin", "nvcc")
    raise NvccNotFoundError(NVCC_HELP)


def normalize_arches(arches) -> list[str]:
    """ "80,sm_90" / ["sm_80", 90] -> ["sm_80", "sm_90"] (sorted, unique)."""
    if isinstance(arches, str):
        arches = arches.split(",")
    out = set()
    for arch in arches:
        text = str(arch).strip().lower()
        if not text:
            continue
        text = text if text.startswith("sm_") else f"sm_{text}"
        digits = text[3:].rstrip("a")
        if not digits.isdigit():
            raise ValueError(f"torch_tvm_gemm: bad CUDA arch {arch!r} (expected e.g. sm_80)")
        out.add(text)
    if not out:
        raise ValueError("torch_tvm_gemm: no CUDA arch given")
    return sorted(out, key=lambda a: (int(a[3:].rstrip("a")), a))


@functools.cache
def nvcc_arches(nvcc: str) -> frozenset[str]:
    """The real archs (``sm_XY``) this nvcc compiles for (``nvcc --list-gpu-code``)."""
    proc = subprocess.run([nvcc, "--list-gpu-code"], capture_output=True, text=True)
    return frozenset(proc.stdout.split()) if proc.returncode == 0 else frozenset()


def check_nvcc_arches(arches) -> None:
    """Raise a clear error for an arch the nvcc found cannot compile for (CUDA 13 dropped
    Volta: its nvcc has no sm_70; a CUDA 12 toolkit does)."""
    nvcc = find_nvcc()
    known = nvcc_arches(nvcc)
    # (the list names base archs only: sm_90a is sm_90's arch-specific variant)
    missing = [a for a in normalize_arches(arches) if known and a.rstrip("af") not in known]
    if missing:
        volta = any(a.startswith("sm_7") and a < "sm_75" for a in missing)
        hint = (
            "CUDA 13 dropped sm_70 (Volta): build those kernels with a CUDA 12 nvcc (put it "
            "first on PATH)"
            if volta
            else "use a newer CUDA toolkit"
        )
        raise NvccArchError(
            f"torch_tvm_gemm: {nvcc} cannot compile for {', '.join(missing)} (it knows "
            f"{' '.join(sorted(known))}); {hint}"
        )


def nvcc_fatbin(source: str, arches, extra: tuple[str, ...] = ()) -> bytes:
    """Compile CUDA C++ to a fatbin holding SASS for each arch (no PTX: no JIT at load)."""
    nvcc = find_nvcc()
    check_nvcc_arches(arches)
    with tempfile.TemporaryDirectory(prefix="tvm_gemm_nvcc_") as tmp:
        src, out = os.path.join(tmp, "kernel.cu"), os.path.join(tmp, "kernel.fatbin")
        Path(src).write_text(source)
        cmd = [nvcc, "-fatbin", *NVCC_FLAGS, "-o", out, src, *extra]
        for arch in normalize_arches(arches):
            cmd += ["-gencode", f"arch=compute_{arch[3:]},code={arch}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(
                f"torch_tvm_gemm: nvcc failed ({' '.join(cmd)}):\n{proc.stderr[-4000:]}"
            )
        return Path(out).read_bytes()


def ptxas_info(source: str, arch: str) -> dict:
    """Registers, spills and static shared memory of each kernel, from ``nvcc -Xptxas -v``."""
    nvcc = find_nvcc()
    with tempfile.TemporaryDirectory(prefix="tvm_gemm_nvcc_") as tmp:
        src = os.path.join(tmp, "kernel.cu")
        Path(src).write_text(source)
        cmd = [nvcc, "-cubin", *NVCC_FLAGS, f"-arch={arch}", "-Xptxas", "-v"]
        proc = subprocess.run(
            [*cmd, "-o", os.path.join(tmp, "k.cubin"), src], capture_output=True, text=True
        )
    if proc.returncode != 0:
        raise RuntimeError(f"torch_tvm_gemm: nvcc failed:\n{proc.stderr[-4000:]}")
    return parse_ptxas(proc.stderr)


def parse_ptxas(text: str) -> dict:
    import re

    info = {"registers": 0, "spill_stores": 0, "spill_loads": 0, "stack": 0, "smem": 0}
    for line in text.splitlines():
        if m := re.search(r"Used (\d+) registers", line):
            info["registers"] = max(info["registers"], int(m.group(1)))
        if m := re.search(r"(\d+) bytes smem", line):
            info["smem"] = max(info["smem"], int(m.group(1)))
        if m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+)", line):
            info["stack"] = max(info["stack"], int(m.group(1)))
            info["spill_stores"] += int(m.group(2))
            info["spill_loads"] += int(m.group(3))
    return info


# --- putting the binary into the exported library --------------------------------------------


def _u64(value: int) -> bytes:
    return struct.pack("<Q", value)


def _string(text: str) -> bytes:
    data = text.encode()
    return _u64(len(data)) + data


def replace_device_source(blob: bytes, source: str, binary: bytes, fmt: str = "fatbin") -> bytes:
    """The imports blob of a host module with its CUDA source payload replaced by ``binary``.

    Layout (all lengths u64 little-endian): ``[blob size][import tree ...][kind "cuda"]
    [payload size][fmt "cuda"][function table][source size][source]``, the CUDA module
    being the last (only) import. Checked field by field; anything unexpected raises.
    """
    src = source.encode()
    tail = _u64(len(src)) + src
    if not blob.endswith(tail):
        raise RuntimeError("torch_tvm_gemm: unexpected TVM module blob (source not last)")
    fmt_field = _string("cuda")
    payload_end = len(blob) - len(tail)
    fmt_at = blob.rfind(fmt_field, 0, payload_end)
    if fmt_at < 8:
        raise RuntimeError("torch_tvm_gemm: unexpected TVM module blob (no 'cuda' payload)")
    (payload_size,) = struct.unpack_from("<Q", blob, fmt_at - 8)
    if fmt_at + payload_size != len(blob):
        raise RuntimeError("torch_tvm_gemm: unexpected TVM module blob (payload size)")
    (total,) = struct.unpack_from("<Q", blob, 0)
    if total != len(blob) - 8:
        raise RuntimeError("torch_tvm_gemm: unexpected TVM module blob (total size)")
    table = blob[fmt_at + len(fmt_field) : payload_end]
    payload = _string(fmt) + table + _u64(len(binary)) + binary
    body = blob[8 : fmt_at - 8] + _u64(len(payload)) + payload
    return _u64(len(body)) + body


def _c_array(blob: bytes) -> str:
    """The imports blob as the C symbol TVM's loader looks for (as ModulePackImportsToC)."""
    rows = [
        "  " + ",".join(f"0x{b:02x}" for b in blob[i : i + 20]) + ","
        for i in range(0, len(blob), 20)
    ]
    return (
        '#ifdef __cplusplus\nextern "C" {\n#endif\n'
        "extern const unsigned char __tvm_ffi__library_bin[];\n"
        f"const unsigned char __tvm_ffi__library_bin[{len(blob)}] = {{\n"
        + "\n".join(rows)
        + "\n};\n#ifdef __cplusplus\n}\n#endif\n"
    )


def export_with_binary(executable: Any, path: str | os.PathLike, arches) -> dict:
    """Export a CUDA ``tvm.compile`` result as a library holding SASS for ``arches``.

    Returns what the build learnt: arches, the CUDA source size and ptxas figures of the
    first arch (registers, spills, shared memory).
    """
    import tvm_ffi

    arches = normalize_arches(arches)
    host = executable.mod
    (device,) = [m for m in host.imports if m.kind == "cuda"]
    source = device.inspect_source()
    binary = nvcc_fatbin(source, arches)
    pack = tvm_ffi.get_global_func("runtime.ModulePackImportsToTensor")

    def fpack_imports(mod, is_system_lib, prefix, workspace_dir):
        import numpy as np

        blob = bytes(np.from_dlpack(pack(mod)))
        c_path = os.path.join(workspace_dir, "devc_fatbin.c")
        Path(c_path).write_text(_c_array(replace_device_source(blob, source, binary)))
        return c_path

    host.export_library(str(path), fpack_imports=fpack_imports)
    return {"arches": arches, "source_chars": len(source), "fatbin_bytes": len(binary)}


class CudaExecutable:
    """What ``build.compile_spec`` returns for CUDA: exports with SASS, not source."""

    def __init__(self, executable: Any, arches) -> None:
        self.executable = executable
        self.arches = normalize_arches(arches)

    @property
    def source(self) -> str:
        (device,) = [m for m in self.executable.mod.imports if m.kind == "cuda"]
        return device.inspect_source()

    def export_library(self, path: str | os.PathLike) -> dict:
        return export_with_binary(self.executable, path, self.arches)

    def __getitem__(self, name: str) -> Any:  # in-memory use (read-only cache): via a file
        from ..runtime.loader import keep_alive, load_kernel_file

        tmp = tempfile.mkdtemp(prefix="tvm_gemm_cuda_")
        path = os.path.join(tmp, "kernel.so")
        self.export_library(path)
        fn = load_kernel_file(path, name, device="cuda")
        keep_alive(tmp)
        return fn


# --- inspecting built libraries (tests, CI: no GPU needed) -------------------------------------

_FATBIN_MAGIC = struct.pack("<I", 0xBA55ED50)


def fatbin_from_library(path: str | os.PathLike) -> bytes:
    """The fatbin embedded in an exported CUDA kernel library (found by its magic number and
    the u64 length TVM's payload puts before it)."""
    data = Path(path).read_bytes()
    at = data.find(_FATBIN_MAGIC)
    if at < 8:
        raise RuntimeError(f"torch_tvm_gemm: no fatbin in {path}")
    (size,) = struct.unpack_from("<Q", data, at - 8)
    return data[at : at + size]


def find_cuobjdump() -> str | None:
    """cuobjdump from PATH, CUDA_HOME or the nvidia-cuda-cuobjdump wheel."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    candidates = [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin")]
    try:
        import nvidia

        for base in nvidia.__path__:
            candidates += [
                os.path.join(base, sub, "bin") for sub in ("cu13", "cu12", "cuda_cuobjdump")
            ]
    except ImportError:
        pass
    for folder in candidates:
        exe = os.path.join(folder, "cuobjdump")
        if os.access(exe, os.X_OK):
            return exe
    return None


def sass_by_arch(fatbin: bytes) -> dict[str, str]:
    """Disassembled SASS of each arch in a fatbin (cuobjdump --dump-sass)."""
    import re

    exe = find_cuobjdump()
    if exe is None:
        raise RuntimeError(
            "torch_tvm_gemm: cuobjdump not found (pip install nvidia-cuda-cuobjdump "
            "nvidia-cuda-nvdisasm)"
        )
    with tempfile.TemporaryDirectory(prefix="tvm_gemm_sass_") as tmp:
        path = os.path.join(tmp, "k.fatbin")
        Path(path).write_bytes(fatbin)
        env = dict(os.environ, PATH=os.path.dirname(exe) + os.pathsep + os.environ["PATH"])
        out = subprocess.run(
            [exe, "--dump-sass", path], capture_output=True, text=True, env=env, check=True
        ).stdout
    sections: dict[str, str] = {}
    current = None
    for line in out.splitlines():
        if m := re.search(r"arch = (sm_\d+a?)", line):
            current = m.group(1)
            sections.setdefault(current, "")
        elif current:
            sections[current] += line + "\n"
    return sections

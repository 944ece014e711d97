"""What machine we compile for, decided without importing the TVM compiler.

The cache key needs a name for the host CPU on every call, including in processes that only
load cached kernels, so it is read from /proc/cpuinfo and `platform` rather than from LLVM.
The LLVM target itself (``mcpu``) is only asked for when a kernel is actually built.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
from dataclasses import dataclass


@dataclass(frozen=True)
class CpuInfo:
    arch: str  # platform.machine(): x86_64, aarch64, ...
    model: str  # "model name" from /proc/cpuinfo, or "" where there is none
    features: frozenset[str]
    l2_bytes: int = 1 << 20  # one core's L2 cache (sysfs), for the GEMM's panel width
    # The cores this process may run on (torch's default thread count). Like l2_bytes, not in
    # the cache key: a kernel scheduled for another count is still right, only less balanced.
    cores: int = 1

    @property
    def vector_bytes(self) -> int:
        """Width of the widest SIMD register the schedules may use."""
        if "avx512f" in self.features:
            return 64
        if "avx2" in self.features and "fma" in self.features:
            return 32
        return 16  # SSE / NEON

    @property
    def vector_registers(self) -> int:
        return 32 if self.vector_bytes == 64 or self.arch == "aarch64" else 16

    @property
    def amx_bf16(self) -> bool:
        """Whether bf16 GEMMs may run on AMX tiles: the CPU has them and Linux lets this
        process use them (``enable_amx``)."""
        has_tiles = {"amx_tile", "amx_bf16"} <= self.features
        return has_tiles and self.arch == "x86_64" and enable_amx()

    def key(self) -> str:
        """A short stable name for the cache: architecture, SIMD level and a feature hash."""
        digest = hashlib.sha256(
            (self.model + "|" + " ".join(sorted(self.features))).encode()
        ).hexdigest()[:10]
        # The tiles' permission is not a CPU flag, and it changes the bf16 kernels.
        return f"{self.arch}-v{self.vector_bytes * 8}-{digest}" + ("-amx" if self.amx_bf16 else "")


@functools.cache
def host_cpu() -> CpuInfo:
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                name = name.strip()
                if name == "model name" and not model:
                    model = value.strip()
                elif name in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:  # not Linux: fall back to the architecture alone
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return CpuInfo(platform.machine(), model, frozenset(flags), _l2_bytes(), cores or 1)


# Linux x86-64: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA). A process must ask
# before its threads touch the AMX tile registers (an instruction on them without it is
# SIGILL); the grant is for the whole process and every thread it starts.
_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18


@functools.cache
def enable_amx() -> bool:
    """Ask Linux for the AMX tile state (once per process); False where it is refused or
    this is not Linux on x86-64. torch's oneDNN asks the same when it first uses AMX."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def _l2_bytes() -> int:
    """The L2 cache of CPU 0 from sysfs ("2048K"), or 1 MiB where it cannot be read."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for index in sorted(os.listdir(base)):
            with open(f"{base}/{index}/level") as f:
                if f.read().strip() != "2":
                    continue
            with open(f"{base}/{index}/size") as f:
                size = f.read().strip().upper()
            units = {"K": 1 << 10, "M": 1 << 20}
            return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
    except (OSError, ValueError):
        pass
    return 1 << 20


def cuda_arch(device_index: int | None = None) -> str:
    """``sm_XY`` of this process's current (or the given) GPU; needs a GPU. A Hopper (9.0)
    GPU is ``sm_90a``: code built for it may use that chip's own instructions (wgmma, TMA),
    and runs on 9.0 GPUs only; kernels built for plain ``sm_90`` run there too."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(
            "torch_tvm_gemm: no CUDA GPU here to build for; cross-compile with "
            "`python -m torch_tvm_gemm compile --target cuda --arch sm_80,...`"
        )
    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm_{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")


def device_key(device: str) -> str:
    """The target part of a kernel's cache key: this CPU, or the current GPU's arch."""
    if device == "cpu":
        return host_cpu().key()
    if device == "cuda":
        return f"cuda-{cuda_arch()}"
    return device

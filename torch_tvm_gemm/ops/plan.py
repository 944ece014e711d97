"""Planning: which kernels a workload needs, found by running it without building any.

While ``ops.planning()`` (in ``impls``) is active, the GEMM and conv impls pick their kernel
exactly as on a real call (``gemm_ops.gemm_spec``, ``conv_ops.conv2d_spec``), record it in
the active ``Plan`` and compute their result with torch instead of a TVM kernel. A forward
(and backward) pass over example inputs then lists the kernels a real run of the same
shapes asks for: ``torch_tvm_gemm.precompile`` builds them up front, the GPU case table
(``tools/cuda_cases.py``) packs them for a machine without the compiler.

This module only holds the state; it imports nothing of ours (the impls read it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEVICES = (None, "cpu", "cuda")


@dataclass
class Plan:
    """What a planned run asked for, and the settings it was planned with."""

    # Whose kernels: "cpu" or "cuda" whatever the tensors' device (a GPU run planned on CPU
    # tensors), or None: the tensors' own.
    device: str | None = None
    # CUDA float32 products: True / False plan the TF32 / exact kernels; None: as a real call
    # decides (torch.backends.cuda.matmul.allow_tf32).
    tf32: bool | None = None
    # False: results are left uninitialised instead of computed by torch (for workloads whose
    # control flow reads no values: a GPU case at 8192^3 would take minutes on the CPU).
    compute: bool = True
    specs: list[Any] = field(default_factory=list)  # in order of first use, each once
    _seen: set[Any] = field(default_factory=set, init=False, repr=False)

    def record(self, spec) -> None:
        if spec not in self._seen:
            self._seen.add(spec)
            self.specs.append(spec)

    def device_for(self, device: str) -> str:
        """The device whose kernel a call on a tensor of ``device`` plans."""
        return self.device or device


_active: Plan | None = None


def active() -> Plan | None:
    """The plan being recorded now, or None (the ops run their kernels)."""
    return _active


def activate(plan: Plan | None) -> Plan | None:
    """Make ``plan`` the active one (None: none); returns the one it replaces."""
    global _active
    previous, _active = _active, plan
    return previous

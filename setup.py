"""Install torch_tvm_gemm. Pins: see README ("Why the pins").

The C++ extension ``torch_tvm_gemm._C`` (csrc/: the ops' per-call hot path) is built against
the torch and apache-tvm-ffi already installed, so install with

    pip install --no-build-isolation .        (or -e .)

(build isolation would hide torch from the build and the package would be installed without
the extension; it still works then, through the slower Python impls, and says so at import).
Environment: ``TVM_GEMM_NO_EXT=1`` skips the extension; ``TVM_GEMM_REQUIRE_EXT=1`` makes a
failure to build it an error instead of a warning (CI sets it).
"""

from __future__ import annotations

import os
import sys

from setuptools import find_packages, setup


def _warn(msg: str) -> None:
    print(f"WARNING: torch_tvm_gemm: {msg}", file=sys.stderr)


def _require_ext() -> bool:
    return os.environ.get("TVM_GEMM_REQUIRE_EXT", "") == "1"


def _extension_kwargs() -> dict:
    """``ext_modules`` and ``cmdclass`` for the C++ extension, or nothing when it can't build."""
    if os.environ.get("TVM_GEMM_NO_EXT", "") == "1":
        return {}
    try:
        import torch  # noqa: F401 (cpp_extension needs it; a missing torch is the common failure)
        import tvm_ffi.libinfo
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError as err:
        if _require_ext():
            raise
        _warn(f"building without the C++ extension ({err}); use --no-build-isolation")
        return {}

    ffi_lib_dir = os.path.dirname(tvm_ffi.libinfo.find_libtvm_ffi())
    ext = CppExtension(
        "torch_tvm_gemm._C",
        [
            "csrc/tvm_gemm_ops.cpp",
            "csrc/parallel_launch.cpp",
            "csrc/python_entry.cpp",
            "csrc/output_pool.cpp",
            "csrc/transposed_copy.cpp",
        ],
        depends=["csrc/parallel_launch.h", "csrc/output_pool.h", "csrc/transposed_copy.h"],
        include_dirs=tvm_ffi.libinfo.include_paths(),
        library_dirs=[ffi_lib_dir],
        libraries=["tvm_ffi"],
        # -g0: Python's own CFLAGS add -g, which makes the library 12 MB instead of ~1 MB.
        # -fopenmp: parallel_launch.cpp runs TVM's parallel loops on torch's OpenMP pool.
        extra_compile_args=["-O3", "-g0", "-fopenmp"],
        # libtvm_ffi.so is found next to the installed package (site-packages/tvm_ffi/lib) or,
        # for an in-place / editable build, where it was at build time. At run time it is
        # normally already loaded (import tvm_ffi loads it RTLD_GLOBAL) and is reused by soname.
        extra_link_args=[
            f"-Wl,-rpath,{ffi_lib_dir}",
            "-Wl,-rpath,$ORIGIN/../tvm_ffi/lib",
            "-fopenmp",
        ],
    )

    class _BuildExt(BuildExtension):
        """Build the extension; on failure warn and install the pure-Python package."""

        def build_extension(self, extension) -> None:
            try:
                super().build_extension(extension)
            except Exception as err:  # a compiler problem must not block the install
                if _require_ext():
                    raise
                _warn(f"the C++ extension failed to build ({err}); the Python impls will be used")

    return {
        "ext_modules": [ext],
        "cmdclass": {"build_ext": _BuildExt.with_options(use_ninja=False)},
    }


setup(
    name="torch_tvm_gemm",
    version="0.1.0",
    description="PyTorch custom ops (matmul, fused linear, conv) with kernels compiled by Apache TVM",
    packages=find_packages(include=["torch_tvm_gemm", "torch_tvm_gemm.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.6",
        "apache-tvm==0.27.0.post1",
        # 0.1.15.x segfaults inside Schedule.tensorize with apache-tvm 0.27 (see README).
        "apache-tvm-ffi==0.1.14.post1",
        "numpy",
        "filelock",
        "tqdm",
    ],
    extras_require={
        # cuobjdump / nvdisasm read the SASS of the cross-compiled CUDA kernels in the tests.
        # transformers: the model tests and bench-models (configs with random weights only).
        "test": [
            "pytest",
            "pytest-xdist",  # -n auto: one test process a core (kernel builds take one each)
            "hypothesis",
            "ruff",
            "nvidia-cuda-cuobjdump",
            "nvidia-cuda-nvdisasm",
            "transformers>=4.40",
        ],
        "models": ["transformers>=4.40"],
        # MetaSchedule (tune, ladder): its cost model needs xgboost; the CPU build avoids
        # the 470 MB NCCL library that the plain xgboost wheel pulls in.
        "tune": ["psutil", "xgboost-cpu", "cloudpickle", "tornado"],
        "plot": ["matplotlib"],
    },
    entry_points={"console_scripts": ["torch-tvm-gemm=torch_tvm_gemm.__main__:main"]},
    **_extension_kwargs(),
)

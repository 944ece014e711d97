"""Install torch_tvm_gemm. Pins: see README ("Why the pins")."""

from setuptools import find_packages, setup

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
        "test": ["pytest", "hypothesis", "ruff", "nvidia-cuda-cuobjdump", "nvidia-cuda-nvdisasm"],
        "tune": ["psutil", "xgboost", "cloudpickle", "tornado"],
        "plot": ["matplotlib"],
    },
    entry_points={"console_scripts": ["torch-tvm-gemm=torch_tvm_gemm.__main__:main"]},
)

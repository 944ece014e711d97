#!/usr/bin/env bash
# GPU check of the CUDA kernels: GPU tests + benchmark vs torch, on a machine WITHOUT apache-tvm.
#
# Two steps:
#
# 1. Here (build machine: apache-tvm, nvcc, registry access, no GPU needed), from the repo root:
#        bash benchmarks/gpu_check.sh prepare [sm_90a]      (an A100: sm_80; a list: sm_90,sm_90a)
#    fills .gpu_carry/ (git-ignored, ~10 MB, small enough to copy anywhere):
#        wheels/  apache-tvm-ffi 0.1.14.post1 (cp312) and pytest (+ deps) for Python 3.12
#        lib/     libtvm_runtime.so and libtvm_runtime_cuda.so copied from the apache-tvm wheel
#        pack/    the kernels of the GPU tests and the benchmark (GEMM and conv2d), cross-
#                 compiled for the arch (`python -m torch_tvm_gemm compile --preset all`),
#                 with manifest.json
#                 (sm_90a, an H100 / H200: the linears on TMA + wgmma, the rest on mma.sync;
#                 with sm_90,sm_90a both kernels of a linear, TVM_GEMM_CUDA_WGMMA=0 picks mma)
#        pack_wmma/  the test kernels again with TVM_GEMM_CUDA_FORCE_WMMA=1: fp16 on the
#                 Volta/Turing WMMA schedule, checked on this GPU by a second, short pytest
#
# 2. On a machine with an NVIDIA GPU (e.g. Python 3.12, torch with CUDA 13, no apache-tvm
#    needed): copy the working tree and .gpu_carry/ there and, from the repo root, with the
#    Python that has torch first on PATH, run
#        bash benchmarks/gpu_check.sh
#    It installs the carried wheels, runs tests/test_cuda_ops.py (kernels from the pack only:
#    TVM_GEMM_NO_COMPILE=1), the fp16 cases again on the forced WMMA schedule, and
#    benchmarks/gpu_bench.py, and prints one table (on an H200 the three take about a
#    minute; each step has its own timeout so the table always prints). Results are also
#    written to $GPU_CHECK_OUT (gpu_bench.json, pytest*.log; default /tmp/gpu_check_out).
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY=.gpu_carry

if [[ "${1:-run}" == "prepare" ]]; then
    ARCH=${2:-sm_90a}
    rm -rf "$CARRY" && mkdir -p "$CARRY/wheels" "$CARRY/lib"
    pip download --quiet --python-version 3.12 --only-binary=:all: --no-deps \
        -d "$CARRY/wheels" apache-tvm-ffi==0.1.14.post1
    pip download --quiet --python-version 3.12 --only-binary=:all: \
        -d "$CARRY/wheels" pytest
    TVM_LIB=$(python -c "import importlib.util, pathlib; \
print(pathlib.Path(importlib.util.find_spec('tvm').origin).parent / 'lib')")
    cp "$TVM_LIB/libtvm_runtime.so" "$TVM_LIB/libtvm_runtime_cuda.so" "$CARRY/lib/"
    python -m torch_tvm_gemm compile --target cuda --arch "$ARCH" --preset all --out "$CARRY/pack"
    # The Volta/Turing WMMA schedule, forced for this arch, so that it is checked here too.
    TVM_GEMM_CUDA_FORCE_WMMA=1 python -m torch_tvm_gemm compile --target cuda --arch "$ARCH" \
        --preset test --out "$CARRY/pack_wmma"
    du -sh "$CARRY"
    exit 0
fi

OUT_DIR=${GPU_CHECK_OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT_DIR"
echo "== $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo '?')"
python -m pip install --quiet --no-index --find-links "$CARRY/wheels" apache-tvm-ffi pytest 2>&1 \
    | grep -v "root user" || true
export TVM_GEMM_RUNTIME_LIB_DIR="$PWD/$CARRY/lib"
export TVM_GEMM_PACK="$PWD/$CARRY/pack"
export TVM_GEMM_NO_COMPILE=1
export TVM_GEMM_CACHE_DIR=/tmp/tvm_gemm_cache
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

echo "== GPU tests (tests/test_cuda_ops.py)"
set +e
timeout 240 python -m pytest -q -p no:cacheprovider tests/test_cuda_ops.py 2>&1 \
    | tee "$OUT_DIR/pytest.log" | tail -40
echo "== the WMMA (sm_70/75) schedule forced on this GPU: fp16 GEMM numerics"
TVM_GEMM_PACK="$PWD/$CARRY/pack_wmma" TVM_GEMM_CUDA_FORCE_WMMA=1 timeout 90 \
    python -m pytest -q -p no:cacheprovider tests/test_cuda_ops.py \
    -k "(test_numerics_vs_torch or test_autograd_matches_torch) and float16" 2>&1 \
    | tee "$OUT_DIR/pytest_wmma.log" | tail -8
echo "== benchmark vs torch (benchmarks/gpu_bench.py)"
timeout 200 python benchmarks/gpu_bench.py --json "$OUT_DIR/gpu_bench.json"
status=$?
set -e
echo "== done (benchmark exit $status)"

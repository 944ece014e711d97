// Runs the parallel loops of TVM's CPU kernels on PyTorch's OpenMP thread pool.
//
// A kernel exported by TVM calls its thread pool through a function pointer in the kernel
// library, `__TVMBackendParallelLaunch`, which TVM's runtime fills in when the library loads.
// TVM's pool and torch's OpenMP pool would then share the cores: after each torch op its
// OpenMP workers spin, waiting for the next parallel region, on the core that TVM's second
// worker needs, and TVM's statically split loop waits for that starved worker (seen: a conv
// 2.5x slower right after a torch conv than alone; a 2-thread ResNet-50 conv benchmark at
// 0.45x of oneDNN that runs at 1.6x with OMP_WAIT_POLICY=PASSIVE). runtime.py points that
// pointer at `parallel_launch` below instead: TVM's tasks run as one OpenMP parallel region on
// the very threads torch's ops use, so the two never compete, and the kernels follow
// torch.set_num_threads by construction.
//
// This file is compiled with -fopenmp. torch's wheel ships libgomp.so.1 and has loaded it
// before this extension, so the dynamic loader binds us to that same library (one soname)
// and therefore to torch's pool.

#include <ATen/Parallel.h>
#include <omp.h>

#include <atomic>
#include <cstdint>

#include "parallel_launch.h"

namespace tvm_gemm {

// The ABI of TVM's C backend API (tvm/runtime/c_backend_api.h), restated here so that the
// extension builds without TVM's headers: a kernel's parallel body is called once per task.
struct ParallelGroupEnv {
  void* sync_handle;  // for TVMBackendParallelBarrier; kernels that use it are not redirected
  int32_t num_task;
};
using ParallelLambda = int (*)(int task_id, ParallelGroupEnv* penv, void* cdata);

// Set (by SerialCalls) around a kernel call too small to share: its parallel loop then runs on
// the calling thread. Opening an OpenMP region costs about a microsecond, more than a
// 16 x 16 x 16 product (which is one task of the packed kernel anyway).
thread_local bool t_serial_calls = false;

SerialCalls::SerialCalls(bool serial) : previous_(t_serial_calls) { t_serial_calls = serial; }
SerialCalls::~SerialCalls() { t_serial_calls = previous_; }

// TVM's contract: run flambda(task, env, cdata) for task in [0, num_task), num_task = 0
// meaning "as many as the pool has" (what TVM's code generator always passes); return 0, or
// -1 if a task failed. Each task computes its own share of the loop from env->num_task.
extern "C" int parallel_launch(ParallelLambda flambda, void* cdata, int num_task) {
  int n = num_task > 0 ? num_task : at::get_num_threads();
  // (Inside a parallel region already: no nested team.)
  if (n <= 1 || t_serial_calls || omp_in_parallel()) {
    ParallelGroupEnv env{nullptr, 1};
    return flambda(0, &env, cdata) == 0 ? 0 : -1;
  }
  ParallelGroupEnv env{nullptr, n};
  std::atomic<bool> failed{false};
#pragma omp parallel num_threads(n)
  {
    // OpenMP may grant fewer threads than asked (OMP_THREAD_LIMIT, dynamic teams): then a
    // thread runs several tasks, which is correct for kernels without barriers.
    int threads = omp_get_num_threads();
    for (int task = omp_get_thread_num(); task < n; task += threads) {
      if (flambda(task, &env, cdata) != 0) failed.store(true, std::memory_order_relaxed);
    }
  }
  return failed.load() ? -1 : 0;
}

int64_t parallel_launch_address() {
  return static_cast<int64_t>(reinterpret_cast<intptr_t>(&parallel_launch));
}

}  // namespace tvm_gemm

// What parallel_launch.cpp offers the ops: see there.
#pragma once

#include <cstdint>

namespace tvm_gemm {

// Products of at most this many multiply-adds run on the calling thread (SerialCalls): one
// OpenMP region costs ~1 us, more than such a product takes (16 x 16 x 16 matmul, 2 threads,
// Intel Xeon: the kernel alone 2.4 us with the region, 1.6 us without). python_entry.cpp keeps
// the GIL through the same products.
constexpr int64_t kSerialMaxMacs = int64_t{1} << 18;  // 64 x 64 x 64

// ... unless B has this many elements or more (schedules/cpu.py GEMV_PARALLEL_MIN_ELEMENTS,
// from which the gemv and dot kernels for a few rows are built with a parallel loop): there
// the product is a read of B, which two threads stream faster than one. Measured: M = 1,
// 512 x 512 (2^18 multiply-adds), 2 threads, Intel Xeon, weights cycling through 48 MB as in
// a model: 22 us with the kernel's parallel loop, 34 us on the calling thread (F.linear 22).
constexpr int64_t kSerialMaxBElements = int64_t{1} << 17;

// Whether an (M, N, K) product runs on the calling thread (SerialCalls).
inline bool serial_product(int64_t m, int64_t n, int64_t k) {
  return m * n * k <= kSerialMaxMacs && n * k < kSerialMaxBElements;
}

// While one is alive on a thread, the kernels it calls run their parallel loops on that
// thread alone (when ``serial``): for products too small to share between threads.
class SerialCalls {
 public:
  explicit SerialCalls(bool serial);
  ~SerialCalls();
  SerialCalls(const SerialCalls&) = delete;
  SerialCalls& operator=(const SerialCalls&) = delete;

 private:
  bool previous_;
};

int64_t parallel_launch_address();

}  // namespace tvm_gemm

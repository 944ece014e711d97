// What parallel_launch.cpp offers the ops: see there.
#pragma once

#include <cstdint>

namespace tvm_gemm {

// Products of at most this many multiply-adds run on the calling thread (SerialCalls): one
// OpenMP region costs ~1 us, more than such a product takes (16 x 16 x 16 matmul, 2 threads,
// Intel Xeon: the kernel alone 2.4 us with the region, 1.6 us without). python_entry.cpp keeps
// the GIL through the same products.
constexpr int64_t kSerialMaxMacs = int64_t{1} << 18;  // 64 x 64 x 64

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

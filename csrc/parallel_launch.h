// What parallel_launch.cpp offers the ops: see there.
#pragma once

#include <cstdint>

namespace tvm_gemm {

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

// The ops' large CPU outputs: see output_pool.cpp.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace tvm_gemm {

// Outputs of min_bytes or more come from the pool; at most limit_bytes of freed outputs are
// kept for reuse. min_bytes 0: the pool is off (at::empty). runtime/output_pool.py sets both.
void configure_output_pool(int64_t min_bytes, int64_t limit_bytes);

// An uninitialized output (at::empty's contract), from the pool where configure_output_pool says.
at::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& options);

struct OutputPoolStats {
  int64_t kept_bytes = 0;   // freed outputs held for reuse
  int64_t kept_blocks = 0;
  int64_t live_bytes = 0;   // outputs from the pool still alive
  int64_t min_bytes = 0;
  int64_t limit_bytes = 0;
};
OutputPoolStats output_pool_stats();

// Returns the kept blocks to the system.
void release_output_pool();

}  // namespace tvm_gemm

// A contiguous copy of a transposed matrix, for the GEMMs' A operand: see transposed_copy.cpp.
#pragma once

#include <ATen/ATen.h>

namespace tvm_gemm {

// Whether t is the transpose of a contiguous 2-D matrix (a backward's dZ.t(), x.t()).
bool is_transposed_contiguous(const at::Tensor& t);

// t as a contiguous matrix, for a t of which is_transposed_contiguous holds: blocked, on
// torch's threads, into an output from the pool.
at::Tensor transposed_copy(const at::Tensor& t);

}  // namespace tvm_gemm

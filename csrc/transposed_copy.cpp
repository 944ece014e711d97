// The kernels read A by rows, so a transposed A (the weight gradient's dZ^T in dW = dZ^T @ X,
// or X^T for a weight stored (in, out)) is copied to rows first. torch's copy of a transpose
// runs on one thread, and into fresh memory: a LLaMA-style training step at batch 8 spent 34 ms
// of its 450 there (dZ^T of 1024 x 1376: 1.9 ms, where a plain copy of as many values takes
// 0.26). Here square blocks that stay in L1 (their rows of both sides), shared out between
// torch's threads, into an output from the pool (no page faults once its blocks are reused).

#include "transposed_copy.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "output_pool.h"

namespace tvm_gemm {
namespace {

constexpr int64_t kBlock = 32;  // 32 x 32 values: the block's 32 source rows fit in L1

// dst (rows x cols, row-major) = the transpose of src (cols x rows, row-major), by blocks of
// rows of dst, each block a task.
template <typename T>
void transpose_blocks(const T* src, T* dst, int64_t rows, int64_t cols) {
  const int64_t row_blocks = (rows + kBlock - 1) / kBlock;
  at::parallel_for(0, row_blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t rb = first; rb < last; ++rb) {
      const int64_t r0 = rb * kBlock, r1 = std::min(r0 + kBlock, rows);
      for (int64_t c0 = 0; c0 < cols; c0 += kBlock) {
        const int64_t c1 = std::min(c0 + kBlock, cols);
        for (int64_t r = r0; r < r1; ++r) {
          T* out = dst + r * cols;
          for (int64_t c = c0; c < c1; ++c) out[c] = src[c * rows + r];
        }
      }
    }
  });
}

}  // namespace

bool is_transposed_contiguous(const at::Tensor& t) {
  return t.dim() == 2 && t.size(0) > 1 && t.size(1) > 1 && t.stride(0) == 1 &&
         t.stride(1) == t.size(0);
}

at::Tensor transposed_copy(const at::Tensor& t) {
  TORCH_CHECK(is_transposed_contiguous(t), "transposed_copy: not a transposed matrix");
  at::Tensor out = empty_output(t.sizes(), t.options());
  const int64_t rows = t.size(0), cols = t.size(1);
  // (by element size: the copy moves values, whatever their type)
  switch (t.element_size()) {
    case 2:
      transpose_blocks(static_cast<const int16_t*>(t.data_ptr()),
                       static_cast<int16_t*>(out.data_ptr()), rows, cols);
      break;
    case 4:
      transpose_blocks(static_cast<const int32_t*>(t.data_ptr()),
                       static_cast<int32_t*>(out.data_ptr()), rows, cols);
      break;
    case 8:
      transpose_blocks(static_cast<const int64_t*>(t.data_ptr()),
                       static_cast<int64_t*>(out.data_ptr()), rows, cols);
      break;
    default:
      out.copy_(t);
  }
  return out;
}

}  // namespace tvm_gemm

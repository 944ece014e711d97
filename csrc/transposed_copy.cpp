// The kernels read A by rows, so a transposed A (the weight gradient's dZ^T in dW = dZ^T @ X,
// or X^T for a weight stored (in, out)) is copied to rows first. torch's copy of a transpose
// runs on one thread, and into fresh memory: a LLaMA-style training step at batch 8 spent 34 ms
// of its 450 there (dZ^T of 1024 x 1376: 1.9 ms, where a plain copy of as many values takes
// 0.26). Here square blocks that stay in L1 (their rows of both sides), shared out between
// torch's threads, into an output from the pool (no page faults once its blocks are reused).
// 4-byte values move by 8 x 8 tiles transposed in AVX2 registers (8 loads and 8 stores of a
// row each, where the scalar loop reads one value a load across 32 rows): 2 threads, Intel
// Xeon, into a kept output, 1376 x 128 55 -> 20 us, 3072 x 128 224 -> 125 us, 1376 x 1024
// 961 -> 659 us (torch's copy 112, 313, 1234); blocks of 16 or 64 were no faster. Through the
// op against torch.mm on the same transposed A (two alternating runs): 1376 x 512 x 128 0.68-0.85
// -> 0.84-0.86x, 3072 x 768 x 128 0.79-0.94 -> 0.94-1.01x, 1376 x 512 x 1024 0.85 -> 0.88-0.91x.
// A kernel reading the transposed A in place (a packed-kernel variant over an A stored (K, M):
// a tile's broadcasts of one step from one row, no copy) was no faster at K = 128 (1376 x 512:
// 0.733 against 0.721 ms with the copy) and 1.3x slower at K = 1024 (a new cache line a step).

#include "transposed_copy.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#define TVM_GEMM_X86 1
#endif

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

#ifdef TVM_GEMM_X86
// d[i * ds + j] = s[j * ss + i] for i, j < 8: the 8 x 8 tile at s transposed into d. (Float
// shuffles move the bits as they are: any 4-byte type goes through.)
__attribute__((target("avx2"))) inline void transpose_8x8(const float* s, int64_t ss, float* d,
                                                          int64_t ds) {
  __m256 r[8], t[8], u[8];
  for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(s + j * ss);
  for (int j = 0; j < 8; j += 2) {  // pairs of rows interleaved
    t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
    t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
  }
  for (int j = 0; j < 8; j += 4) {  // then pairs of pairs: each 128-bit lane a column's 4 values
    u[j] = _mm256_shuffle_ps(t[j], t[j + 2], 0x44);
    u[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], 0xEE);
    u[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0x44);
    u[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {  // column i: the low lanes of rows 0-3 and 4-7; i + 4: the high
    _mm256_storeu_ps(d + i * ds, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
    _mm256_storeu_ps(d + (i + 4) * ds, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
  }
}

// transpose_blocks for 4-byte values: the same blocks, each by 8 x 8 tiles, its edges by value.
__attribute__((target("avx2"))) void transpose_blocks_avx2(const float* src, float* dst,
                                                           int64_t rows, int64_t cols) {
  const int64_t row_blocks = (rows + kBlock - 1) / kBlock;
  at::parallel_for(0, row_blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t rb = first; rb < last; ++rb) {
      const int64_t r0 = rb * kBlock, r1 = std::min(r0 + kBlock, rows);
      for (int64_t c0 = 0; c0 < cols; c0 += kBlock) {
        const int64_t c1 = std::min(c0 + kBlock, cols);
        int64_t r = r0;
        for (; r + 8 <= r1; r += 8) {
          int64_t c = c0;
          for (; c + 8 <= c1; c += 8)
            transpose_8x8(src + c * rows + r, rows, dst + r * cols + c, cols);
          for (; c < c1; ++c)
            for (int64_t q = r; q < r + 8; ++q) dst[q * cols + c] = src[c * rows + q];
        }
        for (; r < r1; ++r)
          for (int64_t c = c0; c < c1; ++c) dst[r * cols + c] = src[c * rows + r];
      }
    }
  });
}

bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}
#endif

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
#ifdef TVM_GEMM_X86
      if (has_avx2()) {
        transpose_blocks_avx2(static_cast<const float*>(t.data_ptr()),
                              static_cast<float*>(out.data_ptr()), rows, cols);
        break;
      }
#endif
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

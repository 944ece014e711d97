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

// dst (rows x cols, row-major) = the transpose of src (cols x rows, row-major), by blocks:
// copy_block(r0, r1, c0, c1) copies rows [r0, r1) x columns [c0, c1) of dst; the blocks of
// rows are torch's threads' tasks.
template <typename CopyBlock>
void transpose_blocks(int64_t rows, int64_t cols, const CopyBlock& copy_block) {
  const int64_t row_blocks = (rows + kBlock - 1) / kBlock;
  at::parallel_for(0, row_blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t rb = first; rb < last; ++rb) {
      const int64_t r0 = rb * kBlock, r1 = std::min(r0 + kBlock, rows);
      for (int64_t c0 = 0; c0 < cols; c0 += kBlock)
        copy_block(r0, r1, c0, std::min(c0 + kBlock, cols));
    }
  });
}

// One block value by value (any element type; the edges of the 8 x 8 tiles below).
template <typename T>
void copy_values(const T* src, T* dst, int64_t rows, int64_t cols, int64_t r0, int64_t r1,
                 int64_t c0, int64_t c1) {
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = c0; c < c1; ++c) dst[r * cols + c] = src[c * rows + r];
}

template <typename T>
void transpose_values(const void* src, void* dst, int64_t rows, int64_t cols) {
  transpose_blocks(rows, cols, [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
    copy_values(static_cast<const T*>(src), static_cast<T*>(dst), rows, cols, r0, r1, c0, c1);
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

// One block of 4-byte values by 8 x 8 tiles, its edges value by value.
__attribute__((target("avx2"))) void copy_tiles(const float* src, float* dst, int64_t rows,
                                                int64_t cols, int64_t r0, int64_t r1,
                                                int64_t c0, int64_t c1) {
  int64_t r = r0;
  for (; r + 8 <= r1; r += 8) {
    int64_t c = c0;
    for (; c + 8 <= c1; c += 8) transpose_8x8(src + c * rows + r, rows, dst + r * cols + c, cols);
    copy_values(src, dst, rows, cols, r, r + 8, c, c1);
  }
  copy_values(src, dst, rows, cols, r, r1, c0, c1);
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
  const void* src = t.data_ptr();
  void* dst = out.data_ptr();
  // (by element size: the copy moves values, whatever their type)
  switch (t.element_size()) {
    case 2:
      transpose_values<int16_t>(src, dst, rows, cols);
      break;
    case 4:
#ifdef TVM_GEMM_X86
      if (has_avx2()) {
        transpose_blocks(rows, cols, [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
          copy_tiles(static_cast<const float*>(src), static_cast<float*>(dst), rows, cols, r0,
                     r1, c0, c1);
        });
        break;
      }
#endif
      transpose_values<int32_t>(src, dst, rows, cols);
      break;
    case 8:
      transpose_values<int64_t>(src, dst, rows, cols);
      break;
    default:
      out.copy_(t);
  }
  return out;
}

}  // namespace tvm_gemm

// caddtree::linear_bf16 for CPUs with AVX2 and FMA but no AVX512-BF16: y = x @ w.T (+ bias).
//
// The same operator and weight layout as linear_bf16.cpp (the AVX512-BF16 kernel, built instead
// of this file where the CPU has it): output rows in groups of 32, each group stored as
// [K/2][32][2], the pair of weights of every row for each pair of input columns. Without a bf16
// dot-product instruction, one 256-bit load holds a column pair of 8 rows; shifting each dword
// left by 16 bits gives the first column's weights in float32, clearing its low half the second's
// (a bfloat16 is the upper half of a float32). Each is multiplied by the input row's broadcast
// value of that column and added with an FMA, so every output accumulates in one float32 lane
// with no horizontal sums, and the weights are read once, in order, per pass over a group.
//
// On such CPUs torch's own bfloat16 linear has no packed oneDNN path, and a few rows cost many
// times one row; here the widening is shared by the rows of a pass, the rest is FMAs. A pass
// takes 2 rows: its 8 accumulators, the rows' 4 broadcast inputs and one widened weight pair fit
// the 16 registers (3 rows, or all 4 vectors of a column pair widened at once, spill to the stack
// and ran 1.3-1.4 times slower at 8-16 rows).
//
// Every output adds, for each column pair in order, its first column's product and then its
// second's, in one float32 lane, whatever the number of rows and however they are blocked or
// split across threads: a row's result is the same bits alone or among others, so plain decoding
// (one row) and tree verification (many) agree exactly.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "linear_op.h"

#include <array>
#include <cstdint>
#include <utility>

namespace {

using caddtree_linear::kGroup;  // output rows per group (four 8-lane vectors)
constexpr int64_t kPrefetch = 8;   // column pairs ahead to prefetch

using Problem = caddtree_linear::Problem<float>;

// Rows m0 .. m0 + MB - 1 of the output, columns o0 .. o0 + 31 (one weight group).
template <int MB>
inline void group_rows(const Problem& p, const uint16_t* wg, int64_t m0, int64_t o0) {
  __m256 acc[MB][4];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_setzero_ps();
  const float* xr[MB];
  for (int i = 0; i < MB; ++i) xr[i] = p.x + (m0 + i) * p.K;
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  const int64_t pairs = p.K / 2;
  for (int64_t kp = 0; kp < pairs; ++kp) {
    const uint16_t* wk = wg + kp * kGroup * 2;
    _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetch * kGroup * 2), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetch * kGroup * 2 + 32), _MM_HINT_T0);
    __m256 x0[MB], x1[MB];
    for (int i = 0; i < MB; ++i) {
      x0[i] = _mm256_broadcast_ss(xr[i] + 2 * kp);
      x1[i] = _mm256_broadcast_ss(xr[i] + 2 * kp + 1);
    }
    for (int j = 0; j < 4; ++j) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + 16 * j));
      const __m256 first = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
      const __m256 second = _mm256_castsi256_ps(_mm256_and_si256(raw, high));
      for (int i = 0; i < MB; ++i) {
        acc[i][j] = _mm256_fmadd_ps(first, x0[i], acc[i][j]);
        acc[i][j] = _mm256_fmadd_ps(second, x1[i], acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MB; ++i) {
    alignas(32) float out[kGroup];
    for (int j = 0; j < 4; ++j) _mm256_store_ps(out + 8 * j, acc[i][j]);
    c10::BFloat16* yr = p.y + (m0 + i) * p.N + o0;
    const int64_t valid = p.N - o0 < kGroup ? p.N - o0 : kGroup;
    for (int64_t r = 0; r < valid; ++r) {
      yr[r] = c10::BFloat16(p.bias ? out[r] + p.bias[o0 + r] : out[r]);
    }
  }
}

template <int... I>
constexpr std::array<caddtree_linear::Pass<float>, sizeof...(I)> passes(
    std::integer_sequence<int, I...>) {
  return {&group_rows<I + 1>...};
}

struct Kernel {
  using X = float;
  static at::Tensor input(const at::Tensor& rows) { return rows.to(at::kFloat).contiguous(); }
  static constexpr int kMaxRows = 2;  // rows per pass: 8 accumulators, 4 broadcasts, 2 weights
  static constexpr auto kPasses = passes(std::make_integer_sequence<int, kMaxRows>{});
};

}  // namespace

TORCH_LIBRARY_IMPL(caddtree, CPU, m) {
  m.impl("linear_bf16", &caddtree_linear::linear_op<Kernel>);
}

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
// times one row; here the widening is shared by the rows of a pass, the rest is FMAs. One or two
// rows take one pass over the whole group (group_rows: its 8 accumulators, the rows' 4 broadcast
// inputs and one widened weight pair fit the 16 registers; 3 rows, or all 4 vectors of a column
// pair widened at once, spilled to the stack and ran 1.3-1.4 times slower at 8-16 rows). More
// rows take passes of up to 5 rows over each half of the group (half_rows).
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
    caddtree_linear::write_outputs(p, m0 + i, o0, out, kGroup);
  }
}

// Rows m0 .. m0 + MB - 1 of the output, the 16 columns of vectors J0 and J0 + 1 of the group
// at o0 (half a group: one 64-byte line of every column pair). Each column pair is widened in
// two phases that read the weights again from cache (the load folds into the shift or the
// mask), so beside the 2 * MB accumulators only two widened vectors, one broadcast and the mask
// are live: a pass takes up to 5 rows without spilling, the widening is shared by 5 rows instead
// of 2, and 10 accumulator chains hide the FMA latency. Each output lane adds the same products
// in the same order as in group_rows.
//
// The accumulators are named variables, one pair per row (CADDTREE_ROWS expands a step for rows
// 0 .. 4, and rows past MB compile to nothing): GCC 12 kept an array of them in memory, storing
// every accumulator to the stack in every iteration, which made these passes no faster than
// group_rows'. 6 rows spill even so.
#define CADDTREE_ROWS(STEP) STEP(0) STEP(1) STEP(2) STEP(3) STEP(4)

template <int MB, int J0>
inline void half_rows(const Problem& p, const uint16_t* wg, int64_t m0, int64_t o0) {
  static_assert(MB >= 1 && MB <= 5, "a half-group pass takes 1 to 5 rows");
#define CADDTREE_DECLARE(i)                                                 \
  __m256 c##i##a = _mm256_setzero_ps(), c##i##b = _mm256_setzero_ps();     \
  const float* x##i = p.x + (m0 + (i < MB ? i : 0)) * p.K;
  CADDTREE_ROWS(CADDTREE_DECLARE)
#undef CADDTREE_DECLARE
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  const int64_t pairs = p.K / 2;
  // The first pass over this half also brings the same half of the next group into L2, a line
  // per column pair: its arithmetic then hides the next group's reads from memory, which a
  // pass from cache would otherwise wait for after this group's passes.
  const uint16_t* ahead = m0 == 0 && o0 + kGroup < p.N ? wg + p.K * kGroup + 16 * J0 : nullptr;
  for (int64_t kp = 0; kp < pairs; ++kp) {
    const uint16_t* wk = wg + kp * kGroup * 2 + 16 * J0;
    _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetch * kGroup * 2), _MM_HINT_T0);
    if (ahead) _mm_prefetch(reinterpret_cast<const char*>(ahead + kp * kGroup * 2), _MM_HINT_T1);
    const __m256i* w = reinterpret_cast<const __m256i*>(wk);
    __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(w), 16));
    __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(w + 1), 16));
#define CADDTREE_FMA(i, column)                                        \
  if constexpr (i < MB) {                                              \
    const __m256 v = _mm256_broadcast_ss(x##i + 2 * kp + column);      \
    c##i##a = _mm256_fmadd_ps(a, v, c##i##a);                          \
    c##i##b = _mm256_fmadd_ps(b, v, c##i##b);                          \
  }
#define CADDTREE_FIRST(i) CADDTREE_FMA(i, 0)
#define CADDTREE_SECOND(i) CADDTREE_FMA(i, 1)
    CADDTREE_ROWS(CADDTREE_FIRST)
    a = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(w), high));
    b = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(w + 1), high));
    CADDTREE_ROWS(CADDTREE_SECOND)
#undef CADDTREE_SECOND
#undef CADDTREE_FIRST
#undef CADDTREE_FMA
  }
  alignas(32) float out[16];
  auto store = [&](int64_t row, __m256 lo, __m256 hi) {
    _mm256_store_ps(out, lo);
    _mm256_store_ps(out + 8, hi);
    caddtree_linear::write_outputs(p, row, o0 + 8 * J0, out, 16);
  };
#define CADDTREE_STORE(i) \
  if constexpr (i < MB) store(m0 + i, c##i##a, c##i##b);
  CADDTREE_ROWS(CADDTREE_STORE)
#undef CADDTREE_STORE
}
#undef CADDTREE_ROWS

template <int MB>
struct Whole {
  static void run(const Problem& p, const uint16_t* wg, int64_t m0, int64_t o0) {
    group_rows<MB>(p, wg, m0, o0);
  }
};

template <int MB>
struct Low {
  static void run(const Problem& p, const uint16_t* wg, int64_t m0, int64_t o0) {
    half_rows<MB, 0>(p, wg, m0, o0);
  }
};

template <int MB>
struct High {
  static void run(const Problem& p, const uint16_t* wg, int64_t m0, int64_t o0) {
    half_rows<MB, 2>(p, wg, m0, o0);
  }
};

struct Kernel {
  using X = float;
  static at::Tensor input(const at::Tensor& rows) { return rows.to(at::kFloat).contiguous(); }
  // rows per pass over a whole group (8 accumulators, 4 broadcasts, 2 weights) and over half a
  // group (10 accumulators, 2 weights, 1 broadcast, the mask)
  static constexpr int kWholeRows = 2, kHalfRows = 5;
  static constexpr auto kWhole = caddtree_linear::pass_table<X, Whole>(
      std::make_integer_sequence<int, kWholeRows>{});
  static constexpr auto kLow = caddtree_linear::pass_table<X, Low>(
      std::make_integer_sequence<int, kHalfRows>{});
  static constexpr auto kHigh = caddtree_linear::pass_table<X, High>(
      std::make_integer_sequence<int, kHalfRows>{});
  // One or two rows are bound by reading the weights from memory: one pass over the whole
  // group reads each line once, in order. More rows are bound by arithmetic: each half of the
  // group takes its passes of up to 5 rows, its lines staying in cache between them.
  static void group(const Problem& p, const uint16_t* wg, int64_t M, int64_t o0) {
    if (M <= kWholeRows) {
      kWhole[M - 1](p, wg, 0, o0);
      return;
    }
    caddtree_linear::balanced_passes(kLow, p, wg, M, o0);
    caddtree_linear::balanced_passes(kHigh, p, wg, M, o0);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(caddtree, CPU, m) {
  m.impl("linear_bf16", &caddtree_linear::linear_op<Kernel>);
}

TORCH_LIBRARY_FRAGMENT(caddtree, m) {
  m.def("amx_in_use() -> bool", [] { return false; });  // AMX CPUs build the AVX512-BF16 variant
}

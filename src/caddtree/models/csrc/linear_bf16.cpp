// caddtree::linear_bf16: y = x @ w.T (+ bias) for bfloat16 on CPUs with AVX512-BF16.
//
// Decoding and tree verification multiply a few rows (1 to a few dozen) by every weight of the
// model, so they are bound by reading the weights once, and oneDNN's fixed cost per call (about
// 10 us, 120 calls a forward on the built-in target) is a large share of a forward. This kernel
// reads each weight once, in one sequential stream, with no per-call set-up beyond a parallel loop.
//
// Layout (made once by caddtree.models.kernels.pack_rows): the output rows come in groups of 32
// (the last one padded with zero rows; n says how many outputs are real), each group stored as
// [K/2][32][2]: for every pair of input columns, the pair of weights of each
// of the 32 rows. One 512-bit load then holds a column pair of 16 rows, and vdpbf16ps multiplies
// it by the broadcast column pair of an input row, accumulating one output per float32 lane: no
// horizontal sums. Input rows are taken up to 12 at a time, reusing each weight load.
//
// Every output accumulates its column pairs in order in one float32 lane, whatever the number of
// rows and however they are blocked or split across threads: a row's result is the same bits
// alone or among others, so plain decoding (one row) and tree verification (many) agree exactly.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "linear_op.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

namespace {

using caddtree_linear::kGroup;  // output rows per group (two 16-lane halves)
constexpr int64_t kPrefetch = 16; // column pairs ahead to prefetch

using Problem = caddtree_linear::Problem<c10::BFloat16>;

// Rows m0 .. m0 + MB - 1 of the output, columns o0 .. o0 + 31 (one weight group).
template <int MB>
inline void group_rows(const Problem& p, const uint16_t* wg, int64_t m0, int64_t o0) {
  __m512 acc[MB][2];
  for (int i = 0; i < MB; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  const uint32_t* xr[MB];
  for (int i = 0; i < MB; ++i) xr[i] = reinterpret_cast<const uint32_t*>(p.x + (m0 + i) * p.K);
  const int64_t pairs = p.K / 2;
  for (int64_t kp = 0; kp < pairs; ++kp) {
    const uint16_t* wk = wg + kp * kGroup * 2;
    _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetch * kGroup * 2), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetch * kGroup * 2 + 32), _MM_HINT_T0);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wk + 32);
    for (int i = 0; i < MB; ++i) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[i][kp]));
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], w0, xv);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], w1, xv);
    }
  }
  for (int i = 0; i < MB; ++i) {
    alignas(64) float out[kGroup];
    _mm512_store_ps(out, acc[i][0]);
    _mm512_store_ps(out + 16, acc[i][1]);
    caddtree_linear::write_outputs(p, m0 + i, o0, out, kGroup);
  }
}

template <int MB>
struct Rows {
  static void run(const Problem& p, const uint16_t* wg, int64_t m0, int64_t o0) {
    group_rows<MB>(p, wg, m0, o0);
  }
};

struct Kernel {
  using X = c10::BFloat16;
  static at::Tensor input(const at::Tensor& rows) { return rows.contiguous(); }
  static constexpr int kMaxRows = 12;  // input rows per pass over a group: 24 accumulators
  static constexpr auto kPasses = caddtree_linear::pass_table<X, Rows>(
      std::make_integer_sequence<int, kMaxRows>{});
  static void group(const Problem& p, const uint16_t* wg, int64_t M, int64_t o0) {
    caddtree_linear::balanced_passes(kPasses, p, wg, M, o0);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(caddtree, CPU, m) {
  m.impl("linear_bf16", &caddtree_linear::linear_op<Kernel>);
}

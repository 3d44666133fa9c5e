// caddtree::tree_attention: masked attention of a few query rows (a decoding step or a draft
// tree) over a bfloat16 key/value cache, on CPUs with AVX512-BF16.
//
// A tree verification attends n = 1..32 rows to a few hundred cached entries per layer: a few
// microseconds of arithmetic, which the flash kernel buries under its fixed cost per call. This
// kernel starts with no set-up but one parallel loop over (key/value head, row).
//
// Scores: each thread copies the first L keys of a key/value head once into a pair-major scratch
// ([L/16][D/2][16] dwords: for every block of 16 keys and every pair of dims, the pair of each of
// the 16 keys). One 512-bit load then holds a dim pair of 16 keys, and vdpbf16ps against the
// broadcast dim pair of a query accumulates 16 scores in float32 lanes (bf16 products are exact),
// with no horizontal sums; the copy serves the G query heads of the key/value head and every row.
// Softmax: the max over the row's allowed entries is subtracted before a float32 exp of our own
// (Cephes' polynomial, within 1 ulp of exp in float32; no Sleef). Values: float32 FMAs of each
// probability with the value row widened to float32 (even and odd dims in separate registers, two
// instructions per 32 dims), several queries per value row; the sums are divided by the sum of
// the probabilities and rounded to bfloat16 once.
//
// Every score lane sums its dim pairs in order, every output lane its entries in order, and the
// softmax of a (row, head) reads only its own scores, summing them by their rank among the
// allowed entries: a row's result is the same bits alone or among others, however rows are
// blocked or split across threads, and the same as over a cache holding only its allowed entries
// side by side (a tree row and the same token decoded plainly after its ancestors).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "attention_op.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kBlock = 16;        // keys per block: one float32 lane each
constexpr int64_t kMaxQueries = 16;   // (row, head) queries scored per pass (scores stay in L1)

using caddtree_attention::Problem;

struct Query {
  const uint32_t* q;     // D / 2 dim pairs
  float* s;              // scores, then probabilities (L rounded up to a block)
  const uint16_t* bits;  // allowed entries, one 16-bit mask per block
  c10::BFloat16* out;    // D outputs
  float sum;             // sum of the probabilities
};

// exp(x) in float32 lanes for finite x, within 2 ulp (Cephes expf: x = n ln2 + r, |r| <= ln2 / 2,
// n ln2 split in two so that n * 0.693359375 is exact); vscalefps multiplies by 2^n, giving 0 or
// infinity out of range with no clamps.
inline __m512 exp16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // exact: few bits
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
  return _mm512_scalef_ps(_mm512_add_ps(p, _mm512_set1_ps(1.0f)), n);  // * 2^n, 0 below range
}

// 16 x 16 dwords: r[i][j] becomes r[j][i].
[[gnu::always_inline]] inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + j], 128-bit lane l: element 4l + j of rows 4i .. 4i + 3
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    t[j] = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x88);
    t[4 + j] = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xdd);
    t[8 + j] = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x88);
    t[12 + j] = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xdd);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xdd);
    r[4 + j] = _mm512_shuffle_i32x4(t[4 + j], t[12 + j], 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(t[4 + j], t[12 + j], 0xdd);
  }
}

// One 16 x 16 dword tile of the pair-major copy: 16 keys from `src` (rows `stride` apart), their
// pairs to `dst` ([16][16] dwords). Partial tiles (Full = false) take `rows` keys and `w` pairs
// and write zeros past the keys.
template <bool Full>
inline void pack_tile(const uint16_t* src, int64_t stride, uint32_t* dst, int64_t rows = 16,
                      int64_t w = 16) {
  __m512i r[16];
  const __mmask16 cols = static_cast<__mmask16>((1u << w) - 1);
  for (int64_t i = 0; i < 16; ++i) {
    if constexpr (Full) r[i] = _mm512_loadu_si512(src + i * stride);
    else r[i] = i < rows ? _mm512_maskz_loadu_epi32(cols, src + i * stride) : _mm512_setzero_si512();
  }
  transpose16(r);
  for (int64_t j = 0; j < (Full ? 16 : w); ++j) _mm512_storeu_si512(dst + j * kBlock, r[j]);
}

// The first L keys of a head (rows `stride` apart) in the pair-major layout, zero past L.
void pack_keys(const uint16_t* keys, int64_t stride, int64_t L, int64_t pairs, uint32_t* out) {
  for (int64_t b = 0; b * kBlock < L; ++b) {
    const int64_t rows = std::min(kBlock, L - b * kBlock);
    for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
      const uint16_t* src = keys + b * kBlock * stride + 2 * p0;
      uint32_t* dst = out + (b * pairs + p0) * kBlock;
      if (rows == kBlock && p0 + 16 <= pairs) pack_tile<true>(src, stride, dst);
      else pack_tile<false>(src, stride, dst, rows, std::min<int64_t>(16, pairs - p0));
    }
  }
}

// Scores of QN queries over KB blocks from block b0: QN x KB independent float32 accumulators.
template <int QN, int KB>
inline void score_tile(const uint32_t* kt, int64_t pairs, Query* qs, int64_t b0, float scale) {
  __m512 acc[QN][KB];
  for (int i = 0; i < QN; ++i)
    for (int j = 0; j < KB; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint32_t* kb = kt + b0 * pairs * kBlock;
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh k[KB];
    for (int j = 0; j < KB; ++j)
      k[j] = (__m512bh)_mm512_loadu_si512(kb + (j * pairs + p) * kBlock);
    for (int i = 0; i < QN; ++i) {
      const __m512bh qv = (__m512bh)_mm512_set1_epi32(static_cast<int>(qs[i].q[p]));
      for (int j = 0; j < KB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], k[j], qv);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  #pragma GCC unroll 8  // unrolled, or gcc keeps acc in memory
  for (int i = 0; i < QN; ++i)
    #pragma GCC unroll 8
    for (int j = 0; j < KB; ++j)
      _mm512_storeu_ps(qs[i].s + (b0 + j) * kBlock, _mm512_mul_ps(acc[i][j], sc));
}

// Every block for QN queries: tiles of KB blocks, then one tile of each smaller size.
template <int QN, int KB>
inline void score_queries(const uint32_t* kt, int64_t pairs, int64_t b, int64_t blocks, Query* qs,
                          float scale) {
  for (; b + KB <= blocks; b += KB) score_tile<QN, KB>(kt, pairs, qs, b, scale);
  if constexpr (KB > 1) score_queries<QN, KB - 1>(kt, pairs, b, blocks, qs, scale);
}

// Scores into probabilities (unnormalized, zero where masked); returns their sum. The sum runs
// over the allowed entries packed together (`packed`: room for blocks + 1 blocks), 16 lanes by
// their rank among the allowed, not by their place in the cache: a tree row that skips the
// entries of other branches then sums exactly as the same token does in plain decoding, where its
// ancestors lie side by side.
inline float softmax(float* s, const uint16_t* bits, int64_t blocks, float* packed) {
  __m512 m = _mm512_set1_ps(-INFINITY);
  for (int64_t b = 0; b < blocks; ++b)
    m = _mm512_mask_max_ps(m, bits[b], m, _mm512_loadu_ps(s + b * kBlock));
  const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
  int64_t count = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    const __m512 e =
        _mm512_maskz_mov_ps(bits[b], exp16(_mm512_sub_ps(_mm512_loadu_ps(s + b * kBlock), mx)));
    _mm512_storeu_ps(s + b * kBlock, e);
    _mm512_mask_compressstoreu_ps(packed + count, bits[b], e);
    count += __builtin_popcount(bits[b]);
  }
  _mm512_storeu_ps(packed + count, _mm512_setzero_ps());
  __m512 sum = _mm512_setzero_ps();
  for (int64_t c = 0; c < count; c += kBlock) sum = _mm512_add_ps(sum, _mm512_loadu_ps(packed + c));
  return _mm512_reduce_add_ps(sum);
}

// Outputs of QN queries (NV vectors of 16 dims each): probabilities times value rows. A value row
// is widened 32 dims (16 dwords) at a time: shifting each dword left by 16 gives the even dims in
// float32, clearing its low half the odd ones; the lanes are put back in order once at the end.
template <int NV, int QN>
inline void value_tile(const uint16_t* v, int64_t stride, int64_t L, const Query* qs) {
  constexpr int C = (NV + 1) / 2;  // 32-dim chunks; with NV odd the last holds 16 dims
  constexpr __mmask16 last = NV % 2 ? 0x00ff : 0xffff;
  __m512 acc[QN][2 * C];
  for (int i = 0; i < QN; ++i)
    for (int j = 0; j < 2 * C; ++j) acc[i][j] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t e = 0; e < L; ++e) {
    __m512 vv[2 * C];
    for (int c = 0; c < C; ++c) {
      const __m512i raw = _mm512_maskz_loadu_epi32(c == C - 1 ? last : 0xffff, v + e * stride + 32 * c);
      vv[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
      vv[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(raw, high));
    }
    for (int i = 0; i < QN; ++i) {
      const __m512 w = _mm512_set1_ps(qs[i].s[e]);
      for (int j = 0; j < 2 * C; ++j) acc[i][j] = _mm512_fmadd_ps(w, vv[j], acc[i][j]);
    }
  }
  #pragma GCC unroll 8  // unrolled, or gcc keeps acc in memory
  for (int i = 0; i < QN; ++i) {
    const __m512 sum = _mm512_set1_ps(qs[i].sum);
    #pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m256bh even = _mm512_cvtneps_pbh(_mm512_div_ps(acc[i][2 * c], sum));
      const __m256bh odd = _mm512_cvtneps_pbh(_mm512_div_ps(acc[i][2 * c + 1], sum));
      const __m512i pairs = _mm512_or_si512(_mm512_cvtepu16_epi32((__m256i)even),
                                            _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)odd), 16));
      _mm512_mask_storeu_epi32(qs[i].out + 32 * c, c == C - 1 ? last : 0xffff, pairs);
    }
  }
}

template <int NV, int QN>
inline void value_queries(const uint16_t* v, int64_t stride, int64_t L, const Query* qs, int64_t nq) {
  int64_t i = 0;
  for (; i + QN <= nq; i += QN) value_tile<NV, QN>(v, stride, L, qs + i);
  if constexpr (QN > 1) value_queries<NV, QN - 1>(v, stride, L, qs + i, nq - i);
}

// Allowed entries of a mask row, 16 per block (none past L).
void mask_bits(const Problem& p, int64_t row, int64_t blocks, uint16_t* bits) {
  const uint8_t* m = p.mask + row * p.m_row;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t e0 = b * kBlock, w = std::min(kBlock, p.L - e0);
    if (p.m_col == 1 && w == kBlock) {
      const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(m + e0));
      bits[b] = _mm_test_epi8_mask(x, x);
    } else {
      uint32_t x = 0;
      for (int64_t j = 0; j < w; ++j) x |= (m[(e0 + j) * p.m_col] != 0 ? 1u : 0u) << j;
      bits[b] = static_cast<uint16_t>(x);
    }
  }
}

// Items begin .. end - 1 of the (key/value head, row) grid, head-major.
template <int NV>
void run_items(const Problem& p, int64_t begin, int64_t end) {
  // Queries per value tile: as many accumulators as the 32 registers hold beside a value row.
  constexpr int C = (NV + 1) / 2, QV = std::max(1, std::min(8, (30 - 2 * C) / (2 * C)));
  const int64_t blocks = (p.L + kBlock - 1) / kBlock, pairs = p.D / 2;
  const int64_t rows_per_pass = std::max<int64_t>(1, kMaxQueries / p.G);
  thread_local std::vector<uint32_t> keys;
  thread_local std::vector<float> scores;
  thread_local std::vector<uint16_t> bits;
  thread_local std::vector<Query> qs;
  thread_local std::vector<float> packed;
  packed.resize(std::max<size_t>(packed.size(), (blocks + 1) * kBlock));
  keys.resize(std::max<size_t>(keys.size(), blocks * pairs * kBlock));
  scores.resize(std::max<size_t>(scores.size(), rows_per_pass * p.G * blocks * kBlock));
  bits.resize(std::max<size_t>(bits.size(), rows_per_pass * blocks));
  qs.resize(std::max<size_t>(qs.size(), rows_per_pass * p.G));
  for (int64_t item = begin; item < end;) {
    const int64_t c = item / p.n, r_begin = item % p.n;
    const int64_t r_end = std::min(p.n, r_begin + (end - item));
    pack_keys(p.k + c * p.k_head, p.k_row, p.L, pairs, keys.data());
    for (int64_t r0 = r_begin; r0 < r_end; r0 += rows_per_pass) {
      const int64_t rows = std::min(rows_per_pass, r_end - r0), nq = rows * p.G;
      for (int64_t r = 0; r < rows; ++r) {
        mask_bits(p, r0 + r, blocks, bits.data() + r * blocks);
        for (int64_t g = 0; g < p.G; ++g) {
          const int64_t i = r * p.G + g, offset = ((r0 + r) * p.H + c * p.G + g) * p.D;
          qs[i] = Query{reinterpret_cast<const uint32_t*>(p.q + offset),
                        scores.data() + i * blocks * kBlock, bits.data() + r * blocks,
                        p.out + offset, 0.0f};
        }
      }
      int64_t i = 0;  // 24 accumulators per tile where there are enough blocks
      for (; i + 4 <= nq; i += 4) score_queries<4, 6>(keys.data(), pairs, 0, blocks, &qs[i], p.scale);
      switch (nq - i) {
        case 3: score_queries<3, 8>(keys.data(), pairs, 0, blocks, &qs[i], p.scale); break;
        case 2: score_queries<2, 8>(keys.data(), pairs, 0, blocks, &qs[i], p.scale); break;
        case 1: score_queries<1, 8>(keys.data(), pairs, 0, blocks, &qs[i], p.scale); break;
      }
      for (int64_t j = 0; j < nq; ++j) qs[j].sum = softmax(qs[j].s, qs[j].bits, blocks, packed.data());
      value_queries<NV, QV>(p.v + c * p.v_head, p.v_row, p.L, qs.data(), nq);
    }
    item += r_end - r_begin;
  }
}

using Items = void (*)(const Problem&, int64_t, int64_t);
template <int... I>
constexpr std::array<Items, sizeof...(I)> items_table(std::integer_sequence<int, I...>) {
  return {&run_items<I + 1>...};
}
constexpr auto kItems = items_table(std::make_integer_sequence<int, 16>{});  // D = 16 .. 256

struct Kernel {
  static void run(const Problem& p, int64_t begin, int64_t end) { kItems[p.D / 16 - 1](p, begin, end); }
};

}  // namespace

TORCH_LIBRARY_IMPL(caddtree, CPU, m) {
  m.impl("tree_attention", &caddtree_attention::attention_op<Kernel>);
  m.impl("tree_attention_batch", &caddtree_attention::batch_attention_op<Kernel>);
}

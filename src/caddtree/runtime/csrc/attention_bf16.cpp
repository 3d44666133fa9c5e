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

#include "amx.h"
#include "attention_op.h"
#include "attention_steps.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kBlock = 16;        // keys per block: one float32 lane each
constexpr int64_t kMaxQueries = 16;   // (row, head) queries scored per pass (scores stay in L1)

using caddtree_attention::Expf;
using caddtree_attention::Problem;
using caddtree_attention::score_queries;

struct Query {
  const uint32_t* q;     // D / 2 dim pairs
  float* s;              // scores, then probabilities (L rounded up to a block)
  const uint16_t* bits;  // allowed entries, one 16-bit mask per block
  c10::BFloat16* out;    // D outputs
  float sum;             // sum of the probabilities
};

// 16 float32 lanes, for the shared steps (attention_steps.h).
struct V16 {
  using reg = __m512;
  static reg set1(float a) { return _mm512_set1_ps(a); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static reg fmadd(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static reg fnmadd(reg a, reg b, reg c) { return _mm512_fnmadd_ps(a, b, c); }
};

// exp(x) in float32 lanes for finite x, within 2 ulp (Expf of attention_steps.h); vscalefps
// multiplies by 2^n, giving 0 or infinity out of range with no clamps.
inline __m512 exp16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(Expf::kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 p = Expf::one_plus_poly<V16>(Expf::reduce<V16>(x, n));
  return _mm512_scalef_ps(p, n);  // * 2^n, 0 below range
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

struct Scores {
  template <int QN, int KB>
  static void tile(const uint32_t* kt, int64_t pairs, Query* qs, int64_t b0, float scale) {
    score_tile<QN, KB>(kt, pairs, qs, b0, scale);
  }
};

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
      for (; i + 4 <= nq; i += 4) score_queries<Scores, 4, 6>(keys.data(), pairs, 0, blocks, &qs[i], p.scale);
      switch (nq - i) {
        case 3: score_queries<Scores, 3, 8>(keys.data(), pairs, 0, blocks, &qs[i], p.scale); break;
        case 2: score_queries<Scores, 2, 8>(keys.data(), pairs, 0, blocks, &qs[i], p.scale); break;
        case 1: score_queries<Scores, 1, 8>(keys.data(), pairs, 0, blocks, &qs[i], p.scale); break;
      }
      for (int64_t j = 0; j < nq; ++j) qs[j].sum = softmax(qs[j].s, qs[j].bits, blocks, packed.data());
      value_queries<NV, QV>(p.v + c * p.v_head, p.v_row, p.L, qs.data(), nq);
    }
    item += r_end - r_begin;
  }
}

// ---- AMX ----------------------------------------------------------------------------------------
// On CPUs with AMX-BF16 every call, one row or many, runs on the tile unit instead (head dims a
// multiple of 32, at most 16 queries of a key/value head per group):
//
// Scores: a tile product takes 16 cached keys as they lie in the cache (A: 16 entries x 32 dims)
// against the group's queries (B: 16 dim pairs x 16 queries), two products per 64 dims; the 16 x 16
// block is transposed into each query's scores. The tile unit computes each score from its key and
// query alone, in the same order of 32-dim chunks, so a score has the same bits wherever its entry
// and row lie. Softmax: as above (float32 exp, a sum by rank among the allowed entries).
// Values: the probabilities are rounded to bfloat16 (as flash attention does on GPUs) and
// multiplied by the value rows 32 entries at a time (A: 16 queries x 32 entries, B: 16 entry pairs
// x 16 dims). The tile unit rounds each such chunk's sum in its own way, so for a row to get the
// same bits alone, in a tree, or in plain decoding after its ancestors, every row sums its allowed
// entries in chunks of 32 by their rank among them (its logical positions), not by their place in
// the cache: the leading chunks that every row of a group allows whole are shared tile products
// over the cache as it lies; each row's remaining entries (the end of the prefix, its ancestors
// and itself) are gathered side by side and added in chunks of 32 from where the shared ones end,
// zero-padded. Both ways give a chunk the same inputs, so the same sums.

constexpr int64_t kAmxQueries = 16;  // queries per group: the rows of a tile
constexpr int64_t kDims = 16;        // dims of a value tile's columns

// Query dword pairs of a group as B tiles: [D / 32][16 pairs][16 queries], zero past nq.
void query_tiles(const Query* qs, int64_t nq, int64_t chunks, uint32_t* bq) {
  for (int64_t kc = 0; kc < chunks; ++kc) {
    __m512i r[16];
    for (int64_t i = 0; i < 16; ++i)
      r[i] = i < nq ? _mm512_loadu_si512(qs[i].q + kc * 16) : _mm512_setzero_si512();
    transpose16(r);
    for (int64_t k = 0; k < 16; ++k) _mm512_storeu_si512(bq + (kc * 16 + k) * kAmxQueries, r[k]);
  }
}

// Every block's scores of a group's queries (scaled, into each query's row of scores); two blocks
// at a time (C tiles 0 and 1), the query tiles loaded once where they fit (D <= 64).
[[gnu::target("amx-tile,amx-bf16")]] void amx_scores(const Problem& p, const uint16_t* keys,
                                                     const uint32_t* bq, Query* qs, int64_t nq,
                                                     uint16_t* edge) {
  const int64_t blocks = (p.L + kBlock - 1) / kBlock, chunks = p.D / 32;
  const bool resident = chunks <= 2;
  alignas(64) float tile[2][kBlock][kAmxQueries];
  const __m512 sc = _mm512_set1_ps(p.scale);
  if (resident) {
    _tile_loadd(6, bq, 64);
    if (chunks > 1) _tile_loadd(7, bq + 16 * kAmxQueries, 64);
  }
  for (int64_t b = 0; b < blocks; b += 2) {
    const bool two = b + 1 < blocks;
    const uint16_t* a[2] = {nullptr, nullptr};
    int64_t stride[2] = {0, 0};
    for (int64_t h = 0; h < (two ? 2 : 1); ++h) {
      const int64_t first = (b + h) * kBlock, rows = std::min(kBlock, p.L - first);
      a[h] = keys + first * p.k_row;
      stride[h] = p.k_row * 2;
      if (rows < kBlock) {  // the last block: its keys side by side, zeros after (never past the cache)
        uint16_t* dst = edge + h * kBlock * p.D;
        for (int64_t e = 0; e < kBlock; ++e)
          for (int64_t d = 0; d < p.D; ++d) dst[e * p.D + d] = e < rows ? a[h][e * p.k_row + d] : 0;
        a[h] = dst;
        stride[h] = p.D * 2;
      }
    }
    _tile_zero(0);
    if (two) _tile_zero(1);
    for (int64_t kc = 0; kc < chunks; ++kc) {
      if (!resident) _tile_loadd(6, bq + kc * 16 * kAmxQueries, 64);
      _tile_loadd(4, a[0] + kc * 32, stride[0]);
      if (two) _tile_loadd(5, a[1] + kc * 32, stride[1]);
      if (kc == 1 && resident) {
        _tile_dpbf16ps(0, 4, 7);
        if (two) _tile_dpbf16ps(1, 5, 7);
      } else {
        _tile_dpbf16ps(0, 4, 6);
        if (two) _tile_dpbf16ps(1, 5, 6);
      }
    }
    _tile_stored(0, tile[0], 64);
    if (two) _tile_stored(1, tile[1], 64);
    for (int64_t h = 0; h < (two ? 2 : 1); ++h) {
      __m512i r[16];
      for (int e = 0; e < 16; ++e) r[e] = _mm512_load_si512(tile[h][e]);
      transpose16(r);
      for (int64_t i = 0; i < nq; ++i)
        _mm512_storeu_ps(qs[i].s + (b + h) * kBlock, _mm512_mul_ps(_mm512_castsi512_ps(r[i]), sc));
    }
  }
}

// Value pairs of entries e0, e1 (nullptr: zeros) as one B row per 16 dims: [D / 16][16] dwords,
// rows 64 bytes apart in `dst` (a tile of 16 rows per 16 dims: tiles `tile_stride` dwords apart).
inline void value_pairs(const uint16_t* e0, const uint16_t* e1, int64_t D, uint32_t* dst,
                        int64_t tile_stride) {
  for (int64_t j = 0; j < D / kDims; ++j) {
    const __m512i lo = e0 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(e0 + j * kDims)))
                          : _mm512_setzero_si512();
    const __m512i hi = e1 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(e1 + j * kDims)))
                          : _mm512_setzero_si512();
    _mm512_storeu_si512(dst + j * tile_stride, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
  }
}

// 32 probabilities (float32, `src`) as two A rows of bfloat16, `hi` and `lo` = the rest, so that
// hi + lo holds 16 of their 24 bits (two tile products then cost next to nothing in accuracy).
inline void probability_rows(const float* src, uint16_t* hi, uint16_t* lo) {
  const __m512 a = _mm512_loadu_ps(src), b = _mm512_loadu_ps(src + 16);
  const __m512bh h = _mm512_cvtne2ps_pbh(b, a);
  const __m512i wide = (__m512i)h;  // back to float32: a bfloat16 is the high half of a float
  const __m512 ha = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(wide)), 16));
  const __m512 hb = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(wide, 1)), 16));
  _mm512_storeu_si512(hi, wide);
  _mm512_storeu_si512(lo, (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(b, hb), _mm512_sub_ps(a, ha)));
}

// acc [16][D] += (A_hi + A_lo) [16][32] x B per chunk (A: [chunks][2][16][32] bfloat16; B: D / 16
// tiles of [16][16] dwords, `tile_stride` dwords apart), four value tiles at a time; acc is loaded
// and stored around the products (rows D floats apart). Each tile adds hi's product, then lo's.
[[gnu::target("amx-tile,amx-bf16")]] inline void value_chunks(const uint16_t* a, const uint32_t* b,
                                                             int64_t b_step, int64_t chunks,
                                                             int64_t D, int64_t tile_stride,
                                                             float* acc) {
  constexpr int64_t a_half = kAmxQueries * 32;
  for (int64_t j0 = 0; j0 < D / kDims; j0 += 4) {
    const int64_t nj = std::min<int64_t>(4, D / kDims - j0);
    float* c = acc + j0 * kDims;
    _tile_loadd(0, c, D * 4);
    if (nj > 1) _tile_loadd(1, c + kDims, D * 4);
    if (nj > 2) _tile_loadd(2, c + 2 * kDims, D * 4);
    if (nj > 3) _tile_loadd(3, c + 3 * kDims, D * 4);
    for (int64_t ch = 0; ch < chunks; ++ch) {
      const uint16_t* ac = a + ch * 2 * a_half;
      const uint32_t* bc = b + ch * b_step + j0 * tile_stride;
      _tile_loadd(4, ac, 64);  // hi
      _tile_loadd(5, bc, 64);
      _tile_dpbf16ps(0, 4, 5);
      if (nj > 1) { _tile_loadd(6, bc + tile_stride, 64); _tile_dpbf16ps(1, 4, 6); }
      if (nj > 2) { _tile_loadd(7, bc + 2 * tile_stride, 64); _tile_dpbf16ps(2, 4, 7); }
      if (nj > 3) { _tile_loadd(5, bc + 3 * tile_stride, 64); _tile_dpbf16ps(3, 4, 5); }
      _tile_loadd(4, ac + a_half, 64);  // lo, against the value tiles still loaded
      if (nj > 3) _tile_dpbf16ps(3, 4, 5);
      if (nj > 2) _tile_dpbf16ps(2, 4, 7);
      if (nj > 1) _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(5, bc, 64);
      _tile_dpbf16ps(0, 4, 5);
    }
    _tile_stored(0, c, D * 4);
    if (nj > 1) _tile_stored(1, c + kDims, D * 4);
    if (nj > 2) _tile_stored(2, c + 2 * kDims, D * 4);
    if (nj > 3) _tile_stored(3, c + 3 * kDims, D * 4);
  }
}

// Entries every row of the group allows from the start, in whole chunks of 32.
int64_t shared_entries(const uint16_t* bits, int64_t rows, int64_t blocks, int64_t L) {
  int64_t lead = L;
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* rb = bits + r * blocks;
    int64_t b = 0;
    while (b < blocks && b * kBlock < lead && rb[b] == 0xffff) ++b;
    const int64_t here = b < blocks ? b * kBlock + __builtin_ctz(~static_cast<uint32_t>(rb[b])) : L;
    lead = std::min(lead, here);
  }
  return std::min(lead, L) / 32 * 32;
}

struct AmxScratch {
  std::vector<uint32_t> bq, vt, tail_b;
  std::vector<uint16_t> edge, ap, tail_a;
  std::vector<float> acc, tail_acc, packed;
  std::vector<int64_t> entries;
};

// The group's outputs: shared chunks over the cache, then each row's own entries.
[[gnu::target("amx-tile,amx-bf16")]] void amx_values(const Problem& p, const uint16_t* values,
                                                     const uint16_t* bits, Query* qs, int64_t rows,
                                                     int64_t shared, int64_t& built,
                                                     AmxScratch& w) {
  const int64_t D = p.D, blocks = (p.L + kBlock - 1) / kBlock, nq = rows * p.G;
  const int64_t tile_stride = 16 * kDims, chunk_b = (D / kDims) * tile_stride;
  for (; built < shared / 32; ++built)  // value pairs of the head's chunks, built once per head
    for (int64_t k = 0; k < 16; ++k) {
      const int64_t e = built * 32 + 2 * k;
      value_pairs(values + e * p.v_row, values + (e + 1) * p.v_row, D,
                  w.vt.data() + built * chunk_b + k * kDims, tile_stride);
    }
  std::fill(w.acc.begin(), w.acc.begin() + kAmxQueries * D, 0.0f);
  const int64_t chunks = shared / 32;
  for (int64_t ch = 0; ch < chunks; ++ch)
    for (int64_t i = 0; i < kAmxQueries; ++i) {
      uint16_t* hi = w.ap.data() + (2 * ch * kAmxQueries + i) * 32;
      uint16_t* lo = hi + kAmxQueries * 32;
      if (i < nq) probability_rows(qs[i].s + ch * 32, hi, lo);
      else std::fill(hi, hi + 32, 0), std::fill(lo, lo + 32, 0);
    }
  value_chunks(w.ap.data(), w.vt.data(), chunk_b, chunks, D, tile_stride, w.acc.data());
  // The tail tiles' rows past G are never read: a tile product's C[m][n] depends on C[m][n], row m
  // of A and column n of B alone, so whatever those rows hold cannot reach the rows below G.
  for (int64_t r = 0; r < rows; ++r) {  // the row's own entries from `shared` on
    const uint16_t* rb = bits + r * blocks;
    w.entries.clear();
    for (int64_t b = shared / kBlock; b < blocks; ++b)
      for (uint32_t m = rb[b]; m != 0; m &= m - 1) w.entries.push_back(b * kBlock + __builtin_ctz(m));
    const int64_t n = static_cast<int64_t>(w.entries.size()), tails = (n + 31) / 32;
    std::copy_n(w.acc.data() + r * p.G * D, p.G * D, w.tail_acc.data());
    alignas(64) float prob[32];
    for (int64_t t = 0; t < tails; ++t) {
      for (int64_t g = 0; g < p.G; ++g) {
        uint16_t* hi = w.tail_a.data() + (2 * t * kAmxQueries + g) * 32;
        for (int64_t x = 0; x < 32; ++x) {
          const int64_t i = t * 32 + x;
          prob[x] = i < n ? qs[r * p.G + g].s[w.entries[i]] : 0.0f;
        }
        probability_rows(prob, hi, hi + kAmxQueries * 32);
      }
      for (int64_t k = 0; k < 16; ++k) {
        const int64_t i = t * 32 + 2 * k;
        value_pairs(i < n ? values + w.entries[i] * p.v_row : nullptr,
                    i + 1 < n ? values + w.entries[i + 1] * p.v_row : nullptr, D,
                    w.tail_b.data() + t * chunk_b + k * kDims, tile_stride);
      }
    }
    value_chunks(w.tail_a.data(), w.tail_b.data(), chunk_b, tails, D, tile_stride,
                 w.tail_acc.data());
    for (int64_t g = 0; g < p.G; ++g) {
      const Query& qr = qs[r * p.G + g];
      const __m512 sum = _mm512_set1_ps(qr.sum);
      for (int64_t j = 0; j < D / kDims; ++j) {
        const __m512 o = _mm512_div_ps(_mm512_loadu_ps(w.tail_acc.data() + g * D + j * kDims), sum);
        _mm256_storeu_si256((__m256i*)(qr.out + j * kDims), (__m256i)_mm512_cvtneps_pbh(o));
      }
    }
  }
}

// Items begin .. end - 1 of the (key/value head, row) grid on the tile unit.
[[gnu::target("amx-tile,amx-bf16")]] void amx_items(const Problem& p, int64_t begin, int64_t end) {
  const int64_t blocks = (p.L + kBlock - 1) / kBlock, D = p.D;
  const int64_t rows_per_group = kAmxQueries / p.G, max_chunks = (p.L + 31) / 32 + 1;
  thread_local AmxScratch w;
  thread_local std::vector<float> scores;
  thread_local std::vector<uint16_t> bits;
  thread_local std::vector<Query> qs;
  auto grow = [](auto& v, size_t n) { if (v.size() < n) v.resize(n); };
  grow(w.bq, D / 32 * 16 * kAmxQueries);
  grow(w.vt, max_chunks * (D / kDims) * 16 * kDims);
  grow(w.tail_b, max_chunks * (D / kDims) * 16 * kDims);
  grow(w.ap, max_chunks * 2 * kAmxQueries * 32);
  grow(w.tail_a, max_chunks * 2 * kAmxQueries * 32);
  grow(w.edge, 2 * kBlock * D);
  grow(w.acc, kAmxQueries * D);
  grow(w.tail_acc, kAmxQueries * D);
  grow(w.packed, (blocks + 1) * kBlock);
  grow(scores, kAmxQueries * blocks * kBlock);
  grow(bits, rows_per_group * blocks);
  grow(qs, kAmxQueries);
  caddtree_amx::load_tile_config();
  for (int64_t item = begin; item < end;) {
    const int64_t c = item / p.n, r_begin = item % p.n;
    const int64_t r_end = std::min(p.n, r_begin + (end - item));
    int64_t built = 0;  // chunks of this head's value pairs in w.vt
    for (int64_t r0 = r_begin; r0 < r_end; r0 += rows_per_group) {
      const int64_t rows = std::min(rows_per_group, r_end - r0), nq = rows * p.G;
      for (int64_t r = 0; r < rows; ++r) {
        mask_bits(p, r0 + r, blocks, bits.data() + r * blocks);
        for (int64_t g = 0; g < p.G; ++g) {
          const int64_t i = r * p.G + g, offset = ((r0 + r) * p.H + c * p.G + g) * D;
          qs[i] = Query{reinterpret_cast<const uint32_t*>(p.q + offset),
                        scores.data() + i * blocks * kBlock, bits.data() + r * blocks,
                        p.out + offset, 0.0f};
        }
      }
      query_tiles(qs.data(), nq, D / 32, w.bq.data());
      amx_scores(p, p.k + c * p.k_head, w.bq.data(), qs.data(), nq, w.edge.data());
      for (int64_t j = 0; j < nq; ++j) qs[j].sum = softmax(qs[j].s, qs[j].bits, blocks, w.packed.data());
      const int64_t shared = shared_entries(bits.data(), rows, blocks, p.L);
      amx_values(p, p.v + c * p.v_head, bits.data(), qs.data(), rows, shared, built, w);
    }
    item += r_end - r_begin;
  }
  _tile_release();
}

// The tile unit takes head dims that are multiples of 32 and groups of at most 16 query heads.
inline bool amx_takes(const Problem& p) {
  return p.D % 32 == 0 && p.G <= kAmxQueries && caddtree_amx::amx_allowed();
}

using Items = void (*)(const Problem&, int64_t, int64_t);
template <int... I>
constexpr std::array<Items, sizeof...(I)> items_table(std::integer_sequence<int, I...>) {
  return {&run_items<I + 1>...};
}
constexpr auto kItems = items_table(std::make_integer_sequence<int, 16>{});  // D = 16 .. 256

struct Kernel {
  static void run(const Problem& p, int64_t begin, int64_t end) {
    if (amx_takes(p)) amx_items(p, begin, end);
    else kItems[p.D / 16 - 1](p, begin, end);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(caddtree, CPU, m) {
  m.impl("tree_attention", &caddtree_attention::attention_op<Kernel>);
  m.impl("tree_attention_batch", &caddtree_attention::batch_attention_op<Kernel>);
}

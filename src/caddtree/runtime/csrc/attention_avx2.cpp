// caddtree::tree_attention: masked attention of a few query rows (a decoding step or a draft
// tree) over a bfloat16 key/value cache, on CPUs with AVX2, FMA and F16C but no AVX512-BF16 (the
// same op, checks and messages as attention_bf16.cpp, which such CPUs cannot run).
//
// A tree verification attends n = 1..32 rows to a few hundred cached entries per layer: a few
// microseconds of arithmetic, which the flash kernel buries under its fixed cost per call. This
// kernel starts with no set-up but one parallel loop over (key/value head, row).
//
// Scores: each thread copies the first L keys of a key/value head once into a pair-major scratch
// ([L/8][D/2][8] dwords: for every block of 8 keys and every pair of dims, the pair of each of the
// 8 keys), by 8 x 8 dword transposes. One 256-bit load then holds a dim pair of 8 keys; shifting
// each dword left by 16 gives the even dim in float32, clearing its low half the odd one, and two
// FMAs against the broadcast (float32) dims of a query accumulate 8 scores in float32 lanes (bf16
// products are exact), dim after dim, with no horizontal sums; the copy serves the G query heads
// of the key/value head and every row, several queries and blocks per tile.
// Softmax: a row's allowed entries are listed once (their places, by rank), and each query's
// scores of them packed side by side (a permute per block of 8, from a table of the 256 masks);
// the max is subtracted before a float32 exp of our own (Cephes' polynomial, within 2 ulp of exp
// in float32, 0 below 2^-126; no Sleef), and the probabilities are summed in 8 float32 lanes over
// the packed buffer, then across the lanes in a fixed order. Values: for the allowed entries only,
// in rank order, float32 FMAs of each probability with the value row widened to float32 (8 dims
// zero-extended to dwords and shifted left by 16), the G queries of a row sharing each value row;
// the sums are divided by the sum of the probabilities and rounded to bfloat16 once (to nearest
// even, as c10::BFloat16).
//
// Every score lane sums its dims in order and reads nothing of other entries or queries. The
// softmax and the outputs of a (row, head) read only its own scores, and only those of the allowed
// entries, by their rank among them: the max, the exps, the sum (its lanes fixed by rank) and the
// output sums (FMAs in rank order, masked entries skipped, not weighted by zero: a masked entry's
// inf or NaN value, or a -0 from 0 * value, never reaches them) are the same operations in the
// same order whichever entries lie between the allowed ones. A row's result is
// thus the same bits alone or among others, however rows are blocked or split across threads,
// and the same as over a cache holding only its allowed entries side by side (a tree row and the
// same token decoded plainly after its ancestors).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "attention_op.h"
#include "attention_steps.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kBlock = 8;         // keys per block: one float32 lane each
constexpr int64_t kMaxQueries = 16;   // (row, head) queries scored per pass (scores stay in L1)

using caddtree_attention::Expf;
using caddtree_attention::Problem;
using caddtree_attention::score_queries;

struct Query {
  const float* q;        // D dims, widened to float32
  float* s;              // scores (L rounded up to a block)
  float* p;              // scores of the allowed entries by rank, then their probabilities
  c10::BFloat16* out;    // D outputs
  float sum;             // sum of the probabilities
};

struct Row {
  const uint8_t* bits;   // allowed entries, one 8-bit mask per block
  const int32_t* index;  // places of the allowed entries, by rank
  int64_t count;         // how many are allowed
};

// For each 8-bit mask, the lanes it sets in order (then zeros): the permute that packs them.
struct PackTable {
  alignas(32) int32_t lanes[256][8];
  constexpr PackTable() : lanes() {
    for (int m = 0; m < 256; ++m) {
      int c = 0;
      for (int j = 0; j < 8; ++j)
        if (m >> j & 1) lanes[m][c++] = j;
      for (; c < 8; ++c) lanes[m][c] = 0;
    }
  }
};
constexpr PackTable kPack{};

inline __m256i pack_perm(unsigned bits) {
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(kPack.lanes[bits]));
}

// 8 float32 lanes, for the shared steps (attention_steps.h).
struct V8 {
  using reg = __m256;
  static reg set1(float a) { return _mm256_set1_ps(a); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static reg fmadd(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static reg fnmadd(reg a, reg b, reg c) { return _mm256_fnmadd_ps(a, b, c); }
};

// exp(x) in float32 lanes for x <= 0, within 2 ulp (Expf of attention_steps.h), times 2^n built in
// the exponent field; 0 where exp(x) < 2^-126 (x = -inf included), NaN kept.
inline __m256 exp8(__m256 x) {
  const __m256 lowest = _mm256_set1_ps(-87.3365447506f);  // ln 2^-126
  const __m256 under = _mm256_cmp_ps(x, lowest, _CMP_LT_OQ);
  x = _mm256_max_ps(lowest, x);  // NaN stays NaN (max_ps returns its second operand)
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(Expf::kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 p = Expf::one_plus_poly<V8>(Expf::reduce<V8>(x, n));
  // n in -126 .. 0: 2^n is a normal float32 with biased exponent n + 127
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

inline float hsum8(__m256 v) {  // fixed order: halves, then pairs, then the last two
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// float32 lanes to bfloat16 bits (in the low half of each dword), to nearest even, NaN as 0x7fc0
// (c10::BFloat16's rounding).
inline __m256i to_bf16(__m256 x) {
  const __m256i b = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
}

// 8 x 8 dwords: r[i][j] becomes r[j][i].
[[gnu::always_inline]] inline void transpose8(__m256i r[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // u[4h + j], 128-bit lane l: element 4l + j of rows 4h .. 4h + 3
    u[4 * h] = _mm256_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
    u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
    u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
    u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x20);
    r[4 + j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x31);
  }
}

// The first L keys of a head (rows `stride` apart) in the pair-major layout, zero past L. D / 2
// pairs is a multiple of 8: only the last block can be partial.
void pack_keys(const uint16_t* keys, int64_t stride, int64_t L, int64_t pairs, uint32_t* out) {
  for (int64_t b = 0; b * kBlock < L; ++b) {
    const int64_t rows = std::min(kBlock, L - b * kBlock);
    for (int64_t p0 = 0; p0 < pairs; p0 += 8) {
      const uint16_t* src = keys + b * kBlock * stride + 2 * p0;
      __m256i r[8];
      for (int64_t i = 0; i < 8; ++i)
        r[i] = i < rows ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i * stride))
                        : _mm256_setzero_si256();
      transpose8(r);
      uint32_t* dst = out + (b * pairs + p0) * kBlock;
      for (int64_t j = 0; j < 8; ++j)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j * kBlock), r[j]);
    }
  }
}

// Scores of QN queries over KB blocks from block b0: QN x KB independent float32 accumulators,
// each lane summing its key's dims in order. Not inlined: inside the caller, gcc keeps the
// caller's constants in registers and spills accumulators instead.
template <int QN, int KB>
[[gnu::noinline]] void score_tile(const uint32_t* kt, int64_t pairs, Query* qs, int64_t b0, float scale) {
  __m256 acc[QN][KB];
  for (int i = 0; i < QN; ++i)
    for (int j = 0; j < KB; ++j) acc[i][j] = _mm256_setzero_ps();
  const uint32_t* kb = kt + b0 * pairs * kBlock;
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t p = 0; p < pairs; ++p) {
    __m256 even[KB], odd[KB];
    for (int j = 0; j < KB; ++j) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kb + (j * pairs + p) * kBlock));
      even[j] = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
      odd[j] = _mm256_castsi256_ps(_mm256_and_si256(raw, high));
    }
    for (int i = 0; i < QN; ++i) {
      const __m256 qe = _mm256_broadcast_ss(qs[i].q + 2 * p);
      for (int j = 0; j < KB; ++j) acc[i][j] = _mm256_fmadd_ps(qe, even[j], acc[i][j]);
      const __m256 qo = _mm256_broadcast_ss(qs[i].q + 2 * p + 1);
      for (int j = 0; j < KB; ++j) acc[i][j] = _mm256_fmadd_ps(qo, odd[j], acc[i][j]);
    }
  }
  const __m256 sc = _mm256_set1_ps(scale);
  #pragma GCC unroll 8  // unrolled, or gcc keeps acc in memory
  for (int i = 0; i < QN; ++i)
    #pragma GCC unroll 8
    for (int j = 0; j < KB; ++j)
      _mm256_storeu_ps(qs[i].s + (b0 + j) * kBlock, _mm256_mul_ps(acc[i][j], sc));
}

struct Scores {
  template <int QN, int KB>
  static void tile(const uint32_t* kt, int64_t pairs, Query* qs, int64_t b0, float scale) {
    score_tile<QN, KB>(kt, pairs, qs, b0, scale);
  }
};

// The allowed entries of a mask row: 8 per block (none past L) and their places by rank
// (`index`: room for blocks + 1 blocks); returns how many.
int64_t mask_row(const Problem& p, int64_t row, int64_t blocks, uint8_t* bits, int32_t* index) {
  const uint8_t* m = p.mask + row * p.m_row;
  int64_t count = 0;
  const __m256i step = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t e0 = b * kBlock, w = std::min(kBlock, p.L - e0);
    unsigned x = 0;
    if (p.m_col == 1 && w == kBlock) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(m + e0));
      x = ~static_cast<unsigned>(_mm_movemask_epi8(_mm_cmpeq_epi8(bytes, _mm_setzero_si128()))) & 0xffu;
    } else {
      for (int64_t j = 0; j < w; ++j) x |= (m[(e0 + j) * p.m_col] != 0 ? 1u : 0u) << j;
    }
    bits[b] = static_cast<uint8_t>(x);
    const __m256i places = _mm256_add_epi32(step, _mm256_set1_epi32(static_cast<int>(e0)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(index + count),
                        _mm256_permutevar8x32_epi32(places, pack_perm(x)));
    count += __builtin_popcount(x);
  }
  return count;
}

// Scores into probabilities of the allowed entries, packed by rank into q.p (room for blocks + 1
// blocks); returns their sum, summed in 8 lanes by rank and then across the lanes: a tree row
// that skips the entries of other branches sums exactly as the same token does in plain decoding,
// where its ancestors lie side by side.
inline float softmax(Query& q, const Row& row, int64_t blocks) {
  int64_t count = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    const unsigned x = row.bits[b];
    _mm256_storeu_ps(q.p + count, _mm256_permutevar8x32_ps(_mm256_loadu_ps(q.s + b * kBlock), pack_perm(x)));
    count += __builtin_popcount(x);
  }
  _mm256_storeu_ps(q.p + count, _mm256_set1_ps(-INFINITY));  // exp gives 0 past the last
  __m256 m = _mm256_set1_ps(-INFINITY);
  for (int64_t c = 0; c < count; c += kBlock) m = _mm256_max_ps(m, _mm256_loadu_ps(q.p + c));
  const __m256 mx = _mm256_set1_ps(hmax8(m));
  __m256 sum = _mm256_setzero_ps();
  for (int64_t c = 0; c < count; c += kBlock) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(q.p + c), mx));
    _mm256_storeu_ps(q.p + c, e);
    sum = _mm256_add_ps(sum, e);
  }
  return hsum8(sum);
}

// Outputs of QV queries of one row for W vectors of 8 dims from d0: the probabilities of the
// allowed entries times their value rows, in rank order; the sums are divided by the sum of the
// probabilities and rounded to bfloat16 once. Not inlined, as score_tile.
template <int QV, int W>
[[gnu::noinline]] void value_tile(const uint16_t* v, int64_t stride, const Row& row, const Query* qs, int64_t d0) {
  __m256 acc[QV][W];
  for (int i = 0; i < QV; ++i)
    for (int j = 0; j < W; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < row.count; ++k) {
    const uint16_t* src = v + row.index[k] * stride + d0;
    __m256 w[QV];  // QV weights and one value vector live beside the accumulators: no spills
    for (int i = 0; i < QV; ++i) w[i] = _mm256_broadcast_ss(qs[i].p + k);
    for (int j = 0; j < W; ++j) {
      const __m256 vv = _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 8 * j))), 16));
      for (int i = 0; i < QV; ++i) acc[i][j] = _mm256_fmadd_ps(w[i], vv, acc[i][j]);
    }
  }
  #pragma GCC unroll 8  // unrolled, or gcc keeps acc in memory
  for (int i = 0; i < QV; ++i) {
    const __m256 sum = _mm256_set1_ps(qs[i].sum);
    #pragma GCC unroll 8
    for (int j = 0; j < W; j += 2) {
      const __m256i lo = to_bf16(_mm256_div_ps(acc[i][j], sum));
      const __m256i hi = to_bf16(_mm256_div_ps(acc[i][j + 1], sum));
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xd8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs[i].out + d0 + 8 * j), packed);
    }
  }
}

// Every dim of QV queries of one row: 64-dim chunks for one query, 32-dim ones for more, then
// what is left in 16-dim ones (D is a multiple of 16).
template <int QV>
inline void value_queries(const uint16_t* v, int64_t stride, const Row& row, const Query* qs, int64_t D) {
  constexpr int W = QV == 1 ? 8 : 4;
  int64_t d0 = 0;
  for (; d0 + 8 * W <= D; d0 += 8 * W) value_tile<QV, W>(v, stride, row, qs, d0);
  if constexpr (W == 8) {
    if (d0 + 32 <= D) { value_tile<QV, 4>(v, stride, row, qs, d0); d0 += 32; }
  }
  for (; d0 < D; d0 += 16) value_tile<QV, 2>(v, stride, row, qs, d0);
}

// Items begin .. end - 1 of the (key/value head, row) grid, head-major.
void run_items(const Problem& p, int64_t begin, int64_t end) {
  const int64_t blocks = (p.L + kBlock - 1) / kBlock, pairs = p.D / 2;
  const int64_t rows_per_pass = std::max<int64_t>(1, kMaxQueries / p.G);
  const int64_t width = (blocks + 1) * kBlock;  // a row's scores, with room for a spare block
  thread_local std::vector<uint32_t> keys;
  thread_local std::vector<float> qf, scores, packed;
  thread_local std::vector<uint8_t> bits;
  thread_local std::vector<int32_t> index;
  thread_local std::vector<Query> qs;
  thread_local std::vector<Row> rs;
  const auto grow = [](auto& vec, size_t size) { if (vec.size() < size) vec.resize(size); };
  grow(keys, blocks * pairs * kBlock);
  grow(qf, rows_per_pass * p.G * p.D);
  grow(scores, rows_per_pass * p.G * width);
  grow(packed, rows_per_pass * p.G * width);
  grow(bits, rows_per_pass * blocks);
  grow(index, rows_per_pass * width);
  grow(qs, rows_per_pass * p.G);
  grow(rs, rows_per_pass);
  for (int64_t item = begin; item < end;) {
    const int64_t c = item / p.n, r_begin = item % p.n;
    const int64_t r_end = std::min(p.n, r_begin + (end - item));
    pack_keys(p.k + c * p.k_head, p.k_row, p.L, pairs, keys.data());
    for (int64_t r0 = r_begin; r0 < r_end; r0 += rows_per_pass) {
      const int64_t rows = std::min(rows_per_pass, r_end - r0), nq = rows * p.G;
      for (int64_t r = 0; r < rows; ++r) {
        uint8_t* b = bits.data() + r * blocks;
        int32_t* x = index.data() + r * width;
        rs[r] = Row{b, x, mask_row(p, r0 + r, blocks, b, x)};
        for (int64_t g = 0; g < p.G; ++g) {
          const int64_t i = r * p.G + g, offset = ((r0 + r) * p.H + c * p.G + g) * p.D;
          float* q = qf.data() + i * p.D;
          for (int64_t d = 0; d < p.D; d += 8)
            _mm256_storeu_ps(q + d, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
                                        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p.q + offset + d))), 16)));
          qs[i] = Query{q, scores.data() + i * width, packed.data() + i * width, p.out + offset, 0.0f};
        }
      }
      int64_t i = 0;  // 8 accumulators per tile where there are enough blocks
      for (; i + 4 <= nq; i += 4) score_queries<Scores, 4, 2>(keys.data(), pairs, 0, blocks, &qs[i], p.scale);
      switch (nq - i) {
        case 3: score_queries<Scores, 3, 2>(keys.data(), pairs, 0, blocks, &qs[i], p.scale); break;
        case 2: score_queries<Scores, 2, 3>(keys.data(), pairs, 0, blocks, &qs[i], p.scale); break;
        case 1: score_queries<Scores, 1, 4>(keys.data(), pairs, 0, blocks, &qs[i], p.scale); break;
      }
      const uint16_t* v = p.v + c * p.v_head;
      for (int64_t r = 0; r < rows; ++r) {
        Query* rq = &qs[r * p.G];
        for (int64_t g = 0; g < p.G; ++g) rq[g].sum = softmax(rq[g], rs[r], blocks);
        for (int64_t g = 0; g < p.G;) {  // the row's queries 3 at a time (4 as 2 + 2)
          const int64_t left = p.G - g, take = left == 4 ? 2 : std::min<int64_t>(3, left);
          switch (take) {
            case 3: value_queries<3>(v, p.v_row, rs[r], rq + g, p.D); break;
            case 2: value_queries<2>(v, p.v_row, rs[r], rq + g, p.D); break;
            default: value_queries<1>(v, p.v_row, rs[r], rq + g, p.D); break;
          }
          g += take;
        }
      }
    }
    item += r_end - r_begin;
  }
}

struct Kernel {
  static void run(const Problem& p, int64_t begin, int64_t end) { run_items(p, begin, end); }
};

}  // namespace

TORCH_LIBRARY_IMPL(caddtree, CPU, m) {
  m.impl("tree_attention", &caddtree_attention::attention_op<Kernel>);
  m.impl("tree_attention_batch", &caddtree_attention::batch_attention_op<Kernel>);
}

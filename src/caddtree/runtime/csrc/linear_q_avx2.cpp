// caddtree::linear_q for CPUs with AVX2 but no AVX512-BF16 (built instead of linear_q.cpp there):
// the same operator, packed layout and numbers as linear_q.cpp, whose header gives the
// arithmetic. The input rows are quantized per block exactly as there (the same integers and
// scales), and each output's float32 sum takes the same steps in the same order, block after
// block, so a row's result is the same bits alone or among others, as on AVX-512.
//
// Without vpdpbusd, a block's integer dot products come from vpmaddubsw (unsigned bytes times
// signed bytes, adjacent pairs added to int16) and vpmaddwd against ones (pairs of those added to
// int32): one int32 lane per output again. Integers of up to 6 bits times int8 inputs stay far
// below int16's range; a Q8_0 weight is taken as a signed byte, its magnitude times the input with
// the weight's sign (vpabsb, vpsignb), so the sum is sum(w * q) directly and needs no offset. A 256-bit load
// holds 8 outputs' 4 bytes, half of one of linear_q.cpp's 64-byte loads; a pass covers 16
// outputs (one half of the group) for up to 2 rows: their 8 sums and accumulators, the weights and
// the broadcast inputs fit the 16 registers.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "linear_op.h"  // balanced_passes
#include "linear_q_op.h"

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

namespace {

using namespace caddtree_q;

inline float max_abs_8(__m256 v) {
  v = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v);
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// One block of 32 inputs quantized as linear_q.cpp's quantize_block: int8 values into q,
// (scale, sum).
std::pair<float, int32_t> quantize_block(const c10::BFloat16* x, int8_t* q) {
  __m256 v[4];
  for (int j = 0; j < 4; ++j) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 8 * j));
    v[j] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
  int nan = 0;
  for (int j = 0; j < 4; ++j) nan |= _mm256_movemask_ps(_mm256_cmp_ps(v[j], v[j], _CMP_UNORD_Q));
  const float amax = std::max(std::max(max_abs_8(v[0]), max_abs_8(v[1])),
                              std::max(max_abs_8(v[2]), max_abs_8(v[3])));
  const auto [d, id] = block_scale(nan ? std::numeric_limits<float>::quiet_NaN() : amax);
  int32_t rounded[kBlock];
  for (int j = 0; j < 4; ++j) {  // to nearest even, as the AVX-512 build
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(rounded + 8 * j),
                        _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(id))));
  }
  int32_t sum = 0;
  for (int64_t c = 0; c < kBlock; ++c) {
    q[c] = static_cast<int8_t>(std::clamp(rounded[c], -128, 127));
    sum += q[c];
  }
  return {d, sum};
}

inline __m256i broadcast4(const int8_t* p) { return _mm256_set1_epi32(load4(p)); }

// sum over each lane's 4 bytes of u * x (u unsigned, x signed), added to acc.
inline __m256i dot4(__m256i acc, __m256i u, __m256i x) {
  const __m256i pairs = _mm256_maddubs_epi16(u, x);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// The same with signed weight bytes w: |w| times x with w's sign.
inline __m256i dot4_signed(__m256i acc, __m256i w, __m256i x) {
  return dot4(acc, _mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
}

// The 8 scales of outputs 16 h + 8 v .. 16 h + 8 v + 7 in scale array a of the block at blk.
template <int64_t Kind>
inline __m256 scales8(const uint8_t* blk, int a, int h, int v) {
  constexpr Format f = format(Kind);
  const uint8_t* at = blk + (32 * a + 16 * h + 8 * v) * f.scale_bytes;
  if constexpr (f.scale_bytes == 4) return _mm256_loadu_ps(reinterpret_cast<const float*>(at));
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
}

// 0x10 in byte b of each 32-bit lane where bit shift + b of the lane's word is set (see
// linear_q.cpp's fifth_bits).
inline __m256i fifth_bits(__m256i words, int shift) {
  const __m256i low_byte = _mm256_srl_epi32(words, _mm_cvtsi32_si128(shift));
  const __m256i spread = _mm256_shuffle_epi8(
      low_byte, _mm256_set_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0, 0x0C0C0C0C, 0x08080808,
                                 0x04040404, 0));
  const __m256i bit = _mm256_set1_epi32(0x08040201);
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

// Rows m0 .. m0 + MB - 1, outputs o0 + 16 h .. o0 + 16 h + 15 (half h of the group at wg).
template <int64_t Kind, int MB>
void half_rows(const Problem& p, const uint8_t* wg, int64_t m0, int64_t o0, int h) {
  constexpr Format f = format(Kind);
  constexpr bool signed_bytes = Kind == kQ8_0;  // summed as signed bytes: no offset to take
  constexpr int steps = 4 / f.parts;
  constexpr int64_t bytes = f.bytes();
  const int64_t nb = p.K / kBlock;
  const Input& in = *p.in;
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[MB][2];
  for (int i = 0; i < MB; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = wg + b * bytes;
    const uint8_t* ints = blk + f.header();
    for (int part = 0; part < f.parts; ++part) {
      __m256i sums[MB][2];
      for (int i = 0; i < MB; ++i) sums[i][0] = sums[i][1] = _mm256_setzero_si256();
      for (int s = part * steps; s < (part + 1) * steps; ++s) {
        const int64_t col = b * kBlock + (f.nibbles ? 4 * s : 8 * s), next = f.nibbles ? 16 : 4;
        for (int v = 0; v < 2; ++v) {  // outputs 8 v .. 8 v + 7 of the half
          __m256i first, second;
          if constexpr (f.nibbles) {
            const __m256i u = _mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(ints + (h * 4 + s) * 64 + 32 * v));
            first = _mm256_and_si256(u, low);
            second = _mm256_and_si256(_mm256_srli_epi16(u, 4), low);
            if constexpr (f.high_bits) {
              const __m256i words = _mm256_loadu_si256(
                  reinterpret_cast<const __m256i*>(ints + 512 + 64 * h + 32 * v));
              first = _mm256_or_si256(first, fifth_bits(words, 4 * s));
              second = _mm256_or_si256(second, fifth_bits(words, 16 + 4 * s));
            }
          } else {
            // Q8_0's bytes are stored as q + 128: flipping the top bit gives the signed byte back
            const __m256i top = _mm256_set1_epi8(signed_bytes ? static_cast<char>(0x80) : 0);
            first = _mm256_xor_si256(top, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                              ints + (h * 8 + 2 * s) * 64 + 32 * v)));
            second = _mm256_xor_si256(top, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                               ints + (h * 8 + 2 * s + 1) * 64 + 32 * v)));
          }
          for (int i = 0; i < MB; ++i) {
            const int8_t* xq = in.q.data() + (m0 + i) * p.K + col;
            if constexpr (signed_bytes) {
              sums[i][v] = dot4_signed(dot4_signed(sums[i][v], first, broadcast4(xq)), second,
                                       broadcast4(xq + next));
            } else {
              sums[i][v] = dot4(dot4(sums[i][v], first, broadcast4(xq)), second, broadcast4(xq + next));
            }
          }
        }
      }
      for (int v = 0; v < 2; ++v) {
        const __m256 dw = scales8<Kind>(blk, part, h, v);
        for (int i = 0; i < MB; ++i) {
          const int64_t row_block = (m0 + i) * nb + b;
          __m256i total = sums[i][v];
          if constexpr (f.offset != 0 && !signed_bytes) {
            const int32_t s = f.parts == 2 ? in.s16[2 * row_block + part] : in.s[row_block];
            total = _mm256_sub_epi32(total, _mm256_set1_epi32(f.offset * s));
          }
          const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(in.d[row_block]));
          acc[i][v] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(total), acc[i][v]);
        }
      }
    }
    if constexpr (f.with_min) {
      for (int v = 0; v < 2; ++v) {
        const __m256 mw = scales8<Kind>(blk, 1, h, v);
        for (int i = 0; i < MB; ++i) {
          acc[i][v] = _mm256_fmadd_ps(mw, _mm256_set1_ps(in.ds[(m0 + i) * nb + b]), acc[i][v]);
        }
      }
    }
  }
  for (int i = 0; i < MB; ++i) {
    alignas(32) float out[16];
    _mm256_store_ps(out, acc[i][0]);
    _mm256_store_ps(out + 8, acc[i][1]);
    const int64_t first = o0 + 16 * h;
    c10::BFloat16* y = p.y + (m0 + i) * p.N + first;
    for (int64_t c = 0; c < 16 && first + c < p.N; ++c) {
      y[c] = c10::BFloat16(p.bias ? out[c] + p.bias[first + c] : out[c]);
    }
  }
}

template <int64_t Kind, int MB>
struct Rows {
  static void run(const Problem& p, const uint8_t* wg, int64_t m0, int64_t o0) {
    half_rows<Kind, MB>(p, wg, m0, o0, 0);
    if (o0 + 16 < p.N) half_rows<Kind, MB>(p, wg, m0, o0, 1);
  }
};

using Pass = void (*)(const Problem&, const uint8_t*, int64_t, int64_t);

struct Kernel {
  static std::pair<float, int32_t> quantize(const c10::BFloat16* x, int8_t* q) {
    return quantize_block(x, q);
  }
  template <int64_t Kind>
  static void group(const Problem& p, const uint8_t* wg, int64_t M, int64_t o0) {
    static constexpr std::array<Pass, 2> passes = {&Rows<Kind, 1>::run, &Rows<Kind, 2>::run};
    caddtree_linear::balanced_passes(passes, p, wg, M, o0);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(caddtree, CPU, m) {
  m.impl("linear_q", &linear_q<Kernel>);
  m.impl("quantize_input", &quantize_input<Kernel>);
}

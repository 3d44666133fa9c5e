// caddtree::linear_q: y = x @ W.T (+ bias) for bfloat16 rows x and a weight W kept in GGUF's
// Q4_0, Q4_1 or Q8_0 blocks, on CPUs with AVX512-VNNI (every CPU with AVX512-BF16 has it).
//
// Arithmetic (llama.cpp's): each row's input is quantized once per call, per block of 32
// columns, to int8 with a float32 scale dx = max|x| / 127 (q = x * (1 / dx) rounded to nearest
// even) and the block's sum s = sum(q). A weight block of 32 columns of one output holds a float16
// scale dw (and, in Q4_1, a float16 minimum mw) and 32 integers u: Q4_0 w = dw * (u - 8), Q4_1
// w = dw * u + mw, Q8_0 w = dw * (u - 128) once its signed bytes are stored as u = q + 128. vpdpbusd
// multiplies the unsigned u by the signed input bytes, so every block's dot product is an exact
// int32 sum I = sum(u * q), and the output accumulates, block after block in order, in float32:
//   Q4_0: acc += (dw * dx) * (I - 8 s)        Q8_0: acc += (dw * dx) * (I - 128 s)
//   Q4_1: acc += (dw * dx) * I, then acc += mw * (dx * s)
// and is rounded once to bfloat16 (plus the bias). Nothing a row computes depends on the other
// rows of the call, so a row's result is the same bits alone or among others, and plain decoding
// (one row) and tree verification (many) agree exactly.
//
// Layout (made once by caddtree.models.quantized.pack_blocks): outputs in groups of 32 (the last
// padded with zero blocks), each group a run of its K / 32 column blocks, each of
//   dw [32] float16 | mw [32] float16 (Q4_1 only) | the integers
// where the integers of output half h (outputs 16h .. 16h + 15) come in 64-byte loads: load s of
// half h holds, for each of its 16 outputs, 4 bytes. Q4 (the file's nibble order): byte b of an
// output in load s has column 4s + b in its low nibble and column 16 + 4s + b in its high one,
// loads [h][s] for s = 0..3. Q8_0: byte b in load s is column 4s + b + 128, loads [h][s] for
// s = 0..7. A load then feeds vpdpbusd directly (Q8) or after a mask and a shift (Q4), against a
// broadcast of the matching 4 input bytes: one int32 lane per output, no horizontal sums.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "linear_op.h"  // balanced_passes
#include "linear_q_op.h"
#include "round_bf16.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

namespace {

using namespace caddtree_q;

// One block of 32 inputs quantized (see the header): its int8 values into q, (scale, sum).
std::pair<float, int32_t> quantize_block(const c10::BFloat16* x, int8_t* q) {
  __m512 v[2];
  for (int h = 0; h < 2; ++h) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16 * h));
    v[h] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
  const bool nan = _mm512_cmp_ps_mask(v[0], v[0], _CMP_UNORD_Q) |
                   _mm512_cmp_ps_mask(v[1], v[1], _CMP_UNORD_Q);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
  const auto [d, id] = block_scale(nan ? std::numeric_limits<float>::quiet_NaN() : amax);
  int32_t sum = 0;
  for (int h = 0; h < 2; ++h) {
    const __m512i rounded = _mm512_cvtps_epi32(_mm512_mul_ps(v[h], _mm512_set1_ps(id)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * h), _mm512_cvtsepi32_epi8(rounded));
    // the int8 values' sum (the same as the rounded values' for any finite block)
    sum += _mm512_reduce_add_epi32(
        _mm512_max_epi32(_mm512_min_epi32(rounded, _mm512_set1_epi32(127)), _mm512_set1_epi32(-128)));
  }
  return {d, sum};
}

inline __m512i broadcast4(const int8_t* p) { return _mm512_set1_epi32(load4(p)); }

// Rows m0 .. m0 + MB - 1 of the output, outputs o0 .. o0 + 31 (one group at wg). Each output's
// integer sum of a block runs in C chains (two where there are too few rows to hide vpdpbusd's
// latency), added at the block's end: integers, so the order does not change the bits.
template <int64_t Kind, int MB>
void group_rows(const Problem& p, const uint8_t* wg, int64_t m0, int64_t o0) {
  constexpr bool q4 = Kind != kQ8_0, with_min = Kind == kQ4_1;
  constexpr int C = MB <= 2 ? 2 : 1;
  constexpr int64_t bytes = block_bytes(Kind);
  constexpr int32_t offset = Kind == kQ4_0 ? 8 : Kind == kQ8_0 ? 128 : 0;
  const int64_t nb = p.K / kBlock;
  const Input& in = *p.in;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[MB][2];
  for (int i = 0; i < MB; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = wg + b * bytes;
    if (m0 == 0) {
      for (int64_t line = 0; line < bytes; line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(blk + 2 * bytes + line), _MM_HINT_T0);
      }
    }
    const uint8_t* ints = blk + (with_min ? 128 : 64);
    __m512i sums[MB][2][C];  // [row][half][chain]
    for (int i = 0; i < MB; ++i) {
      for (int h = 0; h < 2; ++h) {
        for (int c = 0; c < C; ++c) sums[i][h][c] = _mm512_setzero_si512();
      }
    }
    // Q4: a load gives columns 4s.. (low nibbles) and 16 + 4s.. (high); Q8: loads 2s and 2s + 1
    // give columns 8s.. and 8s + 4..
    for (int s = 0; s < 4; ++s) {
      __m512i first[2], second[2];
      for (int h = 0; h < 2; ++h) {
        if constexpr (q4) {
          const __m512i u = _mm512_loadu_si512(ints + (h * 4 + s) * 64);
          first[h] = _mm512_and_si512(u, low);
          second[h] = _mm512_and_si512(_mm512_srli_epi16(u, 4), low);
        } else {
          first[h] = _mm512_loadu_si512(ints + (h * 8 + 2 * s) * 64);
          second[h] = _mm512_loadu_si512(ints + (h * 8 + 2 * s + 1) * 64);
        }
      }
      const int64_t col = b * kBlock + (q4 ? 4 * s : 8 * s), next = q4 ? 16 : 4;
      for (int i = 0; i < MB; ++i) {
        const int8_t* xq = in.q.data() + (m0 + i) * p.K + col;
        const __m512i x0 = broadcast4(xq), x1 = broadcast4(xq + next);
        for (int h = 0; h < 2; ++h) {
          sums[i][h][0] = _mm512_dpbusd_epi32(sums[i][h][0], first[h], x0);
          sums[i][h][C - 1] = _mm512_dpbusd_epi32(sums[i][h][C - 1], second[h], x1);
        }
      }
    }
    const __m512 dw[2] = {
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk))),
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)))};
    for (int i = 0; i < MB; ++i) {
      const int64_t at = (m0 + i) * nb + b;
      const __m512 dx = _mm512_set1_ps(in.d[at]);
      for (int h = 0; h < 2; ++h) {
        __m512i total = sums[i][h][0];
        if constexpr (C == 2) total = _mm512_add_epi32(total, sums[i][h][1]);
        if constexpr (offset != 0) {
          total = _mm512_sub_epi32(total, _mm512_set1_epi32(offset * in.s[at]));
        }
        acc[i][h] = _mm512_fmadd_ps(_mm512_mul_ps(dw[h], dx), _mm512_cvtepi32_ps(total), acc[i][h]);
      }
      if constexpr (with_min) {
        const __m512 ds = _mm512_set1_ps(in.ds[at]);
        for (int h = 0; h < 2; ++h) {
          const __m512 mw = _mm512_cvtph_ps(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 + 32 * h)));
          acc[i][h] = _mm512_fmadd_ps(mw, ds, acc[i][h]);
        }
      }
    }
  }
  for (int i = 0; i < MB; ++i) {
    for (int h = 0; h < 2; ++h) {
      const int64_t first = o0 + 16 * h, valid = std::min<int64_t>(p.N - first, 16);
      if (valid <= 0) continue;
      caddtree_round::store_16_bf16(p.y + (m0 + i) * p.N + first,
                                    p.bias ? p.bias + first : nullptr, valid, acc[i][h]);
    }
  }
}

constexpr int kMaxRows = 4;  // input rows per pass over a group (more spilled registers, no faster)

using Pass = void (*)(const Problem&, const uint8_t*, int64_t, int64_t);

template <int64_t Kind, int... I>
constexpr std::array<Pass, sizeof...(I)> passes_of(std::integer_sequence<int, I...>) {
  return {&group_rows<Kind, I + 1>...};
}

template <int64_t Kind>
void group_of(const Problem& p, const uint8_t* wg, int64_t M, int64_t o0) {
  static constexpr auto passes = passes_of<Kind>(std::make_integer_sequence<int, kMaxRows>{});
  caddtree_linear::balanced_passes(passes, p, wg, M, o0);
}

struct Kernel {
  static std::pair<float, int32_t> quantize(const c10::BFloat16* x, int8_t* q) {
    return quantize_block(x, q);
  }
  template <int64_t Kind>
  static void group(const Problem& p, const uint8_t* wg, int64_t M, int64_t o0) {
    group_of<Kind>(p, wg, M, o0);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(caddtree, CPU, m) {
  m.impl("linear_q", &linear_q<Kernel>);
  m.impl("quantize_input", &quantize_input<Kernel>);
}

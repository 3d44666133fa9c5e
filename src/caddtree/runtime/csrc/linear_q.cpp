// caddtree::linear_q: y = x @ W.T (+ bias) for bfloat16 rows x and a weight W kept in GGUF's
// blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), on CPUs with AVX512-VNNI (every CPU
// with AVX512-BF16 has it).
//
// Arithmetic (llama.cpp's for the 32-column formats; for the K formats llama.cpp quantizes the
// input per 256 columns, Q8_K, where this keeps blocks of 32, so those results differ from its
// in the last bits): each row's input is quantized once per call, per block of 32 columns, to
// int8 with a float32 scale dx = max|x| / 127 (q = x * (1 / dx) rounded to nearest even) and the
// block's sum s = sum(q). Every format is read as blocks of 32 columns of one
// output holding unsigned integers u with a scale dw (and a minimum mw, or a second scale):
//   Q4_0 w = dw (u - 8)   Q5_0 w = dw (u - 16)   Q8_0 w = dw (u - 128), its signed bytes stored
//   as u = q + 128; Q4_1, Q5_1, Q4_K, Q5_K w = dw u + mw; Q6_K w = dw (u - 32) with its own dw
//   for columns 0..15 and 16..31.
// The K formats' scales are products of a float16 super-block scale and a 6- or 8-bit integer
// (and their minimums negated), exact in float32, so they are stored as float32; the others keep
// the file's float16. vpdpbusd multiplies the unsigned u by the signed input bytes, so every
// block's dot product is an exact int32 sum I = sum(u * q), and the output accumulates, block
// after block in order, in float32:
//   acc += (dw * dx) * (I - offset * s)                  (offset 8, 16, 128, or 0)
//   acc += mw * (dx * s)                                 (formats with a minimum, after that)
//   Q6_K: acc += (dw0 * dx) * (I0 - 32 s0), then acc += (dw1 * dx) * (I1 - 32 s1) over its halves
// and is rounded once to bfloat16 (plus the bias). Nothing a row computes depends on the other
// rows of the call, so a row's result is the same bits alone or among others, and plain decoding
// (one row) and tree verification (many) agree exactly.
//
// Layout (made once by caddtree.runtime.quantized.pack_blocks): outputs in groups of 32 (the last
// padded with zero blocks), each group a run of its K / 32 column blocks, each of
//   dw [32] | mw or dw1 [32] (formats with two arrays) | the integers | fifth bits (5-bit formats)
// (float16 or float32 scales), where the integers of output half h (outputs 16h .. 16h + 15)
// come in 64-byte loads: load s of half h holds, for each of its 16 outputs, 4 bytes. 4-bit
// formats (Q4_0's nibble order): byte b of an output in load s has column 4s + b in its low
// nibble and column 16 + 4s + b in its high one, loads [h][s] for s = 0..3; the 5-bit formats add
// one 64-byte load per half of the outputs' 32-bit words of fifth bits (bit c: column c), set
// into bit 4 of each nibble's byte (Q5_0 and Q5_1 keep the file's bytes, reordered). Byte
// formats: byte b in load s is column 4s + b, loads [h][s] for s = 0..7. A load then feeds
// vpdpbusd directly (bytes) or after a mask and a shift (nibbles), against a broadcast of the
// matching 4 input bytes: one int32 lane per output, no horizontal sums.

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

// The 16 scales of output half h in scale array a of the block at blk, as float32.
template <int64_t Kind>
inline __m512 scales16(const uint8_t* blk, int a, int h) {
  constexpr Format f = format(Kind);
  const uint8_t* at = blk + (32 * a + 16 * h) * f.scale_bytes;
  if constexpr (f.scale_bytes == 4) return _mm512_loadu_ps(at);
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
}

// 0x10 in byte b of each 32-bit lane where bit shift + b of the lane's word is set: the fifth
// bits of the integers of 4 columns, for the nibbles of those columns.
inline __m512i fifth_bits(__m512i words, int shift) {
  const __m512i low_byte = _mm512_srl_epi32(words, _mm_cvtsi32_si128(shift));
  const __m512i spread = _mm512_shuffle_epi8(
      low_byte, _mm512_set4_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0x00000000));
  const __mmask64 set = _mm512_test_epi8_mask(spread, _mm512_set1_epi32(0x08040201));
  return _mm512_maskz_mov_epi8(set, _mm512_set1_epi8(0x10));
}

// Rows m0 .. m0 + MB - 1 of the output, outputs o0 .. o0 + 31 (one group at wg), H halves of the
// outputs at a time: both (H = 2) where the rows' accumulators and integer sums fit in registers,
// else each half in turn over all of the group's blocks (H = 1), so that half as many are live. A
// half reads only its own loads and scales, so the group's weights are read once per pass either
// way, and each output's integer sums and float steps come in the same order, so a row gets the
// same bits whatever H. Each output's integer sum of a block (or a part) runs in C chains (two
// where there are too few rows to hide vpdpbusd's latency), added at its end: integers, so the
// order does not change the bits.
template <int64_t Kind, int MB, int H>
void group_rows(const Problem& p, const uint8_t* wg, int64_t m0, int64_t o0) {
  constexpr Format f = format(Kind);
  constexpr int C = MB <= 2 ? 2 : 1, steps = 4 / f.parts;
  constexpr int64_t bytes = f.bytes();
  const int64_t nb = p.K / kBlock;
  const Input& in = *p.in;
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int h0 = 0; h0 < 2; h0 += H) {
    if (p.N - (o0 + 16 * h0) <= 0) continue;  // a padded half (the first is never one)
    __m512 acc[MB][H];
    for (int i = 0; i < MB; ++i) {
      for (int h = 0; h < H; ++h) acc[i][h] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = wg + b * bytes;
      if (m0 == 0 && h0 == 0) {
        for (int64_t line = 0; line < bytes; line += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(blk + 2 * bytes + line), _MM_HINT_T0);
        }
      }
      const uint8_t* ints = blk + f.header();
      __m512i words[H];  // the fifth bits of the 5-bit formats, per half
      if constexpr (f.high_bits) {
        for (int h = 0; h < H; ++h) words[h] = _mm512_loadu_si512(ints + 512 + 64 * (h0 + h));
      }
      for (int part = 0; part < f.parts; ++part) {
        __m512i sums[MB][H][C];  // [row][half][chain]
        for (int i = 0; i < MB; ++i) {
          for (int h = 0; h < H; ++h) {
            for (int c = 0; c < C; ++c) sums[i][h][c] = _mm512_setzero_si512();
          }
        }
        // nibbles: a load gives columns 4s.. (low) and 16 + 4s.. (high); bytes: loads 2s and
        // 2s + 1 give columns 8s.. and 8s + 4..
        for (int s = part * steps; s < (part + 1) * steps; ++s) {
          __m512i first[H], second[H];
          for (int h = 0; h < H; ++h) {
            const int half = h0 + h;
            if constexpr (f.nibbles) {
              const __m512i u = _mm512_loadu_si512(ints + (half * 4 + s) * 64);
              first[h] = _mm512_and_si512(u, low);
              second[h] = _mm512_and_si512(_mm512_srli_epi16(u, 4), low);
              if constexpr (f.high_bits) {
                first[h] = _mm512_or_si512(first[h], fifth_bits(words[h], 4 * s));
                second[h] = _mm512_or_si512(second[h], fifth_bits(words[h], 16 + 4 * s));
              }
            } else {
              first[h] = _mm512_loadu_si512(ints + (half * 8 + 2 * s) * 64);
              second[h] = _mm512_loadu_si512(ints + (half * 8 + 2 * s + 1) * 64);
            }
          }
          const int64_t col = b * kBlock + (f.nibbles ? 4 * s : 8 * s), next = f.nibbles ? 16 : 4;
          for (int i = 0; i < MB; ++i) {
            const int8_t* xq = in.q.data() + (m0 + i) * p.K + col;
            const __m512i x0 = broadcast4(xq), x1 = broadcast4(xq + next);
            for (int h = 0; h < H; ++h) {
              sums[i][h][0] = _mm512_dpbusd_epi32(sums[i][h][0], first[h], x0);
              sums[i][h][C - 1] = _mm512_dpbusd_epi32(sums[i][h][C - 1], second[h], x1);
            }
          }
        }
        __m512 dw[H];
        for (int h = 0; h < H; ++h) dw[h] = scales16<Kind>(blk, part, h0 + h);
        for (int i = 0; i < MB; ++i) {
          const int64_t at = (m0 + i) * nb + b;
          const __m512 dx = _mm512_set1_ps(in.d[at]);
          const int32_t s = f.parts == 2 ? in.s16[2 * at + part] : in.s[at];
          for (int h = 0; h < H; ++h) {
            __m512i total = sums[i][h][0];
            if constexpr (C == 2) total = _mm512_add_epi32(total, sums[i][h][1]);
            if constexpr (f.offset != 0) {
              total = _mm512_sub_epi32(total, _mm512_set1_epi32(f.offset * s));
            }
            acc[i][h] =
                _mm512_fmadd_ps(_mm512_mul_ps(dw[h], dx), _mm512_cvtepi32_ps(total), acc[i][h]);
          }
        }
      }
      if constexpr (f.with_min) {
        __m512 mw[H];
        for (int h = 0; h < H; ++h) mw[h] = scales16<Kind>(blk, 1, h0 + h);
        for (int i = 0; i < MB; ++i) {
          const __m512 ds = _mm512_set1_ps(in.ds[(m0 + i) * nb + b]);
          for (int h = 0; h < H; ++h) acc[i][h] = _mm512_fmadd_ps(mw[h], ds, acc[i][h]);
        }
      }
    }
    for (int i = 0; i < MB; ++i) {
      for (int h = 0; h < H; ++h) {
        const int64_t first = o0 + 16 * (h0 + h), valid = std::min<int64_t>(p.N - first, 16);
        if (valid <= 0) continue;
        caddtree_round::store_16_bf16(p.y + (m0 + i) * p.N + first,
                                      p.bias ? p.bias + first : nullptr, valid, acc[i][h]);
      }
    }
  }
}

// Input rows per pass over a group: up to 4 with both halves at once (more spill the registers),
// up to 8 a half at a time, so a tree of 5-8 rows reads each group once.
constexpr int kMaxRows = 8;
constexpr int kRegisterRows = 4;

using Pass = void (*)(const Problem&, const uint8_t*, int64_t, int64_t);

template <int64_t Kind, int MB>
constexpr Pass pass_of() {
  return &group_rows<Kind, MB, MB <= kRegisterRows ? 2 : 1>;
}

template <int64_t Kind, int... I>
constexpr std::array<Pass, sizeof...(I)> passes_of(std::integer_sequence<int, I...>) {
  return {pass_of<Kind, I + 1>()...};
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

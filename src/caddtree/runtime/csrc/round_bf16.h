// Sixteen float32 sums (plus a bias) rounded to bfloat16 in AVX-512 registers, as c10::BFloat16
// rounds (to nearest even; NaN as 0x7FC0), so the bits equal the scalar conversion's. Shared by
// the linear kernels of the AVX512-BF16 build (linear_bf16.cpp, linear_q.cpp).

#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

namespace caddtree_round {

// y[0 .. valid - 1] = bfloat16(sums + bias[0 .. valid - 1]); bias may be null; 1 <= valid <= 16.
inline void store_16_bf16(c10::BFloat16* y, const float* bias, int64_t valid, __m512 sums) {
  const auto mask = static_cast<__mmask16>(valid >= 16 ? 0xFFFF : (1u << valid) - 1);
  if (bias) sums = _mm512_add_ps(sums, _mm512_maskz_loadu_ps(mask, bias));
  const __m512i bits = _mm512_castps_si512(sums);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i half = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, half), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(sums, sums, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
  _mm256_mask_storeu_epi16(y, mask, _mm512_cvtepi32_epi16(rounded));
}

}  // namespace caddtree_round

// The steps both attention kernels (attention_bf16.cpp, attention_avx2.cpp) take the same way, over
// their own vector width: a float32 exp's range reduction and polynomial, and the scores of a group
// of queries in tiles of blocks. A kernel gives its vector operations as a struct V:
//   using reg = ...;  static reg set1(float);  static reg mul(reg, reg);
//   static reg add(reg, reg);  static reg fmadd(reg a, reg b, reg c);  // a * b + c
//   static reg fnmadd(reg a, reg b, reg c);                              // c - a * b
// and its score tiles as a struct with  template <int QN, int KB> static void tile(...).

#pragma once

#include <cstdint>

namespace caddtree_attention {

// exp(r) - 1 by Cephes' expf polynomial, for |r| <= ln2 / 2 (within 2 ulp in float32 once 1 is
// added back), and the reduction x = n ln2 + r that gives r: n ln2 is taken in two parts so that
// n * 0.693359375 is exact (the constant has few bits).
struct Expf {
  static constexpr float kLog2e = 1.44269504088896341f;
  static constexpr float kLn2High = 0.693359375f;
  static constexpr float kLn2Low = -2.12194440e-4f;
  static constexpr float kPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                     4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

  // r = x - n ln2, for n = round(x log2 e) computed by the caller.
  template <class V>
  static typename V::reg reduce(typename V::reg x, typename V::reg n) {
    const typename V::reg r = V::fnmadd(n, V::set1(kLn2High), x);  // exact: few bits
    return V::fnmadd(n, V::set1(kLn2Low), r);
  }

  // 1 + (exp(r) - 1): exp(r) for a reduced r.
  template <class V>
  static typename V::reg one_plus_poly(typename V::reg r) {
    typename V::reg p = V::set1(kPoly[0]);
    for (int i = 1; i < 6; ++i) p = V::fmadd(p, r, V::set1(kPoly[i]));
    p = V::fmadd(p, V::mul(r, r), r);
    return V::add(p, V::set1(1.0f));
  }
};

// The scores of QN queries over every block from block b: tiles of KB blocks, then one tile of each
// smaller size (Scores::tile<QN, KB> scores QN queries over KB blocks from a given block).
template <class Scores, int QN, int KB, class Query>
inline void score_queries(const uint32_t* kt, int64_t pairs, int64_t b, int64_t blocks, Query* qs,
                          float scale) {
  for (; b + KB <= blocks; b += KB) Scores::template tile<QN, KB>(kt, pairs, qs, b, scale);
  if constexpr (KB > 1) score_queries<Scores, QN, KB - 1>(kt, pairs, b, blocks, qs, scale);
}

}  // namespace caddtree_attention

// caddtree::linear_bf16: y = x @ w.T (+ bias) for bfloat16 on CPUs with AVX512-BF16.
//
// Decoding and tree verification multiply a few rows (1 to a few dozen) by every weight of the
// model, so they are bound by reading the weights once, and oneDNN's fixed cost per call (over a
// hundred calls a forward; benchmarks/linear_kernel.py times both) is a large share of a forward. This kernel
// reads each weight once, in one sequential stream, with no per-call set-up beyond a parallel loop.
//
// Layout (made once by caddtree.runtime.kernels.pack_rows): the output rows come in groups of 32
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

#include "amx.h"
#include "linear_op.h"
#include "round_bf16.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

namespace caddtree_amx {

bool amx_allowed() {
  static const bool allowed = [] {
    const char* env = std::getenv("CADDTREE_AMX");
    if (env != nullptr && std::string(env) == "0") return false;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = (d >> 24) & 1u, bf16 = (d >> 22) & 1u;
    constexpr long kReqPerm = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return tile && bf16 && syscall(SYS_arch_prctl, kReqPerm, kTileData) == 0;
  }();
  return allowed;
}

}  // namespace caddtree_amx

namespace {

using caddtree_linear::kGroup;  // output rows per group (two 16-lane halves)
constexpr int64_t kPrefetch = 16; // column pairs ahead to prefetch

using Problem = caddtree_linear::Problem<c10::BFloat16>;

// caddtree_linear::write_outputs of 16 outputs in vector registers (caddtree_round, the same bits
// as the scalar loop). Both the vector passes and the tile unit's blocks write through it: a
// batched call writes tens of thousands of these, and one at a time they took longer than the tile
// products of a block of 16 more rows. `out` is 64-byte aligned.
inline void write_16_outputs(const Problem& p, int64_t row, int64_t first, const float* out) {
  const int64_t valid = std::min<int64_t>(p.N - first, 16);
  if (valid <= 0) return;
  caddtree_round::store_16_bf16(p.y + row * p.N + first, p.bias ? p.bias + first : nullptr, valid,
                                _mm512_load_ps(out));
}

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
    write_16_outputs(p, m0 + i, o0, out);
    write_16_outputs(p, m0 + i, o0 + 16, out + 16);
  }
}

template <int MB>
struct Rows {
  static void run(const Problem& p, const uint16_t* wg, int64_t m0, int64_t o0) {
    group_rows<MB>(p, wg, m0, o0);
  }
};

// ---- AMX ----------------------------------------------------------------------------------------
// On CPUs with AMX-BF16 (Intel Xeon since Sapphire Rapids) every call, one row or many, runs on
// the tile unit instead (for weights whose K is a multiple of 32; others keep the passes above):
// a tile product takes 16 rows by 32 input columns of x, and the same packed weights as 16 column
// pairs of 16 outputs (one half of a group, read with a 128-byte stride), so a group needs no
// copy. A call of a few dozen rows then costs about what one row does (it reads the weights once,
// and the products are cheap), where the passes above grow with the rows. The tile unit rounds
// its sums in its own way, not vdpbf16ps's, but it computes each row of a tile from that row
// alone, in the same order of 32-column chunks, whatever the number of rows: so with AMX too a
// row gets the same bits alone or among others. The choice is made once per process (the CPU,
// Linux's permission for the tile state, and CADDTREE_AMX=0 to turn it off), so it never changes
// between two calls.

using caddtree_amx::amx_allowed;
using caddtree_amx::kChunk;     // input columns per tile product (16 column pairs)
using caddtree_amx::kTileRows;  // rows of x per tile

constexpr int64_t kChunkBytes = kChunk * kGroup * 2;  // one chunk of a group's packed weights
// Chunks ahead that a block's first pass prefetches: its tile loads wait on memory otherwise
// (a choice measured with benchmarks/linear_kernel.py at several distances).
constexpr int64_t kPrefetchChunks = 4;

inline bool amx_takes(int64_t K) { return K % kChunk == 0 && amx_allowed(); }

// The weights `ahead` chunks after chunk `wc` into the cache (the next group's past this one's end).
inline void prefetch_chunk(const uint16_t* wc, int64_t ahead) {
  const char* at = reinterpret_cast<const char*>(wc) + ahead * kChunkBytes;
  for (int64_t line = 0; line < kChunkBytes; line += 64) _mm_prefetch(at + line, _MM_HINT_T0);
}

// One block of up to 16 rows (C tiles 0 and 1: the group's two halves) or two (tiles 2 and 3
// too), stored and written out.
[[gnu::target("amx-tile,amx-bf16")]] inline void amx_block(const Problem& p, const uint16_t* wg,
                                                         int64_t M, int64_t m0, int64_t o0) {
  const bool two = m0 + kTileRows < M;
  const int64_t chunks = p.K / kChunk, stride = p.K * 2;
  const auto* x0 = reinterpret_cast<const uint16_t*>(p.x) + m0 * p.K;
  const auto* x1 = x0 + kTileRows * p.K;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t c = 0; c < chunks; ++c) {
    const uint16_t* wc = wg + c * (kChunk / 2) * kGroup * 2;
    if (m0 == 0) prefetch_chunk(wc, kPrefetchChunks);
    _tile_loadd(6, wc, kGroup * 4);
    _tile_loadd(7, wc + kTileRows * 2, kGroup * 4);
    _tile_loadd(4, x0 + c * kChunk, stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
      _tile_loadd(5, x1 + c * kChunk, stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float out[4][kTileRows][kTileRows];
  _tile_stored(0, out[0], 64);
  _tile_stored(1, out[1], 64);
  if (two) {
    _tile_stored(2, out[2], 64);
    _tile_stored(3, out[3], 64);
  }
  for (int64_t r = 0; r < 2 * kTileRows && m0 + r < M; ++r) {
    const int64_t b = r / kTileRows * 2, i = r % kTileRows;
    write_16_outputs(p, m0 + r, o0, out[b][i]);
    write_16_outputs(p, m0 + r, o0 + kTileRows, out[b + 1][i]);
  }
}

// Groups begin .. end - 1 against all M rows, 32 rows a pass (beyond 32 rows x is padded to whole
// tiles; up to 32 the tiles hold the rows there are).
[[gnu::target("amx-tile,amx-bf16")]] void amx_groups(const Problem& p, int64_t M, int64_t begin,
                                                     int64_t end) {
  if (M <= 2 * kTileRows) {  // sums 0, 1 and rows 4 of the first 16 rows; 2, 3 and 5 of the rest
    const auto first = static_cast<uint8_t>(std::min(M, kTileRows));
    const auto rest = static_cast<uint8_t>(M > kTileRows ? M - kTileRows : 1);
    const uint8_t rows[8] = {first, first, rest, rest, first, rest, 16, 16};
    caddtree_amx::load_tile_rows(rows);
  } else {
    caddtree_amx::load_tile_config();
  }
  for (int64_t g = begin; g < end; ++g) {
    for (int64_t m0 = 0; m0 < M; m0 += 2 * kTileRows) {
      amx_block(p, p.w + g * p.K * kGroup, M, m0, g * kGroup);
    }
  }
  _tile_release();
}

struct Kernel {
  using X = c10::BFloat16;
  // beyond 32 rows, padded with zeros to whole tiles where AMX takes them
  static at::Tensor input(const at::Tensor& rows) {
    const int64_t M = rows.size(0), padded = (M + kTileRows - 1) / kTileRows * kTileRows;
    if (!amx_takes(rows.size(1)) || padded == M) return rows.contiguous();
    // up to two blocks: the tile configuration gives their tiles as many rows as there are
    // (amx_groups), so nothing is copied
    if (M <= 2 * kTileRows) return rows.contiguous();
    at::Tensor out = at::empty({padded, rows.size(1)}, rows.options());
    out.narrow(0, 0, M).copy_(rows);
    out.narrow(0, M, padded - M).zero_();
    return out;
  }
  static bool groups(const Problem& p, int64_t M, int64_t begin, int64_t end) {
    if (!amx_takes(p.K)) return false;
    amx_groups(p, M, begin, end);
    return true;
  }
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

// ---- greedy choices -------------------------------------------------------------------------------
// caddtree::argmax_rows: per row of bfloat16 logits [N, V], the index of the largest value (the
// first on ties; the first NaN if there is one), as torch.argmax gives; without widening the
// logits to float32 first (a copy as large as the logits, every round).

namespace caddtree_argmax {

int64_t argmax_row(const uint16_t* row, int64_t V) {
  const auto widen = [](uint16_t b) {
    float f;
    const uint32_t u = static_cast<uint32_t>(b) << 16;
    std::memcpy(&f, &u, 4);
    return f;
  };
  int64_t best_i = 0;
  float best = widen(row[0]);
  int64_t j = 0;
  if (V >= 16) {
    const auto load = [&](int64_t at) {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + at));
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
    };
    __m512 top = load(0);
    __m512i top_i = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i at = top_i;
    __mmask16 nan = _mm512_cmp_ps_mask(top, top, _CMP_UNORD_Q);
    for (j = 16; j + 16 <= V; j += 16) {
      at = _mm512_add_epi32(at, _mm512_set1_epi32(16));
      const __m512 x = load(j);
      const __mmask16 greater = _mm512_cmp_ps_mask(x, top, _CMP_GT_OQ);  // strict: first kept
      top = _mm512_mask_blend_ps(greater, top, x);
      top_i = _mm512_mask_blend_epi32(greater, top_i, at);
      nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    }
    if (nan) {  // torch.argmax takes the first NaN
      for (int64_t k = 0; k < V; ++k) {
        if (std::isnan(widen(row[k]))) return k;
      }
    }
    best = _mm512_reduce_max_ps(top);
    const __mmask16 tied = _mm512_cmp_ps_mask(top, _mm512_set1_ps(best), _CMP_EQ_OQ);
    best_i = _mm512_mask_reduce_min_epi32(tied, top_i);  // the first index among the lanes
  }
  for (; j < V; ++j) {  // the tail's indices come after every lane's: strictly greater wins
    const float x = widen(row[j]);
    if (std::isnan(x)) return j;
    if (x > best) best = x, best_i = j;
  }
  return best_i;
}

at::Tensor argmax_rows(const at::Tensor& logits_in) {
  TORCH_CHECK(logits_in.device().is_cpu() && logits_in.scalar_type() == at::kBFloat16 &&
                  logits_in.dim() == 2 && logits_in.size(1) > 0,
              "argmax_rows: bfloat16 CPU logits [N, V] with V > 0 expected, got ",
              logits_in.scalar_type(), " ", logits_in.sizes());
  const at::Tensor logits = logits_in.contiguous();
  const int64_t N = logits.size(0), V = logits.size(1);
  at::Tensor out = at::empty({N}, logits.options().dtype(at::kLong));
  const auto* bits = reinterpret_cast<const uint16_t*>(logits.const_data_ptr());
  int64_t* chosen = out.mutable_data_ptr<int64_t>();
  at::parallel_for(0, N, std::max<int64_t>(1, (1 << 16) / V), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) chosen[r] = argmax_row(bits + r * V, V);
  });
  return out;
}

}  // namespace caddtree_argmax

TORCH_LIBRARY_FRAGMENT(caddtree, m) {
  m.def("amx_in_use() -> bool", [] { return amx_allowed(); });
  m.def("argmax_rows(Tensor logits) -> Tensor", &caddtree_argmax::argmax_rows);
}

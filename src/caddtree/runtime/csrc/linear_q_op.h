// The operator caddtree::linear_q around a kernel of GGUF blocks (linear_q.cpp for AVX512-VNNI,
// linear_q_avx2.cpp for AVX2): the block formats and their packed layout's sizes, the input rows
// quantized per block, the checks, the split of the weight's groups across threads, and the
// output's shape. A kernel is a class with
//   static std::pair<float, int32_t> quantize(const c10::BFloat16* x, int8_t* q);  // one block
//   template <int64_t Kind> static void group(const Problem& p, const uint8_t* wg, int64_t M,
//                                             int64_t o0);
// where quantize computes a block's int8 values, scale and sum exactly as linear_q.cpp's header
// says (both builds give the same integers and scales) and group computes all M rows of outputs
// o0 .. o0 + 31 against the group at wg, each output's float32 sum over blocks in order, rounded
// once to bfloat16.

#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace caddtree_q {

constexpr int64_t kBlock = 32;  // columns per quantization block
constexpr int64_t kGroup = 32;  // outputs per group of the packed layout
// ggml's type ids of the formats computed
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13,
                  kQ6_K = 14;

// How a format's blocks are laid out and computed (see linear_q.cpp's header).
struct Format {
  bool nibbles;        // integers as 4-bit pairs (512 bytes a block of a group), else bytes (1024)
  int arrays;          // scale arrays before the integers: d, and m (a minimum) or a second d
  int scale_bytes;     // 2 (float16) or 4 (float32)
  bool with_min;       // the second array is a minimum added as m * (dx * s)
  int parts;           // 2: the second array scales columns 16..31 (each half its own offset sum)
  int32_t offset;      // subtracted from each integer: sum(u * q) - offset * s
  bool high_bits;      // nibbles plus a fifth bit per integer (a 32-bit word per output, 128 bytes)
  constexpr int64_t header() const { return int64_t{32} * arrays * scale_bytes; }
  constexpr int64_t bytes() const {
    return header() + (nibbles ? 512 : 1024) + (high_bits ? 128 : 0);
  }
};

constexpr bool known_kind(int64_t kind) {
  return kind == kQ4_0 || kind == kQ4_1 || kind == kQ5_0 || kind == kQ5_1 || kind == kQ8_0 ||
         kind == kQ4_K || kind == kQ5_K || kind == kQ6_K;
}

constexpr Format format(int64_t kind) {
  switch (kind) {
    case kQ4_0: return {true, 1, 2, false, 1, 8, false};
    case kQ4_1: return {true, 2, 2, true, 1, 0, false};
    case kQ5_0: return {true, 1, 2, false, 1, 16, true};
    case kQ5_1: return {true, 2, 2, true, 1, 0, true};
    case kQ8_0: return {false, 1, 2, false, 1, 128, false};
    case kQ4_K: return {true, 2, 4, true, 1, 0, false};
    case kQ5_K: return {true, 2, 4, true, 1, 0, true};
    default: return {false, 2, 4, false, 2, 32, false};  // kQ6_K
  }
}

// Bytes of one column block of one group of 32 outputs.
constexpr int64_t block_bytes(int64_t kind) { return format(kind).bytes(); }

// Calls f(std::integral_constant<int64_t, Kind>) for the format kind.
template <class F>
void with_kind(int64_t kind, F f) {
  switch (kind) {
    case kQ4_0: return f(std::integral_constant<int64_t, kQ4_0>{});
    case kQ4_1: return f(std::integral_constant<int64_t, kQ4_1>{});
    case kQ5_0: return f(std::integral_constant<int64_t, kQ5_0>{});
    case kQ5_1: return f(std::integral_constant<int64_t, kQ5_1>{});
    case kQ8_0: return f(std::integral_constant<int64_t, kQ8_0>{});
    case kQ4_K: return f(std::integral_constant<int64_t, kQ4_K>{});
    case kQ5_K: return f(std::integral_constant<int64_t, kQ5_K>{});
    default: return f(std::integral_constant<int64_t, kQ6_K>{});
  }
}

// The input rows quantized per block (see the header).
struct Input {
  std::vector<int8_t> q;   // [M, K]
  std::vector<float> d;    // [M, K / 32] scales
  std::vector<int32_t> s;  // [M, K / 32] sums of q
  std::vector<float> ds;   // [M, K / 32] d * s, in float32
  std::vector<int32_t> s16;  // [M, K / 16] sums of q per 16 columns (formats of two parts only)
};

// The 4 input bytes at p as one int32 (to broadcast to every output lane).
inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// A block's scale d = max|x| / 127 and its inverse (0 for an all-zero block). A block holding
// NaN or infinity gets scale NaN (its outputs are NaN, as the bfloat16 kernel's would be) and
// integers 0; one of denormal size, integers no larger than an int8 holds.
inline std::pair<float, float> block_scale(float amax) {
  if (!(amax <= std::numeric_limits<float>::max())) {
    return {std::numeric_limits<float>::quiet_NaN(), 0.0f};
  }
  const float d = amax / 127.0f;
  return {d, d != 0.0f ? std::min(1.0f / d, std::numeric_limits<float>::max()) : 0.0f};
}

// Every row's blocks quantized by block(x, q) -> (d, sum(q)), which writes the block's 32 int8.
template <class Block>
Input quantize_rows(const c10::BFloat16* x, int64_t M, int64_t K, Block block) {
  const int64_t nb = K / kBlock;
  Input in{std::vector<int8_t>(M * K), std::vector<float>(M * nb), std::vector<int32_t>(M * nb),
           std::vector<float>(M * nb), {}};
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t at = r * K + b * kBlock;
      const auto [d, sum] = block(x + at, in.q.data() + at);
      in.d[r * nb + b] = d;
      in.s[r * nb + b] = sum;
      in.ds[r * nb + b] = d * static_cast<float>(sum);
    }
  }
  return in;
}

// The sums of q per 16 columns, for formats whose blocks have two parts.
inline void add_half_sums(Input& in) {
  in.s16.assign(in.q.size() / 16, 0);
  for (size_t i = 0; i < in.q.size(); ++i) in.s16[i / 16] += in.q[i];
}

struct Problem {
  const Input* in;
  const uint8_t* w;   // [groups, K / 32, block_bytes]
  const float* bias;  // [N] or null
  c10::BFloat16* y;   // [M, N]
  int64_t K, N;
};

template <class Kernel>
at::Tensor linear_q(const at::Tensor& x, const at::Tensor& w, int64_t kind, int64_t n,
                    const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(known_kind(kind), "linear_q: block format ", kind,
              " is not one of Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7), Q8_0 (8), Q4_K (12), "
              "Q5_K (13), Q6_K (14)");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "linear_q: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "linear_q: bfloat16 input expected");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 3 && w.is_contiguous() &&
                  w.size(2) == block_bytes(kind),
              "linear_q: the weight must be packed by caddtree.runtime.quantized.pack_blocks");
  const int64_t K = w.size(1) * kBlock, groups = w.size(0);
  TORCH_CHECK(n > (groups - 1) * kGroup && n <= groups * kGroup, "linear_q: ", n,
              " outputs do not fit a weight packed for ", groups * kGroup);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "linear_q: input has ", x.size(-1),
              " features, the weight takes ", K);
  const at::Tensor rows = x.reshape({-1, K}).contiguous();
  const int64_t M = rows.size(0);
  at::Tensor bias32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "linear_q: bias has ", bias->numel(), " values, not ", n);
    bias32 = bias->to(at::kFloat).contiguous();
  }
  at::Tensor y = at::empty({M, n}, x.options());
  if (M > 0) {
    Input in = quantize_rows(rows.const_data_ptr<c10::BFloat16>(), M, K, Kernel::quantize);
    if (format(kind).parts == 2) add_half_sums(in);
    const Problem p{&in, w.const_data_ptr<uint8_t>(),
                    bias32.defined() ? bias32.const_data_ptr<float>() : nullptr,
                    y.mutable_data_ptr<c10::BFloat16>(), K, n};
    const int64_t stride = w.size(1) * block_bytes(kind);
    with_kind(kind, [&](auto k) {
      at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
        for (int64_t g = begin; g < end; ++g) {
          Kernel::template group<decltype(k)::value>(p, p.w + g * stride, M, g * kGroup);
        }
      });
    });
  }
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = n;
  return y.view(sizes);
}

// The input quantization alone, for tests: (q int8 [M, K], d float32 [M, K / 32]).
template <class Kernel>
std::tuple<at::Tensor, at::Tensor> quantize_input(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) % kBlock == 0,
              "quantize_input: bfloat16 [M, K] with K a multiple of 32 expected");
  const at::Tensor rows = x.contiguous();
  const int64_t M = rows.size(0), K = rows.size(1);
  const Input in = quantize_rows(rows.const_data_ptr<c10::BFloat16>(), M, K, Kernel::quantize);
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, K / kBlock}, x.options().dtype(at::kFloat));
  std::copy(in.q.begin(), in.q.end(), q.mutable_data_ptr<int8_t>());
  std::copy(in.d.begin(), in.d.end(), d.mutable_data_ptr<float>());
  return {q, d};
}

}  // namespace caddtree_q

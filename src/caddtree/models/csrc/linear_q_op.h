// The operator caddtree::linear_q around a kernel of GGUF blocks (linear_q.cpp for AVX512-VNNI,
// linear_q_avx2.cpp for AVX2): the block formats and their packed layout's sizes, the input rows
// quantized per block, the checks, the split of the weight's groups across threads, and the
// output's shape. A kernel is a class with
//   static std::pair<float, int32_t> quantize(const c10::BFloat16* x, int8_t* q);  // one block
//   template <int64_t Kind> static void group(const Problem& p, const uint8_t* wg, int64_t M,
//                                             int64_t o0);
// where quantize computes a block's int8 values, scale and sum exactly as linear_q.cpp's header
// says (both builds give the same integers and scales) and group computes all M rows of outputs o0 .. o0 + 31 against the group
// at wg, each output's float32 sum over blocks in order, rounded once to bfloat16.

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
#include <utility>
#include <vector>

namespace caddtree_q {

constexpr int64_t kBlock = 32;  // columns per quantization block
constexpr int64_t kGroup = 32;  // outputs per group of the packed layout
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;  // ggml's type ids

// Bytes of one column block of one group of 32 outputs.
constexpr int64_t block_bytes(int64_t kind) {
  return 64 + (kind == kQ4_1 ? 64 : 0) + (kind == kQ8_0 ? 1024 : 512);
}

// The input rows quantized per block (see the header).
struct Input {
  std::vector<int8_t> q;   // [M, K]
  std::vector<float> d;    // [M, K / 32] scales
  std::vector<int32_t> s;  // [M, K / 32] sums of q
  std::vector<float> ds;   // [M, K / 32] d * s, in float32
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
           std::vector<float>(M * nb)};
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
  TORCH_CHECK(kind == kQ4_0 || kind == kQ4_1 || kind == kQ8_0,
              "linear_q: block format ", kind, " is not one of Q4_0 (2), Q4_1 (3), Q8_0 (8)");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "linear_q: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "linear_q: bfloat16 input expected");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 3 && w.is_contiguous() &&
                  w.size(2) == block_bytes(kind),
              "linear_q: the weight must be packed by caddtree.models.quantized.pack_blocks");
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
    const Input in = quantize_rows(rows.const_data_ptr<c10::BFloat16>(), M, K, Kernel::quantize);
    const Problem p{&in, w.const_data_ptr<uint8_t>(),
                    bias32.defined() ? bias32.const_data_ptr<float>() : nullptr,
                    y.mutable_data_ptr<c10::BFloat16>(), K, n};
    const auto run = kind == kQ4_0   ? &Kernel::template group<kQ4_0>
                     : kind == kQ4_1 ? &Kernel::template group<kQ4_1>
                                     : &Kernel::template group<kQ8_0>;
    const int64_t stride = w.size(1) * block_bytes(kind);
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) run(p, p.w + g * stride, M, g * kGroup);
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

// The operator caddtree::linear_bf16 around a kernel (linear_bf16.cpp, linear_avx2.cpp): checks
// its inputs, lays the rows out as the kernel reads them, splits the weight groups across threads
// and each group's rows into passes, and shapes the output. A kernel is a class with
//   using X = ...;                                      // the input element its passes read
//   static at::Tensor input(const at::Tensor& rows);    // [M, K] bf16 -> [M, K] of X
//   static void group(const Problem<X>& p, const uint16_t* wg, int64_t M, int64_t o0);
// where group computes all M rows of the output against the weight group at wg (outputs
// o0 .. o0 + 31), usually in passes over it (balanced_passes). A kernel may also have
//   static bool groups(const Problem<X>& p, int64_t M, int64_t begin, int64_t end);
// which computes the groups begin .. end - 1 of one thread in one go where it can (true), or
// leaves them to group (false); input may then give more than M rows (padding it reads).
// w is packed by caddtree.runtime.kernels.pack_rows: [groups, K / 2, 32, 2].

#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#include <array>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace caddtree_linear {

constexpr int64_t kGroup = 32;  // output rows per group of the packed layout

template <class X>
struct Problem {
  const X* x;         // [M, K] input rows
  const uint16_t* w;  // [groups, K / 2, 32, 2] bf16 bits (rows past N are padding)
  const float* bias;  // [N] or null
  c10::BFloat16* y;   // [M, N]
  int64_t K, N;
};

template <class X>
using Pass = void (*)(const Problem<X>&, const uint16_t* wg, int64_t m0, int64_t o0);

// Output row `row`, columns first .. first + width - 1 (those below N): the float32 sums `out`
// plus the bias, each rounded once to bfloat16. Every pass of every kernel ends here.
template <class X>
inline void write_outputs(const Problem<X>& p, int64_t row, int64_t first, const float* out,
                          int64_t width) {
  c10::BFloat16* yr = p.y + row * p.N + first;
  const int64_t valid = p.N - first < width ? p.N - first : width;
  for (int64_t r = 0; r < valid; ++r) {
    yr[r] = c10::BFloat16(p.bias ? out[r] + p.bias[first + r] : out[r]);
  }
}

// Rows 0 .. M - 1 against one weight group, in as few passes of at most N rows (passes[r - 1]
// takes r) as there can be, of balanced sizes (a pass of one or two rows over a group already in
// cache is bound by the latency of its few accumulator chains, so a small remainder pass would
// cost a full one).
template <class P, class W, size_t N>
inline void balanced_passes(const std::array<void (*)(const P&, const W*, int64_t, int64_t), N>& passes,
                            const P& p, const W* wg, int64_t M, int64_t o0) {
  const int64_t count = (M + static_cast<int64_t>(N) - 1) / static_cast<int64_t>(N);
  for (int64_t i = 0, m = 0; i < count; ++i) {
    const int64_t rows = (M - m) / (count - i) + ((M - m) % (count - i) != 0);
    passes[rows - 1](p, wg, m, o0);
    m += rows;
  }
}

// The passes of Fn<1> .. Fn<N> as an array indexed by rows - 1.
template <class X, template <int> class Fn, int... I>
constexpr std::array<Pass<X>, sizeof...(I)> pass_table(std::integer_sequence<int, I...>) {
  return {&Fn<I + 1>::run...};
}

template <class Kernel>
at::Tensor linear_op(const at::Tensor& x, const at::Tensor& w,
                     const std::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "linear_bf16: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "linear_bf16: bfloat16 input and weight expected");
  TORCH_CHECK(w.dim() == 4 && w.size(2) == kGroup && w.size(3) == 2 && w.is_contiguous(),
              "linear_bf16: the weight must be packed by caddtree.runtime.kernels.pack_rows");
  const int64_t K = w.size(1) * 2, N = n < 0 ? w.size(0) * kGroup : n;
  TORCH_CHECK(N <= w.size(0) * kGroup && N > (w.size(0) - 1) * kGroup,
              "linear_bf16: ", N, " outputs do not fit a weight packed for ", w.size(0) * kGroup);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "linear_bf16: input has ", x.size(-1),
              " features, the weight takes ", K);
  const at::Tensor rows = x.reshape({-1, K});
  const int64_t M = rows.size(0);
  const at::Tensor input = Kernel::input(rows);  // M rows at least (a kernel may pad)
  at::Tensor bias32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "linear_bf16: bias has ", bias->numel(), " values, not ", N);
    bias32 = bias->to(at::kFloat).contiguous();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  const Problem<typename Kernel::X> p{
      input.template const_data_ptr<typename Kernel::X>(),
      reinterpret_cast<const uint16_t*>(w.const_data_ptr()),
      bias32.defined() ? bias32.const_data_ptr<float>() : nullptr,
      y.mutable_data_ptr<c10::BFloat16>(), K, N};
  if (M > 0) {
    at::parallel_for(0, w.size(0), 1, [&](int64_t begin, int64_t end) {
      if constexpr (requires { Kernel::groups(p, M, begin, end); }) {
        if (Kernel::groups(p, M, begin, end)) return;  // the kernel took the whole range
      }
      for (int64_t g = begin; g < end; ++g) {
        Kernel::group(p, p.w + g * p.K * kGroup, M, g * kGroup);
      }
    });
  }
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = N;
  return y.view(sizes);
}

}  // namespace caddtree_linear

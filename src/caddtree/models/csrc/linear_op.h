// The operator caddtree::linear_bf16 around a kernel (linear_bf16.cpp, linear_avx2.cpp): checks
// its inputs, lays the rows out as the kernel reads them, and shapes the output. A kernel is a
// class with
//   static at::Tensor input(const at::Tensor& rows);  // [M, K] bf16 -> what run reads
//   static void run(const at::Tensor& input, const at::Tensor& w, const float* bias,
//                   c10::BFloat16* y, int64_t K, int64_t N);  // y [M, N] = input @ w.T + bias
// with w packed by caddtree.models.kernels.pack_rows: [groups, K / 2, 32, 2].

#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace caddtree_linear {

constexpr int64_t kGroup = 32;  // output rows per group of the packed layout

template <class Kernel>
at::Tensor linear_op(const at::Tensor& x, const at::Tensor& w,
                     const std::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "linear_bf16: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "linear_bf16: bfloat16 input and weight expected");
  TORCH_CHECK(w.dim() == 4 && w.size(2) == kGroup && w.size(3) == 2 && w.is_contiguous(),
              "linear_bf16: the weight must be packed by caddtree.models.kernels.pack_rows");
  const int64_t K = w.size(1) * 2, N = n < 0 ? w.size(0) * kGroup : n;
  TORCH_CHECK(N <= w.size(0) * kGroup && N > (w.size(0) - 1) * kGroup,
              "linear_bf16: ", N, " outputs do not fit a weight packed for ", w.size(0) * kGroup);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "linear_bf16: input has ", x.size(-1),
              " features, the weight takes ", K);
  const at::Tensor input = Kernel::input(x.reshape({-1, K}));
  const int64_t M = input.size(0);
  at::Tensor bias32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "linear_bf16: bias has ", bias->numel(), " values, not ", N);
    bias32 = bias->to(at::kFloat).contiguous();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M > 0) {
    Kernel::run(input, w, bias32.defined() ? bias32.const_data_ptr<float>() : nullptr,
                y.mutable_data_ptr<c10::BFloat16>(), K, N);
  }
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = N;
  return y.view(sizes);
}

}  // namespace caddtree_linear

// The operator caddtree::tree_attention around a kernel (attention_bf16.cpp, attention_avx2.cpp):
// checks its inputs, describes them as a Problem, and splits the (key/value head, row) grid across
// threads, each taking at least about kMinWork multiply-adds. A kernel is a class with
//   static void run(const Problem& p, int64_t begin, int64_t end);  // items begin .. end - 1,
//                                                                     // head-major
// that writes the rows' outputs [n, H * D].

#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>

namespace caddtree_attention {

constexpr int64_t kMinWork = 1 << 17;  // multiply-adds a thread takes at least (less: one thread)

struct Problem {
  const uint16_t* q;               // [n, H, D] bf16 bits
  const uint16_t *k, *v;           // [kv, S, D] bf16 bits, last dim contiguous
  int64_t k_head, k_row, v_head, v_row;
  const uint8_t* mask;             // [n, L] bool
  int64_t m_row, m_col;
  c10::BFloat16* out;              // [n, H * D]
  int64_t n, H, G, D, L;
  float scale;
};

template <class Kernel>
at::Tensor attention_op(const at::Tensor& q_in, const at::Tensor& keys, const at::Tensor& values,
                        const at::Tensor& mask, double scale) {
  TORCH_CHECK(q_in.device().is_cpu() && keys.device().is_cpu() && values.device().is_cpu() &&
                  mask.device().is_cpu(),
              "tree_attention: CPU tensors only");
  TORCH_CHECK(q_in.scalar_type() == at::kBFloat16 && keys.scalar_type() == at::kBFloat16 &&
                  values.scalar_type() == at::kBFloat16,
              "tree_attention: bfloat16 q, keys and values expected");
  TORCH_CHECK(mask.scalar_type() == at::kBool, "tree_attention: a bool mask expected, got ",
              mask.scalar_type());
  TORCH_CHECK(q_in.dim() == 3, "tree_attention: q must be [n, H, D], got ", q_in.sizes());
  TORCH_CHECK(keys.dim() == 3 && keys.sizes() == values.sizes(),
              "tree_attention: keys and values must both be [kv, S, D], got ", keys.sizes(),
              " and ", values.sizes());
  TORCH_CHECK(keys.stride(2) == 1 && values.stride(2) == 1,
              "tree_attention: keys and values need a contiguous last dim");
  const int64_t n = q_in.size(0), H = q_in.size(1), D = q_in.size(2), kv = keys.size(0);
  TORCH_CHECK(keys.size(2) == D, "tree_attention: q has head dim ", D, ", keys ", keys.size(2));
  TORCH_CHECK(D % 16 == 0 && D >= 16 && D <= 256,
              "tree_attention: head dim must be a multiple of 16 in 16..256, got ", D);
  TORCH_CHECK(kv > 0 && H % kv == 0, "tree_attention: ", H,
              " query heads are not a multiple of ", kv, " key/value heads");
  TORCH_CHECK(mask.dim() >= 2 && mask.size(-2) == n,
              "tree_attention: mask must be [n, L] with n = ", n, ", got ", mask.sizes());
  for (int64_t d = 0; d + 2 < mask.dim(); ++d)
    TORCH_CHECK(mask.size(d) == 1, "tree_attention: mask must be [n, L] (leading dims of size 1), got ",
                mask.sizes());
  const int64_t L = mask.size(-1);
  TORCH_CHECK(L >= 1 && L <= keys.size(1), "tree_attention: mask covers ", L,
              " entries, the cache holds ", keys.size(1));
  const at::Tensor q = q_in.contiguous();
  at::Tensor out = at::empty({n, H * D}, q.options());
  if (n == 0) return out;
  const Problem p{reinterpret_cast<const uint16_t*>(q.const_data_ptr()),
                  reinterpret_cast<const uint16_t*>(keys.const_data_ptr()),
                  reinterpret_cast<const uint16_t*>(values.const_data_ptr()),
                  keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
                  reinterpret_cast<const uint8_t*>(mask.const_data_ptr()),
                  mask.stride(-2), mask.stride(-1),
                  out.mutable_data_ptr<c10::BFloat16>(), n, H, H / kv, D, L,
                  static_cast<float>(scale)};
  const int64_t grain = std::max<int64_t>(1, kMinWork / (2 * (H / kv) * L * D));
  at::parallel_for(0, kv * n, grain, [&](int64_t begin, int64_t end) { Kernel::run(p, begin, end); });
  return out;
}

}  // namespace caddtree_attention

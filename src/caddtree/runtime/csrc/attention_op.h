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
#include <vector>

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

// The checks both entries share: q [n, H, D], and keys/values of D-dim heads whose count divides H.
inline void check_heads(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                        const at::Tensor& mask, int64_t key_dims) {
  TORCH_CHECK(q.device().is_cpu() && keys.device().is_cpu() && values.device().is_cpu() &&
                  mask.device().is_cpu(),
              "tree_attention: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && keys.scalar_type() == at::kBFloat16 &&
                  values.scalar_type() == at::kBFloat16,
              "tree_attention: bfloat16 q, keys and values expected");
  TORCH_CHECK(mask.scalar_type() == at::kBool, "tree_attention: a bool mask expected, got ",
              mask.scalar_type());
  TORCH_CHECK(q.dim() == 3, "tree_attention: q must be [n, H, D], got ", q.sizes());
  TORCH_CHECK(keys.dim() == key_dims && keys.sizes() == values.sizes(),
              "tree_attention: keys and values must both be ", key_dims == 3 ? "[kv, S, D]" : "[slots, kv, S, D]",
              ", got ", keys.sizes(), " and ", values.sizes());
  TORCH_CHECK(keys.stride(-1) == 1 && values.stride(-1) == 1,
              "tree_attention: keys and values need a contiguous last dim");
  const int64_t H = q.size(1), D = q.size(2), kv = keys.size(-3);
  TORCH_CHECK(keys.size(-1) == D, "tree_attention: q has head dim ", D, ", keys ", keys.size(-1));
  TORCH_CHECK(D % 16 == 0 && D >= 16 && D <= 256,
              "tree_attention: head dim must be a multiple of 16 in 16..256, got ", D);
  TORCH_CHECK(H > 0, "tree_attention: q has no heads (", q.sizes(), ")");
  TORCH_CHECK(kv > 0 && H % kv == 0, "tree_attention: ", H,
              " query heads are not a multiple of ", kv, " key/value heads");
}

template <class Kernel>
at::Tensor attention_op(const at::Tensor& q_in, const at::Tensor& keys, const at::Tensor& values,
                        const at::Tensor& mask, double scale) {
  check_heads(q_in, keys, values, mask, 3);
  const int64_t n = q_in.size(0), H = q_in.size(1), D = q_in.size(2), kv = keys.size(0);
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

// Several sequences in one call (caddtree::tree_attention_batch): q [N, H, D] holds each sequence's
// rows in turn; seqs [B, 3] gives per sequence (cache slot, rows, length L_b); keys and values are
// the whole cache [slots, kv, S, D]; row r of sequence b attends the first L_b entries of b's slot
// where mask [N, >= L_b] allows. Each sequence is the Problem tree_attention would make for it
// alone, so every row gets the same bits as there; one parallel loop runs all their items.
template <class Kernel>
at::Tensor batch_attention_op(const at::Tensor& q_in, const at::Tensor& keys,
                              const at::Tensor& values, const at::Tensor& mask,
                              const at::Tensor& seqs_in, double scale) {
  check_heads(q_in, keys, values, mask, 4);
  const int64_t n = q_in.size(0), H = q_in.size(1), D = q_in.size(2), kv = keys.size(1);
  TORCH_CHECK(mask.dim() == 2 && mask.size(0) == n,
              "tree_attention_batch: mask must be [n, L] with n = ", n, ", got ", mask.sizes());
  TORCH_CHECK(seqs_in.device().is_cpu() && seqs_in.scalar_type() == at::kLong && seqs_in.dim() == 2 &&
                  seqs_in.size(1) == 3,
              "tree_attention_batch: seqs must be int64 [B, 3] (slot, rows, length) on the CPU, got ",
              seqs_in.sizes());
  const at::Tensor seqs = seqs_in.contiguous(), q = q_in.contiguous();
  const int64_t* s = seqs.const_data_ptr<int64_t>();
  const int64_t B = seqs.size(0);
  std::vector<Problem> problems;
  std::vector<int64_t> firsts(B + 1, 0);  // items before each sequence's
  at::Tensor out = at::empty({n, H * D}, q.options());
  const auto* qb = reinterpret_cast<const uint16_t*>(q.const_data_ptr());
  const auto* kb = reinterpret_cast<const uint16_t*>(keys.const_data_ptr());
  const auto* vb = reinterpret_cast<const uint16_t*>(values.const_data_ptr());
  const auto* mb = reinterpret_cast<const uint8_t*>(mask.const_data_ptr());
  auto* ob = out.mutable_data_ptr<c10::BFloat16>();
  int64_t row = 0, work = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t slot = s[3 * b], count = s[3 * b + 1], L = s[3 * b + 2];
    TORCH_CHECK(slot >= 0 && slot < keys.size(0), "tree_attention_batch: slot ", slot,
                " is not in the cache's ", keys.size(0));
    TORCH_CHECK(count >= 0 && row + count <= n, "tree_attention_batch: sequence ", b, " has ",
                count, " rows; the rows left are ", n - row);
    TORCH_CHECK(L >= 1 && L <= mask.size(1) && L <= keys.size(2), "tree_attention_batch: sequence ",
                b, " attends ", L, " entries; the mask covers ", mask.size(1), ", the cache holds ",
                keys.size(2));
    problems.push_back(Problem{qb + row * H * D, kb + slot * keys.stride(0), vb + slot * values.stride(0),
                               keys.stride(1), keys.stride(2), values.stride(1), values.stride(2),
                               mb + row * mask.stride(0), mask.stride(0), mask.stride(1),
                               ob + row * H * D, count, H, H / kv, D, L, static_cast<float>(scale)});
    firsts[b + 1] = firsts[b] + kv * count;
    row += count;
    work += count * L;
  }
  TORCH_CHECK(row == n, "tree_attention_batch: the sequences hold ", row, " rows, q has ", n);
  if (n == 0) return out;
  const int64_t grain = std::max<int64_t>(1, kMinWork * n / (2 * (H / kv) * work * D));
  at::parallel_for(0, firsts[B], grain, [&](int64_t begin, int64_t end) {
    int64_t b = std::upper_bound(firsts.begin(), firsts.end(), begin) - firsts.begin() - 1;
    for (; begin < end; ++b) {  // each sequence's part of begin .. end - 1, in its own items
      const int64_t stop = std::min(end, firsts[b + 1]);
      Kernel::run(problems[b], begin - firsts[b], stop - firsts[b]);
      begin = stop;
    }
  });
  return out;
}

}  // namespace caddtree_attention

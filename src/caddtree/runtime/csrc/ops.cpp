// The schemas of caddtree's CPU kernels (one library, built from every file here by
// caddtree.runtime.kernels); each kernel's file registers its implementation.

#include <torch/library.h>

TORCH_LIBRARY(caddtree, m) {
  m.def("linear_bf16(Tensor x, Tensor w, Tensor? bias=None, int n=-1) -> Tensor");
  m.def("tree_attention(Tensor q, Tensor keys, Tensor values, Tensor mask, float scale) -> Tensor");
  m.def(
      "tree_attention_batch(Tensor q, Tensor keys, Tensor values, Tensor mask, Tensor seqs, "
      "float scale) -> Tensor");
  // GGUF block formats (linear_q.cpp; linear_q_avx2.cpp): kind is ggml's type id
  m.def("linear_q(Tensor x, Tensor w, int kind, int n, Tensor? bias=None) -> Tensor");
  m.def("quantize_input(Tensor x) -> (Tensor, Tensor)");
}

"""caddtree's own target runtime: the forward of a Llama-family or Qwen3 target without
transformers, and its CPU kernels.

* :class:`~caddtree.runtime.verifier.Verifier` (``verifier``) - the protocol every target runtime
  keeps (prefill, verify a tree in one forward, commit, discard, truncate); transformers' verifier
  (:class:`caddtree.models.target.TreeVerifier`) and caddtree's both build on it.
* :class:`~caddtree.runtime.lean.LeanVerifier` / ``LeanTarget`` (``lean``) - the eager forward,
  batched over many requests' rows (``rows``), its layers (``layers``) compiled by ``compiled``.
* ``kernels`` and ``csrc/`` - the C++ kernels (bfloat16 and quantized linear layers, tree
  attention), built once per machine; ``packing`` lays bfloat16 weights out for them;
  ``quantized`` and ``gguf_blocks`` compute GGUF's quantized blocks as the file holds them.
"""

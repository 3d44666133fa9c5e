"""caddtree's forward on quantized GGUF files of real model shapes, beside llama.cpp's decoding of
the same files, and a projection of CaDDTree's time per token from them.

    python benchmarks/real_shapes.py [--shapes smollm2-1.7b smollm2-360m] [--formats Q4_0 Q8_0]
                                     [--depth 300] [--rows 1 3 4 5 8 9 ...] [--repeats 5]
                                     [--runtime compiled] [--draft-fraction 0.25] [--json PATH]

For each shape and block format it writes, once, a GGUF of random weights of that shape (random
block integers and scales: the arithmetic and the bytes read are those of a real file, the text is
noise), with SmolLM2's tokenizer copied from the built-in target's file (SmolLM2-360M and -1.7B
use it) and its output head tied to a Q8_0 ``token_embd``; files are cached in
``<cache root>/real-shapes/``. It then times, in alternating rounds:

* llama.cpp (``benchmarks/vs_llamacpp.py``'s build): ``llama-bench -p 0 -n 32 -d DEPTH``, ms per
  generated token after DEPTH tokens of context;
* caddtree: the target's verification of a bonus row and a tree of ``n - 1`` nodes after a
  DEPTH-token prefill, for each ``n`` in ``--rows`` (the lean runtime's layers on the file's
  blocks; the model object is made on the meta device, so no float copy of the weights exists).

The projection takes the built-in pair's measured acceptance (τ at each DDTree budget, from
``docs/results/default-pair/``, passed as ``--tau``) and these forward times, and a drafter pass
costing ``--draft-fraction`` of the one-row forward (a DFlash drafter of a few layers: the
built-in one costs about a quarter of the 135M target's quantized forward), and prints, per
budget, (C_d + C_v(n)) / τ(n) beside llama.cpp's ms per token. It is a projection, not a
measurement: a drafter trained for that target would have its own τ and its own cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from caddtree.core.profiling import profiling_tree  # noqa: E402
from caddtree.runtime.gguf_blocks import read_blocks  # noqa: E402
from caddtree.util.defaults import cache_root, smollm2_gguf_path  # noqa: E402
from caddtree.util.devices import machine_description  # noqa: E402
from caddtree.util.files import atomic_write, atomic_write_text  # noqa: E402

SHAPES = {  # SmolLM2's published configurations (all tie the head to the embeddings)
    "smollm2-360m": dict(layers=32, hidden=960, heads=15, kv_heads=5, ffn=2560, theta=100000.0),
    "smollm2-1.7b": dict(layers=24, hidden=2048, heads=32, kv_heads=32, ffn=8192, theta=130000.0),
}
VOCAB = 49152
BLOCK_BYTES = {"Q4_0": (2, 16), "Q8_0": (2, 32)}  # (scale bytes, integer bytes) per 32 columns
GGML_TYPES = {"Q4_0": 2, "Q8_0": 8}


def random_blocks(rng: np.random.Generator, rows: int, cols: int, fmt: str) -> np.ndarray:
    """Random ``fmt`` blocks of a [rows, cols] weight: scales of about 0.002, random integers."""
    scale_bytes, int_bytes = BLOCK_BYTES[fmt]
    blocks = rng.integers(0, 256, size=(rows, cols // 32, scale_bytes + int_bytes), dtype=np.uint8)
    scales = (rng.random((rows, cols // 32), dtype=np.float32) * 0.004).astype(np.float16)
    blocks[..., :2] = scales.view(np.uint8).reshape(rows, cols // 32, 2)
    return blocks.reshape(rows, -1)


def write_file(path: Path, shape: dict, fmt: str) -> None:
    """A GGUF of ``shape`` with random ``fmt`` layers, a Q8_0 token_embd and SmolLM2's tokenizer."""
    import gguf

    source = gguf.GGUFReader(str(smollm2_gguf_path()))
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(shape["layers"])
    writer.add_context_length(8192)
    writer.add_embedding_length(shape["hidden"])
    writer.add_feed_forward_length(shape["ffn"])
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_rope_freq_base(shape["theta"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_rope_dimension_count(shape["hidden"] // shape["heads"])
    for key, field in source.fields.items():
        if key.startswith("tokenizer."):
            array = field.types[0] == gguf.GGUFValueType.ARRAY
            sub = field.types[-1] if array else None
            writer.add_key_value(key, field.contents(), field.types[0], sub)
    rng = np.random.default_rng(0)
    h, f = shape["hidden"], shape["ffn"]
    kv = shape["kv_heads"] * h // shape["heads"]
    q8 = gguf.GGMLQuantizationType.Q8_0
    writer.add_tensor("token_embd.weight", random_blocks(rng, VOCAB, h, "Q8_0"), raw_dtype=q8)
    writer.add_tensor("output_norm.weight", np.ones(h, np.float32))
    kind = gguf.GGMLQuantizationType(GGML_TYPES[fmt])
    for i in range(shape["layers"]):
        for name, rows, cols in (
            ("attn_q", h, h),
            ("attn_k", kv, h),
            ("attn_v", kv, h),
            ("attn_output", h, h),
            ("ffn_gate", f, h),
            ("ffn_up", f, h),
            ("ffn_down", h, f),
        ):
            writer.add_tensor(
                f"blk.{i}.{name}.weight", random_blocks(rng, rows, cols, fmt), raw_dtype=kind
            )
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(h, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(h, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def shape_file(name: str, fmt: str) -> Path:
    path = cache_root() / "real-shapes" / f"{name}-random.{fmt}.gguf"
    if not path.is_file():
        print(f"writing {path} (once)", flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda tmp: write_file(Path(tmp), SHAPES[name], fmt))
    return path


def meta_model(shape: dict):
    """A LlamaForCausalLM of ``shape`` whose linear weights stay on the meta device (the lean
    runtime computes them from the file's blocks): real embeddings, norms and rotary tables only."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=shape["hidden"],
        intermediate_size=shape["ffn"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": shape["theta"]},
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    inner = model.model
    inner.embed_tokens.weight = torch.nn.Parameter(
        torch.randn(VOCAB, shape["hidden"]).bfloat16() * 0.02, requires_grad=False
    )
    model.lm_head.weight = inner.embed_tokens.weight
    for module in [
        inner.norm,
        *(
            m
            for layer in inner.layers
            for m in (layer.input_layernorm, layer.post_attention_layernorm)
        ),
    ]:
        module.weight = torch.nn.Parameter(
            torch.ones(shape["hidden"], dtype=torch.bfloat16), requires_grad=False
        )
    inner.rotary_emb = LlamaRotaryEmbedding(config)
    return model.eval()


def caddtree_forwards(path: Path, shape: dict, args: argparse.Namespace):
    from caddtree.runtime.lean import LeanVerifier

    blocks = read_blocks(path)
    compile = "on" if args.runtime == "compiled" else "off"
    verifier = LeanVerifier(meta_model(shape), (), compile=compile, blocks=blocks, progress=True)
    context = torch.randint(0, VOCAB, (args.depth,)).tolist()
    trees = {n: profiling_tree(n - 1, 15, VOCAB) for n in args.rows}
    verifier.reset()
    verifier.prefill(context)

    def forward(n: int) -> float:
        start = time.perf_counter()
        verifier.verify(7, trees[n])
        seconds = time.perf_counter() - start
        verifier.discard()
        return seconds

    for n in args.rows:  # warm-up
        forward(n)
    return verifier.target.weight_format, forward


def llama_tg(bins: Path, path: Path, args: argparse.Namespace) -> float:
    import vs_llamacpp

    cmd = [str(bins / "llama-bench"), "-m", str(path), "-t", str(args.threads), "-o", "json"]
    out = vs_llamacpp.run([*cmd, "-p", "0", "-n", "32", "-d", str(args.depth), "-r", "1"])
    (record,) = json.loads(out)
    return statistics.median(record["samples_ns"]) / record["n_gen"] / 1e6


def project(forward_ms: dict[int, float], llama_ms: float, args: argparse.Namespace) -> list[str]:
    draft = args.draft_fraction * forward_ms[1]
    lines = []
    for pair in args.tau:
        budget, tau = pair.split(":")
        rows = int(budget) + 1
        near = min(forward_ms, key=lambda n: abs(n - rows))
        ms = (draft + forward_ms[near]) / float(tau)
        lines.append(
            f"    DDTree-{budget} (tau {tau}, forward of {near} rows): {ms:.1f} ms/token, "
            f"{ms / llama_ms:.2f}x llama.cpp"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["smollm2-1.7b"], choices=list(SHAPES))
    parser.add_argument("--formats", nargs="+", default=["Q4_0"], choices=list(BLOCK_BYTES))
    parser.add_argument("--depth", type=int, default=300)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 3, 4, 5, 8, 9, 16, 17, 32, 33])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--runtime", choices=["compiled", "lean"], default="compiled")
    parser.add_argument("--draft-fraction", type=float, default=0.25)
    parser.add_argument(
        "--tau",
        nargs="+",
        default=["2:1.58", "4:1.83", "8:1.82", "16:1.96", "32:2.09"],
        help="BUDGET:TAU pairs: the built-in pair's DDTree on HumanEval (budgets 2 and 4: "
        "docs/results/default-pair/small-budgets/, 10 prompts; 8 to 32: "
        "docs/results/default-pair/report.md, 20 prompts)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import vs_llamacpp

    bins, _ = vs_llamacpp.llama_cpp()
    print(machine_description(torch.device("cpu")), f"{args.threads} threads", flush=True)
    results = []
    for name in args.shapes:
        for fmt in args.formats:
            path = shape_file(name, fmt)
            weights, forward = caddtree_forwards(path, SHAPES[name], args)
            llama_tg(bins, path, args)  # warm-up (page cache)
            ours: dict[int, list[float]] = {n: [] for n in args.rows}
            theirs = []
            for k in range(args.repeats):
                for side in ("llama.cpp", "caddtree") if k % 2 == 0 else ("caddtree", "llama.cpp"):
                    if side == "llama.cpp":
                        theirs.append(llama_tg(bins, path, args))
                    else:
                        for n in args.rows:
                            ours[n].append(forward(n) * 1e3)
            llama_ms = statistics.median(theirs)
            forward_ms = {n: statistics.median(v) for n, v in ours.items()}
            print(
                f"\n{name}, {fmt} file ({weights}), context {args.depth}, median of {args.repeats}"
            )
            print(f"  llama.cpp decoding: {llama_ms:.1f} ms/token")
            for n, ms in forward_ms.items():
                print(
                    f"  caddtree forward of {n:>2} rows: {ms:7.1f} ms  ({ms / llama_ms:.2f}x "
                    f"llama.cpp's token, {ms / forward_ms[1]:.2f}x one row)"
                )
            print(f"  projection (drafter pass = {args.draft_fraction} of one row's forward):")
            print("\n".join(project(forward_ms, llama_ms, args)))
            results.append(
                {
                    "shape": name,
                    "format": fmt,
                    "weights": weights,
                    "llama_ms": llama_ms,
                    "llama_samples": theirs,
                    "forward_ms": forward_ms,
                    "forward_samples": ours,
                }
            )
    if args.json:
        meta = {"machine": machine_description(torch.device("cpu")), "args": vars(args)}
        atomic_write_text(
            args.json, json.dumps({**meta, "results": results}, indent=1, default=str)
        )


if __name__ == "__main__":
    main()

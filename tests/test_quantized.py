"""GGUF's quantized blocks computed directly (caddtree.runtime.quantized, csrc/linear_q.cpp): the
kernel's products against float64 references built from the gguf package's own de-quantization,
a row's bits alone and among others, and every decoding method equal to plain decoding on
quantized weights; reading blocks from a GGUF file, and its errors."""

from __future__ import annotations

import functools
from functools import partial

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from caddtree.engine.batching import BatchDecoder, GenerationRequest
from caddtree.engine.decoding import make_policy
from caddtree.models import DFlashProposer
from caddtree.runtime.gguf_blocks import Blocks, check_blocks, read_blocks
from caddtree.runtime.layers import FUSED_LINEARS
from caddtree.runtime.lean import LeanTarget, LeanVerifier
from caddtree.runtime.quantized import (
    QUANT_KINDS,
    QuantLinear,
    QuantStack,
    kind_name,
    pack_blocks,
    quantized_kernel_available,
)
from caddtree.util.errors import CheckpointError
from kquants import SUPER, quantize_k
from oracle import OracleProposer, decode_with
from test_decoding import POLICIES, PROMPTS
from tiny_models import FEATURE_LAYER_IDS, llama_target, new_drafter, qwen3_target

pytestmark = pytest.mark.skipif(
    not quantized_kernel_available(),
    reason="the quantized kernel needs caddtree's kernels (AVX512-BF16 or AVX2, and g++)",
)

PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def quantize(weight: np.ndarray, kind: int) -> np.ndarray:
    if kind_name(kind).endswith("_K"):  # the gguf package reads these but does not write them
        return quantize_k(weight, kind_name(kind))
    return gguf.quants.quantize(weight.astype(np.float32), GGMLQuantizationType(kind))


def whole_blocks(k: int, kind: int) -> int:
    """``k`` rounded up to whole blocks of ``kind`` (the K formats' super-blocks of 256)."""
    columns = SUPER if kind_name(kind).endswith("_K") else 32
    return -(-k // columns) * columns


def dequantize(raw: np.ndarray, kind: int) -> np.ndarray:
    return gguf.quants.dequantize(raw, GGMLQuantizationType(kind))


def quantized_input(x: torch.Tensor) -> np.ndarray:
    """The kernel's arithmetic on the input, written out: per block of 32, d = max|x| / 127 and
    q = x / d rounded to nearest even (float32), as float64 values q * d."""
    rows, k = x.shape
    blocks = x.float().numpy().reshape(rows, k // 32, 32)
    d = np.abs(blocks).max(-1) / np.float32(127)
    inverse = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    q = np.rint(blocks * inverse[..., None])
    return (q * d[..., None].astype(np.float64)).reshape(rows, k), q.reshape(rows, k), d


@pytest.mark.parametrize("kind", QUANT_KINDS.values(), ids=QUANT_KINDS.keys())
@pytest.mark.parametrize(("n", "k"), [(45, 96), (64, 32), (100, 1536), (33, 576), (1, 160)])
@pytest.mark.parametrize("rows", [1, 3, 8, 13])
def test_the_kernel_computes_the_product_of_the_blocks(kind, n, k, rows):
    k = whole_blocks(k, kind)
    rng = np.random.default_rng(n * k + rows)
    raw = quantize(rng.standard_normal((n, k)), kind)
    weight = dequantize(raw, kind).astype(np.float64)  # the gguf package's reading of the blocks
    bias = torch.randn(n).bfloat16() if rows % 2 else None
    x = torch.randn(rows, k).bfloat16()
    out = QuantLinear(pack_blocks(raw, kind), kind, n, bias)(x)
    assert out.dtype is torch.bfloat16 and out.shape == (rows, n)
    inputs, _, _ = quantized_input(x)
    exact = inputs @ weight.T + (0 if bias is None else bias.double().numpy())
    # float32 sums over k / 32 blocks, then one rounding to bfloat16 (half an ulp: 2^-8)
    scale = np.abs(inputs) @ np.abs(weight).T + np.abs(exact)
    error = np.abs(out.double().numpy() - exact)
    assert (error <= 2.0**-8 * np.abs(exact) + (k // 32 + 4) * 2.0**-22 * scale).all()


def test_the_q6_k_writer_gives_scales_of_both_signs():
    # Q6_K's block: 128 bytes of low nibbles, 64 of high bits, then 16 int8 scales
    raw = quantize_k(np.random.default_rng(0).standard_normal((8, SUPER)), "Q6_K")
    scales = raw.reshape(8, -1)[:, 192:208].view(np.int8)
    assert (scales < 0).any() and (scales > 0).any()


def test_the_input_is_quantized_as_written():
    x = torch.randn(7, 96).bfloat16()
    x[2, 32:64] = 0  # an all-zero block: scale 0, integers 0
    q, d = torch.ops.caddtree.quantize_input(x)
    _, expected_q, expected_d = quantized_input(x)
    assert np.array_equal(q.numpy(), expected_q.astype(np.int8))
    assert np.array_equal(d.numpy(), expected_d)


@pytest.mark.parametrize("kind", QUANT_KINDS.values(), ids=QUANT_KINDS.keys())
def test_a_row_gives_the_same_bits_alone_or_among_others(kind):
    rng = np.random.default_rng(kind)
    raw = quantize(rng.standard_normal((200, 768)), kind)
    linear = QuantLinear(pack_blocks(raw, kind), kind, 200)
    x = torch.randn(64, 768).bfloat16()
    together = linear(x)
    for count in (1, 2, 4, 5, 7, 8, 13, 64):  # pass sizes 1-4 and 5-8, and splits of more
        for start in range(0, 64, count):
            part = linear(x[start : start + count])
            assert torch.equal(part, together[start : start + count]), (count, start)


def test_bad_inputs_get_clear_errors():
    raw = quantize(np.ones((32, 64)), 3)
    packed = pack_blocks(raw, 3)
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="block format 5"):
        torch.ops.caddtree.linear_q(x, packed, 5, 32)
    with pytest.raises(RuntimeError, match="packed by"):
        torch.ops.caddtree.linear_q(x, packed, 8, 32)
    with pytest.raises(RuntimeError, match="input has 63 features"):
        torch.ops.caddtree.linear_q(torch.randn(2, 63).bfloat16(), packed, 3, 32)
    with pytest.raises(RuntimeError, match="bfloat16 input"):
        torch.ops.caddtree.linear_q(x.float(), packed, 3, 32)
    with pytest.raises(ValueError, match="whole 20-byte blocks"):
        pack_blocks(raw[:, :-1], 3)


WIDE = {"hidden_size": 256, "intermediate_size": 256, "head_dim": 128}
"""A tiny model whose every linear layer has whole 256-column super-blocks (the K formats)."""

MIXES = {"Q4_K_M": (12, 14), "Q5_K_M": (13, 14)}
"""Files of two types, as llama.cpp's Q4_K_M and Q5_K_M write them: most weights in the first,
some v and down projections and the head in Q6_K (here those of even layers)."""


def kind_of(kind: int | str, name: str) -> int:
    """The type of weight ``name`` in a file of one type, or of a mix of :data:`MIXES`."""
    if isinstance(kind, int):
        return kind
    most, more_bits = MIXES[kind]
    layer = name.split(".")[2] if name.startswith("model.layers.") else None
    wide = name == "lm_head" or (
        layer is not None and int(layer) % 2 == 0 and name.endswith(("v_proj", "down_proj"))
    )
    return more_bits if wide else most


def quantized_model(model, kind: int | str):
    """``model`` in bfloat16 with every linear weight replaced by its blocks' values (of type
    ``kind``, or as a mix of :data:`MIXES` types them), and those blocks by parameter name (as
    :func:`read_blocks` gives a file's)."""
    model = model.to(torch.bfloat16)
    blocks = {}
    names = [f"model.layers.{i}.{p}" for i in range(len(model.model.layers)) for p in PROJECTIONS]
    with torch.no_grad():
        for name in [*names, "lm_head"]:
            module = model.get_submodule(name)
            part = kind_of(kind, name)
            raw = quantize(module.weight.float().numpy(), part)
            module.weight.copy_(torch.from_numpy(dequantize(raw, part)))
            blocks[f"{name}.weight"] = Blocks(raw, part, tuple(module.weight.shape))
    check_blocks(blocks, model)
    return model, blocks


MODEL_KINDS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", *MIXES]


@functools.cache
def quantized_pair(name: str):
    """(model, blocks, drafter) for a file of type ``name`` (or a mix of :data:`MIXES`)."""
    kind = name if name in MIXES else QUANT_KINDS[name]
    shape = WIDE if name in MIXES else {}
    model, blocks = quantized_model(qwen3_target(**shape), kind)
    return model, blocks, new_drafter(qwen3_target(**shape)).to(torch.bfloat16)


@pytest.fixture(scope="module", params=MODEL_KINDS, ids=MODEL_KINDS)
def quantized(request):
    return quantized_pair(request.param)


def test_the_runtime_computes_every_linear_layer_on_the_blocks(quantized):
    model, blocks, _ = quantized
    target = LeanTarget(model, FEATURE_LAYER_IDS, blocks=blocks)
    for i, layer in enumerate(target.layers):
        fused = {"qkv": layer.qkv, "o": layer.o, "gate_up": layer.gate_up, "down": layer.down}
        for key, linear in fused.items():
            kinds = [blocks[f"model.layers.{i}.{name}.weight"].kind for name in FUSED_LINEARS[key]]
            assert isinstance(linear, QuantLinear | QuantStack)
            runs = [k for j, k in enumerate(kinds) if j == 0 or kinds[j - 1] != k]
            assert list(linear.kinds) == runs, (i, key)
    assert isinstance(target.head, QuantLinear)
    names = sorted({kind_name(block.kind) for block in blocks.values()})
    assert target.weight_format == "+".join(names)
    # close to the same weights in bfloat16 (the inputs' int8 rounding aside)
    plain = LeanVerifier(model, (), compile="off")
    ours = LeanVerifier(model, (), compile="off", blocks=blocks)
    ids = torch.tensor([5, 17, 3, 44, 8, 21, 30])
    plain.reset()
    ours.reset()
    a, b = plain.prefill(ids)[0].float(), ours.prefill(ids)[0].float()
    assert (a - b).abs().max() < 0.1 * a.abs().max()


@pytest.mark.parametrize("drafter_kind", ["dflash", "noisy-oracle"])
def test_every_method_equals_plain_decoding_on_quantized_weights(quantized, drafter_kind):
    model, blocks, drafter = quantized
    verifier = partial(LeanVerifier, compile="off", blocks=blocks)
    for prompt in PROMPTS:
        reference = None
        for method, kwargs in POLICIES:
            if drafter_kind == "dflash":
                proposer = DFlashProposer(drafter, model)
            else:
                proposer = OracleProposer(model, prompt, mode="noisy")
            result = decode_with(
                model, prompt, method, kwargs, proposer, 24, verifier_type=verifier
            )
            reference = reference or result.token_ids
            assert result.token_ids == reference, (method, kwargs)


def test_batches_with_joins_and_leaves_equal_plain_decoding(quantized):
    model, blocks, drafter = quantized
    target = LeanTarget(model, FEATURE_LAYER_IDS, blocks=blocks)
    policies = [make_policy(m, **k) for m, k in POLICIES[:6]]
    alone = [
        BatchDecoder(target, drafter, max_batch=1, capacity=64)
        .run([GenerationRequest(prompt, make_policy("ar"), 30)])[0]
        .output
        for prompt in PROMPTS
    ]
    requests = [
        GenerationRequest(PROMPTS[i % len(PROMPTS)], policy, 12 + 3 * i)
        for i, policy in enumerate(policies)
    ]
    done = BatchDecoder(target, drafter, max_batch=3, capacity=64).run(requests)
    for request in done:
        expected = alone[PROMPTS.index(list(request.prompt_ids))][: request.max_new_tokens]
        assert request.output == expected, request.policy.name


# ---- GGUF files ------------------------------------------------------------------------------------


def permute_for_ggml(rows: np.ndarray, heads: int) -> np.ndarray:
    """The row order llama.cpp's converter writes a Llama q or k weight in."""
    shape = rows.shape
    return rows.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def write_gguf(path, model, blocks, arch: str = "llama", tied: bool = False) -> None:
    """``model``'s linear weights as a GGUF of ``arch`` holding their ``blocks`` (by parameter
    name; q and k rows permuted as llama.cpp writes Llama files, Qwen3 files as they are), norms
    in float32, and the head as ``output.weight``, or (``tied``) as ``token_embd.weight`` with no
    output tensor."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.attention.head_count", config.num_attention_heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", config.num_key_value_heads)
    files = {"attn_q": 0, "attn_k": 1, "attn_v": 2, "attn_output": 3, "ffn_gate": 4}
    files.update({"ffn_up": 5, "ffn_down": 6})
    for i in range(len(model.model.layers)):
        for name, index in files.items():
            block = blocks[f"model.layers.{i}.{PROJECTIONS[index]}.weight"]
            raw = block.raw
            if name in ("attn_q", "attn_k") and arch == "llama":
                heads = (
                    config.num_attention_heads if name == "attn_q" else config.num_key_value_heads
                )
                raw = permute_for_ggml(raw, heads)
            kind = GGMLQuantizationType(block.kind)
            writer.add_tensor(f"blk.{i}.{name}.weight", raw, raw_dtype=kind)
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(config.hidden_size, np.float32))
    head = blocks["lm_head.weight"]
    name = "token_embd.weight" if tied else "output.weight"
    writer.add_tensor(name, head.raw, raw_dtype=GGMLQuantizationType(head.kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(
    ("arch", "tied"), [("llama", False), ("llama", True), ("qwen3", False)], ids=str
)
def test_blocks_read_from_a_gguf_file_are_the_models_weights(tmp_path, arch, tied):
    target = llama_target(num_key_value_heads=2) if arch == "llama" else qwen3_target()
    model, blocks = quantized_model(target, 8)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, model, blocks, arch=arch, tied=tied)
    read = read_blocks(path)
    assert set(read) == set(blocks)
    for name, block in blocks.items():
        assert read[name].kind == 8 and read[name].shape == block.shape
        assert np.array_equal(read[name].raw, block.raw), name  # q and k back in model order
    check_blocks(read, model)


def test_a_q4_k_m_file_runs_on_its_blocks_of_both_types(tmp_path):
    """A Llama file as llama.cpp's Q4_K_M writes it (Q4_K, with some v and down projections and
    the head in Q6_K): read in model order, checked, and every linear on its own blocks (a q, k, v
    of two types side by side)."""
    model, blocks = quantized_model(llama_target(num_key_value_heads=2, **WIDE), "Q4_K_M")
    path = tmp_path / "tiny.Q4_K_M.gguf"
    write_gguf(path, model, blocks)
    read = read_blocks(path)
    for name, block in blocks.items():
        assert read[name].kind == block.kind and np.array_equal(read[name].raw, block.raw), name
    check_blocks(read, model)
    target = LeanTarget(model, FEATURE_LAYER_IDS, blocks=read)
    assert target.weight_format == "Q4_K+Q6_K"
    assert isinstance(target.layers[0].qkv, QuantStack) and target.layers[0].qkv.kinds == (12, 14)
    assert isinstance(target.layers[1].qkv, QuantLinear)


def test_a_wrong_head_count_is_caught_by_the_check(tmp_path):
    """q's first rows come from head 0 whatever head count un-permutes them; its last rows show a
    wrong one."""
    model, blocks = quantized_model(llama_target(num_key_value_heads=2), 8)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, model, blocks)
    read = read_blocks(path)
    name = "model.layers.0.self_attn.q_proj.weight"
    from caddtree.runtime.gguf_blocks import _unpermute

    raw = permute_for_ggml(blocks[name].raw, 2)
    read[name] = read[name]._replace(raw=_unpermute(raw, 1))
    with pytest.raises(CheckpointError, match="q_proj.weight does not hold"):
        check_blocks(read, model)


def test_files_that_are_not_the_models_or_not_computable_are_refused(tmp_path):
    model, blocks = quantized_model(llama_target(num_key_value_heads=2), 3)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, model, blocks)
    other, _ = quantized_model(llama_target(num_key_value_heads=2, seed=7), 3)
    with pytest.raises(CheckpointError, match="does not hold the model's weights"):
        check_blocks(read_blocks(path), other)
    gpt2 = tmp_path / "gpt2.gguf"
    write_gguf(gpt2, model, blocks, arch="gpt2")
    with pytest.raises(CheckpointError, match="architecture 'gpt2'.*--dequantize"):
        read_blocks(gpt2)
    data = path.read_bytes()
    for size, name in ((len(data) // 2, "half"), (20, "header"), (0, "empty")):
        cut = tmp_path / f"{name}.gguf"
        cut.write_bytes(data[:size])
        with pytest.raises(CheckpointError, match="not a readable GGUF file"):
            read_blocks(cut)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        read_blocks(garbage)


def test_the_models_own_weights_are_freed_where_blocks_run():
    model, blocks = quantized_model(qwen3_target(), 8)
    verifier = LeanVerifier(model, (), compile="off", blocks=blocks)
    ids = torch.tensor([5, 17, 3, 44, 8])
    verifier.reset()
    before = verifier.prefill(ids)[0]
    assert verifier.target.release_quantized_sources() == 7 * len(model.model.layers)
    assert model.model.layers[0].mlp.down_proj.weight.device.type == "meta"
    verifier.reset()
    assert torch.equal(verifier.prefill(ids)[0], before)


def test_a_generator_on_blocks_says_what_it_computes_on(tmp_path):
    from caddtree.api import SpeculativeGenerator
    from caddtree.profiles import cost_ident
    from caddtree.runtime.gguf_blocks import gguf_location, gguf_source

    model, blocks = quantized_model(qwen3_target(), 3)
    drafter = new_drafter(qwen3_target()).to(torch.bfloat16)
    gen = SpeculativeGenerator(model, None, drafter, runtime="lean", blocks=blocks)
    plain = SpeculativeGenerator(model, None, drafter, runtime="lean")
    assert (gen.weight_format, plain.weight_format) == ("Q4_1", "bfloat16")
    assert cost_ident(gen)["weights"] == "Q4_1" and cost_ident(plain)["weights"] == "bfloat16"
    ar = gen.generate([5, 17, 3], method="ar", max_new_tokens=12).token_ids
    assert gen.generate([5, 17, 3], method="ddtree", budget=8, max_new_tokens=12).token_ids == ar

    file = tmp_path / "model.Q4_1.gguf"
    file.write_bytes(b"")
    assert gguf_location(file, None) == (str(tmp_path), "model.Q4_1.gguf")
    assert gguf_location(tmp_path, None) == (tmp_path, None)
    assert gguf_source(tmp_path, "model.Q4_1.gguf") == file
    assert gguf_source(tmp_path, None) is None  # no file named by a cache marker


AVX2_BUILD = """
import sys
import torch
from caddtree.runtime import kernels
kernels._variant = lambda: kernels._AVX2  # this CPU may have AVX-512: build the AVX2 kernels
from caddtree.runtime.quantized import QuantLinear, quantized_kernel_available
assert quantized_kernel_available() and kernels.kernel_variant() == "avx2"
case = torch.load(sys.argv[1], weights_only=True)
out = {"q": torch.ops.caddtree.quantize_input(case["x"])[0]}
for kind in case["kinds"].tolist():
    out[str(kind)] = QuantLinear(case[f"w{kind}"], kind, int(case["n"]), case["bias"])(case["x"])
    out[f"{kind}-alone"] = QuantLinear(case[f"w{kind}"], kind, int(case["n"]))(case["x"][3:4])
torch.save(out, sys.argv[2])
"""


def test_the_avx2_build_computes_the_same_bits(tmp_path):
    """The AVX2 kernel (built here whatever the CPU, in a process of its own) gives every format
    the same bits as this CPU's build: the same quantized inputs and integer sums, the same float
    steps."""
    import subprocess
    import sys

    rng = np.random.default_rng(5)
    n, k = 45, 768  # 24 blocks, 3 super-blocks
    case = {"x": torch.randn(13, k).bfloat16(), "n": torch.tensor(n), "bias": torch.randn(n)}
    case["kinds"] = torch.tensor(list(QUANT_KINDS.values()))
    for kind in QUANT_KINDS.values():
        case[f"w{kind}"] = pack_blocks(quantize(rng.standard_normal((n, k)), kind), kind)
    torch.save(case, tmp_path / "case.pt")
    script = tmp_path / "avx2.py"
    script.write_text(AVX2_BUILD)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "case.pt"), str(tmp_path / "out.pt")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = torch.load(tmp_path / "out.pt", weights_only=True)
    assert torch.equal(theirs["q"], torch.ops.caddtree.quantize_input(case["x"])[0])
    for kind in QUANT_KINDS.values():
        ours = QuantLinear(case[f"w{kind}"], kind, n, case["bias"])(case["x"])
        assert torch.equal(theirs[str(kind)], ours), kind
        alone = QuantLinear(case[f"w{kind}"], kind, n)(case["x"][3:4])
        assert torch.equal(theirs[f"{kind}-alone"], alone), kind


def test_sampling_on_quantized_weights_keeps_the_runtimes_distribution():
    """At temperature 1 the first three tokens are distributed as the quantized runtime's own
    next-token distributions say (the target a user runs is the file's blocks): a DDTree walk on
    them, chi-square per token at alpha = 1e-3 (as tests/test_decoding.py does for float64)."""
    from caddtree.core.tree import build_ddtree
    from sampling_checks import assert_first_token_marginals, ddtree_first_tokens, sharp_qwen3
    from tiny_models import VOCAB

    model, blocks = quantized_model(sharp_qwen3(), 8)
    verifier_type = partial(LeanVerifier, compile="off", blocks=blocks)
    prompt, n = [5, 17, 3], 800
    counts, accepted = ddtree_first_tokens(model, prompt, n, verifier_type, seed=2000)
    assert accepted > n // 4  # the tree walk is really exercised

    # the exact marginals from the runtime itself: after the prompt, then for every first token
    # a, one verification of a and all VOCAB second tokens b below it (a row's logits are the
    # same bits in a tree as alone)
    verifier = verifier_type(model, ())
    verifier.reset()
    p1 = torch.softmax(verifier.prefill(prompt)[0].double(), -1)
    children = build_ddtree(np.zeros((1, VOCAB)), VOCAB)
    order = torch.as_tensor(children.token_ids)
    p2_given = torch.empty(VOCAB, VOCAB, dtype=torch.float64)
    p3_given = torch.empty(VOCAB, VOCAB, VOCAB, dtype=torch.float64)
    for a in range(VOCAB):
        logits = verifier.verify(a, children)[0].double()
        verifier.discard()
        p2_given[a] = torch.softmax(logits[0], -1)
        p3_given[a, order] = torch.softmax(logits[1:], -1)
    p2 = p1 @ p2_given
    p3 = torch.einsum("a,ab,abc->c", p1, p2_given, p3_given)
    assert_first_token_marginals(counts, [p1, p2, p3])


def test_non_finite_inputs_give_non_finite_outputs_in_their_row_only():
    raw = quantize(np.random.default_rng(0).standard_normal((40, 64)), 3)
    linear = QuantLinear(pack_blocks(raw, 3), 3, 40)
    x = torch.randn(3, 64).bfloat16()
    clean = linear(x)
    x[1, 5], x[2, 40] = float("nan"), float("inf")
    out = linear(x)
    assert torch.equal(out[0], clean[0])
    assert out[1].isnan().all() and out[2].isnan().all()


@pytest.mark.parametrize("name", ["Q4_1", "Q4_K_M"])  # the built-in file's, and two types mixed
def test_the_compiled_runtime_on_blocks_equals_plain_decoding(name):
    """The runtime ``auto`` picks: the lean layers compiled by inductor, on the file's blocks."""
    model, blocks, drafter = quantized_pair(name)
    compiled = partial(LeanVerifier, compile="on", blocks=blocks, progress=False)
    prompt = PROMPTS[0]
    results = [
        decode_with(model, prompt, m, k, DFlashProposer(drafter, model), 20, verifier_type=compiled)
        for m, k in (("ar", {}), ("ddtree", {"budget": 16}))
    ]
    assert results[0].token_ids == results[1].token_ids
    eager = partial(LeanVerifier, compile="off", blocks=blocks)
    alone = decode_with(
        model, prompt, "ar", {}, DFlashProposer(drafter, model), 20, verifier_type=eager
    )
    assert len(alone.token_ids) == 20  # the eager layers may part at near-ties (other kernels)

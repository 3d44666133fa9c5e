"""caddtree's bfloat16 linear kernel (caddtree.runtime.kernels): what it computes, that a row's
result does not depend on the rows beside it, where it applies, how it is turned off, and that
packed layers and the lean runtime run on it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from caddtree.runtime import kernels, packing
from caddtree.runtime.packing import pack_linear_layers, pack_weight, packed_linear

pytestmark = pytest.mark.skipif(
    not kernels.kernel_available(),
    reason="caddtree's bfloat16 kernels need AVX512-BF16 or AVX2, and g++",
)


def weights(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, k, generator=generator).bfloat16(),
        torch.randn(n, generator=generator).bfloat16(),
    )


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The exact product of the bfloat16 numbers, in float64."""
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double())


@pytest.mark.parametrize(
    ("n", "k"), [(32, 2), (64, 70), (96, 576), (960, 576), (576, 1536), (1, 8), (6453, 64)]
)
@pytest.mark.parametrize("rows", [1, 3, 8, 13])
@pytest.mark.parametrize("with_bias", [True, False])
def test_the_kernel_computes_the_linear_layer(n, k, rows, with_bias):
    weight, bias = weights(n, k)
    bias = bias if with_bias else None
    x = torch.randn(rows, k).bfloat16()
    out = kernels.rows_linear(x, kernels.pack_rows(weight), bias, n)
    assert out.dtype is torch.bfloat16 and out.shape == (rows, n)
    exact = reference(x, weight, bias)
    # float32 accumulation, then one rounding to bfloat16 (relative 2^-8)
    error = (out.double() - exact).abs() / exact.abs().clamp(min=1.0)
    assert error.max() < 1e-2
    # as close as torch's own bfloat16 linear
    torch_error = (F.linear(x, weight, bias).double() - exact).abs() / exact.abs().clamp(min=1.0)
    assert error.mean() <= 1.5 * torch_error.mean() + 1e-4


def test_a_row_gives_the_same_bits_alone_or_among_others():
    weight, bias = weights(960, 576)
    packed = kernels.pack_rows(weight)
    x = torch.randn(37, 576).bfloat16()
    together = kernels.rows_linear(x, packed, bias)
    for i in range(x.shape[0]):
        assert torch.equal(kernels.rows_linear(x[i : i + 1], packed, bias), together[i : i + 1])
    # and in any grouping of the rows (8, 4, 2 and 1 at a time inside the kernel)
    for size in (2, 5, 16):
        parts = [kernels.rows_linear(x[s : s + size], packed, bias) for s in range(0, 37, size)]
        assert torch.equal(torch.cat(parts), together)


def test_amx_is_used_where_the_cpu_has_it_unless_turned_off():
    """The linear kernel runs on the AMX tile unit where the CPU has AMX-BF16 (a choice made once
    per process, so every call of a process agrees with every other); CADDTREE_AMX=0 keeps the
    vector passes."""
    import os
    import subprocess
    import sys

    code = "from caddtree.runtime import kernels; print(kernels.amx_in_use())"

    def in_use(**env: str) -> str:
        done = subprocess.run(
            [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True
        )
        return done.stdout.strip()

    has_amx = "amx_bf16" in kernels._cpu_flags() and kernels.kernel_variant() == "avx512-bf16"
    assert kernels.amx_in_use() == has_amx
    assert in_use(CADDTREE_AMX="0") == "False"
    assert in_use(CADDTREE_AMX="1") == str(has_amx)


@pytest.mark.parametrize(("rows", "vocab"), [(1, 1), (3, 15), (2, 16), (7, 33), (12, 49152)])
def test_the_greedy_choice_kernel_is_torch_argmax(rows, vocab):
    """argmax_rows on bfloat16 logits: torch.argmax's index in every row, the first on ties
    (inside a vector and across them), with infinities, and the first NaN where there is one."""
    logits = (
        torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)) * 4
    ).bfloat16()
    if rows >= 7 and vocab >= 33:
        logits[0, [3, 20, vocab - 1]] = logits[0].max() + 1  # ties, the first of them wins
        logits[1] = 1.0
        logits[2] = float("-inf")
        logits[3, [2, 30]] = float("inf")
        logits[4, [9, 31]] = float("nan")
        logits[5, vocab - 1] = float("nan")  # in the tail
        logits[6, 17] = float("inf")
    from caddtree.core.sampling import argmax_rows

    kernels.kernel_available()  # loads the kernels, which register the op where the build has it
    chosen = argmax_rows(logits)
    if kernels.kernel_variant() != "avx512-bf16":
        assert chosen is None  # the AVX2 build leaves it to torch
        return
    assert torch.equal(chosen, torch.argmax(logits.float(), -1))
    assert argmax_rows(logits.float()) is None
    from caddtree.core.sampling import greedy_choices

    assert torch.equal(greedy_choices(logits), chosen)


def test_inputs_of_any_shape_and_layout():
    weight, bias = weights(64, 40)
    packed = kernels.pack_rows(weight)
    x = torch.randn(2, 9, 40).bfloat16()
    expected = kernels.rows_linear(x.reshape(18, 40), packed, bias).view(2, 9, 64)
    assert torch.equal(kernels.rows_linear(x, packed, bias), expected)
    transposed = x.transpose(0, 1)  # not contiguous
    assert torch.equal(kernels.rows_linear(transposed, packed, bias), expected.transpose(0, 1))
    assert kernels.rows_linear(x[:0], packed, bias).shape == (0, 9, 64)


def test_bad_inputs_get_clear_errors():
    weight, _ = weights(64, 40)
    packed = kernels.pack_rows(weight)
    with pytest.raises(RuntimeError, match="input has 39 features, the weight takes 40"):
        kernels.rows_linear(torch.randn(2, 39).bfloat16(), packed)
    with pytest.raises(RuntimeError, match="bfloat16 input and weight expected"):
        kernels.rows_linear(torch.randn(2, 40), packed)
    with pytest.raises(RuntimeError, match="packed by caddtree.runtime.kernels.pack_rows"):
        kernels.rows_linear(torch.randn(2, 40).bfloat16(), weight)
    with pytest.raises(RuntimeError, match="bias has 3 values, not 64"):
        kernels.rows_linear(torch.randn(2, 40).bfloat16(), packed, torch.ones(3).bfloat16())
    with pytest.raises(RuntimeError, match="70 outputs do not fit a weight packed for 64"):
        kernels.rows_linear(torch.randn(2, 40).bfloat16(), packed, None, 70)


def onednn_layout(packed: torch.Tensor | None) -> bool:
    """``packed`` is oneDNN's bfloat16 layout, or nothing on a CPU where oneDNN packs no
    bfloat16 (AVX2 without AVX-512)."""
    if packing._kernel_packs(torch.zeros(2, 2, dtype=torch.bfloat16)):
        return packed is not None and packed.dim() == 2
    return packed is None


def test_each_cpu_builds_its_variant_of_the_kernels(monkeypatch):
    """The AVX512-BF16 and AVX2 builds compile their own sources with their own flags, into
    libraries under different cache keys."""
    keys = set()
    for variant in (kernels._AVX512_BF16, kernels._AVX2):
        monkeypatch.setattr(kernels, "_variant", lambda v=variant: v)
        command = kernels._command("g++", [], "out.so")
        assert all(flag in command for flag in variant.flags)
        assert set(kernels._sources()) == set(variant.sources)
        keys.add(kernels._key("g++"))
    assert len(keys) == 2
    monkeypatch.undo()
    if torch.cpu._is_avx512_bf16_supported():
        assert kernels.kernel_variant() == "avx512-bf16"
    else:  # the kernels are available here, so the CPU has AVX2
        assert kernels.kernel_variant() == "avx2"


def test_where_the_kernel_applies():
    assert kernels.pack_rows(torch.randn(64, 40).bfloat16()).shape == (2, 20, 32, 2)
    assert kernels.pack_rows(torch.randn(64, 40)) is None  # float32: oneDNN
    assert kernels.pack_rows(torch.randn(48, 40).bfloat16()).shape == (2, 20, 32, 2)  # padded
    assert kernels.pack_rows(torch.randn(64, 41).bfloat16()) is None  # odd input size
    assert kernels.kernel_in_use(torch.bfloat16) and not kernels.kernel_in_use(torch.float32)


def test_packing_takes_the_kernel_for_bfloat16_and_onednn_otherwise():
    weight, bias = weights(64, 40)
    ours = pack_weight(weight)
    assert ours.dim() == 4  # caddtree's layout
    assert pack_weight(weight.float()).dim() == 2  # oneDNN's
    x = torch.randn(5, 40).bfloat16()
    assert torch.equal(packed_linear(x, ours, bias), kernels.rows_linear(x, ours, bias))
    # not whole groups: oneDNN, where it packs bfloat16 (AVX-512 CPUs), else nothing
    assert onednn_layout(pack_weight(weight[:40], padded=False))
    for size in (64, 45):  # whole row groups, and padded ones
        layer = torch.nn.Linear(40, size).bfloat16()
        assert pack_linear_layers(layer) == 1
        assert layer._caddtree_packed.weight.dim() == 4
        with torch.no_grad():
            out = layer(x)
            expected = F.linear(x, layer.weight, layer.bias)
        assert out.shape == expected.shape
        torch.testing.assert_close(out.float(), expected.float(), rtol=0, atol=2e-2)


def test_caddtree_kernels_0_turns_it_off(monkeypatch):
    monkeypatch.setenv("CADDTREE_KERNELS", "0")
    kernels.kernel_available.cache_clear()
    try:
        assert not kernels.kernel_available()
        assert kernels.pack_rows(torch.randn(64, 40).bfloat16()) is None
        assert onednn_layout(pack_weight(torch.randn(64, 40).bfloat16()))  # not caddtree's
    finally:
        monkeypatch.delenv("CADDTREE_KERNELS")
        kernels.kernel_available.cache_clear()
    assert kernels.kernel_available()


def test_the_kernel_is_built_once_into_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("CADDTREE_CACHE", str(tmp_path))
    built = kernels._library(kernels.cxx_compiler())
    assert built.parent.parent == tmp_path / "kernels" and built.is_file()
    stamp = built.stat().st_mtime_ns
    assert kernels._library(kernels.cxx_compiler()) == built
    assert built.stat().st_mtime_ns == stamp  # found, not built again
    assert not list(built.parent.glob("*.tmp*"))  # nothing half-written left behind


def test_the_lean_runtime_runs_its_layers_on_the_kernel():
    """The tiny Qwen3 target in bfloat16: every fused linear layer of the lean runtime is packed
    for the kernel, and its logits stay as close to transformers' bfloat16 ones as before."""
    from caddtree.runtime.lean import LeanVerifier
    from tiny_models import qwen3_target

    model = qwen3_target("sdpa").to(torch.bfloat16)
    verifier = LeanVerifier(model, (), compile="off")
    for layer in verifier.target.layers:
        assert all(
            linear.packed.dim() == 4 for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)
        )
    verifier.reset()
    ids = torch.tensor([5, 17, 3, 44, 8, 21, 30])
    ours = verifier.prefill(ids)[0].float()
    with torch.no_grad():
        theirs = model(ids[None]).logits[0, -1].float()
        exact = model.double()(ids[None]).logits[0, -1]
    # as close to the float64 logits as transformers' own bfloat16 forward
    assert (ours - exact).abs().max() <= 1.5 * (theirs - exact).abs().max() + 1e-3


def attention_case(n: int, length: int, heads: int, kv: int, dim: int, seed: int = 0):
    """Random rows, a cache of ``length + 5`` entries (strided views, as a cache slot is) and a
    tree mask: every context entry, then each row's random ancestors among the last ``n``
    entries, and itself."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, dim, generator=generator).bfloat16()
    cache = torch.randn(2, 2, kv, length + 5, dim, generator=generator).bfloat16()
    keys, values = cache[0, 1], cache[1, 0]
    context = length - n
    mask = torch.zeros(n, length, dtype=torch.bool)
    mask[:, :context] = True
    for i in range(n):
        mask[i, context : context + i] = torch.rand(i, generator=generator) < 0.5
        mask[i, context + i] = True
    return q, keys, values, mask


def attention_reference(q, keys, values, mask, scale):
    """Masked softmax attention of the same bfloat16 numbers, in float64: [n, H*D]."""
    n, heads, dim = q.shape
    groups = heads // keys.shape[0]
    length = mask.shape[-1]
    k = keys[:, :length].double().repeat_interleave(groups, 0)  # [H, L, D]
    v = values[:, :length].double().repeat_interleave(groups, 0)
    scores = torch.einsum("nhd,hld->hnl", q.double(), k) * scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hnl,hld->nhd", scores.softmax(-1), v).reshape(n, heads * dim)


@pytest.mark.parametrize(("heads", "kv", "dim"), [(9, 3, 64), (16, 8, 128), (8, 2, 80), (2, 1, 16)])
@pytest.mark.parametrize(("n", "context"), [(1, 0), (1, 300), (5, 17), (16, 300), (33, 40)])
def test_the_attention_kernel_computes_masked_attention(heads, kv, dim, n, context):
    q, keys, values, mask = attention_case(n, context + n, heads, kv, dim)
    scale = dim**-0.5
    out = kernels.tree_attention(q, keys, values, mask, scale)
    assert out.shape == (n, heads * dim) and out.dtype is torch.bfloat16
    exact = attention_reference(q, keys, values, mask, scale)
    # within one rounding to bfloat16 of the exact result, give or take 2**-19 of the largest
    # value (on AMX: the tile unit's own rounding of the scores, and probabilities carried as two
    # bfloat16 parts, 16 of their 24 bits: a near-tie can round the other way)
    bound = 2**-8 * exact.abs().clamp(min=2**-8) + 2**-19 * values.double().abs().max()
    assert ((out.double() - exact).abs() <= bound).all()
    alone = [
        kernels.tree_attention(q[i : i + 1], keys, values, mask[i : i + 1], scale) for i in range(n)
    ]
    assert torch.equal(torch.cat(alone), out)  # a row's bits do not depend on the others


def test_the_attention_kernel_takes_views_of_masks_and_refuses_bad_input():
    q, keys, values, mask = attention_case(4, 20, 4, 2, 32)
    out = kernels.tree_attention(q, keys, values, mask, 0.2)
    assert torch.equal(kernels.tree_attention(q, keys, values, mask[None, None], 0.2), out)
    wide = torch.ones(4, 30, dtype=torch.bool)
    wide[:, :20] = mask
    assert torch.equal(kernels.tree_attention(q, keys, values, wide[:, :20], 0.2), out)
    with pytest.raises(RuntimeError, match="a bool mask expected"):
        kernels.tree_attention(q, keys, values, mask.float(), 0.2)
    with pytest.raises(RuntimeError, match="mask covers 26 entries, the cache holds 25"):
        kernels.tree_attention(q, keys, values, torch.ones(4, 26, dtype=torch.bool), 0.2)
    with pytest.raises(RuntimeError, match="3 query heads are not a multiple of 2"):
        kernels.tree_attention(q[:, :3], keys, values, mask, 0.2)
    with pytest.raises(RuntimeError, match="bfloat16 q, keys and values expected"):
        kernels.tree_attention(q.float(), keys, values, mask, 0.2)
    with pytest.raises(RuntimeError, match="q has no heads"):  # was a division by zero
        kernels.tree_attention(q[:, :0], keys, values, mask, 0.2)
    assert kernels.attention_fits(64, 9, 3) and not kernels.attention_fits(72, 9, 3)


@pytest.mark.parametrize(("heads", "kv", "dim"), [(9, 3, 64), (8, 2, 80)])
def test_several_sequences_attend_in_one_call_as_each_does_alone(heads, kv, dim):
    """tree_attention_batch over a cache of 4 slots: sequences of 1 to 33 rows and 1 to 300
    entries in any slot order, and an empty one, give each row the bits tree_attention gives its
    sequence alone (each reading only its own slot's first entries)."""
    spans = [(2, 5, 17), (0, 1, 300), (3, 33, 40), (1, 0, 1), (1, 4, 4)]  # slot, rows, entries
    generator = torch.Generator().manual_seed(3)
    cache = torch.randn(2, 4, kv, 310, dim, generator=generator).bfloat16()
    keys, values = cache[0], cache[1]
    cases = [
        attention_case(n, length, heads, kv, dim, seed=b)
        for b, (_, n, length) in enumerate(spans)
        if n
    ]
    q = torch.cat([case[0] for case in cases])
    mask = torch.zeros(q.shape[0], 320, dtype=torch.bool)  # wider than any sequence: unread
    mask[:, 300:] = True
    first, alone = 0, []
    for case, (slot, n, length) in zip(cases, [s for s in spans if s[1]]):
        mask[first : first + n, :length] = case[3]
        part = kernels.tree_attention(q[first : first + n], keys[slot], values[slot], case[3], 0.1)
        alone.append(part)
        first += n
    seqs = torch.tensor(spans, dtype=torch.long)
    out = kernels.tree_attention_batch(q, keys, values, mask, seqs, 0.1)
    assert torch.equal(out, torch.cat(alone))


def test_the_batch_attention_refuses_sequences_that_do_not_fit():
    q, keys, values, mask = attention_case(4, 20, 4, 2, 32)
    cache = torch.stack((keys, keys))  # [2 slots, kv, 25, D]

    def call(seqs, mask=mask):
        return kernels.tree_attention_batch(q, cache, cache, mask, torch.tensor(seqs), 0.2)

    assert torch.equal(call([[1, 4, 20]]), kernels.tree_attention(q, keys, keys, mask, 0.2))
    with pytest.raises(RuntimeError, match="slot 2 is not in the cache's 2"):
        call([[2, 4, 20]])
    with pytest.raises(RuntimeError, match="sequence 0 has 5 rows; the rows left are 4"):
        call([[0, 5, 20]])
    with pytest.raises(RuntimeError, match="the sequences hold 3 rows, q has 4"):
        call([[0, 3, 20]])
    with pytest.raises(RuntimeError, match="attends 21 entries; the mask covers 20"):
        call([[0, 4, 21]])
    with pytest.raises(RuntimeError, match="seqs must be int64"):
        kernels.tree_attention_batch(q, cache, cache, mask, torch.ones(1, 2).long(), 0.2)
    with pytest.raises(RuntimeError, match=r"must both be \[slots, kv, S, D\]"):
        kernels.tree_attention_batch(q, keys, values, mask, torch.tensor([[0, 4, 20]]), 0.2)


def test_the_lean_runtime_attends_with_the_kernel_as_with_sdpa():
    """One sequence's tree and a batch of three sequences (trees, lone rows, different contexts)
    on the tiny Qwen3 target in bfloat16: with caddtree's attention kernel the logits and
    features are as close to the float64 forward's as with SDPA."""
    import numpy as np

    from caddtree.runtime.lean import LeanTarget, Rows
    from tiny_models import qwen3_target

    visibility = np.tril(np.ones((4, 4), dtype=bool))
    visibility[3, 1:3] = False

    def run(dtype, fused):
        target = LeanTarget(qwen3_target("sdpa").to(dtype), (1,))
        assert target.fused_attention == (dtype is torch.bfloat16)
        target.fused_attention = fused
        target.reserve(3, 64)
        for slot, length in enumerate((9, 14, 5)):
            ids = torch.arange(length) % 50 + slot
            target.forward(Rows.single(ids, torch.arange(length), 0, None, slot=slot))
        tree = target.forward(
            Rows.single(torch.tensor([3, 4, 5, 6]), torch.arange(9, 13), 9, visibility)
        )
        sequences = [
            (0, 13, [7], [13], None),
            (1, 14, [8, 9, 10], [14, 15, 15], visibility[:3, :3]),
            (2, 5, [11], [5], None),
        ]
        batch = target.forward(Rows.batch(sequences, "cpu"))
        return [t.double() for t in (*tree, *batch)]

    exact = run(torch.float64, False)
    for ours, theirs, reference in zip(
        run(torch.bfloat16, True), run(torch.bfloat16, False), exact
    ):
        ours_error = (ours - reference).abs().max()
        assert ours_error <= 1.5 * (theirs - reference).abs().max() + 1e-2


@pytest.mark.parametrize("context", [0, 7, 300])
def test_a_tree_row_attends_as_the_same_token_does_after_its_ancestors(context):
    """A tree row sees the context and its ancestors, with other branches' entries between them;
    plain decoding sees the same entries side by side. The kernel gives both the same bits (it
    sums the probabilities by rank among the allowed entries), so a token accepted from a tree
    has the keys, values and logits plain decoding would have given it. (Summed by place in the
    cache, an output rounds otherwise about once in 10^5: hence many trees.)"""
    n, heads, kv, dim = 16, 9, 3, 64
    for seed in range(40):
        q, keys, values, mask = attention_case(n, context + n, heads, kv, dim, seed)
        tree = kernels.tree_attention(q, keys, values, mask, dim**-0.5)
        for i in range(n):
            seen = mask[i].nonzero().squeeze(1)
            plain = kernels.tree_attention(
                q[i : i + 1],
                keys[:, seen],
                values[:, seen],
                torch.ones(1, len(seen), dtype=torch.bool),
                dim**-0.5,
            )
            assert torch.equal(plain, tree[i : i + 1]), (seed, i)


def test_the_argmax_kernel_is_taken_only_after_its_probe(monkeypatch):
    """A build whose argmax kernel fails its probe leaves greedy choices to torch, although the
    op is registered."""
    from caddtree.core import sampling

    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1)).bfloat16()
    kernels.kernel_available()
    registered = sampling._ARGMAX_KERNEL
    monkeypatch.setattr(kernels, "_probe_argmax", lambda: False)
    kernels.kernel_available.cache_clear()
    sampling.use_argmax_kernel(None)
    try:
        kernels.kernel_available()
        assert sampling.argmax_rows(logits) is None
        assert torch.equal(sampling.greedy_choices(logits), torch.argmax(logits.float(), -1))
    finally:
        kernels.kernel_available.cache_clear()
        sampling.use_argmax_kernel(registered)

"""Linear layers packed for oneDNN on the CPU (caddtree.runtime.packing): what they compute, when
they fall back to the plain layer, and that decoding with them stays lossless."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from caddtree import ConvexCostModel
from caddtree.api import SpeculativeGenerator
from caddtree.core.cost import PiecewiseLinearCurve
from caddtree.runtime.kernels import kernel_available
from caddtree.runtime.packing import (
    pack_linear_layers,
    pack_weight,
    packed_linear_count,
    unpack_linear_layers,
)
from tiny_models import MASK_TOKEN_ID, new_drafter, qwen3_target
from tiny_tokenizer import tiny_tokenizer

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this PyTorch build has no oneDNN"
)

PROMPT = [5, 17, 3, 44, 8, 21, 30]
# float32 packed kernels sum in another order than F.linear: last-bit differences
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def linear(dtype, bias=True, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(40, 24, bias=bias).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_a_packed_layer_computes_what_the_plain_one_does(dtype, bias):
    layer = linear(dtype, bias)
    if pack_weight(layer.weight) is None:
        pytest.skip(f"neither caddtree's kernel nor oneDNN packs {dtype} on this CPU")
    x = torch.randn(2, 9, 40).to(dtype)
    with torch.no_grad():
        plain = layer(x)
        assert pack_linear_layers(layer) == 1
        assert packed_linear_count(layer) == 1
        packed = layer(x)
        # 2D, 1-row and non-contiguous inputs too
        for inp in (x[0], x[:, :1], x.transpose(0, 1)):
            torch.testing.assert_close(
                layer(inp).float(),
                F.linear(inp, layer.weight, layer.bias).float(),
                rtol=0,
                atol=TOLERANCE[dtype],
            )
    torch.testing.assert_close(packed.float(), plain.float(), rtol=0, atol=TOLERANCE[dtype])
    # the parameters and state dict are the layer's own: nothing was renamed or replaced
    assert set(layer.state_dict()) == ({"weight", "bias"} if bias else {"weight"})


def test_the_packed_path_is_the_one_taken():
    """With the packed copy made from other weights than the parameter's (a test-only swap, the
    version counter and address kept), the output follows the packed copy: so the packed kernel,
    not F.linear, is what runs."""
    layer = linear(torch.float32)
    other = linear(torch.float32, seed=1)
    pack_linear_layers(layer)
    state = layer._caddtree_packed
    layer._caddtree_packed = state._replace(
        weight=torch.ops.mkldnn._reorder_linear_weight(other.weight.detach())
    )
    x = torch.randn(3, 40)
    with torch.no_grad():
        out = layer(x)
    torch.testing.assert_close(out, F.linear(x, other.weight, layer.bias), rtol=0, atol=1e-5)


def test_a_changed_weight_is_never_read_from_a_stale_packed_copy():
    layer = linear(torch.float32)
    pack_linear_layers(layer)
    x = torch.randn(3, 40)
    with torch.no_grad():
        layer.weight.mul_(2)  # in place: the version counter moves
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        layer.weight = torch.nn.Parameter(torch.randn(24, 40))  # replaced
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        layer.double()  # another dtype
        xd = x.double()
        torch.testing.assert_close(layer(xd), F.linear(xd, layer.weight, layer.bias))


def test_gradients_through_a_packed_layer_are_exact():
    layer = linear(torch.float32)
    reference = linear(torch.float32)
    pack_linear_layers(layer)
    x = torch.randn(4, 40, requires_grad=True)
    xr = x.detach().clone().requires_grad_(True)
    layer(x).square().sum().backward()
    reference(xr).square().sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(layer.weight.grad, reference.weight.grad)


def test_what_is_not_packed():
    float64 = linear(torch.float64)
    assert pack_linear_layers(float64) == 0

    class Subclass(torch.nn.Linear):  # e.g. a quantised layer: its own forward must run
        pass

    assert pack_linear_layers(Subclass(4, 4)) == 0
    with torch.inference_mode():  # no version counter to tell a stale copy by
        inference = linear(torch.float32)
    assert pack_linear_layers(inference) == 0
    with torch.inference_mode():
        assert inference(torch.randn(2, 40)).shape == (2, 24)
    # a layer packed twice is packed once; unpacking restores the plain forward
    layer = linear(torch.float32)
    assert pack_linear_layers(layer, layer) == 1 and pack_linear_layers(layer) == 1
    assert unpack_linear_layers(layer) == 1
    assert packed_linear_count(layer) == 0 and "forward" not in vars(layer)
    assert pack_linear_layers(None) == 0


def test_packing_that_would_not_fit_in_memory_is_skipped_with_a_warning(caplog):
    layer = linear(torch.float32)
    with caplog.at_level(logging.WARNING, logger="caddtree.runtime.packing"):
        assert pack_linear_layers(layer, memory_limit=100) == 0
    assert "not packing" in caplog.text and "GiB" in caplog.text
    assert packed_linear_count(layer) == 0
    assert pack_linear_layers(layer, memory_limit=24 * 40 * 4) == 1


def make_gen(dtype, **kwargs):
    target = qwen3_target()
    drafter = new_drafter(target)
    return SpeculativeGenerator(
        target.to(dtype), tiny_tokenizer(MASK_TOKEN_ID), drafter.to(dtype), **kwargs
    )


def linear_count(*models) -> int:
    return sum(isinstance(m, torch.nn.Linear) for model in models for m in model.modules())


def test_the_generator_packs_both_models_on_the_cpu_unless_told_not_to():
    """transformers' target packs all its own linear layers; the drafter's pass packs its own
    fused copies (fc, and q/k/v, o, gate/up, down per layer), not the drafter module's."""
    gen = make_gen(torch.float32, runtime="transformers")
    drafter_fused = 1 + 4 * len(gen.drafter.layers)
    assert packed_linear_count(gen.target) == linear_count(gen.target)
    assert packed_linear_count(gen.drafter) == 0
    assert gen.proposer.packed_layers() == drafter_fused
    assert gen.packed_layers == linear_count(gen.target) + drafter_fused
    assert make_gen(torch.float32, pack_weights=False).packed_layers == 0
    assert make_gen(torch.float64).packed_layers == 0


def test_the_lean_runtime_packs_its_fused_layers_and_the_models_heads():
    """q/k/v, o, gate/up and down of each of the 4 layers as 4 packed weights; of the target's own
    modules only the LM head (the drafter's projection and the lean forward both call it); the
    drafter's pass packs its fc and its layers' fused linears the same way."""
    gen = make_gen(torch.float32)
    assert gen.runtime == "lean"
    assert gen.verifier.packed_layers() == 4 * 4
    assert packed_linear_count(gen.target) == 1
    assert gen.packed_layers == 16 + 1 + 1 + 4 * len(gen.drafter.layers)


@pytest.mark.parametrize(
    ("dtype", "runtime"),
    [(torch.float32, "lean"), (torch.bfloat16, "lean"), (torch.bfloat16, "compiled")],
)
def test_decoding_with_packed_weights_is_plain_decoding(dtype, runtime):
    """Every method reproduces packed plain decoding token for token, and packed plain decoding
    is the unpacked one (float32 here: the tiny model's top two logits are far apart compared with
    the kernels' last-bit differences). In bfloat16 too, on the eager and the compiled runtime:
    caddtree's linear and attention kernels give a row the same bits alone or in a tree, and the
    compiled graphs round between ops as eager does, so a near-tie cannot flip between them."""
    if dtype is torch.bfloat16 and not kernel_available():
        pytest.skip("bfloat16 identity needs caddtree's kernels (AVX512-BF16 or AVX2, and g++)")
    gen = make_gen(dtype, runtime=runtime)
    assert gen.runtime == runtime and gen.packed_layers > 0
    gen.cost_model = ConvexCostModel(
        {0: PiecewiseLinearCurve([0, 8, 64], [0.01, 0.012, 0.05])}, draft_cost=0.004
    )
    kwargs = {"max_new_tokens": 40, "stop_token_ids": ()}
    ar = gen.generate(PROMPT, "ar", **kwargs).token_ids
    for method, extra in (("dflash", {}), ("ddtree", {"budget": 8}), ("caddtree", {})):
        assert gen.generate(PROMPT, method, **extra, **kwargs).token_ids == ar, method
    if dtype is torch.float32:
        plain = make_gen(dtype, pack_weights=False)
        assert plain.generate(PROMPT, "ar", **kwargs).token_ids == ar


def test_the_command_line_flag_turns_packing_off(tiny_pair_dirs):
    """``--no-weight-packing`` (every command that loads the pair) reaches the loaded generator."""
    import argparse

    from caddtree.arguments import add_method_arguments, add_pair_arguments, load_pair_of

    parser = argparse.ArgumentParser()
    add_pair_arguments(parser)
    add_method_arguments(parser)
    target, draft = (str(p) for p in tiny_pair_dirs)
    base = ["--target", target, "--draft", draft, "--dtype", "float32", "--method", "ddtree"]
    assert load_pair_of(parser.parse_args(base)).packed_layers > 0
    assert load_pair_of(parser.parse_args([*base, "--no-weight-packing"])).packed_layers == 0

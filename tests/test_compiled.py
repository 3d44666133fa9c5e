"""The compiled runtime (caddtree.runtime.compiled) computes what transformers computes.

On the tiny Llama and Qwen3 targets in float32 (inductor's CPU path needs packed weights, which
float64 has not): logits and feature layers within 1e-4 relative of transformers' through a
generation (prefill, trees, lone rows, compactions, truncation), no recompile when the context
or the cache grows, and every method's output equal to plain decoding's on the same runtime.
The first run compiles the tiny graphs (tens of seconds); later runs load them from inductor's
on-disk cache.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from caddtree import InvalidInputError, SpeculativeGenerator
from caddtree.core.tree import DraftTree
from caddtree.models import TreeVerifier
from caddtree.runtime import lean
from caddtree.runtime.compiled import CompiledLayers
from caddtree.runtime.lean import LeanVerifier
from test_lean import LAYERS, assert_same, deep_path, prompt, tree
from tiny_models import llama_target, new_drafter, qwen3_target


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def model(request):
    make = {"qwen3": qwen3_target, "llama": llama_target}[request.param]
    return make("sdpa").to(torch.float32)


@pytest.fixture(scope="module")
def compiled(model):
    """A compiled verifier of ``model`` (compiled once per module: the graphs are shared)."""
    verifier = LeanVerifier(model, LAYERS, compile="on", progress=False)
    if verifier.runtime != "compiled":
        pytest.fail("the compiled runtime did not compile")
    return verifier


def graphs_compiled() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def test_logits_and_features_equal_transformers_through_a_generation(model, compiled):
    theirs = TreeVerifier(model, LAYERS)
    compiled.reset(reserve=64)
    theirs.reset(reserve=64)
    for a, b in zip(compiled.prefill(prompt(0)), theirs.prefill(prompt(0))):
        assert_same(a, b, model.dtype)
    for seed in range(5):
        t = tree(seed) if seed not in (2, 4) else DraftTree.empty()
        for a, b in zip(compiled.verify(7 + seed, t), theirs.verify(7 + seed, t)):
            assert_same(a, b, model.dtype)
        path = deep_path(t)
        assert_same(compiled.commit(path), theirs.commit(path), model.dtype)
    for v in (compiled, theirs):
        v.truncate(11)
    for a, b in zip(compiled.verify(3, tree(9)), theirs.verify(3, tree(9))):
        assert_same(a, b, model.dtype)


def test_calls_after_the_prompt_run_the_graphs_and_never_recompile(model, compiled, monkeypatch):
    """Longer contexts, other tree sizes and a cache that grows all reuse the two graphs."""
    monkeypatch.setattr(lean, "_MIN_CAPACITY", 16)
    theirs = TreeVerifier(model, LAYERS)
    compiled.target.release()
    compiled.reset(reserve=1)
    theirs.reset()
    assert compiled.target.capacity == 16
    compiled.prefill(prompt(3, 12))
    theirs.prefill(prompt(3, 12))
    calls = []
    monkeypatch.setattr(CompiledLayers, "__call__", _counting(CompiledLayers.__call__, calls))
    before, first_capacity = graphs_compiled(), compiled.target.capacity
    for budget in (3, 10, 17, 1, 6, 12):
        t = tree(budget, budget) if budget > 1 else DraftTree.empty()
        for a, b in zip(compiled.verify(2, t), theirs.verify(2, t)):
            assert_same(a, b, model.dtype)
        path = deep_path(t)
        compiled.commit(path)
        theirs.commit(path)
    assert compiled.target.capacity > first_capacity  # it grew
    assert len(calls) == 6
    assert graphs_compiled() == before


def test_a_prompt_of_one_token_is_answered_as_transformers_answers_it(model, compiled):
    """A one-token prompt attends over one cache entry, a size the graphs (compiled for two
    or more) cannot take: it runs eager, and the rounds after it on the graphs."""
    theirs = TreeVerifier(model, LAYERS)
    compiled.reset(reserve=64)
    theirs.reset(reserve=64)
    for a, b in zip(compiled.prefill(prompt(5, 1)), theirs.prefill(prompt(5, 1))):
        assert_same(a, b, model.dtype)
    for seed in (1, 0):
        t = tree(seed) if seed else DraftTree.empty()
        for a, b in zip(compiled.verify(4, t), theirs.verify(4, t)):
            assert_same(a, b, model.dtype)
        path = deep_path(t)
        compiled.commit(path)
        theirs.commit(path)


def _counting(call, calls):
    def counted(self, *args, **kwargs):
        calls.append(1)
        return call(self, *args, **kwargs)

    return counted


class _Guards:
    """Stands in for dynamo's guards of a remembered graph: they pass or fail as told."""

    def __init__(self, passes):
        self.passes, self.checked = passes, 0

    def check(self, local):
        self.checked += 1
        return self.passes


def test_a_remembered_graph_runs_only_while_its_guards_pass(model, compiled):
    """Calls go straight to the code dynamo compiled for a graph when that graph's own guards
    pass for them, and through torch.compile (which remembers the code again) when they fail;
    either way the outputs are the graph's."""
    compiled.reset(reserve=64)
    compiled.prefill(prompt(4, 10))
    layers = compiled.target.compiled
    compiled.verify(3, DraftTree.empty())
    compiled.commit([])
    assert layers._known.get("row") is not None  # this torch exposes the compiled code
    code, guards = layers._known["row"]
    ran = []

    def remembered(*args):
        ran.append(1)
        return code(*args)

    passing = _Guards(True)
    layers._known["row"] = (remembered, passing)
    layers._checked.clear()
    shortcut, _ = compiled.verify(4, DraftTree.empty())
    assert ran == [1] and passing.checked == 1
    compiled.discard()
    again, _ = compiled.verify(4, DraftTree.empty())  # the same cache: no second check
    assert ran == [1, 1] and passing.checked == 1
    torch.testing.assert_close(again, shortcut, rtol=0, atol=0)
    compiled.discard()
    failing = _Guards(False)
    layers._known["row"] = (remembered, failing)
    layers._checked.clear()
    framed, _ = compiled.verify(4, DraftTree.empty())
    assert ran == [1, 1] and failing.checked == 1  # not run: torch.compile ran the call
    assert layers._known["row"][1] is not failing  # and the real guards are remembered again
    torch.testing.assert_close(shortcut, framed, rtol=0, atol=0)
    compiled.commit([])
    layers._known["row"] = None  # a torch without the shortcut: every call goes through it
    plain, _ = compiled.verify(5, DraftTree.empty())
    assert layers._known["row"] is None and torch.isfinite(plain).all()
    compiled.commit([])


def test_guards_are_checked_again_once_the_cache_is_replaced(model, compiled):
    """A call checks the graph's guards only after the cache tensors changed (a new or grown
    cache), and then once."""
    compiled.reset(reserve=64)
    compiled.prefill(prompt(4, 10))
    layers = compiled.target.compiled
    layers._known.pop("row", None)  # learnt afresh by the next call
    compiled.verify(3, DraftTree.empty())
    compiled.commit([])
    code, guards = layers._known["row"]
    counting = _Guards(True)
    layers._known["row"] = (code, counting)
    for _ in range(3):
        compiled.verify(3, DraftTree.empty())
        compiled.commit([])
    assert counting.checked == 0  # checked already under this cache
    compiled.reset()  # the cache let go: the prefill makes a new one
    compiled.prefill(prompt(5, 10))
    for _ in range(3):
        compiled.verify(3, DraftTree.empty())
        compiled.commit([])
    assert counting.checked == 1
    layers._known["row"] = (code, guards)


@pytest.mark.parametrize("method", ["dflash", "ddtree", "caddtree"])
def test_every_method_equals_plain_decoding_on_the_compiled_runtime(
    model, compiled, method, cost_file
):
    del compiled  # compiled first, so that the generator below loads the graphs
    gen = SpeculativeGenerator(
        model, None, new_drafter(model).to(torch.float32), runtime="compiled", cost_model=cost_file
    )
    assert gen.runtime == "compiled"
    ids = prompt(4, 10)
    ar = gen.generate(ids, method="ar", max_new_tokens=40)
    extra = {"budget": 6} if method == "ddtree" else {}
    out = gen.generate(ids, method=method, max_new_tokens=40, **extra)
    assert out.token_ids == ar.token_ids


def test_it_is_refused_where_it_cannot_run_and_auto_falls_back(model, monkeypatch, caplog):
    with pytest.raises(InvalidInputError, match="compiled runtime cannot run this model"):
        LeanVerifier(model.to(torch.float64), (), compile="on")
    model.to(torch.float32)
    assert LeanVerifier(model, (), compile="auto").runtime == "lean"  # float32: eager wins

    def broken(self, n):
        raise RuntimeError("no compiler today")

    monkeypatch.setattr(lean.LeanTarget, "_warm_up", broken)
    bf16 = qwen3_target("sdpa").to(torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="caddtree.runtime.lean"):
        fallen = LeanVerifier(bf16, (), compile="auto")
    assert fallen.runtime == "lean" and "compiling the target's layers failed" in caplog.text
    assert "no compiler today" in caplog.text
    fallen.reset()
    assert torch.isfinite(fallen.prefill([1, 2, 3])[0]).all()  # the eager runtime runs
    with pytest.raises(RuntimeError, match="no compiler today"):
        LeanVerifier(bf16, (), compile="on")


def test_inductor_caches_go_to_caddtree_unless_the_user_chose(monkeypatch, tmp_path):
    """torch sets ``$TORCHINDUCTOR_CACHE_DIR`` to its own default (a temporary directory) when it
    is imported; that counts as unset, a directory the user chose is kept."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from caddtree.runtime.compiled import _choose_inductor_cache

    monkeypatch.setenv("CADDTREE_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    _choose_inductor_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    _choose_inductor_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")

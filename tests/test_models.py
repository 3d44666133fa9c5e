"""Tests of the model layer: DFlash checkpoints, tree verification, cache compaction, proposing.

Every exactness test compares against plain sequential transformers forwards in float64. SDPA
(transformers' and caddtree's grouped-query variant, ``caddtree_sdpa``) matches to ~1e-15. transformers' eager attention computes its softmax in float32 even for float64
inputs (``eager_attention_forward``), so eager results agree only to float32 precision; a wrong
mask, position or cache entry changes logits by O(0.1), far above either tolerance.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from caddtree.core.tree import DraftTree, build_chain, build_ddtree
from caddtree.models import (
    DFlashDraftModel,
    DFlashProposer,
    TreeVerifier,
    default_target_layer_ids,
    extract_context_features,
    tree_attention_mask,
)
from caddtree.models import attention as gqa_attention
from caddtree.util.errors import CheckpointError, InvalidInputError
from tiny_models import (
    FEATURE_LAYER_IDS,
    HIDDEN,
    MASK_TOKEN_ID,
    MAX_POSITIONS,
    VOCAB,
    llama_target,
    new_drafter,
    qwen3_target,
    saved_drafter,
)

TOL = {"sdpa": 1e-10, "eager": 1e-5, gqa_attention.GQA_SDPA: 1e-10}
TARGETS = {"qwen3": qwen3_target, "llama": llama_target}
PROMPT_LENGTH = 9


@pytest.fixture(scope="module", params=[(k, a) for k in TARGETS for a in TOL], ids="-".join)
def target(request):
    kind, attn = request.param
    return TARGETS[kind](attn), attn


@pytest.fixture(scope="module")
def saved(qwen3, tmp_path_factory):
    """(original drafter, loaded drafter, checkpoint dir) for the Qwen3 target."""
    directory = tmp_path_factory.mktemp("drafter")
    original, loaded = saved_drafter(qwen3, directory)
    return original, loaded, directory


# ---- helpers --------------------------------------------------------------------------------------


def prompt_ids(seed: int = 0, length: int = PROMPT_LENGTH) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB - 1, length).tolist()


def random_tree(seed: int, depth: int = 5, budget: int = 14) -> DraftTree:
    """A DDTree over logits with two strong candidates per position: deep and branching."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(depth, VOCAB))
    for row in logits:
        row[rng.choice(VOCAB, 2, replace=False)] += 5.0
    tree = build_ddtree(logits, budget)
    assert tree.max_depth >= 3 and len(set(tree.parents.tolist())) < len(tree)  # deep, branching
    return tree


def path_tokens(tree: DraftTree, index: int) -> list[int]:
    """Tokens of the nodes on the path to ``index`` in ``[bonus] + nodes`` (bonus excluded)."""
    return [] if index == 0 else [int(tree.token_ids[j]) for j in tree.path(index - 1)]


def accepted_path(tree: DraftTree, index: int) -> list[int]:
    """``[0] + path`` in ``[bonus] + nodes`` indexing, as ``TreeVerifier.commit`` takes it."""
    return [0] + ([] if index == 0 else [j + 1 for j in tree.path(index - 1)])


def sequential(model, ids: list[int]):
    """Plain forward over ``ids`` from an empty cache: logits, hidden states and the cache."""
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=True, output_hidden_states=True)


def _output_cache(output):
    """The KV cache a forward returned: ``cache`` from transformers 5.24 on, ``past_key_values``
    before (reading the old name on 5.24 warns)."""
    return output["cache"] if "cache" in output else output["past_key_values"]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    torch.testing.assert_close(actual, expected, atol=tol, rtol=0)


# ---- (a) released checkpoint format ---------------------------------------------------------------

RELEASED_LAYER_KEYS = [
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
]


def test_save_writes_the_released_layout(saved):
    _, _, directory = saved
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["model_type"] == "qwen3"
    assert config["block_size"] == 6
    assert config["num_target_layers"] == 4
    assert config["dflash_config"] == {
        "mask_token_id": MASK_TOKEN_ID,
        "target_layer_ids": list(FEATURE_LAYER_IDS),
    }
    with safe_open(directory / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        fc_shape = tuple(f.get_slice("fc.weight").get_shape())
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{name}" for i in range(2) for name in RELEASED_LAYER_KEYS
    }
    assert keys == expected  # in particular no embed_tokens and no lm_head
    assert fc_shape == (HIDDEN, len(FEATURE_LAYER_IDS) * HIDDEN)


def test_loaded_drafter_gives_identical_outputs(qwen3, saved):
    original, loaded, _ = saved
    assert loaded.dtype == torch.float64
    for name, tensor in original.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    features = torch.randn(1, 5, loaded.fc.in_features, dtype=torch.float64)
    a = DFlashProposer(original, qwen3).propose(3, features).rows()
    b = DFlashProposer(loaded, qwen3).propose(3, features).rows()
    assert a.shape == (5, VOCAB)
    assert torch.equal(a, b)


def _rewrite_config(directory: Path, edit) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def _copy_checkpoint(source: Path, destination: Path) -> Path:
    destination.mkdir()
    for name in ("config.json", "model.safetensors"):
        (destination / name).write_bytes((source / name).read_bytes())
    return destination


def test_block_size_inside_dflash_config_loads(qwen3, saved, tmp_path):
    original, _, directory = saved
    copy = _copy_checkpoint(directory, tmp_path / "nested")

    def move_block_size(config):
        config["dflash_config"]["block_size"] = config.pop("block_size")

    _rewrite_config(copy, move_block_size)
    nested = DFlashDraftModel.from_pretrained(copy, dtype=torch.float64)
    assert nested.block_size == original.block_size == 6
    features = torch.randn(1, 4, nested.fc.in_features, dtype=torch.float64)
    assert torch.equal(
        DFlashProposer(nested, qwen3).propose(1, features).rows(),
        DFlashProposer(original, qwen3).propose(1, features).rows(),
    )


def test_default_target_layer_ids_rule():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # e.g. Qwen3-8B, 5 draft layers
    assert default_target_layer_ids(36, 1) == [18]  # one layer: the middle one
    ids = default_target_layer_ids(40, 4)
    assert ids[0] == 1 and ids[-1] == 37 and ids == sorted(ids)
    with pytest.raises(InvalidInputError):
        default_target_layer_ids(0, 1)


def test_missing_target_layer_ids_use_the_default_rule(saved, tmp_path):
    _, _, directory = saved
    copy = _copy_checkpoint(directory, tmp_path / "no_ids")
    _rewrite_config(copy, lambda c: c["dflash_config"].pop("target_layer_ids"))
    drafter = DFlashDraftModel.from_pretrained(copy, dtype=torch.float64)
    # two drafter layers over a 4-layer target: spread from 1 to 4 - 3 = 1
    assert drafter.target_layer_ids == tuple(default_target_layer_ids(4, 2)) == (1, 1)


# ---- (b) tree attention is exact ------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_tree_logits_equal_sequential_logits(target, seed):
    model, attn = target
    verifier = TreeVerifier(model, FEATURE_LAYER_IDS)
    prompt = prompt_ids(seed)
    verifier.prefill(prompt)
    tree, bonus = random_tree(seed), 7
    logits, features = verifier.verify(bonus, tree)
    assert logits.shape == (len(tree) + 1, VOCAB)
    assert features.shape == (len(tree) + 1, len(FEATURE_LAYER_IDS) * HIDDEN)
    for i in range(len(tree) + 1):
        reference = sequential(model, prompt + [bonus] + path_tokens(tree, i))
        assert_close(logits[i], reference.logits[0, -1], TOL[attn])


def test_empty_tree_verifies_the_bonus_alone(target):
    model, attn = target
    verifier = TreeVerifier(model, FEATURE_LAYER_IDS)
    prompt = prompt_ids(3)
    prefill_logits, _ = verifier.prefill(prompt)
    assert_close(prefill_logits, sequential(model, prompt).logits[0, -1], TOL[attn])
    logits, _ = verifier.verify(11, DraftTree.empty())
    assert logits.shape == (1, VOCAB)
    assert_close(logits[0], sequential(model, prompt + [11]).logits[0, -1], TOL[attn])
    verifier.commit([])
    assert verifier.context_length == PROMPT_LENGTH + 1


def test_gqa_sdpa_answers_trees_and_single_queries_itself(monkeypatch):
    """caddtree_sdpa answers a tree verification (grouped heads read in place) and a single query
    (grouped heads stacked as queries) itself and hands everything else to transformers' SDPA;
    either way it computes what transformers' SDPA does."""
    handed_over = []
    original = gqa_attention.sdpa_attention_forward

    def counting(*args, **kwargs):
        handed_over.append(args[4] is None)  # was the mask None?
        return original(*args, **kwargs)

    monkeypatch.setattr(gqa_attention, "sdpa_attention_forward", counting)
    plain = TreeVerifier(qwen3_target("sdpa"), FEATURE_LAYER_IDS)
    gqa = TreeVerifier(qwen3_target(gqa_attention.GQA_SDPA), FEATURE_LAYER_IDS)
    assert gqa.model.model.layers[0].self_attn.num_key_value_groups == 2
    prompt, tree = prompt_ids(4), random_tree(4)
    # the prompt in two pieces: the first needs no mask (transformers' path), the second is
    # causal over a non-empty cache, a 4D mask built as for "sdpa" (caddtree_sdpa's own path)
    out = [[v.prefill(prompt[:4])[0], v.prefill(prompt[4:])[0]] for v in (plain, gqa)]
    layers = gqa.model.config.num_hidden_layers
    assert handed_over == [True] * layers
    assert_close(torch.stack(out[1]), torch.stack(out[0]), 1e-12)
    expected, expected_features = plain.verify(7, tree)
    handed_over.clear()
    logits, features = gqa.verify(7, tree)
    assert handed_over == []  # the tree forward never reached transformers' SDPA
    assert_close(logits, expected, 1e-12)
    assert_close(features, expected_features, 1e-12)
    for verifier in (plain, gqa):
        verifier.commit([])
    expected, _ = plain.verify(3, DraftTree.empty())
    logits, _ = gqa.verify(3, DraftTree.empty())
    assert handed_over == []  # a lone bonus token: no mask, caddtree_sdpa's single-query path
    assert_close(logits, expected, 1e-12)
    # the single-query path under a one-row mask, against transformers' SDPA on the same input
    attention = gqa.model.model.layers[0].self_attn
    query = torch.randn(1, 4, 1, 8, dtype=torch.float64)
    key, value = torch.randn(2, 1, 2, 6, 8, dtype=torch.float64)
    row = torch.zeros(1, 1, 1, 6, dtype=torch.float64)
    row[..., 2] = torch.finfo(torch.float64).min  # one key hidden
    for mask in (None, row):
        handed_over.clear()
        ours, _ = gqa_attention.gqa_sdpa_attention(attention, query, key, value, mask, scaling=0.3)
        assert handed_over == []
        theirs, _ = original(attention, query, key, value, mask, scaling=0.3)
        assert ours.shape == theirs.shape == (1, 1, 4, 8)
        assert_close(ours, theirs, 1e-12)


def test_targets_load_with_gqa_sdpa_on_the_cpu(tiny_pair_dirs):
    from caddtree import SpeculativeGenerator

    target, draft = tiny_pair_dirs
    gen = SpeculativeGenerator.from_pretrained(target, draft, dtype="float64", device="cpu")
    assert gen.target.config._attn_implementation == gqa_attention.GQA_SDPA
    assert gqa_attention.preferred_attention(torch.device("cuda")) == "sdpa"


def test_tree_attention_mask_values():
    tree = DraftTree(
        token_ids=[5, 6, 7], parents=[-1, -1, 0], depths=[1, 1, 2], log_probs=[-1.0, -2.0, -3.0]
    )
    mask = tree_attention_mask(tree, past_length=3, dtype=torch.float32, device="cpu")
    low = torch.finfo(torch.float32).min
    assert mask.shape == (1, 1, 4, 7) and mask.dtype == torch.float32
    assert (mask[0, 0, :, :3] == 0).all()  # the committed cache is visible to every token
    visible = torch.tensor(
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool
    )  # bonus, node 0, node 1 (sibling of 0), node 2 (child of 0)
    assert torch.equal(mask[0, 0, :, 3:], torch.where(visible, 0.0, low))


# ---- (c) compaction and (d) features are exact ----------------------------------------------------


def _deepest_branch_node(tree: DraftTree) -> int:
    """Index in ``[bonus] + nodes`` of a deepest node whose path is not the first nodes in order."""
    candidates = [
        i
        for i in range(1, len(tree) + 1)
        if accepted_path(tree, i) != list(range(tree.depths[i - 1] + 1))
    ]
    return max(candidates, key=lambda i: tree.depths[i - 1])


@pytest.mark.parametrize(
    "reserve", [None, 12, 256, 2**50], ids=["dynamic", "outgrown", "reserved", "unobtainable"]
)
@pytest.mark.parametrize("kind", ["branch", "first-nodes", "bonus-only"])
def test_commit_compacts_the_cache_exactly(target, kind, reserve):
    """Also with room reserved (caddtree.models.kvcache): 12 positions are outgrown by the
    first tree, 256 never are, and the keys then stay in the buffer written at the prefill;
    room no system can map leaves the cache to grow as it fills."""
    model, attn = target
    tol = TOL[attn]
    verifier = TreeVerifier(model, FEATURE_LAYER_IDS)
    verifier.reset(reserve=reserve)
    prompt, bonus = prompt_ids(4), 5
    _, prompt_features = verifier.prefill(prompt)
    first_buffer = verifier.cache.layers[0].keys.data_ptr()
    tree = random_tree(4)
    verifier.verify(bonus, tree)
    node = {"branch": _deepest_branch_node(tree), "first-nodes": 2, "bonus-only": 0}[kind]
    accepted = accepted_path(tree, node)
    if kind == "first-nodes":
        assert accepted == [0, 1, 2]  # best-first: node 1 is node 0's top child
    new_features = verifier.commit([i - 1 for i in accepted[1:]])  # rows -> node indices

    committed = prompt + [bonus] + path_tokens(tree, node)
    reference = sequential(model, committed)
    assert verifier.context_length == len(committed)
    for ours, theirs in zip(verifier.cache.layers, _output_cache(reference).layers, strict=True):
        assert ours.keys.shape == theirs.keys.shape
        assert_close(ours.keys, theirs.keys, tol)
        assert_close(ours.values, theirs.values, tol)

    # (d) features of the prompt and of the committed path equal sequential hidden states
    expected = extract_context_features(reference.hidden_states, FEATURE_LAYER_IDS)
    assert_close(prompt_features, expected[:, : len(prompt)], tol)
    assert new_features.shape == (1, len(accepted), len(FEATURE_LAYER_IDS) * HIDDEN)
    assert_close(new_features, expected[:, len(prompt) :], tol)

    # the next round continues from the compacted cache as if decoding had been sequential
    next_tree, next_bonus = random_tree(5), 9
    logits, _ = verifier.verify(next_bonus, next_tree)
    for i in range(len(next_tree) + 1):
        ids = committed + [next_bonus] + path_tokens(next_tree, i)
        assert_close(logits[i], sequential(model, ids).logits[0, -1], tol)
    layer = verifier.cache.layers[0]
    in_place = layer.keys.data_ptr() == first_buffer
    assert type(layer).__name__ == ("DynamicLayer" if reserve is None else "ReservedLayer")
    assert in_place == (reserve == 256)
    if reserve == 256:  # every layer's room is one allocation, returned whole when it is dropped
        storages = {
            t.untyped_storage().data_ptr()
            for layer in verifier.cache.layers
            for t in (layer.keys, layer.values)
        }
        assert len(storages) == 1


def test_commit_rejects_a_non_path(qwen3):
    verifier = TreeVerifier(qwen3, FEATURE_LAYER_IDS)
    verifier.prefill(prompt_ids())
    tree = random_tree(0)
    verifier.verify(1, tree)
    sibling = int(np.flatnonzero(tree.parents == -1)[1])  # the second child of the root
    with pytest.raises(InvalidInputError, match="node .* is not a child of node 0"):
        verifier.commit([0, sibling])
    deeper = int(np.flatnonzero(tree.parents >= 0)[0])
    with pytest.raises(InvalidInputError, match="is not a child of the root"):
        verifier.commit([deeper])
    with pytest.raises(InvalidInputError, match="not a path"):
        verifier.commit([len(tree)])
    with pytest.raises(InvalidInputError, match="commit"):
        verifier.verify(1, tree)  # the previous verification is still pending
    verifier.discard()  # discarding the round is allowed
    assert verifier.context_length == PROMPT_LENGTH
    with pytest.raises(InvalidInputError, match="needs a verify"):
        verifier.discard()


@pytest.mark.parametrize("reserve", [None, 256], ids=["dynamic", "reserved"])
def test_truncate_leaves_the_cache_of_the_shorter_context(target, reserve):
    """The profile measures each context length by truncating the longest one's cache."""
    model, attn = target
    tol = TOL[attn]
    verifier = TreeVerifier(model, FEATURE_LAYER_IDS)
    verifier.reset(reserve=reserve)
    prompt = prompt_ids(4)
    verifier.prefill(prompt)
    verifier.truncate(3)
    assert verifier.context_length == 3
    tree, bonus = random_tree(5), 9
    logits, _ = verifier.verify(bonus, tree)
    for i in range(len(tree) + 1):
        ids = prompt[:3] + [bonus] + path_tokens(tree, i)
        assert_close(logits[i], sequential(model, ids).logits[0, -1], tol)
    with pytest.raises(InvalidInputError, match="commit"):
        verifier.truncate(2)  # the verification is still pending
    verifier.discard()
    with pytest.raises(InvalidInputError, match="cannot truncate a 3-token context to 4"):
        verifier.truncate(4)
    verifier.truncate(0)
    assert verifier.context_length == 0


# ---- (e) the drafter's cache -----------------------------------------------------------------------


def test_propose_after_crop_equals_proposing_from_scratch(qwen3, saved):
    _, drafter, _ = saved
    verifier = TreeVerifier(qwen3, drafter.target_layer_ids)
    prompt = prompt_ids(6, 12)
    _, features = verifier.prefill(prompt)  # features of 12 committed tokens

    incremental = DFlashProposer(drafter, qwen3)
    incremental.propose(3, features[:, :7])
    incremental.propose(4, features[:, 7:10])
    assert incremental.context_length == 10
    incremental.crop(8)
    assert incremental.context_length == 8
    after_crop = incremental.propose(5, features[:, 8:12]).rows()

    scratch = DFlashProposer(drafter, qwen3)
    from_scratch = scratch.propose(5, features).rows()
    assert scratch.context_length == incremental.context_length == 12
    assert_close(after_crop, from_scratch, 1e-12)
    # the block's entries of each pass lie past the context and are not kept: proposing again
    # from the same context drafts the same block
    incremental.crop(12)
    assert_close(incremental.propose(5, features[:, :0]).rows(), from_scratch, 1e-12)


def test_block_attention_is_bidirectional(qwen3, saved):
    _, drafter, _ = saved
    embed = qwen3.get_input_embeddings()
    block = torch.tensor([[3, MASK_TOKEN_ID, MASK_TOKEN_ID, 17]])
    context = torch.randn(1, 4, drafter.fc.in_features, dtype=torch.float64)
    positions = torch.arange(8).unsqueeze(0)
    with torch.no_grad():
        base = drafter(embed(block), context, positions)
        changed = drafter(embed(block.index_fill(1, torch.tensor([3]), 18)), context, positions)
    # changing the last block token changes the first position's output: no causal mask
    assert (base[0, 0] - changed[0, 0]).abs().max() > 1e-3


def test_propose_protocol_shapes_and_positions(qwen3, saved):
    _, drafter, _ = saved
    proposer = DFlashProposer(drafter, qwen3)
    features = torch.randn(1, 6, drafter.fc.in_features, dtype=torch.float64)
    logits = proposer.propose(2, features).rows()
    assert logits.shape == (drafter.block_size - 1, VOCAB)
    # the same pass by hand: block [bonus, MASK x (B-1)] at positions 6..11, after the context
    block = torch.tensor([[2] + [MASK_TOKEN_ID] * (drafter.block_size - 1)])
    with torch.no_grad():
        hidden = drafter(qwen3.get_input_embeddings()(block), features, torch.arange(12)[None])
        expected = qwen3.get_output_embeddings()(hidden[0, 1:])
    assert_close(logits, expected, 1e-12)
    with pytest.raises(InvalidInputError, match="new_context_features"):
        proposer.propose(2, features[0])
    with pytest.raises(InvalidInputError, match="crop"):
        proposer.crop(7)


# ---- (f) clear errors -------------------------------------------------------------------------------


def test_hidden_size_mismatch_is_refused(saved):
    _, drafter, _ = saved
    wide = llama_target(hidden_size=48)
    with pytest.raises(CheckpointError, match="hidden size 32 differs from the target's 48"):
        DFlashProposer(drafter, wide)


def test_vocabulary_without_the_mask_token_is_refused(saved):
    _, drafter, _ = saved
    small = llama_target(vocab_size=MASK_TOKEN_ID)
    with pytest.raises(CheckpointError, match="mask_token_id 95 is outside"):
        DFlashProposer(drafter, small)


def test_target_with_other_layer_count_is_refused(saved):
    _, drafter, _ = saved
    with pytest.raises(CheckpointError, match="4 layers"):
        DFlashProposer(drafter, llama_target(num_hidden_layers=3))


def test_missing_weight_is_named(saved, tmp_path):
    _, _, directory = saved
    copy = _copy_checkpoint(directory, tmp_path / "missing")
    weights = load_file(copy / "model.safetensors")
    del weights["layers.1.self_attn.k_norm.weight"]
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"layers\.1\.self_attn\.k_norm\.weight"):
        DFlashDraftModel.from_pretrained(copy, dtype=torch.float64)


def test_fc_that_does_not_match_the_layer_ids_is_refused(saved, tmp_path):
    _, _, directory = saved
    copy = _copy_checkpoint(directory, tmp_path / "three_ids")
    _rewrite_config(copy, lambda c: c["dflash_config"].update(target_layer_ids=[0, 1, 2]))
    with pytest.raises(CheckpointError, match=r"fc\.weight"):
        DFlashDraftModel.from_pretrained(copy, dtype=torch.float64)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c["dflash_config"].pop("mask_token_id"), "mask_token_id"),
        (lambda c: c.pop("block_size"), "block_size"),
        (lambda c: c.pop("dflash_config"), "dflash_config"),
        (lambda c: c.update(architectures=["DFlash2DraftModel"]), "DFlash2DraftModel"),
    ],
    ids=["mask_token_id", "block_size", "dflash_config", "architecture"],
)
def test_config_without_dflash_fields_is_refused(saved, tmp_path, edit, message):
    _, _, directory = saved
    copy = _copy_checkpoint(directory, tmp_path / "config")
    _rewrite_config(copy, edit)
    with pytest.raises(CheckpointError, match=message):
        DFlashDraftModel.from_pretrained(copy, dtype=torch.float64)


def test_truncated_weights_are_a_one_line_checkpoint_error(saved, tmp_path):
    """Issue 14, defect 4: a cut-off model.safetensors gave a raw SafetensorError traceback."""
    _, _, directory = saved
    copy = _copy_checkpoint(directory, tmp_path / "truncated")
    weights = copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="damaged or cut short") as info:
        DFlashDraftModel.from_pretrained(copy, dtype=torch.float64)
    message = str(info.value)
    assert str(copy) in message and "\n" not in message


def test_config_that_is_not_json_is_a_checkpoint_error(saved, tmp_path):
    _, _, directory = saved
    copy = _copy_checkpoint(directory, tmp_path / "bad_json")
    (copy / "config.json").write_text('{"architectures": ["DFlashDraftModel"], ')
    with pytest.raises(CheckpointError, match="cannot load a DFlash drafter"):
        DFlashDraftModel.from_pretrained(copy, dtype=torch.float64)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("hidden_size", None, r"field 'hidden_size'.* expected int"),  # was a hub error type
        ("hidden_size", 0, "hidden_size must be a positive integer"),
        ("num_key_value_heads", 0, "num_key_value_heads must be a positive integer"),  # 1 / 0
        ("num_key_value_heads", 3, "must be a multiple of num_key_value_heads"),
        (
            "rms_norm_eps",
            float("nan"),
            "rms_norm_eps must be a small positive number",
        ),  # NaN logits
        ("rms_norm_eps", -1.0, "rms_norm_eps must be a small positive number"),
    ],
)
def test_config_fields_that_cannot_build_a_drafter_are_refused(
    saved, tmp_path, field, value, message
):
    """Found by the property-based suite (tests/test_robustness.py)."""
    _, _, directory = saved
    copy = _copy_checkpoint(directory, tmp_path / "bad_field")
    _rewrite_config(copy, lambda c: c.update({field: value}))
    with pytest.raises(CheckpointError, match=message):
        DFlashDraftModel.from_pretrained(copy, dtype=torch.float64)


def test_missing_checkpoint_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="cannot load"):
        DFlashDraftModel.from_pretrained(tmp_path / "nothing-here", local_files_only=True)


def test_prompt_longer_than_the_position_limit_is_refused(qwen3):
    verifier = TreeVerifier(qwen3, FEATURE_LAYER_IDS)
    with pytest.raises(InvalidInputError, match="max_position_embeddings"):
        verifier.prefill(list(range(MAX_POSITIONS + 1)))
    verifier.prefill([1] * (MAX_POSITIONS - 2))
    chain = build_chain(np.eye(3, VOCAB))  # a depth-3 chain would reach position 64
    with pytest.raises(InvalidInputError, match="max_position_embeddings"):
        verifier.verify(1, chain)


def test_verifier_refuses_bad_setups(qwen3):
    with pytest.raises(InvalidInputError, match="feature layer ids"):
        TreeVerifier(qwen3, [4])
    model = qwen3_target("sdpa")
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(InvalidInputError, match="sdpa"):
        TreeVerifier(model, FEATURE_LAYER_IDS)


def test_for_target_builds_a_fitting_drafter():
    llama = llama_target()
    drafter = new_drafter(llama, num_layers=1, target_layer_ids=None)
    assert drafter.target_layer_ids == (2,)  # one layer of a 4-layer target: the middle one
    assert drafter.config.hidden_size == HIDDEN and drafter.mask_token_id == MASK_TOKEN_ID
    logits = (
        DFlashProposer(drafter, llama)
        .propose(0, torch.randn(1, 3, HIDDEN, dtype=torch.float64))
        .rows()
    )
    assert logits.shape == (drafter.block_size - 1, VOCAB) and torch.isfinite(logits).all()


def test_drafter_runs_with_eager_and_sdpa_attention(qwen3, saved):
    _, _, directory = saved
    features = torch.randn(1, 5, len(FEATURE_LAYER_IDS) * HIDDEN, dtype=torch.float64)
    logits = {}
    for attn in TOL:
        drafter = DFlashDraftModel.from_pretrained(
            directory, dtype=torch.float64, attn_implementation=attn
        )
        assert drafter.config._attn_implementation == attn
        logits[attn] = DFlashProposer(drafter, qwen3).propose(4, features).rows()
    assert_close(logits["eager"], logits["sdpa"], TOL["eager"])


def _greedy_walk(tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], int]:
    """Follow the target's argmax down the tree: (accepted nodes, next bonus token)."""
    choice = logits.argmax(-1).tolist()  # row k + 1 is node k
    accepted, node = [], -1
    while (child := tree.child_with_token(node, choice[node + 1])) >= 0:
        accepted.append(child)
        node = child
    return accepted, choice[node + 1]


def test_rounds_keep_the_drafter_in_step_with_the_target(qwen3, saved):
    """Four rounds of the round loop (docs/design.md); the draft is nudged towards the target's greedy text
    for two positions so that rounds accept nodes (a random drafter alone would accept none)."""
    _, drafter, _ = saved
    prompt = prompt_ids(7)
    greedy = list(prompt)
    for _ in range(16):
        greedy.append(int(sequential(qwen3, greedy).logits[0, -1].argmax()))

    verifier = TreeVerifier(qwen3, drafter.target_layer_ids)
    proposer = DFlashProposer(drafter, qwen3)
    logits, features = verifier.prefill(prompt)
    committed, bonus = list(prompt), int(logits.argmax())
    for _ in range(4):
        draft = proposer.propose(bonus, features).rows()
        assert proposer.context_length == verifier.context_length == len(committed)
        hint = greedy[len(committed) + 1 : len(committed) + 3]
        draft[torch.arange(len(hint)), hint] += 20.0
        tree = build_ddtree(draft, 8)
        accepted, next_bonus = _greedy_walk(tree, verifier.verify(bonus, tree)[0])
        assert len(accepted) >= 2
        features = verifier.commit(accepted)
        committed += [bonus] + [int(tree.token_ids[k]) for k in accepted]
        bonus = next_bonus

    assert committed + [bonus] == greedy[: len(committed) + 1]  # lossless
    # drafting after the rounds equals drafting from scratch on the committed context
    reference = sequential(qwen3, committed).hidden_states
    fresh = (
        DFlashProposer(drafter, qwen3)
        .propose(bonus, extract_context_features(reference, drafter.target_layer_ids))
        .rows()
    )
    assert_close(proposer.propose(bonus, features).rows(), fresh, 1e-10)


def test_freed_heap_memory_goes_back_to_the_system():
    """What SpeculativeGenerator.decode calls after a long generation on the CPU: pages that
    glibc kept on its heap after a free are handed back (RSS falls)."""
    from caddtree.models.kvcache import _malloc_trim, return_freed_memory

    if _malloc_trim() is None or not Path("/proc/self/statm").exists():
        pytest.skip("needs glibc's malloc_trim and /proc (Linux)")

    def rss_mib() -> float:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20

    # 64 KiB blocks come from the heap; the last one stays, so the heap top cannot shrink alone
    blocks = [torch.ones(16 * 1024) for _ in range(2048)]  # 128 MiB, every page touched
    keep = blocks[-1]
    del blocks
    before = rss_mib()
    return_freed_memory()
    assert rss_mib() < before - 64, (before, rss_mib())
    assert keep.sum().item() == 16 * 1024


def test_verifier_passes_the_cache_under_the_name_the_model_takes(qwen3):
    """transformers 5.24 renamed ``past_key_values`` to ``cache`` and warns on the old name: the
    verifier passes the cache under whichever name ``forward``'s signature has."""
    import inspect

    verifier = TreeVerifier(qwen3, FEATURE_LAYER_IDS)
    names = inspect.signature(qwen3.forward).parameters
    expected = "cache" if "cache" in names else "past_key_values"
    seen: list[set[str]] = []
    forward = qwen3.forward

    def spy(*args, **kwargs):
        seen.append(set(kwargs))
        return forward(*args, **kwargs)

    qwen3.forward = spy
    try:
        verifier.reset()
        verifier.prefill(prompt_ids())
        verifier.verify(3, random_tree(1))
    finally:
        del qwen3.forward
    assert len(seen) == 2
    for kwargs in seen:
        assert expected in kwargs
        assert not ({"cache", "past_key_values"} - {expected}) & kwargs

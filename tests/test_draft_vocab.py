"""Draft vocabularies (EAGLE-3 / FR-Spec): the checkpoint layout, the drafter's logits over draft
ids, lossless decoding with trees built over draft ids, and choosing the vocabulary by coverage."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from caddtree import CaddtreeError
from caddtree.core.tree import build_ddtree
from caddtree.engine.decoding import decode, make_policy
from caddtree.models import DFlashDraftModel, DFlashProposer, TreeVerifier
from caddtree.train.data import TrainingData, choose_draft_vocab
from sampling_checks import hf_generate
from test_decoding import POLICIES, PROMPTS
from tiny_models import FEATURE_LAYER_IDS, MASK_TOKEN_ID, VOCAB, new_drafter

# every third token plus the top of the vocabulary: sparse, so a wrong mapping shows
DRAFT_IDS = sorted(set(range(0, VOCAB, 3)) | {VOCAB - 2})


@pytest.fixture(scope="module")
def saved(qwen3, tmp_path_factory):
    directory = tmp_path_factory.mktemp("draft-vocab")
    drafter = new_drafter(qwen3, draft_token_ids=DRAFT_IDS)
    drafter.save_pretrained(directory)
    loaded = DFlashDraftModel.from_pretrained(directory, dtype=torch.float64).eval()
    return drafter, loaded, directory


def test_checkpoint_stores_d2t_and_draft_vocab_size(saved):
    _, loaded, directory = saved
    config = json.loads((directory / "config.json").read_text())
    assert config["draft_vocab_size"] == len(DRAFT_IDS)
    tensors = load_file(directory / "model.safetensors")
    d2t = tensors["d2t"]
    assert d2t.dtype == torch.int64 and d2t.shape == (len(DRAFT_IDS),)
    # EAGLE-3's convention: target id = draft id + d2t[draft id]
    assert (torch.arange(len(DRAFT_IDS)) + d2t).tolist() == DRAFT_IDS
    assert loaded.draft_token_ids.tolist() == DRAFT_IDS
    assert not any("lm_head" in k or "embed" in k for k in tensors)


def test_logits_are_the_target_heads_rows_of_the_draft_vocabulary(qwen3, saved):
    original, _, _ = saved
    full = new_drafter(qwen3)  # the same weights (same seed) without a draft vocabulary
    features = torch.randn(1, 4, full.fc.in_features, dtype=torch.float64)
    small = DFlashProposer(original, qwen3).propose(7, features).rows()
    big = DFlashProposer(full, qwen3).propose(7, features).rows()
    assert small.shape == (5, len(DRAFT_IDS)) and big.shape == (5, VOCAB)
    torch.testing.assert_close(small, big[:, DRAFT_IDS], rtol=0, atol=1e-12)
    proposer = DFlashProposer(original, qwen3)
    assert proposer.token_map.tolist() == DRAFT_IDS


def test_tree_over_draft_ids_maps_to_target_ids():
    logits = np.random.default_rng(0).normal(size=(5, len(DRAFT_IDS)))
    tree = build_ddtree(logits, 12)
    mapped = tree.map_tokens(np.array(DRAFT_IDS))
    assert mapped.token_ids.tolist() == [DRAFT_IDS[t] for t in tree.token_ids]
    assert np.array_equal(mapped.parents, tree.parents)
    assert np.array_equal(mapped.log_probs, tree.log_probs)


@pytest.mark.parametrize("prompt", PROMPTS[:2], ids=["p5", "p10"])
def test_greedy_equals_ar_with_a_draft_vocabulary(qwen3, saved, prompt):
    _, loaded, _ = saved
    reference = hf_generate(qwen3, prompt, 30, do_sample=False)
    accepted = 0
    for method, kwargs in POLICIES:
        result = decode(
            TreeVerifier(qwen3, FEATURE_LAYER_IDS),
            prompt,
            make_policy(method, **kwargs),
            proposer=DFlashProposer(loaded, qwen3) if method != "ar" else None,
            max_new_tokens=30,
        )
        assert result.token_ids == reference, (method, kwargs)
        accepted += sum(r.accepted for r in result.stats.per_round)
    assert accepted > 0  # drafts in target ids were checked, and some matched


def test_damaged_d2t_is_refused(qwen3, saved, tmp_path):
    _, _, directory = saved
    for name in ("config.json",):
        (tmp_path / name).write_text((directory / name).read_text())
    tensors = load_file(directory / "model.safetensors")
    tensors["d2t"] = torch.full_like(tensors["d2t"], VOCAB)  # every id outside the vocabulary
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    drafter = DFlashDraftModel.from_pretrained(tmp_path, dtype=torch.float64)
    with pytest.raises(CaddtreeError, match="draft vocabulary"):
        DFlashProposer(drafter, qwen3)


def test_released_checkpoints_without_a_draft_vocabulary_are_unchanged(qwen3):
    drafter = new_drafter(qwen3)
    assert drafter.draft_token_ids is None and "d2t" not in drafter.state_dict()
    assert DFlashProposer(drafter, qwen3).token_map is None


def test_choose_draft_vocab_takes_the_smallest_covering_set():
    # responses: token 5 x6, token 7 x3, token 9 x1 (10 tokens); prompts are not counted
    seqs = [torch.tensor([1, 2, 5, 5, 5, 7, 9]), torch.tensor([3, 5, 5, 5, 7, 7])]
    data = TrainingData(seqs, [2, 1])
    ids, covered = choose_draft_vocab(data, 0.6)
    assert ids == [5] and covered == pytest.approx(0.6)
    ids, covered = choose_draft_vocab(data, 0.61, always=[MASK_TOKEN_ID])
    assert ids == [5, 7, MASK_TOKEN_ID] and covered == pytest.approx(0.9)
    ids, covered = choose_draft_vocab(data, 1.0)
    assert ids == [5, 7, 9] and covered == pytest.approx(1.0)


@pytest.mark.parametrize("draft_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocabulary", ["draft", "whole"])
def test_a_drafter_in_another_dtype_than_the_target_decodes_losslessly(
    qwen3, saved, draft_dtype, vocabulary
):
    """A float32 or bfloat16 drafter beside the float64 target: its head (a draft vocabulary's
    rows, copied) runs in its dtype, its logits are the float64 drafter's to its rounding, and
    every method still decodes the target's greedy tokens."""
    base = saved[1] if vocabulary == "draft" else new_drafter(qwen3)
    drafter = copy.deepcopy(base).to(draft_dtype)
    proposer = DFlashProposer(drafter, qwen3)
    expected_head = draft_dtype if vocabulary == "draft" else torch.float64
    assert proposer.lm_head.weight.dtype == expected_head
    features = torch.randn(1, 4, drafter.fc.in_features, dtype=torch.float64)
    rows = proposer.propose(7, features).rows().double()
    exact = DFlashProposer(base, qwen3).propose(7, features).rows()
    tolerance = 1e-4 if draft_dtype == torch.float32 else 0.1
    assert (rows - exact).abs().max() <= tolerance * exact.abs().max()
    prompt = PROMPTS[0]
    reference = hf_generate(qwen3, prompt, 30, do_sample=False)
    accepted = 0
    for method, kwargs in POLICIES[1:]:
        result = decode(
            TreeVerifier(qwen3, FEATURE_LAYER_IDS),
            prompt,
            make_policy(method, **kwargs),
            proposer=DFlashProposer(drafter, qwen3),
            max_new_tokens=30,
        )
        assert result.token_ids == reference, (method, kwargs)
        accepted += sum(r.accepted for r in result.stats.per_round)
    assert accepted > 0


def test_the_drafters_dtype_is_the_targets_unless_asked_and_auto_picks_bfloat16_for_float32(
    monkeypatch,
):
    from caddtree.util.devices import resolve_draft_dtype

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for target in (torch.float64, torch.float32, torch.bfloat16):
        assert resolve_draft_dtype("same", target, cpu) == target
        assert resolve_draft_dtype(None, target, cpu) == target
        assert resolve_draft_dtype("float32", target, cpu) == torch.float32
    for fast in (True, False):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda fast=fast: fast)
        picked = resolve_draft_dtype("auto", torch.float32, cpu)
        assert picked == (torch.bfloat16 if fast else torch.float32)
        assert resolve_draft_dtype("auto", torch.float64, cpu) == torch.float64
        assert resolve_draft_dtype("auto", torch.float32, cuda) == torch.float32
    with pytest.raises(CaddtreeError, match="unknown dtype"):
        resolve_draft_dtype("float13", torch.float32, cpu)


def test_from_pretrained_loads_the_drafter_in_the_dtype_asked_for(tiny_pair_dirs, cost_file):
    from caddtree import SpeculativeGenerator

    target, draft = tiny_pair_dirs
    same = SpeculativeGenerator.from_pretrained(target, draft, dtype="float64", device="cpu")
    other = SpeculativeGenerator.from_pretrained(
        target, draft, dtype="float64", device="cpu", draft_dtype="float32", cost_model=cost_file
    )
    assert same.drafter.dtype == torch.float64 and other.drafter.dtype == torch.float32
    assert other.verifier.dtype == torch.float64
    prompt = [5, 9, 2, 7, 1, 3]
    expected = same.generate(prompt, max_new_tokens=24, method="ar").token_ids
    for method, kwargs in (
        ("ddtree", {"budget": 8}),
        ("caddtree", {}),
        ("caddtree", {"lookup": True}),
    ):
        assert other.generate(prompt, max_new_tokens=24, method=method, **kwargs).token_ids == (
            expected
        ), method

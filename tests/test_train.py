"""Drafter training on a tiny target: the loss goes down, checkpoints are in the released format
and decode losslessly, and a resumed run is identical to an uninterrupted one."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from caddtree.engine.decoding import decode, make_policy
from caddtree.models import DFlashDraftModel, DFlashProposer, TreeVerifier
from caddtree.train.data import TrainingData, prepare_data
from caddtree.train.features import compute_features
from caddtree.train.loss import AnchorBlockLoss, build_training_batch, dpace_weights
from caddtree.train.trainer import train_drafter
from tiny_models import (
    FEATURE_LAYER_IDS,
    MASK_TOKEN_ID,
    VOCAB,
    new_drafter,
    qwen3_target,
    train_config,
)
from tiny_tokenizer import tiny_tokenizer

config = train_config


def test_generate_responses_is_greedy_and_keeps_order(target, data):
    assert len(data.sequences) == 40
    for seq, plen in list(zip(data.sequences, data.prompt_lengths))[:5]:
        prompt = seq[:plen]
        ref = target.generate(prompt[None], do_sample=False, max_new_tokens=24, pad_token_id=0)[0]
        assert torch.equal(ref, seq)


def test_training_batch_masks_blocks():
    tokens = torch.arange(10, 30)
    anchors = torch.tensor([5, 12, 17])
    batch = build_training_batch(tokens, anchors, 4, 99, torch.float32)
    visible = batch["attention_mask"][0, 0] == 0
    T, B = 20, 4
    for j, a in enumerate(anchors.tolist()):
        rows = visible[j * B : (j + 1) * B]
        # context strictly before the anchor, nothing at or after it
        assert rows[:, :a].all() and not rows[:, a:T].any()
        # its own block, bidirectionally, and no other block
        own = torch.zeros(3 * B, dtype=torch.bool)
        own[j * B : (j + 1) * B] = True
        assert torch.equal(rows[:, T:], own.expand(B, -1))
    assert batch["block_tokens"].view(3, B)[:, 0].tolist() == tokens[anchors].tolist()
    assert (batch["block_tokens"].view(3, B)[:, 1:] == 99).all()
    assert batch["position_ids"][0, T:].view(3, B)[:, 0].tolist() == anchors.tolist()
    # labels: the next B-1 tokens, -100 past the end
    assert batch["labels"][0, 0].tolist() == tokens[6:9].tolist()
    assert batch["labels"][0, 2].tolist() == [tokens[18].item(), tokens[19].item(), -100]


def test_training_lowers_the_loss_and_decodes_losslessly(target, data, tmp_path):
    train_drafter(
        target,
        data,
        tmp_path,
        config(steps=300, save_every=150, eval_every=30),
        resume=False,
        progress=False,
    )
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 300
    first = sum(e["loss"] for e in log[:10]) / 10
    last = sum(e["loss"] for e in log[-10:]) / 10
    # from about ln(96) = 4.56 nats (a uniform guess) to well below it
    assert first > 4.3 and last < 0.9 * first, (first, last)
    evals = [e["eval_loss"] for e in log if "eval_loss" in e]
    assert len(evals) == 10 and evals[-1] < evals[0]  # held-out loss falls too

    ckpt = tmp_path / "checkpoint"
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 6
    keys = set(load_file(ckpt / "model.safetensors"))
    assert not any("embed" in k or "lm_head" in k for k in keys) and "fc.weight" in keys

    drafter = DFlashDraftModel.from_pretrained(ckpt, dtype=torch.float64).eval()
    dd = assert_ddtree_equals_ar(target, drafter, data, 0)
    assert dd.stats.tau > 1.0  # the trained drafter gets drafts accepted

    # the held-out walks are what decoding does: round by round, the tokens it commits, with the
    # chain (DFlash) and with DDTree trees
    evals = [e for e in log if "eval_loss" in e]
    assert all(e["eval_tree_tau"] >= 1.0 and e["eval_walk_tau"] >= 1.0 for e in evals)
    feats = compute_features(target, data, drafter.target_layer_ids, progress=False)
    walker = AnchorBlockLoss(drafter, target, feats, data, config(), torch.device("cpu"))
    for method, budget in (("dflash", None), ("ddtree", 3), ("ddtree", 12)):
        accepted_somewhere = False
        for i in range(6):
            decoded = decode_sample(target, drafter, data, i, method, budget)
            walk = walker.walk(i, budget, chunk=5)
            assert walk == [r.committed for r in decoded.stats.per_round], (method, budget, i)
            accepted_somewhere |= max(walk) > 1
        assert accepted_somewhere  # the comparison covers accepted drafts, not only bonus tokens
    assert walker.chain_walk(0) == walker.walk(0, None)
    # one drafter pass serves several budgets, as the trainer's evaluation uses it
    assert walker.walks(1, [None, 3, 12]) == [walker.walk(1, b) for b in (None, 3, 12)]


def decode_sample(target, drafter, data, i: int, method: str = "dflash", budget=None):
    """Decode sample ``i``'s prompt with ``method`` (the drafter's chain, or DDTree of ``budget``
    nodes) for as many tokens as its response has; the result must be that response (the
    target's own greedy output)."""
    seq, plen = data.sequences[i], data.prompt_lengths[i]
    result = decode(
        TreeVerifier(target, drafter.target_layer_ids),
        seq[:plen].tolist(),
        make_policy(method, budget=budget),
        proposer=DFlashProposer(drafter, target),
        max_new_tokens=len(seq) - plen,
    )
    assert result.token_ids == seq[plen:].tolist()
    return result


def assert_ddtree_equals_ar(target, drafter, data, sample: int):
    """Decode a sample's prompt with DDTree-8 and the trained drafter; it must reproduce AR."""
    prompt = data.sequences[sample][: data.prompt_lengths[sample]].tolist()
    verifier = TreeVerifier(target, drafter.target_layer_ids)
    ar = decode(verifier, prompt, make_policy("ar"), max_new_tokens=20)
    dd = decode(
        verifier,
        prompt,
        make_policy("ddtree", budget=8),
        proposer=DFlashProposer(drafter, target),
        max_new_tokens=20,
    )
    assert dd.token_ids == ar.token_ids
    return dd


def test_resume_is_identical_to_an_uninterrupted_run(target, data, tmp_path):
    cfg = config(steps=12, save_every=5, eval_every=6)
    train_drafter(target, data, tmp_path / "straight", cfg, resume=False, progress=False)
    # interrupted after 7 steps (between two checkpoints, so the end-of-call save is used), resumed
    train_drafter(
        target,
        data,
        tmp_path / "resumed",
        config(steps=12, save_every=5, eval_every=6),
        progress=False,
        stop_after=7,
    )
    state = json.loads((tmp_path / "resumed" / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == 7
    # a step logged after the checkpoint by a killed call is run again, not listed twice
    with open(tmp_path / "resumed" / "train_log.jsonl", "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"step": 8, "loss": 99.0}) + "\n")
    train_drafter(
        target,
        data,
        tmp_path / "resumed",
        config(steps=12, save_every=5, eval_every=6),
        progress=False,
    )
    a = load_file(tmp_path / "straight" / "checkpoint" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "checkpoint" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    log_a = (tmp_path / "straight" / "train_log.jsonl").read_text().splitlines()
    log_b = (tmp_path / "resumed" / "train_log.jsonl").read_text().splitlines()
    strip = [{k: v for k, v in json.loads(x).items() if k != "step_s"} for x in log_a]
    assert strip == [{k: v for k, v in json.loads(x).items() if k != "step_s"} for x in log_b]
    assert len(strip) == 12


def test_resume_with_other_settings_is_refused(target, data, tmp_path):
    train_drafter(
        target, data, tmp_path, config(steps=2, save_every=1), resume=False, progress=False
    )
    with pytest.raises(ValueError, match="other settings"):
        train_drafter(target, data, tmp_path, config(steps=4, learning_rate=1e-4), progress=False)


def test_training_data_is_kept_as_uint16_and_read_from_its_xz_copy(tmp_path):
    seqs = [torch.tensor([1, 65535, 7]), torch.tensor([3, 4])]
    data = TrainingData(seqs, [1, 2], {"generators": [{"first": 0, "end": 2}]})
    data.save(tmp_path / "data.safetensors.xz")
    assert not (tmp_path / "data.safetensors").exists()
    assert TrainingData.exists(tmp_path / "data.safetensors")
    back = TrainingData.load(tmp_path / "data.safetensors")  # found as the .xz beside it
    assert [s.tolist() for s in back.sequences] == [[1, 65535, 7], [3, 4]]
    assert back.prompt_lengths == [1, 2] and back.meta == data.meta
    assert TrainingData.read_meta(tmp_path / "data.safetensors") == data.meta
    wide = TrainingData([torch.tensor([70000, 2])], [1], {})
    wide.save(tmp_path / "wide.safetensors")
    assert TrainingData.load(tmp_path / "wide.safetensors").sequences[0].tolist() == [70000, 2]
    with pytest.raises(ValueError, match="no training data"):
        TrainingData.load(tmp_path / "none.safetensors")


def test_the_newer_of_a_plain_file_and_its_xz_is_read_and_a_damaged_xz_is_named(tmp_path, caplog):
    import os

    from caddtree.util.errors import CaddtreeError
    from caddtree.util.files import read_packed, write_packed

    plain, packed = tmp_path / "raw.jsonl", tmp_path / "raw.jsonl.xz"
    write_packed(packed, b"new\n")
    plain.write_bytes(b"stale\n")
    os.utime(plain, (1, 1))  # older than the .xz copied in beside it
    assert read_packed(plain) == b"new\n" and "is newer than raw.jsonl" in caplog.text
    plain.write_bytes(b"grown\n")  # the run's plain file grew after the .xz
    assert read_packed(plain) == b"grown\n"
    plain.unlink()
    packed.write_bytes(packed.read_bytes()[:-8])  # cut short
    with pytest.raises(CaddtreeError, match="raw.jsonl.xz is not a complete xz file"):
        read_packed(plain)


def test_prepare_data_resumes_and_checks_fingerprint(target, tmp_path):
    tok = tiny_tokenizer(MASK_TOKEN_ID)
    prompts = ["hello", "what is 2 + 2?", "tell me a story", "abc", "zz"]
    path = tmp_path / "data.safetensors"
    partial = prepare_data(
        target, tok, prompts[:2] + prompts[2:], path, max_new_tokens=6, chunk_size=2, progress=False
    )
    full = TrainingData.load(path)
    assert len(full.sequences) == 5 and all(
        torch.equal(a, b) for a, b in zip(full.sequences, partial.sequences)
    )
    # simulate an interruption after the first chunk, then resume
    TrainingData(full.sequences[:2], full.prompt_lengths[:2], full.meta).save(path)
    again = prepare_data(target, tok, prompts, path, max_new_tokens=6, chunk_size=2, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(again.sequences, full.sequences))
    # where each range of samples came from is recorded; the range cut short is recounted and
    # chunks of one generator grow one range
    assert [(r["first"], r["end"]) for r in full.meta["generators"]] == [(0, 5)]
    ranges = TrainingData.read_meta(path)["generators"]
    assert [(r["first"], r["end"]) for r in ranges] == [(0, 2), (2, 5)]
    assert [r["response_tokens"] for r in ranges] == [
        TrainingData(full.sequences[a:b], full.prompt_lengths[a:b]).response_tokens()
        for a, b in [(0, 2), (2, 5)]
    ]
    assert "seconds" not in ranges[0] and ranges[1]["generator"] in ("engine", "hf")
    # the committed form: only the .xz beside the run's path, which the run resumes from
    xz = tmp_path / "committed" / "data.safetensors"
    TrainingData(full.sequences[:3], full.prompt_lengths[:3], full.meta).save(f"{xz}.xz")
    grown = prepare_data(target, tok, prompts, xz, max_new_tokens=6, chunk_size=2, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(grown.sequences, full.sequences))
    ranges = TrainingData.read_meta(xz)["generators"]  # only the last two were generated
    assert [(r["first"], r["end"]) for r in ranges][-1] == (3, 5)
    with pytest.raises(ValueError, match="other prompts"):
        prepare_data(target, tok, prompts[::-1], path, max_new_tokens=6, progress=False)


def test_samples_no_range_records_get_a_range_of_their_own():
    from caddtree.train.data import record_provenance

    seqs = [torch.tensor([1, 2, 3, 4][: i + 2]) for i in range(3)]
    made = {"first": 0, "end": 1, "generator": "hf", "batch_size": 8, "seconds": 2.0}
    done = TrainingData(seqs, [1, 1, 1], {"generators": [dict(made, response_tokens=1)]})
    chunk = TrainingData([torch.tensor([5, 6, 7])], [1], {"generator": "engine"})
    record_provenance(done, chunk, 1.5, 16)
    assert done.meta["generators"] == [
        dict(made, response_tokens=1),
        {"first": 1, "end": 3, "generator": None, "response_tokens": 5},  # 2 + 3 tokens
        {
            "first": 3,
            "end": 4,
            "generator": "engine",
            "batch_size": 16,
            "seconds": 1.5,
            "response_tokens": 2,
        },
    ]
    unrecorded = TrainingData(seqs[:2], [1, 1], {})
    record_provenance(unrecorded, chunk, 1.0, 16)
    assert [(r["first"], r["end"], r["generator"]) for r in unrecorded.meta["generators"]] == [
        (0, 2, None),
        (2, 3, "engine"),
    ]


def test_sigterm_saves_a_checkpoint_like_ctrl_c(target, data, tmp_path):
    """`kill PID` (how background and scheduled jobs are stopped) saves the run like Ctrl-C."""
    import os
    import signal
    import threading
    import time

    log = tmp_path / "train_log.jsonl"

    def stop_after_first_step() -> None:
        deadline = time.monotonic() + 120

        def steps_done() -> bool:
            return log.exists() and bool(log.read_text().strip())

        while not steps_done() and time.monotonic() < deadline:
            time.sleep(0.01)
        if steps_done():  # the handler is installed once steps run
            os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    stopper = threading.Thread(target=stop_after_first_step)
    stopper.start()
    with pytest.raises(KeyboardInterrupt):
        train_drafter(
            target,
            data,
            tmp_path,
            config(steps=10**6, save_every=10**6),
            resume=False,
            progress=False,
        )
    stopper.join()
    state = json.loads((tmp_path / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] >= 1
    assert (tmp_path / "checkpoint" / "model.safetensors").is_file()
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is put back


def test_batch_of_several_sequences_pads_without_leaking():
    a, b = torch.arange(10, 30), torch.arange(50, 62)  # T = 20 and 12
    batch = build_training_batch(
        [a, b], [torch.tensor([5, 12, 17]), torch.tensor([3])], 4, 99, torch.float32
    )
    B, T, M = 4, 20, 3
    assert batch["block_tokens"].shape == (2, M * B)
    assert batch["attention_mask"].shape == (2, 1, M * B, T + M * B)
    single = build_training_batch(b, torch.tensor([3]), 4, 99, torch.float32)
    visible = batch["attention_mask"][1, 0] == 0
    # the short sequence's one block sees what it sees alone: context < 3 and its own 4 positions
    own = single["attention_mask"][0, 0] == 0  # [4, 12 + 4]
    assert torch.equal(visible[:B, :12], own[:, :12]) and not visible[:B, 12:T].any()
    assert torch.equal(visible[:B, T : T + B], own[:, 12:])
    assert not visible[:B, T + B :].any()
    assert batch["labels"][1, 0].tolist() == b[4:7].tolist()
    assert (batch["labels"][1, 1:] == -100).all()  # padding blocks are never scored
    assert batch["position_ids"][1, T : T + B].tolist() == [3, 4, 5, 6]
    assert torch.equal(
        batch["labels"][0],
        build_training_batch(a, torch.tensor([5, 12, 17]), 4, 99, torch.float32)["labels"][0],
    )


def test_training_with_a_draft_vocabulary_and_bfloat16(target, data, tmp_path):
    train_drafter(
        target,
        data,
        tmp_path,
        config(steps=300, draft_vocab_coverage=0.9, precision="bfloat16"),
        resume=False,
        progress=False,
        stop_token_ids=[1],
    )
    drafter = DFlashDraftModel.from_pretrained(tmp_path / "checkpoint", dtype=torch.float64)
    ids = drafter.draft_token_ids.tolist()
    responses = torch.cat([s[p:] for s, p in zip(data.sequences, data.prompt_lengths)])
    covered = torch.isin(responses, torch.tensor(ids)).float().mean().item()
    assert covered >= 0.9 and 1 in ids and len(ids) < VOCAB
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert sum(e["loss"] for e in log[-10:]) < 0.9 * sum(e["loss"] for e in log[:10])
    assert_ddtree_equals_ar(target, drafter, data, 1)


def test_memorised_samples_decode_in_whole_blocks(target, data, tmp_path):
    """The guard against a train/inference mismatch: a drafter trained until it memorises a few
    samples must draft them almost perfectly through the real decoding loop. A misaligned
    feature, position or label keeps acceptance near zero however long it trains."""
    few = TrainingData(data.sequences[:4], data.prompt_lengths[:4])
    cfg = config(
        steps=400,
        num_layers=2,
        anchors_per_sample=24,
        samples_per_step=4,
        learning_rate=3e-3,
        eval_fraction=0.0,
        save_every=400,
    )
    train_drafter(target, few, tmp_path, cfg, resume=False, progress=False)
    drafter = DFlashDraftModel.from_pretrained(tmp_path / "checkpoint", dtype=torch.float64)
    for i in range(len(few.sequences)):
        result = decode_sample(target, drafter, few, i)
        full_rounds = result.stats.per_round[:-1]  # the last round is cut by max_new_tokens
        tau = sum(r.committed for r in full_rounds) / len(full_rounds)
        assert tau >= 0.8 * cfg.block_size, tau


def test_prepare_data_grows_when_prompts_are_appended(target, tmp_path):
    tok = tiny_tokenizer(MASK_TOKEN_ID)
    path = tmp_path / "data.safetensors"
    first = prepare_data(target, tok, ["hello", "abc"], path, max_new_tokens=5, progress=False)
    grown = prepare_data(
        target,
        tok,
        ["hello", "abc", [{"role": "user", "content": "zz"}]],
        path,
        max_new_tokens=5,
        progress=False,
    )
    assert len(grown.sequences) == 3
    assert all(torch.equal(a, b) for a, b in zip(first.sequences, grown.sequences))
    # a run on the first prompts only reuses the first responses, and leaves the file whole
    fewer = prepare_data(target, tok, ["hello"], path, max_new_tokens=5, progress=False)
    assert len(fewer.sequences) == 1 and torch.equal(fewer.sequences[0], first.sequences[0])
    assert len(TrainingData.load(path).sequences) == 3
    with pytest.raises(ValueError, match="max_new_tokens: saved 5, now 6"):
        prepare_data(target, tok, ["hello", "abc"], path, max_new_tokens=6, progress=False)


def test_batched_features_equal_one_sequence_at_a_time(target, data):
    few = TrainingData(data.sequences[:7], data.prompt_lengths[:7])
    batched = compute_features(target, few, [0, 2], max_batch_tokens=64, progress=False)
    for seq, feats in zip(few.sequences, batched):
        single = compute_features(target, TrainingData([seq], [1]), [0, 2], progress=False)[0]
        assert feats.shape == (len(seq), 2 * 32)
        torch.testing.assert_close(feats, single, rtol=0, atol=1e-10)


def test_cached_responses_and_features_belong_to_one_target_and_dtype(target, tmp_path):
    """Another model that shares the tokenizer, or the same model in another dtype, must not
    reuse the responses or the context features cached for the first one."""
    from caddtree.train.features import cached_features

    tok = tiny_tokenizer(MASK_TOKEN_ID)
    path = tmp_path / "data.safetensors"
    data = prepare_data(target, tok, ["hello", "abc"], path, max_new_tokens=5, progress=False)
    other = qwen3_target(seed=1)  # same shapes and tokenizer, other weights
    with pytest.raises(ValueError, match="target: saved"):
        prepare_data(other, tok, ["hello", "abc"], path, max_new_tokens=5, progress=False)
    as_float32 = qwen3_target().float()
    with pytest.raises(ValueError, match="dtype: saved 'float64', now 'float32'"):
        prepare_data(as_float32, tok, ["hello", "abc"], path, max_new_tokens=5, progress=False)

    feats_path = tmp_path / "features.safetensors"
    first = cached_features(target, data, [0, 2], feats_path, progress=False)
    recomputed = cached_features(other, data, [0, 2], feats_path, progress=False)
    expected = compute_features(other, data, [0, 2], progress=False)
    assert all(torch.equal(a, b) for a, b in zip(recomputed, expected))
    assert not all(torch.equal(a, b) for a, b in zip(first, recomputed))


def test_a_save_interrupted_between_its_renames_resumes_from_the_previous_checkpoint(
    target, data, tmp_path
):
    cfg = config(steps=6, save_every=3, eval_every=6)
    train_drafter(target, data, tmp_path, cfg, progress=False, stop_after=3)
    ckpt = tmp_path / "checkpoint"
    # the state a crash leaves after the first rename of the next save: only checkpoint.old
    ckpt.rename(tmp_path / "checkpoint.old")
    one_more = train_drafter(target, data, tmp_path, cfg, progress=False, stop_after=1)
    assert one_more["step"] == 4  # resumed after step 3 (a restart would have run step 1)
    assert not (tmp_path / "checkpoint.old").exists()
    final = train_drafter(target, data, tmp_path, cfg, progress=False)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert [e["step"] for e in state["log"]] == [1, 2, 3, 4, 5, 6]
    straight = train_drafter(target, data, tmp_path / "straight", cfg, progress=False)
    assert straight["loss"] == final["loss"]


def test_growing_a_drafter_keeps_its_function_and_trains_on(target, data, tmp_path):
    """``--init-from`` a drafter with fewer layers appends layers that start as the identity
    (zero output projections), so the grown drafter computes exactly what the smaller one did."""
    from caddtree.train.trainer import grow_drafter
    from caddtree.util.errors import InvalidInputError
    from tiny_models import new_drafter

    small = new_drafter(target, num_layers=1, draft_token_ids=list(range(0, VOCAB, 2)))
    grown = grow_drafter(small, 3)
    assert grown.config.num_hidden_layers == 3 and torch.equal(grown.d2t, small.d2t)
    hidden = target.config.hidden_size
    gen = torch.Generator().manual_seed(3)
    noise = torch.randn(1, 6, hidden, generator=gen, dtype=torch.float64)
    context = torch.randn(1, 4, 2 * hidden, generator=gen, dtype=torch.float64)
    positions = torch.arange(10)[None]
    with torch.no_grad():
        assert torch.equal(small(noise, context, positions), grown(noise, context, positions))
    # the new layers are not dead: their inputs are trained copies, only their outputs start at 0
    assert grown.layers[2].self_attn.o_proj.weight.abs().max() == 0
    assert torch.equal(
        grown.layers[2].self_attn.q_proj.weight, small.layers[0].self_attn.q_proj.weight
    )

    first = tmp_path / "one-layer"
    train_drafter(target, data, first, config(steps=10), resume=False, progress=False)
    second = tmp_path / "two-layers"
    train_drafter(
        target,
        data,
        second,
        config(steps=20, num_layers=2),
        resume=False,
        progress=False,
        init_from=first,
    )
    drafter = DFlashDraftModel.from_pretrained(second / "checkpoint", dtype=torch.float64)
    assert drafter.config.num_hidden_layers == 2
    assert drafter.layers[1].self_attn.o_proj.weight.abs().max() > 0  # it learned
    assert_ddtree_equals_ar(target, drafter, data, 1)
    with pytest.raises(InvalidInputError, match="at least as many --num-layers"):
        train_drafter(
            target,
            data,
            tmp_path / "x",
            config(num_layers=1),
            resume=False,
            progress=False,
            init_from=second,
        )


def test_dpace_weights_are_each_positions_share_of_the_accepted_length():
    # one block of four positions: confidences 0.5, 1, 0.25, and a label outside the vocabulary
    valid = torch.tensor([[True, True, True, False]])
    q = torch.tensor([0.5, 1.0, 0.25])
    ce = torch.cat([-torch.log(q), torch.tensor([7.0])])[None]  # the last is not read
    w = dpace_weights(ce, valid, alpha=0.5)
    s = 0.5 * q + 0.5  # smoothed: 0.75, 1.0, 0.625
    reach = [s[0], s[0] * s[1], s[0] * s[1] * s[2]]  # chance to reach past each position
    expected = [reach[0] + reach[1] + reach[2], reach[1] + reach[2], reach[2], 0.0]
    assert torch.allclose(w, torch.tensor([expected]))
    # alpha = 1 ignores the confidences: position j weighs the positions left from it
    w1 = dpace_weights(ce, valid, alpha=1.0)
    assert torch.equal(w1, torch.tensor([[3.0, 2.0, 1.0, 0.0]]))
    # an invalid position ends the chain: nothing after it is weighed
    gap = torch.tensor([[True, False, True]])
    assert dpace_weights(torch.zeros(1, 3), gap, 0.5).tolist() == [[1.0, 0.0, 0.0]]


def test_dpace_weighting_trains_and_is_kept_on_resume(target, data, tmp_path):
    cfg = config(steps=200, loss_weighting="dpace", save_every=100, eval_every=50)
    train_drafter(target, data, tmp_path, cfg, resume=False, progress=False, stop_after=100)
    # resuming under the other weighting is refused: it would be another run
    with pytest.raises(ValueError, match="other settings"):
        train_drafter(target, data, tmp_path, config(steps=200, save_every=100), progress=False)
    train_drafter(target, data, tmp_path, cfg, progress=False)
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 200
    first = sum(e["loss"] for e in log[:10]) / 10
    last = sum(e["loss"] for e in log[-10:]) / 10
    # from about ln(96) = 4.56 nats (a uniform guess) down; the weights move to later, harder
    # positions as the drafter improves, so the weighted loss falls less than the decay's
    assert first > 4.3 and last < first - 0.2, (first, last)
    evals = [e["eval_loss"] for e in log if "eval_loss" in e]
    assert len(evals) == 4 and evals[-1] < evals[0]  # held-out loss falls too
    drafter = DFlashDraftModel.from_pretrained(tmp_path / "checkpoint", dtype=torch.float64)
    assert_ddtree_equals_ar(target, drafter, data, 1)
    with pytest.raises(ValueError, match="loss_weighting"):
        config(loss_weighting="kl").validate()
    with pytest.raises(ValueError, match="dpace_alpha"):
        config(dpace_alpha=0.0).validate()


def test_split_keeps_each_samples_side_when_the_data_grows(data, tmp_path):
    """With a run's split record, samples keep their side (held out or trained on) as the data
    grows and in runs with another seed; without a record the split is the seeded rule."""
    from caddtree.train.data import split_samples

    cfg = config(eval_fraction=0.25)
    record = tmp_path / "split.json"
    first = TrainingData(data.sequences[:24], data.prompt_lengths[:24])
    train24, held24 = split_samples(first, cfg, record)
    assert (train24, held24) == split_samples(first, cfg)  # a new record: the plain rule
    assert len(held24) == 6 and json.loads(record.read_text())["samples"] == 24
    train40, held40 = split_samples(data, cfg, record)
    assert set(held24) <= set(held40) and set(train24) <= set(train40)
    assert sorted(train40 + held40) == list(range(40))
    assert len(held40) == 6 + 4  # a quarter of the 16 appended samples
    assert json.loads(record.read_text())["samples"] == 40
    # a run on fewer samples reads the record's first ones and leaves it whole
    assert split_samples(first, cfg, record) == (train24, held24)
    assert json.loads(record.read_text())["samples"] == 40
    # a run with another seed or fraction keeps the record's sides (its rule stays recorded)
    for other in (config(eval_fraction=0.25, seed=5), config(eval_fraction=0.5, seed=0)):
        train, held = split_samples(data, other, record)
        assert sorted(held) == sorted(held40) and sorted(train) == sorted(train40)
    assert json.loads(record.read_text())["rule"] == {"seed": cfg.seed, "eval_fraction": 0.25}
    assert split_samples(data, config(eval_fraction=0.25, seed=5)) != (train40, held40)


def test_feature_cache_computes_only_appended_samples(target, data, tmp_path, monkeypatch):
    """Growing the data computes the new samples' features only (also from a cache written
    before the digest existed); other data, layers or targets are computed afresh."""
    from safetensors.torch import save_file

    from caddtree.train import features as feature_module
    from caddtree.train.data import target_fingerprint

    computed = []
    real = feature_module.compute_features

    def counting(target, data, layer_ids, **kw):
        computed.append(len(data.sequences))
        return real(target, data, layer_ids, **kw)

    monkeypatch.setattr(feature_module, "compute_features", counting)
    path = tmp_path / "features.safetensors"
    first = TrainingData(data.sequences[:12], data.prompt_lengths[:12])
    feature_module.cached_features(target, first, [0, 2], path, progress=False)
    grown = feature_module.cached_features(target, data, [0, 2], path, progress=False)
    assert computed == [12, 28]
    expected = real(target, data, [0, 2], progress=False)
    for got, want in zip(grown, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    loaded = feature_module.load_features(path)
    assert len(loaded) == 40 and all(torch.equal(a, b) for a, b in zip(loaded, grown))
    assert len(feature_module.cached_features(target, data, [0, 2], path, False)) == 40
    assert computed == [12, 28]  # all cached now
    # a sample of the cached prefix changed: its features are stale, so all are recomputed
    changed = TrainingData([s.clone() for s in data.sequences], list(data.prompt_lengths))
    changed.sequences[3][-1] = (changed.sequences[3][-1] + 1) % 90
    feature_module.cached_features(target, changed, [0, 2], path, progress=False)
    assert computed == [12, 28, 40]
    feature_module.cached_features(target, changed, [0, 1], path, progress=False)
    assert computed == [12, 28, 40, 40]
    # a file in the earlier format (its key has counts but no digest) is extended too
    old_key = {"layers": [0, 2], "n": 12, "tokens": int(sum(len(s) for s in first.sequences))}
    feats = real(target, first, [0, 2], progress=False)
    tensors = {"features": torch.cat(feats), "lengths": torch.tensor([len(f) for f in feats])}
    key = json.dumps({**old_key, **target_fingerprint(target)})
    save_file(tensors, str(path), metadata={"key": key})
    again = feature_module.cached_features(target, data, [0, 2], path, progress=False)
    assert computed[-1] == 28 and len(again) == 40
    # a damaged file is computed again, not a traceback
    path.write_bytes(path.read_bytes()[:100])
    assert len(feature_module.cached_features(target, data, [0, 2], path, False)) == 40
    assert computed[-1] == 40 and len(feature_module.load_features(path)) == 40


def test_a_float32_step_scores_with_a_float32_copy_of_a_half_precision_head(target, data):
    """With --precision float32 the frozen head is a float32 copy of the target's (bfloat16)
    rows: the transposed bfloat16 matmul of its input gradient ran at about 1 GFLOP/s on a CPU
    without AVX512-BF16 (10 s a step). With bfloat16 autocast it stays the target's."""
    import copy

    from caddtree.cli.train import training_precision

    half = copy.deepcopy(target).to(torch.bfloat16)
    feats = compute_features(half, data, list(FEATURE_LAYER_IDS), progress=False)
    model = new_drafter(half).float()
    head = half.get_output_embeddings().weight
    for precision, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        cfg = train_config(precision=precision, block_size=model.block_size)
        loss = AnchorBlockLoss(model, half, feats, data, cfg, torch.device("cpu"))
        assert loss.lm_head.weight.dtype == dtype and not loss.lm_head.weight.requires_grad
        assert torch.equal(loss.lm_head.weight.to(torch.bfloat16), head)
        value, _ = loss.batch_loss([0, 1], torch.Generator().manual_seed(0))
        value.backward()
        assert torch.isfinite(value) and model.fc.weight.grad is not None
    rows = list(range(0, VOCAB, 3))  # a draft vocabulary: its rows copied once, in float32
    model = new_drafter(half, num_layers=1, draft_token_ids=rows).float()
    cfg = train_config(precision="float32", block_size=model.block_size)
    loss = AnchorBlockLoss(model, half, feats, data, cfg, torch.device("cpu"))
    assert loss.lm_head.weight.dtype == torch.float32
    assert torch.equal(loss.lm_head.weight.to(torch.bfloat16), head[rows])
    assert training_precision("float32", "cpu") == "float32"
    assert training_precision("bfloat16", "cpu") == "bfloat16"
    fast = torch.cpu._is_avx512_bf16_supported()
    assert training_precision("auto", "cpu") == ("bfloat16" if fast else "float32")


def reference_loss(loss: AnchorBlockLoss, sample_ids, anchors):
    """The loss written out plainly: the batch from :func:`build_training_batch` (an additive
    mask, features copied from the host), the head on the scored rows only, the
    position-weighted mean of their cross-entropies."""
    drafter, cfg = loss.drafter, loss.config
    seqs = [loss.data.sequences[i] for i in sample_ids]
    dtype = drafter.fc.weight.dtype
    batch = build_training_batch(seqs, anchors, cfg.block_size, drafter.mask_token_id, dtype)
    T = batch["position_ids"].shape[1] - batch["block_tokens"].shape[1]
    hidden_in = torch.zeros((len(seqs), T, drafter.fc.in_features), dtype=dtype)
    for r, i in enumerate(sample_ids):
        n = seqs[r].shape[0]
        hidden_in[r, :n] = loss.bank.features[int(loss.bank.starts[i]) :][:n].to(dtype)
    hidden = drafter(
        noise_embedding=loss.embed(batch["block_tokens"]).to(dtype),
        target_hidden=hidden_in,
        position_ids=batch["position_ids"],
        attention_mask=batch["attention_mask"],
    )
    b, M, B = len(seqs), batch["labels"].shape[1], cfg.block_size
    hidden = hidden.view(b, M, B, -1)[:, :, 1:]
    labels = batch["labels"]
    valid = labels >= 0
    logits = loss.lm_head(hidden[valid])  # float32 at least, as the trainer computes them
    logits = logits if logits.dtype == torch.float64 else logits.float()
    ce = torch.nn.functional.cross_entropy(logits, labels[valid], reduction="none")
    weights = loss.position_weights.expand(valid.shape)[valid]
    return (weights * ce).sum() / weights.sum()


def test_the_device_batches_give_the_loss_and_gradients_of_the_host_batches(target, data):
    """The same blocks (a short sample among them, so that padding blocks are built) give the
    same loss and gradients as the host-built batches the trainer used before (a float64
    drafter and target; the logits are float64 in both)."""
    feats = compute_features(target, data, list(FEATURE_LAYER_IDS), progress=False)
    model = new_drafter(target)
    cfg = train_config(block_size=model.block_size)
    loss = AnchorBlockLoss(model, target, feats, data, cfg, torch.device("cpu"))
    ids = [3, 0, 7]

    def response_positions(i, picks):
        positions = torch.arange(data.prompt_lengths[i], len(data.sequences[i]) - 1)
        return positions[torch.tensor(picks).clamp(max=len(positions) - 1)].unique()

    # the short one: one block where the others have 5 (its other 4 are padding)
    anchors = [response_positions(3, [0, 3, 4, 10, 99]), response_positions(0, [2])]
    anchors.append(response_positions(7, [1, 2, 3, 15, 16]))
    expected = reference_loss(loss, ids, anchors)
    expected.backward()
    reference_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    value, stats = loss.batch_loss(ids, None, anchors)
    value.backward()
    assert torch.allclose(value, expected, rtol=1e-6, atol=0), (value, expected)
    for name, param in model.named_parameters():
        scale = reference_grads[name].abs().max()
        assert torch.allclose(param.grad, reference_grads[name], rtol=1e-5, atol=1e-6 * scale), name
    assert 0 <= float(stats["accept"]) <= cfg.block_size - 1


def test_device_anchors_are_distinct_sorted_response_positions(target, data):
    from caddtree.train.batch import SampleBank, by_length, length_buckets, random_anchors

    feats = [torch.zeros(len(s), 4) for s in data.sequences]
    bank = SampleBank(
        data.sequences, data.prompt_lengths, feats, torch.device("cpu"), torch.float32
    )
    ids = torch.tensor([0, 5, 9])
    anchors, real = random_anchors(bank, ids, 8, torch.Generator().manual_seed(1))
    for row, keep, i in zip(anchors, real, ids.tolist()):
        picked = row[keep]
        assert len(picked) == min(8, len(data.sequences[i]) - 1 - data.prompt_lengths[i])
        assert torch.equal(picked, picked.unique())  # sorted and distinct
        assert picked.min() >= data.prompt_lengths[i] and picked.max() < len(data.sequences[i]) - 1
    many, real = random_anchors(bank, ids, 200, torch.Generator().manual_seed(1))
    assert int(real.sum()) == sum(len(data.sequences[i]) - 1 - data.prompt_lengths[i] for i in ids)
    # a step's samples by length: neighbours in length order
    lengths = [5, 50, 6, 49, 7, 48]
    ordered = by_length(range(6), lengths)
    assert ordered == [0, 2, 4, 5, 3, 1]
    chosen = length_buckets(ordered, torch.tensor([0.0, 0.1, 0.9]), 3)
    assert chosen == [0, 0, 4]  # the first picks the place, the others in its bucket of 3
    # windows of 4: the last 2 join the first bucket, so one step may take any of the 6
    assert length_buckets(ordered, torch.tensor([0.9, 0.0, 0.99]), 4) == [1, 0, 1]


def test_length_buckets_draw_every_sample_equally_often():
    from caddtree.train.batch import length_buckets

    n, window, per_step, draws = 50, 8, 4, 20_000
    counts = torch.zeros(n)
    gen = torch.Generator().manual_seed(0)
    for _ in range(draws):
        for i in length_buckets(list(range(n)), torch.rand(per_step, generator=gen), window):
            counts[i] += 1
    expected = draws * per_step / n
    # each count is near binomial: within 5 standard deviations, and no trend with the length
    assert (counts - expected).abs().max() < 5 * expected**0.5
    assert abs(counts[:window].mean() - counts[-window:].mean()) < 0.05 * expected
    # no step draws from a bucket smaller than the window: 50 = 5 buckets of 8, then one of 10
    ordered = list(range(n))
    for place in (0.0, 0.79, 0.8, 0.999):
        picks = torch.tensor([place] + [i / 16 for i in range(16)])
        spread = set(length_buckets(ordered, picks, window)[1:])
        assert len(spread) == (8 if place < 0.8 else 10)


def test_a_compiled_forward_gives_the_eager_loss_and_gradients(target, data):
    feats = compute_features(target, data, list(FEATURE_LAYER_IDS), progress=False)
    model = new_drafter(target).float()
    ids = [1, 4]
    anchors = [torch.arange(data.prompt_lengths[i], len(data.sequences[i]) - 1)[:6] for i in ids]
    results = []
    for compiled in (False, True):
        cfg = train_config(block_size=model.block_size, compile=compiled)
        loss = AnchorBlockLoss(model, target, feats, data, cfg, torch.device("cpu"))
        value, _ = loss.batch_loss(ids, None, anchors)
        value.backward()
        results.append((value.detach(), model.fc.weight.grad.clone()))
        model.zero_grad()
    (eager, eager_grad), (compiled, compiled_grad) = results
    assert torch.allclose(eager, compiled, rtol=1e-4)
    assert torch.allclose(eager_grad, compiled_grad, rtol=1e-3, atol=1e-5 * eager_grad.abs().max())


def test_a_deadline_ends_the_call_and_the_schedule_in_time(target, data, tmp_path):
    import time

    saved = []
    cfg = train_config(steps=10**6, log_every=2, save_every=10**6, eval_every=10**6)
    began = time.monotonic()
    last = train_drafter(
        target,
        data,
        tmp_path,
        cfg,
        resume=False,
        progress=False,
        deadline=began + 3.0,
        on_checkpoint=saved.append,
    )
    took = time.monotonic() - began
    log = [json.loads(x) for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    # a window's overrun at most, plus slack for a machine shared with other test workers
    assert took < 3.0 + 2 * max(e["step_s"] for e in log) + 3.0
    # the schedule ends where the call ends, or within the window the call was planned to finish
    # when the pace slowed in its last window (steps already run keep their learning rates)
    assert last["step"] == len(log) >= 2
    assert len(log) <= last["schedule_steps"] <= len(log) + cfg.log_every
    assert last["lr"] < 0.2 * cfg.learning_rate  # its cosine ran to its floor (a tenth)
    assert saved == [tmp_path / "checkpoint"] * 2  # after the first step, and at the end
    assert "eval_accept" in last and cfg.steps == 10**6  # the caller's config is left alone
    state = json.loads((tmp_path / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == len(log)
    assert state["log"][-1]["schedule_steps"] == last["schedule_steps"]


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_a_boolean_block_mask_means_the_same_under_every_attention(target, implementation):
    from caddtree.models.dflash import additive_mask

    model = new_drafter(target).double().eval()
    torch.manual_seed(0)
    q, c = 4, 5
    hidden = model.config.hidden_size
    noise = torch.randn(1, q, hidden, dtype=torch.float64)
    feats = torch.randn(1, c, model.fc.in_features, dtype=torch.float64)
    positions = torch.arange(c + q)[None]
    visible = torch.rand(1, 1, q, c + q, generator=torch.Generator().manual_seed(1)) < 0.6
    visible[..., c:] = True  # every row sees something
    model.config._attn_implementation = "sdpa"
    reference = model(noise, feats, positions, attention_mask=additive_mask(visible, noise.dtype))
    model.config._attn_implementation = implementation
    got = model(noise, feats, positions, attention_mask=visible)
    assert torch.allclose(got, reference, atol=1e-10)


def test_features_computed_per_step_give_the_cached_features_loss_and_gradients(target, data):
    """A step whose features the target computes from the step's padded tokens has the loss and
    gradients of the same step over the cached features (float64 target and drafter)."""
    feats = compute_features(target, data, list(FEATURE_LAYER_IDS), progress=False)
    model = new_drafter(target)
    cfg = train_config(block_size=model.block_size)
    ids = [3, 0, 7]  # of different lengths: the shorter ones are padded to the longest
    results = []
    for stored in (feats, None):
        loss = AnchorBlockLoss(model, target, stored, data, cfg, torch.device("cpu"))
        value, _ = loss.batch_loss(ids, torch.Generator().manual_seed(5))
        value.backward()
        results.append((value.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        model.zero_grad()
    (cached, cached_grads), (per_step, step_grads) = results
    assert torch.allclose(per_step, cached, rtol=1e-10, atol=0), (per_step, cached)
    for name, grad in cached_grads.items():
        assert torch.allclose(step_grads[name], grad, rtol=1e-8, atol=1e-10), name


def test_features_per_step_reuse_the_last_pass_only_for_the_same_tokens(target, data, monkeypatch):
    from caddtree.train import features as feature_module
    from caddtree.train.features import StepFeatures

    passes = []
    real = feature_module._decoder_pass
    monkeypatch.setattr(
        feature_module, "_decoder_pass", lambda *a: passes.append(a[1].clone()) or real(*a)
    )
    step = StepFeatures(target, list(FEATURE_LAYER_IDS))
    first, second = data.sequences[0][None, :12], data.sequences[1][None, :12]
    a = step(first)
    assert step(first.clone()) is a and len(passes) == 1  # equal tokens: the pass is reused
    b = step(second)
    assert len(passes) == 2 and not torch.equal(a, b)
    assert torch.equal(step(first), a) and len(passes) == 3  # only the last pass is kept


def test_a_run_with_features_per_step_trains_as_a_cached_run_and_writes_no_cache(
    target, data, tmp_path
):
    runs = {}
    for mode in ("cache", "step"):
        cfg = config(steps=6, save_every=3, eval_every=3, features=mode)
        train_drafter(target, data, tmp_path / mode, cfg, resume=False, progress=False)
        runs[mode] = load_file(tmp_path / mode / "checkpoint" / "model.safetensors")
    assert (tmp_path / "cache" / "features.safetensors").is_file()
    assert not (tmp_path / "step" / "features.safetensors").exists()
    for name, weight in runs["cache"].items():
        assert torch.allclose(runs["step"][name], weight, rtol=1e-7, atol=1e-9), name
    logs = [(tmp_path / m / "train_log.jsonl").read_text().splitlines() for m in runs]
    losses = [[json.loads(line)["loss"] for line in log] for log in logs]
    assert losses[0] == pytest.approx(losses[1], rel=1e-8)


def test_auto_features_are_cached_where_they_fit_and_per_step_where_they_do_not(
    target, data, monkeypatch
):
    from caddtree.runtime import packing
    from caddtree.train.features import resolve_feature_mode
    from caddtree.util.errors import InvalidInputError

    cpu, layers = torch.device("cpu"), list(FEATURE_LAYER_IDS)
    tokens = sum(len(s) for s in data.sequences)
    need = tokens * len(layers) * target.config.hidden_size * 8  # float64 rows
    monkeypatch.setattr(packing, "available_memory", lambda: 2 * need)
    assert resolve_feature_mode("auto", target, data, layers, cpu) == "cache"
    monkeypatch.setattr(packing, "available_memory", lambda: 2 * need - 1)
    assert resolve_feature_mode("auto", target, data, layers, cpu) == "step"
    assert resolve_feature_mode("cache", target, data, layers, cpu) == "cache"
    with pytest.raises(InvalidInputError, match="--features cache"):
        config(features="step", l1_weight=0.5).validate()

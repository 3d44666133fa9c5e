"""The drafter's training loss over anchor blocks, and the held-out figures made from it.

A block is ``[anchor token, MASK x (B-1)]`` at positions ``anchor .. anchor+B-1``; it sees the
context features strictly before its anchor and itself (bidirectionally), never other blocks
(:func:`build_training_batch`). The loss is cross-entropy through the target's frozen ``lm_head``
on block positions ``1 .. B-1`` (predicting tokens ``anchor+1 .. anchor+B-1``), weighted by
``exp(-(k - 1) / gamma)`` for position ``k`` or by D-PACE (:func:`dpace_weights`)
(:class:`AnchorBlockLoss`). With the target's next-token distribution stored by the feature pass
(:mod:`caddtree.train.targets`), the loss can mix in the L1 distance ``sum |p - q| = 2 TV(p, q)``
between the target's and the drafter's distributions and the LK term ``-log(1 - TV)``
(:func:`distribution_terms`, :func:`lk_term`), with the same position weights. :func:`evaluate`
reports it on held-out samples, with acceptance per block position and the chain decoding that
teacher-forced blocks imply (:meth:`AnchorBlockLoss.chain_walk`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..models.dflash import additive_mask, draft_lm_head
from ..util.ranks import DistInfo, all_objects, all_sum
from .batch import SampleBank, anchors_from_lists, block_batch, random_anchors
from .features import StepFeatures
from .head_loss import head_cross_entropy

__all__ = [
    "LK_FLOOR",
    "WALK_BUDGET",
    "WALK_SAMPLES",
    "AnchorBlockLoss",
    "build_training_batch",
    "distribution_terms",
    "dpace_weights",
    "evaluate",
    "host_stats",
    "lk_term",
]


def build_training_batch(
    tokens: torch.Tensor | Sequence[torch.Tensor],
    anchors: torch.Tensor | Sequence[torch.Tensor],
    block_size: int,
    mask_token_id: int,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """Inputs for one drafter forward over anchor blocks of ``b`` sequences at once.

    ``tokens`` is one sequence or a list of ``b``; ``anchors`` the matching anchor positions (one
    tensor per sequence). With ``T`` the longest sequence and ``M`` the most anchors, returns
    ``block_tokens`` [b, M*B], ``position_ids`` [b, T + M*B], an additive ``attention_mask``
    [b, 1, M*B, T + M*B] and ``labels`` [b, M, B-1]. Block ``j`` of a sequence sees that
    sequence's context positions ``< anchors[j]`` and its own ``B`` positions, nothing else;
    labels are the tokens ``anchor+1 .. anchor+B-1`` (``-100`` past the end of the sequence and
    for padding blocks). Context features are padded to ``T`` with anything: no block sees them.
    The caller applies the position weights ``exp(-(k-1)/gamma)``.
    """
    if isinstance(tokens, torch.Tensor):
        tokens, anchors = [tokens], [anchors]
    b, B = len(tokens), block_size
    T = max(int(t.shape[0]) for t in tokens)
    M = max(int(a.shape[0]) for a in anchors)
    offsets = torch.arange(B)
    block_tokens = torch.full((b, M, B), mask_token_id, dtype=torch.long)
    positions = torch.zeros((b, T + M * B), dtype=torch.long)
    visible = torch.zeros((b, M * B, T + M * B), dtype=torch.bool)
    labels = torch.full((b, M, B - 1), -100, dtype=torch.long)
    block_of = torch.arange(M).repeat_interleave(B)
    for r, (seq, anc) in enumerate(zip(tokens, anchors)):
        n, m = int(seq.shape[0]), int(anc.shape[0])
        block_tokens[r, :m, 0] = seq[anc]
        positions[r, :T] = torch.arange(T)
        positions[r, T : T + m * B] = (anc[:, None] + offsets).reshape(-1)
        ctx = torch.arange(T)[None, :] < anc[:, None]  # [m, T]
        visible[r, : m * B, :T] = ctx.repeat_interleave(B, dim=0)
        own = block_of[: m * B, None] == block_of[None, : m * B]
        visible[r, : m * B, T : T + m * B] = own
        target_pos = anc[:, None] + offsets[1:]  # [m, B-1]
        labels[r, :m] = torch.where(
            target_pos < n, seq[target_pos.clamp(max=n - 1)], torch.full_like(target_pos, -100)
        )
    mask = additive_mask(visible, dtype)
    return {
        "block_tokens": block_tokens.reshape(b, M * B),
        "position_ids": positions,
        "attention_mask": mask[:, None],
        "labels": labels,
    }


def dpace_weights(ce: torch.Tensor, valid: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE position weights [..., B-1] (arXiv 2605.18810) from the cross-entropies ``ce``
    [..., B-1] of the block positions (read where ``valid``).

    With ``q = exp(-ce)`` the drafter's probability of the label, smoothed to
    ``q~ = (1 - alpha) q + alpha``, position ``j`` weighs ``sum_{m >= j} prod_{i <= m} q~_i``:
    the chance that the chain reaches it times the accepted length it can still add. An invalid
    position (past the sequence, or a label outside the draft vocabulary) ends the chain, as it
    does when decoding. Weights carry no gradient.
    """
    q = torch.where(valid, (1 - alpha) * torch.exp(-ce.float()) + alpha, 0.0)
    reach = torch.cumprod(q, dim=-1)
    return reach.flip(-1).cumsum(-1).flip(-1) * valid


LK_FLOOR = 1e-6
"""The acceptance below which the LK term ``-log(acceptance)`` stops growing (and its gradient
is zero), so that a block position the target and the drafter share no mass on stays finite."""


def lk_term(accept: torch.Tensor) -> torch.Tensor:
    """The LK-alpha loss of arXiv 2602.23881 (LK losses): ``-log(acceptance)``, with the
    acceptance floored at :data:`LK_FLOOR`. Its gradient is TV's scaled by ``1 / acceptance``;
    at a one-token target distribution it is the cross-entropy of that token."""
    return -torch.log(accept.clamp(min=LK_FLOOR))


def _weighted_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (weights * values).sum() / weights.sum()


def _share(ranks: DistInfo, sample_ids: Sequence[int], ids: torch.Tensor, drawn: Any):
    """This rank's share of a batch (every ``world``-th sample from its ``rank``): its sample
    ids on the host and the device, and their anchors (padded and real, or one list each)."""
    r, w = ranks.rank, ranks.world
    mine = drawn[r::w] if isinstance(drawn, list) else tuple(t[r::w] for t in drawn)
    return list(sample_ids)[r::w], ids[r::w], mine


def _on_device(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """Host integers as a long tensor on ``device`` (pinned and copied without waiting on a GPU)."""
    host = torch.tensor(list(values), dtype=torch.long)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _pad_blocks(value: torch.Tensor, M: int) -> torch.Tensor:
    """``value`` [b, m, ...] with zero blocks added up to ``M``."""
    missing = M - value.shape[1]
    if missing <= 0:
        return value
    return torch.cat([value, value.new_zeros((value.shape[0], missing, *value.shape[2:]))], 1)


def host_stats(stats: dict) -> dict:
    """A batch's statistics (:meth:`AnchorBlockLoss.batch_loss`) read back: floats, and the
    per-position sums as CPU tensors."""
    out = {k: float(v) for k, v in stats.items() if k != "by_position"}
    out["by_position"] = {k: v.cpu() for k, v in stats["by_position"].items()}
    return out


def _anchor_lists(anchors: tuple[torch.Tensor, torch.Tensor] | Sequence[torch.Tensor]):
    """Anchors as one tensor per sample on the host (for the stored target distributions)."""
    if not isinstance(anchors, tuple):
        return list(anchors)
    padded, real = (t.cpu() for t in anchors)
    return [row[keep] for row, keep in zip(padded, real)]


def distribution_terms(
    log_q: torch.Tensor,
    ids: torch.Tensor,
    probs: torch.Tensor,
    rest: torch.Tensor,
    outside: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """The distance between the target's distribution ``p`` and the drafter's ``q`` at each of
    ``N`` block positions, from the target's stored top-k (:mod:`caddtree.train.targets`).

    ``log_q`` [N, V] is the drafter's log-distribution over the draft vocabulary; ``ids`` [N, k]
    the draft ids of the target's top k there, ``probs`` [N, k] their probabilities (normalised
    over the target's whole vocabulary), ``rest`` [N] the target's draft-vocabulary mass outside
    them and ``outside`` [N] its mass outside the draft vocabulary (where ``q`` is 0).

    Returns per position ``l1``: ``sum_v |p_v - q_v|`` with the ``k`` ids taken one by one and
    the rest of the draft vocabulary, and everything outside it, each as one lump (``|rest -
    q_rest| + outside``, ``q_rest`` the drafter's mass outside the ``k`` ids); ``accept``:
    ``1 - l1 / 2``, the probability that a token sampled from ``q`` is accepted by speculative
    sampling against ``p`` (``sum_v min(p_v, q_v)``); and ``slack``: ``min(rest, q_rest)``.
    Lumping can only hide differences, so ``l1`` is at most the true L1 and at least the true
    L1 minus ``2 * slack``; it is exact when ``k`` covers the draft vocabulary (``rest`` = 0).
    """
    q_top = log_q.gather(-1, ids).exp()
    q_rest = (1 - q_top.sum(-1)).clamp(min=0)
    l1 = (probs - q_top).abs().sum(-1) + (rest - q_rest).abs() + outside
    return {"l1": l1, "accept": 1 - l1 / 2, "slack": torch.minimum(rest, q_rest)}


def _block_stats(
    correct: torch.Tensor,
    in_range: torch.Tensor,
    rows: torch.Tensor,
    terms: dict[str, torch.Tensor] | None,
    ranks: DistInfo | None = None,
) -> dict:
    """A batch's acceptance statistics: ``top1`` (position 1's top-1 accuracy) and ``accept``
    (the mean leading run of correct predictions of a chain draft, block by block: a token
    outside the draft vocabulary ends it, as it would when decoding), and ``by_position``:
    per block position, how many positions are inside the sequence (``count``), how many of
    them the drafter's argmax matches (``top1``) and, with the target's distributions, the sums
    of ``accept`` and ``slack`` (:func:`distribution_terms`)."""
    run = torch.cumprod((correct | ~in_range).float(), dim=-1) * in_range.float()
    blocks = in_range[..., 0]
    by_position = {
        "count": in_range.sum((0, 1)),
        "top1": (correct & in_range).sum((0, 1)),
    }
    if terms is not None:
        for name in ("accept", "slack"):
            full = torch.zeros(in_range.shape, dtype=terms[name].dtype, device=in_range.device)
            full[rows] = terms[name].detach()
            by_position[name] = full.sum((0, 1))
    ranks = ranks if ranks is not None else DistInfo()
    by_position = {k: all_sum(ranks, v) for k, v in by_position.items()}  # the whole batch's
    sums = torch.stack([(correct[..., 0] & blocks).sum().float(), (run.sum(-1) * blocks).sum()])
    top1, accept = all_sum(ranks, sums) / all_sum(ranks, blocks.sum()).clamp(min=1)
    return {"top1": top1, "accept": accept, "by_position": by_position}


class AnchorBlockLoss:
    """The training loss of a drafter over anchor blocks of samples (their cached context features
    in ``features``, or ``None``: computed per step by ``target``), through the target's frozen
    embeddings and ``lm_head`` (its draft-vocabulary rows where the drafter has one); ``targets`` (a
    :class:`~caddtree.train.targets.TargetDistributions` over the drafter's vocabulary) give the
    L1 and LK terms and the per-position acceptance."""

    def __init__(self, drafter, target, features, data, config, device, targets=None, ranks=None):
        self.drafter, self.config, self.device = drafter, config, device
        # under torchrun each rank trains on its share of every batch (see batch_loss)
        self.ranks = ranks if ranks is not None else DistInfo()
        # the module that runs the forward: the drafter, or its compiled form (same parameters)
        self.forward = torch.compile(drafter, dynamic=True) if config.compile else drafter
        self.targets = targets  # the target's next-token top-k (TargetDistributions), or None
        self.embed = target.get_input_embeddings()
        self.embed.requires_grad_(False)
        ids = drafter.draft_token_ids
        # the target's lm_head, or its rows of the draft vocabulary (frozen either way); in
        # float32 when the forward is: a bfloat16 head there took 10 s a step on a CPU without
        # AVX512-BF16 (its input gradient's transposed bfloat16 matmul ran at about 1 GFLOP/s)
        full = target.get_output_embeddings()
        half = full.weight.dtype in (torch.bfloat16, torch.float16)
        dtype = torch.float32 if config.precision == "float32" and half else None
        head = draft_lm_head(full, ids, dtype)  # a draft vocabulary's rows copied in that dtype
        if head is full and dtype is not None:
            head = copy.deepcopy(full).float()
        self.lm_head = head.requires_grad_(False)
        self.label_map = None  # target id -> draft id, -100 outside the draft vocabulary
        if ids is not None:
            vocab = int(target.config.get_text_config().vocab_size)
            self.label_map = torch.full((vocab,), -100, dtype=torch.long, device=device)
            self.label_map[ids.to(device)] = torch.arange(ids.numel(), device=device)
        self.data = data
        compute = None
        if features is None:  # computed per step by the target (TrainConfig.features "step")
            compute = StepFeatures(target, drafter.target_layer_ids)
            dtype = compute.dtype
        else:
            dtype = features[0].dtype if features else torch.bfloat16
        self.bank = SampleBank(
            data.sequences, data.prompt_lengths, features, device, dtype, compute
        )
        B = config.block_size
        self.position_weights = torch.exp(
            -torch.arange(B - 1, dtype=torch.float32) / config.gamma
        ).to(device)

    def _autocast(self):
        return torch.autocast(
            self.device.type, dtype=torch.bfloat16, enabled=self.config.precision == "bfloat16"
        )

    def _block_hidden(
        self,
        sample_ids: Sequence[int],
        anchors: Sequence[torch.Tensor] | tuple[torch.Tensor, torch.Tensor],
        ids: torch.Tensor | None = None,
    ):
        """One drafter forward over the blocks at ``anchors`` (one sorted tensor per sample, or
        padded anchors and which are real, as :func:`~caddtree.train.batch.random_anchors`
        gives them): the hidden states of block positions ``1 .. B-1`` [b, M, B-1, H], their
        labels in draft ids [b, M, B-1] (``-100`` past the sequence, for padding blocks or
        outside the draft vocabulary), and where the labels are inside the sequence. ``ids``:
        ``sample_ids`` already on the device."""
        cfg, dev = self.config, self.device
        if not isinstance(anchors, tuple):
            anchors = anchors_from_lists(anchors, dev)
        ids = _on_device(sample_ids, dev) if ids is None else ids
        T = self.bank.context_length(sample_ids)
        batch = block_batch(self.bank, ids, T, *anchors, cfg.block_size, self.drafter.mask_token_id)
        dtype = self.drafter.fc.weight.dtype
        labels = batch.labels  # [b, M, B-1], target ids
        in_range = labels >= 0
        if self.label_map is not None:
            labels = torch.where(in_range, self.label_map[labels.clamp(min=0)], labels)
        # under bfloat16 autocast a float32 drafter takes bfloat16 inputs as they are (its
        # matmuls run in bfloat16 anyway); anything else is cast to the drafter's dtype
        as_is = cfg.precision == "bfloat16" and dtype == torch.float32

        def cast(t: torch.Tensor) -> torch.Tensor:
            return t if as_is and t.dtype == torch.bfloat16 else t.to(dtype)

        with self._autocast():
            noise = cast(self.embed(batch.block_tokens))
            hidden = self.forward(
                noise_embedding=noise,
                target_hidden=cast(batch.features),
                position_ids=batch.position_ids,
                attention_mask=batch.attention_mask,
            )
        b, M, B = labels.shape[0], labels.shape[1], cfg.block_size
        return hidden.view(b, M, B, -1)[:, :, 1:], labels, in_range

    def _random_anchors(
        self, ids: torch.Tensor, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``anchors_per_sample`` random response positions of each sample of ``ids`` (on the
        device; sorted, drawn on the device), at most as many as it has: padded anchors and
        which are real."""
        return random_anchors(self.bank, ids, self.config.anchors_per_sample, generator)

    def _weights(self, ce: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The position weights of every block position [b, M, B-1] (zero where D-PACE's chain
        has ended)."""
        if self.config.loss_weighting == "dpace":
            return dpace_weights(ce.detach(), valid, self.config.dpace_alpha)
        return self.position_weights.expand(valid.shape)

    def batch_loss(
        self,
        sample_ids: Sequence[int],
        generator: torch.Generator | None,
        anchors: Sequence[torch.Tensor] | None = None,
    ):
        """The loss of ``anchors_per_sample`` random blocks of each sample (or the blocks at
        the given ``anchors``, one sorted tensor per sample), all in one drafter forward:
        ``ce_weight`` x the weighted cross-entropy of the positions whose label is in the draft
        vocabulary, plus (with the target's distributions) ``l1_weight`` x the weighted L1 and
        ``lk_weight`` x the weighted LK term of every position inside the sequence
        (:func:`distribution_terms`). Returns the loss and the batch's statistics, as tensors
        on the device (read them when they are logged: reading is a host synchronisation).
        With the target's distributions (L1, LK), the anchors are read back to the host each
        step to pick the stored top-k there: that path synchronises once a step.

        ``generator`` draws the anchors; it must be a generator of the training device."""
        cfg = self.config
        ids = _on_device(sample_ids, self.device)
        drawn = self._random_anchors(ids, generator) if anchors is None else anchors
        if self.ranks.distributed:  # the whole batch's anchors are drawn, so each share is the same
            sample_ids, ids, drawn = _share(self.ranks, sample_ids, ids, drawn)
        hidden, labels, in_range = self._block_hidden(sample_ids, drawn, ids)
        valid = labels >= 0  # scored: inside the sequence and the draft vocabulary
        if self.targets is None:
            ce, correct = self._head_ce(hidden, labels)
        else:
            with self._autocast():
                logits = self.lm_head(hidden.to(self.lm_head.weight.dtype)).float()
            ce = torch.nn.functional.cross_entropy(
                logits.flatten(0, -2), labels.flatten(), ignore_index=-100, reduction="none"
            ).view(labels.shape)
        weights = self._weights(ce, valid)
        loss = cfg.ce_weight * self._mean(ce, weights * valid)
        terms = None
        if self.targets is not None:
            lists = _anchor_lists(drawn)
            terms = self._distribution_terms(logits[in_range], sample_ids, lists, in_range)
            loss = loss + self._distribution_loss(terms, weights[in_range])
            correct = (logits.detach().argmax(-1) == labels) & valid
        with torch.no_grad():
            stats = _block_stats(correct, in_range, in_range, terms, self.ranks)
            stats["loss"] = self._whole(loss)
            if terms is not None:
                stats["ce"] = self._whole(self._mean(ce, weights * valid))
                stats["l1"] = self._whole(self._mean(terms["l1"], weights[in_range]))
        return loss, stats

    def _head_ce(
        self, hidden: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-entropy of every block position [b, M, B-1] through the frozen head (0 where
        its label is ignored) and whether the head's argmax is the label
        (:func:`~caddtree.train.head_loss.head_cross_entropy`; its matmul in bfloat16 under
        bfloat16 precision, as autocast runs it)."""
        head = self.lm_head
        dtype = torch.bfloat16 if self.config.precision == "bfloat16" else head.weight.dtype
        flat = hidden.reshape(-1, hidden.shape[-1])  # cast to dtype by the function
        ce, correct = head_cross_entropy(flat, head, labels.flatten(), dtype)
        return ce.view(labels.shape), correct.view(labels.shape)

    def _mean(self, values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The weighted mean of ``values`` over the whole batch; under torchrun, this rank's
        share of it times the number of ranks (its weights over the whole batch's), so that the
        mean DistributedDataParallel takes of the ranks' gradients is the whole batch's."""
        if not self.ranks.distributed:
            return _weighted_mean(values, weights)
        total = all_sum(self.ranks, weights.sum().detach())
        return (weights * values).sum() * self.ranks.world / total

    def _whole(self, value: torch.Tensor) -> torch.Tensor:
        """A figure of :meth:`_mean` over the whole batch (every rank's share added)."""
        if not self.ranks.distributed:
            return value.detach()
        return all_sum(self.ranks, value.detach()) / self.ranks.world

    def _distribution_terms(
        self,
        logits: torch.Tensor,
        sample_ids: Sequence[int],
        anchors: Sequence[torch.Tensor],
        rows: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """:func:`distribution_terms` of the drafter's ``logits`` at the block positions
        ``rows`` against the target's stored distributions there."""
        stored = self.targets.for_blocks(
            sample_ids, anchors, self.data.prompt_lengths, self.config.block_size
        )
        picked = {
            name: _pad_blocks(value, rows.shape[1]).to(self.device)[rows]
            for name, value in stored.items()
        }
        return distribution_terms(torch.log_softmax(logits, dim=-1), **picked)

    def _distribution_loss(self, terms: dict[str, torch.Tensor], weights: torch.Tensor):
        """``l1_weight`` x the weighted L1 plus ``lk_weight`` x the weighted LK term."""
        cfg = self.config
        loss = torch.zeros((), device=weights.device)
        if cfg.l1_weight:
            loss = loss + cfg.l1_weight * self._mean(terms["l1"], weights)
        if cfg.lk_weight:
            loss = loss + cfg.lk_weight * self._mean(lk_term(terms["accept"]), weights)
        return loss

    @torch.no_grad()
    def walks(
        self, sample_id: int, budgets: Sequence[int | None], chunk: int = 64
    ) -> list[list[int]]:
        """The tokens each round of decoding would commit on this sample's response, for each of
        ``budgets``, from teacher-forced blocks (one drafter pass serves them all): DFlash's
        chain (``None``) or the DDTree of that many nodes, built from each block's
        log-probabilities exactly as decoding builds it. The first anchor is the response's first
        token; a round accepts the deepest tree node on the response's path and adds the target's
        bonus token, and the next anchor is the last token committed. As decoding does, it spends
        more rounds where acceptance is low (blocks placed uniformly at random do not). A token
        outside the draft vocabulary ends a path."""
        from ..core.tree import build_chain, build_ddtree

        tokens = self.data.sequences[sample_id]
        P, T = self.data.prompt_lengths[sample_id], int(tokens.shape[0])
        every = torch.arange(P, T - 1)
        parts, labels = [], []
        for k in range(0, every.numel(), chunk):
            hidden, block_labels, _ = self._block_hidden([sample_id], [every[k : k + chunk]])
            with self._autocast():
                logits = self.lm_head(hidden[0].to(self.lm_head.weight.dtype))
            parts.append(torch.log_softmax(logits.double(), dim=-1).cpu().numpy())
            labels.append(block_labels[0].cpu())
        log_probs = np.concatenate(parts)  # [anchors, B-1, draft vocabulary]
        paths = torch.cat(labels).tolist()
        out = []
        for budget in budgets:
            committed, at = [], 0  # ``at``: the anchor's index in ``every``
            while at < len(paths):
                tree = (
                    build_chain(log_probs[at])
                    if budget is None
                    else build_ddtree(log_probs[at], budget)
                )
                node, accepted = -1, 0
                for label in paths[at]:
                    node = tree.child_with_token(node, label) if label >= 0 else -1
                    if node < 0:
                        break
                    accepted += 1
                committed.append(min(accepted + 1, len(paths) - at))
                at += accepted + 1
            out.append(committed)
        return out

    def walk(self, sample_id: int, budget: int | None = None, chunk: int = 64) -> list[int]:
        """:meth:`walks` with one budget (``None``: DFlash's chain)."""
        return self.walks(sample_id, [budget], chunk)[0]

    def chain_walk(self, sample_id: int, chunk: int = 64) -> list[int]:
        """:meth:`walk` with DFlash's chain."""
        return self.walk(sample_id, None, chunk)


# how many held-out samples the walks of each evaluation decode (the first in split order), and
# the DDTree budget of the tree walk
WALK_SAMPLES = 32
WALK_BUDGET = 16


@torch.no_grad()
def evaluate(loss: AnchorBlockLoss, eval_ids: Sequence[int], seed: int) -> dict:
    """Held-out figures: the loss, position 1's top-1 accuracy and the mean chain acceptance of
    random blocks (``eval_loss``, ``eval_top1``, ``eval_accept``), and the tokens per round of
    decoding the first :data:`WALK_SAMPLES` held-out responses (:meth:`AnchorBlockLoss.walks`,
    pooled), which is what decoding measures as tau: with DFlash's chain (``eval_walk_tau``)
    and with a DDTree of :data:`WALK_BUDGET` nodes (``eval_tree_tau``).

    Per block position ``k = 1 .. B-1`` of the random blocks (lists of ``B-1``): how often the
    drafter's argmax is the target's greedy token (``eval_top1_by_position``, acceptance at
    T = 0 given the true prefix) and, with the target's distributions, ``1 - TV(p, q)``
    (``eval_accept_by_position``, acceptance of a token sampled from the drafter at T = 1),
    with ``eval_accept_slack``, the most by which those can overstate it from the stored top-k
    alone (the mean of ``slack``, :func:`distribution_terms`), and the loss's two parts
    (``eval_ce``, ``eval_l1``)."""
    loss.drafter.eval()
    g = torch.Generator(device=loss.device).manual_seed(seed + 17)
    batches = []
    size = loss.config.samples_per_step
    with torch.no_grad():
        for k in range(0, len(eval_ids), size):
            batches.append(host_stats(loss.batch_loss(eval_ids[k : k + size], g)[1]))
        # under torchrun the ranks walk every world-th sample and pool their rounds
        ranks = loss.ranks
        walked = [
            loss.walks(i, [None, WALK_BUDGET])
            for i in eval_ids[:WALK_SAMPLES][ranks.rank :: ranks.world]
        ]
    walked = [pair for part in all_objects(ranks, walked) for pair in part]
    rounds = [n for chain, _ in walked for n in chain]
    tree_rounds = [n for _, tree in walked for n in tree]
    loss.drafter.train()
    n = len(batches)
    figures = {
        "eval_loss": sum(b["loss"] for b in batches) / n,
        "eval_top1": sum(b["top1"] for b in batches) / n,
        "eval_accept": sum(b["accept"] for b in batches) / n,
        "eval_walk_tau": sum(rounds) / len(rounds),
        "eval_tree_tau": sum(tree_rounds) / len(tree_rounds),
    }
    return {**figures, **_position_figures(batches)}


def _position_figures(batches: Sequence[dict]) -> dict:
    """The per-position figures of :func:`evaluate` from its batches' statistics."""
    totals = {
        name: sum(b["by_position"][name].double() for b in batches)
        for name in batches[0]["by_position"]
    }
    count = totals["count"].clamp(min=1)
    figures = {"eval_top1_by_position": (totals["top1"] / count).tolist()}
    if "accept" in totals:
        figures["eval_accept_by_position"] = (totals["accept"] / count).tolist()
        positions = totals["count"].sum().clamp(min=1)
        figures["eval_accept_slack"] = float(totals["slack"].sum() / positions)
        for name in ("ce", "l1"):
            figures[f"eval_{name}"] = sum(b[name] for b in batches) / len(batches)
    return figures

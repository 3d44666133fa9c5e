"""One DFlash drafter pass for one or several sequences, on caddtree's own forward.

:class:`BatchProposer` keeps one drafter KV cache per **slot** (one per request being decoded)
and runs the blocks of every drafting request in a single pass through the drafter's layers.
:class:`~caddtree.models.proposer.DFlashProposer` is its one-slot view for single-request
decoding. In a pass of ``B`` sequences, sequence ``b``:

* appends the keys/values of its ``c_b`` new context features (the target's features of its
  tokens since its last pass) at its cache entries ``length_b .. length_b + c_b - 1``;
* runs its block ``[bonus, MASK x (q-1)]`` at positions ``length_b + c_b ..``: the block's queries
  attend to the slot's whole context and to the whole block (no causal mask inside a block, as
  in DFlash), and to nothing of the other sequences;
* keeps the context entries and drops the block's (they lie past its length and are overwritten
  by the next pass).

The pass is the lean runtime's arithmetic (:mod:`caddtree.runtime.layers`), not the drafter
module's forward: q/k/v and gate/up fused and packed once (caddtree's bfloat16 kernel on CPUs
with AVX512-BF16 or AVX2, else oneDNN), RMSNorm in one call, rotary tables computed once, a static cache
written by entry, and attention one call per sequence over its own slot (caddtree's attention
kernel where the drafter runs in bfloat16 on such a CPU, else SDPA). The linear layers and norms
run once over all sequences' rows. The weights are read when the proposer is made: make a new
one after changing the drafter's. Its draft logits equal the drafter module's forward over each
sequence's whole context (float64 to rounding: tests/test_batch_proposer.py). The cache grows
when a pass would outgrow it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from ..runtime.kernels import (
    amx_in_use,
    attention_fits,
    kernel_in_use,
    tree_attention,
    tree_attention_batch,
)
from ..runtime.layers import (
    Shape,
    decoder_layer,
    fused_linear,
    layer_weights,
    rms_norm,
    rotary_tables,
)
from ..runtime.packing import pack_linear_layers
from ..util.checks import check_int, is_int
from ..util.errors import CheckpointError, InvalidInputError
from .dflash import DFlashDraftModel, check_drafter_fits_target, draft_lm_head
from .drafts import PROJECTION_STEPS, DraftLogits

__all__ = ["BatchProposer", "DraftCall"]

_MIN_CAPACITY = 256


class DraftCall(NamedTuple):
    """One sequence of a :meth:`BatchProposer.propose` pass: its slot, its bonus token and the
    target's features of its tokens since its last pass, ``[t, k*H]``."""

    slot: int
    bonus: int
    features: torch.Tensor


class BatchProposer:
    """Drafts for several sequences per pass (see the module docstring).

    Args:
        drafter: the DFlash drafter.
        target_model: the target whose embeddings and lm_head the drafter reads.
        slots: sequences it can hold (each :meth:`propose` call uses some of them).
        pack: on the CPU, keep the fused linear weights packed
            (:func:`~caddtree.runtime.packing.pack_weight`).
    """

    def __init__(
        self, drafter: DFlashDraftModel, target_model: Any, slots: int, *, pack: bool = True
    ) -> None:
        check_drafter_fits_target(drafter, target_model.config)
        self.drafter = drafter
        self.embed_tokens = target_model.get_input_embeddings()
        lm_head = target_model.get_output_embeddings()
        if self.embed_tokens is None or lm_head is None:
            raise CheckpointError("the target model must have input embeddings and an lm_head")
        ids = drafter.draft_token_ids
        # a draft vocabulary's rows are copied in the drafter's dtype (a bfloat16 drafter beside
        # a float32 target projects in bfloat16); the whole vocabulary is the target's own head
        self.lm_head = draft_lm_head(lm_head, ids, drafter.fc.weight.dtype)
        if pack and ids is not None:  # its own copy of the head's rows, packed like the rest
            pack_linear_layers(self.lm_head)
        #: target id of each draft id (numpy int64 [K]), or ``None`` with the full vocabulary
        self.token_map = None if ids is None else ids.cpu().numpy()
        #: how :meth:`propose`'s logits are projected (see :class:`DraftLogits`)
        self.projection_steps: tuple[int, ...] = PROJECTION_STEPS
        #: project every position of every block of a pass in one call, where rows are almost
        #: free (the AMX tile unit multiplies a few dozen rows for the price of one); elsewhere
        #: positions are projected on demand, as far as the trees reach
        self.project_at_once = (
            self.lm_head.weight.device.type == "cpu"
            and self.lm_head.weight.dtype is torch.bfloat16
            and amx_in_use()
        )
        config = drafter.config
        heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
        head_dim = drafter.layers[0].self_attn.head_dim
        self.shape = Shape(heads, kv_heads, head_dim, float(config.rms_norm_eps))
        self.scale = head_dim**-0.5
        weight = drafter.fc.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.fc = fused_linear([drafter.fc], pack)
        self.layers = [layer_weights(layer, heads, kv_heads, pack) for layer in drafter.layers]
        self.fused_attention = (
            self.device.type == "cpu"
            and kernel_in_use(self.dtype)
            and attention_fits(head_dim, heads, kv_heads)
        )
        self._cos = self._sin = torch.empty(0)
        self.slots = check_int("slots", slots, minimum=1)
        self.lengths = [0] * self.slots
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.capacity = 0

    @property
    def block_size(self) -> int:
        return self.drafter.block_size

    def packed_layers(self) -> int:
        """How many of the pass's (fused) linear layers are packed."""
        linears = [self.fc] + [
            linear
            for layer in self.layers
            for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)
        ]
        return sum(linear.packed is not None for linear in linears)

    def reset(self, slot: int) -> None:
        """Forget ``slot``'s context (a new request takes it)."""
        self.lengths[slot] = 0

    def _reserve(self, needed: int) -> None:
        """Room for ``needed`` entries per slot, the slots' context entries carried over."""
        if needed <= self.capacity:
            return
        capacity = max(needed, 2 * self.capacity, _MIN_CAPACITY)
        shape = (self.slots, self.shape.kv_heads, capacity, self.shape.head_dim)

        def grown(old: list[torch.Tensor]) -> list[torch.Tensor]:
            new = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
            for fresh, kept in zip(new, old):  # nothing to keep the first time
                fresh[:, :, : self.capacity] = kept
            return new

        self.keys, self.values = grown(self.keys), grown(self.values)
        self.capacity = capacity

    def _ensure_positions(self, needed: int) -> None:
        if needed > self._cos.shape[0]:
            size = max(needed, 2 * self._cos.shape[0], _MIN_CAPACITY)
            rotary = self.drafter.rotary_emb
            self._cos, self._sin = rotary_tables(rotary, size, self.device, self.dtype)

    @torch.no_grad()
    def propose(
        self, calls: Sequence[DraftCall], positions: Sequence[int] | None = None
    ) -> list[DraftLogits]:
        """One drafter pass for ``calls`` (distinct slots); the draft logits of each block's
        positions ``1 .. q-1``, as :meth:`DFlashProposer.propose
        <caddtree.models.proposer.DFlashProposer.propose>` returns them.

        ``positions``: each call's block size ``q`` (its bonus and ``q - 1`` masks; 2 .. the
        drafter's block size, which is the default). Where no tree can reach deeper than
        ``q - 1``, a shorter block saves the drafter the rows nothing reads. The first
        positions' marginals move a little, since the masks after them are not there; the
        built-in pair's trees were accepted as often (``docs/design.md``, "What a batch measures
        as it runs"). A call's logits depend on its own ``q``, not on the other calls'."""
        sizes = [self.block_size] * len(calls) if positions is None else list(positions)
        if len(sizes) != len(calls) or not all(
            is_int(q) and 2 <= q <= self.block_size for q in sizes
        ):
            raise InvalidInputError(
                f"a drafter pass takes 2 .. {self.block_size} positions per block, one size "
                f"per call; got {positions!r} for {len(calls)} calls"
            )
        plan = self._plan(calls, [int(q) for q in sizes])
        self._reserve(max(plan.ends))
        self._ensure_positions(max(plan.ends))
        width = self.drafter.fc.in_features
        features = [c.features.reshape(-1, width) for c in calls]
        features = features[0] if len(features) == 1 else torch.cat(features)
        context = self.fc(features.to(device=self.device, dtype=self.dtype))
        context = rms_norm(context, self.drafter.hidden_norm.weight, self.shape.eps)
        tokens = plan.block.to(self.embed_tokens.weight.device)
        hidden = self.embed_tokens(tokens).to(device=self.device, dtype=self.dtype)
        cos, sin = self._cos[plan.positions], self._sin[plan.positions]
        for index, layer in enumerate(self.layers):
            attend = _Attend(self, index, plan)
            hidden = decoder_layer(layer, self.shape, hidden, cos, sin, attend, context)
        hidden = rms_norm(hidden, self.drafter.norm.weight, self.shape.eps)
        for call, start in zip(calls, plan.starts):
            self.lengths[call.slot] = start
        return self._draft_logits(hidden, plan)

    def _draft_logits(self, hidden: torch.Tensor, plan: _Plan) -> list[DraftLogits]:
        """Each block's positions after its bonus, as draft logits: projected now, every block in
        one call (:attr:`project_at_once`), or on demand."""
        drafted = hidden[1:] if len(plan.sizes) == 1 else hidden[plan.drafted]
        drafted = drafted.to(self.lm_head.weight)
        lengths = [q - 1 for q in plan.sizes]
        if self.project_at_once:
            logits = self.lm_head(drafted).split(lengths)
            return [DraftLogits.precomputed(block, self.token_map) for block in logits]
        blocks = drafted.split(lengths)
        return [
            DraftLogits(block, self.lm_head, self.projection_steps, self.token_map)
            for block in blocks
        ]

    def _plan(self, calls: Sequence[DraftCall], sizes: list[int]) -> _Plan:
        slots = [int(c.slot) for c in calls]
        if (
            not calls
            or len(set(slots)) != len(slots)
            or not 0 <= min(slots) <= max(slots) < self.slots
        ):
            raise InvalidInputError(
                f"a drafter pass needs distinct slots below {self.slots}: {slots}"
            )
        counts = [int(c.features.reshape(-1, c.features.shape[-1]).shape[0]) for c in calls]
        firsts = [self.lengths[s] for s in slots]
        starts = [f + c for f, c in zip(firsts, counts)]
        block = np.full(sum(sizes), self.drafter.mask_token_id, dtype=np.int64)
        heads = np.cumsum([0] + sizes[:-1])  # each block's bonus row among the block rows
        block[heads] = [int(c.bonus) for c in calls]
        # every row's cache entry (which is its position): context rows first, then the blocks
        entries = np.concatenate(
            [np.arange(f, s) for f, s in zip(firsts, starts)]
            + [np.arange(s, s + q) for s, q in zip(starts, sizes)]
        )
        row_slots = np.concatenate([np.repeat(slots, counts), np.repeat(slots, sizes)])
        index = torch.from_numpy(np.stack((entries, row_slots))).to(self.device)
        ends = [s + q for s, q in zip(starts, sizes)]
        return _Plan(
            sizes=sizes,
            slots=slots,
            counts=counts,
            starts=starts,
            ends=ends,
            block=torch.from_numpy(block),
            positions=index[0],
            write=None if len(calls) == 1 else (index[1], index[0]),
            visible=torch.ones((max(sizes), max(ends)), dtype=torch.bool, device=self.device),
            drafted=torch.from_numpy(np.delete(np.arange(sum(sizes)), heads)).to(self.device),
        )


class _Plan(NamedTuple):
    """Where a pass's rows go: per sequence its slot, its count of new context rows, its new
    length (``starts``: its block's first position) and block end; every row's position, which
    is its cache entry (context rows first, then the blocks), and for several sequences the
    (slot, entry) of every row; a mask that shows a block everything up to its end (sliced
    per sequence: caddtree's attention kernel takes one); each block's size (``sizes``), and
    which block rows are drafted positions (``drafted``: all but each block's bonus row)."""

    sizes: list[int]
    slots: list[int]
    counts: list[int]
    starts: list[int]
    ends: list[int]
    block: torch.Tensor
    positions: torch.Tensor
    write: tuple[torch.Tensor, torch.Tensor] | None
    visible: torch.Tensor
    drafted: torch.Tensor


class _Attend:
    """The cache's part of a drafter layer (:data:`~caddtree.runtime.layers.Attend`): writes the
    keys and values of the context and block rows into their slots, then attends each block over
    its slot's first ``start + q`` entries (all of them visible; ``q`` its own size)."""

    def __init__(self, proposer: BatchProposer, index: int, plan: _Plan) -> None:
        self.proposer, self.plan = proposer, plan
        self.keys, self.values = proposer.keys[index], proposer.values[index]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self._write(k, v)
        proposer, plan = self.proposer, self.plan
        blocks = zip(plan.slots, plan.sizes, plan.ends)
        if proposer.fused_attention and len(plan.slots) > 1:  # every block in one call
            seqs = torch.tensor(list(blocks))
            visible = plan.visible[:1].expand(q.shape[0], -1)
            return tree_attention_batch(q, self.keys, self.values, visible, seqs, proposer.scale)
        out = [
            self._attend(query, slot, end)
            for query, (slot, _, end) in zip(q.split(plan.sizes), blocks)
        ]
        return out[0] if len(out) == 1 else torch.cat(out)

    def _write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        plan = self.plan
        if plan.write is None:  # one sequence: its entries are consecutive
            slot, first = plan.slots[0], plan.starts[0] - plan.counts[0]
            self.keys[slot, :, first : plan.ends[0]] = k.transpose(0, 1)
            self.values[slot, :, first : plan.ends[0]] = v.transpose(0, 1)
        else:
            slots, entries = plan.write
            self.keys[slots, :, entries] = k
            self.values[slots, :, entries] = v

    def _attend(self, query: torch.Tensor, slot: int, end: int) -> torch.Tensor:
        """Block rows ``query`` [q, H, D] over entries ``0 .. end - 1`` of ``slot``: [q, H*D]."""
        proposer = self.proposer
        keys, values = self.keys[slot], self.values[slot]
        if proposer.fused_attention:
            visible = self.plan.visible[: query.shape[0], :end]
            return tree_attention(query, keys, values, visible, proposer.scale)
        shape = proposer.shape
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1)[None],
            keys[None, :, :end],
            values[None, :, :end],
            scale=proposer.scale,
            enable_gqa=shape.heads != shape.kv_heads,
        )
        return out[0].transpose(0, 1).reshape(query.shape[0], -1)

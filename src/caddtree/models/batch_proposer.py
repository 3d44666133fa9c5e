"""One DFlash drafter pass for several sequences: the proposer of batched decoding.

:class:`BatchProposer` keeps one drafter KV cache per **slot** (one per request being decoded)
and runs the blocks of every drafting request in a single pass through the drafter's layers,
instead of one pass per request (:class:`~caddtree.models.proposer.DFlashProposer`, whose
protocol it follows slot by slot). In a pass of ``B`` sequences, sequence ``b``:

* appends the keys/values of its ``c_b`` new context features (the target's features of its
  tokens since its last pass) at its cache entries ``length_b .. length_b + c_b - 1``;
* runs its block ``[bonus, MASK x (q-1)]`` at positions ``length_b + c_b ..``: the block's queries
  attend to the slot's whole context and to the whole block (no causal mask inside a block, as
  in DFlash), and to nothing of the other sequences;
* keeps the context entries and drops the block's (they lie past its length and are overwritten
  by the next pass).

The linear layers, norms and MLPs run once over all sequences' rows; the attention runs once
over the slots' caches, padded to the longest under a mask. Its draft logits equal
``DFlashProposer``'s for each sequence alone (float64 to rounding: tests/test_batch_proposer.py).
The cache grows when a pass would outgrow it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from transformers.models.qwen3.modeling_qwen3 import rotate_half

from ..util.checks import check_int
from ..util.errors import InvalidInputError
from .dflash import DFlashDraftModel, check_drafter_fits_target, draft_lm_head
from .proposer import PROJECTION_STEPS, DraftLogits

__all__ = ["BatchProposer", "DraftCall"]


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
    """

    def __init__(self, drafter: DFlashDraftModel, target_model: Any, slots: int) -> None:
        check_drafter_fits_target(drafter, target_model.config)
        self.drafter = drafter
        self.embed_tokens = target_model.get_input_embeddings()
        ids = drafter.draft_token_ids
        self.lm_head = draft_lm_head(target_model.get_output_embeddings(), ids)
        #: target id of each draft id (numpy int64 [K]), or ``None`` with the full vocabulary
        self.token_map = None if ids is None else ids.cpu().numpy()
        config = drafter.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        attention = drafter.layers[0].self_attn
        self.head_dim, self.scale = attention.head_dim, attention.scaling
        self.slots = check_int("slots", slots, minimum=1)
        self.lengths = [0] * self.slots
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.capacity = 0

    @property
    def block_size(self) -> int:
        return self.drafter.block_size

    def reset(self, slot: int) -> None:
        """Forget ``slot``'s context (a new request takes it)."""
        self.lengths[slot] = 0

    def _reserve(self, needed: int) -> None:
        """Room for ``needed`` entries per slot, the slots' entries carried over. Zeros: the
        entries a padded pass masks out must hold numbers (a zero weight times NaN is NaN)."""
        if needed <= self.capacity:
            return
        capacity = max(needed, 2 * self.capacity, 256)
        weight = self.drafter.fc.weight
        shape = (self.slots, self.kv_heads, capacity, self.head_dim)

        def grown(old: list[torch.Tensor]) -> list[torch.Tensor]:
            new = [weight.new_zeros(shape) for _ in self.drafter.layers]
            for fresh, kept in zip(new, old):  # nothing to keep the first time
                fresh[:, :, : self.capacity] = kept
            return new

        self.keys, self.values = grown(self.keys), grown(self.values)
        self.capacity = capacity

    @torch.no_grad()
    def propose(self, calls: Sequence[DraftCall]) -> list[DraftLogits]:
        """One drafter pass for ``calls`` (distinct slots); the draft logits of each block's
        positions ``1 .. q-1``, as :meth:`DFlashProposer.propose
        <caddtree.models.proposer.DFlashProposer.propose>` returns them."""
        plan = self._plan(calls)
        self._reserve(max(plan.ends))
        drafter = self.drafter
        weight = drafter.fc.weight
        features = torch.cat([c.features.reshape(-1, drafter.fc.in_features) for c in calls])
        context = drafter.hidden_norm(drafter.fc(features.to(weight)))
        hidden = self.embed_tokens(plan.block.to(self.embed_tokens.weight.device)).to(weight)
        cos, sin = drafter.rotary_emb(hidden, plan.positions[None])
        cos, sin = cos[0, :, None], sin[0, :, None]  # [rows, 1, D]
        for index, layer in enumerate(drafter.layers):
            attended = self._attention(
                index, layer.self_attn, layer.input_layernorm(hidden), context, cos, sin, plan
            )
            hidden = hidden + attended
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        hidden = drafter.norm(hidden).view(len(calls), self.block_size, -1)
        for call, start in zip(calls, plan.starts):
            self.lengths[call.slot] = start
        target_dtype = self.lm_head.weight
        return [
            DraftLogits(
                hidden[b, 1:].to(target_dtype), self.lm_head, PROJECTION_STEPS, self.token_map
            )
            for b in range(len(calls))
        ]

    def _plan(self, calls: Sequence[DraftCall]) -> _Plan:
        slots = [int(c.slot) for c in calls]
        if (
            not calls
            or len(set(slots)) != len(slots)
            or not 0 <= min(slots) <= max(slots) < self.slots
        ):
            raise InvalidInputError(
                f"a drafter pass needs distinct slots below {self.slots}: {slots}"
            )
        q, device = self.block_size, self.drafter.fc.weight.device
        counts = [int(c.features.reshape(-1, c.features.shape[-1]).shape[0]) for c in calls]
        firsts = [self.lengths[s] for s in slots]
        starts = [f + c for f, c in zip(firsts, counts)]
        block = torch.full((len(calls), q), self.drafter.mask_token_id, dtype=torch.long)
        block[:, 0] = torch.tensor([int(c.bonus) for c in calls])
        context_entries = [list(range(f, s)) for f, s in zip(firsts, starts)]
        block_entries = [list(range(s, s + q)) for s in starts]
        flat = [e for entries in context_entries for e in entries] + [
            e for entries in block_entries for e in entries
        ]
        row_slots = [s for s, c in zip(slots, counts) for _ in range(c)] + [
            s for s in slots for _ in range(q)
        ]
        length = max(starts) + q
        visible = torch.zeros((len(calls), 1, 1, length), dtype=torch.bool)
        for b, start in enumerate(starts):
            visible[b, 0, 0, : start + q] = True
        return _Plan(
            slots=slots,
            starts=starts,
            ends=[s + q for s in starts],
            block=block.view(-1),
            positions=torch.tensor(flat, device=device),
            write=(torch.tensor(row_slots, device=device), torch.tensor(flat, device=device)),
            mask=visible.expand(-1, -1, q, -1).to(device),
            context_rows=sum(counts),
        )

    def _attention(
        self,
        index: int,
        attention: Any,
        hidden: torch.Tensor,
        context: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: _Plan,
    ) -> torch.Tensor:
        """The layer's attention of every block row: writes the context and block keys/values
        into the slots, then attends each block over its slot."""
        rows, dim, q = hidden.shape[0], self.head_dim, self.block_size
        c = plan.context_rows
        queries = attention.q_norm(attention.q_proj(hidden).view(rows, self.heads, dim))
        queries = _rotate(queries, cos[c:], sin[c:])
        kv_input = torch.cat([context, hidden])
        keys = attention.k_norm(attention.k_proj(kv_input).view(-1, self.kv_heads, dim))
        keys = _rotate(keys, cos, sin)
        values = attention.v_proj(kv_input).view(-1, self.kv_heads, dim)
        slots, entries = plan.write
        self.keys[index][slots, :, entries] = keys
        self.values[index][slots, :, entries] = values
        slot_index = torch.tensor(plan.slots, device=hidden.device)
        length = plan.mask.shape[-1]
        k_seen = self.keys[index][:, :, :length].index_select(0, slot_index)
        v_seen = self.values[index][:, :, :length].index_select(0, slot_index)
        query = queries.view(len(plan.slots), q, self.heads, dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            query,
            k_seen,
            v_seen,
            attn_mask=plan.mask,
            scale=self.scale,
            enable_gqa=self.heads != self.kv_heads,
        )
        return attention.o_proj(out.transpose(1, 2).reshape(rows, self.heads * dim))


class _Plan(NamedTuple):
    """Where a pass's rows go: per sequence its slot, its new length (``starts``: its block's
    first position) and block end; every row's position and cache entry (context rows first,
    then the blocks), and the attention mask of the blocks [B, 1, q, L]."""

    slots: list[int]
    starts: list[int]
    ends: list[int]
    block: torch.Tensor
    positions: torch.Tensor
    write: tuple[torch.Tensor, torch.Tensor]
    mask: torch.Tensor
    context_rows: int


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` [rows, heads, D] by ``cos``/``sin`` [rows, 1, D], as the
    drafter's own attention applies it (transformers' ``rotate_half``)."""
    return x * cos + rotate_half(x) * sin

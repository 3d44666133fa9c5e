"""The target's next-token distribution at every response position, as the loss's L1 / TV and LK
terms and the per-position acceptance figures need it: its top ``k`` over the draft vocabulary.

Row ``j`` of a sample whose prompt has ``P`` tokens is the target's distribution after the tokens
``0 .. P+j`` of the sample (conditioned on the true prefix), over the next token ``P+j+1``: the
distribution whose argmax is the greedy label there. A sample of ``T`` tokens has ``T-1-P`` rows
(every response token but the first has one; the first is never a block's label). Each row holds
(:func:`topk_rows`):

==========  ============  ========================================================================
``ids``     int16 [k]     the draft ids of the ``k`` most likely draft-vocabulary tokens (int32
                          when the draft vocabulary has more than 32,767 ids)
``probs``   float16 [k]   their probabilities, normalised over the target's *whole* vocabulary
``rest``    float32       the draft vocabulary's mass outside those ``k`` (1 - outside - sum probs)
``outside`` float32       the mass outside the draft vocabulary (0 without one)
==========  ============  ========================================================================

that is ``4k + 8`` bytes per response token (136 at ``k = 32``). They are computed in the same
forward as the context features, with the target's ``lm_head`` (:mod:`caddtree.train.features`),
and cached with them under a key of ``k`` and the draft vocabulary (:meth:`TopKSpec.key`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..util.errors import InvalidInputError

__all__ = ["DEFAULT_TOPK", "TargetDistributions", "TopKSpec", "topk_rows"]

DEFAULT_TOPK = 32
"""How many of the target's most likely draft-vocabulary tokens a row keeps by default."""

_FIELDS = ("ids", "probs", "rest", "outside")


@dataclass(frozen=True)
class TopKSpec:
    """What the stored rows are: the top ``k`` over the draft vocabulary ``draft_ids`` (the
    target ids in draft-id order; ``None``: the target's whole vocabulary of ``vocab_size``)."""

    k: int
    draft_ids: torch.Tensor | None
    vocab_size: int

    @classmethod
    def make(cls, k: int, draft_ids: torch.Tensor | None, vocab_size: int) -> TopKSpec:
        """The spec for ``k``, at most the size of the draft vocabulary."""
        if k < 1:
            raise InvalidInputError(f"the target's top-k needs k >= 1, got {k}")
        size = vocab_size if draft_ids is None else int(draft_ids.numel())
        ids = None if draft_ids is None else draft_ids.detach().to("cpu", torch.long)
        return cls(min(int(k), size), ids, int(vocab_size))

    @property
    def size(self) -> int:
        """The number of draft ids."""
        return self.vocab_size if self.draft_ids is None else int(self.draft_ids.numel())

    def key(self) -> dict:
        """What a cache of these rows must have been made with: ``k`` and the draft vocabulary."""
        if self.draft_ids is None:
            vocab = f"full:{self.vocab_size}"
        else:
            vocab = hashlib.sha256(self.draft_ids.numpy().tobytes()).hexdigest()[:24]
        return {"k": self.k, "vocab": vocab}


@torch.inference_mode()
def topk_rows(
    hidden: torch.Tensor, lm_head: torch.nn.Module, spec: TopKSpec, chunk: int = 512
) -> dict[str, torch.Tensor]:
    """The stored rows (module docstring) of the target's final hidden states ``hidden`` [N, H]
    (after its final norm): the logits of the whole vocabulary give the normalisation, the top
    ``k`` is taken over the draft vocabulary's columns; ``chunk`` rows at a time, returned on the
    CPU."""
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in _FIELDS}
    columns = None if spec.draft_ids is None else spec.draft_ids.to(hidden.device)
    id_dtype = torch.int16 if spec.size <= torch.iinfo(torch.int16).max else torch.int32
    # at least once, so that no rows give empty tensors of the right shapes
    for start in range(0, max(hidden.shape[0], 1), chunk):
        logits = lm_head(hidden[start : start + chunk]).float()
        log_z = torch.logsumexp(logits, dim=-1, keepdim=True)
        log_p = (logits if columns is None else logits[:, columns]) - log_z
        top, ids = log_p.topk(spec.k, dim=-1)
        probs = top.exp().to(torch.float16)
        # the mass outside the draft vocabulary, 1 - exp(log mass inside), without cancellation
        outside = (-torch.expm1(torch.logsumexp(log_p, dim=-1))).clamp(min=0)
        if columns is None:
            outside = torch.zeros_like(outside)
        # from the stored (rounded) probabilities, so that a row's masses add up to 1
        rest = (1 - outside - probs.float().sum(-1)).clamp(min=0)
        for name, value in zip(_FIELDS, (ids.to(id_dtype), probs, rest, outside)):
            parts[name].append(value.cpu())
    return {name: torch.cat(values) for name, values in parts.items()}


class TargetDistributions:
    """The stored rows of every sample: ``rows`` (module docstring; all samples' rows in sample
    order), ``counts`` (rows per sample) and the key of the spec they were made with."""

    def __init__(self, rows: dict[str, torch.Tensor], counts: Sequence[int], spec_key: dict):
        self.rows, self.spec_key = rows, dict(spec_key)
        self.counts = [int(c) for c in counts]
        self.samples = {name: list(torch.split(rows[name], self.counts)) for name in _FIELDS}

    def __len__(self) -> int:
        return len(self.counts)

    @staticmethod
    def tensor_names(suffix: str) -> dict[str, str]:
        """The names of a cache part's tensors (``counts``: rows per sample)."""
        return {name: f"next_{name}{suffix}" for name in (*_FIELDS, "counts")}

    def named_tensors(self, suffix: str) -> dict[str, torch.Tensor]:
        """These rows as a cache part's tensors (:meth:`tensor_names`)."""
        tensors = {**self.rows, "counts": torch.tensor(self.counts, dtype=torch.long)}
        return {name: tensors[field] for field, name in self.tensor_names(suffix).items()}

    @classmethod
    def from_parts(
        cls, tensors: dict[str, torch.Tensor], suffixes: Sequence[str], spec_key: dict
    ) -> TargetDistributions:
        """The rows of a cache file's parts (``suffixes`` in order)."""
        names = [cls.tensor_names(s) for s in suffixes]
        rows = {f: torch.cat([tensors[n[f]] for n in names]) for f in _FIELDS}
        counts = torch.cat([tensors[n["counts"]] for n in names]).tolist()
        return cls(rows, counts, spec_key)

    def for_blocks(
        self,
        sample_ids: Sequence[int],
        anchors: Sequence[torch.Tensor],
        prompt_lengths: Sequence[int],
        block_size: int,
    ) -> dict[str, torch.Tensor]:
        """The rows of block positions ``1 .. B-1`` of the blocks at ``anchors`` (one tensor per
        sample): position ``k`` of the block at anchor ``a`` predicts token ``a+k``, so it takes
        the row of sequence position ``a+k-1``. Returns ``ids`` [b, M, B-1, k] (long), ``probs``
        [b, M, B-1, k] (float32), ``rest`` and ``outside`` [b, M, B-1]; entries past a sample's
        rows and of padding blocks are zeros (the caller masks them)."""
        b, M = len(sample_ids), max(int(a.shape[0]) for a in anchors)
        k = self.samples["ids"][0].shape[-1] if self.counts else 0
        out = {
            "ids": torch.zeros((b, M, block_size - 1, k), dtype=torch.long),
            "probs": torch.zeros((b, M, block_size - 1, k)),
            "rest": torch.zeros((b, M, block_size - 1)),
            "outside": torch.zeros((b, M, block_size - 1)),
        }
        offsets = torch.arange(block_size - 1)
        for r, (i, anc) in enumerate(zip(sample_ids, anchors)):
            if self.counts[i] == 0:
                continue
            rows = anc[:, None] + offsets - prompt_lengths[i]  # [m, B-1]
            inside = rows < self.counts[i]
            rows = rows.clamp(0, self.counts[i] - 1)
            for name, value in self.samples.items():
                picked = value[i][rows].to(out[name].dtype)
                mask = inside if picked.ndim == 2 else inside[..., None]
                out[name][r, : anc.shape[0]] = picked * mask
        return out

"""Training batches built where the drafter trains (the GPU, or the CPU's memory).

:class:`SampleBank` holds every sample's tokens and context features in flat tensors with
offsets on the training device, so a step gathers its samples there instead of copying them
from the host (or, without stored features, computes a batch's from its tokens).
:func:`random_anchors` draws a step's anchor blocks with the device's generator, and
:func:`block_batch` makes the drafter's inputs for them (block tokens, positions, a boolean
mask, labels) with tensor operations: the same inputs as
:func:`~caddtree.train.loss.build_training_batch`, except that padding blocks see their own
positions (nothing reads them; no row of the mask is empty). Nothing here reads a device value
back on the host: the host knows each sample's length, and that is all a step's shapes need.
:func:`length_buckets` orders samples by length so a step's samples pad little.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

__all__ = [
    "BlockBatch",
    "SampleBank",
    "anchors_from_lists",
    "block_batch",
    "by_length",
    "length_buckets",
    "random_anchors",
]

_ROUND_CONTEXT = 16  # contexts are padded to a multiple of this (fewer distinct shapes)


class SampleBank:
    """Every sample's tokens [N] (long) and features [N, width] in one tensor each on
    ``device``, sample ``i`` at rows ``starts[i] .. starts[i] + lengths[i] - 1``. The lengths and
    prompt lengths are also kept on the host (``host_lengths``), for a batch's shape."""

    def __init__(
        self,
        sequences: Sequence[torch.Tensor],
        prompt_lengths: Sequence[int],
        features: list[torch.Tensor] | None,
        device: torch.device,
        dtype: torch.dtype,
        compute: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.host_lengths = [int(s.shape[0]) for s in sequences]
        self.longest = max(self.host_lengths, default=0)
        lengths = torch.tensor(self.host_lengths, dtype=torch.long)
        starts = torch.cumsum(lengths, 0) - lengths
        self.device, self.dtype = device, dtype
        self.lengths = lengths.to(device)
        self.starts = starts.to(device)
        self.prompt_lengths = torch.tensor(list(prompt_lengths), dtype=torch.long).to(device)
        flat = torch.cat(list(sequences)) if sequences else torch.zeros(0, dtype=torch.long)
        self.tokens = flat.to(device, torch.long)
        # without stored features, ``compute`` makes a batch's from its tokens [b, T]
        self.compute = compute
        if compute is None:
            self.features = _flat_features(features, self.host_lengths, starts, device, dtype)

    def __len__(self) -> int:
        return len(self.host_lengths)

    def context_length(self, sample_ids: Sequence[int]) -> int:
        """The padded context length of a batch of these samples (host values only)."""
        longest = max(self.host_lengths[i] for i in sample_ids)
        return -(-longest // _ROUND_CONTEXT) * _ROUND_CONTEXT

    def gather(self, ids: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [b, T] and features [b, T, width] of samples ``ids`` (a device tensor), each
        padded past its end with its last row (which no block sees)."""
        last = (self.lengths[ids] - 1)[:, None]
        rows = self.starts[ids][:, None] + torch.arange(T, device=self.device).minimum(last)
        tokens = self.tokens[rows]
        if self.compute is not None:
            return tokens, self.compute(tokens).to(self.dtype)
        return tokens, self.features[rows]


def _flat_features(
    features: list[torch.Tensor],
    lengths: Sequence[int],
    starts: torch.Tensor,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The samples' features in one tensor. On the CPU the list's entries are replaced by views
    of it as they are copied (the same values), so the old tensors can be freed one by one
    rather than held beside the copy."""
    width = int(features[0].shape[-1]) if features else 0
    flat = torch.empty((sum(lengths), width), dtype=dtype, device=device)
    for i, (start, n) in enumerate(zip(starts.tolist(), lengths)):
        if int(features[i].shape[0]) < n:
            raise ValueError(f"sample {i} has {n} tokens but features of {features[i].shape[0]}")
        flat[start : start + n] = features[i][:n].to(device, dtype)
        if device.type == "cpu" and features[i].dtype == dtype:
            features[i] = flat[start : start + n]
    return flat


def random_anchors(
    bank: SampleBank, ids: torch.Tensor, count: int, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` distinct random response positions of each sample ``ids`` (positions ``P ..
    T-2``, sorted), drawn on the bank's device: anchors [b, count] and which of them are real
    [b, count] (a sample with fewer positions gets that many; the rest are padding)."""
    lengths, prompts = bank.lengths[ids], bank.prompt_lengths[ids]
    span = max(bank.longest, count)
    pos = torch.arange(span, device=bank.device)
    usable = (pos >= prompts[:, None]) & (pos < lengths[:, None] - 1)
    keys = torch.rand((len(ids), span), device=bank.device, generator=generator)
    keys = torch.where(usable, keys, 2.0)
    chosen = keys.topk(count, dim=-1, largest=False).indices
    real = usable.gather(1, chosen)
    order = torch.where(real, chosen, span).sort(dim=-1).values
    real = order < span
    return torch.where(real, order, 0), real


def anchors_from_lists(
    anchors: Sequence[torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors given as one sorted tensor per sample, padded: anchors [b, M] and which are real."""
    M = max(int(a.shape[0]) for a in anchors)
    padded = torch.zeros((len(anchors), M), dtype=torch.long)
    real = torch.zeros((len(anchors), M), dtype=torch.bool)
    for r, a in enumerate(anchors):
        padded[r, : a.shape[0]] = a
        real[r, : a.shape[0]] = True
    return padded.to(device), real.to(device)


class BlockBatch(NamedTuple):
    """The drafter's inputs for a batch of anchor blocks (see :func:`block_batch`)."""

    block_tokens: torch.Tensor  # [b, M*B]
    position_ids: torch.Tensor  # [b, T + M*B]
    attention_mask: torch.Tensor  # [b, 1, M*B, T + M*B], True where a position is seen
    labels: torch.Tensor  # [b, M, B-1] target ids, -100 past the sequence and for padding
    features: torch.Tensor  # [b, T, width]


def block_batch(
    bank: SampleBank,
    ids: torch.Tensor,
    T: int,
    anchors: torch.Tensor,
    real: torch.Tensor,
    block_size: int,
    mask_token_id: int,
) -> BlockBatch:
    """The inputs of one drafter forward over the blocks at ``anchors`` [b, M] (``real`` marks
    the ones that are not padding) of samples ``ids``, context padded to ``T``: block ``j`` of a
    sample sees the sample's positions before its anchor and its own ``B`` positions; its labels
    are the tokens ``anchor+1 .. anchor+B-1``."""
    b, M = anchors.shape
    B, dev = block_size, bank.device
    tokens, features = bank.gather(ids, T)
    offsets = torch.arange(B, device=dev)
    first = torch.where(real, tokens.gather(1, anchors), mask_token_id)
    block_tokens = torch.full((b, M, B), mask_token_id, dtype=torch.long, device=dev)
    block_tokens[..., 0] = first
    block_positions = torch.where(real[..., None], anchors[..., None] + offsets, 0)
    positions = torch.cat(
        [torch.arange(T, device=dev).expand(b, T), block_positions.reshape(b, M * B)], 1
    )
    sees_context = torch.arange(T, device=dev) < anchors[..., None]  # [b, M, T]
    sees_context = sees_context & real[..., None]
    block_of = torch.arange(M, device=dev).repeat_interleave(B)
    own = (block_of[:, None] == block_of[None, :]).expand(b, -1, -1)
    mask = torch.cat([sees_context.repeat_interleave(B, dim=1), own], -1)[:, None]
    wanted = anchors[..., None] + offsets[1:]  # [b, M, B-1]
    length = bank.lengths[ids][:, None, None]
    labels = tokens.gather(1, wanted.reshape(b, -1).clamp(max=T - 1)).view(b, M, B - 1)
    labels = torch.where(real[..., None] & (wanted < length), labels, -100)
    return BlockBatch(block_tokens.view(b, M * B), positions, mask, labels, features)


def by_length(sample_ids: Sequence[int], lengths: Sequence[int]) -> list[int]:
    """``sample_ids`` ordered by their ``lengths`` (ties by id), for :func:`length_buckets`."""
    return sorted(sample_ids, key=lambda i: (lengths[i], i))


def length_buckets(ordered: Sequence[int], picks: torch.Tensor, window: int) -> list[int]:
    """Samples for a step by length: ``ordered`` (sample ids by length, :func:`by_length`) is cut
    into buckets of ``window`` neighbours, the last one taking the remainder (so no bucket is
    smaller than ``window``); ``picks`` (uniform random numbers in [0, 1), one per sample of the
    step) choose, the first a place in ``ordered`` and so its bucket (a bucket as often as it has
    samples), the others places in that bucket. Every sample is drawn equally often, and a step's
    samples have similar lengths."""
    n = len(ordered)
    window = max(1, min(window, n))
    buckets = n // window
    first, *others = picks.tolist()
    place = min(int(first * n), n - 1)
    low = min(place // window, buckets - 1) * window
    size = window if low + 2 * window <= n else n - low
    return [ordered[place]] + [ordered[low + min(int(p * size), size - 1)] for p in others]

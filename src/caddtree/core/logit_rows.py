"""Reading one row of draft logits on the CPU: its normaliser and its ``k`` largest entries.

:class:`caddtree.core.candidates.Candidates` reads each position's row the first time the tree expansion
reaches it, and again, wider, only when the expansion runs past what it read. These are the
pieces of such a read that touch the whole row, written to pass over it as few times and as
cheaply as they can: one max per 128-token chunk (torch if loaded, on one thread), the top-``k`` selected
among the chunks whose max can hold one of the ``k`` largest entries (numpy), and one ``exp`` pass
for the logsumexp (numpy's is about twice as fast as torch's on a CPU).
"""

from __future__ import annotations

import math
import sys

import numpy as np

__all__ = ["CHUNK", "chunk_maxima", "chunked", "logsumexp", "top_candidates"]


def logsumexp(row: np.ndarray, peak: float | None = None) -> float:
    """``log(sum(exp(row)))`` in the row's precision (``peak``: the row's max, if known); the
    row's max if that is not finite."""
    m = row.max() if peak is None else peak
    if not np.isfinite(m):
        return float(m)
    return float(m) + math.log(float(np.exp(row - m).sum()))


CHUNK = 128
"""Width of the chunks whose maxima :func:`top_candidates` selects from."""


def chunk_maxima(row: np.ndarray) -> np.ndarray:
    """The max of each :data:`CHUNK` entries of ``row`` (the last chunk may be shorter).

    With torch loaded, its reduction over the last axis does this several times faster than
    numpy's; it runs on one thread (a parallel reduction this small waits on a descheduled helper
    thread whenever the machine is busy, a hundred times longer than the work).
    Without torch (numpy logits), numpy does it and torch is not imported for it.
    """
    full = row.shape[0] // CHUNK
    head = row[: full * CHUNK].reshape(full, CHUNK)
    torch = sys.modules.get("torch")
    if torch is None:
        maxima = head.max(axis=1)
    else:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            maxima = torch.from_numpy(head).amax(dim=1).numpy()
        finally:
            torch.set_num_threads(threads)
    if row.shape[0] > full * CHUNK:
        maxima = np.append(maxima, row[full * CHUNK :].max())
    return maxima


def chunked(vocab: int, k: int) -> bool:
    """Whether selecting among chunk maxima saves work for a top-``k`` of ``vocab`` entries."""
    return k * CHUNK * 8 <= vocab


def top_candidates(
    row: np.ndarray, k: int, maxima: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` largest entries of a 1-D array with a finite max, and their indices, in no
    order (tied entries at the cut may be any of them, as with ``torch.topk``). ``maxima`` are
    the row's :func:`chunk_maxima` when :func:`chunked` (computed here if not given).

    A selection over the whole row costs a pass with a partition. Here the row is cut into
    chunks of :data:`CHUNK`, a vectorised max is taken per chunk, and the selection then runs
    over only the chunks whose max reaches the ``k``-th largest chunk max ``t``. That is exact:
    ``k`` chunks have a max of at least ``t``, so the ``k`` largest entries are all ``>= t``, and
    every entry ``>= t`` lies in a chunk whose max is ``>= t``.
    """
    vocab = row.shape[0]
    if k >= vocab:
        return row, np.arange(vocab)
    if not chunked(vocab, k):
        idx = np.argpartition(row, vocab - k)[vocab - k :]
        return row[idx], idx
    if maxima is None:
        maxima = chunk_maxima(row)
    cut = np.partition(maxima, maxima.shape[0] - k)[maxima.shape[0] - k]
    chosen = np.flatnonzero(maxima >= cut)
    ids = (chosen[:, None] * CHUNK + np.arange(CHUNK)).ravel()
    if chosen[-1] == vocab // CHUNK:  # the short last chunk
        ids = ids[ids < vocab]
    candidates = row[ids]
    pick = np.argpartition(candidates, candidates.shape[0] - k)[candidates.shape[0] - k :]
    return candidates[pick], ids[pick]

"""Drafts copied from the context: the tokens that followed earlier occurrences of the text's last
few tokens (prompt-lookup decoding's source), with an acceptance estimate learnt as they are
verified.

:class:`ContextIndex` holds one request's prompt and output and finds the longest suffix of up to
``max_order`` tokens that occurred before, extends each occurrence's match backwards (up to
:data:`MAX_MATCH` tokens) and takes what followed the most recent occurrences whose match is in the
longest one's class (:func:`match_class`). :func:`copy_trie` turns those continuations into a
:class:`CopyTrie` (one branch per distinct continuation, with how many occurrences share each
node), priced by :class:`CopyRates`: the estimated probability that the target accepts a copied
token given that its parent was accepted, per match class and depth, learnt from every verified
round (:meth:`CopyRates.observe`) with a pooled estimate as its prior. The tree builders
(:mod:`caddtree.core.merged`) put the trie's nodes and the drafter's on one scale.

Memory per request: the token ids and one 64-bit hash per order and token, ``8 * (1 + max_order)``
bytes a token (160 KiB for 4,096 tokens at the default order 4), grown by doubling.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "MAX_DEPTH_BUCKET",
    "MAX_MATCH",
    "MAX_OCCURRENCES",
    "MAX_ORDER",
    "ContextIndex",
    "CopyRates",
    "CopyTrie",
    "copy_trie",
    "match_class",
    "prior_rate",
]

MAX_ORDER = 4
"""The longest suffix (in tokens) looked up in the context."""

MAX_OCCURRENCES = 4
"""How many of the suffix's most recent earlier occurrences give a continuation."""

MAX_SCANNED = 32
"""How many of the suffix's most recent earlier occurrences are compared for the longest match."""

MAX_MATCH = 32
"""How far back an occurrence's match with the text's end is followed."""

MAX_DEPTH_BUCKET = 8
"""Copied tokens this deep or deeper share one acceptance estimate."""

_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)

CLASS_BOUNDS = (1, 2, 3, 4, 8, 16, 32)
"""The shortest match of each class: a match of 1, 2 or 3 tokens, 4-7, 8-15, 16-31, 32 or more
(:func:`match_class`)."""

PRIOR_BY_CLASS = (
    (0.0, 0.0, 0.0),
    (0.3, 0.55, 0.65),
    (0.55, 0.65, 0.7),
    (0.65, 0.7, 0.75),
    (0.75, 0.8, 0.82),
    (0.85, 0.88, 0.9),
    (0.92, 0.93, 0.94),
    (0.97, 0.98, 0.98),
)
"""Where a pool's estimate starts, by match class and depth (1, 2, 3 and deeper): longer matches
are accepted more often, and a copy's later tokens more than its first (:func:`prior_rate`;
``benchmarks/copy_rates.py`` and docs/design.md, "Copies from the context", for where these come
from)."""


def match_class(length: int) -> int:
    """The class of a match of ``length`` tokens (0: none; :data:`CLASS_BOUNDS`)."""
    return bisect.bisect_right(CLASS_BOUNDS, length)


def prior_rate(match: int, depth: int) -> float:
    """The starting estimate of a copied token at ``depth`` below a match of ``match`` tokens."""
    return _class_prior(match_class(match), depth)


def _class_prior(c: int, depth: int) -> float:
    """:data:`PRIOR_BY_CLASS` of class ``c`` at ``depth`` (the third and deeper share one)."""
    return PRIOR_BY_CLASS[c][min(max(depth, 1), 3) - 1]


class ContextIndex:
    """One request's tokens (its prompt, then its output as it is committed) with a rolling hash
    of the n-gram that ends at each position, for n = 1 .. ``max_order``; the last token is the
    round's bonus token, below which drafts hang."""

    def __init__(self, tokens: Iterable[int] = (), max_order: int = MAX_ORDER) -> None:
        self.max_order = max_order
        self.length = 0
        self._tokens = np.zeros(64, np.int64)
        self._keys = np.zeros((max_order, 64), np.uint64)
        self.extend(tokens)

    @property
    def tokens(self) -> np.ndarray:
        return self._tokens[: self.length]

    def extend(self, tokens: Iterable[int]) -> None:
        """Append ``tokens`` (a round's committed ones); O(len(tokens) * max_order)."""
        new = np.fromiter((int(t) for t in tokens), np.int64)
        start, end = self.length, self.length + len(new)
        if start == end:
            return
        if end > self._tokens.shape[0]:
            self._grow(end)
        self._tokens[start:end] = new
        self._keys[0, start:end] = new.astype(np.uint64) + np.uint64(1)
        for n in range(1, self.max_order):
            shorter = self._keys[n - 1, max(start - 1, 0) : end - 1]
            if start == 0:
                shorter = np.concatenate((np.zeros(1, np.uint64), shorter))
            self._keys[n, start:end] = shorter * _MULTIPLIER + self._keys[0, start:end]
        self.length = end

    def _grow(self, needed: int) -> None:
        size = max(needed, 2 * self._tokens.shape[0])
        tokens, keys = np.zeros(size, np.int64), np.zeros((self.max_order, size), np.uint64)
        tokens[: self.length], keys[:, : self.length] = self.tokens, self._keys[:, : self.length]
        self._tokens, self._keys = tokens, keys

    def continuations(
        self, depth: int, occurrences: int = MAX_OCCURRENCES
    ) -> tuple[int, list[np.ndarray]]:
        """``(match, continuations)``: for the longest suffix of at most ``max_order`` tokens that
        occurred before, the up to ``depth`` tokens that followed each of its ``occurrences`` most
        recent earlier occurrences (newest first) whose match with the text's end, followed back up
        to :data:`MAX_MATCH` tokens, is in the class of the longest such match (of the
        :data:`MAX_SCANNED` newest), and that match's length; ``(0, [])`` when no token recurs."""
        end, tokens = self.length, self.tokens
        for n in range(min(self.max_order, end - 1), 0, -1):
            keys = self._keys[n - 1, : end - 1]
            ends = np.flatnonzero(keys[n - 1 :] == self._keys[n - 1, end - 1]) + (n - 1)
            lasts, lengths = self._newest_matches(ends[::-1], n)
            if lasts.size:
                longest = int(lengths.max())
                shortest_of_class = CLASS_BOUNDS[match_class(longest) - 1]
                best = lasts[lengths >= shortest_of_class][:occurrences]
                return longest, [tokens[last + 1 : last + 1 + depth] for last in best.tolist()]
        return 0, []

    def _newest_matches(self, ends: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Of the hash matches ``ends`` (newest first), the :data:`MAX_SCANNED` newest whose last
        ``n`` tokens are those of the text's end (checked token by token), with their match
        lengths."""
        lasts, lengths = [], []
        found = 0
        for start in range(0, ends.size, MAX_SCANNED):
            chunk = ends[start : start + MAX_SCANNED]
            length = self._match_lengths(chunk)
            real = length >= n
            lasts.append(chunk[real])
            lengths.append(length[real])
            found += int(real.sum())
            if found >= MAX_SCANNED:
                break
        if not lasts:
            return ends[:0], ends[:0]
        return np.concatenate(lasts)[:MAX_SCANNED], np.concatenate(lengths)[:MAX_SCANNED]

    def _match_lengths(self, lasts: np.ndarray) -> np.ndarray:
        """For each position in ``lasts``, how many tokens up to it equal those up to the text's
        end (at most :data:`MAX_MATCH`; the text's start ends a match)."""
        back = np.arange(min(MAX_MATCH, self.length))
        at = lasts[:, None] - back[None, :]
        tokens = self.tokens
        same = (at >= 0) & (tokens[np.maximum(at, 0)] == tokens[self.length - 1 - back][None, :])
        return np.where(same.all(axis=1), back.size, np.argmin(same, axis=1))


@dataclass
class CopyTrie:
    """The continuations of one suffix as a trie below the bonus token (node 0, the root), with the
    length of their match with the text's end: for each node its token, parent, depth (the root's
    is 0), how many continuations pass through it and its children by token.
    ``log_conditional[v]``: the log of the estimated probability that the target accepts node
    ``v`` given that its parent was accepted."""

    match: int
    tokens: list[int] = field(default_factory=lambda: [-1])
    parents: list[int] = field(default_factory=lambda: [-1])
    depths: list[int] = field(default_factory=lambda: [0])
    counts: list[int] = field(default_factory=lambda: [0])
    children: list[dict[int, int]] = field(default_factory=lambda: [{}])
    log_conditional: list[float] = field(default_factory=lambda: [0.0])

    def __len__(self) -> int:
        """The copied nodes (the root is not one)."""
        return len(self.tokens) - 1

    def add(self, continuation: Sequence[int]) -> None:
        node = 0
        self.counts[0] += 1
        for token in continuation:
            child = self.children[node].get(int(token))
            if child is None:
                child = len(self.tokens)
                self.children[node][int(token)] = child
                self.tokens.append(int(token))
                self.parents.append(node)
                self.depths.append(self.depths[node] + 1)
                self.counts.append(0)
                self.children.append({})
                self.log_conditional.append(-math.inf)
            self.counts[child] += 1
            node = child

    def price(self, rates: CopyRates) -> None:
        """Each node's estimate: the rate of its match and depth times its share of its parent's
        continuations."""
        by_depth = [rates.rate(self.match, d) for d in range(MAX_DEPTH_BUCKET + 1)]
        for v in range(1, len(self.tokens)):
            share = self.counts[v] / self.counts[self.parents[v]]
            rate = by_depth[min(self.depths[v], MAX_DEPTH_BUCKET)]
            self.log_conditional[v] = math.log(rate * share)

    def chain(self) -> list[int]:
        """The nodes of the most shared path from the root (ties: the newest continuation, whose
        nodes were added last)."""
        path, node = [], 0
        while self.children[node]:
            node = max(self.children[node].values(), key=lambda v: (self.counts[v], v))
            path.append(node)
        return path


def copy_trie(index: ContextIndex, rates: CopyRates, depth: int) -> CopyTrie | None:
    """The priced trie of ``index``'s continuations, at most ``depth`` deep; None without any."""
    if depth <= 0:
        return None
    match, found = index.continuations(depth)
    if not found:
        return None
    trie = CopyTrie(match)
    for continuation in reversed(found):  # the oldest first: node numbers grow with recency
        trie.add(continuation.tolist())
    trie.price(rates)
    return trie


class CopyRates:
    """How often the target accepts a copied token whose parent it accepted, by match class
    (:func:`match_class`) and depth: counts of trials and hits, shrunk towards ``prior`` (a pooled
    :class:`CopyRates`, e.g. over a batch's requests or a generator's calls) by ``strength``
    pseudo-trials; without a prior, towards ``default`` (``None``: :func:`prior_rate`)."""

    def __init__(
        self, prior: CopyRates | None = None, strength: float = 4.0, default: float | None = None
    ) -> None:
        self.prior, self.strength, self.default = prior, strength, default
        shape = (len(CLASS_BOUNDS) + 1, MAX_DEPTH_BUCKET + 1)
        self.trials, self.hits = np.zeros(shape), np.zeros(shape)

    def rate(self, match: int, depth: int) -> float:
        """The estimate for a copied token at ``depth`` below a match of ``match`` tokens."""
        return self._rate(match_class(match), min(depth, MAX_DEPTH_BUCKET))

    def _rate(self, c: int, d: int) -> float:
        if self.prior is not None:
            base = self.prior._rate(c, d)
        elif self.default is None:
            base = _class_prior(c, d)
        else:
            base = self.default
        rate = (self.hits[c, d] + self.strength * base) / (self.trials[c, d] + self.strength)
        return min(max(rate, 1e-4), 1.0 - 1e-4)

    def observe(self, trie: CopyTrie | None, chosen: Sequence[int]) -> None:
        """Count a verified round: ``chosen`` are the target's tokens below the bonus (the
        accepted path's, then the next bonus). Each trie node on that path with children is a
        trial at the next depth, a hit where the target's token is one of them."""
        if trie is None:
            return
        node = 0
        for token in chosen:
            if not trie.children[node]:
                return
            self._count(trie.match, trie.depths[node] + 1, token in trie.children[node])
            node = trie.children[node].get(int(token), -1)
            if node < 0:
                return

    def _count(self, match: int, depth: int, hit: bool) -> None:
        c, d = match_class(match), min(depth, MAX_DEPTH_BUCKET)
        for rates in (self, self.prior):
            if rates is not None:
                rates.trials[c, d] += 1
                rates.hits[c, d] += hit

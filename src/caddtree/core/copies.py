"""Drafts copied from the context: the tokens that followed earlier occurrences of the text's last
few tokens (prompt-lookup decoding's source), with an acceptance estimate learnt as they are
verified.

:class:`ContextIndex` holds one request's prompt and output and finds, for the longest suffix of up
to ``max_order`` tokens that occurred before, what followed its most recent occurrences.
:func:`copy_trie` turns those continuations into a :class:`CopyTrie` (one branch per distinct
continuation, with how many occurrences share each node), priced by :class:`CopyRates`: the
estimated probability that the target accepts a copied token given that its parent was accepted,
per suffix order and depth, learnt from every verified round (:meth:`CopyRates.observe`) with a
pooled estimate as its prior. The tree builders (:mod:`caddtree.core.merged`) put the trie's nodes
and the drafter's on one scale.

Memory per request: the token ids and one 64-bit hash per order and token, ``8 * (1 + max_order)``
bytes a token (160 KiB for 4,096 tokens at the default order 4), grown by doubling.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "MAX_DEPTH_BUCKET",
    "MAX_OCCURRENCES",
    "MAX_ORDER",
    "ContextIndex",
    "CopyRates",
    "CopyTrie",
    "copy_trie",
    "prior_rate",
]

MAX_ORDER = 4
"""The longest suffix (in tokens) looked up in the context."""

MAX_OCCURRENCES = 4
"""How many of the suffix's most recent earlier occurrences give a continuation."""

MAX_DEPTH_BUCKET = 8
"""Copied tokens this deep or deeper share one acceptance estimate."""

_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)

PRIOR_BY_ORDER = (0.0, 0.35, 0.6, 0.7, 0.85)
"""Where a pool's estimate starts, by suffix order: longer matches are accepted more often, and
a copy's later tokens more than its first (:func:`prior_rate`; docs/design.md, "Copies from the
context", for where these come from)."""


def prior_rate(order: int, depth: int) -> float:
    """The starting estimate of a copied token at ``depth`` of a suffix of ``order`` tokens."""
    base = PRIOR_BY_ORDER[min(order, MAX_ORDER)]
    return min(0.95, base + 0.1 * (min(depth, 3) - 1))


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
        """``(order, continuations)``: the longest suffix of at most ``max_order`` tokens that
        occurred before, and the up to ``depth`` tokens that followed each of its ``occurrences``
        most recent earlier occurrences (newest first); ``(0, [])`` when no token recurs."""
        end, tokens = self.length, self.tokens
        for n in range(min(self.max_order, end - 1), 0, -1):
            keys = self._keys[n - 1, : end - 1]
            ends = np.flatnonzero(keys[n - 1 :] == self._keys[n - 1, end - 1]) + (n - 1)
            suffix = tokens[end - n :]
            found = []
            for last in ends[::-1].tolist():  # newest first; a hash match is checked token by token
                if np.array_equal(tokens[last - n + 1 : last + 1], suffix):
                    found.append(tokens[last + 1 : min(last + 1 + depth, end)])
                    if len(found) == occurrences:
                        break
            if found:
                return n, found
        return 0, []


@dataclass
class CopyTrie:
    """The continuations of one suffix as a trie below the bonus token (node 0, the root): for
    each node its token, parent, depth (the root's is 0), how many continuations pass through it
    and its children by token. ``log_conditional[v]``: the log of the estimated probability that
    the target accepts node ``v`` given that its parent was accepted."""

    order: int
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
        """Each node's estimate: the rate of its order and depth times its share of its parent's
        continuations."""
        for v in range(1, len(self.tokens)):
            share = self.counts[v] / self.counts[self.parents[v]]
            self.log_conditional[v] = math.log(rates.rate(self.order, self.depths[v]) * share)

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
    order, found = index.continuations(depth)
    if not found:
        return None
    trie = CopyTrie(order)
    for continuation in reversed(found):  # the oldest first: node numbers grow with recency
        trie.add(continuation.tolist())
    trie.price(rates)
    return trie


class CopyRates:
    """How often the target accepts a copied token whose parent it accepted, by suffix order and
    depth: counts of trials and hits, shrunk towards ``prior`` (a pooled :class:`CopyRates`, e.g.
    over a batch's requests or a generator's calls) by ``strength`` pseudo-trials; without a prior,
    towards ``default`` (``None``: :func:`prior_rate`)."""

    def __init__(
        self, prior: CopyRates | None = None, strength: float = 4.0, default: float | None = None
    ) -> None:
        self.prior, self.strength, self.default = prior, strength, default
        shape = (MAX_ORDER + 1, MAX_DEPTH_BUCKET + 1)
        self.trials, self.hits = np.zeros(shape), np.zeros(shape)

    def rate(self, order: int, depth: int) -> float:
        """The estimate for a copied token at ``depth`` of a suffix of ``order`` tokens."""
        o, d = min(order, MAX_ORDER), min(depth, MAX_DEPTH_BUCKET)
        if self.prior is not None:
            base = self.prior.rate(o, d)
        else:
            base = prior_rate(o, d) if self.default is None else self.default
        rate = (self.hits[o, d] + self.strength * base) / (self.trials[o, d] + self.strength)
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
            self._count(trie.order, trie.depths[node] + 1, token in trie.children[node])
            node = trie.children[node].get(int(token), -1)
            if node < 0:
                return

    def _count(self, order: int, depth: int, hit: bool) -> None:
        o, d = min(order, MAX_ORDER), min(depth, MAX_DEPTH_BUCKET)
        for rates in (self, self.prior):
            if rates is not None:
                rates.trials[o, d] += 1
                rates.hits[o, d] += hit

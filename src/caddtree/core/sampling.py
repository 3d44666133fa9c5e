"""Choosing the target's tokens: the :class:`Sampler` and the walk of a verified draft tree.

Losslessness. The target's token at every visited tree node is chosen by the :class:`Sampler`
exactly as plain decoding would choose it there: from that node's logits, processed by the same
transformers logits processors (repetition penalty, temperature, top-k, top-p, min-p) with that
node's own context, the prompt, the committed tokens and the tree path down to the node
(:class:`TokenContext`). Greedy decoding takes the argmax of the (processed) scores, sampling
draws from their softmax; the walk (:func:`walk_tree`) follows the child that carries the chosen
token, and the first chosen token with no matching child becomes the next bonus token. Every
committed token is therefore distributed as plain decoding's token given everything before it (at
temperature 0: token for token the same), for any processor that depends only on the context, as
transformers' processors do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ..util.checks import check_sampling
from .tree import DraftTree

__all__ = [
    "Sampler",
    "TokenContext",
    "argmax_rows",
    "greedy_choices",
    "use_argmax_kernel",
    "walk_tree",
]


class Sampler:
    """Chooses the target's token from one row of logits, as transformers' ``generate`` does.

    A sampler is a list of transformers logits processors and a ``do_sample`` flag. The token is
    the argmax of the processed scores (``do_sample=False``) or a sample of their softmax; the
    processors see a float32 copy of the logits and the context (``input_ids``, ``[1, n]``), as
    in ``GenerationMixin._sample``. Build one from the usual settings::

        Sampler(temperature=0.7, top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.1, seed=0)

    which makes the processors ``model.generate`` makes for the same arguments, in its order
    (``GenerationMixin._get_logits_processor``): ``RepetitionPenaltyLogitsProcessor``, then only
    when sampling ``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper`` and
    ``MinPLogitsWarper``, each only when it changes anything; ``temperature=0`` is greedy
    decoding (``do_sample=False``). Or wrap processors prepared elsewhere (for example those
    transformers hands to ``generate(custom_generate=...)``) with :meth:`from_processors`.
    Sampling draws from ``generator`` when given, else from a new one seeded with ``seed`` (on
    ``device``), else from torch's global random number generator.

    With no processors and greedy decoding the choice needs no context and the round loop takes
    a fast path: one argmax over all of a tree's rows (:func:`walk_tree`).
    """

    def __init__(
        self,
        temperature: float = 0.0,
        top_p: float = 1.0,
        *,
        top_k: int = 0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        seed: int | None = None,
        device: torch.device | str = "cpu",
        generator: torch.Generator | None = None,
    ):
        settings = check_sampling(temperature, top_p, top_k, min_p, repetition_penalty, seed)
        do_sample = settings["temperature"] > 0
        if do_sample and generator is None and settings["seed"] is not None:
            generator = torch.Generator(device=device).manual_seed(settings["seed"])
        processors = _sampling_processors(
            temperature=settings["temperature"],
            top_p=settings["top_p"],
            top_k=settings["top_k"],
            min_p=settings["min_p"],
            repetition_penalty=settings["repetition_penalty"],
            do_sample=do_sample,
        )
        self._setup(processors, do_sample, generator)
        self.settings = settings

    @classmethod
    def from_processors(
        cls,
        processors: Iterable[Any] | None,
        do_sample: bool,
        generator: torch.Generator | None = None,
    ) -> Sampler:
        """A sampler that applies ``processors`` (a ``LogitsProcessorList`` or any iterable of
        logits processors, in order) and then takes the argmax (``do_sample=False``) or samples
        with ``generator`` (``None``: torch's global random number generator)."""
        sampler = cls.__new__(cls)
        sampler._setup(list(processors or ()), bool(do_sample), generator)
        sampler.settings = None
        return sampler

    def _setup(
        self, processors: list[Any], do_sample: bool, generator: torch.Generator | None
    ) -> None:
        # A tuple called in order, as ``LogitsProcessorList`` does without extra arguments, minus
        # the signature inspection it repeats on every call (about half of its time on a small
        # vocabulary). Empty: raw logits (the fast greedy path).
        self.processors = tuple(processors)
        self.do_sample = do_sample
        self._needs_context = False
        if self.processors:
            from transformers import (
                MinPLogitsWarper,
                TemperatureLogitsWarper,
                TopKLogitsWarper,
                TopPLogitsWarper,
            )

            context_free = (
                TemperatureLogitsWarper,
                TopKLogitsWarper,
                TopPLogitsWarper,
                MinPLogitsWarper,
            )
            self._needs_context = not all(isinstance(p, context_free) for p in self.processors)
        self.generator = generator if do_sample else None

    def __repr__(self) -> str:
        what = self.settings or {
            "do_sample": self.do_sample,
            "processors": [type(p).__name__ for p in self.processors],
        }
        return f"Sampler({', '.join(f'{k}={v!r}' for k, v in what.items())})"

    @property
    def greedy(self) -> bool:
        """Argmax decoding (of the processed scores, when there are processors)."""
        return not self.do_sample

    @property
    def needs_context(self) -> bool:
        """Whether :meth:`choose` reads the context: a processor other than transformers'
        temperature, top-k, top-p and min-p warpers may (a repetition penalty does)."""
        return self._needs_context

    def scores(self, logits: torch.Tensor, context_ids: Any = None) -> torch.Tensor:
        """The processed scores of a 1D row of ``logits`` (float32, like transformers'), given the
        tokens before it, ``context_ids`` (a ``[1, n]`` or 1D tensor, or a list of ints; may be
        left out when :attr:`needs_context` is false)."""
        scores = logits.reshape(1, -1).to(dtype=torch.float32, copy=True)
        if self.processors:
            if context_ids is None:
                if self._needs_context:
                    raise ValueError("this sampler's logits processors need the context token ids")
                context_ids = ()  # read by none of them
            ids = torch.as_tensor(context_ids, dtype=torch.long, device=scores.device)
            ids = ids.reshape(1, -1)
            for processor in self.processors:
                scores = processor(ids, scores)
        return scores[0]

    def probabilities(self, logits: torch.Tensor, context_ids: Any = None) -> torch.Tensor:
        """The distribution that :meth:`choose` samples from (for a 1D row of logits)."""
        return torch.softmax(self.scores(logits, context_ids), dim=-1)

    def choose(self, logits: torch.Tensor, context_ids: Any = None) -> int:
        """The token after ``context_ids`` given the target's ``logits`` row there. The context
        may be left out when :attr:`needs_context` is false."""
        if self.greedy and not self.processors:
            return int(greedy_choices(logits))
        scores = self.scores(logits, context_ids)
        if self.greedy:
            return int(torch.argmax(scores))
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def _sampling_processors(
    *,
    temperature: float,
    top_p: float,
    top_k: int,
    min_p: float,
    repetition_penalty: float,
    do_sample: bool,
) -> list[Any]:
    """The logits processors ``model.generate`` builds for these settings, in its order (see
    :class:`Sampler`); empty for plain greedy decoding and for plain sampling at temperature 1."""
    wanted = (
        repetition_penalty != 1.0,
        do_sample and temperature != 1.0,
        do_sample and top_k != 0,
        do_sample and top_p < 1.0,
        do_sample and min_p > 0.0,
    )
    if not any(wanted):
        return []
    from transformers import (
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    makers = (
        lambda: RepetitionPenaltyLogitsProcessor(repetition_penalty),
        lambda: TemperatureLogitsWarper(temperature),
        lambda: TopKLogitsWarper(top_k),
        lambda: TopPLogitsWarper(top_p),
        lambda: MinPLogitsWarper(min_p),
    )
    return [make() for make, want in zip(makers, wanted) if want]


def plain_greedy(sampler: Sampler) -> bool:
    """Whether ``sampler`` takes the argmax of the raw logits (greedy, no processors)."""
    return sampler.greedy and not sampler.processors


_ARGMAX_KERNEL: Callable[[torch.Tensor], torch.Tensor] | None = None


def use_argmax_kernel(kernel: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
    """Take ``kernel`` for :func:`argmax_rows` (the runtime sets it once its kernels have passed
    their probes; ``None`` goes back to torch's)."""
    global _ARGMAX_KERNEL
    _ARGMAX_KERNEL = kernel


def argmax_rows(logits: torch.Tensor) -> torch.Tensor | None:
    """``torch.argmax(logits, -1)`` of bfloat16 CPU logits [N, V] (the first index on ties, the
    first NaN if any) without widening them to float32 first, by caddtree's kernel where the
    runtime has loaded its AVX512-BF16 build and it passed its probes
    (:func:`caddtree.runtime.kernels.kernel_available` sets it, :func:`use_argmax_kernel`);
    ``None`` elsewhere (the caller takes torch's)."""
    if (
        _ARGMAX_KERNEL is None
        or logits.dtype is not torch.bfloat16
        or logits.device.type != "cpu"
        or logits.dim() != 2
        or not logits.shape[1]
    ):
        return None
    return _ARGMAX_KERNEL(logits)


def greedy_choices(logits: torch.Tensor) -> torch.Tensor:
    """``argmax`` over the last dimension (the first index on ties). bfloat16 rows on the CPU go
    to caddtree's kernel where it is loaded (:func:`argmax_rows`, the same choices); other
    half-precision logits are upcast to float32 first: exact, so the choices are the same, and on
    a CPU several times faster than a bfloat16 argmax."""
    chosen = argmax_rows(logits)
    if chosen is not None:
        return chosen
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return torch.argmax(logits, dim=-1)


class TokenContext:
    """The prompt and the committed tokens as transformers' ``input_ids`` (``[1, n]``, on the
    device), for logits processors and stopping criteria that read the context.

    A preallocated buffer of ``capacity`` tokens: :meth:`ids` is a view of its first tokens, so no
    call copies the whole sequence. Tokens put after the committed ones with :meth:`put` are
    tentative (a tree path being walked, a round's tokens being checked) until :meth:`commit`.
    """

    def __init__(self, prompt: Sequence[int], capacity: int, device: torch.device | str):
        self._ids = torch.zeros((1, capacity), dtype=torch.long, device=device)
        self._ids[0, : len(prompt)] = torch.tensor(list(prompt), dtype=torch.long)
        self.length = len(prompt)

    def ids(self, tentative: int = 0) -> torch.Tensor:
        """The committed tokens and the first ``tentative`` tokens put after them."""
        return self._ids[:, : self.length + tentative]

    def put(self, offset: int, token: int) -> None:
        """Place ``token`` ``offset`` positions after the committed tokens (not committed)."""
        self._ids[0, self.length + offset] = token

    def commit(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to the committed tokens."""
        if tokens:
            end = self.length + len(tokens)
            self._ids[0, self.length : end] = torch.tensor(list(tokens), dtype=torch.long)
            self.length = end


def walk_tree(
    tree: DraftTree,
    logits: torch.Tensor,
    sampler: Sampler,
    context: TokenContext | None = None,
    choices: Sequence[int] | None = None,
) -> tuple[list[int], int]:
    """Walk ``tree`` with the target's choices.

    ``logits`` [n+1, V] are the target's logits for ``[bonus] + nodes``. The target's token at a
    node is chosen with that node's own path as context: ``context`` (the prompt and every
    committed token, the bonus included) followed by the tokens on the tree path down to and
    including the node, so a repetition penalty sees exactly what plain decoding would have seen
    there. ``context`` may be ``None`` when the sampler does not read it
    (:attr:`Sampler.needs_context`). ``choices``: the :func:`greedy_choices` of ``logits``,
    where the caller has them (a batch takes all its rows' in one call); used only by a greedy
    sampler without processors. Returns the accepted nodes (tree node indices, from the root
    down) and the next bonus token: the target's choice after the last accepted node, which no
    child carries. The row of ``logits`` of node ``k`` is ``k + 1``.
    """
    track = context is not None and sampler.needs_context
    if plain_greedy(sampler) and (len(tree) or choices is not None):
        if choices is None:
            choices = greedy_choices(logits).tolist()  # one host sync for the whole tree
        chosen = choices

        def choose(row: int, depth: int) -> int:
            return chosen[row]
    else:

        def choose(row: int, depth: int) -> int:
            return sampler.choose(logits[row], context.ids(depth) if track else None)

    nodes: list[int] = []
    node = -1
    while True:
        depth = len(nodes)  # tokens of the tree path after the committed ones
        token = choose(node + 1, depth)
        child = tree.child_with_token(node, token) if len(tree) else -1
        if child < 0:
            return nodes, token
        if track:
            context.put(depth, token)
        nodes.append(child)
        node = child

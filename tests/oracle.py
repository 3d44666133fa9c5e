"""A drafter for tests that "copies the target": it runs the target itself on the committed
tokens, so its drafts can be made always right, sometimes right, or the target's own marginals."""

from __future__ import annotations

import torch

from caddtree.engine.decoding import decode, make_policy
from caddtree.models import TreeVerifier
from caddtree.models.drafts import DraftLogits
from tiny_models import FEATURE_LAYER_IDS


def decode_with(
    model,
    prompt,
    method,
    policy_kwargs,
    proposer,
    max_new_tokens,
    *,
    verifier_type=TreeVerifier,
    trees=None,
    **options,
):
    """:func:`decode` of ``prompt`` on a fresh verifier of ``verifier_type`` (the runtime) with
    ``method``'s policy; an :class:`OracleProposer` is told the committed tokens, and with a list
    as ``trees``, ``(tree, round stats)`` of every round is appended to it. ``options`` go to
    :func:`decode` (stop tokens, sampler, stopping criteria)."""
    return decode(
        verifier_type(model, FEATURE_LAYER_IDS),
        prompt,
        make_policy(method, **policy_kwargs),
        proposer=proposer,
        max_new_tokens=max_new_tokens,
        callback=proposer.observe if isinstance(proposer, OracleProposer) else None,
        tree_callback=None if trees is None else (lambda t, r: trees.append((t, r))),
        **options,
    )


class OracleProposer:
    """A drafter that 'copies the target': it runs the target itself on the committed tokens.

    ``mode="onehot"``: a sure vote for the target's greedy continuation (every draft is right).
    ``mode="target"``: the target's own next-token logits along its greedy continuation.
    ``mode="noisy"``: those logits plus Gaussian noise (some drafts right, some wrong).
    It learns the committed tokens through the decode callback. With ``processors`` (transformers
    logits processors, e.g. a repetition penalty) the continuation it drafts along is the argmax
    of the processed scores, greedy decoding's with those processors.
    """

    def __init__(
        self, target, prompt, block_size=6, mode="onehot", noise=3.0, seed=0, processors=None
    ):
        self.target, self.prompt, self.block_size, self.mode = (
            target,
            list(prompt),
            block_size,
            mode,
        )
        self.processors = processors
        self.noise, self.gen = noise, torch.Generator().manual_seed(seed)
        self.reset()

    def reset(self):
        self.history = list(self.prompt)

    @property
    def context_length(self):
        return len(self.history) - 1  # the bonus token is not context yet

    def crop(self, context_length):
        del self.history[context_length + 1 :]

    def observe(self, _stats, tokens):
        self.history.extend(tokens)

    @torch.no_grad()
    def propose(self, bonus, _features):
        assert self.history[-1] == bonus
        seq = list(self.history)
        rows, chosen = [], []
        for _ in range(self.block_size - 1):
            logits = self.target(torch.tensor([seq])).logits[0, -1]
            scores = logits[None].float()
            for processor in self.processors or ():
                scores = processor(torch.tensor([seq]), scores)
            rows.append(logits)
            chosen.append(int(scores.argmax()))
            seq.append(chosen[-1])
        out = torch.stack(rows)
        if self.mode == "onehot":
            out = torch.full_like(out, -30.0).scatter_(1, torch.tensor(chosen)[:, None], 30.0)
        elif self.mode == "noisy":
            out = out + self.noise * torch.randn(out.shape, generator=self.gen, dtype=out.dtype)
        return DraftLogits.precomputed(out)

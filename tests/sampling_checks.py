"""What test_sampling.py (caddtree's decoding loop) and test_hf.py (caddtree inside
``model.generate``) both check against: transformers' own decoding, the tokens its processors
allow, and the exact distribution of sampled tokens (chi-square).

* :data:`METHODS` - every decoding method with small settings; :data:`COST` - a cost model for it.
* :func:`hf_generate` - transformers' own greedy or sampled decoding (the reference).
* :func:`allowed_sets`, :func:`sharp_qwen3` - the tokens the processors leave at each position,
  on a target sharp enough that they cut something.
* :func:`marginal_target`, :data:`MARGINAL_PROMPT`, :data:`MARGINAL_SETTINGS`,
  :func:`assert_three_token_marginals` - the distribution check of three sampled tokens.
* :func:`ddtree_first_tokens`, :func:`assert_first_token_marginals` - sampled DDTree walks over
  the target's own marginals, and the chi-square check of their first three tokens.
* :func:`char_stop` - a stop string the output of a tiny model really contains.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.stats import chisquare

from caddtree import ConvexCostModel
from caddtree.core.cost import PiecewiseLinearCurve
from tiny_models import MASK_TOKEN_ID, llama_target, qwen3_target

COST = ConvexCostModel({0: PiecewiseLinearCurve([0, 8, 64], [0.01, 0.01, 0.05])}, draft_cost=0.004)
METHODS = [
    ("ar", {}),
    ("dflash", {}),
    ("ddtree", {"budget": 8}),
    ("caddtree", {"cost_model": COST, "max_budget": 32}),
]


def hf_generate(model, prompt, max_new_tokens, **kwargs):
    """transformers' own decoding of ``prompt`` (no EOS unless given)."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        pad_token_id=0,
        **{"eos_token_id": None, **kwargs},
    )
    return out[0, len(prompt) :].tolist()


def char_stop(tokenizer, tokens, start):
    """A two-character stop string from ``tokens`` (the first printable pair from ``start``) and
    the position of its last token."""
    chars = [tokenizer.convert_ids_to_tokens(t) if 2 <= t < MASK_TOKEN_ID else None for t in tokens]
    j = next(i for i in range(start, len(tokens)) if chars[i - 1] and chars[i])
    return chars[j - 1] + chars[j], j


# ---- sampled tokens lie in the set the processors allow -------------------------------------------


def sharp_qwen3():
    """The tiny Qwen3 target with a sharper next-token distribution, so that the sampling
    warpers (top-k, top-p, min-p) cut something."""
    model = qwen3_target(seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model


def allowed_sets(model, prompt, tokens, processors):
    """For every generated token, the tokens ``processors`` leave a finite score at its context,
    from one forward over the whole sequence (the target's one-token logits at each position)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0]
    sets = []
    for i in range(len(tokens)):
        context = torch.tensor([prompt + tokens[:i]])
        scores = logits[len(prompt) - 1 + i][None].float()
        for processor in processors:
            scores = processor(context, scores)
        sets.append(set(torch.nonzero(torch.isfinite(scores[0])).flatten().tolist()))
    return sets


# ---- sampled tokens are distributed as the processed target ---------------------------------------

MARGINAL_PROMPT = [3, 7, 3]
# every setting cuts or reshapes something, and the repetition penalty makes the context matter
MARGINAL_SETTINGS = {
    "temperature": 1.5,
    "top_k": 10,
    "top_p": 0.95,
    "min_p": 0.05,
    "repetition_penalty": 2.0,
}


def marginal_target(vocab=16):
    """A one-layer Llama over a ``vocab`` small enough for exact three-token distributions."""
    model = llama_target(seed=6, vocab_size=vocab, num_hidden_layers=1)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    return model


def chi_square_pvalue(counts, probs):
    """Chi-square goodness of fit of ``counts`` to ``probs``; cells expecting fewer than 5 are
    pooled into one."""
    expected = probs * counts.sum()
    big = expected >= 5
    observed, wanted = counts[big], expected[big]
    if expected[~big].sum() > 0:
        observed = np.append(observed, counts[~big].sum())
        wanted = np.append(wanted, expected[~big].sum())
    return chisquare(observed, wanted * observed.sum() / wanted.sum()).pvalue


def ddtree_first_tokens(model, prompt, samples, verifier_type, seed, policy=("ddtree", {})):
    """``(counts, accepted)``: ``counts[k, t]``, how often token ``k + 1`` of ``samples``
    generations at temperature 1 (seeds ``seed``, ``seed + 1``, ...) was ``t``, each walking a
    DDTree of 12 nodes built from the target's own marginals (an oracle drafter, blocks of 3) on
    ``verifier_type``, or the tree of another ``policy`` (method, options); ``accepted``, the
    draft tokens their first rounds accepted."""
    from caddtree.core.sampling import Sampler
    from oracle import OracleProposer, decode_with

    counts = np.zeros((3, model.config.vocab_size))
    accepted = 0
    for i in range(samples):
        proposer = OracleProposer(model, prompt, block_size=3, mode="target")
        result = decode_with(
            model,
            prompt,
            policy[0],
            {"budget": 12, **policy[1]} if policy[0] == "ddtree" else policy[1],
            proposer,
            4,
            verifier_type=verifier_type,
            sampler=Sampler(1.0, seed=seed + i),
        )
        for k, tok in enumerate(result.token_ids[:3]):
            counts[k, tok] += 1
        accepted += result.stats.per_round[0].accepted
    return counts, accepted


def assert_first_token_marginals(counts, exact):
    """Each of the first three tokens' counts fits its exact marginal in ``exact``, chi-square
    at alpha = 1e-3, where at least 5 tokens expect 5 samples or more."""
    samples = counts[0].sum()
    for k, p in enumerate(exact):
        assert (p.numpy() * samples >= 5).sum() >= 5, k
        assert chi_square_pvalue(counts[k], p.numpy()) > 1e-3, f"token {k + 1}"


def assert_three_token_marginals(model, prompt, counts, reference):
    """``counts[k, t]``: how often generated token ``k + 1`` was ``t``. Each token's marginal must
    fit the exact one under ``reference`` (a :class:`~caddtree.core.sampling.Sampler`) with the right
    context, chi-square at alpha = 1e-3: the third token's context holds the prompt, token 1 and
    the accepted tree node's token 2. The same check must reject two wrong distributions: the
    unprocessed target, and the processed target that forgets the node's own token in the context
    (the repetition penalty's context)."""
    vocab = counts.shape[1]

    def next_token_probs(contexts, processor_contexts=None):
        with torch.no_grad():
            logits = model(torch.tensor(contexts)).logits[:, -1]
        seen = processor_contexts or contexts
        rows = [reference.probabilities(logits[j], seen[j]) for j in range(len(contexts))]
        return torch.stack(rows).double()

    p1 = next_token_probs([prompt])[0]
    p2_given = next_token_probs([[*prompt, a] for a in range(vocab)])  # [a, b]
    pairs = [[*prompt, a, b] for a in range(vocab) for b in range(vocab)]
    p3_given = next_token_probs(pairs)
    p3_forgetful = next_token_probs(
        pairs, [[*prompt, a] for a in range(vocab) for _ in range(vocab)]
    )
    weights = (p1[:, None] * p2_given).reshape(-1)
    exact = [p1, p1 @ p2_given, weights @ p3_given]
    for k, p in enumerate(exact):
        assert (p > 0.01).sum() >= 5, k  # spread over several tokens
        assert chi_square_pvalue(counts[k], p.numpy()) > 1e-3, f"token {k + 1}"
    # the check has teeth
    with torch.no_grad():
        raw = torch.softmax(model(torch.tensor([prompt])).logits[0, -1], -1)
    assert chi_square_pvalue(counts[0], raw.numpy()) < 1e-6
    assert chi_square_pvalue(counts[2], (weights @ p3_forgetful).numpy()) < 1e-6

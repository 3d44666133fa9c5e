"""Why two greedy outputs differ: where a method's output first leaves plain AR decoding's, and
whether the target's margin there is within the rounding of its dtype (``generate --compare-ar``;
see docs/bf16-divergence.md).

:func:`explain_divergence` replays both ways of computing the differing position with a loaded
:class:`~caddtree.api.SpeculativeGenerator` and returns a :class:`Divergence` with a verdict;
:func:`near_tie_threshold` is the largest logit gap that rounding in a dtype can flip.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..core.tree import DraftTree
from ..util.checks import check_int
from ..util.devices import dtype_name
from ..util.errors import InvalidInputError

if TYPE_CHECKING:  # pragma: no cover
    from ..api import SpeculativeGenerator

__all__ = ["NEAR_TIE_ULPS", "Divergence", "explain_divergence", "near_tie_threshold"]

# A gap between two logits below this many units of the dtype's machine epsilon, times the size of
# the top logit, counts as a rounding near-tie. Why: a logit ``x`` is stored with an error of up to
# half an ulp, and an ulp of ``x`` is at most ``eps * |x|`` (eps = 2**-7 for bfloat16, 2**-10 for
# float16). The two forwards being compared (one query token against many) sum the same products in
# different orders and tile the matmuls differently, so the final hidden state and every logit pick
# up a few such rounding errors, independently in each forward: the two top logits can move by a
# few ulps each, in opposite directions. ``4 * eps * |x|`` (four to eight ulps) covers that; for
# bfloat16 at a logit of 20 it is about 0.6, at a logit of 5 about 0.16. A gap above it is more than
# rounding can explain.
NEAR_TIE_ULPS = 4.0

# Lossless decoding in these dtypes must reproduce greedy AR token for token: any difference is
# worth a bug report.
_EXACT_DTYPES = (torch.float32, torch.float64)


def near_tie_threshold(dtype: torch.dtype, top_logit: float) -> float:
    """The largest logit gap that rounding in ``dtype`` can flip (see :data:`NEAR_TIE_ULPS`)."""
    if not dtype.is_floating_point:
        raise InvalidInputError(f"near_tie_threshold needs a floating-point dtype, not {dtype}")
    return NEAR_TIE_ULPS * float(torch.finfo(dtype).eps) * max(abs(float(top_logit)), 1.0)


@dataclass
class Divergence:
    """Where a method's greedy output first leaves plain AR decoding's, and the target's margin there.

    ``position`` indexes the generated tokens (0 = the first token after the prompt). A token is
    ``None`` where that output ended before ``position``. Gaps are in logit units: ``*_top2_gap``
    is the target's top-1 logit minus its top-2 logit, ``ar_pair_gap`` is the AR forward's logit of
    the AR token minus that of the method's token (the margin the method would have had to lose).
    ``ar_*`` come from a one-token, KV-cached forward replayed exactly as AR decoding runs it;
    ``tree_*`` from one forward over the last ``tree_queries`` tokens (the last committed tokens,
    the two candidates and padding nodes, with tree attention over the rest of the context), the
    way verification computes it. The method's actual verification forward had another tree and a
    cache built by other forwards, so the ``tree_*`` numbers show how much the forward's shape
    alone moves the margin; they need not reproduce the flip.
    """

    position: int
    method: str
    ar_token: int | None
    method_token: int | None
    ar_text: str
    method_text: str
    ar_top2_gap: float
    ar_pair_gap: float
    ar_top_logit: float
    ar_replay_token: int  # the AR replay's argmax: ar_token unless the forward is not deterministic
    tree_top2_gap: float
    tree_token: int  # the multi-token forward's argmax at the position
    tree_queries: int
    dtype: str
    threshold: float
    near_tie: bool
    verdict: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """A few lines for a person: the position, the two tokens, the margins and the verdict."""

        def token(tok: int | None, text: str) -> str:
            return "(end of output)" if tok is None else f"{tok} {text!r}"

        pair = ""
        if self.method_token is not None and abs(self.ar_pair_gap - self.ar_top2_gap) > 1e-12:
            pair = f" (AR's token over {self.method}'s: {self.ar_pair_gap:.4g})"
        if self.tree_token == self.method_token:
            picks = f"it picks {self.method}'s token"
        elif self.tree_token == self.ar_token:
            picks = "it picks AR's token"
        else:
            picks = f"it picks {self.tree_token}"
        lines = [
            f"first difference at generated token {self.position}: AR chose "
            f"{token(self.ar_token, self.ar_text)}, {self.method} chose "
            f"{token(self.method_token, self.method_text)}",
            f"target's top-2 logit gap there: {self.ar_top2_gap:.4g} in AR's one-token forward"
            f"{pair}, {self.tree_top2_gap:.4g} in a {self.tree_queries}-token forward like "
            f"verification's ({picks}); {self.dtype} rounding reaches about "
            f"{self.threshold:.3g} at logit {self.ar_top_logit:.4g}",
        ]
        if self.ar_replay_token != self.ar_token:
            lines.append(
                f"note: replaying AR picked {self.ar_replay_token}, not {self.ar_token}: the "
                "target's forward is not deterministic on this device"
            )
        lines.append(self.verdict)
        return "\n".join(lines)


def _top2(logits: torch.Tensor) -> tuple[float, float]:
    """(top-1 logit, top-1 minus top-2) of a 1D row of logits, in float64."""
    top = torch.topk(logits.double(), 2).values
    return float(top[0]), float(top[0] - top[1])


def explain_divergence(
    gen: SpeculativeGenerator,
    prompt_ids: Sequence[int],
    ar_ids: Sequence[int],
    method_ids: Sequence[int],
    *,
    method: str = "method",
    window: int = 16,
    tree_nodes: int | None = None,
) -> Divergence | None:
    """Explain why ``method_ids`` (a method's greedy output) differs from ``ar_ids`` (plain AR's).

    Returns ``None`` when the two are identical. Otherwise takes the common prefix (``prompt_ids``
    plus the agreed generated tokens) and runs ``gen``'s target on it twice:

    * the AR way: prefill the prompt, then one KV-cached forward per agreed token, exactly as
      :func:`caddtree.engine.decoding.decode` runs AR (so it costs as many forwards as the agreed tokens);
    * the verification way: prefill all but the last ``window`` tokens of the prefix, then one
      tree-attention forward over those ``window`` tokens as a chain with the two differing tokens
      (and padding nodes up to ``tree_nodes`` nodes, e.g. the method's mean tree size) hanging
      below it.

    and reports the target's top-2 logit gap at the first differing position in each, with a
    verdict: in float32/float64 any difference is a likely bug; in bfloat16/float16 a gap within
    :func:`near_tie_threshold` is a rounding near-tie, anything larger a real discrepancy.
    Leaves ``gen``'s KV cache empty.
    """
    prompt = [int(t) for t in prompt_ids]
    ar, other = [int(t) for t in ar_ids], [int(t) for t in method_ids]
    if not prompt:
        raise InvalidInputError("the prompt is empty; give at least one token")
    check_int("window", window)
    if ar == other:
        return None
    position, ar_token, method_token = _first_difference(ar, other)
    context = prompt + ar[:position]
    verifier = gen.verifier
    try:
        row = _replay_ar(verifier, prompt, ar[:position])
        ar_top, ar_gap = _top2(row)
        ar_replay = int(torch.argmax(row))
        pair_gap = ar_gap
        if ar_token is not None and method_token is not None:
            pair_gap = float(row[ar_token].double() - row[method_token].double())
        candidates = [t for t in (ar_token, method_token) if t is not None]
        tree_row, tree_queries = _replay_verification(
            verifier, context, candidates, int(row.shape[-1]), window, tree_nodes
        )
        _, tree_gap = _top2(tree_row)
        tree_token = int(torch.argmax(tree_row))
    finally:
        verifier.reset()

    dtype = verifier.dtype
    name = dtype_name(dtype)
    threshold = near_tie_threshold(dtype, ar_top)
    near_tie, verdict = _verdict(dtype, method, pair_gap, threshold)
    return Divergence(
        position=position,
        method=method,
        ar_token=ar_token,
        method_token=method_token,
        ar_text=_token_text(gen.tokenizer, ar_token),
        method_text=_token_text(gen.tokenizer, method_token),
        ar_top2_gap=ar_gap,
        ar_pair_gap=pair_gap,
        ar_top_logit=ar_top,
        ar_replay_token=ar_replay,
        tree_top2_gap=tree_gap,
        tree_token=tree_token,
        tree_queries=tree_queries,
        dtype=name,
        threshold=threshold,
        near_tie=near_tie,
        verdict=verdict,
    )


def _first_difference(ar: list[int], other: list[int]) -> tuple[int, int | None, int | None]:
    """Where two outputs first differ, and their tokens there (``None`` past an output's end)."""
    position = next(
        (i for i, (a, b) in enumerate(zip(ar, other)) if a != b), min(len(ar), len(other))
    )
    ar_token = ar[position] if position < len(ar) else None
    return position, ar_token, other[position] if position < len(other) else None


def _token_text(tokenizer: Any, token: int | None) -> str:
    return "" if token is None or tokenizer is None else tokenizer.decode([token])


def _replay_ar(verifier: Any, prompt: list[int], agreed: list[int]) -> torch.Tensor:
    """The target's logits for the token after ``prompt + agreed``, computed the AR way: a
    prefill, then one KV-cached forward per agreed token, as decode() runs AR."""
    verifier.reset()
    row, _ = verifier.prefill(prompt)
    for tok in agreed:
        logits, _ = verifier.verify(tok, DraftTree.empty())
        row = logits[0]
        verifier.commit([])
    return row


def _replay_verification(
    verifier: Any,
    context: list[int],
    candidates: list[int],
    vocab: int,
    window: int,
    tree_nodes: int | None,
) -> tuple[torch.Tensor, int]:
    """The target's logits for the token after ``context``, computed the verification way: many
    query tokens in one forward, over a multi-token prefill. Returns them and the number of
    query tokens."""
    verifier.reset()
    start = max(0, len(context) - window)
    if start > 0:
        verifier.prefill(context[:start])
    chain = context[start + 1 :]
    want = max(len(chain) + len(candidates), min(int(tree_nodes or 0), 1024))
    n_padding = max(0, want - len(chain) - len(candidates))
    padding = (t for t in range(vocab) if t not in candidates)
    below = candidates + list(itertools.islice(padding, n_padding))
    n_chain = len(chain)
    tree = DraftTree(
        token_ids=chain + below,
        parents=list(range(-1, n_chain - 1)) + [n_chain - 1] * len(below),
        depths=list(range(1, n_chain + 1)) + [n_chain + 1] * len(below),
        log_probs=[0.0] * (n_chain + len(below)),
    )
    logits, _ = verifier.verify(context[start], tree)
    return logits[n_chain], len(tree) + 1  # the row after the bonus and the whole chain


def _verdict(
    dtype: torch.dtype, method: str, pair_gap: float, threshold: float
) -> tuple[bool, str]:
    """Whether the gap is a rounding near-tie in ``dtype``, and the verdict to print."""
    name = dtype_name(dtype)
    if dtype in _EXACT_DTYPES:
        return False, (
            f"likely a bug: in {name} {method} must reproduce AR token for token; please report "
            "it with the prompt, models and this output"
        )
    if abs(pair_gap) <= threshold:
        return True, (
            f"{name} near-tie: not a bug (the two forwards round differently and the two tokens "
            "are within rounding of each other; see docs/bf16-divergence.md)"
        )
    return False, (
        f"real discrepancy: the gap is larger than {name} rounding explains; please report it "
        "with the prompt, models and this output"
    )

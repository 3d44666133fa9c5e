"""The Python API: load a target and a DFlash drafter once, then generate with any method.

gen = SpeculativeGenerator.from_pretrained("Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16",
                                           dtype="bfloat16", device="cuda")
out = gen.generate("Prove that sqrt(2) is irrational.", method="caddtree",
                   cost_model="cost.json", max_new_tokens=512)
print(out.text, out.stats.tau, out.stats.ms_per_token)

:class:`SpeculativeGenerator` is a facade: loading is :mod:`caddtree.loading`, cost models are
:mod:`caddtree.profiles`, requests are :mod:`caddtree.engine.requests` and decoding is
:mod:`caddtree.engine.decoding`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from . import profiles
from .core.copies import CopyRates
from .core.cost import CostModel, load_cost_model
from .core.tree import DraftTree
from .engine.decoding import GenerationResult, RoundStats, TreePolicy, decode, make_policy
from .engine.requests import (
    GenerationRequest,
    RequestSettings,
    build_request,
    draft_block,
    encode_prompt,
)
from .engine.tokens import chat_template_ids, eos_token_ids, stop_string_criterion
from .loading import build_runtime, checked_context_window, load_pair, release_caches
from .util.checks import check_int, check_runtime, check_tree_budgets
from .util.devices import dtype_name
from .util.errors import InvalidInputError

if TYPE_CHECKING:
    from .engine.batch_cost import BatchCostModel
    from .models.dflash import DFlashDraftModel

__all__ = [
    "GenerationResult",
    "SpeculativeGenerator",
    "chat_template_ids",
    "eos_token_ids",
    "stop_string_criterion",
]

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int] | Sequence[dict[str, str]]
"""Text, chat messages or token ids (:meth:`SpeculativeGenerator.encode`)."""


def _as_cost_model(value: CostModel | str | os.PathLike[str] | None) -> CostModel | None:
    """A cost model given as one, or as a file to read."""
    return value if value is None or isinstance(value, CostModel) else load_cost_model(value)


class SpeculativeGenerator:
    """A target model, its tokenizer and (optionally) a DFlash drafter, ready to generate with any
    method (:data:`caddtree.util.checks.METHODS`; ``ar`` and ``lookup`` need no drafter), losslessly: the
    output is plain greedy decoding's at temperature 0, and the target's distribution above.
    ``runtime`` (:func:`caddtree.loading.runtime_choice`; ``self.runtime`` says which ran):
    ``"auto"`` is caddtree's own forward (:mod:`caddtree.runtime`) on the CPU where it runs the
    model, compiled where that wins, else transformers'. ``pack_weights``: lay the CPU's linear
    weights out once (:func:`caddtree.loading.packed_layer_count`; ``packed_layers``)."""

    def __init__(
        self,
        target: Any,
        tokenizer: Any = None,
        drafter: DFlashDraftModel | None = None,
        *,
        cost_model: CostModel | str | os.PathLike[str] | None = None,
        context_window: int | None = None,
        pack_weights: bool = True,
        runtime: str = "auto",
        blocks: dict[str, Any] | None = None,
    ):
        check_runtime(runtime)
        self.target, self.tokenizer = target.eval(), tokenizer
        self.drafter = drafter.eval() if drafter is not None else None
        parts = build_runtime(self.target, self.drafter, runtime, pack_weights, blocks)
        self.proposer, self.verifier, self.packed_layers = parts
        self.runtime = self.verifier.runtime
        lean = getattr(self.verifier, "target", None)
        self.weight_format = getattr(lean, "weight_format", dtype_name(self.verifier.dtype))
        if context_window is not None:
            self.set_context_window(context_window)
        self.cost_model = _as_cost_model(cost_model)
        self.copy_rates = CopyRates()  # copies' acceptance, pooled over this generator's calls

    def set_context_window(self, positions: int) -> None:
        """Let a generation's prompt and output together hold up to ``positions`` tokens (default:
        the model's ``max_position_embeddings``); positions past the trained ones are
        extrapolated, with a warning (:func:`caddtree.loading.context_window`)."""
        self.verifier.max_positions = checked_context_window(self.target, positions)

    @classmethod
    def from_pretrained(
        cls,
        target: str | os.PathLike[str],
        draft: str | os.PathLike[str] | None = None,
        *,
        dtype: str | torch.dtype | None = "auto",
        device: str | torch.device | None = None,
        cost_model: CostModel | str | os.PathLike[str] | None = None,
        gguf_file: str | None = None,
        context_window: int | None = None,
        pack_weights: bool = True,
        runtime: str = "auto",
        dequantize: bool = False,
        draft_dtype: str | torch.dtype | None = "same",
        **target_kwargs: Any,
    ) -> SpeculativeGenerator:
        """Load a transformers causal LM (a directory or hub id, or ``gguf_file``), its tokenizer
        and a DFlash drafter in the released format (``draft``; optional for ``ar``); see
        :func:`caddtree.loading.load_pair`. A GGUF target's quantized weights run as the file
        holds them on the lean runtimes where the kernels compute them (``dequantize``: as
        bfloat16; ``weight_format`` says which ran), and ``dtype="auto"`` is then bfloat16 on the
        CPU. ``draft_dtype``: the drafter's, ``"same"`` as the target, ``"auto"`` bfloat16 beside
        a float32 target on a CPU with AVX512-BF16 (:func:`caddtree.util.devices.
        resolve_draft_dtype`), or a dtype; the output is the target's whichever it is.
        ``context_window``: :meth:`set_context_window`; the rest: the class docstring."""
        check_int("context_window", context_window, minimum=2, allow_none=True)  # before loading
        check_runtime(runtime)
        load = dict(dtype=dtype, device=device, gguf_file=gguf_file, dequantize=dequantize)
        load["draft_dtype"] = draft_dtype
        pair = load_pair(target, draft, runtime=runtime, **load, **target_kwargs)
        options = dict(cost_model=cost_model, context_window=context_window, runtime=runtime)
        gen = cls(*pair[:3], pack_weights=pack_weights, blocks=pair.blocks, **options)
        if pair.blocks and gen.runtime != "transformers":
            gen.verifier.target.release_quantized_sources()  # their blocks run instead
        gen.source = pair.source
        return gen

    # ---- cost models (caddtree.profiles) --------------------------------------------------------

    def profile(self, **kwargs: Any) -> CostModel:
        """Measure this pair on this machine and fit a cost model (``kwargs``: the grid, trials)."""
        return profiles.profile_generator(self, **kwargs)

    def cached_cost_model(
        self, cache_dir: str | os.PathLike[str] | None = None, **kwargs: Any
    ) -> CostModel:
        """This pair's cost model on this machine, from the cache or profiled once and cached."""
        return profiles.cached_cost_model(self, cache_dir, **kwargs)

    def cached_batch_cost_model(
        self, max_batch: int, cache_dir: str | os.PathLike[str] | None = None
    ) -> BatchCostModel:
        """The batch cost model of rounds of 1 to ``max_batch`` requests, cached likewise."""
        return profiles.cached_batch_cost_model(self, max_batch, cache_dir)

    # ---- requests (caddtree.engine.requests) ----------------------------------------------------

    def encode(self, prompt: Any, chat: bool | None = None, chat_template_kwargs: Any = None):
        """Token ids of ``prompt``: text (in the chat template unless ``chat=False``), chat
        messages, or token ids as they are (:func:`caddtree.engine.requests.encode_prompt`)."""
        return encode_prompt(self.tokenizer, self._vocab(), prompt, chat, chat_template_kwargs)

    def default_stop_token_ids(self) -> set[int]:
        """EOS from the tokenizer and from the target's generation config."""
        return eos_token_ids(self.tokenizer, self.target)

    def policy(
        self,
        method: str,
        *,
        budget: int | None = None,
        cost_model: CostModel | str | os.PathLike[str] | None = None,
        max_budget: int = 1024,
        profile: bool = False,
        lookup: bool = False,
        gate: bool | None = None,
    ) -> TreePolicy:
        """The tree policy of ``method`` with its budgets checked against the drafter's block.
        CaDDTree's cost model is ``cost_model`` (a model or a file), else this generator's; with
        ``profile``, one is loaded from the cache or profiled when neither is set. ``lookup``:
        copies from the context join the trees; ``gate``: CaDDTree drafts only where it pays
        (:func:`caddtree.engine.decoding.make_policy`)."""
        given = _as_cost_model(cost_model)  # a file is read (and checked) whatever the method
        cost = (given or self.cost_model) if method == "caddtree" else None
        if method == "caddtree" and cost is None and profile:
            cost = self.cost_model = self.cached_cost_model()
        block = draft_block(self.proposer, self._vocab())
        max_budget = check_tree_budgets(method, budget, max_budget, **block)
        limits = dict(budget=budget, cost_model=cost, max_budget=max_budget, lookup=lookup)
        return make_policy(method, gate=gate, **limits)

    def request(
        self, prompt: Prompt, method: str = "caddtree", **settings: Any
    ) -> GenerationRequest:
        """The checked request of :meth:`generate`'s arguments (:class:`RequestSettings`), for
        :meth:`generate` or a :class:`~caddtree.engine.batching.BatchDecoder`."""
        s = RequestSettings.of(settings, caller=f"{type(self).__name__}.request")
        limits = dict(budget=s.budget, cost_model=s.cost_model, max_budget=s.max_budget)
        policy = self.policy(method, lookup=s.lookup, gate=s.gate, **limits)
        if policy.needs_drafter and self.proposer is None:
            raise InvalidInputError(
                f"method {method!r} needs a DFlash drafter; load one (draft=...) or use method='ar'"
            )
        encode = partial(self.encode, prompt, s.chat, s.chat_template_kwargs)
        model = dict(tokenizer=self.tokenizer, vocab=self._vocab(), device=self.verifier.device)
        return build_request(
            policy, s, encode, default_stops=self.default_stop_token_ids(), **model
        )

    def _vocab(self) -> int:
        return int(self.target.config.get_text_config().vocab_size)

    # ---- decoding (caddtree.engine.decoding) ----------------------------------------------------

    def generate(
        self,
        prompt: Prompt,
        method: str = "caddtree",
        *,
        callback: Callable[[RoundStats | None, list[int]], Any] | None = None,
        tree_callback: Callable[[DraftTree, RoundStats], Any] | None = None,
        **settings: Any,
    ) -> GenerationResult:
        """Generate a continuation of ``prompt`` (:func:`caddtree.engine.decoding.decode`, whose
        ``callback`` and ``tree_callback`` these are). ``settings``: :class:`RequestSettings`
        (budgets, sampling as transformers' ``generate``: ``temperature=0`` is greedy, stops)."""
        request = self.request(prompt, method, **settings)
        hooks = {"callback": callback, "tree_callback": tree_callback}
        result = self.decode(
            request.prompt_ids, request.policy, **request.decode_settings(), **hooks
        )
        if self.tokenizer is not None:
            result.text = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        return result

    def decode(
        self, prompt_ids: Sequence[int], policy: TreePolicy, **kwargs: Any
    ) -> GenerationResult:
        """:func:`caddtree.engine.decoding.decode` of ``prompt_ids`` on this generator's target and
        drafter (keyword arguments as there), without text; the caches are let go afterwards
        (:func:`caddtree.loading.release_caches`)."""
        kwargs.setdefault("copy_rates", self.copy_rates)
        try:
            return decode(self.verifier, prompt_ids, policy, proposer=self.proposer, **kwargs)
        finally:
            release_caches(self.verifier, self.proposer)

"""caddtree inside transformers' ``generate``: ``custom_generate=caddtree.hf.generate``.

transformers 5 lets ``model.generate`` hand its prepared inputs, logits processors and stopping
criteria to a callable of ours; :func:`generate` decodes with a DFlash drafter and draft trees and
returns what ``generate`` returns::

    import caddtree.hf
    from caddtree import DFlashDraftModel
    from transformers import TextStreamer

    drafter = DFlashDraftModel.from_pretrained("z-lab/Qwen3-4B-DFlash-b16", dtype=model.dtype)
    out = model.generate(
        **inputs,                                # one prompt, no padding
        custom_generate=caddtree.hf.generate,
        assistant_model=drafter.to(model.device),
        method="caddtree",                       # or "ar", "dflash", "ddtree" (with budget=64)
        cost_model="cost.json",                  # None: profiled once per machine, then cached
        max_new_tokens=256,
        do_sample=True, temperature=0.7, top_p=0.9,
        streamer=TextStreamer(tokenizer, skip_prompt=True),
    )

What ``generate`` prepares is honoured: the logits processors (repetition penalty, temperature,
top-k, top-p, min-p, ...) choose the target's token at every tree node with that node's own path as
context, so greedy output is ``generate``'s token for token and sampled output has its distribution;
the stopping criteria (``max_new_tokens``, EOS, ``max_time``, your own) end the output where
``generate`` would, the EOS token kept. With ``return_dict_in_generate=True`` the result is a
:class:`CaddtreeGenerateOutput`: ``generate``'s ``sequences``, ``scores`` (``output_scores``) and
``logits`` (``output_logits``), plus the decoding statistics in ``caddtree``
(:class:`~caddtree.engine.decoding.GenerationStats`). Sampling draws from torch's global random number
generator, as ``generate`` does (``torch.manual_seed`` makes it reproducible).

Not supported, each refused with a clear error rather than ignored: a batch of several prompts
(call ``generate`` once per prompt), padding, ``num_beams > 1``, ``num_return_sequences > 1``,
``output_attentions`` / ``output_hidden_states``, ``inputs_embeds`` and a pre-filled KV cache
(``cache``, called ``past_key_values`` before transformers 5.24). The returned output holds no
cache.

Stop strings: transformers 5 (checked with 5.23) does not pass ``tokenizer=`` on to a callable
``custom_generate``, so ``stop_strings=`` cannot be built into a criterion there; give them as a
criterion, ``stopping_criteria=StoppingCriteriaList([StopStringCriteria(tokenizer, [...])])``.

The target's verifier and the drafter's proposer are built once per model and drafter and reused
by later calls (not from several threads at once); their KV caches are emptied after every call.
"""

from __future__ import annotations

import inspect
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
from transformers import EosTokenCriteria, MaxLengthCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerationMixin

from .api import SpeculativeGenerator, stop_string_criterion
from .core.cost import CostModel
from .core.sampling import Sampler
from .engine.decoding import GenerationStats
from .models.target import CACHE_ARGUMENTS
from .util.checks import DEFAULT_DDTREE_BUDGET, DRAFTLESS_METHODS, check_method, check_stop
from .util.errors import InvalidInputError

__all__ = ["DEFAULT_DDTREE_BUDGET", "CaddtreeGenerateOutput", "generate"]


# model_kwargs that generate() prepares for every decoder-only call and that need nothing from us
_PREPARED_KWARGS = frozenset(
    {"attention_mask", "position_ids", "logits_to_keep", *CACHE_ARGUMENTS, "use_cache"}
)


@dataclass
class CaddtreeGenerateOutput(GenerateDecoderOnlyOutput):
    """``generate``'s output (``sequences``, and ``scores`` / ``logits`` when asked for) plus
    ``caddtree``: the statistics of the generation (:class:`~caddtree.engine.decoding.GenerationStats`:
    ``tau``, ``stop_reason``, timings, per-round details)."""

    caddtree: GenerationStats | None = None


def _generate_call_arguments(model: Any) -> dict[str, Any]:
    """``assistant_model`` and ``streamer`` as given to the ``model.generate`` call that is running
    :func:`generate`.

    Works around transformers 5 (checked with 5.23): for a callable ``custom_generate``,
    ``GenerationMixin._extract_generation_mode_kwargs`` replaces its dict of generation-mode
    arguments with just the keyword arguments whose names the callable adds to
    ``GenerationMixin._sample``'s, taken from ``**kwargs``. ``assistant_model`` and ``streamer``
    are named parameters of ``generate``, not ``**kwargs``, so they never reach the callable
    (although ``generate`` has already called ``streamer.put(prompt_ids)``). They are still local
    variables of that ``generate`` call: this reads them from its frame, the nearest caller frame
    running ``GenerationMixin.generate``'s code (its decorators unwrapped) on ``model``. Fails
    soft: without such a frame (:func:`generate` called directly, or another transformers) it
    returns ``{}``.
    """
    try:
        code = inspect.unwrap(GenerationMixin.generate).__code__
    except AttributeError:  # pragma: no cover - another transformers
        return {}
    frame = sys._getframe(1)
    try:
        while frame is not None:
            if frame.f_code is code:
                local = frame.f_locals
                if local.get("self") is not model:
                    return {}
                return {name: local.get(name) for name in ("assistant_model", "streamer")}
            frame = frame.f_back
        return {}
    finally:
        del frame


class _GeneratorSlot:
    """Where a model keeps its :class:`SpeculativeGenerator` for :func:`generate`. An attribute of
    the model rather than a module-level weak dictionary, because the generator refers to the
    model (a weak key would never die); copies and pickles of the model get an empty slot."""

    def __init__(self) -> None:
        self.generator: SpeculativeGenerator | None = None

    def __deepcopy__(self, memo: dict[int, Any]) -> _GeneratorSlot:
        return _GeneratorSlot()

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return (_GeneratorSlot, ())


_SLOT = "_caddtree_generator_slot"


def _generator(model: Any, drafter: Any) -> SpeculativeGenerator:
    """The :class:`SpeculativeGenerator` of ``model`` and ``drafter`` (``None``: any drafter will
    do, for AR), built on first use and kept on the model until another drafter is used."""
    slot = model.__dict__.get(_SLOT)
    if not isinstance(slot, _GeneratorSlot):
        slot = _GeneratorSlot()
        model.__dict__[_SLOT] = slot
    gen = slot.generator
    if (
        gen is None
        or gen.target is not model
        or (drafter is not None and gen.drafter is not drafter)
    ):
        gen = slot.generator = SpeculativeGenerator(model, None, drafter)
    return gen


def _drafter(drafter: Any, assistant_model: Any) -> Any:
    """The DFlash drafter, from ``drafter=`` or ``assistant_model=`` (``None``: none given)."""
    from .models import DFlashDraftModel

    if drafter is not None and assistant_model is not None and drafter is not assistant_model:
        raise InvalidInputError(
            "two different drafters were given, drafter= and assistant_model=; give one of them"
        )
    chosen = drafter if drafter is not None else assistant_model
    if chosen is not None and not isinstance(chosen, DFlashDraftModel):
        raise InvalidInputError(
            "caddtree drafts with a DFlash drafter: assistant_model= (or drafter=) must be a "
            f"caddtree.DFlashDraftModel, got a {type(chosen).__name__}"
        )
    return chosen


def _check_request(input_ids: Any, config: Any, model_kwargs: dict[str, Any]) -> None:
    """Refuse, with the fix in the message, what :func:`generate` cannot do and ``generate``'s own
    loop would: several sequences, padding, beams, attentions and hidden states, other inputs."""
    if (getattr(config, "num_beams", 1) or 1) > 1:
        raise InvalidInputError(
            f"caddtree does not do beam search (num_beams={config.num_beams}); leave num_beams at 1"
        )
    if (getattr(config, "num_return_sequences", 1) or 1) > 1:
        raise InvalidInputError(
            f"caddtree returns one sequence per call (num_return_sequences="
            f"{config.num_return_sequences}); call generate once per sequence wanted"
        )
    for flag in ("output_attentions", "output_hidden_states"):
        if getattr(config, flag, False):
            raise InvalidInputError(
                f"{flag}=True is not supported by caddtree (tree verification computes them for "
                "draft nodes, not per generated token); leave it out"
            )
    if model_kwargs.get("inputs_embeds") is not None:
        raise InvalidInputError("caddtree needs input_ids, not inputs_embeds")
    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        batch = input_ids.shape[0] if input_ids.ndim == 2 else "not 2-D"
        raise InvalidInputError(
            f"caddtree decodes one prompt at a time (batch size 1), got input_ids of shape "
            f"{tuple(input_ids.shape)} (batch {batch}); call generate once per prompt"
        )
    mask = model_kwargs.get("attention_mask")
    if mask is not None and bool((torch.as_tensor(mask) == 0).any()):
        raise InvalidInputError(
            "the attention mask has zeros (padding), which caddtree does not support; pass the "
            "prompt without padding (an attention mask of all ones, or none)"
        )
    for name in CACHE_ARGUMENTS:
        cache = model_kwargs.get(name)
        if cache is not None and (
            not hasattr(cache, "get_seq_length") or cache.get_seq_length() > 0
        ):
            raise InvalidInputError(
                f"caddtree keeps its own KV cache and cannot continue from a filled {name}; "
                "leave it out"
            )
    other = sorted(
        k for k, v in model_kwargs.items() if v is not None and k not in _PREPARED_KWARGS
    )
    if other:
        hint = ""
        if any(hasattr(config, k) for k in other):  # generation settings, in a direct call
            hint = "; called directly, it takes generation settings in generation_config="
        raise InvalidInputError(
            f"caddtree.hf.generate does not support the model inputs {', '.join(other)}; "
            f"it takes input_ids (and an all-ones attention_mask) only{hint}"
        )


def _token_set(value: Any) -> set[int]:
    """Token ids from an int, a list of ints or a tensor (``None``: none)."""
    if value is None:
        return set()
    if isinstance(value, torch.Tensor):
        return {int(t) for t in value.reshape(-1).tolist()}
    if isinstance(value, (list, tuple, set)):
        return {int(t) for t in value}
    return {int(value)}


def generate(
    model: Any,
    input_ids: torch.LongTensor,
    logits_processor: Any = None,
    stopping_criteria: Any = None,
    generation_config: Any = None,
    assistant_model: Any = None,
    streamer: Any = None,
    method: str = "caddtree",
    budget: int | None = None,
    cost_model: CostModel | str | os.PathLike[str] | None = None,
    max_budget: int = 1024,
    drafter: Any = None,
    stop_strings: str | list[str] | None = None,
    tokenizer: Any = None,
    **model_kwargs: Any,
) -> torch.LongTensor | CaddtreeGenerateOutput:
    """Decode one prompt with ``method``; ``model.generate(custom_generate=generate)`` calls it.

    ``model`` is the target, ``input_ids`` one prompt ``[1, T]``; ``logits_processor``,
    ``stopping_criteria`` and ``generation_config`` are what ``generate`` prepared (called
    directly, ``generation_config`` defaults to the model's). ``method`` is one of ``ar``,
    ``dflash``, ``ddtree`` (``budget`` nodes, default :data:`DEFAULT_DDTREE_BUDGET`) and
    ``caddtree`` (``cost_model``: a :class:`~caddtree.core.cost.CostModel` or a file; ``None`` takes
    :meth:`SpeculativeGenerator.cached_cost_model`, profiled once per machine; trees of at most
    ``max_budget`` nodes). Every method but ``ar`` needs the DFlash drafter, given to ``generate``
    as ``assistant_model=`` or here as ``drafter=``. ``streamer`` receives the new tokens after
    every round and ``end()`` at the end. ``stop_strings`` need ``tokenizer``, which transformers 5
    does not pass on (see the module's docstring). Returns ``[1, T + new]`` token ids, or with
    ``return_dict_in_generate`` a :class:`CaddtreeGenerateOutput`.
    """
    passed_on = _generate_call_arguments(model)
    if assistant_model is None:
        assistant_model = passed_on.get("assistant_model")
    if streamer is None:
        streamer = passed_on.get("streamer")
    try:
        with torch.no_grad():
            return _generate(
                model,
                input_ids,
                logits_processor,
                stopping_criteria,
                generation_config,
                _drafter(drafter, assistant_model),
                streamer,
                method,
                budget,
                cost_model,
                max_budget,
                stop_strings,
                tokenizer,
                model_kwargs,
            )
    finally:
        if streamer is not None:
            streamer.end()


def _generate(
    model: Any,
    input_ids: torch.Tensor,
    logits_processor: Any,
    stopping_criteria: Any,
    config: Any,
    drafter: Any,
    streamer: Any,
    method: str,
    budget: int | None,
    cost_model: Any,
    max_budget: int,
    stop_strings: Any,
    tokenizer: Any,
    model_kwargs: dict[str, Any],
) -> torch.LongTensor | CaddtreeGenerateOutput:
    if config is None:
        config = model.generation_config
    _check_request(input_ids, config, model_kwargs)
    stops = _check_method_and_stops(method, drafter, stop_strings, tokenizer)
    prompt = [int(t) for t in input_ids[0].tolist()]
    max_new_tokens, stop_ids, criteria = _stopping(
        config, len(prompt), stopping_criteria, tokenizer, stops
    )

    gen = _generator(model, drafter)
    if method == "ddtree" and budget is None:
        budget = DEFAULT_DDTREE_BUDGET
    policy = gen.policy(
        method, budget=budget, cost_model=cost_model, max_budget=max_budget, profile=True
    )
    sampler = Sampler.from_processors(logits_processor, do_sample=bool(config.do_sample))

    want_scores = bool(getattr(config, "output_scores", False))
    want_logits = bool(getattr(config, "output_logits", False))
    rows: list[torch.Tensor] = []

    def put(_stats: Any, tokens: list[int]) -> None:
        streamer.put(torch.tensor(tokens, dtype=torch.long))

    result = gen.decode(
        prompt,
        policy,
        max_new_tokens=max_new_tokens,
        sampler=sampler,
        stop_token_ids=stop_ids,
        stopping_criteria=criteria,
        callback=put if streamer is not None else None,
        logits_callback=rows.append if want_scores or want_logits else None,
    )

    new = torch.tensor([result.token_ids], dtype=input_ids.dtype, device=input_ids.device)
    sequences = torch.cat([input_ids, new], dim=1)
    if not getattr(config, "return_dict_in_generate", False):
        return sequences
    scores = logits = None
    if rows:
        raw = torch.cat(rows).to(device=input_ids.device)
        if want_logits:
            logits = tuple(row.float()[None] for row in raw)
        if want_scores:
            scores = tuple(
                sampler.scores(row, sequences[:, : len(prompt) + j])[None]
                for j, row in enumerate(raw)
            )
    return CaddtreeGenerateOutput(
        sequences=sequences, scores=scores, logits=logits, caddtree=result.stats
    )


def _check_method_and_stops(
    method: str, drafter: Any, stop_strings: Any, tokenizer: Any
) -> list[str]:
    """Check ``method`` (and that it has the drafter it needs) and the stop strings (and that
    there is a tokenizer for them); returns the stop strings as a list."""
    check_method(method)
    if method not in DRAFTLESS_METHODS and drafter is None:
        raise InvalidInputError(
            f"method {method!r} needs a DFlash drafter: pass assistant_model=drafter (a "
            "caddtree.DFlashDraftModel) to generate, or use method='ar'"
        )
    stops = check_stop(stop_strings)
    if stops and tokenizer is None:
        raise InvalidInputError(
            "stop_strings need the tokenizer, and transformers does not pass tokenizer= on to a "
            "custom_generate callable; give them as stopping_criteria=StoppingCriteriaList("
            "[StopStringCriteria(tokenizer, stop_strings)]) instead"
        )
    return stops


def _stopping(
    config: Any, prompt_len: int, stopping_criteria: Any, tokenizer: Any, stops: list[str]
) -> tuple[int, set[int], list[Any]]:
    """(max new tokens, stop token ids, other criteria) from the config and the stopping
    criteria. Length and EOS are handled by the loop itself (so stop_reason says which), other
    criteria (stop strings, max_time, the caller's) checked after every token as generate does."""
    limit = config.max_length
    if getattr(config, "max_new_tokens", None) is not None:
        limit = prompt_len + config.max_new_tokens
    stop_ids = _token_set(getattr(config, "eos_token_id", None))
    criteria = [stop_string_criterion(tokenizer, stops)] if stops else []
    for criterion in stopping_criteria or ():
        if isinstance(criterion, MaxLengthCriteria):
            limit = min(limit, criterion.max_length) if limit is not None else criterion.max_length
        elif isinstance(criterion, EosTokenCriteria):
            stop_ids |= _token_set(criterion.eos_token_id)
        else:
            criteria.append(criterion)
    if limit is None:
        raise InvalidInputError("give max_new_tokens (or max_length) to bound the generation")
    max_new_tokens = limit - prompt_len
    if max_new_tokens < 1:
        raise InvalidInputError(
            f"the prompt has {prompt_len} tokens and max_length is {limit}: nothing to generate; "
            "raise max_new_tokens"
        )
    return max_new_tokens, stop_ids, criteria

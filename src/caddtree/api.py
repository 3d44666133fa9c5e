"""The Python API: load a target and a DFlash drafter once, then generate with any method.

gen = SpeculativeGenerator.from_pretrained("Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16",
                                           dtype="bfloat16", device="cuda")
out = gen.generate("Prove that sqrt(2) is irrational.", method="caddtree",
                   cost_model="cost.json", max_new_tokens=512)
print(out.text, out.stats.tau, out.stats.ms_per_token)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .core.cost import CostModel, load_cost_model
from .core.sampling import Sampler
from .core.tree import DraftTree
from .engine.decoding import (
    GenerationResult,
    RoundStats,
    TreePolicy,
    criteria_list,
    decode,
    make_policy,
)
from .engine.requests import GenerationRequest
from .engine.tokens import chat_template_ids, eos_token_ids, stop_string_criterion
from .models.gguf_blocks import gguf_location, gguf_source, quantized_blocks
from .util.checks import (
    chat_messages,
    check_chat_template_kwargs,
    check_int,
    check_runtime,
    check_stop,
    check_text,
    check_tree_budgets,
    token_ids,
)
from .util.devices import (
    CPU_SLOW_HALF,
    dtype_name,
    machine_description,
    resolve_device,
    resolve_dtype,
)
from .util.errors import CheckpointError, InvalidInputError

if TYPE_CHECKING:
    from .engine.batch_cost import BatchCostModel
    from .models.dflash import DFlashDraftModel

# The model layer (transformers) is imported where a model is built, not here.

__all__ = [
    "GenerationResult",
    "SpeculativeGenerator",
    "chat_template_ids",
    "eos_token_ids",
    "stop_string_criterion",
]

logger = logging.getLogger(__name__)

# A generation that reached this many positions hands the heap memory it freed back (on the CPU)
LONG_CONTEXT = 2048


SLOW_PROFILE_S = 300.0
"""A first-use profile estimated to take longer than this (seconds) comes with a hint how to
avoid it."""


def _no_template_kwargs(kwargs: dict[str, Any], why: str) -> None:
    """Refuse chat-template arguments where no chat template is applied: they would be lost."""
    if kwargs:
        raise InvalidInputError(
            f"chat_template_kwargs ({', '.join(sorted(kwargs))}) only apply with the chat "
            f"template, and {why}; leave them out, or give text or chat messages with chat=True"
        )


def runtime_choice(runtime: str, device_type: str, unsupported: str | None) -> str:
    """The runtime a generator runs, for the ``runtime`` asked, the target's device type and why
    the lean runtime cannot run the target (``None``: it can): ``"transformers"``, or the lean
    family as asked (``"lean"``, ``"compiled"``, or ``"auto"``, which on the CPU is the lean runtime
    compiled where that wins, :class:`~caddtree.models.lean.LeanVerifier`). ``auto`` takes the
    lean family on the CPU only (on a GPU this project has not run it yet); ``lean`` or
    ``compiled`` on a target it cannot run is refused with the reason."""
    if runtime == "transformers":
        return "transformers"
    if unsupported is not None and runtime != "auto":
        raise InvalidInputError(
            f"runtime {runtime!r} cannot run this target: {unsupported}; use runtime "
            "'transformers' (--runtime transformers)"
        )
    if unsupported is not None or (runtime == "auto" and device_type != "cpu"):
        return "transformers"
    return runtime


def _verifier(
    target: Any, layer_ids: Sequence[int], runtime: str, pack: bool, blocks: Any = None
) -> Any:
    """The target's verifier on :func:`runtime_choice`'s runtime (the lean one computing on
    ``blocks``, a GGUF file's quantized weights, where given)."""
    from .models.lean import LeanVerifier, lean_unsupported
    from .models.target import TreeVerifier

    device = target.get_input_embeddings().weight.device
    reason = lean_unsupported(target) if runtime != "transformers" else None
    chosen = runtime_choice(runtime, device.type, reason)
    if chosen != "transformers":
        return LeanVerifier(target, layer_ids, pack=pack, compile=_COMPILE[chosen], blocks=blocks)
    if runtime == "auto":
        why = reason or f"runtime 'auto' picks it on CPUs, and the target is on {device.type}"
        logger.info("the target runs on transformers' forward: the lean runtime %s", why)
    return TreeVerifier(target, layer_ids)


_COMPILE = {"auto": "auto", "lean": "off", "compiled": "on"}


class SpeculativeGenerator:
    """A target model, its tokenizer and (optionally) a DFlash drafter, ready to generate.

    Methods (:data:`caddtree.util.checks.METHODS`): ``ar`` needs no drafter; ``dflash``, ``ddtree``
    (with ``budget``) and ``caddtree`` (with a cost model) need one. Output is lossless for every
    method: identical to plain greedy decoding at temperature 0, and distributed as the target's
    sampling at temperature > 0.

    The target runs on ``runtime`` (:data:`caddtree.util.checks.RUNTIMES`): ``"auto"`` (the default)
    picks caddtree's lean forward (:mod:`caddtree.models.lean`) on the CPU wherever it runs the
    model (Llama family, Qwen3), compiled by inductor where that wins
    (:mod:`caddtree.models.compiled`: bfloat16 with a C++ compiler), else transformers' own;
    ``"lean"`` asks for the eager lean forward and ``"compiled"`` for the compiled one, on any
    device (on CUDA neither has been run by this project's tests yet); ``self.runtime`` says
    which was picked (``"compiled"``, ``"lean"`` or ``"transformers"``). On the CPU the
    linear layers are packed for oneDNN unless ``pack_weights`` is false
    (:mod:`caddtree.models.packing`); ``packed_layers`` says how many were.
    """

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
        from .models.packing import pack_linear_layers
        from .models.proposer import DFlashProposer

        check_runtime(runtime)
        self.target = target.eval()
        self.tokenizer = tokenizer
        self.drafter = drafter.eval() if drafter is not None else None
        self.proposer = (
            DFlashProposer(self.drafter, self.target, pack=pack_weights)
            if self.drafter is not None
            else None
        )
        layer_ids = self.drafter.target_layer_ids if self.drafter is not None else ()
        self.verifier = _verifier(self.target, layer_ids, runtime, pack_weights, blocks)
        self.runtime = self.verifier.runtime
        self.weight_format = getattr(
            getattr(self.verifier, "target", None),
            "weight_format",
            str(self.verifier.dtype).split(".")[-1],
        )
        # On the CPU, lay the linear layers' weights out for oneDNN once instead of every call
        # (caddtree.models.packing); elsewhere, and with pack_weights=False, this packs nothing.
        # The lean runtime and the proposer pack their own fused copies; of the target the lean
        # runtime still calls the LM head, and the proposer its (draft-vocabulary) head.
        head = self.proposer.lm_head if self.proposer is not None else None
        own = self.target if self.runtime == "transformers" else self.target.lm_head
        if getattr(getattr(self.verifier, "target", None), "head", None) is not None:
            own = None  # the runtime's head runs on a file's blocks
        self.packed_layers = (
            pack_linear_layers(own, head)
            + self.verifier.packed_layers()
            + (self.proposer.packed_layers() if self.proposer is not None else 0)
            if pack_weights
            else 0
        )
        if context_window is not None:
            self.set_context_window(context_window)
        self.cost_model = self._cost_model(cost_model)

    def set_context_window(self, positions: int) -> None:
        """Let a generation's prompt and output together hold up to ``positions`` tokens.

        The default is the model's ``max_position_embeddings``, and a generation that would pass
        it is refused. A larger window is the user's choice: positions past the ones the model
        was trained for are extrapolated by its position encoding, as plain decoding with
        transformers would (a warning says so). The output still equals plain decoding of the
        same model; whether it is any good past the trained window is the model's affair.
        """
        check_int("context_window", positions, minimum=2)
        trained = getattr(self.target.config.get_text_config(), "max_position_embeddings", None)
        if trained is not None and positions > trained:
            logger.warning(
                "context window %d is past the %d positions this model was trained for: "
                "positions beyond %d are extrapolated, and text there may degrade (the output "
                "still equals plain decoding)",
                positions,
                trained,
                trained,
            )
        self.verifier.max_positions = positions

    # ---- loading ------------------------------------------------------------------------------

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
        **target_kwargs: Any,
    ) -> SpeculativeGenerator:
        """Load a transformers causal LM (a local directory or hub id) with SDPA attention (on the
        CPU, caddtree's variant that reads grouped-query heads in place:
        :mod:`caddtree.models.attention`), its tokenizer, and a DFlash drafter in the released
        format (``draft``; optional for ``ar``).
        ``context_window``: see :meth:`set_context_window` (default: the model's window).
        ``pack_weights``: on the CPU, lay the linear layers' weights out for oneDNN once
        (:mod:`caddtree.models.packing`: faster, one more copy of those weights in memory).
        ``runtime``: the target's forward, see the class docstring.
        A target read from a GGUF file (``gguf_file``, or the built-in one) keeps its quantized
        weights on the lean runtimes in bfloat16 on CPUs whose kernels compute them
        (:mod:`caddtree.models.quantized`: Q4_0 to Q8_0, Q4_K to Q6_K); ``dequantize`` runs them as
        bfloat16 instead; ``dtype="auto"`` is bfloat16 for such a target on the CPU. The loaded
        model's own copies of the weights that run on blocks are then freed: ``gen.target`` keeps
        the model's configuration, embeddings, norms and head, and its forward runs only through
        ``gen.verifier``.
        ``weight_format`` says which ran."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        from .models.attention import preferred_attention
        from .models.checkpoints import check_model_location, checkpoint_errors
        from .models.dflash import DFLASH_ARCHITECTURE, DFlashDraftModel
        from .models.lean import lean_unsupported

        check_int("context_window", context_window, minimum=2, allow_none=True)  # before loading
        check_runtime(runtime)
        target, gguf_file = gguf_location(target, gguf_file)
        dev = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, dev)
        if gguf_file and dtype == "auto" and dev.type == "cpu":
            torch_dtype = torch.bfloat16  # a GGUF's quantized blocks run with bfloat16 rows
        extra = {"gguf_file": gguf_file} if gguf_file else {}
        what = "the target model"
        check_model_location(target, what, gguf_file or "config.json")
        if draft is not None:
            check_model_location(draft, "a DFlash drafter from")
        with checkpoint_errors(what, target):
            config = AutoConfig.from_pretrained(target, **extra)
            if DFLASH_ARCHITECTURE in (getattr(config, "architectures", None) or []):
                raise CheckpointError(
                    f"{str(target)!r} is a DFlash drafter, not a target model: give it as the "
                    "drafter (--draft / draft=) and, as the target, the model it drafts for"
                )
            model, info = AutoModelForCausalLM.from_pretrained(
                target,
                dtype=torch_dtype,
                attn_implementation=preferred_attention(dev),
                output_loading_info=True,
                **extra,
                **target_kwargs,
            )
        missing = sorted(info.get("missing_keys") or ())
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise CheckpointError(
                f"{str(target)!r} is not a complete causal language model: it lacks the weights "
                f"{', '.join(missing[:3])}{more}, which would start random. A target needs its "
                "token embeddings, every layer and an LM head"
            )
        with checkpoint_errors("the tokenizer of", target):
            tokenizer = AutoTokenizer.from_pretrained(target, **extra)
        drafter = None
        if draft is not None:
            drafter = DFlashDraftModel.from_pretrained(draft, dtype=torch_dtype).to(dev)
        model = model.to(dev)
        blocks = None
        if not dequantize and runtime != "transformers" and lean_unsupported(model) is None:
            blocks = quantized_blocks(gguf_source(target, gguf_file), model)  # or None
        gen = cls(
            model,
            tokenizer,
            drafter,
            cost_model=cost_model,
            context_window=context_window,
            pack_weights=pack_weights,
            runtime=runtime,
            blocks=blocks,
        )
        if blocks and gen.runtime != "transformers":
            gen.verifier.target.release_quantized_sources()  # their blocks run instead
        named = Path(target) / gguf_file if gguf_file else target
        gen.source = {"target": str(named), "draft": None if draft is None else str(draft)}
        return gen

    # ---- cost model -----------------------------------------------------------------------------

    def profile(self, **kwargs: Any) -> CostModel:
        """Measure this target and drafter on this machine and fit a cost model; keyword arguments
        go to :func:`caddtree.core.profiling.profile_cost_model` (grid, trials, progress)."""
        from .core.profiling import profile_cost_model

        if self.proposer is None:
            raise InvalidInputError("profiling the drafting cost needs a drafter")
        meta = {
            "machine": machine_description(self.verifier.device),
            "dtype": str(self.verifier.dtype),
        }
        meta.update(getattr(self, "source", {}))
        return profile_cost_model(self.verifier, self.proposer, metadata=meta, **kwargs)

    def _profile_duration(self, settings: dict[str, Any]) -> str:
        """How long :meth:`profile` with ``settings`` will take, said for a person (see
        :func:`caddtree.core.profiling.estimate_profile_seconds`), with a hint when a half-precision
        dtype makes it slow on a CPU."""
        from .core.profiling import describe_duration, estimate_profile_seconds

        seconds = estimate_profile_seconds(self.verifier, self.proposer, **settings)
        text = f"{describe_duration(seconds)}, estimated"
        if seconds > SLOW_PROFILE_S and self.verifier.device.type == "cpu":
            dtype = dtype_name(self.verifier.dtype)
            if self.verifier.dtype in CPU_SLOW_HALF:
                other = " or ".join(d for d in ("float32", "bfloat16") if d != dtype)
                text += (
                    f"; {dtype} may have no fast kernels on this CPU: the dtype {other} may "
                    "profile and decode several times faster; or give a cost model "
                    "(--cost-model / cost_model=) to skip profiling"
                )
            else:
                text += "; give a cost model (--cost-model / cost_model=) to skip profiling"
        return text

    def _default_profile_lengths(self) -> list[int]:
        """Context lengths for the automatic profile: up to 1024, within the model's window."""
        from .core.profiling import max_profile_context_length

        room = max_profile_context_length(self.verifier, self.proposer)
        room = 10**9 if room is None else room
        lengths = [x for x in (0, 256, 512, 1024) if x <= room]
        if len(lengths) < 2:
            lengths = sorted({0, room // 2, room})
        return lengths

    def cached_cost_model(
        self, cache_dir: str | os.PathLike[str] | None = None, **kwargs: Any
    ) -> CostModel:
        """A cost model for this target, drafter, dtype and machine: read from the cache, or
        profiled once (with a progress bar) and cached. Says on stderr which of the two happened."""
        from .profiles import cached_profile, cost_ident

        if self.proposer is None:
            raise InvalidInputError(
                "a cost model times the drafter's pass too, and this generator has no drafter: "
                "load it with one (from_pretrained(target, draft))"
            )
        ident = {**cost_ident(self), "grid": {k: str(v) for k, v in sorted(kwargs.items())}}

        def profile() -> CostModel:
            if "context_lengths" not in kwargs:
                kwargs["context_lengths"] = self._default_profile_lengths()
            settings = {"trials": 3, "warmup": 1, **kwargs}
            logger.warning(
                "no cost model for this model pair and machine yet; profiling it once (%s), "
                "then caching it",
                self._profile_duration(settings),
            )
            model = self.profile(**settings)
            if model.noisy:
                logger.warning("%s", model.noise_warning("measuring once more"))
                model = max(model, self.profile(**settings), key=lambda m: m.quality)
            return model

        path, model = cached_profile("cost", ident, cache_dir, profile)
        if model is None:
            return load_cost_model(path)
        logger.info("cost model saved to %s\n%s", path, model.fit_report())
        warning = model.noise_warning(
            f"measured twice. For a better fit, delete {path} and run again on a quiet machine."
        )
        if warning:
            logger.warning("%s", warning)
        return model

    def cached_batch_cost_model(
        self, max_batch: int, cache_dir: str | os.PathLike[str] | None = None
    ) -> BatchCostModel:
        """The batch cost model (:class:`~caddtree.engine.batch_cost.BatchCostModel`) of rounds
        of 1 to ``max_batch`` requests on the lean runtimes: read from the cache, or profiled
        once (with a progress bar) and cached."""
        from .profiles import cached_batch_cost_model

        return cached_batch_cost_model(self, max_batch, cache_dir)

    def _block(self) -> dict[str, int]:
        """The drafter's block size and the number of tokens it scores (its draft vocabulary, or
        the target's), for :func:`check_tree_budgets`; empty without a drafter."""
        if self.proposer is None:
            return {}
        token_map = self.proposer.token_map
        vocab = (
            len(token_map)
            if token_map is not None
            else int(self.target.config.get_text_config().vocab_size)
        )
        return {"block_size": self.proposer.block_size, "vocab": vocab}

    @staticmethod
    def _cost_model(value: CostModel | str | os.PathLike[str] | None) -> CostModel | None:
        if value is None or isinstance(value, CostModel):
            return value
        return load_cost_model(value)

    # ---- prompts ------------------------------------------------------------------------------

    def encode(
        self,
        prompt: str | Sequence[int] | Sequence[dict[str, str]] | Any,
        chat: bool | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of ``prompt``: a string (wrapped in the chat template when the tokenizer has
        one, unless ``chat=False``), a list of chat messages, or token ids as they are (a list of
        ints, or a 1-D integer torch tensor or numpy array; see :func:`token_ids`).
        ``chat_template_kwargs`` (a dict, e.g. ``{"enable_thinking": False}`` for Qwen3) go to
        the chat template; giving some where no template is applied is an error."""
        template_kwargs = check_chat_template_kwargs(chat_template_kwargs)
        messages = chat_messages(prompt)
        if isinstance(prompt, str) or messages is not None:
            if self.tokenizer is None:
                raise InvalidInputError("this generator has no tokenizer; pass token ids instead")
            if messages is None:
                messages = [{"role": "user", "content": check_text(prompt)}]
            has_template = getattr(self.tokenizer, "chat_template", None) is not None
            if chat is None:
                chat = has_template
            if chat:
                if not has_template:
                    raise InvalidInputError("the tokenizer has no chat template; use chat=False")
                return chat_template_ids(self.tokenizer, messages, template_kwargs)
            if not isinstance(prompt, str):
                raise InvalidInputError("chat messages need chat=True and a chat template")
            _no_template_kwargs(template_kwargs, "the prompt is not wrapped in the chat template")
            return [int(t) for t in self.tokenizer(prompt, add_special_tokens=True)["input_ids"]]
        if not isinstance(prompt, (list, tuple, torch.Tensor, np.ndarray, bytes, bytearray)):
            raise InvalidInputError(
                "a prompt is a string, a list of chat messages, or token ids (a list of ints, or "
                f"a 1-D integer tensor or array), got a value of type {type(prompt).__name__}"
            )
        _no_template_kwargs(template_kwargs, "a prompt of token ids is used as it is")
        vocab = int(self.target.config.get_text_config().vocab_size)
        return token_ids(prompt, vocab, "a prompt's token ids")

    def default_stop_token_ids(self) -> set[int]:
        """EOS from the tokenizer and from the target's generation config."""
        return eos_token_ids(self.tokenizer, self.target)

    # ---- generation ---------------------------------------------------------------------------

    def generate(
        self,
        prompt: str | Sequence[int] | Sequence[dict[str, str]],
        method: str = "caddtree",
        *,
        callback: Callable[[RoundStats | None, list[int]], Any] | None = None,
        tree_callback: Callable[[DraftTree, RoundStats], Any] | None = None,
        **settings: Any,
    ) -> GenerationResult:
        """Generate a continuation of ``prompt``; see :func:`caddtree.engine.decoding.decode`. The
        ``settings`` are :meth:`request`'s: ``budget``, ``cost_model``, ``max_budget``,
        ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``,
        ``max_new_tokens`` (256), ``stop_token_ids``, ``stop``, ``stopping_criteria``, ``chat``,
        ``chat_template_kwargs`` and ``seed``.

        Sampling follows transformers' ``generate``: ``temperature=0`` is greedy decoding, above
        0 samples after ``top_k`` (0 = off), ``top_p`` (1 = off) and ``min_p`` (0 = off);
        ``repetition_penalty`` (1 = off) applies either way (see
        :class:`~caddtree.core.sampling.Sampler`). ``seed`` makes sampling reproducible.
        ``stop_token_ids=None`` uses :meth:`default_stop_token_ids`; pass ``()`` to ignore EOS.
        ``stop`` (a string or a list of strings) ends generation after the token that completes
        one of them (the token is kept; :class:`~caddtree.engine.decoding.StopStrings`, which needs the
        tokenizer); ``stopping_criteria`` adds other transformers-style criteria.
        ``chat_template_kwargs`` go to the chat template (see :meth:`encode`).
        """
        request = self.request(prompt, method, **settings)
        result = self.decode(
            request.prompt_ids,
            request.policy,
            max_new_tokens=request.max_new_tokens,
            sampler=request.sampler,
            stop_token_ids=request.stop_token_ids,
            stopping_criteria=request.stopping_criteria,
            callback=callback,
            tree_callback=tree_callback,
        )
        if self.tokenizer is not None:
            result.text = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        return result

    def policy(
        self,
        method: str,
        *,
        budget: int | None = None,
        cost_model: CostModel | str | os.PathLike[str] | None = None,
        max_budget: int = 1024,
        profile: bool = False,
    ) -> TreePolicy:
        """The tree policy of ``method`` with its budgets checked against the drafter's block.
        CaDDTree's cost model is ``cost_model`` (a model or a file), else this generator's; with
        ``profile``, one is loaded from the cache or profiled when neither is set."""
        given = self._cost_model(cost_model)  # a file is read (and checked) whatever the method
        cost = None
        if method == "caddtree":
            cost = given or self.cost_model
            if cost is None and profile:
                cost = self.cost_model = self.cached_cost_model()
        max_budget = check_tree_budgets(method, budget, max_budget, **self._block())
        return make_policy(method, budget=budget, cost_model=cost, max_budget=max_budget)

    def request(
        self,
        prompt: str | Sequence[int] | Sequence[dict[str, str]],
        method: str = "caddtree",
        *,
        budget: int | None = None,
        cost_model: CostModel | str | os.PathLike[str] | None = None,
        max_budget: int = 1024,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        max_new_tokens: int = 256,
        stop_token_ids: Iterable[int] | None = None,
        stop: str | Sequence[str] | None = None,
        stopping_criteria: Iterable[Callable[..., Any]] | None = None,
        chat: bool | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        seed: int | None = None,
    ) -> GenerationRequest:
        """The :class:`~caddtree.engine.requests.GenerationRequest` of :meth:`generate`'s arguments
        (the same meaning), every one checked here: what :meth:`generate` decodes, and what a
        :class:`~caddtree.engine.batching.BatchDecoder` takes."""
        policy = self.policy(method, budget=budget, cost_model=cost_model, max_budget=max_budget)
        if policy.needs_drafter and self.proposer is None:
            raise InvalidInputError(
                f"method {method!r} needs a DFlash drafter; load one (draft=...) or use method='ar'"
            )
        sampler = Sampler(
            temperature,
            top_p,
            seed=seed,
            device=self.verifier.device,
            top_k=top_k,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
        )
        stop_strings = check_stop(stop)
        if stop_strings and self.tokenizer is None:
            raise InvalidInputError(
                "stop strings need a tokenizer and this generator has none; use stop_token_ids"
            )
        prompt_ids = self.encode(prompt, chat=chat, chat_template_kwargs=chat_template_kwargs)
        stops = self.default_stop_token_ids()
        if stop_token_ids is not None:
            if isinstance(stop_token_ids, Iterable) and not isinstance(
                stop_token_ids, (str, bytes, bytearray, torch.Tensor, np.ndarray)
            ):
                stop_token_ids = list(stop_token_ids)  # a set, a generator ...
            vocab = int(self.target.config.get_text_config().vocab_size)
            stops = set(token_ids(stop_token_ids, vocab, "stop_token_ids"))
        criteria = criteria_list(stopping_criteria)
        if stop_strings:
            criteria.insert(0, stop_string_criterion(self.tokenizer, stop_strings))
        check_int("max_new_tokens", max_new_tokens)
        return GenerationRequest(
            prompt_ids,
            policy,
            max_new_tokens,
            sampler=sampler,
            stop_token_ids=frozenset(stops),
            stopping_criteria=criteria,
        )

    def decode(
        self, prompt_ids: Sequence[int], policy: TreePolicy, **kwargs: Any
    ) -> GenerationResult:
        """:func:`caddtree.engine.decoding.decode` of ``prompt_ids`` on this generator's target and
        drafter (keyword arguments as there), without text; the KV caches are let go afterwards,
        whatever happens, since they grow with the output, and after a long generation on the CPU
        the heap memory it freed goes back to the system (see benchmarks/long_generation.py)."""
        try:
            return decode(self.verifier, prompt_ids, policy, proposer=self.proposer, **kwargs)
        finally:
            reached = self.verifier.context_length
            self.verifier.reset()
            if self.proposer is not None:
                self.proposer.reset()
            if reached >= LONG_CONTEXT and self.verifier.device.type == "cpu":
                from .models.kvcache import return_freed_memory

                return_freed_memory()

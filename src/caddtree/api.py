"""The Python API: load a target and a DFlash drafter once, then generate with any method.

gen = SpeculativeGenerator.from_pretrained("Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16",
                                           dtype="bfloat16", device="cuda")
out = gen.generate("Prove that sqrt(2) is irrational.", method="caddtree",
                   cost_model="cost.json", max_new_tokens=512)
print(out.text, out.stats.tau, out.stats.ms_per_token)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .cost import CostModel, load_cost_model
from .decoding import GenerationStats, RoundStats, Sampler, decode, make_policy
from .errors import CheckpointError, InvalidInputError
from .models.dflash import DFlashDraftModel, DFlashProposer
from .models.target import TreeVerifier
from .tree import DraftTree

__all__ = ["GenerationResult", "SpeculativeGenerator", "machine_description", "resolve_dtype"]

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float64": torch.float64,
    "fp64": torch.float64,
    "double": torch.float64,
}


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``"auto"``/``None`` means bfloat16 on CUDA and float32 elsewhere."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise InvalidInputError(
            f"unknown dtype {dtype!r}; use one of auto, {', '.join(sorted(set(_DTYPES)))}"
        ) from None


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidInputError(f"unknown device {device!r} (e.g. cpu, cuda, cuda:1)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidInputError("device 'cuda' was requested but torch sees no CUDA device")
    return dev


def eos_token_ids(tokenizer: Any, model: Any) -> set[int]:
    """EOS ids from ``tokenizer`` and from ``model.generation_config`` (int or list; either may
    be missing)."""
    ids: set[int] = set()
    gen_config = getattr(model, "generation_config", None)
    for value in (
        getattr(tokenizer, "eos_token_id", None),
        getattr(gen_config, "eos_token_id", None),
    ):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def chat_template_ids(tokenizer: Any, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` in the tokenizer's chat template, ready for the assistant turn."""
    ids = tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=True, tokenize=True, return_dict=False
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # some versions return a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def machine_description(device: torch.device) -> str:
    """What the timings depend on: the accelerator, or the CPU model and thread count."""
    import platform

    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            cpu = next(
                (line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), cpu
            )
    except OSError:
        pass
    return f"cpu:{cpu}:{os.cpu_count()} cores:{torch.get_num_threads()} threads"


def _weights_digest(model: torch.nn.Module) -> str:
    """A cheap fingerprint of a model's weights (shapes and a few values of each tensor)."""
    import hashlib

    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        h.update(name.encode())
        h.update(str(tuple(tensor.shape)).encode())
        h.update(flat[:: max(1, flat.numel() // 64)].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated tokens only
    prompt_ids: list[int]
    method: str
    stats: GenerationStats

    def to_dict(self, per_round: bool = False) -> dict[str, Any]:
        return {
            "method": self.method,
            "text": self.text,
            "token_ids": self.token_ids,
            "prompt_tokens": len(self.prompt_ids),
            "stats": self.stats.to_dict(per_round=per_round),
        }


class SpeculativeGenerator:
    """A target model, its tokenizer and (optionally) a DFlash drafter, ready to generate.

    Methods (:data:`caddtree.decoding.METHODS`): ``ar`` needs no drafter; ``dflash``, ``ddtree``
    (with ``budget``) and ``caddtree`` (with a cost model) need one. Output is lossless for every
    method: identical to plain greedy decoding at temperature 0, and distributed as the target's
    sampling at temperature > 0.
    """

    def __init__(
        self,
        target: Any,
        tokenizer: Any = None,
        drafter: DFlashDraftModel | None = None,
        *,
        cost_model: CostModel | str | os.PathLike[str] | None = None,
    ):
        self.target = target.eval()
        self.tokenizer = tokenizer
        self.drafter = drafter.eval() if drafter is not None else None
        self.proposer = (
            DFlashProposer(self.drafter, self.target) if self.drafter is not None else None
        )
        layer_ids = self.drafter.target_layer_ids if self.drafter is not None else ()
        self.verifier = TreeVerifier(self.target, layer_ids)
        self.cost_model = self._cost_model(cost_model)

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
        **target_kwargs: Any,
    ) -> SpeculativeGenerator:
        """Load a transformers causal LM (a local directory or hub id) with SDPA attention, its
        tokenizer, and a DFlash drafter in the released format (``draft``; optional for ``ar``)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        dev = _resolve_device(device)
        torch_dtype = resolve_dtype(dtype, dev)
        extra = {"gguf_file": gguf_file} if gguf_file else {}
        try:
            model = AutoModelForCausalLM.from_pretrained(
                target, dtype=torch_dtype, attn_implementation="sdpa", **extra, **target_kwargs
            )
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot load the target model {str(target)!r}: {exc}") from None
        try:
            tokenizer = AutoTokenizer.from_pretrained(target, **extra)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot load the tokenizer of {str(target)!r}: {exc}") from None
        drafter = None
        if draft is not None:
            drafter = DFlashDraftModel.from_pretrained(draft, dtype=torch_dtype).to(dev)
        gen = cls(model.to(dev), tokenizer, drafter, cost_model=cost_model)
        gen.source = {"target": str(target), "draft": None if draft is None else str(draft)}
        return gen

    # ---- cost model -----------------------------------------------------------------------------

    def profile(self, **kwargs: Any) -> CostModel:
        """Measure this target and drafter on this machine and fit a cost model; keyword arguments
        go to :func:`caddtree.profiling.profile_cost_model` (grid, trials, progress)."""
        from .profiling import profile_cost_model

        if self.proposer is None:
            raise InvalidInputError("profiling the drafting cost needs a drafter")
        meta = {
            "machine": machine_description(self.verifier.device),
            "dtype": str(self.verifier.dtype),
        }
        meta.update(getattr(self, "source", {}))
        return profile_cost_model(self.verifier, self.proposer, metadata=meta, **kwargs)

    def _default_profile_lengths(self) -> list[int]:
        """Context lengths for the automatic profile: up to 1024, within the model's window."""
        from .profiling import max_profile_context_length

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
        import hashlib
        import json
        import sys
        from pathlib import Path

        from .defaults import cache_root

        ident = {
            "source": getattr(self, "source", {}),
            "drafter": _weights_digest(self.drafter) if self.drafter is not None else None,
            "target_config": self.target.config.get_text_config()
            .to_dict()
            .get("_name_or_path", ""),
            "dtype": str(self.verifier.dtype),
            "machine": machine_description(self.verifier.device),
            "grid": {k: str(v) for k, v in sorted(kwargs.items())},
        }
        digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
        path = Path(cache_dir) if cache_dir is not None else cache_root() / "cost-models"
        path = path / f"cost-{digest}.json"
        if path.is_file():
            print(
                f"caddtree: using the cost model profiled earlier on this machine: {path}",
                file=sys.stderr,
            )
            return load_cost_model(path)
        print(
            "caddtree: no cost model for this model pair and machine yet; profiling it once "
            "(about a minute), then caching it",
            file=sys.stderr,
        )
        if "context_lengths" not in kwargs:
            kwargs["context_lengths"] = self._default_profile_lengths()
        model = self.profile(**{"trials": 3, "warmup": 1, **kwargs})
        model.save(path)
        print(f"caddtree: cost model saved to {path}\n{model.fit_report()}", file=sys.stderr)
        worst = min(q.r2 for q in model.fit_quality.values())
        if not worst >= 0.9:
            print(
                f"caddtree: warning: the timings were noisy (R2 down to {worst:.2f}); another "
                "process may have been using the machine. The fit is still convex and usable, but "
                f"for a better one delete {path} and run again on a quiet machine.",
                file=sys.stderr,
            )
        return model

    @staticmethod
    def _cost_model(value: CostModel | str | os.PathLike[str] | None) -> CostModel | None:
        if value is None or isinstance(value, CostModel):
            return value
        return load_cost_model(value)

    # ---- prompts ------------------------------------------------------------------------------

    def encode(
        self, prompt: str | Sequence[int] | Sequence[dict[str, str]], chat: bool | None = None
    ) -> list[int]:
        """Token ids of ``prompt``: a string (wrapped in the chat template when the tokenizer has
        one, unless ``chat=False``), a list of chat messages, or token ids as they are."""
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], dict)):
            if self.tokenizer is None:
                raise InvalidInputError("this generator has no tokenizer; pass token ids instead")
            messages = (
                [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            )
            has_template = getattr(self.tokenizer, "chat_template", None) is not None
            if chat is None:
                chat = has_template
            if chat:
                if not has_template:
                    raise InvalidInputError("the tokenizer has no chat template; use chat=False")
                return chat_template_ids(self.tokenizer, messages)
            if not isinstance(prompt, str):
                raise InvalidInputError("chat messages need chat=True and a chat template")
            return [int(t) for t in self.tokenizer(prompt, add_special_tokens=True)["input_ids"]]
        try:
            ids = [int(t) for t in prompt]
        except (TypeError, ValueError):
            raise InvalidInputError(
                "a prompt is a string, a list of chat messages, or token ids"
            ) from None
        vocab = int(self.target.config.get_text_config().vocab_size)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidInputError(
                f"token id {bad[0]} is outside the vocabulary of {vocab} tokens"
            )
        return ids

    def default_stop_token_ids(self) -> set[int]:
        """EOS from the tokenizer and from the target's generation config."""
        return eos_token_ids(self.tokenizer, self.target)

    # ---- generation ---------------------------------------------------------------------------

    def generate(
        self,
        prompt: str | Sequence[int] | Sequence[dict[str, str]],
        method: str = "caddtree",
        *,
        budget: int | None = None,
        cost_model: CostModel | str | os.PathLike[str] | None = None,
        max_budget: int = 1024,
        temperature: float = 0.0,
        top_p: float = 1.0,
        max_new_tokens: int = 256,
        stop_token_ids: Iterable[int] | None = None,
        chat: bool | None = None,
        seed: int | None = None,
        callback: Callable[[RoundStats | None, list[int]], Any] | None = None,
        tree_callback: Callable[[DraftTree, RoundStats], Any] | None = None,
    ) -> GenerationResult:
        """Generate a continuation of ``prompt``; see :func:`caddtree.decoding.decode`.

        ``stop_token_ids=None`` uses :meth:`default_stop_token_ids`; pass ``()`` to ignore EOS.
        """
        cost = self._cost_model(cost_model) or self.cost_model
        policy = make_policy(
            method,
            budget=budget,
            cost_model=cost if method == "caddtree" else None,
            max_budget=max_budget,
        )
        if policy.needs_drafter and self.proposer is None:
            raise InvalidInputError(
                f"method {method!r} needs a DFlash drafter; load one (draft=...) or use method='ar'"
            )
        prompt_ids = self.encode(prompt, chat=chat)
        sampler = Sampler(temperature, top_p, seed, device=self.verifier.device)
        stops = self.default_stop_token_ids() if stop_token_ids is None else set(stop_token_ids)
        result = decode(
            self.verifier,
            prompt_ids,
            policy,
            proposer=self.proposer,
            max_new_tokens=max_new_tokens,
            sampler=sampler,
            stop_token_ids=stops,
            callback=callback,
            tree_callback=tree_callback,
        )
        text = ""
        if self.tokenizer is not None:
            text = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        return GenerationResult(text, result.token_ids, prompt_ids, policy.name, result.stats)

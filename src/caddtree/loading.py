"""Loading a model pair for :class:`~caddtree.api.SpeculativeGenerator`: the target (a
transformers directory, a hub id or a GGUF file) with its tokenizer and a DFlash drafter
(:func:`load_pair`), the runtime its forward runs on (:func:`runtime_choice`,
:func:`make_verifier`), and the weights laid out once for the CPU's kernels
(:func:`packed_layer_count`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from .runtime.gguf_blocks import gguf_location, gguf_source, quantized_blocks
from .util.checks import check_int
from .util.devices import resolve_device, resolve_draft_dtype, resolve_dtype
from .util.errors import CheckpointError, InvalidInputError

__all__ = [
    "LoadedPair",
    "build_runtime",
    "checked_context_window",
    "load_pair",
    "make_verifier",
    "packed_layer_count",
    "release_caches",
    "runtime_choice",
]

logger = logging.getLogger("caddtree.api")

_COMPILE = {"auto": "auto", "lean": "off", "compiled": "on"}


def runtime_choice(runtime: str, device_type: str, unsupported: str | None) -> str:
    """The runtime a generator runs, for the ``runtime`` asked, the target's device type and why
    the lean runtime cannot run the target (``None``: it can): ``"transformers"``, or the lean
    family as asked (``"lean"``, ``"compiled"``, or ``"auto"``, which on the CPU is the lean runtime
    compiled where that wins, :class:`~caddtree.runtime.lean.LeanVerifier`). ``auto`` takes the
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


def make_verifier(
    target: Any, layer_ids: Sequence[int], runtime: str, pack: bool, blocks: Any = None
) -> Any:
    """The target's verifier on :func:`runtime_choice`'s runtime (the lean one computing on
    ``blocks``, a GGUF file's quantized weights, where given)."""
    from .models.target import TreeVerifier
    from .runtime.lean import LeanVerifier, lean_unsupported

    device = target.get_input_embeddings().weight.device
    reason = lean_unsupported(target) if runtime != "transformers" else None
    chosen = runtime_choice(runtime, device.type, reason)
    if chosen != "transformers":
        return LeanVerifier(target, layer_ids, pack=pack, compile=_COMPILE[chosen], blocks=blocks)
    if runtime == "auto":
        why = reason or f"runtime 'auto' picks it on CPUs, and the target is on {device.type}"
        logger.info("the target runs on transformers' forward: the lean runtime %s", why)
    return TreeVerifier(target, layer_ids)


def packed_layer_count(target: Any, verifier: Any, proposer: Any, pack: bool) -> int:
    """Lay the linear layers' weights out for oneDNN once instead of every call, on the CPU
    (:mod:`caddtree.runtime.packing`; elsewhere, and with ``pack`` false, nothing is packed), and
    count the layers packed. The lean runtime and the proposer pack their own fused copies; of the
    target the lean runtime still calls the LM head (unless it runs on a file's blocks), and the
    proposer its (draft-vocabulary) head."""
    from .runtime.packing import pack_linear_layers

    if not pack:
        return 0
    head = proposer.lm_head if proposer is not None else None
    own = target if verifier.runtime == "transformers" else target.lm_head
    if getattr(getattr(verifier, "target", None), "head", None) is not None:
        own = None  # the runtime's head runs on a file's blocks
    return (
        pack_linear_layers(own, head)
        + verifier.packed_layers()
        + (proposer.packed_layers() if proposer is not None else 0)
    )


def build_runtime(
    target: Any, drafter: Any, runtime: str, pack: bool, blocks: dict[str, Any] | None
) -> tuple[Any, Any, int]:
    """The drafter's proposer (``None`` without a drafter), the target's verifier on
    :func:`runtime_choice`'s runtime, and the count of :func:`packed_layer_count`."""
    from .models.proposer import DFlashProposer

    proposer = None if drafter is None else DFlashProposer(drafter, target, pack=pack)
    layer_ids = drafter.target_layer_ids if drafter is not None else ()
    verifier = make_verifier(target, layer_ids, runtime, pack, blocks)
    return proposer, verifier, packed_layer_count(target, verifier, proposer, pack)


def checked_context_window(target: Any, positions: int) -> int:
    """``positions`` checked as a context window for ``target``, with a warning where it is past
    the positions the model was trained for (they are extrapolated by its position encoding, as
    plain decoding would; text there may degrade)."""
    check_int("context_window", positions, minimum=2)
    trained = getattr(target.config.get_text_config(), "max_position_embeddings", None)
    if trained is not None and positions > trained:
        logger.warning(
            "context window %d is past the %d positions this model was trained for: "
            "positions beyond %d are extrapolated, and text there may degrade (the output "
            "still equals plain decoding)",
            positions,
            trained,
            trained,
        )
    return positions


class LoadedPair(NamedTuple):
    """What :func:`load_pair` read."""

    model: Any
    tokenizer: Any
    drafter: Any
    blocks: dict[str, Any] | None  # a GGUF file's quantized weights, to compute on as they are
    source: dict[str, str | None]  # where the target and the drafter came from


def load_pair(
    target: str | os.PathLike[str],
    draft: str | os.PathLike[str] | None,
    *,
    dtype: str | torch.dtype | None,
    device: str | torch.device | None,
    gguf_file: str | None,
    runtime: str,
    dequantize: bool,
    draft_dtype: str | torch.dtype | None = "same",
    **target_kwargs: Any,
) -> LoadedPair:
    """Read the target (with SDPA attention, or caddtree's variant on the CPU), its tokenizer,
    the drafter and, for a GGUF target the lean runtime runs, its quantized blocks; see
    :meth:`~caddtree.api.SpeculativeGenerator.from_pretrained`."""
    from transformers import AutoTokenizer

    from .models.checkpoints import check_model_location, checkpoint_errors
    from .models.dflash import DFlashDraftModel
    from .runtime.lean import lean_unsupported

    target, gguf_file = gguf_location(target, gguf_file)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    if gguf_file and dtype == "auto" and dev.type == "cpu":
        torch_dtype = torch.bfloat16  # a GGUF's quantized blocks run with bfloat16 rows
    extra = {"gguf_file": gguf_file} if gguf_file else {}
    check_model_location(target, "the target model", gguf_file or "config.json")
    if draft is not None:
        check_model_location(draft, "a DFlash drafter from")
    model = _target_model(target, torch_dtype, dev, extra, target_kwargs)
    with checkpoint_errors("the tokenizer of", target):
        tokenizer = AutoTokenizer.from_pretrained(target, **extra)
    drafter = None
    if draft is not None:
        draft_torch_dtype = resolve_draft_dtype(draft_dtype, torch_dtype, dev)
        drafter = DFlashDraftModel.from_pretrained(draft, dtype=draft_torch_dtype).to(dev)
    model = model.to(dev)
    blocks = None
    if not dequantize and runtime != "transformers" and lean_unsupported(model) is None:
        blocks = quantized_blocks(gguf_source(target, gguf_file), model)  # or None
    named = Path(target) / gguf_file if gguf_file else target
    source = {"target": str(named), "draft": None if draft is None else str(draft)}
    return LoadedPair(model, tokenizer, drafter, blocks, source)


def _target_model(
    target: Any, dtype: torch.dtype, device: torch.device, extra: dict, kwargs: dict
) -> Any:
    """The target as a complete transformers causal LM (not a drafter, no weight missing)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from .models.attention import preferred_attention
    from .models.checkpoints import checkpoint_errors
    from .models.dflash import DFLASH_ARCHITECTURE

    with checkpoint_errors("the target model", target):
        config = AutoConfig.from_pretrained(target, **extra)
        if DFLASH_ARCHITECTURE in (getattr(config, "architectures", None) or []):
            raise CheckpointError(
                f"{str(target)!r} is a DFlash drafter, not a target model: give it as the "
                "drafter (--draft / draft=) and, as the target, the model it drafts for"
            )
        model, info = AutoModelForCausalLM.from_pretrained(
            target,
            dtype=dtype,
            attn_implementation=preferred_attention(device),
            output_loading_info=True,
            **extra,
            **kwargs,
        )
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise CheckpointError(
            f"{str(target)!r} is not a complete causal language model: it lacks the weights "
            f"{', '.join(missing[:3])}{more}, which would start random. A target needs its "
            "token embeddings, every layer and an LM head"
        )
    return model


LONG_CONTEXT = 2048
"""A generation that reached this many positions hands the heap memory it freed back (CPU)."""


def release_caches(verifier: Any, proposer: Any) -> None:
    """Let a generation's KV caches go (they grow with the output), and after a long generation
    on the CPU hand the heap memory it freed back to the system (benchmarks/long_generation.py)."""
    reached = verifier.context_length
    verifier.reset()
    if proposer is not None:
        proposer.reset()
    if reached >= LONG_CONTEXT and verifier.device.type == "cpu":
        from .models.kvcache import return_freed_memory

        return_freed_memory()

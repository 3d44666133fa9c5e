"""Cost models of a :class:`~caddtree.api.SpeculativeGenerator`, measured on this machine and
cached per machine: a profile of the pair (:func:`profile_generator`), what it depends on
(:func:`cost_ident`, its cache key), one profile per cache file at a time
(:func:`cached_profile`), and the cost model and batch cost model read from the cache or
profiled once (:func:`cached_cost_model`, :func:`cached_batch_cost_model`)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from filelock import FileLock

from .core.cost import CostModel, load_cost_model
from .runtime.kernels import amx_in_use, kernel_in_use, source_digest
from .util.defaults import cache_root
from .util.devices import CPU_SLOW_HALF, dtype_name, machine_description, weights_digest
from .util.errors import CaddtreeError, InvalidInputError

if TYPE_CHECKING:
    from .engine.batch_cost import BatchCostModel

__all__ = [
    "batch_sizes",
    "cached_batch_cost_model",
    "cached_cost_model",
    "cached_profile",
    "cost_ident",
    "others_cpu_share",
    "profile_batches",
    "profile_generator",
]

logger = logging.getLogger("caddtree.api")

SLOW_PROFILE_S = 300.0
"""A first-use profile estimated to take longer than this (seconds) comes with a hint how to
avoid it."""


def cost_cache_dir() -> Path:
    """Where profiled cost models are cached."""
    return cache_root() / "cost-models"


BUSY_SHARE = 0.25
"""Others' share of this process's CPUs' time above which a profile on the CPU warns."""


def others_cpu_share(
    seconds: float = 0.25, read_stat: Callable[[], str] | None = None
) -> float | None:
    """The share of the time of the CPUs this process may run on that was busy over ``seconds``
    while it slept (so: other processes' load), from Linux's ``/proc/stat``; ``None`` where that
    cannot be read."""
    read = read_stat or (lambda: Path("/proc/stat").read_text(encoding="ascii"))
    try:
        cpus = {f"cpu{i}" for i in os.sched_getaffinity(0)}
    except AttributeError:  # not Linux
        return None
    try:
        before = _busy_and_total(read(), cpus)
        time.sleep(seconds)
        after = _busy_and_total(read(), cpus)
    except (OSError, ValueError, IndexError):
        return None
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else None


def _busy_and_total(stat: str, cpus: set[str]) -> tuple[int, int]:
    """Busy and total jiffies of the ``cpus`` lines of ``/proc/stat``'s text (the first eight
    fields: user, nice, system, idle, iowait, irq, softirq, steal; idle and iowait are idle)."""
    busy = total = 0
    for line in stat.splitlines():
        fields = line.split()
        if fields and fields[0] in cpus:
            ticks = [int(x) for x in fields[1:9]]
            total += sum(ticks)
            busy += sum(ticks) - ticks[3] - ticks[4]
    if total == 0:
        raise ValueError("no CPU lines")
    return busy, total


def warn_if_cpu_busy(device: Any, read_stat: Callable[[], str] | None = None) -> None:
    """Warn, before a profile on the CPU, where other processes keep its CPUs busy: the timings,
    and the cost model fitted to them, would be theirs as much as the model's."""
    if getattr(device, "type", device) != "cpu":
        return
    share = others_cpu_share(read_stat=read_stat)
    if share is not None and share > BUSY_SHARE:
        logger.warning(
            "other processes keep %.0f%% of this process's CPUs busy: the profile's timings, "
            "and so the cost model, will be off. Profile when the machine is idle "
            "(`caddtree profile --out cost.json`, then --cost-model cost.json), or remove the "
            "cached model (under %s) to profile again later",
            100 * share,
            cost_cache_dir(),
        )


def profile_generator(gen: Any, **kwargs: Any) -> CostModel:
    """:meth:`SpeculativeGenerator.profile <caddtree.api.SpeculativeGenerator.profile>`: measure
    the target and drafter of ``gen`` on this machine and fit a cost model."""
    from .core.profiling import profile_cost_model

    if gen.proposer is None:
        raise InvalidInputError("profiling the drafting cost needs a drafter")
    warn_if_cpu_busy(gen.verifier.device)
    meta = {"machine": machine_description(gen.verifier.device), "dtype": str(gen.verifier.dtype)}
    meta.update(getattr(gen, "source", {}))
    return profile_cost_model(gen.verifier, gen.proposer, metadata=meta, **kwargs)


def profile_duration(gen: Any, settings: dict[str, Any]) -> str:
    """How long a profile of ``gen`` with ``settings`` will take, said for a person (see
    :func:`caddtree.core.profiling.estimate_profile_seconds`), with a hint when a half-precision
    dtype makes it slow on a CPU."""
    from .core.profiling import describe_duration, estimate_profile_seconds

    seconds = estimate_profile_seconds(gen.verifier, gen.proposer, **settings)
    text = f"{describe_duration(seconds)}, estimated"
    if seconds > SLOW_PROFILE_S and gen.verifier.device.type == "cpu":
        dtype = dtype_name(gen.verifier.dtype)
        if gen.verifier.dtype in CPU_SLOW_HALF:
            other = " or ".join(d for d in ("float32", "bfloat16") if d != dtype)
            text += (
                f"; {dtype} may have no fast kernels on this CPU: the dtype {other} may "
                "profile and decode several times faster; or give a cost model "
                "(--cost-model / cost_model=) to skip profiling"
            )
        else:
            text += "; give a cost model (--cost-model / cost_model=) to skip profiling"
    return text


def default_profile_lengths(gen: Any) -> list[int]:
    """Context lengths for the automatic profile: up to 1024, within the model's window."""
    from .core.profiling import max_profile_context_length

    room = max_profile_context_length(gen.verifier, gen.proposer)
    room = 10**9 if room is None else room
    lengths = [x for x in (0, 256, 512, 1024) if x <= room]
    if len(lengths) < 2:
        lengths = sorted({0, room // 2, room})
    return lengths


def cached_cost_model(
    gen: Any, cache_dir: str | os.PathLike[str] | None = None, **kwargs: Any
) -> CostModel:
    """:meth:`SpeculativeGenerator.cached_cost_model <caddtree.api.SpeculativeGenerator.
    cached_cost_model>`: the cost model of ``gen`` read from the cache, or profiled once (by
    ``gen.profile``, measured twice where the first fit is noisy) and cached."""
    if gen.proposer is None:
        raise InvalidInputError(
            "a cost model times the drafter's pass too, and this generator has no drafter: "
            "load it with one (from_pretrained(target, draft))"
        )
    ident = {**cost_ident(gen), "grid": {k: str(v) for k, v in sorted(kwargs.items())}}

    def profile() -> CostModel:
        if "context_lengths" not in kwargs:
            kwargs["context_lengths"] = default_profile_lengths(gen)
        settings = {"trials": 3, "warmup": 1, **kwargs}
        logger.warning(
            "no cost model for this model pair and machine yet; profiling it once (%s), "
            "then caching it",
            profile_duration(gen, settings),
        )
        model = gen.profile(**settings)
        if model.noisy:
            logger.warning("%s", model.noise_warning("measuring once more"))
            model = max(model, gen.profile(**settings), key=lambda m: m.quality)
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


def cost_ident(gen: Any) -> dict[str, Any]:
    """What a profile of ``gen`` (a :class:`~caddtree.api.SpeculativeGenerator`) on this machine
    depends on: its cache key's contents."""
    ident = {
        # the target by its path (for the built-in one, a cache directory named by the
        # GGUF's contents); the drafter by its weights, not its path, so that a second clone
        # or virtual environment, whose packaged drafter lies elsewhere, reuses the profile
        "source": {"target": getattr(gen, "source", {}).get("target")},
        "drafter": weights_digest(gen.drafter) if gen.drafter is not None else None,
        "target_config": gen.target.config.get_text_config().to_dict().get("_name_or_path", ""),
        "dtype": str(gen.verifier.dtype),
        # verification costs differ between attention implementations (sdpa, caddtree_sdpa)
        "attention": getattr(gen.target.config, "_attn_implementation", None),
        # and with and without weights packed for oneDNN, and between runtimes
        "packed_layers": gen.packed_layers,
        "runtime": gen.runtime,
        # and between weight formats (bfloat16, or a GGUF file's blocks computed as they are)
        "weights": getattr(gen, "weight_format", None),
        # and between caddtree's bfloat16 kernels and torch's (caddtree.runtime.kernels)
        "linear_kernel": gen.packed_layers > 0 and kernel_in_use(gen.verifier.dtype),
        "attention_kernel": gen.runtime != "transformers" and gen.verifier.target.fused_attention,
        "kernel_sources": source_digest() if kernel_in_use(gen.verifier.dtype) else None,
        # and with the linear kernel on the AMX tile unit or not
        "amx": kernel_in_use(gen.verifier.dtype) and amx_in_use(),
        "machine": machine_description(gen.verifier.device),
        # 2: the grid measured in interleaved passes, in decoding's reserved cache; 3: the
        # compiled runtime checks its guards only when the cache changes (cheaper calls); 4:
        # the drafter's pass runs on the lean arithmetic (a cheaper C_d); 5: C_d is what a
        # drafted round pays beyond its rows (pass, tree, the verification's slower start). A
        # model cached by an earlier profile is measured again once
        "profiling": 5,
    }
    if gen.drafter is not None and gen.drafter.dtype != gen.verifier.dtype:
        ident["draft_dtype"] = str(gen.drafter.dtype)  # (a drafter in the target's: no key)
    return ident


def cached_profile(
    kind: str,
    ident: dict[str, Any],
    cache_dir: str | os.PathLike[str] | None,
    profile: Callable[[], Any],
) -> tuple[Any, Any]:
    """(path, model): the cache file of ``kind`` for ``ident`` and the model ``profile()``
    made and saved there, or ``None`` where the file existed already (read it). One profile
    per file at a time: two processes timing the machine at once would each measure the
    other's load and cache a fit that says rounds cost several times what they do, so the
    second waits for the first's file."""
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    folder = Path(cache_dir) if cache_dir is not None else cost_cache_dir()
    path = folder / f"{kind}-{digest}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(path) + ".lock"):
            if path.is_file():
                logger.info("using the %s model profiled earlier on this machine: %s", kind, path)
                return path, None
            model = profile()
            model.save(path)
    except OSError as exc:  # e.g. a cache folder another user made, without write access
        where = f" ({exc.filename})" if exc.filename else ""
        raise CaddtreeError(
            f"cannot use the cost-model cache in {path.parent}: {exc.strerror or exc}{where}; "
            "make it writable for this user, or set CADDTREE_CACHE to a writable directory"
        ) from None
    return path, model


def batch_sizes(max_batch: int) -> list[int]:
    """The batch sizes a batch cost model for rounds of up to ``max_batch`` requests profiles:
    1, the powers of two below ``max_batch``, and ``max_batch`` (interpolated between)."""
    return sorted({1, int(max_batch), *(2**k for k in range(1, 10) if 2**k < max_batch)})


def profile_batches(gen: Any, max_batch: int, **grid: Any) -> BatchCostModel:
    """Profile ``gen``'s batch cost model over :func:`batch_sizes` of ``max_batch``
    (:func:`~caddtree.engine.batch_cost.profile_batch_cost_model`, its ``grid`` keywords), with
    a drafter pass of its own; the target's cache is made again afterwards."""
    from .engine.batch_cost import profile_batch_cost_model
    from .models.batch_proposer import BatchProposer

    if gen.runtime not in ("lean", "compiled") or gen.drafter is None:
        raise InvalidInputError(
            "a batch cost model needs the lean runtime (--runtime lean or compiled) and a drafter"
        )
    proposer = BatchProposer(gen.drafter, gen.target, max_batch)
    sizes = batch_sizes(max_batch)
    model = profile_batch_cost_model(gen.verifier.target, proposer, batches=sizes, **grid)
    gen.verifier.reset()  # the profile let the target's cache go
    return model


def cached_batch_cost_model(
    gen: Any, max_batch: int, cache_dir: str | os.PathLike[str] | None = None
) -> BatchCostModel:
    """:meth:`SpeculativeGenerator.cached_batch_cost_model <caddtree.api.SpeculativeGenerator.
    cached_batch_cost_model>`: :func:`profile_batches`, once per machine."""
    from .engine.batch_cost import BatchCostModel

    batches = batch_sizes(max_batch)
    ident = {**cost_ident(gen), "batches": batches}

    def profile() -> BatchCostModel:
        logger.warning(
            "no batch cost model for this model pair and machine yet; profiling it once "
            "(batch sizes %s), then caching it",
            batches,
        )
        return profile_batches(gen, max_batch)

    path, model = cached_profile("batch-cost", ident, cache_dir, profile)
    if model is None:
        return BatchCostModel.load(path)
    logger.info("batch cost model saved to %s\n%s", path, model.fit_report())
    return model

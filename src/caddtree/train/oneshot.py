"""The one-shot GPU run: new target-written data and a drafter trained further on it, within
one command of a machine that is lent for minutes (``scripts/gpu_drafter_run.py``,
``docs/training.md``, "One shot on a GPU").

The run goes through six phases, each under its own deadline (a wall-clock budget from the
moment it starts; training takes what is left before the last two phases' reserve):

==========  ========================================================================================
assemble    join the target's GGUF from its pieces (:mod:`caddtree.train.pieces`, checked against
            their SHA-256), convert it once as caddtree converts the built-in target, load it
queries     Magpie queries, batch by batch, filtered after the committed data's queries
responses   the target's greedy responses to the held-out prompts (for tau), then to the queries;
            the data goes to the output folder as it grows, before anything else
features    the context features of the new data, then of the committed data's training samples
train       caddtree's trainer (:func:`~caddtree.train.train_drafter`) from the shipped drafter,
            in one call that ends by the deadline; each checkpoint is copied out as it is saved
evaluate    tau at DDTree budget 16 of the shipped and the new drafter on the held-out prompts
==========  ========================================================================================

A phase that fails is reported (its error and the end of its traceback) and the phases that do
not need what it made go on. ``report.json`` in the output folder is rewritten after every
phase. The output folder gets at most 8 files of at most 16 MiB each: the data shards
(``data-NN.safetensors``, each loadable with :meth:`TrainingData.load`), the raw Magpie queries,
``report.json`` and the drafter (``drafter/config.json``, ``drafter/model.safetensors``).
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..util.errors import InvalidInputError
from ..util.files import atomic_write_text
from . import oneshot_phases as phases
from .oneshot_work import Deadline

__all__ = ["RunSettings", "run_oneshot"]

logger = logging.getLogger(__name__)

BUDGETED = ("assemble", "queries", "responses", "features", "evaluate", "pack")


@dataclass
class RunSettings:
    """What one run does and how long each phase may take (seconds)."""

    kit: Path  # manifest.json (and the carried gguf package)
    carried: Path  # where this command's pieces are
    work: Path  # a folder that outlives the command on the machine
    out: Path  # what comes back
    drafter: Path  # the drafter training starts from, and tau's baseline
    committed: Path | None  # the committed data folder (data, split, raw queries)
    eval_prompts: Path  # held-out prompts, {"prompt": ...} per line
    device: str = "cuda"
    dtype: str = "bfloat16"
    seed: int = 1
    total_s: float = 540.0
    budgets: dict[str, float] = field(
        default_factory=lambda: {
            "assemble": 90.0,
            "queries": 60.0,
            "responses": 170.0,
            "features": 60.0,
            "evaluate": 40.0,
            "pack": 10.0,
        }
    )
    generator: str = "engine"
    query_batch: int = 512
    query_tokens: int = 64
    max_queries: int = 40_000
    response_batch: int = 256
    response_tokens: int = 256
    max_prompt_tokens: int = 512
    eval_tokens: int = 64
    eval_budget: int = 16
    feature_chunk: int = 512
    feature_batch_tokens: int = 32768
    samples_per_step: int = 32
    anchors_per_sample: int = 32
    learning_rate: float = 3e-4
    warmup_steps: int = 20
    save_every: int = 100  # steps between checkpoints (each is copied to the outputs)

    def check(self) -> None:
        """Refuse settings that are wrong in themselves; a missing file is the failure of the
        phase that needs it, so that the phases that do not need it still run."""
        unknown = set(self.budgets) - set(BUDGETED)
        if unknown:
            raise InvalidInputError(
                f"budgets for unknown phases: {', '.join(sorted(unknown))}; the phases with a "
                f"budget are {', '.join(BUDGETED)} (training takes what is left)"
            )
        bad = [k for k, v in self.budgets.items() if not v >= 0]
        if bad or not self.total_s > 0:
            raise InvalidInputError(
                f"budgets must be seconds >= 0 and the total > 0: {bad or self.total_s}"
            )


class Run:
    """The phases' bookkeeping: the run's own deadline, each phase's, and the report."""

    def __init__(self, settings: RunSettings):
        self.settings = settings
        self.began = time.monotonic()
        self.end = Deadline(settings.total_s)
        settings.out.mkdir(parents=True, exist_ok=True)
        self.report: dict[str, Any] = {
            "settings": {
                k: str(v) if isinstance(v, Path) else v for k, v in asdict(settings).items()
            },
            "phases": {},
        }

    def deadline(self, name: str) -> Deadline:
        """``name``'s deadline: its budget, within what the run has left before the budgets of
        the phases that must still run after it (evaluate and pack); training has no budget of
        its own and takes all of that."""
        budgets = self.settings.budgets
        later = {"pack": (), "evaluate": ("pack",)}.get(name, ("evaluate", "pack"))
        cap = self.end.left() - sum(budgets[p] for p in later)
        return Deadline(min(budgets.get(name, cap), cap))

    def phase(self, name: str, work: Callable[[Deadline], dict]) -> None:
        """Run ``work(deadline)`` and record the figures it returns, its time and its outcome
        (a failure with its error and the end of its traceback)."""
        deadline = self.deadline(name)
        entry: dict[str, Any] = {"budget_s": round(deadline.left(), 1)}
        began = time.monotonic()
        logger.warning("phase %s: %.0f s", name, deadline.left())
        try:
            entry.update(work(deadline), status="done")
        except Exception as err:
            logger.exception("phase %s failed", name)
            entry.update(status="failed", error=f"{type(err).__name__}: {err}")
            entry["traceback"] = traceback.format_exc().splitlines()[-12:]
        entry["seconds"] = round(time.monotonic() - began, 2)
        entry["over_s"] = round(max(0.0, -deadline.left()), 2)
        self.report["phases"][name] = entry
        self.write_report()

    def skip(self, name: str, why: str) -> None:
        self.report["phases"][name] = {"status": "skipped", "why": why}
        self.write_report()

    def write_report(self) -> None:
        self.report["seconds"] = round(time.monotonic() - self.began, 2)
        text = json.dumps(self.report, indent=1, default=str) + "\n"
        atomic_write_text(self.settings.out / "report.json", text)


# ---- the run -------------------------------------------------------------------------------------


def run_oneshot(settings: RunSettings) -> dict[str, Any]:
    """Every phase in turn (module docstring); returns the report also written to
    ``settings.out/report.json``."""
    settings.check()
    run = Run(settings)
    state = phases.State(settings)
    steps = [
        ("assemble", phases.assemble, ()),
        ("queries", phases.queries, ("target",)),
        ("responses", phases.responses, ("target",)),
        ("features", phases.features, ("target", "shipped")),
        ("train", phases.train, ("train_features",)),
        ("evaluate", phases.evaluate, ("eval_features",)),
    ]
    for name, work, needs in steps:
        lacking = [need for need in needs if getattr(state, need) is None]
        if lacking:
            run.skip(name, f"nothing to work on: no {', no '.join(lacking).replace('_', ' ')}")
            continue
        run.phase(name, lambda deadline, w=work: w(state, deadline))
    run.phase("pack", lambda deadline: phases.pack(state, deadline, run.report))
    return run.report

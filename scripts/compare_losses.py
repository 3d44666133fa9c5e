"""Learning curves of drafter runs side by side (for example cross-entropy against CE + L1).

    python scripts/compare_losses.py OUT.png LABEL=RUN_DIR [LABEL=RUN_DIR ...]

Reads each run's log from its checkpoint (``RUN_DIR/checkpoint/trainer_state.json``, the
authoritative log) and draws, against the training step, for every run:

* the held-out acceptance the trainer measures by walking held-out responses: tokens per round
  with a DDTree of the trainer's walk budget (``eval_tree_tau``) and with DFlash's chain
  (``eval_walk_tau``), T = 0;
* the held-out acceptance at T = 1 given the true prefix, ``1 - TV(p, q)`` averaged over block
  positions (``eval_accept_by_position``; needs the target's stored distribution);
* the held-out cross-entropy part of the loss (``eval_ce``), the same quantity whatever the
  loss's weights, so the runs compare on it.

It also prints those figures at every evaluation, one row per run and step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from caddtree.util.plots import pyplot, save_figure

PANELS = (
    ("eval_tree_tau", "DDTree walk τ (T = 0)"),
    ("eval_walk_tau", "chain walk τ (T = 0)"),
    ("accept_t1", "mean 1 − TV per position (T = 1)"),
    ("eval_ce", "held-out cross-entropy"),
)


def evaluations(run: Path) -> list[dict]:
    """The evaluation entries of ``run``'s log, with the T = 1 acceptance averaged."""
    log = json.loads((run / "checkpoint" / "trainer_state.json").read_text(encoding="utf-8"))
    out = []
    for entry in log["log"]:
        if "eval_loss" not in entry:
            continue
        per_position = entry.get("eval_accept_by_position") or []
        accept = sum(per_position) / len(per_position) if per_position else None
        out.append({**entry, "accept_t1": accept})
    return out


def main(out: str, runs: list[str]) -> None:
    named = []
    for spec in runs:
        label, _, path = spec.partition("=")
        if not path:
            raise SystemExit(f"give runs as LABEL=RUN_DIR, not {spec!r}")
        named.append((label, evaluations(Path(path))))
    plt = pyplot()
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4 * len(PANELS), 3.4))
    for ax, (key, title) in zip(axes, PANELS):
        for label, evals in named:
            points = [(e["step"], e[key]) for e in evals if e.get(key) is not None]
            if points:
                ax.plot(*zip(*points), marker="o", ms=3, label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, out)
    for label, evals in named:
        for e in evals:
            cells = " ".join(f"{key}={e[key]:.4f}" for key, _ in PANELS if e.get(key) is not None)
            print(f"{label} step {e['step']}: {cells}")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__.split("\n\n")[1])
    main(sys.argv[1], sys.argv[2:])

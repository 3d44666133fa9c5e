"""Plot a drafter training run's learning curve (docs/smollm2-drafter-learning-curve.png).

    python scripts/plot_learning_curve.py RUN_DIR/checkpoint/trainer_state.json OUT.png

Reads the log stored in the checkpoint (the authoritative one: steps after the last checkpoint of
an interrupted call are not in it) and draws the training loss (smoothed over 25 steps), the
held-out loss, and the held-out chain acceptance per block.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from caddtree.util.plots import pyplot, save_figure


def main(state_path: str, out: str) -> None:
    log = json.loads(Path(state_path).read_text(encoding="utf-8"))["log"]
    steps = np.array([e["step"] for e in log])
    loss = np.array([e["loss"] for e in log])
    window = min(25, len(loss))
    smooth = np.convolve(loss, np.ones(window) / window, mode="valid")
    evals = [e for e in log if "eval_loss" in e]
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    left.plot(steps, loss, color="0.8", lw=0.6, label="train loss (per step)")
    left.plot(
        steps[window - 1 :], smooth, color="tab:blue", label=f"train loss ({window}-step mean)"
    )
    left.plot(
        [e["step"] for e in evals],
        [e["eval_loss"] for e in evals],
        "o-",
        color="tab:red",
        label="held-out loss",
    )
    left.set_xlabel("step")
    left.set_ylabel("position-weighted cross-entropy")
    left.legend(fontsize=8)
    right.plot(
        [e["step"] for e in evals],
        [e["eval_accept"] for e in evals],
        "o-",
        color="tab:green",
        label="chain tokens accepted / block",
    )
    right.plot(
        [e["step"] for e in evals],
        [e["eval_top1"] for e in evals],
        "s-",
        color="tab:purple",
        label="position-1 top-1",
    )
    right.set_xlabel("step")
    right.set_ylabel("held-out")
    right.legend(fontsize=8)
    fig.suptitle("DFlash drafter for SmolLM2-135M-Instruct: learning curve")
    fig.tight_layout()
    save_figure(fig, out)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])

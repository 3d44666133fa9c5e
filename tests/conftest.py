"""Shared fixtures: the tiny float64 target and drafter (in memory, and saved to disk as a user
would have them), and the ``caddtree generate`` command line on the saved pair."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from caddtree.models import TreeVerifier
from caddtree.runtime.lean import LeanVerifier
from tiny_models import MASK_TOKEN_ID, new_drafter, qwen3_target, saved_drafter, training_data
from tiny_tokenizer import tiny_tokenizer


@pytest.fixture(scope="module")
def qwen3():
    """The tiny Qwen3 target (float64, seeded: the same weights in every module)."""
    return qwen3_target()


@pytest.fixture(scope="module")
def target():
    """The tiny Qwen3 target the training tests train drafters for."""
    return qwen3_target()


@pytest.fixture(scope="module")
def data(target):
    """The training data (the target's own responses) of the training tests."""
    return training_data(target)


@pytest.fixture(scope="module")
def drafter(qwen3):
    """A random DFlash drafter for :func:`qwen3`."""
    return new_drafter(qwen3)


VERIFIERS = {"transformers": TreeVerifier, "lean": LeanVerifier}
"""The verifier of each runtime (``--runtime``)."""


@pytest.fixture(params=list(VERIFIERS))
def verifier_type(request):
    """Each runtime's verifier class in turn: the lossless tests run on both."""
    return VERIFIERS[request.param]


@pytest.fixture(scope="session")
def tiny_pair_dirs(tmp_path_factory):
    """(target_dir, draft_dir): a tiny Qwen3 target with tokenizer and a DFlash drafter in the
    released checkpoint format, both float64."""
    root = tmp_path_factory.mktemp("tiny_pair")
    target = qwen3_target()
    tokenizer = tiny_tokenizer(MASK_TOKEN_ID)
    target.generation_config.eos_token_id = tokenizer.eos_token_id
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    saved_drafter(target, root / "draft")
    return root / "target", root / "draft"


@pytest.fixture(scope="module")
def cost_file(tmp_path_factory):
    """A convex cost model saved as JSON (the servers' cost-model folder holds it)."""
    from caddtree import ConvexCostModel

    n = np.array([0, 4, 16, 64, 256])
    model = ConvexCostModel.fit({0: (n, 0.01 + 1e-4 * n + 1e-7 * n**2)}, draft_cost=0.003)
    return str(model.save(tmp_path_factory.mktemp("cost") / "cost.json"))


@pytest.fixture(scope="module")
def reference(tiny_pair_dirs, cost_file):
    """A second generator on the tiny saved pair: the expected outputs, computed while a
    server's own generator may be busy."""
    from caddtree import SpeculativeGenerator

    target, draft = tiny_pair_dirs
    return SpeculativeGenerator.from_pretrained(
        target, draft, dtype="float64", device="cpu", cost_model=cost_file
    )


@pytest.fixture
def generate_argv(tiny_pair_dirs):
    """``generate_argv(*options)``: the ``caddtree generate`` arguments that run the tiny saved
    pair in float64 on the CPU, then ``options`` (the prompt included)."""
    target, draft = tiny_pair_dirs

    def argv(*options: str) -> list[str]:
        return [
            "generate",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--dtype",
            "float64",
            "--device",
            "cpu",
            *options,
        ]

    return argv


# The tiny models gain nothing from intra-op threads, and two test processes (or CI's 2 cores)
# oversubscribe badly with them.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _deterministic_torch():
    torch.manual_seed(0)
    yield

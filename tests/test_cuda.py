"""The CUDA path: every method, both runtimes and the batched decoder reproduce plain greedy
decoding on a GPU (float64 tiny models). Skipped where torch sees no GPU (CI has none); run it
with ``pytest tests/test_cuda.py`` on a machine that has one."""

from __future__ import annotations

import os

import pytest
import torch

from caddtree import SpeculativeGenerator
from caddtree.engine.batching import BatchDecoder, GenerationRequest
from caddtree.engine.decoding import make_policy
from caddtree.runtime.lean import LeanTarget
from sampling_checks import hf_generate
from tiny_models import FEATURE_LAYER_IDS, new_drafter, qwen3_target

DEVICE = os.environ.get(
    "CADDTREE_TEST_CUDA_AS", "cuda"
)  # "cpu": check this file itself without a GPU
pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU"
)

PROMPTS = [[5, 17, 3, 44, 8], [70, 2, 2, 9, 31, 12, 60, 1, 0, 33], [11], [40, 41, 42]]
METHODS = [
    ("ar", {}),
    ("dflash", {}),
    ("ddtree", {"budget": 8}),
    ("caddtree", {"max_budget": 24}),
]


@pytest.fixture(scope="module")
def references():
    """Plain greedy decoding of each prompt on the CPU (transformers' generate)."""
    target = qwen3_target()
    return [hf_generate(target, prompt, 24) for prompt in PROMPTS]


@pytest.mark.parametrize("runtime", ["transformers", "lean"])
@pytest.mark.parametrize(("method", "settings"), METHODS)
def test_each_method_on_cuda_is_plain_greedy_decoding(
    tiny_pair_dirs, cost_file, references, runtime, method, settings
):
    target, draft = tiny_pair_dirs
    gen = SpeculativeGenerator.from_pretrained(
        target, draft, dtype="float64", device=DEVICE, cost_model=cost_file, runtime=runtime
    )
    assert gen.target.device.type == DEVICE
    for prompt, reference in zip(PROMPTS, references):
        result = gen.generate(
            prompt, method, max_new_tokens=24, temperature=0, stop_token_ids=(), **settings
        )
        assert result.token_ids == reference, (runtime, method, prompt)


def test_the_batched_decoder_on_cuda_is_plain_greedy_decoding(references):
    target = qwen3_target().to(DEVICE)
    drafter = new_drafter(qwen3_target()).to(DEVICE)
    decoder = BatchDecoder(LeanTarget(target, FEATURE_LAYER_IDS), drafter, max_batch=3, capacity=64)
    requests = [
        GenerationRequest(prompt, make_policy(method, **settings), 24)
        for prompt, (method, settings) in zip(PROMPTS, METHODS[:3] + [("ddtree", {"budget": 16})])
    ]
    done = decoder.run(requests)
    assert len(done) == len(PROMPTS)
    for request in done:
        index = PROMPTS.index(list(request.prompt_ids))
        assert request.output == references[index], request.policy.name

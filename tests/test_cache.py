"""The buffered KV-cache layer: appending writes in place, and every operation the engine and
transformers apply to a cache layer gives exactly what transformers' own ``DynamicLayer`` gives."""

from __future__ import annotations

import random

import torch
from transformers.cache_utils import DynamicLayer

from caddtree.models.target import BufferedLayer, buffered_cache, compact_cache
from tiny_models import qwen3_target


def _states(gen: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(1, 2, n, 4, generator=gen), torch.randn(1, 2, n, 4, generator=gen)


class _OneLayer:
    """Just enough of a Cache for :func:`compact_cache`: one layer."""

    def __init__(self, layer) -> None:
        self.layers = [layer]


def test_buffered_layer_equals_dynamic_layer_through_appends_compactions_and_crops():
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    buffered, plain = BufferedLayer(), DynamicLayer()
    moves = 0
    for step in range(300):
        n = rng.choice([1, 1, 3, 17, 40]) if step else 200  # a prompt, then rounds of trees
        keys, values = _states(gen, n)
        got = buffered.update(keys, values)
        want = plain.update(keys, values)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        length = buffered.get_seq_length()
        assert length == plain.get_seq_length()
        action = rng.random()
        if action < 0.6 and n > 1:  # keep the bonus and a random path, as a verification does
            keep = [0] + sorted(rng.sample(range(1, n), rng.randint(0, n - 1)))
            start = length - n
            compact_cache(_OneLayer(buffered), start, keep)
            compact_cache(_OneLayer(plain), start, keep)
        elif action < 0.7 and length > 5:
            buffered.crop(-3)
            plain.crop(-3)
        elif action < 0.72:  # something outside replaces the tensors: the buffer is rebuilt
            buffered.batch_select_indices(torch.tensor([0]))
            plain.batch_select_indices(torch.tensor([0]))
            moves += 1
        assert torch.equal(buffered.keys, plain.keys)
        assert torch.equal(buffered.values, plain.values)
    assert moves  # the rebuild path ran
    buffered.reset()
    assert buffered.get_seq_length() == 0
    keys, values = _states(gen, 5)
    assert torch.equal(buffered.update(keys, values)[0], keys)


def test_appending_writes_in_place_until_the_buffer_is_full():
    gen = torch.Generator().manual_seed(1)
    layer = BufferedLayer()
    layer.update(*_states(gen, 100))
    first = layer.keys.data_ptr()
    capacity = layer._buffers[0].shape[-2]
    assert capacity >= BufferedLayer.MIN_CAPACITY
    moved_at = []
    for _ in range(400):
        before = layer.keys.data_ptr()
        layer.update(*_states(gen, 3))
        if layer.keys.data_ptr() != before:
            moved_at.append(layer.get_seq_length())
    # 1,300 entries from a 256-entry start, growing by half each time: a handful of moves
    assert layer.keys.data_ptr() != first and 1 <= len(moved_at) <= 6
    assert all(later >= 1.4 * earlier for earlier, later in zip(moved_at, moved_at[1:]))


def test_the_verifier_and_drafter_caches_are_buffered():
    target = qwen3_target()
    cache = buffered_cache(target.config)
    assert len(cache.layers) == target.config.num_hidden_layers
    assert all(type(layer) is BufferedLayer for layer in cache.layers)
    lazy = buffered_cache()
    lazy.update(*_states(torch.Generator().manual_seed(2), 4), layer_idx=0)
    assert type(lazy.layers[0]) is BufferedLayer

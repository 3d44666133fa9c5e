"""The chunked cross-entropy through a frozen head against torch's own, value and gradient."""

from __future__ import annotations

import pytest
import torch

from caddtree.train import head_loss
from caddtree.train.head_loss import head_cross_entropy


def _case(dtype, rows=150, hidden=24, vocab=97, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(hidden, vocab, bias=bias).to(dtype).requires_grad_(False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=g))
        if bias:
            head.bias.copy_(torch.randn(vocab, generator=g))
    x = torch.randn(rows, hidden, generator=g, dtype=dtype).requires_grad_(True)
    labels = torch.randint(0, vocab, (rows,), generator=g)
    labels[torch.rand(rows, generator=g) < 0.2] = -100
    weights = torch.rand(rows, generator=g, dtype=dtype)
    return head, x, labels, weights


def _reference(head, x, labels, weights):
    logits = head(x).float() if x.dtype != torch.float64 else head(x)
    ce = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="none")
    correct = (logits.argmax(-1) == labels) & (labels >= 0)
    (grad,) = torch.autograd.grad((ce * weights).sum(), x)
    return ce.detach(), correct, grad


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_matches_torch_in_float64(monkeypatch, bias, chunk):
    monkeypatch.setattr(head_loss, "ROWS_PER_CHUNK", chunk)
    head, x, labels, weights = _case(torch.float64, bias=bias)
    ce_ref, correct_ref, grad_ref = _reference(head, x, labels, weights)
    ce, correct = head_cross_entropy(x, head, labels)
    (grad,) = torch.autograd.grad((ce * weights).sum(), x)
    assert ce.dtype == torch.float64
    torch.testing.assert_close(ce.detach(), ce_ref, rtol=1e-12, atol=1e-12)
    assert torch.equal(correct, correct_ref)
    assert bool(correct.any()) and bool((ce[labels < 0] == 0).all())
    torch.testing.assert_close(grad, grad_ref, rtol=1e-10, atol=1e-12)


def test_bfloat16_matmul_matches_autocast():
    """With a bfloat16 matmul (bfloat16 precision), the same logits as autocast's linear, so the
    same losses up to float32 summation order and gradients up to bfloat16 rounding."""
    head, x, labels, weights = _case(torch.float32, rows=300, hidden=64, vocab=513)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = head(x).float()
    ce_ref = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="none")
    correct_ref = (logits.argmax(-1) == labels) & (labels >= 0)
    (grad_ref,) = torch.autograd.grad((ce_ref * weights).sum(), x)
    ce, correct = head_cross_entropy(x, head, labels, torch.bfloat16)
    (grad,) = torch.autograd.grad((ce * weights).sum(), x)
    torch.testing.assert_close(ce.detach(), ce_ref.detach(), rtol=1e-5, atol=1e-5)
    assert torch.equal(correct, correct_ref)
    assert grad.dtype == torch.float32
    torch.testing.assert_close(grad, grad_ref, rtol=2e-2, atol=2e-3)


def test_frozen_head_and_single_backward_are_required():
    head, x, labels, _ = _case(torch.float64)
    ce, _ = head_cross_entropy(x, head, labels)
    loss = ce.sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="only once"):
        loss.backward()
    head.weight.requires_grad_(True)
    with pytest.raises(ValueError, match="frozen"):
        head_cross_entropy(x, head, labels)


def test_ties_count_for_the_first_column_as_argmax_does():
    """Two columns with equal logits at the maximum: only a label on the first is correct."""
    head = torch.nn.Linear(4, 12, bias=False).double().requires_grad_(False)
    with torch.no_grad():
        head.weight.zero_()
        head.weight[3, 0] = head.weight[7, 0] = 10.0
    x = torch.tensor([[1.0, 0.5, -0.5, 2.0]] * 3, dtype=torch.float64)
    labels = torch.tensor([3, 7, 5])
    _, correct = head_cross_entropy(x, head, labels)
    assert correct.tolist() == [True, False, False]
    assert torch.equal(correct, head(x).argmax(-1) == labels)

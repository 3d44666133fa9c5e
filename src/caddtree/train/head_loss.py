"""Cross-entropy through a frozen vocabulary head, without materialising float32 logits.

:func:`head_cross_entropy` gives what ``F.cross_entropy(head(hidden).float(), labels,
reduction="none")`` and ``logits.argmax(-1) == labels`` give, with the gradient with respect to
``hidden``. The head's matmul runs once, in ``dtype``; its logits are kept in that dtype (half
of float32's bytes under bfloat16) and every element-wise step (the maximum, the log-sum-exp, the
label's logit, and in the backward pass the softmax minus the one-hot) runs on a few rows at a
time in float32 while they are in cache, the backward writing its gradient over the logits it no
longer needs. Where the loss needs the whole log-softmax (the L1 and LK terms), the caller keeps
the plain path.
"""

from __future__ import annotations

import torch

__all__ = ["DEVICE_ROWS_PER_CHUNK", "ROWS_PER_CHUNK", "head_cross_entropy"]

ROWS_PER_CHUNK = 64
"""Rows of logits whose element-wise work runs at once on a CPU: 64 rows of an 8k draft
vocabulary are 2 MB of float32, a core's L2 cache on the CPUs this was written for."""

DEVICE_ROWS_PER_CHUNK = 4096
"""The same on an accelerator, where each step is a kernel launch and memory is plentiful."""


def _chunk(device: torch.device) -> int:
    return ROWS_PER_CHUNK if device.type == "cpu" else DEVICE_ROWS_PER_CHUNK


def _float_rows(rows: torch.Tensor) -> torch.Tensor:
    return rows if rows.dtype in (torch.float32, torch.float64) else rows.float()


class _HeadCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, dtype):
        logits = hidden.to(dtype) @ weight.to(dtype).T
        if bias is not None:
            logits += bias.to(dtype)
        n = logits.shape[0]
        precision = torch.float64 if dtype == torch.float64 else torch.float32
        lse = torch.empty(n, dtype=precision, device=logits.device)
        ce, correct = torch.empty_like(lse), torch.empty(n, dtype=torch.bool, device=lse.device)
        valid = labels >= 0
        safe = labels.clamp(min=0)
        step = _chunk(logits.device)
        for s in range(0, n, step):
            e = min(s + step, n)
            rows = _float_rows(logits[s:e])
            top, best = rows.max(-1)
            lse[s:e] = top + (rows - top[:, None]).exp_().sum(-1).log_()
            picked = rows.gather(1, safe[s:e, None])[:, 0]
            ce[s:e] = torch.where(valid[s:e], lse[s:e] - picked, 0.0)
            correct[s:e] = (best == labels[s:e]) & valid[s:e]
        ctx.save_for_backward(logits, weight, lse, labels)
        ctx.hidden_dtype = hidden.dtype
        ctx.mark_non_differentiable(correct)
        return ce, correct

    @staticmethod
    def backward(ctx, grad_ce, _grad_correct):
        if getattr(ctx, "spent", False):  # the first backward wrote its gradient over the logits
            raise RuntimeError("head_cross_entropy's graph can be differentiated only once")
        ctx.spent = True
        logits, weight, lse, labels = ctx.saved_tensors
        scale = torch.where(labels >= 0, grad_ce, 0.0)
        safe = labels.clamp(min=0)
        step = _chunk(logits.device)
        for s in range(0, logits.shape[0], step):
            e = min(s + step, logits.shape[0])
            grad = _float_rows(logits[s:e]).sub_(lse[s:e, None]).exp_()
            grad.scatter_add_(1, safe[s:e, None], -torch.ones_like(lse[s:e, None]))
            logits[s:e] = grad.mul_(scale[s:e, None])  # the logits are not needed again
        grad_hidden = (logits @ weight.to(logits.dtype)).to(ctx.hidden_dtype)
        return grad_hidden, None, None, None, None


def head_cross_entropy(
    hidden: torch.Tensor,
    head: torch.nn.Linear,
    labels: torch.Tensor,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``hidden`` [N, H]: the cross-entropy of ``head``'s logits against ``labels``
    [N] (0 where a label is negative: ignored) and whether the logits' argmax is the label (the
    first of equal maxima, as ``argmax``; False where ignored). ``head`` is frozen (no gradient
    reaches its weights); its matmul runs in ``dtype`` (default: the head's)."""
    if head.weight.requires_grad:
        raise ValueError("head_cross_entropy takes a frozen head (requires_grad False)")
    dtype = dtype or head.weight.dtype
    return _HeadCrossEntropy.apply(hidden, head.weight, head.bias, labels, dtype)

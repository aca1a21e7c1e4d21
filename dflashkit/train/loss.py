"""The drafter's training loss over blocks, the lm_head applied in chunks (docs/design.md section 7, "The loss in
detail"): slot k weighs exp(-(k-1)/gamma), normalised over the whole optimiser step, so the split does not matter."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflashkit.drafter.head import LOGIT_ELEMENTS, scaled


def slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[B] float32: 0 for slot 0, exp(-(k-1)/gamma) for slot k >= 1."""
    w = torch.exp(-(torch.arange(block_size, dtype=torch.float32) - 1) / gamma)
    w[0] = 0.0
    return w


class ChunkedHeadLoss(torch.autograd.Function):
    """sum_i row_w[i] * loss_i over `chunk` rows at a time, the [N, H] gradient computed in the forward so no logits are
    kept. hidden [N, H]; weight [V, H] frozen; labels [N] (-100: none) -> (loss, correct [N], top [N, top_k])."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, row_w, target, chunk: int, kind: str, scale=(1.0, None), top_k: int = 0):
        need_grad, n = ctx.needs_input_grad[0], hidden.shape[0]
        chunk = max(1, min(chunk, LOGIT_ELEMENTS // weight.shape[0]))  # bounded whatever the vocabulary
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        correct = torch.zeros(n, dtype=torch.bool, device=hidden.device)
        grad = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_grad else None
        top = torch.zeros(n, top_k, dtype=torch.long, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, n, chunk):
                e = min(n, s + chunk)
                logits, dlogits = scaled(F.linear(hidden[s:e].to(weight.dtype), weight).float(), *scale)  # [c, V]
                if top_k:
                    top[s:e] = logits.topk(top_k, dim=-1).indices
                logq, lab, w = logits.log_softmax(-1), labels[s:e], row_w[s:e]
                correct[s:e] = logits.argmax(-1) == lab
                if kind == "ce":
                    ok, safe = lab >= 0, lab.clamp(min=0)
                    nll = -logq.gather(1, safe[:, None])[:, 0]
                    total += (w * torch.where(ok, nll, 0.0)).sum()
                    if need_grad:
                        d = logq.exp()
                        d[torch.arange(e - s, device=d.device), safe] -= 1.0
                        d *= (w * ok)[:, None]
                else:
                    logp = F.linear(target[s:e].to(weight.dtype), weight).float().log_softmax(-1)
                    p = logp.exp()
                    total += (w * (p * (logp - logq)).sum(-1)).sum()
                    if need_grad:
                        d = (logq.exp() - p) * w[:, None]
                if need_grad:
                    grad[s:e] = ((d * dlogits).to(weight.dtype) @ weight).float()
        ctx.save_for_backward(grad if need_grad else torch.empty(0))
        ctx.hidden_dtype = hidden.dtype
        ctx.mark_non_differentiable(correct, top)
        return total, correct, top

    @staticmethod
    def backward(ctx, g_total, g_correct, g_top):
        (grad,) = ctx.saved_tensors
        return ((grad * g_total).to(ctx.hidden_dtype) if ctx.needs_input_grad[0] else None,) + (None,) * 8


def block_targets(labels: torch.Tensor, head, slot_w: torch.Tensor, kind: str):
    """labels [b, n, B] (-100: none) -> (slots with a label, draft-vocabulary index, w_k where supervised else 0)."""
    rows = labels >= 0
    index = head.to_index(labels)
    supervised = rows & (index >= 0) if kind == "ce" else rows
    return rows, index, torch.where(supervised, slot_w.to(labels.device), 0.0)


def step_weight(labels: torch.Tensor, head, slot_w: torch.Tensor, kind: str) -> float:
    """The normaliser contribution of one micro-batch: sum of w_k over its supervised slots."""
    return float(block_targets(labels, head, slot_w, kind)[2].sum())


def predecessors(block_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[b, n, B] the true token before each slot's label: the anchor for slot 1, label k-1 for slot k."""
    pred = labels.roll(1, dims=-1)
    pred[..., 1] = block_ids[..., 0]
    return pred


def block_loss(hidden, labels, slot_w, head, kind: str, norm: float, target_hidden=None, anchors=None,
               chunk: int = 2048, selector=None, pred=None, alpha: float = 1.0):
    """hidden [b, n*B, H]; labels [b, n, B]; norm: the step's total weight; target_hidden [b, T, H] (kl: slot k of the
    block at a reads row a+k-1) -> (sum w_k l_k / norm, stats of summed counts)."""
    b, n, B = labels.shape
    rows, index, weight = block_targets(labels, head, slot_w, kind)
    h, w, idx = hidden.reshape(b, n, B, -1)[rows], weight[rows], index[rows]
    bi, ni, slot = rows.nonzero(as_tuple=True)  # of each row of h, in the same (row-major) order
    target = target_hidden[bi, (anchors[bi, ni] + slot - 1).clamp(min=0)] if kind == "kl" else None
    loss, correct, top = ChunkedHeadLoss.apply(h, head.weight, idx, w / norm, target, chunk, kind, head.scaling,
                                               selector.top_k if selector is not None else 0)
    first = slot == 1
    stats = {"slots": int(rows.sum()), "oov": int((idx < 0).sum()), "pos1": int(first.sum()),
             "pos1_correct": int(correct[first].sum()), "correct": int(correct.sum())}
    if selector is not None:
        sel, picked = selector_loss(selector, head, h, top, idx, pred[rows], w / norm)
        loss = loss + alpha * sel
        stats.update(selector_slots=int((idx >= 0).sum()), selector_correct=int(picked.sum()))
    return loss, stats


def selector_loss(selector, head, h, top, idx, pred, row_w):
    """DFlash2's loss: sum_i row_w[i] * CE(scores_i, true candidate), which replaces the last one when absent."""
    k, ok, hit = top.shape[1], idx >= 0, top == idx[:, None]
    present = hit.any(-1)
    cands = top.clone()
    cands[:, -1] = torch.where(present | ~ok, top[:, -1], idx.clamp(min=0))
    target = torch.where(present, hit.int().argmax(-1), k - 1)
    w_c = head.weight[cands]  # [N, k, H]
    raw = torch.einsum("nh,nkh->nk", h.to(w_c.dtype), w_c).float()
    unary = scaled(raw, *head.scaling)[0]
    scores = selector.scores(h, pred.clamp(min=0), head.to_tokens(cands), unary)
    nll = F.cross_entropy(scores.float(), target, reduction="none")
    return (row_w * ok * nll).sum(), ok & (scores.argmax(-1) == target)

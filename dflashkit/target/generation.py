"""Batched greedy generation with left padding: the target's own answers, for caches and training data."""

from __future__ import annotations

from collections.abc import Iterator

import torch


@torch.no_grad()
def iter_generate_greedy(target, prompts: list[list[int]], max_new_tokens: int,
                         batch_size: int = 8) -> Iterator[tuple[int, list[int]]]:
    """Yield (prompt index, completion ids) batch by batch, so callers can persist as they go.

    Prompts are batched by length to waste little on padding; a completion ends with the first stop token
    (kept, since the target produced it) or at max_new_tokens. Output equals batch-size-1 greedy decoding.
    """
    todo = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    pad = target.tokenizer.pad_token_id
    if pad is None:
        pad = target.stop_token_ids[0] if target.stop_token_ids else 0
    stops = set(target.stop_token_ids)
    dev = target.device
    for s in range(0, len(todo), batch_size):
        idx = todo[s : s + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        att = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            p = prompts[i]
            ids[r, width - len(p):] = torch.tensor(p)
            att[r, width - len(p):] = 1
        out = target.model.generate(
            input_ids=ids.to(dev), attention_mask=att.to(dev), max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=sorted(stops) or None, pad_token_id=pad, top_p=None, top_k=None, temperature=None,
        )
        for r, i in enumerate(idx):
            comp = out[r, width:].tolist()
            for j, t in enumerate(comp):
                if t in stops:
                    comp = comp[: j + 1]
                    break
            yield i, comp

"""Batched generation with left padding: the target's own answers, for caches and training data, equal to
batch-size-1 greedy decoding, features recorded while generating (docs/design.md, "Batched generation")."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.nn.utils.rnn import pad_sequence


def _batches(target, prompts: list[list[int]], batch_size: int):
    """(prompt indices, left-padded ids, attention mask) per batch, shortest prompts first."""
    todo = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for s in range(0, len(todo), batch_size):
        idx = todo[s : s + batch_size]
        rows = [torch.tensor(prompts[i], dtype=torch.long) for i in idx]
        ids = pad_sequence(rows, batch_first=True, padding_value=_pad_id(target), padding_side="left")
        att = pad_sequence([torch.ones_like(r) for r in rows], batch_first=True, padding_side="left")
        yield idx, ids.to(target.device), att.to(target.device)


def _pad_id(target) -> int:
    pad = target.tokenizer.pad_token_id
    return pad if pad is not None else (target.stop_token_ids or [0])[0]


def _generate(target, ids, att, max_new_tokens: int, temperature: float = 0.0, **extra):
    stops = sorted(set(target.stop_token_ids))
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
        dict(do_sample=False, top_p=None, top_k=None, temperature=None)
    return target.model.generate(input_ids=ids, attention_mask=att, max_new_tokens=max_new_tokens,
                                 eos_token_id=stops or None, pad_token_id=_pad_id(target), **sampling, **extra)


def _cut(tokens: list[int], stops: set[int]) -> list[int]:
    return next((tokens[: j + 1] for j, t in enumerate(tokens) if t in stops), tokens)


@torch.no_grad()
def iter_generate_greedy(target, prompts: list[list[int]], max_new_tokens: int,
                         batch_size: int = 8) -> Iterator[tuple[int, list[int]]]:
    """Yield (prompt index, completion ids) batch by batch, so callers can persist as they go."""
    stops = set(target.stop_token_ids)
    for idx, ids, att in _batches(target, prompts, batch_size):
        out = _generate(target, ids, att, max_new_tokens)
        for r, i in enumerate(idx):
            yield i, _cut(out[r, ids.shape[1]:].tolist(), stops)


@torch.no_grad()
def iter_generate_with_features(target, prompts: list[list[int]], max_new_tokens: int, layer_ids, batch_size: int = 8,
                                temperature: float = 0.0) -> Iterator[tuple[int, list[int], dict[int, torch.Tensor]]]:
    """Yield (prompt index, completion ids, {layer id: [prompt + completion, H] CPU features}) batch by batch;
    temperature > 0 samples from torch's global generator (seed it for repeatable samples)."""
    stops = set(target.stop_token_ids)
    for idx, ids, att in _batches(target, prompts, batch_size):
        width = ids.shape[1]
        with target.recording(layer_ids) as steps:
            out = _generate(target, ids, att, max_new_tokens, temperature, return_dict_in_generate=True)
            seq, generated = out.sequences, out.sequences.shape[1] - width
            full = torch.cat([att, torch.ones_like(seq[:, width:])], dim=1)  # the last token is still to be fed
            target.decoder(input_ids=seq[:, -1:], attention_mask=full, past_key_values=out.past_key_values,
                           position_ids=full.sum(1, keepdim=True) - 1, use_cache=True)
        feats = {}
        for layer, outs in steps.items():
            prefill, rest = outs[0], torch.cat(outs[1:], dim=1)  # rest[:, k]: completion token k's row
            if rest.shape[1] != generated:  # a generate loop that did not feed one token per step
                raise RuntimeError(f"recorded {rest.shape[1]} steps for {generated} generated tokens")
            feats[layer] = (prefill.cpu(), rest.cpu())
        for r, i in enumerate(idx):
            comp = _cut(seq[r, width:].tolist(), stops)
            p = len(prompts[i])
            yield i, comp, {layer: torch.cat([pre[r, width - p:], rest[r, : len(comp)]]).clone()
                            for layer, (pre, rest) in feats.items()}

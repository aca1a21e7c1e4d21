"""How long each demo stage will take on this machine, from a short measurement at the start (about a minute).

Constants measured on one CPU were off by 2x on another (a float32-only CPU ran the data stage in 17 min against
an estimate of 9), so the demo times the operations its stages repeat and scales them:
- a batched greedy step and prefill at the data stage's batch size and typical context (data, cache stages);
- a one-token forward on the reference backend's kernels (bench's ar, and the offline eval, which scales with the
  machine).
Per-method factors (time per token relative to plain decoding) come from measured demo runs; they are the one
part that depends on the drafter, so the bench estimate is the loosest.
On a 2-core bf16 CPU the probe reads the batched step 1.5x slow: at 32 or 96 rows its step at the mid-answer context
is 0.20 s (0.49 s) where the stage's real prompts average 0.13 s (0.32 s) per step, so the plan gives that machine
about 30% less than its budget (cpu-2026-12-02-demo-bf16.md). A step of stretched prompts grows with the context
(0.13 s at 53 tokens, 0.22 s at 149) more than the stage's steps do; not denormals, not the attention mask, not
generate vs a direct call. Float32 estimates landed within 25%.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch

from dflashkit.decode.cost import measure_cost_curve
from dflashkit.decode.methods import parse_method

# time per generated token relative to plain decoding, from measured runs on coding-10 (float32 and the bf16 demo
# report, which agree within 10%)
METHOD_FACTOR = {"ar": 1.0, "ar-stock": 1.0, "ngram": 0.6, "hybrid": 0.6, "ddtree": 1.2, "chain": 1.0,
                 "prompt-lookup": 0.7, "hf-generate": 1.05,
                 # the plain peer, against the stock one-token forward (bf16, 2-core Zen 5: ar 34.5, llama.cpp 146
                 # tok/s in one bench; cpu-2026-12-03-zen5-static-gc-bf16.md), rounded up
                 "llama.cpp": 0.3}
ANSWER_FILL = 0.9  # answers stop early: coding-10's 10 answers filled 2281 of 2560 tokens
EVAL_STEPS_PER_TOKEN = 0.3  # offline eval of one cached token (3 drafters x 2 anchor schedules), in verify steps:
#                             103 s for coding-10's cache at an 82 ms verify (runs/demo-small)
TRAIN_OVERHEAD_S = 10.0  # saving the untrained twin and the first checkpoint after the time box (measured 3 s)
BENCH_OVERHEAD_S = 20.0  # the cost curve and the warm-up
# the first compile of the static decoder's steps on 2 cores (native kernels: about 1 min, its tree widths 1 more;
# 10 s from inductor's cache), and llama.cpp's first GGUF conversion and server start
PEER_START_S = {"llama.cpp": 30.0}
# --engine auto: the probe and the static step's first compile (2-core Xeon: ~90 s, its tree widths ~60 more), and
# plain decoding on the other backend beside ours (bench holds the static backend to hf): about one more ar row
ENGINE_START_S = 150.0


@dataclass
class Probe:
    batch: int
    context: int
    batch_step_s: float  # one greedy step of `batch` rows at `context` tokens
    prefill_token_s: float  # per token of a batched prefill
    verify_s: float  # a one-token forward at `context` tokens
    seconds: float  # what the probe itself took


STEPS = 8  # timed greedy steps; the median is the step time


@torch.no_grad()
def probe(target, prompt_ids: list[int], batch: int, context: int) -> Probe:
    """Times the data stage's operations on `batch` copies of a prompt stretched to `context` tokens, with five
    layers recorded as generation records them: the batched prefill once, then STEPS one-token steps on its KV, each
    timed (the median is the step). Taking the step as the difference of two whole generations of 4 and 12 tokens
    read 0.10-0.40 s for a 0.25 s step: 8 steps are a small difference between two 12 s prefills."""
    t0 = time.perf_counter()
    ids = torch.tensor([(prompt_ids * math.ceil(context / max(1, len(prompt_ids))))[:context]] * batch,
                       device=target.device)
    with target.recording(target.default_layer_ids(5)):
        target.model(input_ids=ids[:, :8], use_cache=True, logits_to_keep=1)  # warm-up
        t = time.perf_counter()
        out = target.model(input_ids=ids, use_cache=True, logits_to_keep=1)
        prefill = (time.perf_counter() - t) / ids.numel()
        steps = []
        for k in range(STEPS + 1):  # the first step warms the one-token shapes up
            t = time.perf_counter()
            out = target.model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values,
                               use_cache=True, logits_to_keep=1)
            steps.append(time.perf_counter() - t)
    step = statistics.median(steps[1:])
    verify = measure_cost_curve(target, ns=(1,), context=context, repeats=5)(1)
    return Probe(batch, context, step, prefill, verify, time.perf_counter() - t0)


def data_seconds(p: Probe, num_prompts: int, batch: int, max_new_tokens: int, context: int) -> float:
    """Generation, features recorded as it goes: every batch runs to max_new_tokens (one long answer keeps the
    batch going) and one step more, after a prefill over its prompts. `context`: the mean prompt length. A step
    scales with the batch rows and the mid-answer context from the probe's."""
    batches, mid = math.ceil(num_prompts / batch), context + max_new_tokens / 2
    step = p.batch_step_s * (batch / p.batch) ** 0.5 * (0.5 + 0.5 * mid / p.context)
    return batches * (max_new_tokens + 1) * step + num_prompts * context * p.prefill_token_s


def method_factor(method: str) -> float:
    try:
        family = parse_method(method)[0]
    except ValueError:
        family = method
    return METHOD_FACTOR.get(method, METHOD_FACTOR.get(family, 1.0))


def bench_seconds(p: Probe, runs: list[tuple[int, list[str], int]]) -> float:
    """runs: (prompts, methods, max new tokens) per suite. Tokens x a one-token forward x the method's factor."""
    def token_s(method: str) -> float:
        return p.verify_s * method_factor(method)

    starts = ENGINE_START_S + sum(PEER_START_S.get(m, 0.0) for m in {m for _, methods, _ in runs for m in methods})
    return BENCH_OVERHEAD_S + starts + sum(n * tokens * ANSWER_FILL * token_s(m) for n, methods, tokens in runs
                                           for m in methods)


def eval_seconds(p: Probe, cached_tokens: int) -> float:
    return 10 + cached_tokens * EVAL_STEPS_PER_TOKEN * p.verify_s

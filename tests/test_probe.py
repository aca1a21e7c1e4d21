"""Stage estimates scale the probe's measured step costs by what each stage repeats (demo/probe.py)."""

from dataclasses import replace

import pytest

from dflashkit.demo.probe import ANSWER_FILL, ENGINE_START_S, METHOD_FACTOR, Probe, bench_seconds, data_seconds, eval_seconds, method_factor

PROBE = Probe(batch=32, context=350, batch_step_s=0.4, prefill_token_s=1e-4, verify_s=0.06, seconds=15.0)


def test_data_seconds_is_steps_of_every_batch_plus_the_prefill():
    # 64 prompts of 300 tokens in batches of 32, mid-answer at the probe's context (350): 2 batches x (100 steps + the
    # one that records the last token's features) x 0.4 s, and the prefill over every prompt (features are recorded
    # while generating: no second pass over prompt + answer)
    got = data_seconds(PROBE, num_prompts=64, batch=32, max_new_tokens=100, context=300)
    assert got == pytest.approx(2 * 101 * 0.4 + 64 * 300 * 1e-4)
    # a partial last batch still runs every step; a smaller batch costs less per step (sqrt of the rows)
    assert data_seconds(PROBE, 65, 32, 100, 300) > got
    assert data_seconds(PROBE, 8, 8, 100, 300) < data_seconds(PROBE, 8, 32, 100, 300)


def test_bench_seconds_sums_tokens_times_the_verify_cost_and_each_methods_factor():
    runs = [(10, ["ar", "ngram", "ddtree-8"], 256), (12, ["ar", "hybrid-auto", "ar-stock"], 128)]
    first = 0.06 * 256 * ANSWER_FILL * 10 * (1.0 + METHOD_FACTOR["ngram"] + METHOD_FACTOR["ddtree"])
    second = 0.06 * 128 * ANSWER_FILL * 12 * (1.0 + METHOD_FACTOR["hybrid"])
    stock = 0.06 * 128 * ANSWER_FILL * 12 * METHOD_FACTOR["ar-stock"]
    assert bench_seconds(PROBE, runs) == pytest.approx(20.0 + ENGINE_START_S + first + second + stock)
    assert bench_seconds(replace(PROBE, verify_s=0.03), runs) == pytest.approx(20.0 + ENGINE_START_S + 0.5 * (first + second + stock))
    assert method_factor("hybrid-auto") == METHOD_FACTOR["hybrid"] and method_factor("ar-stock") == METHOD_FACTOR["ar-stock"]
    assert method_factor("something-new") == 1.0


def test_eval_seconds_grow_with_the_cached_tokens():
    assert eval_seconds(PROBE, 2000) > eval_seconds(PROBE, 1000) > 10

"""Prompt files in the formats the field uses, multi-turn decoding and per-category results (issue 21)."""

import json

import pytest
import torch

from dflashkit.prompts import PromptItem, load_prompts, select_prompts
from helpers import standard_set

pytestmark = pytest.mark.usefixtures("one_thread")


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


SHAREGPT = [
    {"id": "s1", "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Name a fruit."},
                                   {"from": "gpt", "value": "FILE-ANSWER-ONE"}, {"from": "human", "value": "Another?"},
                                   {"from": "gpt", "value": "FILE-ANSWER-TWO"}]},
    {"conversations": [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "hi"}]},
]


def test_every_format_by_its_fields(tmp_path):
    rows = [{"id": "ours", "prompt": "p"},
            {"id": "chat", "messages": [{"role": "user", "content": "m"}]},
            {"messages": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
                          {"role": "user", "content": "q2"}]},
            {"turns": ["t1", "t2"]},
            {"question_id": 81, "category": "writing", "turns": ["w"]},
            SHAREGPT[0]]
    suite = load_prompts(_write(tmp_path / "mixed.jsonl", rows))
    assert suite.ids() == ["ours", "chat", "mixed-3", "mixed-4", "81", "s1"]  # no id: file stem + line
    assert [it.category for it in suite.items] == ["mixed"] * 4 + ["writing", "mixed"]
    assert [it.num_turns for it in suite.items] == [1, 1, 2, 2, 1, 2]
    openai, turns, share = suite.items[2], suite.items[3], suite.items[5]
    assert turns.messages == ({"role": "user", "content": "t1"}, {"role": "user", "content": "t2"})
    assert share.messages[0] == {"role": "system", "content": "Be brief."}
    assert share.messages[2] == {"role": "assistant", "content": "FILE-ANSWER-ONE"}
    # turn k: the head, earlier turns with the given answers (the target's) or the file's own, then user turn k
    assert share.turn(1, ["mine"]) == [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Name a fruit."},
                                       {"role": "assistant", "content": "mine"}, {"role": "user", "content": "Another?"}]
    assert share.turn(1)[2]["content"] == "FILE-ANSWER-ONE"
    assert share.file_answer(1) == "FILE-ANSWER-TWO" and openai.file_answer(1) is None
    assert openai.turn(1)[1] == {"role": "assistant", "content": "a1"}
    with pytest.raises(ValueError, match="no answer to user turn 1"):
        turns.turn(1)  # a turns file holds no answers: the target must give them
    (tmp_path / "b").mkdir()
    rows[4]["category"] = "relabelled"
    again = load_prompts(_write(tmp_path / "b" / "mixed.jsonl", rows))
    assert again.content_hash == suite.content_hash  # categories are labels; the hash is ids + messages


@pytest.mark.parametrize("row, words", [
    ({"conversations": [{"from": "robot", "value": "x"}]}, ["conversations[0]", "'robot'", "human"]),
    ({"conversations": [{"from": "human"}]}, ["conversations[0]", "'value'"]),
    ({"turns": "just text"}, ["'turns'", "list"]),
    ({"turns": ["ok", ""]}, ["'turns'"]),
    ({"text": "x", "label": 1}, ["no prompt field", "label, text", "conversations", "turns", "messages"]),
    ({"turns": ["a"], "prompt": "b"}, ["both 'prompt' and 'turns'"]),
    ({"id": "", "prompt": "x"}, ["'id'", "empty"]),
    ({"question_id": 3.5, "turns": ["x"]}, ["'question_id'"]),
    ({"prompt": "x", "category": 7}, ["'category'"]),
    ({"messages": [{"role": "system", "content": "s"}]}, ["no user message"]),
])
def test_bad_rows_name_line_field_and_fix(tmp_path, row, words):
    path = _write(tmp_path / "bad.jsonl", [{"prompt": "fine"}, row])
    with pytest.raises(ValueError) as info:
        load_prompts(path)
    msg = str(info.value)
    assert "bad.jsonl:2" in msg and "\n" not in msg
    for w in words:
        assert w in msg, (w, msg)


def test_files_joined_by_commas_and_per_category(tmp_path):
    a = _write(tmp_path / "gsm.jsonl", [{"turns": [f"g{i}"]} for i in range(3)])
    b = _write(tmp_path / "mt.jsonl", [{"turns": [f"m{i}", "more"]} for i in range(3)])
    suite = load_prompts(f"{a},{b}")
    assert suite.categories() == ["gsm", "mt"] and suite.ids()[:2] == ["gsm-1", "gsm-2"]
    picked = select_prompts(f"{a},{b}", per_category=2)
    assert picked.ids() == ["gsm-1", "gsm-2", "mt-1", "mt-2"]
    assert select_prompts(f"{a},{b}", num_prompts=3, per_category=2).ids() == ["gsm-1", "gsm-2", "mt-1"]
    c = _write(tmp_path / "c.jsonl", [{"id": "gsm-1", "prompt": "x"}])
    with pytest.raises(ValueError, match="also in"):
        load_prompts(f"{a},{c}")


@pytest.mark.parametrize("rel", ["spec-bench/question.jsonl", "deepspec/gsm8k.jsonl", "deepspec/math500.jsonl",
                                 "deepspec/mbpp.jsonl", "deepspec/mt-bench.jsonl"])
def test_standard_sets_load(rel):
    suite = load_prompts(standard_set(rel))
    assert len(set(suite.ids())) == len(suite) >= 2
    if rel.startswith("spec-bench"):
        assert {"writing", "math", "translation"} <= set(suite.categories())
        assert all(it.num_turns == 2 for it in suite.items if it.category == "writing")
    else:
        assert suite.categories() == [rel.split("/")[1].removesuffix(".jsonl")]
    if "mt-bench" in rel:
        assert all(it.num_turns == 2 for it in suite.items)


def test_second_turn_is_asked_after_the_targets_own_answer(tiny_targets):
    from dflashkit.decode.conversation import decode_conversation
    from dflashkit.decode.speculative import generate

    target = tiny_targets["llama"]
    item = PromptItem("c", ({"role": "user", "content": "first question"},
                            {"role": "assistant", "content": "FILE ANSWER"},
                            {"role": "user", "content": "second question"}))
    seen = []

    def run(ids):
        seen.append(ids)
        return generate(target, ids, "ar", max_new_tokens=5)

    c = decode_conversation(target, item, run)
    first = c.generation.tokens[: c.lengths[0]]
    answer = target.decode(first)
    assert seen == c.prompts and len(c.prompts) == 2 and sum(c.lengths) == len(c.generation.tokens)
    assert c.prompts[1] == target.chat_ids([item.messages[0], {"role": "assistant", "content": answer},
                                            item.messages[2]])
    assert answer in target.decode(c.prompts[1]) and "FILE ANSWER" not in target.decode(c.prompts[1])
    assert len(c.generation.accepted) == len(c.generation.tokens) - 2  # ar: one round per token after each prefill


@pytest.mark.slow  # a whole bench or compare folder, figures included
def test_bench_runs_every_turn_and_reports_per_category(tiny_targets, tmp_path):
    from dflashkit.measure.bench import bench_markdown, run_bench, write_bench

    target = tiny_targets["llama"]
    suite = select_prompts(str(standard_set("spec-bench/question.jsonl")), per_category=1)
    prompts = [(it.id, it) for it in suite.items]
    res = run_bench(target, None, prompts, ["ar", "ngram"], max_new_tokens=5, progress=False, warmup=False, predict=False)
    assert res["mismatches"] == [] and set(res["categories"]) == set(suite.categories())
    for r in res["runs"]:
        item = next(it for it in suite.items if it.id == r["prompt"])
        assert len(r["turns"]) == item.num_turns and sum(r["turns"]) == len(r["tokens"])
    overall = res["methods"]["ar"]["new_tokens"]
    assert overall == sum(s["ar"]["new_tokens"] for s in res["categories"].values())
    md = bench_markdown(res)
    assert "## Per category" in md and "| writing | 1 |" in md and "| overall | " in md
    paths = write_bench(res, tmp_path / "b")
    assert tmp_path / "b" / "categories.png" in paths


@pytest.mark.slow  # a whole bench or compare folder, figures included
def test_cli_bench_on_spec_bench_deepspec_and_sharegpt(tiny_dirs, tmp_path, capsys):
    from dflashkit.cli import main

    share = _write(tmp_path / "share.jsonl", SHAREGPT)
    base = ["bench", "--no-predict", "--target", str(tiny_dirs["llama"]), "--methods", "ar,ngram", "--max-new-tokens", "3",
            "--per-category", "1"]
    for path in (standard_set("spec-bench/question.jsonl"), standard_set("deepspec/mt-bench.jsonl"), share):
        out = tmp_path / path.stem
        assert main(base + ["--prompts", str(path), "--out", str(out)]) == 0
        printed = capsys.readouterr().out
        res = json.loads((out / "results.json").read_text())
        cats = load_prompts(path).categories()
        assert list(res["categories"]) == cats and "## Per category" in printed
        assert res["cost_models"] == {}  # --no-predict: no engine samples, no cost models
        assert all(len(ids) <= 1 for ids in [[p for p in res["config"]["prompts"]
                                              if res["config"]["categories"][p] == c] for c in cats])
    assert main(base[:-2] + ["--per-category", "0", "--prompts", str(share)]) == 2
    assert "--per-category 0" in capsys.readouterr().err
    assert main(base + ["--prompts", str(share), "--offline", str(tmp_path)]) == 2
    assert "--offline and --no-predict" in capsys.readouterr().err
    assert main(["generate", "--target", str(tiny_dirs["llama"]), "--prompts", str(share), "--method", "ngram",
                 "--max-new-tokens", "3", "--json"]) == 0
    recs = json.loads(capsys.readouterr().out)
    assert [len(r["turns"]) for r in recs] == [2, 1] and recs[0]["category"] == "share"
    assert len(recs[0]["prompt_tokens"]) == 2 and recs[0]["prompt_tokens"][1] > recs[0]["prompt_tokens"][0]


# ---- training data and caches from these formats ------------------------------------------------------------

def test_data_generate_regenerates_every_turn_unless_asked_for_the_files_answers(tiny_dirs, tiny_targets, tmp_path,
                                                                                  capsys):
    from dflashkit.cache.sequences import generate_sequences, read_sequences
    from dflashkit.cli import main
    from dflashkit.errors import DFlashError
    from helpers import greedy_reference

    target = tiny_targets["llama"]
    share = _write(tmp_path / "share.jsonl", SHAREGPT)
    out = tmp_path / "seq.jsonl"
    base = ["data", "generate", "--target", str(tiny_dirs["llama"]), "--prompts", str(share), "--max-new-tokens", "6"]
    assert main(base + ["--out", str(out)]) == 0
    assert "the target's own answers" in capsys.readouterr().out
    head, recs = read_sequences(out)
    by_id = {r["id"]: r for r in recs}
    assert head["responses"] == "target" and set(by_id) == {"s1#1", "s1#2", "share-2"}
    item = load_prompts(share).items[0]
    first, second = by_id["s1#1"], by_id["s1#2"]
    assert second["prompt_ids"] == target.chat_ids(item.turn(1, [first["completion"]]))  # the target's own answer
    stops = set(target.stop_token_ids)
    for r in recs:  # every assistant turn is the target's greedy answer, none the file's
        assert r["completion_ids"] == greedy_reference(target, r["prompt_ids"], 6, stops)
        assert "FILE-ANSWER" not in target.tokenizer.decode(r["prompt_ids"] + r["completion_ids"])
    assert [r["turn"] for r in recs] == [1, 1, 2]  # round by round: every first turn before any second one

    own = tmp_path / "own.jsonl"
    assert main(base + ["--out", str(own), "--use-file-responses"]) == 0
    assert "the file's own answers" in capsys.readouterr().out
    head, recs = read_sequences(own)
    by_id = {r["id"]: r for r in recs}
    assert head["responses"] == "file" and by_id["s1#1"]["completion"] == "FILE-ANSWER-ONE"
    assert "FILE-ANSWER-ONE" in target.tokenizer.decode(by_id["s1#2"]["prompt_ids"])
    assert by_id["s1#2"]["completion_ids"][-1] in stops
    with pytest.raises(DFlashError, match="responses='file', now 'target'"):
        generate_sequences(target, str(share), own, 6, progress=False)  # one file never mixes the two
    served = tmp_path / "q8.jsonl"  # the answers of the target as served, in q8_0: its identity says so
    assert main(base + ["--out", str(served), "--weights", "q8_0", "--num-prompts", "1"]) == 0
    assert read_sequences(served)[0]["target"]["weights"] == "q8_0"
    turns_only = _write(tmp_path / "t.jsonl", [{"turns": ["a", "b"]}])
    assert main(base[:5] + [str(turns_only)] + base[6:] + ["--out", str(tmp_path / "x.jsonl"), "--use-file-responses"]) == 2
    assert "no assistant answer to user turn 1" in capsys.readouterr().err


def test_extract_answers_every_turn_and_records_categories(tiny_targets, tmp_path, capsys):
    from dflashkit.cache import open_cache
    from dflashkit.cache.extraction import extract
    from dflashkit.cache.sequences import read_sequences

    target = tiny_targets["llama"]
    share = _write(tmp_path / "share.jsonl", SHAREGPT)
    path = extract(target, load_prompts(share), tmp_path / "cache", layer_ids=[1, 2], max_new_tokens=5,
                   progress=False)
    cache = open_cache(path)
    turns = {r["id"]: r for r in read_sequences(tmp_path / "cache.turns.jsonl")[1]}
    assert cache.prompt_ids == ["s1#1", "s1#2", "share-2"]
    for rec in cache:
        t = turns[rec.id]
        assert rec.tokens.tolist() == t["prompt_ids"] + t["completion_ids"] and rec.category == "share"
        assert "FILE-ANSWER" not in target.tokenizer.decode(rec.tokens.tolist())
    again = extract(target, load_prompts(share), tmp_path / "cache", layer_ids=[1, 2], max_new_tokens=5)
    assert again == path and "nothing to do" in capsys.readouterr().out


def test_eval_and_compare_per_category(tiny_targets, tmp_path):
    from dflashkit.cache import open_cache
    from dflashkit.cache.extraction import extract
    from dflashkit.drafter.checkpoint import new_drafter, save_drafter
    from dflashkit.evaluate.compare import compare_runs
    from dflashkit.evaluate.runs import run_eval

    t = tiny_targets["llama"]
    a = _write(tmp_path / "gsm.jsonl", [{"turns": [f"Add {i} and {i + 1}."]} for i in range(2)])
    b = _write(tmp_path / "code.jsonl", [{"turns": [f"Write a loop that prints {i}."]} for i in range(2)])
    path = extract(t, load_prompts(f"{a},{b}"), tmp_path / "cache", layer_ids=[1, 2], max_new_tokens=12,
                   progress=False)
    runs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        save_drafter(new_drafter(t, num_layers=1, target_layer_ids=[1, 2], block_size=4), tmp_path / f"d{seed}",
                     target_identity=t.identity())
        res = run_eval(tmp_path / f"d{seed}", t, open_cache(path), tmp_path / f"run{seed}", trees=("budget:4",),
                       progress=False, say=lambda line: None)
        runs.append(tmp_path / f"run{seed}")
        per = res["per_category"]
        assert list(per) == ["gsm", "code"] and sum(v["blocks"] for v in per.values()) == res["overall"]["blocks"]
        gsm = [blk for blk in res["blocks"] if blk["prompt"].startswith("gsm")]
        assert per["gsm"]["streak"] == pytest.approx(sum(blk["streak"] for blk in gsm) / len(gsm))
        summary = (tmp_path / f"run{seed}" / "summary.md").read_text()
        assert "## Per category" in summary and (tmp_path / f"run{seed}" / "categories.png").is_file()
    cmp = compare_runs(runs, out=tmp_path / "cmp")
    assert cmp["categories"] == ["gsm", "code"] and "## Per category: tau" in cmp["markdown"]
    assert "categories.png" in cmp["files"]


def test_an_interrupted_bench_resumes_without_measuring_a_run_twice(tiny_dirs, tmp_path, monkeypatch, capsys):
    """Issue 72: bench wrote only at the end, so an interrupt lost every finished run (while the CLI said it was
    saved). Now each run is appended as it ends: a rerun of the same command measures only the rest, and ends with
    every run; other settings on the same --out are refused by name."""
    from dflashkit.cli import main
    from dflashkit.measure import bench

    real, measured = bench._run, []

    def counted(target, proposer, item, m, n, *a, **k):
        if n == 10:  # the runs (the warm-up's are 8 tokens)
            if len(measured) == stop_after[0]:
                raise KeyboardInterrupt
            measured.append(m)
        return real(target, proposer, item, m, n, *a, **k)

    monkeypatch.setattr(bench, "_run", counted)
    out = tmp_path / "b"
    argv = ["bench", "--no-predict", "--target", str(tiny_dirs["llama"]), "--methods", "ar,ngram", "--prompts",
            "coding-10", "--num-prompts", "3", "--max-new-tokens", "10", "--out", str(out)]
    stop_after = [4]
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert f"interrupted; the finished runs are in {out / 'runs.jsonl'}: the same command resumes" in err
    assert len((out / "runs.jsonl").read_text().splitlines()) == 1 + 4
    assert main(argv[:-4] + ["--max-new-tokens", "9", "--out", str(out)]) == 2
    assert "holds an interrupted bench of other settings (max_new_tokens differ)" in capsys.readouterr().err
    stop_after[0] = None
    assert main(argv) == 0
    assert len(measured) == 6 and "resuming from" in capsys.readouterr().err  # 4 before, 2 after: none twice
    res = json.loads((out / "results.json").read_text())
    assert len(res["runs"]) == 6 and {(r["prompt"], r["method"]) for r in res["runs"]} == {
        (p, m) for p in res["config"]["prompts"] for m in ("ar", "ngram")}
    assert res["mismatches"] == [] and not (out / "runs.jsonl").exists()  # done: a rerun measures anew

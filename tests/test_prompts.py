import json
import re

import pytest

from dflashkit.prompts import BUILTIN_SUITES, PromptItem, PromptSuite, load_prompts

NAMED_CODING_IDS = {
    "fizzbuzz",
    "binary_search",
    "linked_list_reverse",
    "json_parser",
    "async_rate_limiter",
    "graph_bfs",
    "lru_cache",
    "trie",
}

# Topics of the coding-10 eval suite that must never leak into train-mix.
EXCLUDED_TOPICS = re.compile(
    r"fizz|buzz|binary[\s_-]*search|bisect|linked|json[\s_-]*pars|pars\w*\s+(?:a\s+|the\s+)?json|"
    r"rate[\s_-]*limit|\bbfs\b|breadth[\s_-]*first|\blru|least[\s_-]+recently|\btries?\b|"
    r"prefix[\s_-]*tree|spiral|interval",
    re.IGNORECASE,
)


def _write(tmp_path, lines, name="suite.jsonl"):
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _user_text(item: PromptItem) -> str:
    return " ".join(m["content"] for m in item.messages)


# ---------------------------------------------------------------- built-ins


def test_builtin_names_are_the_shipped_suites_and_load():
    import dflashkit.prompts as prompts_pkg
    from pathlib import Path

    shipped = sorted(f.stem for f in Path(prompts_pkg.__file__).parent.glob("*.jsonl"))
    assert sorted(BUILTIN_SUITES) == shipped and "coding-10" in shipped  # every file is reachable by name
    for name in BUILTIN_SUITES:
        suite = load_prompts(name)
        assert suite.name == name and len(suite.ids()) > 0


def test_coding10_ids():
    suite = load_prompts("coding-10")
    assert isinstance(suite, PromptSuite)
    assert suite.name == "coding-10"
    ids = suite.ids()
    assert len(ids) == 10 and len(set(ids)) == 10
    assert NAMED_CODING_IDS <= set(ids)
    for item in suite.items:
        assert len(item.messages) == 1
        assert item.messages[0]["role"] == "user"
        assert "Python" in item.messages[0]["content"]


def test_train_mix_size_and_uniqueness():
    suite = load_prompts("train-mix")
    ids = suite.ids()
    texts = [_user_text(item) for item in suite.items]
    assert len(set(ids)) == len(ids) >= 500
    assert len(set(t.strip().lower() for t in texts)) >= 500
    assert all(re.fullmatch(r"train-\d{4}", i) for i in ids)


def test_train_mix_is_mostly_python_coding():
    texts = [_user_text(i) for i in load_prompts("train-mix").items]
    python = sum("python" in t.lower() for t in texts)
    assert python / len(texts) >= 0.35


def test_train_mix_excludes_eval_topics():
    offenders = [
        (item.id, _user_text(item))
        for item in load_prompts("train-mix").items
        if EXCLUDED_TOPICS.search(_user_text(item))
    ]
    assert offenders == []


def test_train_mix_does_not_repeat_coding10_prompts():
    coding = {_user_text(i).lower() for i in load_prompts("coding-10").items}
    train = {_user_text(i).lower() for i in load_prompts("train-mix").items}
    assert not coding & train


def test_exclusion_regex_catches_eval_topics():
    # Sanity check that the exclusion check itself would fire on each coding-10 prompt.
    for item in load_prompts("coding-10").items:
        assert EXCLUDED_TOPICS.search(_user_text(item)), item.id


# ---------------------------------------------------------------- hashing


def test_hash_is_stable_across_loads():
    a, b = load_prompts("coding-10"), load_prompts("coding-10")
    assert a.content_hash == b.content_hash
    assert re.fullmatch(r"[0-9a-f]{64}", a.content_hash)
    assert a.content_hash != load_prompts("train-mix").content_hash


def test_hash_matches_same_content_from_file(tmp_path):
    builtin = load_prompts("coding-10")
    lines = [json.dumps({"id": i.id, "prompt": i.messages[0]["content"]}) for i in builtin.items]
    from_file = load_prompts(str(_write(tmp_path, lines)))
    assert from_file.content_hash == builtin.content_hash
    assert from_file.name != builtin.name


def test_hash_changes_when_content_changes(tmp_path):
    base = load_prompts(str(_write(tmp_path, ['{"id": "a", "prompt": "x"}'], "a.jsonl")))
    text = load_prompts(str(_write(tmp_path, ['{"id": "a", "prompt": "y"}'], "b.jsonl")))
    ident = load_prompts(str(_write(tmp_path, ['{"id": "b", "prompt": "x"}'], "c.jsonl")))
    more = load_prompts(
        str(_write(tmp_path, ['{"id": "a", "prompt": "x"}', '{"id": "b", "prompt": "x"}'], "d.jsonl"))
    )
    hashes = {base.content_hash, text.content_hash, ident.content_hash, more.content_hash}
    assert len(hashes) == 4


def test_subset():
    suite = load_prompts("coding-10")
    sub = suite.subset(3)
    assert sub.name == suite.name
    assert sub.ids() == suite.ids()[:3]
    assert sub.content_hash != suite.content_hash
    assert sub.content_hash == suite.subset(3).content_hash
    assert suite.subset(10).content_hash == suite.content_hash
    assert len(suite.subset(100)) == 10
    assert len(suite.subset(0)) == 0
    with pytest.raises(ValueError):
        suite.subset(-1)


# ---------------------------------------------------------------- file loading


def test_load_file_with_prompt(tmp_path):
    path = _write(
        tmp_path,
        ['{"id": "q1", "prompt": "Hello?"}', "", '{"id": "q2", "prompt": "Bye."}'],
    )
    suite = load_prompts(str(path))
    assert suite.name == str(path)
    assert suite.ids() == ["q1", "q2"]
    assert suite.items[0].messages == ({"role": "user", "content": "Hello?"},)


def test_load_file_with_messages(tmp_path):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Sum 2 and 2."},
    ]
    path = _write(tmp_path, [json.dumps({"id": "chat", "messages": messages})])
    suite = load_prompts(path)  # os.PathLike accepted as well as str
    assert suite.ids() == ["chat"]
    assert suite.items[0].messages == tuple(messages)


def test_prompt_and_messages_forms_hash_equal(tmp_path):
    a = load_prompts(str(_write(tmp_path, ['{"id": "a", "prompt": "x"}'], "p.jsonl")))
    b = load_prompts(
        str(_write(tmp_path, ['{"id": "a", "messages": [{"role": "user", "content": "x"}]}'], "m.jsonl"))
    )
    assert a.content_hash == b.content_hash


# ---------------------------------------------------------------- errors


def _error(tmp_path, lines, name="bad.jsonl") -> str:
    path = _write(tmp_path, lines, name)
    with pytest.raises(ValueError) as info:
        load_prompts(str(path))
    msg = str(info.value)
    assert name in msg
    assert "\n" not in msg
    return msg


def test_unknown_suite_name():
    with pytest.raises(ValueError) as info:
        load_prompts("no-such-suite")
    msg = str(info.value)
    assert "no-such-suite" in msg
    for name in BUILTIN_SUITES:
        assert name in msg


def test_invalid_json(tmp_path):
    msg = _error(tmp_path, ['{"id": "a", "prompt": "ok"}', '{"id": "b", "prompt": '])
    assert "bad.jsonl:2" in msg and "invalid JSON" in msg


def test_not_an_object(tmp_path):
    msg = _error(tmp_path, ['["a", "b"]'])
    assert "bad.jsonl:1" in msg


def test_missing_id_gets_file_stem_and_line_but_a_clash_is_an_error(tmp_path):
    path = _write(tmp_path, ['{"id": "a", "prompt": "ok"}', "", '{"prompt": "no id"}'], "set.jsonl")
    assert load_prompts(path).ids() == ["a", "set-3"]
    msg = _error(tmp_path, ['{"id": "bad-2", "prompt": "ok"}', '{"prompt": "no id"}'])
    assert "bad.jsonl:2" in msg and "duplicate id 'bad-2'" in msg


def test_missing_prompt_and_messages(tmp_path):
    msg = _error(tmp_path, ['{"id": "a"}'])
    assert "bad.jsonl:1" in msg and "prompt" in msg and "messages" in msg


def test_duplicate_id(tmp_path):
    msg = _error(tmp_path, ['{"id": "a", "prompt": "x"}', '{"id": "b", "prompt": "y"}', '{"id": "a", "prompt": "z"}'])
    assert "bad.jsonl:3" in msg and "duplicate" in msg and "line 1" in msg


@pytest.mark.parametrize(
    "messages",
    [
        "hello",
        [],
        ["hello"],
        [{"role": "user"}],
        [{"content": "hi"}],
        [{"role": "user", "content": 5}],
    ],
)
def test_bad_messages(tmp_path, messages):
    msg = _error(tmp_path, ['{"id": "ok", "prompt": "x"}', json.dumps({"id": "a", "messages": messages})])
    assert "bad.jsonl:2" in msg and "messages" in msg


def test_empty_file(tmp_path):
    msg = _error(tmp_path, [], name="empty.jsonl")
    assert "empty" in msg


def test_blank_lines_only_file(tmp_path):
    msg = _error(tmp_path, ["", "   "], name="blank.jsonl")
    assert "empty" in msg


def test_nearest_picks_on_topic_prompts_in_suite_order(tmp_path):
    path = tmp_path / "mix.jsonl"
    rows = [("a", "Explain how tides work."), ("b", "Write a Python function that sorts a list of tuples."),
            ("c", "How many days are in a leap year?"), ("d", "Implement a Python class for a bounded stack."),
            ("e", "Give me tips for a job interview.")]
    path.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in rows))
    mix = load_prompts(path)
    picked = mix.nearest(load_prompts("coding-10"), 2)
    assert picked.ids() == ["b", "d"]  # the two coding tasks, in the suite's own order
    assert picked.content_hash != mix.content_hash and len(mix.nearest(mix, 99)) == 5
    with pytest.raises(ValueError, match="non-negative"):
        mix.nearest(mix, -1)


def test_a_directory_is_named_as_one_with_what_to_pass(tmp_path):
    _write(tmp_path, ['{"id": "a", "prompt": "hi"}'], name="coding.jsonl")
    with pytest.raises(ValueError) as e:
        load_prompts(tmp_path)
    msg = str(e.value)
    assert "is a directory" in msg and "no such file" not in msg
    assert "coding.jsonl" in msg and "--prompts" in msg


def test_the_cli_says_a_prompts_directory_is_a_directory(tmp_path, capsys):
    from dflashkit.cli import main

    rc = main(["extract", "--target", "nowhere", "--prompts", str(tmp_path), "--out", str(tmp_path / "out")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "is a directory" in err

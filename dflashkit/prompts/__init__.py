"""Built-in prompt suites and a JSONL loader for the formats the field uses, told apart by their fields
(docs/standard-sets.md). A row without an id gets the file stem and its line (``mt-bench-12``), one without a
category the stem, so files joined by commas make one suite with a table per set."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections import Counter
from dataclasses import dataclass
from importlib import resources

from dflashkit.errors import DFlashError

__all__ = ["BUILTIN_SUITES", "PromptItem", "PromptSuite", "load_prompts"]

BUILTIN_SUITES = ("coding-10", "train-mix", "complete-12")  # complete-12: evaluation only, never trained on

_EXAMPLE = '{"id": "task-1", "prompt": "..."}'


@dataclass(frozen=True)
class PromptItem:
    """One conversation: a unique id, its chat messages (user turns, maybe the file's answers), its category."""

    id: str
    messages: tuple[dict, ...]  # [{"role": "user", "content": ...}, ...]
    category: str | None = None

    @property
    def num_turns(self) -> int:
        return sum(m["role"] == "user" for m in self.messages)

    def _segments(self) -> tuple[list[dict], list[list[dict]]]:
        """(what precedes the first user turn, [[user turn, the messages that answer it], ...])."""
        cuts = [i for i, m in enumerate(self.messages) if m["role"] == "user"] + [len(self.messages)]
        return list(self.messages[:cuts[0]]), [list(self.messages[a:b]) for a, b in zip(cuts, cuts[1:])]

    def turn(self, k: int, answers: list[str] | None = None) -> list[dict]:
        """The messages that ask user turn k (0-based), each earlier turn followed by `answers[j]`, the target's own
        answer (MT-Bench's protocol), or with answers None by the file's own messages."""
        head, turns = self._segments()
        if not 0 <= k < len(turns):
            raise IndexError(f"{self.id}: turn {k} of a conversation with {len(turns)} user turns")
        out = list(head)
        for j in range(k):
            if answers is not None:
                out += [turns[j][0], {"role": "assistant", "content": answers[j]}]
            elif len(turns[j]) == 1:
                raise ValueError(f"{self.id}: the file holds no answer to user turn {j + 1}; let the target answer it")
            else:
                out += turns[j]
        return out + [turns[k][0]]

    def prompt(self) -> list[dict]:
        """The messages up to the last user turn (a trailing answer of the file dropped): one prompt to answer."""
        last = max(i for i, m in enumerate(self.messages) if m["role"] == "user")
        return list(self.messages[: last + 1])

    def file_answer(self, k: int) -> str | None:
        """The file's own assistant answer to user turn k, if it has one."""
        answer = [m["content"] for m in self._segments()[1][k][1:] if m["role"] == "assistant"]
        return "\n".join(answer) if answer else None


@dataclass(frozen=True)
class PromptSuite:
    """An ordered, immutable collection of prompts with a content hash."""

    name: str  # built-in suite name, or the file path given to load_prompts
    items: tuple[PromptItem, ...]
    content_hash: str  # sha256 over a canonical JSON dump of ids + messages

    def ids(self) -> list[str]:
        return [item.id for item in self.items]

    def subset(self, n: int) -> "PromptSuite":
        """The first ``n`` items (all of them if ``n`` exceeds the suite size)."""
        _check_size(n)
        return _suite(self.name, self.items[:n])

    def per_category(self, n: int) -> "PromptSuite":
        """The first ``n`` items of each category, in suite order (a short run that still covers every category)."""
        _check_size(n)
        seen: Counter = Counter()
        keep = []
        for it in self.items:
            seen[it.category] += 1
            if seen[it.category] <= n:
                keep.append(it)
        return _suite(f"{self.name} (first {n} per category)", keep)

    def categories(self) -> list[str]:
        return list(dict.fromkeys(it.category for it in self.items if it.category))

    def nearest(self, reference: "PromptSuite", n: int) -> "PromptSuite":
        """The ``n`` items closest to ``reference``'s topic (TF-IDF cosine to its centroid), in this suite's order."""
        _check_size(n)
        docs = [_words(it) for it in self.items]
        df = Counter(w for d in docs for w in set(d))

        def unit(words: list[str]) -> dict[str, float]:
            v = {w: c * math.log((len(docs) + 1) / (df.get(w, 0) + 1)) for w, c in Counter(words).items()}
            z = math.sqrt(sum(x * x for x in v.values())) or 1.0
            return {w: x / z for w, x in v.items()}

        centroid = sum((Counter(unit(_words(it))) for it in reference.items), Counter())
        score = [sum(x * centroid.get(w, 0.0) for w, x in unit(d).items()) for d in docs]
        keep = sorted(sorted(range(len(docs)), key=lambda i: (-score[i], i))[:n])
        return _suite(f"{self.name} (nearest {len(keep)} to {reference.name})", [self.items[i] for i in keep])

    def __len__(self) -> int:
        return len(self.items)


def _check_size(n) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"subset size must be a non-negative integer, got {n!r}")


def _words(item: PromptItem) -> list[str]:
    return re.findall(r"[a-z]+", " ".join(m["content"] for m in item.messages).lower())


def _suite(name: str, items) -> PromptSuite:
    """A suite and its content hash over ids and messages (a category is a label: relabelling keeps caches)."""
    items = tuple(items)
    payload = [{"id": item.id, "messages": list(item.messages)} for item in items]
    blob = json.dumps(payload, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return PromptSuite(name=name, items=items, content_hash=hashlib.sha256(blob.encode("utf-8")).hexdigest())


_EXPECTED = ('"prompt" or "messages" (ours, OpenAI chat), "turns" (z-lab, DeepSpec, Spec-Bench) or '
             '"conversations" (ShareGPT)')
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant",
                  "system": "system"}


def _from_prompt(value, where: str) -> tuple[dict, ...]:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: 'prompt' is empty or not a string; give the prompt text as a string")
    return ({"role": "user", "content": value},)


def _parse_messages(value, where: str) -> tuple[dict, ...]:
    fix = 'use a list like [{"role": "user", "content": "..."}]'
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects; {fix}")
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise ValueError(f"{where}: messages[{i}] is {type(msg).__name__}, not an object; {fix}")
        role, content = msg.get("role"), msg.get("content")
        if not isinstance(role, str) or not role.strip():
            raise ValueError(f"{where}: messages[{i}] needs a non-empty string 'role'; {fix}")
        if not isinstance(content, str):
            raise ValueError(f"{where}: messages[{i}] needs a string 'content'; {fix}")
    return tuple(map(dict, value))


def _from_turns(value, where: str) -> tuple[dict, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(t, str) and t.strip() for t in value):
        raise ValueError(f"{where}: 'turns' must be a non-empty list of user messages (strings), as in "
                         '{"turns": ["first question", "follow-up"]}')
    return tuple({"role": "user", "content": t} for t in value)


def _from_sharegpt(value, where: str) -> tuple[dict, ...]:
    fix = 'use a list like [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}]'
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: 'conversations' must be a non-empty list of {{from, value}} objects; {fix}")
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict) or not isinstance(msg.get("value"), str):
            raise ValueError(f"{where}: conversations[{i}] needs a string 'value'; {fix}")
        role = SHAREGPT_ROLES.get(str(msg.get("from", "")).lower())
        if role is None:
            raise ValueError(f"{where}: conversations[{i}] has 'from' {msg.get('from')!r}; use one of "
                             f"{', '.join(SHAREGPT_ROLES)}")
        out.append({"role": role, "content": msg["value"]})
    return tuple(out)


_PARSERS = {"prompt": _from_prompt, "messages": _parse_messages, "turns": _from_turns, "conversations": _from_sharegpt}


def _row_id(obj: dict, where: str, default: str) -> str:
    """The row's `id` (or Spec-Bench's `question_id`), as a string; rows with neither get `default`."""
    for key in ("id", "question_id"):
        if key in obj:
            v = obj[key]
            if isinstance(v, int) and not isinstance(v, bool):
                return str(v)
            if not isinstance(v, str) or not v.strip():
                raise ValueError(f"{where}: {key!r} is empty or not a string or integer; give a unique id such as "
                                 f"{_EXAMPLE}, or leave it out for one made of the file name and line")
            return v
    return default


def _parse_row(obj: dict, where: str, default_id: str, stem: str) -> PromptItem:
    keys = [k for k in _PARSERS if k in obj]
    if not keys:
        raise ValueError(f"{where}: no prompt field (it has {', '.join(sorted(obj)) or 'none'}); "
                         f"expected {_EXPECTED}, e.g. {_EXAMPLE}")
    if len(keys) > 1:
        raise ValueError(f"{where}: has both {keys[0]!r} and {keys[1]!r}; keep only one of them")
    pid = _row_id(obj, where, default_id)
    messages = _PARSERS[keys[0]](obj[keys[0]], f"{where} (id {pid!r})")
    if not any(m["role"] == "user" for m in messages):
        raise ValueError(f"{where}: item {pid!r} has no user message; a conversation needs at least one user turn")
    category = obj.get("category")
    if category is not None and (not isinstance(category, str) or not category.strip()):
        raise ValueError(f"{where}: 'category' must be a non-empty string (or left out)")
    return PromptItem(id=pid, messages=messages, category=category or stem)


def _parse_lines(text: str, source: str, stem: str, seen: dict[str, str]) -> list[PromptItem]:
    """The file's prompts; `seen`: where each id of the suite was first used (the suite's files share it)."""
    items: list[PromptItem] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno}); "
                             f"each line must be one JSON object such as {_EXAMPLE}") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}; write it as {_EXAMPLE}")
        item = _parse_row(obj, where, f"{stem}-{lineno}", stem)
        if item.id in seen:
            raise ValueError(f"{where}: duplicate id {item.id!r}, also in {seen[item.id]}; make every id unique")
        seen[item.id] = f"line {lineno} of {source}"
        items.append(item)
    if not items:
        raise ValueError(f"{source}: file is empty (no prompts found); add one JSON object per line, e.g. {_EXAMPLE}")
    return items


def _load_one(spec: str, seen: dict[str, str]) -> list[PromptItem]:
    if spec in BUILTIN_SUITES:
        text = resources.files(__name__).joinpath(f"{spec}.jsonl").read_text(encoding="utf-8")
        return _parse_lines(text, f"{spec}.jsonl", spec, seen)
    if os.path.isdir(spec):
        files = sorted(n for n in os.listdir(spec) if n.endswith((".jsonl", ".json")))
        hint = f" (it holds {', '.join(files[:3])}{', ...' if len(files) > 3 else ''})" if files else ""
        raise ValueError(
            f"{spec}: is a directory{hint}; --prompts takes a JSONL file of prompts (several joined by commas) or a "
            f"built-in suite ({', '.join(BUILTIN_SUITES)}), e.g. --prompts {os.path.join(spec, files[0] if files else 'prompts.jsonl')}")
    if not os.path.isfile(spec):
        raise ValueError(
            f"unknown prompt suite {spec!r}: it is not a built-in suite ({', '.join(BUILTIN_SUITES)}) and no such "
            "file exists; pass one of the built-in names or a path to a JSONL file (several joined by commas)")
    try:
        with open(spec, encoding="utf-8-sig") as fh:
            text = fh.read()
    except UnicodeDecodeError as exc:
        raise ValueError(f"{spec}: not valid UTF-8 ({exc.reason} at byte {exc.start}); save the file as UTF-8") from None
    return _parse_lines(text, spec, os.path.basename(spec).split(".")[0] or "prompts", seen)


def load_prompts(spec: str | os.PathLike) -> PromptSuite:
    """Load a built-in suite, a JSONL file, or several joined by commas; bad input names the file, line and fix."""
    spec_str = os.fspath(spec)
    parts = [spec_str] if spec_str in BUILTIN_SUITES or os.path.isfile(spec_str) or "," not in spec_str else \
        [p.strip() for p in spec_str.split(",") if p.strip()]
    seen: dict[str, str] = {}
    return _suite(spec_str, [item for part in parts for item in _load_one(part, seen)])


def select_prompts(spec: str, num_prompts: int | None = None, per_category: int | None = None) -> PromptSuite:
    """What `--prompts SPEC [--num-prompts N] [--per-category N]` means: the first N of each category, then of all."""
    try:
        suite = load_prompts(spec)
    except ValueError as e:
        raise DFlashError(f"--prompts: {e}") from None
    if per_category is not None:
        if per_category < 1:
            raise DFlashError(f"--per-category {per_category}: must be at least 1")
        suite = suite.per_category(per_category)
    if num_prompts is not None:
        if num_prompts > len(suite):
            raise DFlashError(f"--num-prompts {num_prompts}: suite {suite.name} holds only {len(suite)} prompts")
        suite = suite.subset(num_prompts)
    return suite

"""Built-in prompt suites and a JSONL prompt loader.

A prompt file is JSON Lines: one object per line with a unique string ``id`` and
either a ``prompt`` string or a chat ``messages`` list of ``{"role", "content"}``
objects.  Blank lines are ignored.

    >>> suite = load_prompts("coding-10")
    >>> suite.ids()[:2]
    ['fizzbuzz', 'binary_search']

Built-in suites:

* ``coding-10`` -- ten Python coding tasks used for evaluation.
* ``train-mix`` -- 600+ mixed prompts (mostly coding) for drafter training; it
  deliberately contains no task that duplicates a ``coding-10`` topic.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections import Counter
from dataclasses import dataclass
from importlib import resources

__all__ = ["BUILTIN_SUITES", "PromptItem", "PromptSuite", "load_prompts"]

BUILTIN_SUITES = ("coding-10", "train-mix", "complete-12")  # complete-12: evaluation only, never trained on

_EXAMPLE = '{"id": "task-1", "prompt": "..."}'


@dataclass(frozen=True)
class PromptItem:
    """One prompt: a unique id and its chat messages."""

    id: str
    messages: tuple[dict, ...]  # [{"role": "user", "content": ...}, ...]


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
        items = self.items[:n]
        return PromptSuite(name=self.name, items=items, content_hash=_content_hash(items))

    def nearest(self, reference: "PromptSuite", n: int) -> "PromptSuite":
        """The ``n`` items closest to ``reference``'s topic (TF-IDF cosine to its centroid), in this suite's
        order: on-domain training data for a drafter that will be judged on ``reference``."""
        _check_size(n)
        docs = [_words(it) for it in self.items]
        df = Counter(w for d in docs for w in set(d))

        def unit(words: list[str]) -> dict[str, float]:
            v = {w: c * math.log((len(docs) + 1) / (df.get(w, 0) + 1)) for w, c in Counter(words).items()}
            z = math.sqrt(sum(x * x for x in v.values())) or 1.0
            return {w: x / z for w, x in v.items()}

        centroid: Counter = Counter()
        for it in reference.items:
            centroid.update(unit(_words(it)))
        score = [sum(x * centroid.get(w, 0.0) for w, x in unit(d).items()) for d in docs]
        keep = sorted(sorted(range(len(docs)), key=lambda i: (-score[i], i))[:n])
        items = tuple(self.items[i] for i in keep)
        return PromptSuite(name=f"{self.name} (nearest {len(items)} to {reference.name})", items=items,
                           content_hash=_content_hash(items))

    def __len__(self) -> int:
        return len(self.items)


def _check_size(n) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"subset size must be a non-negative integer, got {n!r}")


def _words(item: PromptItem) -> list[str]:
    return re.findall(r"[a-z]+", " ".join(m["content"] for m in item.messages).lower())


def _content_hash(items: tuple[PromptItem, ...]) -> str:
    payload = [{"id": item.id, "messages": list(item.messages)} for item in items]
    blob = json.dumps(payload, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def _parse_messages(value, where: str) -> tuple[dict, ...]:
    fix = 'use a list like [{"role": "user", "content": "..."}]'
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects; {fix}")
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise ValueError(f"{where}: messages[{i}] is {type(msg).__name__}, not an object; {fix}")
        role, content = msg.get("role"), msg.get("content")
        if not isinstance(role, str) or not role.strip():
            raise ValueError(f"{where}: messages[{i}] needs a non-empty string 'role'; {fix}")
        if not isinstance(content, str):
            raise ValueError(f"{where}: messages[{i}] needs a string 'content'; {fix}")
        out.append(dict(msg))
    return tuple(out)


def _parse_lines(text: str, source: str) -> tuple[PromptItem, ...]:
    items: list[PromptItem] = []
    first_line: dict[str, int] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{where}: invalid JSON ({exc.msg} at column {exc.colno}); "
                f"each line must be one JSON object such as {_EXAMPLE}"
            ) from None
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}; write it as {_EXAMPLE}")
        pid = obj.get("id")
        if not isinstance(pid, str) or not pid.strip():
            raise ValueError(f"{where}: missing or empty string 'id'; add a unique id, e.g. {_EXAMPLE}")
        has_prompt, has_messages = "prompt" in obj, "messages" in obj
        if not has_prompt and not has_messages:
            raise ValueError(
                f"{where}: item {pid!r} has neither 'prompt' nor 'messages'; "
                f"add a \"prompt\" string or a chat \"messages\" list"
            )
        if has_prompt and has_messages:
            raise ValueError(f"{where}: item {pid!r} has both 'prompt' and 'messages'; keep only one of them")
        if has_prompt:
            prompt = obj["prompt"]
            if not isinstance(prompt, str) or not prompt.strip():
                raise ValueError(f"{where}: item {pid!r} has an empty or non-string 'prompt'; give the prompt text as a string")
            messages: tuple[dict, ...] = ({"role": "user", "content": prompt},)
        else:
            messages = _parse_messages(obj["messages"], where)
        if pid in first_line:
            raise ValueError(
                f"{where}: duplicate id {pid!r} (first used on line {first_line[pid]}); make every id unique"
            )
        first_line[pid] = lineno
        items.append(PromptItem(id=pid, messages=messages))
    if not items:
        raise ValueError(f"{source}: file is empty (no prompts found); add one JSON object per line, e.g. {_EXAMPLE}")
    return tuple(items)


def load_prompts(spec: str | os.PathLike) -> PromptSuite:
    """Load a built-in suite by name (see BUILTIN_SUITES) or a JSONL file by path.

    Raises ValueError naming the file, line and fix for any malformed input.
    """
    spec_str = os.fspath(spec)
    if spec_str in BUILTIN_SUITES:
        source = f"{spec_str}.jsonl"
        text = resources.files(__name__).joinpath(source).read_text(encoding="utf-8")
        name = spec_str
    else:
        if not os.path.isfile(spec_str):
            raise ValueError(
                f"unknown prompt suite {spec_str!r}: it is not a built-in suite "
                f"({', '.join(BUILTIN_SUITES)}) and no such file exists; "
                f"pass one of the built-in names or a path to a JSONL file"
            )
        source = spec_str
        try:
            with open(spec_str, encoding="utf-8-sig") as fh:
                text = fh.read()
        except UnicodeDecodeError as exc:
            raise ValueError(f"{source}: not valid UTF-8 ({exc.reason} at byte {exc.start}); save the file as UTF-8") from None
        name = spec_str
    items = _parse_lines(text, source)
    return PromptSuite(name=name, items=items, content_hash=_content_hash(items))


def select_prompts(spec: str, num_prompts: int | None = None) -> PromptSuite:
    """What a CLI's `--prompts SPEC [--num-prompts N]` means: the suite, or its first N items; one clear error."""
    from dflashkit.errors import DFlashError

    try:
        suite = load_prompts(spec)
    except ValueError as e:
        raise DFlashError(f"--prompts: {e}") from None
    if num_prompts is not None:
        if num_prompts > len(suite):
            raise DFlashError(f"--num-prompts {num_prompts}: suite {suite.name} holds only {len(suite)} prompts")
        suite = suite.subset(num_prompts)
    return suite

"""The sequences JSONL of `dflashkit data generate`: the target's own answer to every turn of a prompt suite, one
record per turn, appended batch by batch (format: docs/design.md, "The sequences file in detail")."""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path

from tqdm import tqdm

from dflashkit.errors import DFlashError
from dflashkit.prompts import PromptSuite, load_prompts
from dflashkit.targets.generation import iter_generate_greedy
from dflashkit.targets.model import identity_mismatch

FORMAT = "dflashkit-sequences/1"


def same_target(a: dict | None, b: dict | None) -> bool:
    """Both identities are known and match (target.model.identity_mismatch), wherever the folder lives."""
    return a is not None and b is not None and not identity_mismatch(a, b)


def read_sequences(path) -> tuple[dict, list[dict]]:
    """(header, records) of a sequences JSONL; errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise DFlashError(f"{path}: no such sequences file; write one with `dflashkit data generate`")
    header, records = None, []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if not line.endswith("\n"):
                break  # a half-written last line: ignored, a rerun of `data generate` rewrites it
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DFlashError(f"{path}:{lineno}: invalid JSON ({e.msg}); regenerate with `dflashkit data generate`") from e
            if header is None:
                if obj.get("format") != FORMAT:
                    raise DFlashError(f"{path}:1: not a dflashkit sequences file (first line must be a header with "
                                      f"format {FORMAT!r}); write it with `dflashkit data generate`")
                header = obj
                continue
            if lost := [k for k in ("id", "prompt_ids", "completion_ids") if k not in obj]:
                raise DFlashError(f"{path}:{lineno}: record lacks {lost[0]!r}; each line needs id, prompt_ids, completion_ids")
            records.append(obj)
    if header is None:
        raise DFlashError(f"{path}: empty sequences file; write it with `dflashkit data generate`")
    return header, records


def turn_id(item, k: int) -> str:
    """A record's id: the conversation's own for a single turn, `id#k` (k from 1) for each turn of a longer one."""
    return item.id if item.num_turns == 1 else f"{item.id}#{k + 1}"


def file_record(target, item, k: int, where: str) -> dict:
    """Turn k answered by the file's own assistant message (--use-file-responses), closed by the end-of-turn token."""
    answer = item.file_answer(k)
    if answer is None:
        raise DFlashError(f"{where}: conversation {item.id!r} has no assistant answer to user turn {k + 1}, so "
                          "--use-file-responses has nothing to train on there; drop the flag (the target answers "
                          "every turn) or give that row its answer")
    stops = target.stop_token_ids
    end = target.tokenizer.eos_token_id if target.tokenizer.eos_token_id in stops else stops[0]
    comp = target.tokenizer(answer, add_special_tokens=False)["input_ids"] + [end]
    return {"id": turn_id(item, k), "turn": k + 1, "category": item.category,
            "prompt_ids": target.chat_ids(item.turn(k), enable_thinking=False), "completion_ids": comp,
            "stopped": True, "completion": answer}


def generate_sequences(target, prompts, out, max_new_tokens: int = 256, batch_size: int = 8,
                       num_prompts: int | None = None, progress: bool = True, use_file_responses: bool = False,
                       answered_by=None) -> Path:
    """Greedy responses to every user turn of a suite, each after the target's own earlier answers, appended batch by
    batch (a rerun skips the turns done); `answered_by`: (name, answer) of another backend (measure/peers)."""
    try:
        suite = prompts if isinstance(prompts, PromptSuite) else load_prompts(prompts)
    except ValueError as e:
        raise DFlashError(str(e)) from e
    header = {"format": FORMAT, "target": target.identity(), "prompts": suite.name,
              "prompts_hash": suite.content_hash, "max_new_tokens": max_new_tokens, "enable_thinking": False,
              "responses": "file" if use_file_responses else "target", "engine": answered_by[0] if answered_by else "hf"}
    if num_prompts is not None:
        suite = suite.subset(num_prompts)
    out = Path(out)
    done = _start_or_resume(out, header, target)
    rounds = max((it.num_turns for it in suite.items), default=0)
    turns = [(item, k) for k in range(rounds) for item in suite.items if k < item.num_turns]
    bar = tqdm(total=len(turns), initial=sum(turn_id(it, k) in done for it, k in turns), desc="generate",
               unit="turn", disable=not progress, smoothing=0)  # batches finish at once: whole-run rate
    pending: list[dict] = []

    def flush():
        with open(out, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in pending))
            f.flush()
            os.fsync(f.fileno())
        done.update((r["id"], r) for r in pending)
        bar.update(len(pending))
        pending.clear()

    if use_file_responses:
        pending += [file_record(target, it, k, suite.name) for it, k in turns if turn_id(it, k) not in done]
        flush()
        rounds = 0  # nothing for the target to answer
    stops, answer = set(target.stop_token_ids), answered_by[1] if answered_by else partial(iter_generate_greedy, target)
    for k in range(rounds):
        todo = [it for it, j in turns if j == k and turn_id(it, k) not in done]
        answers = [[done[turn_id(it, j)]["completion"] for j in range(k)] for it in todo]
        prompt_ids = [target.chat_ids(it.turn(k, a), enable_thinking=False) for it, a in zip(todo, answers)]
        for i, comp in answer(prompt_ids, max_new_tokens, batch_size=batch_size):
            pending.append({"id": turn_id(todo[i], k), "turn": k + 1, "category": todo[i].category,
                            "prompt_ids": prompt_ids[i], "completion_ids": comp,
                            "stopped": bool(comp) and comp[-1] in stops, "completion": target.decode(comp)})
            if len(pending) >= batch_size:
                flush()
        flush()  # the next round reads this one's answers
    bar.close()
    return out


def _start_or_resume(out: Path, header: dict, target) -> dict[str, dict]:
    """The records already in `out` by id (a new file gets the header); other settings are refused."""
    if not (out.is_file() and out.stat().st_size):
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(header) + "\n")
        return {}
    data = out.read_bytes()
    if not data.endswith(b"\n"):  # a run killed mid-append: drop its half-written last line
        with open(out, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)
    old, records = read_sequences(out)
    for key in ("prompts_hash", "max_new_tokens", "enable_thinking", "responses", "engine"):
        was = old.get(key, {"responses": "target", "engine": "hf"}.get(key))  # files from before the flag
        if was != header[key]:
            raise DFlashError(f"{out}: was generated with {key}={was!r}, now {header[key]!r}; "
                              "use another --out (or delete the file) instead of mixing the two")
    if not same_target(old.get("target"), header["target"]):
        raise DFlashError(f"{out}: was generated by target {old['target'].get('name')} "
                          f"({old['target'].get('config_hash')}), not {target.name}; use another --out")
    return {r["id"]: r for r in records}

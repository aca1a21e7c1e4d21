"""Extraction: the target's completion of every prompt and its hidden states over prompt + completion, written as a
cache (store.py); resumable, and sharded under torchrun (docs/design.md, "Extraction in detail")."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import time
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch
from safetensors.torch import save
from tqdm import tqdm

from dflashkit import __version__
from dflashkit.cache import store
from dflashkit.cache.sequences import generate_sequences, read_sequences, same_target, turn_id
from dflashkit.cache.store import COMPLETIONS, FORMAT, MANIFEST, SHARD_SIZE, read_header, record_name
from dflashkit.distributed import Dist, barrier, from_master, gather_all, init_distributed
from dflashkit.errors import DFlashError
from dflashkit.fileio import atomic_path, sha256_file, write_json
from dflashkit.prompts import PromptItem, PromptSuite
from dflashkit.rng import seeded
from dflashkit.targets.linear_attention import linear_attention as la_backend, resolve_backend
from dflashkit.targets.generation import iter_generate_with_features

LOG_GLOB = ".completions.rank*.jsonl"


def capture_features(target, seqs: list[list[int]], layer_ids, padding: str = "right") -> list[dict[int, torch.Tensor]]:
    """Per sequence {layer id: [T_i, H] on CPU}, several in one forward, equal to one at a time (test_contracts.py)."""
    feats = target.features(seqs, layer_ids, padding).cpu()  # [b, T, K*H]
    H = target.hidden_size
    return [{l: feats[r, : len(s), k * H:(k + 1) * H].clone() for k, l in enumerate(layer_ids)}
            for r, s in enumerate(seqs)]


@dataclass
class _Run:
    """This process's share of one extraction, and what is known of it so far (filled step by step)."""

    out: Path
    pids: list[str]  # every prompt's id, in suite order
    prompts: list[list[int]]  # every prompt's chat-template tokens
    mine: list[int]  # the prompt indices this rank handles: every world-th one
    sharded: bool
    sampled: set[int] = field(default_factory=set)  # indices whose answer is sampled, not greedy
    completions: dict[int, list[int]] = field(default_factory=dict)  # index -> completion tokens
    done: dict[int, dict] = field(default_factory=dict)  # index -> {"file", "bytes", "sha256"} of its feature file


def extract(target, suite, out, layer_ids=None, max_new_tokens: int = 256, batch_size: int = 8,
            linear_attention: str = "auto", progress: bool = True, enable_thinking: bool = False,
            completions_from=None, capture_tokens: int = 4096, allow_final_layers: bool = False,
            callback=None, samples: int = 0, temperature: float = 0.8, seed: int = 0) -> Path:
    """Write (or finish) the cache of `suite` under `out`. completions_from: a cache or sequences JSONL to reuse;
    callback(event, prompt_id) after each "completion" and "features" persisted; samples: sampled answers, `ID~sK`."""
    out = Path(out)
    if int(max_new_tokens) < 1 or int(batch_size) < 1:  # refused before any work
        raise DFlashError(f"max_new_tokens ({max_new_tokens}) and batch_size ({batch_size}) must be at least 1")
    layer_ids = target.check_layer_ids(layer_ids if layer_ids is not None else target.default_layer_ids(5),
                                       allow_final=allow_final_layers)
    layer_ids = sorted(set(layer_ids))  # each layer stored once; features([1, 2, 2]) still repeats on reading
    d = init_distributed(target.device.type)
    suite, sampled = with_samples(suite, samples, temperature)
    if any(it.num_turns > 1 for it in suite.items) and completions_from is None:
        suite, completions_from = answer_turns(target, suite, out, max_new_tokens, batch_size, enable_thinking,
                                               progress, d)
    items, pids = suite.items, suite.ids()
    prompts = [target.chat_ids(it.prompt(), enable_thinking=enable_thinking) for it in items]
    reused, source = ({}, None) if completions_from is None else _completions_from(completions_from, target, pids)
    settings = _settings(target, suite, layer_ids, max_new_tokens, resolve_backend(target, linear_attention),
                         enable_thinking, source)
    if samples:  # only then: caches made before sampling existed keep their settings
        settings.update(samples=int(samples), temperature=float(temperature), seed=int(seed))
    show = progress and d.master

    fresh = _manifest(target, suite, settings, linear_attention, batch_size, d.world)
    if _start_or_resume(out, settings, fresh, d) == "complete":
        if show:
            print(f"{out}: complete ({len(pids)} prompts, same settings); nothing to do")
        return out
    manifest = store.read_manifest(out)
    run = _Run(out, pids, prompts, mine=list(range(d.rank, len(items), d.world)), sharded=manifest["layout"]["sharded"],
               sampled=sampled)
    _find_done(run, layer_ids, target.hidden_size)
    _find_completions(run, reused, completions_from)
    with la_backend(target, linear_attention):
        _generate_missing(run, target, layer_ids, max_new_tokens, batch_size, out / f".completions.rank{d.rank}.jsonl",
                          show, callback, temperature, seed + d.rank)
        _capture_missing(run, target, layer_ids, batch_size, capture_tokens, show, callback)

    parts = gather_all(_my_entries(run, target, items), d)
    if d.master:
        t = _finish(out, manifest, parts, len(items), d.world)
        if show:
            print(f"{out}: {t['prompts']} prompts, {t['tokens']} tokens, layers {layer_ids}, "
                  f"{t['bytes'] / 2**20:.1f} MiB")
    barrier(d)
    return out


def with_samples(suite, samples: int, temperature: float) -> tuple[PromptSuite, set[int]]:
    """The suite plus `samples` copies of each prompt (ids `ID~s1`...), and the indices of the copies to sample."""
    if not samples:
        return suite, set()
    if int(samples) < 0 or not temperature > 0:
        raise DFlashError(f"samples ({samples}) must be 0 or more and temperature ({temperature}) above 0")
    if any(it.num_turns > 1 for it in suite.items):
        raise DFlashError(f"{suite.name}: sampled answers are for single-turn prompts; drop --samples or the "
                          "multi-turn prompts")
    copies = tuple(PromptItem(f"{it.id}~s{k}", it.messages, it.category)
                   for k in range(1, int(samples) + 1) for it in suite.items)
    n = len(suite.items)
    return (PromptSuite(f"{suite.name} (+{samples} sampled answers each at T={temperature:g})", suite.items + copies,
                        suite.content_hash), set(range(n, n + len(copies))))


def answer_turns(target, suite, out: Path, max_new_tokens: int, batch_size: int, enable_thinking: bool, progress: bool,
                 d: Dist):
    """A multi-turn suite as one prompt `id#k` per turn, and <out>.turns.jsonl, the target's answers (rank 0 writes)."""
    if enable_thinking:
        raise DFlashError(f"{suite.name}: multi-turn prompts are answered without thinking mode; drop --thinking")
    turns = out.parent / f"{out.name}.turns.jsonl"
    if d.master:
        generate_sequences(target, suite, turns, max_new_tokens, batch_size, progress=progress)
    barrier(d)
    recs = {r["id"]: r for r in read_sequences(turns)[1]}
    flat = []
    for it in suite.items:
        answers = [recs[turn_id(it, k)]["completion"] for k in range(it.num_turns)]
        flat += [PromptItem(turn_id(it, k), tuple(it.turn(k, answers)), it.category) for k in range(it.num_turns)]
    return PromptSuite(f"{suite.name} (one prompt per turn)", tuple(flat), suite.content_hash), str(turns)


def _start_or_resume(out: Path, settings: dict, fresh: dict, d: Dist) -> str:
    """The cache's status, `fresh` written for a new one; rank 0 decides and every rank gets its answer or error."""
    status = None
    if d.master:
        try:
            if (out / MANIFEST).is_file():
                manifest = store.read_manifest(out)
                old = manifest.get("settings", {})
                if diffs := [f"{k} {settings[k]!r} now vs {old.get(k)!r} in the cache"
                             for k in settings if old.get(k) != settings[k]]:
                    raise DFlashError(f"{out / MANIFEST}: this cache was extracted with different settings "
                                      f"({'; '.join(diffs)}); mixing them would make one cache hold two kinds of "
                                      "features: choose a new --out folder, or rerun with the cache's settings")
                status = manifest["status"]
            elif out.exists() and any(out.iterdir()):
                raise DFlashError(f"{out}: folder exists, is not empty and holds no {MANIFEST}; it is not a cache: "
                                  "choose a new or empty --out folder")
            else:
                write_json(out / MANIFEST, fresh)
                status = "in-progress"
        except DFlashError as e:
            status = e
    status = from_master(status, d)
    if isinstance(status, DFlashError):
        raise DFlashError(str(status))
    return status


def _find_done(run: _Run, layer_ids, hidden: int) -> None:
    """Record my prompts whose feature file is valid (its tokens give the completion too); delete any other file."""
    for i in run.mine:
        f, p = run.out / record_name(i, run.pids[i], run.sharded), run.prompts[i]
        if not f.is_file():
            continue
        head = None
        with suppress(DFlashError):  # read_header turns any unreadable file into a DFlashError
            head = read_header(f, layer_ids, hidden, tokens=True)
        if head is None or head["id"] != run.pids[i] or head["prompt_len"] != len(p) or head["tokens"][:len(p)] != p:
            f.unlink()
            continue
        run.completions[i] = head["tokens"][len(p):]
        run.done[i] = {"file": f.relative_to(run.out).as_posix(), "bytes": f.stat().st_size, "sha256": sha256_file(f)}


def _find_completions(run: _Run, reused: dict, completions_from) -> None:
    """Completions from earlier runs' logs or --completions-from, for the same prompt tokens (required for the latter)."""
    known = {}
    for f in sorted(run.out.glob(LOG_GLOB)):  # persisted by earlier (possibly killed) runs; a torn last line is ignored
        for line in f.read_text().splitlines():
            with suppress(json.JSONDecodeError, KeyError, TypeError):
                rec = json.loads(line)
                known[rec["id"]] = rec
    for i in run.mine:
        rec = known.get(run.pids[i]) or reused.get(run.pids[i])
        if i not in run.completions and rec is not None and rec["prompt_ids"] == run.prompts[i]:
            run.completions[i] = list(rec["completion_ids"])
    lost = [run.pids[i] for i in run.mine if i not in run.completions and i not in run.sampled]
    if completions_from is not None and lost:
        raise DFlashError(f"--completions-from {completions_from}: no completion with the same prompt tokens for "
                          f"{len(lost)} prompts ({', '.join(lost[:5])}); use a cache of the same suite and target")


def _generate_missing(run: _Run, target, layer_ids, max_new_tokens: int, batch_size: int, log: Path, show: bool,
                      callback, temperature: float, seed: int) -> None:
    """Greedy, then sampled, completions and features for my prompts without one; file first, then the log line."""
    todo = [i for i in run.mine if i not in run.completions]
    if not todo:
        return

    def answers():
        for temp in (0.0, temperature) if run.sampled else (0.0,):  # greedy answers first, then the sampled ones
            group = [i for i in todo if (i in run.sampled) == (temp > 0)]
            # a resumed run draws new samples for what is missing
            with seeded(seed + len(run.completions), target.device):
                for j, comp, feats in iter_generate_with_features(target, [run.prompts[i] for i in group],
                                                                  max_new_tokens, layer_ids, batch_size=batch_size,
                                                                  temperature=temp):
                    run.completions[group[j]] = comp
                    yield group[j], run.prompts[group[j]] + comp, feats, len(comp)

    with open(log, "a") as fh:
        for i in _write_records(run, answers(), len(todo), "generate", show, callback, ".1f"):
            _append(fh, {"id": run.pids[i], "prompt_ids": run.prompts[i], "completion_ids": run.completions[i]})
            if callback:
                callback("completion", run.pids[i])


def _capture_missing(run: _Run, target, layer_ids, batch_size: int, capture_tokens: int, show: bool, callback) -> None:
    """Features of prompt + completion for my prompts without a file, sorted by length to share forwards."""
    seqs = {i: run.prompts[i] + run.completions[i] for i in run.mine if i not in run.done}
    lengths = {i: len(s) for i, s in seqs.items()}
    todo = sorted(seqs, key=lengths.__getitem__)
    feats = ((i, seqs[i], fe, lengths[i]) for group in _batches(todo, lengths, batch_size, capture_tokens)
             for i, fe in zip(group, capture_features(target, [seqs[i] for i in group], layer_ids)))
    for _ in _write_records(run, feats, len(todo), "features", show, callback, ".0f"):
        pass


def _write_records(run: _Run, results, total: int, desc: str, show: bool, callback, rate: str):
    """Write each (index, prompt + completion, features, tokens) of `results` to its file; yield the index."""
    bar, t0, ntok = _bar(total, desc, show), time.perf_counter(), 0
    for i, seq, feats, n in results:
        rel = record_name(i, run.pids[i], run.sharded)
        size, digest = _write_record(run.out / rel, seq, len(run.prompts[i]), run.pids[i], feats)
        run.done[i] = {"file": rel, "bytes": size, "sha256": digest}
        if callback:
            callback("features", run.pids[i])
        yield i
        ntok += n
        bar.update(1)
        bar.set_postfix_str(f"{ntok / (time.perf_counter() - t0):{rate}} tok/s")
    bar.close()


def _my_entries(run: _Run, target, items) -> list[tuple[int, dict, dict]]:
    """(index, manifest entry, completions record) of each of my prompts: what rank 0 needs to merge."""
    entries = []
    for i in run.mine:
        p, c, done = run.prompts[i], run.completions[i], run.done[i]
        entry = {"id": run.pids[i], "category": items[i].category, "file": done["file"], "prompt_len": len(p),
                 "completion_len": len(c), "num_tokens": len(p) + len(c), "bytes": done["bytes"],
                 "sha256": done["sha256"]}
        record = {"id": run.pids[i], "messages": list(items[i].messages),
                  "prompt_text": target.tokenizer.decode(p, skip_special_tokens=False),
                  "prompt_ids": p, "completion_ids": c, "completion_text": target.decode(c)}
        entries.append((i, entry, record))
    return entries


def _finish(out: Path, manifest: dict, parts: list[list], num_prompts: int, world: int) -> dict:
    """Rank 0: every rank's entries into completions.json, then the manifest, marked complete last; the totals."""
    gathered = sorted((x for part in parts for x in part), key=lambda x: x[0])
    if [x[0] for x in gathered] != list(range(num_prompts)):
        raise DFlashError(f"{out}: ranks returned {len(gathered)} of {num_prompts} prompts; rerun to resume")
    entries = [x[1] for x in gathered]
    write_json(out / COMPLETIONS, [x[2] for x in gathered])
    manifest.update({
        "status": "complete", "finished": _now(), "world_size": world, "prompts": entries,
        "totals": {"prompts": len(entries), "tokens": sum(e["num_tokens"] for e in entries),
                   "completion_tokens": sum(e["completion_len"] for e in entries),
                   "bytes": sum(e["bytes"] for e in entries)},
    })
    write_json(out / MANIFEST, manifest)
    for f in out.glob(LOG_GLOB):
        f.unlink()
    return manifest["totals"]


def _settings(target, suite, layer_ids, max_new_tokens, backend, enable_thinking, completions_from) -> dict:
    """What a rerun into the same folder must match (batch size and world size may change)."""
    ident = target.identity()
    return {"target_config_hash": ident["config_hash"], "target_weights_hash": ident["weights_hash"],
            "layer_ids": list(layer_ids), "dtype": str(target.dtype).removeprefix("torch."), "device": target.device.type,
            "attention": getattr(target.model.config, "_attn_implementation", None), "linear_attention": backend,
            "max_new_tokens": int(max_new_tokens), "enable_thinking": bool(enable_thinking),
            "suite_content_hash": suite.content_hash, "completions_from": completions_from}


def _manifest(target, suite, settings: dict, requested_backend: str, batch_size: int, world: int) -> dict:
    """A new cache's manifest, "in-progress": how it is made (settings and more) and what it will hold."""
    prompt_ids = suite.ids()
    template = target.tokenizer.chat_template or ""
    return {
        "format": FORMAT, "status": "in-progress", "tool_version": __version__, "created": _now(), "finished": None,
        "target": target.identity(), "layer_ids": settings["layer_ids"],
        "features": dict(store.FEATURES),  # which tensor each layer_{l} is: decoder layer l's output, no final norm
        "dtype": settings["dtype"], "feature_dtype": settings["dtype"], "device": str(target.device),
        "attention": settings["attention"],
        "linear_attention": {"requested": requested_backend, "backend": settings["linear_attention"]},
        "generation": {
            "greedy": True, "max_new_tokens": settings["max_new_tokens"], "batch_size": int(batch_size),
            "samples": settings.get("samples", 0), "sample_temperature": settings.get("temperature"),
            "enable_thinking": settings["enable_thinking"], "template_has_thinking": "enable_thinking" in template,
            "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest()[:16],
            "stop_token_ids": list(target.stop_token_ids), "completions_from": settings["completions_from"],
        },
        "suite": {"name": suite.name, "content_hash": suite.content_hash, "num_prompts": len(prompt_ids),
                  "prompt_ids": prompt_ids},
        "layout": {"sharded": len(prompt_ids) > store.SHARD_THRESHOLD, "shard_size": SHARD_SIZE},
        "world_size": world, "settings": settings, "prompts": [], "totals": {},
    }


def _completions_from(path, target, prompt_ids: list[str]) -> tuple[dict, str]:
    """Completions of another cache (compare backends on identical tokens) or of a sequences JSONL, and their source."""
    if Path(path).is_file():
        header, recs = read_sequences(path)
        if not same_target(header.get("target"), target.identity()):
            raise DFlashError(f"--completions-from {path}: written by target {header.get('target', {}).get('name')}, "
                              f"not {target.name}; generate it with this target")
        on = f" (answered on {header['engine']})" if header.get("engine", "hf") != "hf" else ""  # data generate --engine
        return {r["id"]: r for r in recs}, f"{Path(path).resolve()}#{sha256_file(path)[:16]}{on}"
    m = store.read_manifest(path)
    store.check_target(path, m, target.identity())
    f = Path(path) / COMPLETIONS
    if m.get("status") != "complete" or not f.is_file():
        raise DFlashError(f"--completions-from {path}: that cache is unfinished (no {COMPLETIONS}); finish it first")
    recs = {r["id"]: r for r in json.loads(f.read_text())}
    return {p: recs[p] for p in prompt_ids if p in recs}, f"{Path(path).resolve()}#{store.sha256_json(m)[:16]}"


def _append(fh, rec: dict) -> None:
    """One durable line per completion: a kill loses at most the batch being generated."""
    try:
        fh.write(json.dumps(rec) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    except OSError as e:
        raise DFlashError(f"{fh.name}: cannot append a completion ({e}); free space or fix the folder and rerun the "
                          "same command to resume") from e


def _write_record(file: Path, tokens: list[int], prompt_len: int, pid: str, feats: dict[int, torch.Tensor]) -> tuple[int, str]:
    """One prompt's file, atomically; returns (bytes, sha256)."""
    tensors = {"tokens": torch.tensor(tokens, dtype=torch.long)}
    tensors.update({f"layer_{l}": t.contiguous() for l, t in feats.items()})
    data = save(tensors, metadata={"format": FORMAT, "prompt_id": pid, "prompt_len": str(prompt_len)})
    try:
        with atomic_path(file) as tmp:
            tmp.write_bytes(data)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise DFlashError(f"{file}: disk full while writing {len(data) >> 20} MiB; free space and rerun the same "
                              "command: finished prompts are kept and the extraction resumes") from e
        raise DFlashError(f"{file}: cannot write ({e}); fix the folder and rerun the same command to resume") from e
    return len(data), hashlib.sha256(data).hexdigest()


def _batches(order: list[int], lengths: list[int], batch_size: int, max_tokens: int):
    """Consecutive groups of length-sorted items: at most batch_size items and max_tokens padded tokens."""
    batch: list[int] = []
    for i in order:  # the widest so far is the newest
        if batch and (len(batch) >= batch_size or lengths[i] * (len(batch) + 1) > max_tokens):
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch


def _bar(total: int, desc: str, enabled: bool):
    # smoothing 0: a batch finishes its prompts at one instant, which a moving average reads as each prompt's time
    return tqdm(total=total, desc=desc, unit="prompt", disable=not enabled, dynamic_ncols=True, smoothing=0)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")

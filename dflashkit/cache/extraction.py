"""Extraction: the target's greedy completion of every prompt, then the hidden states of chosen layers over
prompt + completion, written as a cache (see store.py for the layout).

Resumable by construction: completions are appended to a per-rank log as each generation batch finishes,
and each prompt's features land in their own atomically written file, so a killed run loses at most one
batch; a rerun with the same settings picks up what is missing, and one with other settings is refused.
Under torchrun (WORLD_SIZE > 1) each rank takes every WORLD_SIZE-th prompt and rank 0 writes the manifest.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from dflashkit.cache.store import COMPLETIONS, FORMAT, MANIFEST, SHARD_SIZE, read_header, record_name
from dflashkit.cache import store
from dflashkit.errors import DFlashError
from dflashkit.fileio import atomic_path, sha256_file, write_json

LOG_GLOB = ".completions.rank*.jsonl"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _dist() -> tuple[int, int]:
    """(rank, world size); joins the torchrun process group (gloo: only small objects travel) when needed."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def _from_rank0(obj, world: int):
    if world == 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(obj, world: int) -> list:
    if world == 1:
        return [obj]
    import torch.distributed as dist

    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _settings(target, suite, layer_ids, max_new_tokens, backend, enable_thinking, completions_from) -> dict:
    """What a rerun into the same folder must match (batch size and world size may change)."""
    return {
        "target_config_hash": target.identity()["config_hash"],
        "target_weights_hash": target.identity()["weights_hash"],
        "layer_ids": list(layer_ids),
        "dtype": str(target.dtype).removeprefix("torch."),
        "device": target.device.type,
        "attention": getattr(target.model.config, "_attn_implementation", None),
        "linear_attention": backend,
        "max_new_tokens": int(max_new_tokens),
        "enable_thinking": bool(enable_thinking),
        "suite_content_hash": suite.content_hash,
        "completions_from": completions_from,
    }


def _check_settings(out: Path, manifest: dict, settings: dict) -> None:
    old = manifest.get("settings", {})
    diffs = [f"{k} {settings[k]!r} now vs {old.get(k)!r} in the cache" for k in settings if old.get(k) != settings[k]]
    if diffs:
        raise DFlashError(
            f"{out / MANIFEST}: this cache was extracted with different settings ({'; '.join(diffs)}); mixing them "
            "would make one cache hold two kinds of features: choose a new --out folder, or rerun with the cache's settings"
        )


def _manifest(target, suite, layer_ids, settings, requested_backend, max_new_tokens, batch_size, enable_thinking,
              completions_from, prompt_ids, world) -> dict:
    from dflashkit import __version__

    template = target.tokenizer.chat_template or ""
    return {
        "format": FORMAT,
        "status": "in-progress",
        "tool_version": __version__,
        "created": _now(),
        "finished": None,
        "target": target.identity(),
        "layer_ids": list(layer_ids),
        "dtype": settings["dtype"],
        "feature_dtype": settings["dtype"],
        "device": str(target.device),
        "attention": settings["attention"],
        "linear_attention": {"requested": requested_backend, "backend": settings["linear_attention"]},
        "generation": {
            "greedy": True, "max_new_tokens": int(max_new_tokens), "batch_size": int(batch_size),
            "enable_thinking": bool(enable_thinking), "template_has_thinking": "enable_thinking" in template,
            "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest()[:16],
            "stop_token_ids": list(target.stop_token_ids), "completions_from": completions_from,
        },
        "suite": {"name": suite.name, "content_hash": suite.content_hash, "num_prompts": len(prompt_ids),
                  "prompt_ids": list(prompt_ids)},
        "layout": {"sharded": len(prompt_ids) > store.SHARD_THRESHOLD, "shard_size": SHARD_SIZE},
        "world_size": world,
        "settings": settings,
        "prompts": [],
        "totals": {},
    }


def _read_logs(out: Path) -> dict[str, dict]:
    """Completions persisted by earlier (possibly killed) runs; a torn last line is ignored."""
    known = {}
    for f in sorted(out.glob(LOG_GLOB)):
        for line in f.read_text().splitlines():
            try:
                rec = json.loads(line)
                known[rec["id"]] = rec
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return known


def _completions_from(path, target, prompt_ids: list[str]) -> tuple[dict, str]:
    """Reuse another cache's completions, so that two backends are compared on identical tokens."""
    m = store.read_manifest(path)
    store.check_target(path, m, target.identity())
    f = Path(path) / COMPLETIONS
    if m.get("status") != "complete" or not f.is_file():
        raise DFlashError(f"--completions-from {path}: that cache is unfinished (no {COMPLETIONS}); finish it first")
    recs = {r["id"]: r for r in json.loads(f.read_text())}
    return {p: recs[p] for p in prompt_ids if p in recs}, f"{Path(path).resolve()}#{store.sha256_json(m)[:16]}"


def _write_record(file: Path, tokens: list[int], prompt_len: int, pid: str, feats: dict[int, torch.Tensor]) -> tuple[int, str]:
    """One prompt's file, atomically; returns (bytes, sha256)."""
    from safetensors.torch import save

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


def _append(fh, rec: dict) -> None:
    """One durable line per completion: a kill loses at most the batch being generated."""
    try:
        fh.write(json.dumps(rec) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    except OSError as e:
        raise DFlashError(f"{fh.name}: cannot append a completion ({e}); free space or fix the folder and rerun the "
                          "same command to resume") from e


def capture_features(target, seqs: list[list[int]], layer_ids) -> list[dict[int, torch.Tensor]]:
    """Features of several sequences in one forward (Target.features: right padding, never seen).

    seqs: token id lists; returns per sequence {layer id: [T_i, H] tensor on CPU, target dtype}.
    """
    feats = target.features(seqs, layer_ids).cpu()  # [b, T, K*H]
    H = target.hidden_size
    return [{l: feats[r, : len(s), k * H:(k + 1) * H].clone() for k, l in enumerate(layer_ids)}
            for r, s in enumerate(seqs)]


def _batches(order: list[int], lengths: list[int], batch_size: int, max_tokens: int):
    """Consecutive groups of length-sorted items: at most batch_size items and max_tokens padded tokens."""
    batch: list[int] = []
    for i in order:
        width = max([lengths[j] for j in batch] + [lengths[i]])
        if batch and (len(batch) >= batch_size or width * (len(batch) + 1) > max_tokens):
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch


def _valid_existing(file: Path, pid: str, prompt: list[int], layer_ids, hidden: int) -> list[int] | None:
    """Tokens of an existing, readable prompt file that matches this prompt; None if it must be redone."""
    from safetensors import SafetensorError, safe_open

    try:
        head = read_header(file, layer_ids, hidden)
        with safe_open(str(file), framework="pt") as f:
            toks = f.get_tensor("tokens").tolist()
    except (DFlashError, OSError, SafetensorError):  # read_header turns a corrupt header into a DFlashError
        return None
    if head["id"] != pid or head["prompt_len"] != len(prompt) or toks[: len(prompt)] != prompt:
        return None
    return toks


def _bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="prompt", disable=not enabled, dynamic_ncols=True)


def extract(target, suite, out, layer_ids=None, max_new_tokens: int = 256, batch_size: int = 8,
            linear_attention: str = "auto", progress: bool = True, enable_thinking: bool = False,
            completions_from=None, capture_tokens: int = 4096, allow_final_layers: bool = False,
            callback=None) -> Path:
    """Write (or finish) the cache of `suite` under `out`; returns `out`.

    layer_ids: target layers to store (default target.default_layer_ids(5)), kept once each, ascending.
    linear_attention: auto|torch|torch-recurrent|fla, for hybrid targets (see dflashkit.target.backends).
    enable_thinking: passed to chat templates that have a thinking mode (recorded either way).
    completions_from: another cache whose completions are reused instead of generating (compare backends
    on identical tokens).
    capture_tokens: padded tokens per feature-capture forward. callback(event, prompt_id) is called after
    each persisted completion ("completion") and prompt file ("features").
    """
    from dflashkit.target.backends import linear_attention as la_backend, resolve_backend

    out = Path(out)
    if int(max_new_tokens) < 1 or int(batch_size) < 1:
        raise DFlashError(f"max_new_tokens ({max_new_tokens}) and batch_size ({batch_size}) must be at least 1")
    layer_ids = target.check_layer_ids(layer_ids if layer_ids is not None else target.default_layer_ids(5),
                                       allow_final=allow_final_layers)
    layer_ids = sorted(set(layer_ids))  # each layer stored once; features([1, 2, 2]) still repeats on reading
    rank, world = _dist()
    backend = resolve_backend(target, linear_attention)
    items = list(suite.items)
    pids = [it.id for it in items]
    prompts = [target.chat_ids(it.messages, enable_thinking=enable_thinking) for it in items]
    reused, source = ({}, None) if completions_from is None else _completions_from(completions_from, target, pids)
    settings = _settings(target, suite, layer_ids, max_new_tokens, backend, enable_thinking, source)
    say = print if progress and rank == 0 else (lambda *a, **k: None)

    # ---- start or resume (rank 0 decides; everyone gets the same answer) -------------------------------
    status = None
    if rank == 0:
        try:
            if (out / MANIFEST).is_file():
                manifest = store.read_manifest(out)
                _check_settings(out, manifest, settings)
                status = manifest["status"]
            else:
                if out.exists() and any(out.iterdir()):
                    raise DFlashError(f"{out}: folder exists, is not empty and holds no {MANIFEST}; it is not a cache: "
                                      "choose a new or empty --out folder")
                write_json(out / MANIFEST, _manifest(target, suite, layer_ids, settings, linear_attention,
                                                     max_new_tokens, batch_size, enable_thinking, source, pids, world))
                status = "in-progress"
        except DFlashError as e:
            status = e
    status = _from_rank0(status, world)
    if isinstance(status, DFlashError):
        raise DFlashError(str(status))
    if status == "complete":
        say(f"{out}: complete ({len(pids)} prompts, same settings); nothing to do")
        return out
    manifest = store.read_manifest(out)
    sharded = manifest["layout"]["sharded"]
    mine = list(range(rank, len(items), world))

    # ---- which of my prompts are done: valid files first, then logged or reused completions -------------
    completions: dict[int, list[int]] = {}
    done: dict[int, dict] = {}
    for i in mine:
        f = out / record_name(i, pids[i], sharded)
        if f.is_file():
            toks = _valid_existing(f, pids[i], prompts[i], layer_ids, target.hidden_size)
            if toks is None:
                f.unlink()  # unreadable or from other tokens: redo it
                continue
            completions[i] = toks[len(prompts[i]):]
            done[i] = {"file": f.relative_to(out).as_posix(), "bytes": f.stat().st_size, "sha256": sha256_file(f)}
    known = _read_logs(out)
    for i in mine:
        rec = known.get(pids[i]) or reused.get(pids[i])
        if i not in completions and rec is not None and rec["prompt_ids"] == prompts[i]:
            completions[i] = list(rec["completion_ids"])
    if completions_from is not None:
        lost = [pids[i] for i in mine if i not in completions]
        if lost:
            raise DFlashError(f"--completions-from {completions_from}: no completion with the same prompt tokens for "
                              f"{len(lost)} prompts ({', '.join(lost[:5])}); use a cache of the same suite and target")

    with la_backend(target, linear_attention):
        # ---- generation, batched, persisted per batch ---------------------------------------------------
        todo = [i for i in mine if i not in completions]
        if todo:
            from dflashkit.target.generation import iter_generate_greedy

            log = out / f".completions.rank{rank}.jsonl"
            bar = _bar(len(todo), "generate", progress and rank == 0)
            t0, ntok = time.perf_counter(), 0
            it = iter_generate_greedy(target, [prompts[i] for i in todo], max_new_tokens, batch_size=batch_size)
            with open(log, "a") as fh:
                for j, comp in it:
                    i = todo[j]
                    completions[i] = comp
                    _append(fh, {"id": pids[i], "prompt_ids": prompts[i], "completion_ids": comp})
                    ntok += len(comp)
                    bar.update(1)
                    bar.set_postfix_str(f"{ntok / (time.perf_counter() - t0):.1f} tok/s")
                    if callback:
                        callback("completion", pids[i])
            bar.close()

        # ---- features, several prompts per forward, one file each ----------------------------------------
        todo = sorted((i for i in mine if i not in done), key=lambda i: len(prompts[i]) + len(completions[i]))
        seqs = {i: prompts[i] + completions[i] for i in todo}
        lengths = {i: len(s) for i, s in seqs.items()}
        bar = _bar(len(todo), "features", progress and rank == 0)
        t0, ntok = time.perf_counter(), 0
        for group in _batches(todo, lengths, batch_size, capture_tokens):
            feats = capture_features(target, [seqs[i] for i in group], layer_ids)
            for i, fe in zip(group, feats):
                rel = record_name(i, pids[i], sharded)
                size, digest = _write_record(out / rel, seqs[i], len(prompts[i]), pids[i], fe)
                done[i] = {"file": rel, "bytes": size, "sha256": digest}
                ntok += lengths[i]
                bar.update(1)
                bar.set_postfix_str(f"{ntok / (time.perf_counter() - t0):.0f} tok/s")
                if callback:
                    callback("features", pids[i])
        bar.close()

    # ---- merge on rank 0 ------------------------------------------------------------------------------
    mine_entries = []
    for i in mine:
        c = completions[i]
        mine_entries.append((i, {
            "id": pids[i], "file": done[i]["file"], "prompt_len": len(prompts[i]), "completion_len": len(c),
            "num_tokens": len(prompts[i]) + len(c), "bytes": done[i]["bytes"], "sha256": done[i]["sha256"],
        }, {
            "id": pids[i], "messages": list(items[i].messages),
            "prompt_text": target.tokenizer.decode(prompts[i], skip_special_tokens=False),
            "prompt_ids": prompts[i], "completion_ids": c, "completion_text": target.decode(c),
        }))
    gathered = sorted((x for part in _gather(mine_entries, world) for x in part), key=lambda x: x[0])
    if rank == 0:
        if [x[0] for x in gathered] != list(range(len(items))):
            raise DFlashError(f"{out}: ranks returned {len(gathered)} of {len(items)} prompts; rerun to resume")
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
        t = manifest["totals"]
        say(f"{out}: {t['prompts']} prompts, {t['tokens']} tokens, layers {layer_ids}, {t['bytes'] / 2**20:.1f} MiB")
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
    return out

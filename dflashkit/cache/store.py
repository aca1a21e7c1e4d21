"""The on-disk cache: manifest.json (each file with its sha256, and whether extraction finished), completions.json,
and one atomically written safetensors file per prompt: `tokens` [T] and `layer_{l}` [T, H], the OUTPUT of decoder
layer l (docs/design.md section 2). Reading is strict: fewer prompts, other layers or another target are errors."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from contextlib import suppress
from functools import cached_property
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from dflashkit.errors import DFlashError
from dflashkit.fileio import read_json, sha256_file, sha256_json
from dflashkit.targets.model import check_same_target, identity_mismatch

FORMAT = "dflashkit-cache/1"
MANIFEST, COMPLETIONS = "manifest.json", "completions.json"
SHARD_THRESHOLD = 2000  # caches with more prompts than this put their files in shard folders
SHARD_SIZE = 1000  # prompts per shard folder
# which tensor `layer_{l}` is (docs/design.md section 14): the output of decoder layer l, i.e. Hugging Face's
# output_hidden_states[l + 1] (index 0 is the embeddings), the last layer too taken before the target's final norm
FEATURES = {"hidden_states_index": "layer_id + 1", "final_norm": False}


def record_name(index: int, pid: str, sharded: bool) -> str:
    """Relative file name of prompt number `index` (suite order); readable, and unique whatever the id."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", pid)[:48].strip("._") or "prompt"
    name = f"{index:06d}-{safe}.safetensors"
    return f"shard-{index // SHARD_SIZE:04d}/{name}" if sharded else name


def read_manifest(path) -> dict:
    path = Path(path)
    f = path / MANIFEST
    if not f.is_file():
        hint = " (it does not exist)" if not path.exists() else ""
        raise DFlashError(f"{path}: not a dflashkit cache, no {MANIFEST}{hint}; create one with `dflashkit extract --out {path}`")
    m = read_json(f, "the manifest is corrupt: re-extract the cache")
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise DFlashError(f"{f}: field 'format' is {m.get('format') if isinstance(m, dict) else None!r}, expected {FORMAT!r}; "
                          "this is not a cache written by this version of dflashkit")
    check_features(f, m.get("features", FEATURES))  # caches from before the field: written by the same hooks
    return m


def check_features(source, features: dict) -> None:
    """A cache whose layers are other tensors than a drafter reads is refused on opening, in one line each."""
    index = features.get("hidden_states_index")
    if index != FEATURES["hidden_states_index"]:
        raise DFlashError(f"{source}: features.hidden_states_index is {index!r}, but a drafter's layer l is the output of "
                          "decoder layer l = output_hidden_states[l + 1] (index 0 is the embeddings); re-extract with "
                          "`dflashkit extract` (or store hidden_states[l + 1] as layer_{l})")
    if features.get("final_norm") is not False:
        raise DFlashError(f"{source}: features.final_norm is {features.get('final_norm')!r}: the last layer was stored "
                          "after the target's final norm (Hugging Face's last hidden_states entry), but drafters read "
                          "raw decoder-layer outputs; re-extract with `dflashkit extract`")


def read_header(file: Path, layer_ids, hidden_size: int, tokens: bool = False) -> dict:
    """Open one prompt file and check its tensors' names and shapes; returns its metadata and length (and tokens)."""
    try:
        with safe_open(str(file), framework="pt") as f:
            meta, shapes = f.metadata() or {}, {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
            toks = f.get_tensor("tokens").tolist() if tokens and "tokens" in shapes else None
    except Exception as e:  # safetensors raises several types for truncated or corrupt headers
        raise DFlashError(f"{file}: cannot read ({str(e).splitlines()[0]}); the file is truncated or corrupt: "
                          "run `dflashkit cache verify` and rerun the extraction to replace it") from e
    want = {"tokens"} | {f"layer_{l}" for l in layer_ids}
    if not want <= shapes.keys():
        raise DFlashError(f"{file}: missing tensors {sorted(want - shapes.keys())}; the file does not match the manifest's "
                          "layer ids: run `dflashkit cache verify` and re-extract")
    T = shapes["tokens"][0]
    for l in layer_ids:
        if shapes[f"layer_{l}"] != [T, hidden_size]:
            raise DFlashError(f"{file}: layer_{l} has shape {shapes[f'layer_{l}']}, expected [{T}, {hidden_size}]")
    return {"id": meta.get("prompt_id"), "prompt_len": int(meta.get("prompt_len", -1)), "num_tokens": int(T),
            "tokens": toks}


class CacheRecord:
    """One prompt of a cache: its tokens and, on request, the features of chosen layers."""

    def __init__(self, cache: "Cache", entry: dict):
        self.id: str = entry["id"]
        self.category: str | None = entry.get("category")  # caches from before categories: None
        self.prompt_len: int = int(entry["prompt_len"])
        self.num_tokens: int = int(entry["num_tokens"])
        self.file: Path = cache.path / entry["file"]
        self._cache = cache

    def _read(self, names: list[str]) -> list[torch.Tensor]:
        try:
            with safe_open(str(self.file), framework="pt") as f:
                out = [f.get_tensor(n) for n in names]
        except FileNotFoundError as e:
            raise DFlashError(f"{self.file}: missing, though {self._cache.path / MANIFEST} lists it; "
                              "run `dflashkit cache verify` and re-extract") from e
        except Exception as e:
            raise DFlashError(f"{self.file}: cannot read ({str(e).splitlines()[0]}); the file is truncated or corrupt: "
                              "run `dflashkit cache verify` and rerun the extraction") from e
        if out[0].shape[0] != self.num_tokens:
            raise DFlashError(f"{self.file}: holds {out[0].shape[0]} positions but the manifest says {self.num_tokens}; "
                              "run `dflashkit cache verify`")
        return out

    @cached_property
    def tokens(self) -> torch.Tensor:
        """LongTensor [T]: prompt ids followed by the target's greedy completion."""
        return self._read(["tokens"])[0].long()

    def features(self, layer_ids=None) -> torch.Tensor:
        """float32 [T, K*H]: row p holds the features of position p, layers concatenated in the given order."""
        ids = self._cache.selected_layer_ids if layer_ids is None else [int(l) for l in layer_ids]
        self._cache.check_layers(ids)
        feats = torch.cat([t.float() for t in self._read([f"layer_{l}" for l in ids])], dim=-1)
        if not torch.isfinite(feats).all():  # corruption that keeps shapes: a target never writes NaN/inf
            bad = (~torch.isfinite(feats)).any(-1).nonzero().flatten()
            raise DFlashError(f"{self.file}: prompt {self.id!r} has non-finite features at {len(bad)} position(s) "
                              f"(first {int(bad[0])}); the record is corrupt: run `dflashkit cache verify "
                              f"{self._cache.path}` and re-extract")
        return feats

    def __repr__(self) -> str:
        return f"CacheRecord({self.id!r}, prompt_len={self.prompt_len}, tokens={self.num_tokens})"


class Cache:
    """An opened cache restricted to the selected prompts; iterate for CacheRecords in suite order."""

    def __init__(self, path, manifest: dict, entries: list[dict], shortfall: dict | None, selected_layer_ids):
        self.path, self.manifest = Path(path), manifest
        self.manifest_hash = sha256_json(manifest)
        self.layer_ids: list[int] = list(manifest["layer_ids"])
        self.selected_layer_ids: list[int] = list(selected_layer_ids)
        self.target: dict = manifest["target"]
        self.hidden_size: int = int(manifest["target"]["hidden_size"])
        self.shortfall = shortfall
        self._entries = {e["id"]: e for e in entries}
        self.prompt_ids: list[str] = [e["id"] for e in entries]

    def check_layers(self, layer_ids) -> None:
        if missing := [l for l in layer_ids if l not in self.layer_ids]:
            raise DFlashError(f"cache {self.path} holds target layers {self.layer_ids} but layers {missing} were "
                              f"asked for (requested {list(layer_ids)}); extract a cache with `--target-layers "
                              f"{','.join(map(str, layer_ids))}` or use a drafter trained on the cached layers")

    def record(self, pid: str) -> CacheRecord:
        if pid not in self._entries:
            raise DFlashError(f"cache {self.path}: no prompt {pid!r} among the {len(self)} selected prompts")
        return CacheRecord(self, self._entries[pid])

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def __iter__(self) -> Iterator[CacheRecord]:
        return (CacheRecord(self, self._entries[pid]) for pid in self.prompt_ids)

    def __repr__(self) -> str:
        short = f", shortfall {self.shortfall['present']}/{self.shortfall['requested']}" if self.shortfall else ""
        return f"Cache({str(self.path)!r}, {len(self)} prompts, layers {self.selected_layer_ids}{short})"


def _list(ids, n: int = 5) -> str:
    ids = list(ids)
    return ", ".join(ids[:n]) + (f", ... ({len(ids) - n} more)" if len(ids) > n else "")


def describe_nearby(path, target: dict) -> str:
    """Sibling caches in the parent folder, the most prompts first: where the right cache often is."""
    path, found = Path(path), []
    with suppress(OSError):
        for d in sorted(path.parent.iterdir()):
            if d.name != path.name and (d / MANIFEST).is_file():
                with suppress(DFlashError):  # an unreadable one is no hint
                    found.append((d, read_manifest(d)))
    found.sort(key=lambda dm: -len(dm[1].get("prompts", [])) if dm[1].get("status") == "complete" else 1)
    parts = []
    for d, m in found[:5]:
        t = m.get("target", {})
        same = "same target" if not identity_mismatch(t, target) else f"target {t.get('name')}"
        if m.get("status") == "complete":
            parts.append(f"{d} ({len(m.get('prompts', []))} prompts, {same})")
        else:
            n = sum(1 for _ in d.rglob("*.safetensors"))
            parts.append(f"{d} ({n} of {m['suite']['num_prompts']} prompts so far, {same}, incomplete)")
    return "; caches nearby: " + ", ".join(parts) if parts else "; no other caches in " + str(path.parent)


def scan_entries(path, manifest: dict, read: bool = True) -> list[dict]:
    """Entries of an unfinished cache from its files so far; read=False leaves them unopened (lengths None)."""
    path, m, out = Path(path), manifest, []
    for i, pid in enumerate(m["suite"]["prompt_ids"]):
        rel = record_name(i, pid, m["layout"]["sharded"])
        if (path / rel).is_file():
            head = read_header(path / rel, m["layer_ids"], m["target"]["hidden_size"]) if read else {}
            out.append({"id": pid, "file": rel, **{k: head.get(k) for k in ("prompt_len", "num_tokens")}})
    return out


def check_target(path, manifest: dict, expect: dict) -> None:
    """Refuse a cache of another target (other weights, a fine-tune included, config or hidden size)."""
    have = manifest["target"]
    if expect.get("hidden_size") is not None and int(expect["hidden_size"]) != int(have["hidden_size"]):
        raise DFlashError(f"cache {path} holds hidden size {have['hidden_size']} (target {have.get('name')}) but the "
                          f"target in use has hidden size {expect['hidden_size']} ({expect.get('name')}); extract a "
                          f"cache with `--target {expect.get('name')}`")
    check_same_target(have, expect, f"cache {path}",
                      "its features would be misread: extract a cache with this target "
                      f"(`dflashkit extract --target {expect.get('path') or expect.get('name')}`), or use the cache's "
                      f"own target ({have.get('path') or have.get('name')})")


def open_cache(path, num_prompts: int | None = None, allow_partial: bool = False, expect_target: dict | None = None,
               layer_ids=None, partial_hint: str = "allow_partial=True") -> Cache:
    """Open a cache strictly: the first num_prompts in suite order (None: all), fewer raising unless allow_partial
    (then `.shortfall` records it); expect_target: the identity in use; layer_ids: what `record.features()`
    returns, in order; partial_hint: how the user accepts a shortfall, named in the error."""
    path = Path(path)
    m = read_manifest(path)
    if expect_target is not None:
        check_target(path, m, expect_target)
    selected = list(m["layer_ids"]) if layer_ids is None else [int(l) for l in layer_ids]
    suite_ids = list(m["suite"]["prompt_ids"])
    complete = m.get("status") == "complete"
    entries = m["prompts"] if complete else scan_entries(path, m)
    if num_prompts is not None and (isinstance(num_prompts, bool) or int(num_prompts) < 1):
        raise DFlashError(f"num_prompts must be a positive number, got {num_prompts!r}")
    requested = len(suite_ids) if num_prompts is None else int(num_prompts)
    wanted = suite_ids[:requested]
    have = {e["id"]: e for e in entries}
    chosen = [have[p] for p in wanted if p in have]
    shortfall = None
    if len(chosen) < requested:
        present = [e["id"] for e in chosen]
        # missing: ids known to be absent (a cache of a smaller suite does not know the others' ids)
        shortfall = {"requested": requested, "present": len(chosen), "missing": [p for p in wanted if p not in have],
                     "missing_count": requested - len(chosen), "present_ids": present, "complete": complete}
        if not allow_partial:
            why = "" if complete else (f" (the extraction stopped after {len(entries)} of the suite's {len(suite_ids)} "
                                       "prompts: rerun the same `dflashkit extract` command to resume it)")
            raise DFlashError(f"cache {path} has {len(chosen)} of the {requested} requested prompts "
                              f"({_list(present) or 'none'}){why}{describe_nearby(path, m['target'])}; pass "
                              f"{partial_hint} to proceed with {len(chosen)}, or point at a cache that holds all "
                              f"{requested}")
    cache = Cache(path, m, chosen, shortfall, selected)
    cache.check_layers(selected)
    for e in chosen:
        if not (path / e["file"]).is_file():
            raise DFlashError(f"{path / e['file']}: missing, though {path / MANIFEST} lists it; the cache was modified "
                              "after extraction: run `dflashkit cache verify` and re-extract")
    return cache


def record_digest(file) -> str:
    """A record file's tensors and metadata, whatever order safetensors wrote its header in (from a hash map)."""
    h = hashlib.sha256()
    with safe_open(str(file), "pt") as f:
        h.update(json.dumps(sorted((f.metadata() or {}).items())).encode())
        for name in sorted(f.keys()):
            t = f.get_tensor(name).contiguous()
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def content_digest(path) -> str:
    """What a cache holds, not when it was written, so a rebuild of the same features digests the same; '' if unreadable."""
    path = Path(path)
    try:
        m = {k: v for k, v in read_json(path / MANIFEST).items() if k not in ("created", "finished")}
        m["prompts"] = [{k: v for k, v in e.items() if k != "sha256"} for e in m.get("prompts", [])]
        files = [f for f in sorted(path.rglob("*")) if f.is_file() and f.name != MANIFEST]
        rows = [(str(f.relative_to(path)), record_digest(f) if f.suffix == ".safetensors" else sha256_file(f)) for f in files]
    except (OSError, DFlashError, SafetensorError):  # no manifest, or a truncated record: not what was built
        return ""
    return sha256_json([m, rows])


def cache_size(path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def find_caches(roots) -> list[Path]:
    """Every folder holding a manifest.json under the given roots (shard folders are not descended)."""
    out = []
    for root in roots:
        for d, subdirs, files in os.walk(root):
            if MANIFEST in files:
                out.append(Path(d))
                subdirs[:] = []
            else:
                subdirs[:] = sorted(s for s in subdirs if not s.startswith("."))
    return out


def verify_cache(path, progress: bool = False) -> tuple[list[str], dict]:
    """Every file against the manifest and completions.json, and nothing unlisted -> (problems, summary)."""
    path = Path(path)
    m = read_manifest(path)
    problems: list[str] = []
    complete = m.get("status") == "complete"
    if not complete:
        problems.append(f"{path / MANIFEST}: status is {m.get('status')!r}: the extraction did not finish; rerun the same "
                        "`dflashkit extract` command to resume it")
    suite_ids = list(m["suite"]["prompt_ids"])
    entries = m.get("prompts", []) if complete else scan_entries(path, m, read=False)
    ids = [e["id"] for e in entries]
    if complete and ids != suite_ids:
        problems.append(f"{path / MANIFEST}: lists {len(ids)} prompt entries but its suite has {len(suite_ids)} prompts "
                        f"(missing: {_list([p for p in suite_ids if p not in set(ids)]) or 'none'})")
    comps, cf = {}, path / COMPLETIONS
    try:
        comps = {c["id"]: c for c in json.loads(cf.read_text())} if complete else {}
    except FileNotFoundError:
        problems.append(f"{cf}: missing; the manifest says the extraction finished")
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        problems.append(f"{cf}: unreadable ({e})")
    bar = tqdm(entries, desc="verify", unit="file", disable=not progress, leave=False)
    tokens = sum(_check_record(path, e, m, comps, complete, problems) for e in bar)
    listed = {(path / e["file"]).resolve() for e in entries}
    problems += [f"{f}: not listed in {path / MANIFEST}" + ("" if complete else " under the expected name")
                 for f in sorted(path.rglob("*.safetensors")) if f.resolve() not in listed]
    if complete and m.get("totals", {}).get("tokens") not in (None, tokens) and not any("missing" in p for p in problems):
        problems.append(f"{path / MANIFEST}: totals.tokens is {m['totals']['tokens']} but the files hold {tokens}")
    return problems, {"prompts": len(entries), "tokens": tokens, "complete": complete, "suite_prompts": len(suite_ids)}


def _check_record(path: Path, e: dict, m: dict, comps: dict, complete: bool, problems: list[str]) -> int:
    """One record file against its manifest entry and completions.json; returns the tokens it holds (0 if unread)."""
    f, cf = path / e["file"], path / COMPLETIONS
    if not f.is_file():
        problems.append(f"{f}: missing (listed for prompt {e['id']!r})")
        return 0
    if e.get("bytes") is not None and f.stat().st_size != e["bytes"]:
        problems.append(f"{f}: {f.stat().st_size} bytes, the manifest says {e['bytes']}: truncated or replaced")
    if e.get("sha256") and sha256_file(f) != e["sha256"]:
        problems.append(f"{f}: sha256 differs from the manifest: the file is corrupt or was changed")
    c = comps.get(e["id"])
    try:
        head = read_header(f, m["layer_ids"], m["target"]["hidden_size"], tokens=c is not None)
    except DFlashError as err:
        problems.append(str(err))
        return 0
    problems += [f"{f}: {key} is {head[key]!r} in the file but {e[key]!r} in the manifest"
                 for key in ("id", "prompt_len", "num_tokens") if e.get(key) is not None and head[key] != e[key]]
    if complete and c is None and comps:
        problems.append(f"{cf}: no entry for prompt {e['id']!r}")
    elif c is not None and head["tokens"] != c["prompt_ids"] + c["completion_ids"]:
        problems.append(f"{f}: tokens differ from prompt + completion ids in {cf} for {e['id']!r}")
    return head["num_tokens"]

"""`dflashkit drafter export`: a trained drafter in the format an engine serves, with its draft vocabulary's token
map (`d2t`) unless `--full-vocab`, which makes engines draft over tokens it never trained on: the export then states
tau as trained and as exported. It sits above drafter, engines and evaluate, the three stages it uses."""

from __future__ import annotations

from pathlib import Path

import torch

from dflashkit.cache import open_cache
from dflashkit.drafter.checkpoint import check_against_target, load_drafter, run_latest, save_drafter
from dflashkit.drafter.cli import DTYPES, FORMATS
from dflashkit.engines.install import require
from dflashkit.engines.llamacpp import drafter_gguf
from dflashkit.errors import DFlashError
from dflashkit.evaluate.offline import evaluate
from dflashkit.targets.model import load_target


def cmd_export(args) -> int:
    res = export_drafter(args.drafter, args.out, args.format, dtype=args.dtype, target_ref=args.target,
                         full_vocab=args.full_vocab, cache=args.cache, num_prompts=args.num_prompts)
    print("\n".join(res["lines"]))
    return 0


def export_drafter(src, out, fmt: str = "zlab", dtype: str = "bfloat16", target_ref: str | None = None,
                   full_vocab: bool = False, cache: str | None = None, num_prompts: int | None = None) -> dict:
    """Write the export, its token map read back and checked; returns what it wrote, taus None without a cache."""
    for flag, value, allowed in (("--format", fmt, FORMATS), ("--dtype", dtype, DTYPES)):
        if value not in allowed:
            raise DFlashError(f"{flag} {value!r}: use one of {', '.join(allowed)}")
    src, out = run_latest(src) or Path(src), Path(out)
    if fmt == "gguf" and out.suffix != ".gguf":
        raise DFlashError(f"--out {out}: a GGUF export is one file; name it *.gguf")
    drafter = load_drafter(src)
    vocab = (drafter.contract or {}).get("draft_vocab")
    keep_map = bool(vocab) and not full_vocab
    needs_target = fmt in ("gguf", "transformers") or keep_map or cache
    tgt = (drafter.contract or {}).get("target") or {}  # the recorded folder, or the registry name when it moved
    target_ref = target_ref or (tgt["path"] if tgt.get("path") and Path(tgt["path"]).exists() else tgt.get("name"))
    if needs_target and not target_ref:
        raise DFlashError(f"{src}: records no target (a z-lab folder); pass --target NAME_OR_FOLDER")
    # tau on the target as served: the cache's features are at the format it was extracted at (the drafter's any)
    served = (open_cache(cache).target.get("weights") or "float") if cache else None
    target = load_target(target_ref, device="cpu", weights=served or "float") if needs_target else None
    if target is not None:
        check_against_target(drafter.config, target, str(src))
    if fmt == "gguf":
        drafter_gguf(require("llama.cpp"), drafter, target, dtype, out, token_map=keep_map)
    else:  # transformers: its head is the target's own, so a draft vocabulary cannot travel (refused by name)
        save_drafter(drafter, out, format=fmt, dtype=getattr(torch, dtype),
                     lm_head=target.lm_head.weight if keep_map else None)
    if fmt == "zlab" and (written := (load_drafter(out).contract or {}).get("draft_vocab")) != (vocab if keep_map else None):
        raise DFlashError(f"{out}: the written token map ({len(written or [])} ids) is not the drafter's "
                          f"({len(vocab or []) if keep_map else 0}); the export is wrong, please report it")
    full = target.lm_head.weight.shape[0] if target is not None else drafter.config.vocab_size
    res = {"path": str(out), "format": fmt, "dtype": dtype, "source": str(src),
           "vocabulary": {"as_trained": len(vocab) if vocab else full, "as_exported": len(vocab) if keep_map else full},
           "tau": {"as_trained": None, "as_exported": None}, "trained_at": tgt.get("weights") or "float",
           "measured_at": served}
    if cache:
        res["tau"] = _offline_tau(drafter, target, cache, num_prompts, exported_full=bool(vocab) and not keep_map)
    res["lines"] = _lines(res, bool(vocab), keep_map)
    return res


def _offline_tau(drafter, target, cache_path: str, num_prompts: int | None, exported_full: bool) -> dict:
    if exported_full and drafter.config.arch != "dflash":  # evaluate scores the full vocabulary for DFlash only
        raise DFlashError(f"{drafter.config.arch}: tau over the full vocabulary is measured for DFlash drafters "
                          "only; export with the token map (leave out --full-vocab)")
    cache = open_cache(cache_path, num_prompts=num_prompts, expect_target=target.identity(),
                       layer_ids=drafter.config.target_layer_ids)
    o = evaluate(drafter, target, cache, trees=(), progress=True)["overall"]
    as_exported = o["as_exported"]["tau"] if exported_full else o["tau"]
    return {"as_trained": o["tau"], "as_exported": as_exported, "prompts": o["prompts"], "cache": str(cache.path)}


def _lines(res: dict, has_vocab: bool, keep_map: bool) -> list[str]:
    v, t = res["vocabulary"], res["tau"]
    lines = [f"{res['path']}: {res['format']} ({res['dtype']}) from {res['source']}"]
    if res["format"] == "transformers":
        lines.append(f"use: drafter = AutoModel.from_pretrained({res['path']!r}); target.generate(ids, "
                     "assistant_model=drafter, speculation_type='dflash') (docs/engines.md)")
    if not has_vocab:
        lines.append(f"vocabulary: the full {v['as_trained']} tokens, as trained")
    elif keep_map:
        lines.append(f"vocabulary: the {v['as_trained']}-token draft vocabulary, kept as the token map d2t "
                     f"(engines draft over it as the drafter was trained)")
    else:
        lines.append(f"vocabulary: trained over {v['as_trained']} tokens, exported over all {v['as_exported']} "
                     "(--full-vocab: engines draft over tokens the drafter never trained on)")
    if t["as_trained"] is not None:
        lines.append(f"tau (offline, {t['prompts']} prompts of {t['cache']}, the target's features at "
                     f"{res['measured_at']}; the drafter trained at {res['trained_at']}): as trained "
                     f"{t['as_trained']:.3f}, as exported {t['as_exported']:.3f}")
    elif has_vocab and not keep_map:
        lines.append("tau as exported: not measured; pass --cache CACHE (`dflashkit eval` reports both too)")
    else:
        lines.append("tau as exported = tau as trained (same vocabulary); `dflashkit eval` measures it")
    if t["as_trained"] is None:
        lines.append(f"target format: the drafter trained at {res['trained_at']}; for its tau on the target as served "
                     "pass --cache CACHE extracted at that format (dflashkit extract --weights gguf|q8_0|...)")
    return lines

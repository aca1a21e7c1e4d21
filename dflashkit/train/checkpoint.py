"""Training checkpoints: a drafter folder in the dflashkit format plus `train_state.pt`, written atomically; a rerun
whose settings change the resume contract is refused (layout and contract: docs/design.md, "Training checkpoints")."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch

from dflashkit.drafter.checkpoint import RUN_POINTER, run_latest, save_drafter
from dflashkit.errors import DFlashError
from dflashkit.fileio import atomic_dir, write_json

STATE_FILE = "train_state.pt"


def resume_contract(drafter, loss: str, draft_vocab_setting, gamma: float, target_identity: dict) -> dict:
    """What a resumed run must share with the one it continues (a change would silently train another model)."""
    c = drafter.config
    return {"target_layer_ids": list(c.target_layer_ids), "block_size": c.block_size, "mask_token_id": c.mask_token_id,
            "gamma": gamma, "loss": loss, "draft_vocab_setting": draft_vocab_setting, "num_layers": c.num_hidden_layers,
            "target": {k: v for k, v in target_identity.items() if k != "path"}}


def check_resume_contract(saved: dict, now: dict, where) -> None:
    for key in now:
        if saved.get(key) != now.get(key):
            raise DFlashError(
                f"{where}: the run was trained with {key}={saved.get(key)!r} but the settings now say {now.get(key)!r}; "
                f"set {key} back to resume, or start a new run (another `out`, or resume=false to start over)")


def step_dirs(run: Path) -> list[Path]:
    found = [(int(m.group(1)), p) for p in (run / "checkpoints").glob("step-*") if (m := re.fullmatch(r"step-(\d+)", p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run) -> Path | None:
    """The checkpoint a rerun continues from: latest.json's, else the highest complete step folder."""
    done = [p for p in [*step_dirs(Path(run)), run_latest(run)] if p is not None and (p / STATE_FILE).is_file()]
    return done[-1] if done else None


def save_checkpoint(run, drafter, resume: dict, contract_extra: dict, keep_last: int, finished: bool,
                    reason: str) -> Path:
    """Write checkpoints/step-N atomically (drafter folder + train_state.pt), point latest.json at it, prune."""
    run = Path(run)
    path = run / "checkpoints" / f"step-{resume['step']:08d}"
    with atomic_dir(path) as tmp:
        save_drafter(drafter, tmp, format="dflashkit", **contract_extra, trained_steps=resume["step"],
                     finished=finished, stop_reason=reason)
        torch.save(resume, tmp / STATE_FILE)
    write_json(run / RUN_POINTER, {"step": resume["step"], "checkpoint": str(path.relative_to(run)),
                                     "finished": finished, "reason": reason})
    for old in step_dirs(run)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def load_train_state(ckpt) -> dict:
    f = Path(ckpt) / STATE_FILE
    try:
        return torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated or foreign file
        raise DFlashError(f"{f}: cannot read the training state ({e}); delete this checkpoint folder to resume from an "
                          "earlier one, or set resume=false") from e


def save_best(run, drafter, metrics: dict, step: int, contract_extra: dict) -> Path:
    run = Path(run)
    save_drafter(drafter, run / "best", format="dflashkit", **contract_extra, trained_steps=step, eval=metrics)
    write_json(run / "best.json", {"step": step, "metrics": metrics})
    return run / "best"

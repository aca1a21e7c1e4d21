"""Drafter folders: z-lab's format (what vLLM and SGLang serve) and ours, which adds `dflashkit.json`, the contract it
was trained under, so a mismatched target or cache is refused instead of silently scoring near zero."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflashkit.drafter import transformers_format as tf
from dflashkit.drafter.config import ARCH_CLASS, SCALING_OFF, DrafterConfig
from dflashkit.drafter.model import DFlashDrafter, rotary_dim
from dflashkit.errors import DFlashError
from dflashkit.fileio import atomic_dir, read_json, sha256_file, write_json
from dflashkit.targets.model import check_same_target

CONTRACT_FILE = "dflashkit.json"
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
FORMATS = ("zlab", "dflashkit", "transformers")


def contract(drafter: DFlashDrafter, target_identity: dict | None = None, **extra) -> dict:
    c = drafter.config
    return {"format": "dflashkit-drafter/1", "target_layer_ids": list(c.target_layer_ids), "block_size": c.block_size,
            "mask_token_id": c.mask_token_id,
            "block_slot0": "seed",  # slot 0 = the last accepted token, slots 1..B-1 = mask (docs/design.md section 14)
            "hidden_size": c.hidden_size, "num_target_layers": c.num_target_layers, "target": target_identity, **extra}


def save_drafter(drafter: DFlashDrafter, path, format: str = "dflashkit", target_identity: dict | None = None,
                 dtype: torch.dtype | None = None, lm_head: torch.Tensor | None = None, **contract_extra) -> Path:
    """Write a drafter folder atomically: `zlab` is what serving engines read, `dflashkit` adds the contract.
    `lm_head` (zlab only): a draft vocabulary is kept as vLLM's token map (EAGLE-3's `d2t` offsets + head rows)."""
    if format not in FORMATS:
        raise DFlashError(f"unknown drafter format {format!r}; use one of {', '.join(FORMATS)}")
    path = Path(path)
    cfg = drafter.config.to_zlab()
    tensors = {k: v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in drafter.state_dict().items()}
    cfg["dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    vocab = (getattr(drafter, "contract", None) or {}).get("draft_vocab")
    if format == "zlab" and vocab and lm_head is not None:
        ids = torch.tensor(vocab, dtype=torch.long)
        tensors["d2t"] = ids - torch.arange(len(ids))
        tensors["lm_head.weight"] = lm_head.detach()[ids.to(lm_head.device)].to(dtype or lm_head.dtype).contiguous().cpu()
        cfg["draft_vocab_size"] = len(ids)
    if format == "transformers":
        if why := tf.refusal(drafter.config, bool(vocab) and lm_head is not None):
            raise DFlashError(f"transformers format: {why}")
        cfg, tensors = tf.to_transformers(drafter, tensors, cfg["dtype"])
    with atomic_dir(path) as tmp:
        write_json(tmp / "config.json", cfg)
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        if format == "dflashkit":
            write_json(tmp / CONTRACT_FILE, contract(drafter, target_identity, **contract_extra))
    return path


RUN_POINTER = "latest.json"  # in a training run folder: {"step", "checkpoint", "finished", "reason"}


def run_latest(run) -> Path | None:
    """The drafter folder a training run's latest.json points at; None when `run` is not a run folder."""
    f = Path(run) / RUN_POINTER
    return Path(run) / read_json(f)["checkpoint"] if f.is_file() else None


def drafter_identity(path) -> dict:
    """Which drafter a result is of: its folder and its weights' sha256 (None where it has no model.safetensors)."""
    weights = Path(path) / "model.safetensors"
    return {"path": str(Path(path).resolve()), "sha256": sha256_file(weights) if weights.is_file() else None}


def load_drafter(path, target=None, allow_missing: bool = False, allow_skipped: bool = False, device="cpu",
                 dtype: torch.dtype | None = torch.float32, same_target: bool = True) -> DFlashDrafter:
    """Load any format; `drafter.load_report` lists what was detected, loaded and skipped. A tensor with no place is
    refused unless allow_skipped; same_target=False accepts a contract of another target (a warm start)."""
    path = Path(path)
    cfg_file, weights = path / "config.json", path / "model.safetensors"
    raw, tensors = _read_folder(path, cfg_file, weights)
    from_tf = raw.get("model_type") == tf.MODEL_TYPE
    if from_tf:  # transformers' own DFlash drafter
        raw, tensors = tf.from_transformers(raw, tensors, str(cfg_file))
    cfg, report = _config_for_weights(raw, tensors, cfg_file, weights)
    if from_tf:
        report.insert(0, "Format: transformers' DFlash drafter (muse_glimmer_assistant), read as DFlash")
    con = read_json(path / CONTRACT_FILE) if (path / CONTRACT_FILE).is_file() else None
    vocab = token_map(raw, tensors, weights)
    if con:
        check_contract(con, cfg, path / CONTRACT_FILE)
    if target is not None:
        check_against_target(cfg, target, str(cfg_file))
        if con and con.get("target") and same_target:
            # the same weights in another format (a quantized target as served) keep the drafter's target
            check_same_target(con["target"], {**target.identity(), "weights": None}, f"drafter {path} (its {CONTRACT_FILE})",
                              "use it with the target it was trained for, or train a drafter for this target "
                              "(a warm start from it: same_target=False)")
        if not cfg.vocab_size:
            cfg.vocab_size = target.vocab_size
    drafter = DFlashDrafter(cfg)
    report.append(_load_tensors(drafter, tensors, weights, allow_missing, allow_skipped))
    if vocab is not None:
        report.append(f"Draft vocabulary: {len(vocab)} tokens (the export's token map d2t)")
        if not (con or {}).get("draft_vocab"):
            con = {**(con or {}), "draft_vocab": vocab}
    drafter.load_report, drafter.contract = report, con
    return drafter.to(device=device, dtype=dtype).eval()


def check_contract(con: dict, cfg: DrafterConfig, source: Path) -> None:
    """dflashkit.json against config.json; mask in slot 0 runs in every engine at a fraction of its tau: refused."""
    for key in ("target_layer_ids", "block_size", "mask_token_id"):
        if con.get(key) != getattr(cfg, key):
            raise DFlashError(f"{source}: {key}={con.get(key)} disagrees with config.json ({getattr(cfg, key)})")
    slot0 = con.get("block_slot0", "seed")  # folders from before the field: dflashkit always trained with the seed
    if slot0 != "seed":
        raise DFlashError(f"{source}: block_slot0 is {slot0!r}, but dflashkit and every engine put the last accepted "
                          "token in slot 0 (mask only in slots 1..B-1); retrain with block_slot0 'seed'")


def token_map(raw: dict, tensors: dict, weights: Path) -> list[int] | None:
    """The draft vocabulary of an export's `d2t` offsets, taken out of `tensors` with its rows of the target's head."""
    if "d2t" not in tensors:
        return None
    d2t = tensors.pop("d2t").long()
    tensors.pop("lm_head.weight", None)
    vocab = (d2t + torch.arange(len(d2t))).tolist()
    if raw.get("draft_vocab_size") not in (None, len(vocab)):
        raise DFlashError(f"{weights}: d2t maps {len(vocab)} tokens but config.json says draft_vocab_size "
                          f"{raw['draft_vocab_size']}; re-export the drafter")
    if min(vocab) < 0 or len(set(vocab)) != len(vocab):
        raise DFlashError(f"{weights}: d2t maps to negative or repeated token ids; re-export the drafter")
    return vocab


def _read_folder(path: Path, cfg_file: Path, weights: Path) -> tuple[dict, dict]:
    if not path.is_dir():
        raise DFlashError(f"{path}: not a drafter folder (expected config.json + model.safetensors)")
    for f in (cfg_file, weights):
        if not f.is_file():
            raise DFlashError(f"{f}: missing; a drafter folder holds config.json and model.safetensors")
    raw = read_json(cfg_file)
    try:
        tensors = load_file(weights)
    except Exception as e:  # safetensors raises several types for truncated or corrupt files
        raise DFlashError(f"{weights}: cannot read ({e}); the file is truncated or corrupt") from e
    for name in CODEBOOKS:  # dflash 0.1.0's module names (nn.Embedding); released checkpoints use the bare ones
        if name + ".weight" in tensors:
            tensors[name] = tensors.pop(name + ".weight")
    return raw, tensors


def _config_for_weights(raw: dict, tensors: dict, cfg_file: Path, weights: Path) -> tuple[DrafterConfig, list[str]]:
    """The config, checked against what the tensors imply (fc width, codebook rows)."""
    if "fc.weight" not in tensors:
        raise DFlashError(f"{weights}: no fc.weight tensor; this is not a DFlash drafter")
    hidden, fc_in = raw.get("hidden_size"), tensors["fc.weight"].shape[1]
    if not hidden or fc_in % hidden:
        raise DFlashError(f"{weights}: fc.weight input width {fc_in} is not a multiple of config hidden_size {hidden}")
    k = fc_in // hidden
    cfg, notes = DrafterConfig.from_zlab(raw, str(cfg_file), fc_features=k)
    report = [f"Detected fc input: {fc_in} = {k} target layers x {hidden}", *notes]
    if cfg.num_features != k:
        raise DFlashError(f"{cfg_file}: dflash_config.target_layer_ids has {cfg.num_features} layers "
                          f"{cfg.target_layer_ids} but fc.weight expects {k} ({fc_in} = {k} x {hidden}); fix "
                          f"target_layer_ids to list {k} layer ids")
    if cfg.arch == "dflash2" and not cfg.vocab_size and CODEBOOKS[0] in tensors:
        cfg.vocab_size = tensors[CODEBOOKS[0]].shape[0]
    report.append(f"Architecture: {ARCH_CLASS[cfg.arch]} ({describe(cfg)})")
    return cfg, report


def describe(cfg: DrafterConfig) -> str:
    """One line that says which model runs: layers, attention kinds, scaling fields, DFlash2 parts."""
    kinds = [cfg.attention_kind(i) for i in range(cfg.num_hidden_layers)]
    attn = ", ".join(f"{'causal' if c else 'non-causal'}{f' window {w}' if w else ''}" for c, w in kinds)
    out = (f"{cfg.num_hidden_layers} layers [{attn}], block {cfg.block_size} = the last accepted token + "
           f"{cfg.block_size - 1} mask slots (drafts: vLLM num_speculative_tokens {cfg.block_size - 1}), target layers "
           f"{cfg.target_layer_ids} (layer l = hidden_states[l + 1])")
    if cfg.partial_rotary_factor != 1.0:
        out += f", RoPE on {rotary_dim(cfg)} of {cfg.head_dim} head dims (partial_rotary_factor {cfg.partial_rotary_factor:g})"
    out += "".join(f", {key} {getattr(cfg, key)}" for key, off in SCALING_OFF.items()
                   if (getattr(cfg, key) or None) != off)  # a softcap of 0 is off too
    if cfg.arch == "dflash2":
        out += (f", convolutions kernel {cfg.conv_kernel_size} group {cfg.conv_group_size}, selector rank "
                f"{cfg.selector_rank}, top-{cfg.selector_top_k}")
    return out


def _load_tensors(drafter: DFlashDrafter, tensors: dict, weights: Path, allow_missing: bool, allow_skipped: bool) -> str:
    expected = drafter.state_dict()
    skipped = sorted(set(tensors) - set(expected))
    missing = sorted(set(expected) - set(tensors))
    if skipped and not allow_skipped:
        hint = (" (they are DFlash2 tensors: the config's architectures should be DFlash2DraftModel)"
                if any("_conv." in n or n.startswith("candidate_selector.") for n in skipped) else "")
        raise DFlashError(f"{weights}: {len(skipped)} tensor(s) the {ARCH_CLASS[drafter.config.arch]} described by "
                          f"config.json has no place for: {', '.join(skipped[:6])}{'...' if len(skipped) > 6 else ''}"
                          f"{hint}; fix config.json, or load with allow_skipped (CLI --allow-skipped) to run the "
                          "model without them")
    if missing and not allow_missing:
        raise DFlashError(f"{weights}: missing tensors {missing[:6]}{'...' if len(missing) > 6 else ''}; "
                          "the checkpoint is incomplete (allow_missing initialises them randomly)")
    for name in [n for n in expected if n in tensors]:
        t = tensors[name]
        if t.shape != expected[name].shape:
            raise DFlashError(f"{weights}: {name} has shape {list(t.shape)}, config.json implies {list(expected[name].shape)}")
        if not torch.isfinite(t.float()).all():
            raise DFlashError(f"{weights}: {name} contains NaN or Inf values; the checkpoint is corrupt (diverged training?)")
    drafter.load_state_dict({k: v for k, v in tensors.items() if k in expected}, strict=False)
    line = f"Loaded {len(expected) - len(missing)} tensors"
    if skipped:
        line += (f", SKIPPED {len(skipped)} (allow_skipped: the model run is the {ARCH_CLASS[drafter.config.arch]} "
                 f"of config.json without them): {', '.join(skipped)}")
    if missing:
        line += f", MISSING {len(missing)} (randomly initialised): {', '.join(missing)}"
    return line


def check_against_target(cfg: DrafterConfig, target, source: str = "drafter config") -> None:
    """A drafter borrows the target's embedding and lm_head: hidden size, vocab and layers must fit."""
    if cfg.hidden_size != target.hidden_size:
        raise DFlashError(f"{source}: hidden_size {cfg.hidden_size} != target {target.name} hidden size {target.hidden_size}; "
                          "this drafter was made for another target")
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        raise DFlashError(f"{source}: dflash_config.mask_token_id {cfg.mask_token_id} is outside target {target.name}'s "
                          f"vocabulary (0..{target.vocab_size - 1})")
    if cfg.num_target_layers != target.num_layers:
        raise DFlashError(f"{source}: num_target_layers {cfg.num_target_layers} != target {target.name}'s {target.num_layers} layers")
    if bad := [i for i in cfg.target_layer_ids if not 0 <= i < target.num_layers]:
        raise DFlashError(f"{source}: target_layer_ids {bad} out of range for {target.name} (0..{target.num_layers - 1})")


def check_feature_layers(cfg: DrafterConfig, available: list[int], source: str) -> list[int]:
    """Indices into `available` for the drafter's layers; refuses a cache/target that lacks some."""
    if missing := [i for i in cfg.target_layer_ids if i not in available]:
        raise DFlashError(f"drafter expects {cfg.num_features} target layers {cfg.target_layer_ids} (fc input "
                          f"{cfg.num_features * cfg.hidden_size} = {cfg.num_features} x {cfg.hidden_size}) but "
                          f"{source} offers {len(available)} layers {available}; missing {missing}: re-extract with "
                          f"--target-layers {','.join(map(str, cfg.target_layer_ids))}")
    return [available.index(i) for i in cfg.target_layer_ids]


def new_drafter(target, num_layers: int = 5, target_layer_ids=None, allow_final_layers: bool = False, **overrides) -> DFlashDrafter:
    """A randomly initialised drafter shaped for `target`; refuses the shortcut layers."""
    cfg = DrafterConfig.for_target(target, num_layers=num_layers, target_layer_ids=target_layer_ids, **overrides)
    target.check_layer_ids(cfg.target_layer_ids, allow_final=allow_final_layers)
    return DFlashDrafter(cfg)


@torch.no_grad()
def warm_start_from_target(drafter: DFlashDrafter, target) -> list[str]:
    """Copy the target's top decoder layers into the drafter's (same shapes), so it starts from weights that model
    the language; tensors the target lacks (a Llama's q_norm, DFlash2's convolutions) keep their initial values."""
    layers = target.layers
    n, L = len(drafter.layers), len(layers)
    if n > L:
        raise DFlashError(f"warm_start: the drafter has {n} layers, the target only {L}; use num_layers <= {L}")
    report = []
    for i, layer in enumerate(drafter.layers):
        src = dict(layers[L - n + i].named_parameters())
        own = dict(layer.named_parameters())
        copied = [name for name in own if name in src]
        for name in copied:
            if src[name].shape != own[name].shape:
                raise DFlashError(f"warm_start: {name} is {tuple(src[name].shape)} in target layer {L - n + i} "
                                  f"but {tuple(own[name].shape)} in drafter layer {i}; train without warm_start")
            own[name].copy_(src[name].to(own[name].dtype))
        report.append(f"drafter layer {i} <- target layer {L - n + i}: {len(copied)} tensors")
    return report

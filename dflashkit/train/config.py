"""Training settings: dataclass defaults <- a YAML file <- key=value pairs; an unknown key or a wrong type is an
error naming the key, so a typo never silently falls back to a default."""

from __future__ import annotations

import contextlib
import difflib
import math
import types
import typing
from dataclasses import asdict, dataclass, field, fields

import yaml

from dflashkit.configs import find_config
from dflashkit.errors import DFlashError


def _f(default, help: str):
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    # what to train on
    target: str = _f("smollm2-135m", "registry name or local Hugging Face folder of the target")
    data: str = _f("", "a cache folder from `dflashkit extract` (offline features) or a JSONL from "
                       "`dflashkit data generate` (the target runs in the loop)")
    num_sequences: int | None = _f(None, "use only the first N sequences of `data` (null: all)")
    max_seq_len: int = _f(2048, "truncate sequences (prompt + response) to this many tokens")
    # the drafter
    init: str | None = _f(None, "start from this drafter folder instead of random weights")
    warm_start: bool = _f(False, "copy the target's top num_layers decoder layers (attention, MLP, norms: same shapes) "
                                 "into the new drafter's layers before the first step")
    num_layers: int = _f(5, "drafter decoder layers")
    target_layer_ids: list[int] | None = _f(None, "target layers fed to the drafter (null: z-lab's rule for "
                                                  "num_target_layers)")
    num_target_layers: int | None = _f(None, "how many target layers z-lab's rule picks when target_layer_ids is null "
                                             "(null: one per drafter layer)")
    allow_final_layers: bool = _f(False, "allow the last two target layers as features (a shortcut that fails in use)")
    block_size: int = _f(16, "B: one anchor + B-1 drafted tokens")
    arch: str = _f("dflash", "dflash | dflash2 (grouped dynamic convolutions around each sublayer + a candidate "
                             "selector that reranks each position's top-k; z-lab ships it with block_size 8)")
    conv_kernel_size: int = _f(2, "dflash2: causal taps of each convolution")
    conv_group_size: int = _f(16, "dflash2: hidden channels sharing one dynamic tap")
    selector_rank: int = _f(256, "dflash2: rank of the selector's predecessor/successor codebooks")
    selector_top_k: int = _f(16, "dflash2: candidates the selector reranks per position")
    selector_loss_alpha: float = _f(1.0, "dflash2: weight of the selector's candidate cross-entropy")
    mask_token_id: int | None = _f(None, "mask id of the block inputs (null: the target's, see `dflashkit target info`)")
    draft_vocab: str | int = _f("auto", "auto: tokens seen in the training responses + specials; none: full "
                                        "vocabulary; N: the N most frequent response tokens + specials; "
                                        "FILE.json: a list of token ids (+ specials)")
    # the recipe (docs/design.md section 7)
    anchors_per_seq: int = _f(512, "anchors sampled per sequence among response positions, re-sampled every epoch")
    loss: str = _f("ce", "ce: hard cross-entropy on the next tokens; kl: KL(target || drafter) over the draft "
                         "vocabulary (needs the target's last layer: online data, or a cache that stores it)")
    gamma: float | None = _f(None, "slot k weighs exp(-(k-1)/gamma) (null: 7 for B=16, 5 for B=10, 4 for B=8, "
                                   "else min(7, B/2))")
    noise_std: float = _f(0.0, "Gaussian noise on the drafter's input features, relative to their RMS; labels "
                               "and target logits are never touched")
    head_chunk: int = _f(2048, "rows per lm_head chunk in the loss (fewer when rows x vocabulary > 32M): bounds memory")
    # optimiser
    lr: float = _f(6e-4, "AdamW peak learning rate")
    betas: list[float] = _f([0.9, 0.95], "AdamW betas")
    weight_decay: float = _f(0.01, "AdamW weight decay")
    warmup_ratio: float = _f(0.04, "linear warmup over this fraction of the steps, then cosine")
    min_lr_ratio: float = _f(0.0, "cosine floor as a fraction of lr")
    grad_clip: float = _f(1.0, "clip the global gradient norm (0: off)")
    batch_size: int = _f(4, "sequences per micro-batch per process")
    grad_accum: int = _f(1, "micro-batches per optimiser step; global batch = batch_size x grad_accum x processes")
    epochs: float = _f(6, "passes over the data (ignored when `steps` is set)")
    steps: int | None = _f(None, "optimiser steps (overrides epochs)")
    max_minutes: float | None = _f(None, "stop cleanly with a checkpoint once the run has trained this many minutes "
                                         "(counted across resumes: raise it to continue a run that reached it)")
    schedule_minutes: float | None = _f(None, "fit warmup + cosine into this many minutes: the schedule follows "
                                              "max(step/steps, elapsed/schedule_minutes), for time-boxed runs (the "
                                              "rate then depends on the clock, so a resume no longer repeats exactly)")
    # runtime
    device: str = _f("auto", "auto | cpu | cuda | cuda:N (under torchrun: cuda:LOCAL_RANK)")
    dtype: str = _f("auto", "auto: bfloat16 autocast on CUDA and on CPUs with bf16 matrix instructions (avx512_bf16/amx), "
                            "else float32; or float32 | bfloat16")
    distributed: str = _f("ddp", "under torchrun: ddp | fsdp (FSDP2 fully_shard)")
    attention: str = _f("auto", "block-sparse attention of the training blocks: auto (flex on CUDA, else chunked) | "
                                "flex (FlexAttention BlockMask, CUDA) | chunked (anchor-sorted chunks, any device) | "
                                "dense (the full mask: the reference, slow at 512 anchors)")
    seed: int = _f(0, "seeds the weights, the data order, the anchors and the noise")
    # outputs
    out: str = _f("runs/train", "run folder: checkpoints, metrics.csv, summary")
    resume: bool = _f(True, "continue from the latest checkpoint in `out` (its contract must match)")
    save_every: int = _f(200, "checkpoint every N steps (and at the end, on Ctrl-C/SIGTERM, on max_minutes)")
    keep_last: int = _f(3, "keep the last K step checkpoints (the best one is kept apart)")
    eval_cache: str | None = _f(None, "cache folder for periodic offline evaluation and best-checkpoint selection")
    eval_every: int = _f(0, "evaluate every N steps (0: only at the end)")
    eval_prompts: int | None = _f(None, "evaluate on the first N prompts of eval_cache (null: all)")
    eval_max_blocks: int | None = _f(None, "cap on evaluated blocks per evaluation (null: all)")
    eval_trees: list[str] = _f(["budget:4", "budget:8"], "DDTree families reported by the evaluator")
    eval_anchors: str = _f("stride", "stride | walk")
    progress: bool = _f(True, "progress bar")

    def check(self) -> "TrainConfig":
        """Value checks that types cannot express; returns self."""
        if isinstance(self.draft_vocab, str) and self.draft_vocab.isdigit():
            self.draft_vocab = int(self.draft_vocab)
        dv = self.draft_vocab
        enums = dict(loss=("ce", "kl"), distributed=("ddp", "fsdp"), attention=("auto", "flex", "chunked", "dense"),
                     arch=("dflash", "dflash2"), eval_anchors=("stride", "walk"))
        rules = [(key, getattr(self, key) in ok, f"is not one of: {', '.join(ok)}") for key, ok in enums.items()]
        rules += [
            ("dtype", self.dtype in ("auto", "float32", "fp32", "bfloat16", "bf16"),
             "is not one of: auto, float32, bfloat16"),
            ("draft_vocab", not isinstance(dv, str) or dv in ("auto", "none") or dv.endswith(".json"),
             "is not auto, none, a positive integer or a .json file of token ids"),
            ("draft_vocab", not isinstance(dv, int) or dv >= 1, "must be a positive integer"),
            ("block_size", self.block_size >= 2, "must be at least 2"),
            *((key, getattr(self, key) >= 1, "must be at least 1") for key in (
                "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "anchors_per_seq",
                "batch_size", "grad_accum", "head_chunk", "num_layers", "max_seq_len", "save_every", "keep_last")),
            ("num_target_layers", self.num_target_layers is None or self.num_target_layers >= 1,
             "must be at least 1 (or null: one per drafter layer)"),
            ("steps", self.steps is None or self.steps >= 1, "must be at least 1 (or null to use epochs)"),
            ("epochs", self.steps is not None or self.epochs > 0, "must be positive when steps is null"),
            ("warmup_ratio", 0 <= self.warmup_ratio < 1, "must be in [0, 1)"),
            ("gamma", self.gamma is None or self.gamma > 0, "must be positive"),
            ("schedule_minutes", self.schedule_minutes is None or self.schedule_minutes > 0,
             "must be positive (or null)"),
            ("noise_std", not self.noise_std < 0, "must be >= 0"),
            ("betas", len(self.betas) == 2, "must be two numbers, e.g. [0.9, 0.95]")]
        for key, ok, why in rules:
            if not ok:
                raise DFlashError(f"train config: {key}={getattr(self, key)!r} {why}")
        return self

    def to_dict(self) -> dict:
        return asdict(self)


def default_gamma(block_size: int) -> float:
    """The decay used with each block size in the paper's recipe (docs/design.md section 7)."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, min(7.0, block_size / 2))


def _type_ok(value, tp) -> bool:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if origin is list:
        (item,) = typing.get_args(tp)
        return isinstance(value, list) and all(_type_ok(v, item) for v in value)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def _coerce(key: str, value, tp, source: str):
    args = typing.get_args(tp) or (tp,)
    if float in args and isinstance(value, str):  # PyYAML reads 6e-4 (no dot) as a string
        with contextlib.suppress(ValueError):
            value = float(value)
    if not _type_ok(value, tp):
        name = getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
        raise DFlashError(f"{source}: {key}={value!r} has the wrong type (expected {name}); fix the value of {key}")
    if float in args and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typing.get_origin(tp) is list and args == (float,):
        return [float(v) for v in value]
    return value


def apply(cfg: TrainConfig, values: dict, source: str) -> TrainConfig:
    hints = typing.get_type_hints(TrainConfig)  # one per field
    for key, value in values.items():
        if key not in hints:
            close = difflib.get_close_matches(str(key), sorted(hints), n=2)
            hint = f" (did you mean {' or '.join(close)}?)" if close else ""
            raise DFlashError(f"{source}: unknown setting {key!r}{hint}; `dflashkit train --print-config` lists them all")
        setattr(cfg, key, _coerce(key, value, hints[key], source))
    return cfg


def parse_overrides(items: list[str]) -> dict:
    """["lr=1e-3", "target_layer_ids=[1,4]"] -> dict; values are read as YAML scalars/lists."""
    out = {}
    for item in items:
        if "=" not in item:
            raise DFlashError(f"override {item!r}: write overrides as key=value (e.g. lr=3e-4)")
        key, raw = item.split("=", 1)
        try:
            out[key.strip()] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as e:
            raise DFlashError(f"override {item!r}: the value is not valid YAML ({e})") from e
    return out


def load_config(path=None, overrides: list[str] | dict | None = None) -> TrainConfig:
    """Defaults <- YAML file <- key=value overrides; then value checks."""
    cfg = TrainConfig()
    if path is not None:
        p = find_config(path)
        try:
            values = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise DFlashError(f"{p}: invalid YAML ({e})") from e
        if not isinstance(values, dict):
            raise DFlashError(f"{p}: expected a mapping of settings (key: value), got {type(values).__name__}")
        apply(cfg, values, str(p))
    if overrides:
        apply(cfg, overrides if isinstance(overrides, dict) else parse_overrides(overrides), "command line")
    return cfg.check()


def format_config(cfg: TrainConfig) -> str:
    """YAML of every setting with its help as a comment (what --print-config shows)."""
    flow = lambda key: yaml.safe_dump({key: getattr(cfg, key)}, default_flow_style=True, width=1000).strip()[1:-1]
    return "".join(f"{flow(f.name):40s} # {f.metadata.get('help', '')}\n" for f in fields(TrainConfig))

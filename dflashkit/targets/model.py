"""The frozen target: loads offline, exposes what a drafter borrows (embedding, lm_head, layer features). Layer id
`l` is the OUTPUT of decoder layer `l` (HF `hidden_states[l + 1]`, docs/design.md section 2), captured by hooks on
the decoder layers themselves, so the final norm never leaks into a feature."""

from __future__ import annotations

import hashlib
import json
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence

from dflashkit.errors import DFlashError
from dflashkit.fileio import sha256_json
from dflashkit.targets.formats import HALVES, QUANTS, apply, base, gguf_source, is_file
from dflashkit.targets.invariant import step_linear_attention
from dflashkit.targets.registry import resolve, weights_hash
from dflashkit import levels


def pick_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DFlashError(f"--device {device}: CUDA is not available on this machine; use --device cpu or auto")
    return torch.device(device)


def cpu_has_bf16_matmul() -> bool:
    """Native bf16 dot products at the chosen ISA level (v4 only): without them bf16 is emulated, slower than float32."""
    return levels.native_bf16()


def pick_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """auto: bf16 on CUDA and on CPUs with native bf16 dot products, float32 on other CPUs."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" or cpu_has_bf16_matmul() else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise DFlashError(f"unknown dtype {dtype!r}; use one of {', '.join(table)}")
    return table[dtype]


def dtype_reason(dtype: torch.dtype, device: torch.device, asked: str | None = "auto") -> str:
    """One line for reports: the dtype a run used and why."""
    name = str(dtype).removeprefix("torch.")
    if asked not in (None, "auto"):
        return f"{name}, as asked (--dtype {asked})"
    if device.type == "cuda":
        return f"{name}: the default on CUDA"
    if dtype == torch.float32 and levels.narrower():
        return f"{name}: level {levels.chosen()} (--isa) has no native bf16 dot products"
    if dtype == torch.float32:
        return f"{name}: this CPU has no native bf16 dot products (avx512_bf16/AMX), where bf16 is emulated and slower"
    return f"{name}: this CPU has native bf16 dot products"


def default_layer_ids(num_layers: int, num_features: int) -> list[int]:
    """z-lab's rule: one feature -> the middle layer; else evenly from layer 1 to layer N-3."""
    if num_features == 1:
        return [num_layers // 2]
    return [int(round(1 + i * (num_layers - 4) / (num_features - 1))) for i in range(num_features)]


@dataclass
class TargetOutput:
    logits: torch.Tensor | None  # [b, T, V] (or the requested slice)
    features: torch.Tensor | None  # [b, T, K*H], layers concatenated in the order asked for
    past_key_values: object


class Target:
    def __init__(self, model, tokenizer, path: Path, name: str):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer, self.path, self.name = tokenizer, Path(path), name
        self.config = cfg = model.config.get_text_config(decoder=True)  # a VL wrapper's text part, or the config
        self.decoder, self.layers, self.final_norm = decoder_parts(model, self.path)
        self.num_layers, self.hidden_size = len(self.layers), cfg.hidden_size
        self.embed_tokens, self.lm_head = model.get_input_embeddings(), model.get_output_embeddings()
        self.vocab_size = self.embed_tokens.weight.shape[0]
        self.layer_types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * self.num_layers)
        self.is_hybrid = any(t == "linear_attention" for t in self.layer_types)
        self.mask_token_id, self.mask_token_source = choose_mask_token(tokenizer, self.vocab_size)
        self.stop_token_ids = _stop_tokens(model, tokenizer)
        self._capture: dict[int, torch.Tensor] | None = None
        self._weights_hash: str | None = None
        self.weights, self.blocks = "float", {}  # quantized matrices, by targets/formats.apply
        for i, layer in enumerate(self.layers):
            layer.register_forward_hook(self._hook(i))

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows for `ids`, unscaled as z-lab feeds a drafter (Gemma's module scales for its own layers)."""
        return torch.nn.functional.embedding(ids, self.embed_tokens.weight)

    @property
    def architecture(self) -> str:
        return (getattr(self.config, "architectures", None) or [type(self.model).__name__])[0]

    def identity(self) -> dict:
        """What a cache or checkpoint records so that another target (a fine-tune too) is never mixed in silently."""
        cfg = json.loads((self.path / "config.json").read_text())
        if self._weights_hash is None:
            self._weights_hash = weights_hash(self.path) or state_dict_hash(self.model)
        quant = base(self.weights) if base(self.weights) in (*QUANTS, *HALVES) else "float"  # gguf: the float copy's values
        quant = f"file {base(self.weights)}" if is_file(self.weights) else quant  # another file's: its own
        return {"name": self.name, "path": str(self.path.resolve()), "weights_hash": self._weights_hash, "weights": quant,
                "config_hash": sha256_json(cfg)[:16], "architecture": self.architecture, "num_layers": self.num_layers,
                "hidden_size": self.hidden_size, "vocab_size": self.vocab_size, "mask_token_id": self.mask_token_id}

    def default_layer_ids(self, num_features: int) -> list[int]:
        return default_layer_ids(self.num_layers, num_features)

    def check_layer_ids(self, layer_ids, allow_final: bool = False) -> list[int]:
        ids = [int(i) for i in layer_ids]
        if bad := [i for i in ids if not 0 <= i < self.num_layers]:
            raise DFlashError(f"target layer ids {bad} out of range for {self.name} (layers 0..{self.num_layers - 1})")
        late = [i for i in ids if i >= self.num_layers - 2]
        if late and not allow_final:
            early = [i for i in self.default_layer_ids(len(ids)) if i < self.num_layers - 2]
            hint = f"use e.g. {early}" if early else f"a {self.num_layers}-layer target has no earlier layer to use"
            raise DFlashError(f"target layer ids {late} include the last two decoder layers of {self.name} "
                              f"({self.num_layers} layers): they encode the next-token choice and give the drafter a "
                              f"shortcut that fails in use; {hint}, or pass --allow-final-layers "
                              "(allow_final_layers=True) to override")
        return ids

    @property
    def has_thinking_mode(self) -> bool:
        return "enable_thinking" in (self.tokenizer.chat_template or "")

    def chat_ids(self, messages, enable_thinking: bool = False) -> list[int]:
        """Prompt ids with the target's chat template; thinking mode is always explicit."""
        if not self.tokenizer.chat_template:
            return self.tokenizer("\n".join(m["content"] for m in messages))["input_ids"]
        return list(self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True,
                                                       return_dict=True, enable_thinking=enable_thinking)["input_ids"])

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _hook(self, i: int):
        def hook(module, args, output):
            if self._capture is not None and i in self._capture:
                out = output[0] if isinstance(output, tuple) else output
                if isinstance(self._capture[i], list):  # inside recording(): every forward's output, in order
                    self._capture[i].append(out)
                else:
                    self._capture[i] = out
        return hook

    @contextmanager
    def recording(self, layer_ids):
        """Inside, every forward (generate's included) appends the layers' outputs [b, t, H] to the yielded lists."""
        self._capture = {int(i): [] for i in layer_ids}
        try:
            yield self._capture
        finally:
            self._capture = None

    @torch.no_grad()
    def forward(self, input_ids, layer_ids=None, past_key_values=None, position_ids=None, attention_mask=None,
                use_cache: bool = True, logits_to_keep: int = 0, compute_logits: bool = True) -> TargetOutput:
        """One target forward; `layer_ids` selects the features to capture (None: none)."""
        self._capture = {int(i): None for i in layer_ids} if layer_ids is not None else None
        try:
            kw = dict(input_ids=input_ids, past_key_values=past_key_values, position_ids=position_ids,
                      attention_mask=attention_mask, use_cache=use_cache)
            out = self.model(**kw, logits_to_keep=logits_to_keep) if compute_logits else self.decoder(**kw)
            feats = None if layer_ids is None else torch.cat([self._capture[int(i)] for i in layer_ids], dim=-1)
        finally:
            self._capture = None
        return TargetOutput(out.logits if compute_logits else None, feats, out.past_key_values)

    def features(self, seqs, layer_ids, padding: str = "right") -> torch.Tensor:
        """Features [b, T, K*H] of several sequences in one forward; row r's first len(seqs[r]) positions are its own.
        padding "left" (as generation batches) masks it and counts positions from each row's first real token."""
        if padding not in ("right", "left"):
            raise DFlashError(f"padding={padding!r}: use right or left")
        rows = [torch.as_tensor(s, dtype=torch.long) for s in seqs]
        ids = pad_sequence(rows, batch_first=True, padding_side=padding)
        mask = pad_sequence([torch.ones_like(r) for r in rows], batch_first=True, padding_side=padding)
        T = ids.shape[1]
        same = all(len(s) == T for s in seqs)
        pos = None if padding == "right" or same else (mask.cumsum(1) - 1).clamp(min=0).to(self.device)
        feats = self.forward(ids.to(self.device), layer_ids=layer_ids, use_cache=False, compute_logits=False,
                             attention_mask=None if same else mask.to(self.device), position_ids=pos).features
        if padding == "left" and not same:  # each row's own positions first, as with right padding
            feats = torch.stack([feats[r].roll(len(s) - T, dims=0) for r, s in enumerate(seqs)])
        return feats


IDENTITY_KEYS = ("weights_hash", "weights", "config_hash", "architecture", "num_layers", "hidden_size", "vocab_size")


def state_dict_hash(model) -> str:
    """Content hash of in-memory weights, for a target whose folder holds no weight files."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def describe_identity(ident: dict | None) -> str:
    ident = ident or {}
    where = f", {ident['path']}" if ident.get("path") else ""
    fmt = f" in {ident['weights']}" if ident.get("weights") not in (None, "float") else ""
    return (f"{ident.get('name')}{fmt} (weights {ident.get('weights_hash') or 'not recorded'}, "
            f"config {ident.get('config_hash')}{where})")


def identity_mismatch(recorded: dict | None, current: dict) -> list[str]:
    """The identity fields on which two targets differ; one either side lacks is skipped."""
    recorded = recorded or {}
    return [k for k in IDENTITY_KEYS
            if recorded.get(k) is not None and current.get(k) is not None and recorded[k] != current[k]]


def check_same_target(recorded: dict | None, current: dict, what: str, fix: str) -> None:
    """Refuse when `what` (a cache, a drafter, data) was made with another target than the one in use."""
    if diff := identity_mismatch(recorded, current):
        raise DFlashError(f"{what} was made with target {describe_identity(recorded)}, not with the target in use "
                          f"{describe_identity(current)} (they differ in {', '.join(diff)}); {fix}")


def decoder_parts(model, path):
    """(decoder, its layers, its final norm) by get_decoder(), whatever the attribute names (a VL wrapper's too)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers, norm = getattr(decoder, "layers", None), getattr(decoder, "norm", None)
    if decoder is None or not isinstance(layers, torch.nn.ModuleList) or norm is None:
        raise DFlashError(f"{path}: architecture {type(model).__name__} has no decoder with `layers` and a final `norm` "
                          "(get_decoder()), so its layer hidden states cannot be captured; use a decoder-only causal "
                          "LM or a vision-language model whose language model has them (Llama, Qwen3, Qwen3.5, their "
                          "MoE and VL variants, DeepSeek-V3, GLM-4 MoE, ...)")
    return decoder, layers, norm


def check_loading_info(path, info: dict) -> None:
    """Refuse missing, unexpected or reshaped weights: transformers only warns, and random layers give garbage."""
    problems = []
    for key, what in (("missing_keys", "missing from the checkpoint (they would be random)"),
                      ("unexpected_keys", "in the checkpoint but not in the model (they would be dropped)"),
                      ("mismatched_keys", "of another shape in the checkpoint than in the model")):
        if names := sorted(k if isinstance(k, str) else str(k[0]) for k in info.get(key) or ()):
            shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            problems.append(f"{len(names)} weight(s) {what}: {shown}")
    if problems:
        raise DFlashError(f"{path}: the weights do not match the model's layout: {'; '.join(problems)}; fix the "
                          "checkpoint's weight names (model*.safetensors) or re-download it")


def _stop_tokens(model, tokenizer) -> list[int]:
    eos = [getattr(src, "eos_token_id", None) for src in (getattr(model, "generation_config", None), tokenizer)]
    return sorted({int(i) for e in eos if e is not None for i in (e if isinstance(e, (list, tuple)) else [e])})


def choose_mask_token(tokenizer, vocab_size: int) -> tuple[int, str]:
    """A mask id inside the embedding, trained or not (docs/design.md section 2): the tokenizer's mask token, the first
    row past the tokenizer (Qwen3 drafters: 151669), a mask/reserved/unused special token, or the last unused one."""
    mid = getattr(tokenizer, "mask_token_id", None)
    if mid is not None and 0 <= mid < vocab_size:
        return int(mid), f"tokenizer mask token {tokenizer.mask_token!r}"
    n = len(tokenizer)
    if n < vocab_size:
        return n, f"first embedding row past the tokenizer's {n} tokens"
    added = sorted(getattr(tokenizer, "added_tokens_decoder", {}).items())
    for tid, tok in added:
        if re.search(r"mask|reserved|unused", tok.content, re.I) and tid < vocab_size:
            return int(tid), f"reserved special token {tok.content!r}"
    template = tokenizer.chat_template or ""
    used = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    for tid, tok in reversed(added):
        if tok.special and tid not in used and tok.content not in template and tid < vocab_size:
            return int(tid), f"unused special token {tok.content!r}"
    raise DFlashError("the target has no mask token, no spare embedding row and no unused special token; pass a mask id explicitly")


def load_target(name_or_path: str | os.PathLike = "smollm2-135m", device: str = "auto", dtype=None,
                weights: str = "float") -> Target:
    """Load a registry target or a local Hugging Face folder, offline, frozen, in `weights` (targets/formats.py)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name, path = resolve(name_or_path)
    dev = pick_device(device)
    # blocks widen to float32 (for a GGUF target's own, faster than bf16 copies): a quantized format's dtype, and
    # auto's for a GGUF target on a CPU, unless one is given
    blocks = weights not in ("auto", "float") or weights == "auto" and dev.type == "cpu" and gguf_source(path) is not None
    dt = torch.float32 if blocks and dtype in (None, "auto") else pick_dtype(dtype, dev)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        # a VL checkpoint (Qwen3.5) loads as its text model: transformers leaves the vision tower out
        model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dt, output_loading_info=True)
    except (OSError, ValueError, KeyError) as e:
        raise DFlashError(f"{path}: cannot load as a causal LM ({str(e).splitlines()[0]})") from e
    check_loading_info(path, info)
    target = Target(model.to(dev), tokenizer, path, name)
    step_linear_attention(target.model)
    apply(target, weights)
    return target

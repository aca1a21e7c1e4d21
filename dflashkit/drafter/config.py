"""The drafter's configuration, round-tripping z-lab's `config.json` (docs/design.md section 3): every field is
honoured as `dflash==0.1.0` computes it or refused by name, never silently run as another model."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from dflashkit.errors import DFlashError

ARCHITECTURES = {"DFlashDraftModel": "dflash", "DFlash2DraftModel": "dflash2"}
ARCH_CLASS = {v: k for k, v in ARCHITECTURES.items()}
SCALING_OFF = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}  # plain DFlash
# dflash_config keys the reference reads (any may also sit at the top level)
DFLASH_KEYS = {"mask_token_id", "target_layer_ids", "block_size", *SCALING_OFF}
# speculators' flag for bidirectional sliding layers: dflash 0.1.0 never reads it and runs them causal
NON_CAUSAL_KEY = "sliding_window_non_causal"
# what transformers' Qwen3Config (hence the reference) takes when a file has neither rope_theta nor rope_parameters
DEFAULT_ROPE_THETA = 10000.0
DFLASH2_KEYS = {"conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"}
DFLASH2_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}


@dataclass
class DrafterConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_hidden_layers: int
    target_layer_ids: list[int]
    num_target_layers: int
    mask_token_id: int
    vocab_size: int  # the target's embedding rows; the drafter has no embedding of its own
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    partial_rotary_factor: float = 1.0  # RoPE rotates the first int(head_dim * factor) dims of each head
    max_position_embeddings: int = 32768
    layer_types: list[str] = field(default_factory=list)  # "full_attention" | "sliding_attention" per layer
    sliding_window: int | None = None
    # z-lab dflash 0.1.0 fields: block embeddings x scale; logits x multiplier, then c * tanh(logits / c)
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    # the reference makes sliding layers causal and full ones not, unless is_causal (all layers) says otherwise;
    # sliding_window_non_causal exists in memory only: the reference ignores it (refused on load and on export)
    is_causal: bool | None = None
    sliding_window_non_causal: bool | None = None
    arch: str = "dflash"  # "dflash" | "dflash2" (grouped dynamic convolutions + candidate selector)
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16

    def __post_init__(self):
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise DFlashError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        if self.block_size < 2:
            raise DFlashError(f"block_size must be at least 2 (one anchor + drafts), got {self.block_size}")
        if self.arch not in ARCH_CLASS:
            raise DFlashError(f"arch {self.arch!r} is not one of: {', '.join(ARCH_CLASS)}")
        rot = self.head_dim * self.partial_rotary_factor
        if not 0 < self.partial_rotary_factor <= 1 or rot != int(rot) or int(rot) % 2:
            raise DFlashError(f"partial_rotary_factor {self.partial_rotary_factor}: must be in (0, 1] and rotate an even "
                              f"whole number of the {self.head_dim} head dims")
        if self.arch == "dflash2" and self.hidden_size % self.conv_group_size:
            raise DFlashError(f"conv_group_size {self.conv_group_size} does not divide hidden_size {self.hidden_size}")

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    def attention_kind(self, layer: int) -> tuple[bool, int | None]:
        """(causal, window) of a layer, as dflash 0.1.0 computes it (plus the in-memory non-causal flag)."""
        sliding = self.layer_types[layer] == "sliding_attention"
        causal = sliding
        if self.is_causal is not None:
            causal = bool(self.is_causal)
        elif sliding and self.sliding_window_non_causal is not None:
            causal = not self.sliding_window_non_causal
        return causal, (self.sliding_window if sliding else None)  # no window: transformers dropped it

    def to_zlab(self) -> dict:
        """The config.json that vLLM, SGLang and z-lab's loader read."""
        dflash = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids),
                  "block_size": self.block_size}
        dflash.update({k: getattr(self, k) for k, off in SCALING_OFF.items() if getattr(self, k) != off})
        if self.sliding_window_non_causal and self.is_causal is None and "sliding_attention" in self.layer_types:
            raise DFlashError(f"{NON_CAUSAL_KEY} is true: this drafter's sliding layers are bidirectional, but z-lab's "
                              "dflash 0.1.0 (and the engines that read its config.json) never read the field and run "
                              "them causal, so no drafter folder can carry it; train and save with it unset")
        if self.arch == "dflash2":
            dflash.update({key: getattr(self, key) for key in sorted(DFLASH2_KEYS)})
        out = {
            "architectures": [ARCH_CLASS[self.arch]], "auto_map": {"AutoModel": f"dflash.{ARCH_CLASS[self.arch]}"},
            "model_type": "qwen3", "hidden_size": self.hidden_size, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings, "layer_types": self.layer_types,
            "sliding_window": self.sliding_window,
            "use_sliding_window": "sliding_attention" in self.layer_types and self.sliding_window is not None,
            "tie_word_embeddings": False, "vocab_size": self.vocab_size, "num_target_layers": self.num_target_layers,
            "block_size": self.block_size, "dflash_config": dflash, "dtype": "bfloat16",
        }
        if self.is_causal is not None:  # the reference reads it from the top level only
            out["is_causal"] = self.is_causal
        if self.partial_rotary_factor != 1.0:  # top level: llama.cpp's converter; rope_parameters: vLLM's get_rope
            out["partial_rotary_factor"] = self.partial_rotary_factor
            out["rope_parameters"] = {"rope_theta": self.rope_theta, **(self.rope_scaling or {"rope_type": "default"}),
                                      "partial_rotary_factor": self.partial_rotary_factor}
        return out

    @classmethod
    def from_zlab(cls, cfg: dict, source: str = "config.json", fc_features: int | None = None) -> tuple["DrafterConfig", list[str]]:
        """Parse a z-lab config; returns (config, notes). Missing layer ids fall back to fc's width + z-lab's rule."""
        notes = []
        missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size") if k not in cfg]
        if missing:
            raise DFlashError(f"{source}: missing field(s) {', '.join(missing)}; a DFlash config.json is a Qwen3 config plus dflash_config")
        _refuse_unsupported(cfg, source)
        arch = _architecture(cfg, source, notes)
        dfc = _dflash_fields(cfg, arch, source)
        if "block_size" not in dfc:  # _dflash_fields keeps only the keys that are set
            notes.append("block_size not in config (top level or dflash_config): assuming 16")
        ids, n_target = _layer_ids(cfg, dfc, source, fc_features, notes)
        if dfc.get("mask_token_id") is None:
            raise DFlashError(f"{source}: dflash_config.mask_token_id is missing; add the mask id the drafter was trained with")
        layer_types, window = _layer_types(cfg, notes)
        heads = cfg["num_attention_heads"]
        theta, scaling = _rope(cfg, notes)
        conf = cls(
            hidden_size=cfg["hidden_size"], num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_hidden_layers"],
            target_layer_ids=[int(i) for i in ids], block_size=int(dfc.get("block_size", 16)),
            num_target_layers=int(n_target) if n_target is not None else max(ids) + 3,
            mask_token_id=int(dfc["mask_token_id"]), vocab_size=cfg.get("vocab_size", 0),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling, layer_types=layer_types,
            partial_rotary_factor=_partial_rotary(cfg, source), max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            sliding_window=window if "sliding_attention" in layer_types else None, arch=arch,
            **{k: v for k, v in dfc.items() if k not in ("block_size", "mask_token_id", "target_layer_ids")},
        )
        if n_target is None:
            notes.append(f"num_target_layers missing: assuming {conf.num_target_layers}")
        return conf, notes

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def for_target(cls, target, num_layers: int = 5, target_layer_ids=None, block_size: int = 16, **overrides) -> "DrafterConfig":
        """A drafter shaped like the target (hidden size, heads, rope), z-lab's default layer ids."""
        tc = target.config
        plain = tc.to_dict()  # Gemma 4 refuses per-layer fields (head_dim) as attributes; Qwen3.5-MoE has no dense MLP
        ids = target_layer_ids if target_layer_ids is not None else target.default_layer_ids(num_layers)
        heads = tc.num_attention_heads
        theta = (getattr(tc, "rope_parameters", None) or {}).get("rope_theta", getattr(tc, "rope_theta", DEFAULT_ROPE_THETA))
        return cls(**dict(
            hidden_size=target.hidden_size, num_attention_heads=heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", heads),
            head_dim=plain.get("head_dim") or target.hidden_size // heads,
            intermediate_size=plain.get("intermediate_size") or plain.get("shared_expert_intermediate_size")
            or 4 * target.hidden_size,
            num_hidden_layers=num_layers, target_layer_ids=list(ids), num_target_layers=target.num_layers,
            mask_token_id=target.mask_token_id, vocab_size=target.vocab_size, block_size=block_size,
            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6), rope_theta=float(theta),
            max_position_embeddings=getattr(tc, "max_position_embeddings", 32768),
        ) | overrides)


def _refuse_unsupported(cfg: dict, source: str) -> None:
    """Qwen3 fields the drafter's layers do not implement: refused, never dropped."""
    if cfg.get("attention_bias"):
        raise DFlashError(f"{source}: attention_bias is true, but the drafter's q/k/v/o projections have no bias "
                          "(z-lab's released drafters: attention_bias false); loading it would drop the biases, so "
                          "it is refused: convert the checkpoint without biases, or set attention_bias false if "
                          "its bias tensors are all zero")
    if cfg.get("hidden_act", "silu") != "silu":
        raise DFlashError(f"{source}: hidden_act {cfg['hidden_act']!r} is not supported (the drafter's MLP is SwiGLU "
                          "with silu, as in z-lab's Qwen3 drafters); convert the checkpoint or set hidden_act silu")


def _architecture(cfg: dict, source: str, notes: list[str]) -> str:
    archs = cfg.get("architectures") or []
    if not archs:
        notes.append("architectures missing: reading it as DFlashDraftModel")
        return "dflash"
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise DFlashError(f"{source}: architectures {archs} is not one of {list(ARCHITECTURES)}: this drafter is a "
                          "model dflashkit cannot run, and running it as DFlash would give another model's outputs")
    return ARCHITECTURES[archs[0]]


def _dflash_fields(cfg: dict, arch: str, source: str) -> dict:
    """dflash_config merged over the top level (the reference reads dflash_config first); unknown keys refused."""
    dfc = cfg.get("dflash_config") or {}
    _refuse_non_causal(cfg, dfc, source)
    if "is_causal" in dfc:
        raise DFlashError(f"{source}: dflash_config.is_causal is not read by z-lab's dflash 0.1.0 (it reads the "
                          "top-level is_causal, for every layer); move it to the top level or remove it")
    known = DFLASH_KEYS | (DFLASH2_KEYS if arch == "dflash2" else set())
    if unknown := sorted(set(dfc) - known - {NON_CAUSAL_KEY}):  # false (or moot): accepted, nothing to honour
        hint = (" (DFlash2 fields: set architectures to DFlash2DraftModel)" if set(unknown) & DFLASH2_KEYS else "")
        raise DFlashError(f"{source}: dflash_config has unknown key(s) {unknown}{hint}; dflashkit knows "
                          f"{sorted(known)}. A field it cannot honour is refused rather than ignored")
    # block_size counts the anchor (z-lab, SGLang, llama.cpp's dflash.block_size; vLLM drafts block_size - 1): a
    # top-level value that disagrees with dflash_config's leaves engines drafting different numbers of tokens
    top, inner = cfg.get("block_size"), dfc.get("block_size")
    if top is not None and inner is not None and int(top) != int(inner):
        raise DFlashError(f"{source}: block_size {top} (top level) disagrees with dflash_config.block_size {inner}; "
                          "set both to the trained block, anchor included (vLLM then drafts block_size - 1)")
    out = {k: v for k in known if (v := dfc.get(k, cfg.get(k))) is not None}
    out.update({key: float(out[key]) for key in SCALING_OFF if key in out})
    if out.get("final_logit_softcapping", 1.0) <= 0:
        out["final_logit_softcapping"] = None  # the reference applies it only when > 0
    if cfg.get("is_causal") is not None:
        out["is_causal"] = bool(cfg["is_causal"])
    if arch == "dflash2":
        if absent := sorted(DFLASH2_KEYS - set(out)):
            raise DFlashError(f"{source}: DFlash2 config lacks {absent} in dflash_config; z-lab's reference needs them "
                              f"(speculators' defaults: {DFLASH2_DEFAULTS})")
        out.update({k: int(out[k]) for k in DFLASH2_KEYS})
    # vLLM's eagle-style layer field stores ids + 1; one that disagrees with target_layer_ids is ambiguous
    aux, ids = cfg.get("eagle_aux_hidden_state_layer_ids"), out.get("target_layer_ids")
    if aux is not None and ids is not None and [int(i) + 1 for i in ids] != [int(i) for i in aux]:
        raise DFlashError(f"{source}: eagle_aux_hidden_state_layer_ids {aux} disagrees with dflash_config."
                          f"target_layer_ids {ids} (which would read {[int(i) + 1 for i in ids]}); remove one of them")
    return out


def _refuse_non_causal(cfg: dict, dfc: dict, source: str) -> None:
    """speculators' bidirectional sliding layers: the reference runs them causal, so honouring it runs another model
    (moot under a top-level is_causal, which decides every layer in both)."""
    if cfg.get("is_causal") is not None:
        return
    for where, fields in (("dflash_config.", dfc), ("", cfg)):
        if fields.get(NON_CAUSAL_KEY):
            raise DFlashError(f"{source}: {where}{NON_CAUSAL_KEY} is true, but z-lab's dflash 0.1.0 never reads it and "
                              "runs sliding_attention layers causal; dflashkit refuses rather than run a model the "
                              f"reference does not. Remove {NON_CAUSAL_KEY} (or set it false) if the drafter was trained "
                              "with causal sliding layers; otherwise the folder is not a z-lab DFlash drafter")


def _layer_ids(cfg: dict, dfc: dict, source: str, fc_features: int | None, notes: list[str]):
    ids, n_target = dfc.get("target_layer_ids"), cfg.get("num_target_layers")
    if ids is None:
        if n_target is None or fc_features is None:
            raise DFlashError(f"{source}: dflash_config.target_layer_ids is missing and cannot be derived (needs num_target_layers)")
        from dflashkit.targets.model import default_layer_ids

        ids = default_layer_ids(n_target, fc_features)
        notes.append(f"dflash_config.target_layer_ids missing: derived {ids} from num_target_layers={n_target} and fc width")
    return ids, n_target


def _layer_types(cfg: dict, notes: list[str]) -> tuple[list[str], int | None]:
    """layer_types and the window as transformers' Qwen3Config leaves them, which is what the reference runs:
    the window exists only with use_sliding_window true; a sliding_attention layer without one is still causal."""
    n = cfg["num_hidden_layers"]
    layer_types = list(cfg.get("layer_types") or [])[:n]
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    if layer_types and "sliding_attention" in layer_types and window is None and cfg.get("sliding_window"):
        notes.append("use_sliding_window is not true: transformers drops sliding_window, so the reference runs the "
                     "sliding_attention layers causal with no window; read the same way here")
    if not layer_types:  # transformers' Qwen3 rule: sliding on layers >= max_window_layers when use_sliding_window
        first = cfg.get("max_window_layers", n)
        layer_types = ["sliding_attention" if window is not None and i >= first else "full_attention" for i in range(n)]
        if "sliding_attention" in layer_types:
            notes.append(f"layer_types missing: derived sliding attention (window {window}) on layers "
                         f"{first}..{n - 1} from use_sliding_window and max_window_layers")
    return layer_types, window


def _rope(cfg: dict, notes: list[str]) -> tuple[float, dict | None]:
    rope = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", rope.get("rope_theta"))
    if theta is None:
        theta = DEFAULT_ROPE_THETA
        notes.append(f"rope_theta missing (top level and rope_parameters): assuming {DEFAULT_ROPE_THETA:g}, "
                     "transformers' Qwen3Config default, which the reference runs")
    scaling = cfg.get("rope_scaling")
    if scaling is None and rope.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
    return float(theta), scaling


def _partial_rotary(cfg: dict, source: str) -> float:
    """partial_rotary_factor from the top level or rope_parameters (llama.cpp's converter and vLLM read either);
    two that disagree are refused: engines would rotate other dims than training did (speculators #613)."""
    top, rope = cfg.get("partial_rotary_factor"), (cfg.get("rope_parameters") or {}).get("partial_rotary_factor")
    if top is not None and rope is not None and float(top) != float(rope):
        raise DFlashError(f"{source}: partial_rotary_factor {top} disagrees with rope_parameters.partial_rotary_factor "
                          f"{rope}; set both to the factor the drafter was trained with")
    return float(top if top is not None else rope if rope is not None else 1.0)


# how each engine is told the block (docs/design.md section 14): z-lab, SGLang and llama.cpp's GGUF key count the
# anchor, vLLM's num_speculative_tokens and llama-server's --spec-draft-n-max count the drafts only
ENGINE_BLOCK = {"zlab": ("dflash_config.block_size", 0), "sglang": ("speculative_num_draft_tokens", 0),
                "llama.cpp": ("--spec-draft-n-max", -1), "vllm": ("num_speculative_tokens", -1)}


def engine_block(engine: str, block_size: int) -> tuple[str, int]:
    """(setting, value) that makes `engine` draft block_size - 1 tokens a round with a block-`block_size` drafter."""
    name, offset = ENGINE_BLOCK[engine]
    return name, block_size + offset


def check_engine_block(engine: str, value: int, block_size: int, source: str) -> None:
    """Refuses an engine setting that would draft another number of tokens than the drafter was trained for."""
    name, want = engine_block(engine, block_size)
    if int(value) != want:
        counts = "the anchor included" if ENGINE_BLOCK[engine][1] == 0 else "the drafts only, not the anchor"
        raise DFlashError(f"{source}: {engine} {name} is {value} for a drafter of block_size {block_size}; {name} counts "
                          f"{counts}: set it to {want}")

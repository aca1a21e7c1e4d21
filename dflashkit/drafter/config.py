"""The drafter's configuration as plain data that round-trips to z-lab's `config.json` (SPEC.md section 3)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from dflashkit.errors import DFlashError


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
    max_position_embeddings: int = 32768
    layer_types: list[str] = field(default_factory=list)  # "full_attention" | "sliding_attention" per layer
    sliding_window: int | None = None

    def __post_init__(self):
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise DFlashError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise DFlashError("layer_types has sliding_attention layers but sliding_window is not set")
        if self.block_size < 2:
            raise DFlashError(f"block_size must be at least 2 (one anchor + drafts), got {self.block_size}")

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    def to_zlab(self) -> dict:
        """The config.json that vLLM, SGLang and z-lab's loader read."""
        return {
            "architectures": ["DFlashDraftModel"],
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "layer_types": self.layer_types,
            "sliding_window": self.sliding_window,
            "use_sliding_window": "sliding_attention" in self.layer_types,
            "tie_word_embeddings": False,
            "vocab_size": self.vocab_size,
            "num_target_layers": self.num_target_layers,
            "block_size": self.block_size,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
                "block_size": self.block_size,
            },
            "dtype": "bfloat16",
        }

    @classmethod
    def from_zlab(cls, cfg: dict, source: str = "config.json", fc_features: int | None = None) -> tuple["DrafterConfig", list[str]]:
        """Parse a z-lab config; returns (config, notes). Missing layer ids fall back to fc's width + z-lab's rule."""
        notes = []
        dfc = cfg.get("dflash_config") or {}
        need = ["hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size"]
        missing = [k for k in need if k not in cfg]
        if missing:
            raise DFlashError(f"{source}: missing field(s) {', '.join(missing)}; a DFlash config.json is a Qwen3 config plus dflash_config")
        block = dfc.get("block_size", cfg.get("block_size"))
        if block is None:
            block = 16
            notes.append("block_size not in config (top level or dflash_config): assuming 16")
        rope = cfg.get("rope_parameters") or {}
        theta = cfg.get("rope_theta", rope.get("rope_theta", 1_000_000.0))
        scaling = cfg.get("rope_scaling")
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        ids = dfc.get("target_layer_ids", cfg.get("target_layer_ids"))
        n_target = cfg.get("num_target_layers")
        if ids is None:
            if n_target is None or fc_features is None:
                raise DFlashError(f"{source}: dflash_config.target_layer_ids is missing and cannot be derived (needs num_target_layers)")
            from dflashkit.target.model import default_layer_ids

            ids = default_layer_ids(n_target, fc_features)
            notes.append(f"dflash_config.target_layer_ids missing: derived {ids} from num_target_layers={n_target} and fc width")
        mask = dfc.get("mask_token_id", cfg.get("mask_token_id"))
        if mask is None:
            raise DFlashError(f"{source}: dflash_config.mask_token_id is missing; add the mask id the drafter was trained with")
        if cfg.get("attention_bias"):
            raise DFlashError(f"{source}: attention_bias is true, but the drafter's q/k/v/o projections have no bias "
                              "(z-lab's released drafters: attention_bias false); loading it would drop the biases, so "
                              "it is refused: convert the checkpoint without biases, or set attention_bias false if "
                              "its bias tensors are all zero")
        heads = cfg["num_attention_heads"]
        layer_types = list(cfg.get("layer_types") or [])[: cfg["num_hidden_layers"]]
        window = cfg.get("sliding_window")
        if cfg.get("use_sliding_window") is False and "sliding_attention" in layer_types:
            # transformers' Qwen3Config drops the window when use_sliding_window is false: every layer sees all
            notes.append("use_sliding_window is false: layer_types' sliding_attention layers attend fully, as in transformers")
            layer_types = ["full_attention"] * len(layer_types)
        if not layer_types:  # transformers' Qwen3 rule: sliding on layers >= max_window_layers when use_sliding_window
            use = bool(cfg.get("use_sliding_window")) and window is not None
            first = cfg.get("max_window_layers", cfg["num_hidden_layers"])
            layer_types = ["sliding_attention" if use and i >= first else "full_attention"
                           for i in range(cfg["num_hidden_layers"])]
            if "sliding_attention" in layer_types:
                notes.append(f"layer_types missing: derived sliding attention (window {window}) on layers "
                             f"{first}..{cfg['num_hidden_layers'] - 1} from use_sliding_window and max_window_layers")
        conf = cls(
            hidden_size=cfg["hidden_size"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            target_layer_ids=[int(i) for i in ids],
            num_target_layers=int(n_target) if n_target is not None else max(ids) + 3,
            mask_token_id=int(mask),
            vocab_size=cfg.get("vocab_size", 0),
            block_size=int(block),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            layer_types=layer_types,
            sliding_window=window if "sliding_attention" in layer_types else None,
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
        ids = target_layer_ids if target_layer_ids is not None else target.default_layer_ids(num_layers)
        heads = tc.num_attention_heads
        rope = getattr(tc, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0))
        conf = dict(
            hidden_size=target.hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", heads),
            head_dim=getattr(tc, "head_dim", None) or target.hidden_size // heads,
            intermediate_size=tc.intermediate_size,
            num_hidden_layers=num_layers,
            target_layer_ids=list(ids),
            num_target_layers=target.num_layers,
            mask_token_id=target.mask_token_id,
            vocab_size=target.vocab_size,
            block_size=block_size,
            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=getattr(tc, "max_position_embeddings", 32768),
        )
        conf.update(overrides)
        return cls(**conf)

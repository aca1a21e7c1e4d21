"""Our drafter as transformers' own DFlash drafter (5.23: `MuseGlimmerAssistantModel`) and back (docs/design.md
section 3): only `fc` and `hidden_norm` are renamed; what has no counterpart there is refused by name."""

from __future__ import annotations

import weakref

from dflashkit.drafter.config import SCALING_OFF
from dflashkit.errors import DFlashError

MODEL_TYPE = "muse_glimmer_assistant"
CLASS = "MuseGlimmerAssistantModel"
RENAMES = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}
_ASSISTANTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # our drafter -> its transformers twin


def refusal(config, draft_vocab: bool) -> str | None:
    """Why this drafter cannot be expressed in transformers' DFlash drafter, or None."""
    if config.arch != "dflash":
        return f"architecture {config.arch}: transformers' DFlash drafter has no selector or codebooks"
    if draft_vocab:
        return ("a draft vocabulary: transformers drafts through the target's full head, with no token map; "
                "export with --full-vocab (tau as exported is then stated) or use --format zlab")
    if "sliding_attention" in config.layer_types:
        return "sliding-window layers: transformers' bidirectional window differs from ours at its edge"
    if scaled := [k for k, off in SCALING_OFF.items() if getattr(config, k) != off]:
        return f"{', '.join(scaled)}: transformers' DFlash loop applies no embedding or output scaling"
    if config.partial_rotary_factor != 1.0 or config.rope_scaling:
        return "partial rotary or RoPE scaling: transformers' DFlash drafter rotates every dim with plain RoPE"
    return None


def to_transformers(drafter, tensors: dict, dtype: str) -> tuple[dict, dict]:
    """(config.json, tensors) of transformers' DFlash drafter for `drafter` (its state dict `tensors`)."""
    c = drafter.config
    config = {
        "architectures": [CLASS], "model_type": MODEL_TYPE, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "max_position_embeddings": c.max_position_embeddings, "layer_types": list(c.layer_types),
        "sliding_window": c.sliding_window or c.max_position_embeddings,  # an int there; unread by full layers
        "block_size": c.block_size, "mask_token_id": c.mask_token_id,
        "target_layer_ids": list(c.target_layer_ids), "num_target_layers": c.num_target_layers,
        "vocab_size": c.vocab_size, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, "dtype": dtype,
    }
    return config, {RENAMES.get(k, k): v for k, v in tensors.items()}


def assistant(drafter, target):
    """transformers' DFlash drafter built in memory from ours, in the target's dtype and device; one per drafter."""
    if (made := _ASSISTANTS.get(drafter)) is not None:
        return made
    from transformers import AutoConfig, AutoModel

    if why := refusal(drafter.config, bool((getattr(drafter, "contract", None) or {}).get("draft_vocab"))):
        raise DFlashError(f"transformers-dflash: {why}")
    config, tensors = to_transformers(drafter, drafter.state_dict(), str(target.dtype).removeprefix("torch."))
    model = AutoModel.from_config(AutoConfig.for_model(**config), dtype=target.dtype)
    model.load_state_dict({k: v.to(target.dtype) for k, v in tensors.items()}, strict=True)
    _ASSISTANTS[drafter] = made = model.to(target.device).eval().requires_grad_(False)
    return made


def from_transformers(raw: dict, tensors: dict, source: str) -> tuple[dict, dict]:
    """A transformers DFlash drafter folder's (config, tensors) as the z-lab ones load_drafter reads."""
    if missing := [k for k in ("block_size", "mask_token_id", "target_layer_ids") if raw.get(k) is None]:
        raise DFlashError(f"{source}: model_type {MODEL_TYPE} without {', '.join(missing)}; transformers' DFlash loop "
                          "reads them: add them to config.json")
    rope = raw.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" or rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise DFlashError(f"{source}: rope_parameters {rope}: only plain RoPE (rope_type default) is read")
    back = {v: k for k, v in RENAMES.items()}
    zlab = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "rope_parameters")}
    zlab.update(architectures=["DFlashDraftModel"], model_type="qwen3", rope_theta=rope.get("rope_theta", 500000.0),
                dflash_config={"mask_token_id": raw["mask_token_id"], "target_layer_ids": raw["target_layer_ids"],
                               "block_size": raw["block_size"]})
    zlab.setdefault("num_target_layers", max(raw["target_layer_ids"]) + 3)
    if "sliding_attention" not in (raw.get("layer_types") or ["sliding_attention"]):
        zlab["sliding_window"] = None  # written only because the field must be an int there
    return zlab, {back.get(k, k): v for k, v in tensors.items()}

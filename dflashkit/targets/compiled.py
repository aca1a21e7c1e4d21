"""Compiled small-M linears for a float32 CPU target: a verify of 2-8 tokens costs little more than one token.

With the stock kernels on a float32-only CPU (AVX2) a 2-token forward costs 1.5-1.7x a 1-token one and an
8-token forward 1.8x, so speculative decoding barely pays there. inductor's CPP GEMM micro-kernels, with the
weights frozen (packed once), bring that to 1.1-1.3x for 2-4 tokens and 1.4x for 8, and a one-token forward gets
faster too (benchmarks/results/cpu-2026-12-01-compiled-forward.md; on coding-10 hybrid-auto went from 1.30x to
1.69x plain decoding, cpu-2026-12-01-compiled-coding-10.md). A Llama decoder layer runs as two compiled halves
around its attention (FusedLayer: norms, projections, rotary embedding, residuals and MLP fused; a one-token forward
75 -> 61 ms on SmolLM2), other layouts as one compiled unit per projection and MLP, and the LM head as one unit.
Each is compiled once for every number of rows (dynamic, size-oblivious shapes: one row is not a special case), so
a row's output does not depend on how many rows share the call. That holds for every linear, norm and MLP by
construction; attention (PyTorch's SDPA) is not row-invariant: a multi-token verify's rows round differently from
a one-token step by up to about 3e-7 in float32 (measured, with or without the mask), so exactness rests on such a
difference not flipping a greedy choice. It has not in any run so far, and bench checks every output.

Compiling costs about 2 minutes per process on 2 cores (the first forward pays it), which is why `auto` uses it
only for a target large enough to win that back; `kernels="compiled"` forces it, `"eager"` never compiles.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
from torch import nn

from dflashkit.errors import DFlashError

ATTRIBUTE = "_dflashkit_kernels"  # the mode a Target chose for its model: "eager" or "compiled"
MIN_PARAMETERS = 50_000_000  # below this a compile costs more than the decoding it speeds up
KERNELS = ("auto", "eager", "compiled")


def choose_kernels(model: nn.Module, asked: str = "auto") -> str:
    """auto: compiled for a float32 CPU model of the Llama layout with at least MIN_PARAMETERS weights."""
    if asked not in KERNELS:
        raise DFlashError(f"--kernels {asked!r}: use one of {', '.join(KERNELS)}")
    if asked == "eager":
        return "eager"
    param = next(model.parameters())
    fits = param.device.type == "cpu" and param.dtype == torch.float32 and bool(_slots(model))
    if asked == "compiled" and not fits:
        raise DFlashError("--kernels compiled: only a float32 CPU target with Llama-style layers (q/k/v/o_proj and "
                          "an mlp in every decoder layer) can use them; use --kernels eager or --dtype float32")
    big = sum(p.numel() for p in model.parameters()) >= MIN_PARAMETERS
    return "compiled" if fits and (asked == "compiled" or big) else "eager"


def uses_compiled(model: nn.Module) -> bool:
    return getattr(model, ATTRIBUTE, "eager") == "compiled"


def _slots(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent, attribute) of every unit to compile; empty when the model is not laid out like Llama."""
    layers = getattr(model.get_decoder(), "layers", None) if hasattr(model, "get_decoder") else None
    if layers is None or not hasattr(model, "lm_head"):
        return []
    out = []
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        names = ("q_proj", "k_proj", "v_proj", "o_proj")
        if attn is None or not hasattr(layer, "mlp") or not all(isinstance(getattr(attn, n, None), nn.Linear)
                                                                for n in names):
            return []
        out += [(attn, n) for n in names] + [(layer, "mlp")]
    return out + [(model, "lm_head")]


def _compile(fn, name: str):
    """torch.compile for every number of rows; its own code object, so that a call checks its own guards only, not
    those of 150 siblings (that search cost 0.7 ms per call)."""
    fn.__code__ = fn.__code__.replace(co_name=name)
    return torch.compile(fn, mode="max-autotune-no-cudagraphs")  # dynamic in the rows: _rows() marks them


class CompiledUnit(nn.Module):
    """One linear or MLP, compiled on first use for every number of rows, with inductor's CPP GEMM template only
    (ATen's kernels are not row-invariant). Rows are flattened to one contiguous matrix first: one graph serves any
    batch and any view (a strided batch of rows also hit a codegen bug of the CPP template)."""

    def __init__(self, inner: nn.Module, index: int):
        super().__init__()
        self.inner = inner

        def unit(x):
            return inner(x)
        self.fn = _compile(unit, f"dflashkit_unit_{index}")

    def forward(self, x):
        return self.fn(_rows(x)).view(*x.shape[:-1], -1)  # compiled_linears() holds the settings a compile needs


class FusedLayer:
    """A Llama decoder layer as two compiled halves around its attention: norm, q/k/v projections and rotary
    embedding before; output projection, residuals, norm and MLP after. Per layer that is 2 compiled calls instead
    of 5 plus about 20 eager operations. Between them, the model's own KV cache and PyTorch's SDPA on the mask
    transformers built (Llama layers have no sliding window, soft-capping or dropout at inference to honour)."""

    def __init__(self, layer: nn.Module, index: int):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        attn = self.attn = layer.self_attn

        def before(x, cos, sin):  # x: (rows, hidden); cos, sin: (rows, head_dim)
            h = layer.input_layernorm(x)
            q, k = (proj(h).view(x.shape[0], -1, attn.head_dim) for proj in (attn.q_proj, attn.k_proj))
            return *apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1), attn.v_proj(h)

        def after(x, a):  # x: the layer's input rows; a: the attention's output rows
            x = x + attn.o_proj(a)
            return x + layer.mlp(layer.post_attention_layernorm(x))

        self.before, self.after = _compile(before, f"dflashkit_before_{index}"), _compile(after, f"dflashkit_after_{index}")

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                position_embeddings=None, **kwargs):
        b, t, width = hidden_states.shape
        attn, x = self.attn, _rows(hidden_states)
        cos, sin = (_rows(e.expand(b, t, -1)) for e in position_embeddings)
        q, k, v = (y.reshape(b, t, -1, attn.head_dim).transpose(1, 2) for y in self.before(x, cos, sin))
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, attn.layer_idx)
        # the grouped key/value heads as they are (enable_gqa), also under a mask, where transformers' sdpa path
        # copies them out to every query head (7 of 70 ms of a 4-token verify here); bitwise the same result
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask, scale=attn.scaling, is_causal=attention_mask is None and t > 1,
            enable_gqa=True)
        return self.after(x, _rows(out.transpose(1, 2).reshape(b, t, -1))).view(b, t, width)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as one contiguous (rows, features) matrix that is not a view, the rows marked dynamic: dynamo guards a
    view's base, whose strides change with the batch and the sequence, and would recompile for each; the features
    stay static (the rows need no gradient here)."""
    rows = x.reshape(-1, x.shape[-1]).detach()
    torch._dynamo.mark_dynamic(rows, 0)
    return rows


def memoise_templates() -> None:
    """inductor re-parses the same Jinja template for every GEMM it renders: half of a CPU compile here."""
    from torch._inductor.codegen.common import KernelTemplate

    raw = KernelTemplate.__dict__.get("_template_from_string")
    if isinstance(raw, staticmethod) and not hasattr(raw.__func__, "cache_info"):
        KernelTemplate._template_from_string = staticmethod(functools.lru_cache(maxsize=None)(raw.__func__))


def _fusable(model: nn.Module) -> bool:
    """Llama's own decoder layers, whose forward FusedLayer restates; other layouts get per-linear units."""
    layers = model.get_decoder().layers
    return all(type(layer).__name__ == "LlamaDecoderLayer" for layer in layers)


def _units(model: nn.Module) -> tuple[list[FusedLayer], list[tuple[nn.Module, str, CompiledUnit]]]:
    """(fused layers, (parent, attribute, unit) of every other compiled unit): built once per model and kept, as
    the compiled code lives as long as the model; not submodules, so state_dict and .to() never see them."""
    units = model.__dict__.get("_dflashkit_units")
    if units is None:
        memoise_templates()
        fusable = _fusable(model)
        slots = [(model, "lm_head")] if fusable else _slots(model)
        fused = [FusedLayer(layer, i) for i, layer in enumerate(model.get_decoder().layers)] if fusable else []
        units = fused, [(parent, name, CompiledUnit(getattr(parent, name), i)) for i, (parent, name) in enumerate(slots)]
        model.__dict__["_dflashkit_units"] = units
    return units


@contextmanager
def compiled_linears(model: nn.Module):
    """The compiled units in place of the model's own inside the block, the originals restored after."""
    import torch._inductor.config as inductor_config
    import torch.fx.experimental._config as fx_config

    fused, units = _units(model)
    layers = list(model.get_decoder().layers)[: len(fused)]
    originals = [getattr(parent, name) for parent, name, _ in units]
    forwards = [layer.__dict__.get("forward") for layer in layers]  # set when nested
    try:
        for parent, name, unit in units:
            setattr(parent, name, unit)
        for layer, unit in zip(layers, fused):
            layer.forward = unit.forward  # the module stays: hooks that record hidden states still fire
        # what any (re)compile inside needs, set once per block rather than per call (60-150 calls per forward):
        # one-row inputs not special-cased, frozen (packed) weights, the CPP template only; no_grad for freezing
        with (fx_config.patch(backed_size_oblivious=True), torch.no_grad(),
              inductor_config.patch(freezing=True, max_autotune_gemm_backends="CPP")):
            yield
    finally:
        for (parent, name, _), original in zip(units, originals):
            setattr(parent, name, original)
        for layer, forward in zip(layers, forwards):
            if forward is None:
                del layer.forward
            else:
                layer.forward = forward

"""Compiled small-M linears for a float32 CPU target: a verify of 2-8 tokens costs little more than one token.

With the stock kernels on a float32-only CPU (AVX2) a 2-token forward costs 1.5-1.7x a 1-token one and an
8-token forward 1.8x, so speculative decoding barely pays there. inductor's CPP GEMM micro-kernels, with the
weights frozen (packed once), bring that to 1.1-1.3x for 2-4 tokens and 1.4x for 8, and a one-token forward gets
faster too (benchmarks/results/cpu-2026-12-01-compiled-forward.md; on coding-10 hybrid-auto went from 1.30x to
1.69x plain decoding, cpu-2026-12-01-compiled-coding-10.md). Each attention projection, each MLP and the LM head
becomes one compiled unit, compiled once for every number of rows (dynamic, size-oblivious shapes: one row is not
a special case), so a row's output does not depend on how many rows share the call: the row invariance that keeps
speculative decoding token-exact holds by construction, for plain decoding as much as for a tree verify.

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
    layers = getattr(getattr(model, "model", None), "layers", None)
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


class CompiledUnit(nn.Module):
    """One linear or MLP, compiled on first use for every number of rows, with inductor's CPP GEMM template only
    (ATen's kernels are not row-invariant). Each unit gets its own code object, so that a call checks its own
    guards only, not those of 150 siblings (that search cost 0.7 ms per call)."""

    def __init__(self, inner: nn.Module, index: int):
        super().__init__()
        self.inner = inner

        def unit(x):
            return inner(x)
        unit.__code__ = unit.__code__.replace(co_name=f"dflashkit_unit_{index}")
        self.fn = torch.compile(unit, dynamic=True, mode="max-autotune-no-cudagraphs")

    def forward(self, x):
        return self.fn(x)  # compiled_linears() holds the settings a (re)compile needs


def memoise_templates() -> None:
    """inductor re-parses the same Jinja template for every GEMM it renders: half of a CPU compile here."""
    from torch._inductor.codegen.common import KernelTemplate

    raw = KernelTemplate.__dict__.get("_template_from_string")
    if isinstance(raw, staticmethod) and not hasattr(raw.__func__, "cache_info"):
        KernelTemplate._template_from_string = staticmethod(functools.lru_cache(maxsize=None)(raw.__func__))


def _units(model: nn.Module) -> list[CompiledUnit]:
    units = model.__dict__.get("_dflashkit_units")
    if units is None:  # built once per model and kept: the compiled code lives as long as the model
        memoise_templates()
        units = [CompiledUnit(getattr(parent, name), i) for i, (parent, name) in enumerate(_slots(model))]
        model.__dict__["_dflashkit_units"] = units  # not a submodule: state_dict and .to() never see it
    return units


@contextmanager
def compiled_linears(model: nn.Module):
    """The compiled units in place of the model's own inside the block, the originals restored after."""
    import torch._inductor.config as inductor_config
    import torch.fx.experimental._config as fx_config

    slots = _slots(model)
    originals = [getattr(parent, name) for parent, name in slots]
    try:
        for (parent, name), unit in zip(slots, _units(model)):
            setattr(parent, name, unit)
        # what any (re)compile inside needs, set once per block rather than per call (150 calls per forward):
        # one-row inputs not special-cased, frozen (packed) weights, the CPP template only; no_grad for freezing
        with (fx_config.patch(backed_size_oblivious=True), torch.no_grad(),
              inductor_config.patch(freezing=True, max_autotune_gemm_backends="CPP")):
            yield
    finally:
        for (parent, name), original in zip(slots, originals):
            setattr(parent, name, original)

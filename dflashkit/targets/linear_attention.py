"""Linear-attention backends for hybrid targets' Gated DeltaNet layers, rebound for a block so that caches extracted
with two can be compared (docs/design.md, "Linear-attention backends")."""

from __future__ import annotations

import importlib.util
import inspect
import sys
from contextlib import contextmanager

from dflashkit.errors import DFlashError

BACKENDS = ("auto", "torch", "torch-recurrent", "fla")
CHUNK, RECURRENT = "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"
_ORIGINAL: dict[str, tuple] = {}  # module name -> the functions transformers bound, before any rebinding


def _delta_rule_modules(model) -> list:
    """The Python modules whose gated-delta-rule functions the model's layers call."""
    mods = {}
    for m in model.modules():
        mod = sys.modules.get(type(m).__module__)
        if mod is not None and hasattr(mod, CHUNK) and hasattr(mod, RECURRENT):
            mods[mod.__name__] = mod
            _ORIGINAL.setdefault(mod.__name__, (getattr(mod, CHUNK), getattr(mod, RECURRENT)))
    return list(mods.values())


def resolve_backend(target, backend: str = "auto") -> str:
    """The backend a setting means for this target on its device ("none" for non-hybrid targets)."""
    if backend not in BACKENDS:
        raise DFlashError(f"unknown linear-attention backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if not target.is_hybrid or not _delta_rule_modules(target.model):
        return "none"
    cuda = target.device.type == "cuda"
    if backend == "auto":
        return "fla" if cuda and importlib.util.find_spec("fla") else "torch"
    if backend == "fla":
        if not cuda:
            raise DFlashError("--linear-attention fla needs a CUDA device (its kernels are Triton); use torch on CPU")
        if importlib.util.find_spec("fla") is None:
            raise DFlashError("--linear-attention fla: the `flash-linear-attention` package is not installed; "
                              "`pip install flash-linear-attention`, or use --linear-attention torch")
    return backend


def _keep_known_kwargs(fn):
    """fla's kernels reject keyword arguments the torch reference takes (chunk_size, ...): drop them."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return fn

    def call(*args, **kwargs):
        return fn(*args, **{k: v for k, v in kwargs.items() if k in params})
    return call


def _functions(backend: str, mod):
    if backend == "fla":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

        return _keep_known_kwargs(chunk_gated_delta_rule), _keep_known_kwargs(fused_recurrent_gated_delta_rule)
    # transformers wraps the torch reference (functools.wraps), possibly twice: unwrap to reach it.
    chunk, recurrent = (inspect.unwrap(f) for f in _ORIGINAL[mod.__name__])
    return (recurrent if backend == "torch-recurrent" else chunk), recurrent


@contextmanager
def linear_attention(target, backend: str = "auto"):
    """Run the block with the given linear-attention backend; yields the resolved name."""
    resolved = resolve_backend(target, backend)
    saved = []
    try:
        for mod in _delta_rule_modules(target.model) if resolved != "none" else ():
            saved += [(mod, name, getattr(mod, name)) for name in (CHUNK, RECURRENT)]
            for name, fn in zip((CHUNK, RECURRENT), _functions(resolved, mod)):
                setattr(mod, name, fn)
        yield resolved
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)

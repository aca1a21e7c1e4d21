"""Row-invariant kernels: a token's logits must not depend on how many tokens share its forward.

Speculative decoding is lossless only if the target's choice for a token is the same whether the token is
verified alone (plain decoding) or among a block or tree of drafts. On CPU in bfloat16 it is not by default:
a one-row matmul runs a GEMV kernel whose rounding differs from the GEMM kernel used for 2+ rows, and the fused
SDPA kernels reduce differently for 1 and n queries. One ulp of bf16 (0.4%) then flips a near-tie a few hundred
tokens in, and plain and speculative outputs part (measured on SmolLM2: first difference after 135-217 tokens).

Hybrid targets add a third source: a Gated DeltaNet layer runs a multi-token input through its chunked conv and
delta rule and a one-token input through the recurrent ones, which round differently in bf16. Inside the switch
those layers therefore take any multi-token input after the prefill one token at a time, which is exactly what
plain decoding computes (the prefill itself is the same call for both).

`row_invariant(model)` (a context manager, so no kernel switch outlives the decoding that asked for it: an
extraction on the same target afterwards runs the stock kernels again) removes both sources: every linear layer
runs one-row inputs as two identical rows (the GEMM kernel; in bf16 a two-row forward costs 1.01x a one-row one)
and calls of more than MAX_ROWS rows in slices (on AMX CPUs a GEMM of 33+ rows takes another kernel), and
attention is matmul + softmax + matmul in float64, rounded once (on AMX CPUs a bf16 matmul's rounding changed
with the number of keys). float32 needs none of it (its
rounding differences are 1e-7 and have not flipped a token in our runs), and there the GEMV kernel is
much faster, so the function leaves float32 models alone.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from dflashkit.targets.compiled import compiled_linears, uses_compiled

NAME = "row_invariant"  # (a name containing "flash" would be routed to flash-attention kernels)


MAX_ROWS = 32  # on an AMX CPU a bf16 GEMM of 33+ rows rounds differently from one of 2-32 (a wide verify)


class RowInvariantLinear(nn.Linear):
    """nn.Linear whose every row is computed by the same kernel whatever shares its call: one row runs as two
    identical rows (the GEMV kernel rounds differently) and more than MAX_ROWS rows in slices of at most MAX_ROWS
    (a slice of one again as two)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if 1 < rows.shape[0] <= MAX_ROWS:
            return F.linear(x, self.weight, self.bias)
        out = torch.cat([self._slice(s) for s in rows.split(MAX_ROWS)])
        return out.reshape(*x.shape[:-1], -1)

    def _slice(self, rows: torch.Tensor) -> torch.Tensor:
        if rows.shape[0] > 1:
            return F.linear(rows, self.weight, self.bias)
        return F.linear(torch.cat([rows, rows]), self.weight, self.bias)[:1]


def row_invariant_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None,
                            s_aux=None, **kwargs):
    """query [b, h, q, d], key/value [b, kv_h, T, d]; additive mask [b, 1, q, T] or None -> ([b, q, h, d], None).

    Computed in float64 and rounded once at the end: a bf16 matmul's rounding depends on the kernel the call's
    shape selects (on AMX CPUs a query row's scores round differently with 52 keys than with 53), and float32 sums
    still differ in order (about 1e-7, enough to flip a bf16 output now and then). In float64 the differences are
    about 1e-16 relative: a bf16 output flips only if its exact value lies that close to a rounding boundary.
    The two extras of the families' own eager attention are honoured, else the switch would run another model:
    softcap (Gemma 2: softcap * tanh(scores / softcap) before the mask) and s_aux (gpt-oss's attention sinks: one
    logit per head that joins each row's softmax and is dropped after it)."""
    out_dtype = query.dtype
    groups = query.shape[1] // key.shape[1]
    query = query.double()
    key, value = key.double().repeat_interleave(groups, dim=1), value.double().repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores + attention_mask[..., : key.shape[2]].double()
    if s_aux is not None:
        scores = torch.cat([scores, s_aux.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1).double()], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if s_aux is not None:
        probs = probs[..., :-1]
    out = torch.matmul(probs, value).to(out_dtype)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register(NAME, row_invariant_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, eager_mask)  # additive float masks, as the eager path uses


_STOCK = contextvars.ContextVar("stock_kernels", default=False)
_STEPWISE: dict[type, type] = {}


def needs_switch(model: nn.Module) -> bool:
    """True where decoding runs other kernels than the model's own: a low-precision CPU model (row-invariant ones)
    and a float32 CPU model that chose compiled ones (target/compiled.py)."""
    param = next(model.parameters())
    return (param.dtype != torch.float32 and param.device.type == "cpu") or uses_compiled(model)


def describe_kernels(model: nn.Module) -> str:
    """One line for reports: the kernels decoding runs on this model and why."""
    if uses_compiled(model):
        return ("compiled linears (inductor's CPP GEMM micro-kernels, weights frozen, one compile for every number of "
                "tokens) for every method, plain decoding included: a 2-8 token verify costs 1.1-1.5x one token "
                "instead of 1.5-1.8x, and each linear's row is computed the same whatever shares its call (attention "
                "rounds a verify's rows within about 3e-7 of a one-token step; every output is checked); ar-stock runs the "
                "stock kernels, and speedups are against the faster of ar and ar-stock")
    if needs_switch(model):
        return ("row-invariant kernels (one-row products run as two rows, attention as matmul + float32 softmax), so "
                "that speculative output equals plain greedy output token for token in low precision; the speed "
                "baseline ar-stock runs the stock kernels")
    return ("the stock kernels (MKL/oneDNN linears, SDPA attention) for every method, ar included: in float32 their "
            "row-to-row rounding differences (1e-7) have not flipped a token in our runs; compiled linears were not "
            "chosen (--kernels eager, a target too small to win back the compile, or not a float32 CPU)")


def stock_kernels_active() -> bool:
    return _STOCK.get()


@contextmanager
def stock_kernels():
    """Inside, row_invariant() switches nothing: plain decoding runs the model's own, fastest kernels. That is the
    fair timing baseline; its tokens may part from the invariant reference in low precision."""
    token = _STOCK.set(True)
    try:
        yield
    finally:
        _STOCK.reset(token)


def _stepwise(cls: type) -> type:
    """A subclass of a linear-attention layer class whose cached multi-token calls run one token at a time."""
    if cls not in _STEPWISE:
        def forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
            n = hidden_states.shape[1]
            if n == 1 or cache_params is None or cache_params.get_conv_state(self.layer_idx, state_idx=0) is None:
                return cls.forward(self, hidden_states, cache_params, attention_mask, **kwargs)
            mask = (lambda i: None) if attention_mask is None else (lambda i: attention_mask[:, i : i + 1])
            return torch.cat([cls.forward(self, hidden_states[:, i : i + 1], cache_params, mask(i), **kwargs)
                              for i in range(n)], dim=1)
        _STEPWISE[cls] = type(f"Stepwise{cls.__name__}", (cls,), {"forward": forward})
    return _STEPWISE[cls]


def _is_linear_attention(m: nn.Module) -> bool:
    return hasattr(m, "A_log") and hasattr(m, "conv1d") and hasattr(m, "layer_idx")


@contextmanager
def row_invariant(model: nn.Module):
    """Row-invariant kernels on a low-precision CPU model inside the block, the model's own ones restored after;
    yields True if it switched anything (nested use is a no-op). Linear attention (Gated DeltaNet) layers step
    token by token after the prefill."""
    if not _STOCK.get() and uses_compiled(model):  # float32: compiled units, row-invariant linears by construction
        with compiled_linears(model):
            yield True
        return
    if _STOCK.get() or not needs_switch(model) or model.config._attn_implementation == NAME:
        yield model.config._attn_implementation == NAME
        return
    before = model.config._attn_implementation
    swapped = [(m, type(m)) for m in model.modules() if type(m) is nn.Linear or _is_linear_attention(m)]
    for m, cls in swapped:
        m.__class__ = RowInvariantLinear if cls is nn.Linear else _stepwise(cls)
    _register()
    model.set_attn_implementation(NAME)
    try:
        yield True
    finally:
        for m, cls in swapped:
            m.__class__ = cls
        model.set_attn_implementation(before)

"""Row-invariant kernels: a token's logits must not depend on how many tokens share its forward (in CPU bf16 a
one-row GEMV and fused SDPA round unlike their n-row kernels): docs/design.md section 8."""

from __future__ import annotations

import functools
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

MAX_ROWS = 32  # on an AMX CPU a bf16 GEMM of 33+ rows rounds differently from one of 2-32 (a wide verify)
LOW = (torch.bfloat16, torch.float16)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with every row computed by the same kernel whatever shares its call."""
    rows = x.reshape(-1, x.shape[-1])
    if 1 < rows.shape[0] <= MAX_ROWS:
        return F.linear(x, weight, bias)
    parts = [F.linear(s if s.shape[0] > 1 else torch.cat([s, s]), weight, bias)[: s.shape[0]]
             for s in rows.split(MAX_ROWS)]
    return torch.cat(parts).reshape(*x.shape[:-1], -1)


def invariant_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """scaled_dot_product_attention in float64, rounded once to the query's dtype (inference: no dropout)."""
    q, k, v = query.double(), key.double(), value.double()
    if k.shape[-3] != q.shape[-3]:  # grouped key/value heads
        groups = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    scores = q @ k.transpose(-2, -1) * (scale if scale is not None else q.shape[-1] ** -0.5)
    hidden = torch.finfo(torch.float64).min  # finite, as eager masks are: a row with no key left is no NaN
    if is_causal:  # torch's convention: query i sees keys <= i, aligned at the top left
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, hidden)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, hidden) if attn_mask.dtype == torch.bool \
            else scores + attn_mask.double()
    return (torch.softmax(scores, dim=-1) @ v).to(query.dtype)


def _low(fn):
    """fn on low-precision inputs; NotImplemented (the stock kernel) on any other."""
    return lambda x, *args, **kwargs: fn(x, *args, **kwargs) if x.dtype in LOW else NotImplemented


def _wide_matmul(a, b, *rest, **kw):
    return (a.double() @ b.double()).to(a.dtype) if isinstance(b, torch.Tensor) else NotImplemented


def _wide_softmax(x, dim=None, dtype=None):  # torch.softmax and Tensor.softmax
    return torch.softmax(x.double(), dim=dim).to(dtype or x.dtype)


_HANDLERS = {F.linear: _low(invariant_linear), F.scaled_dot_product_attention: _low(invariant_sdpa),
             torch.softmax: _low(_wide_softmax), torch.Tensor.softmax: _low(_wide_softmax),
             F.softmax: _low(lambda x, dim=None, _stacklevel=3, dtype=None: _wide_softmax(x, dim, dtype)),
             **dict.fromkeys((torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm),
                             _low(_wide_matmul))}


class RowInvariantKernels(TorchFunctionMode):
    """The row-invariant kernels (see the module docstring) for the forwards run inside; all else runs as outside."""

    name = "row-invariant"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = _HANDLERS[func](*args, **kwargs) if func in _HANDLERS else NotImplemented
        return func(*args, **kwargs) if out is NotImplemented else out


def needs_invariant(model: nn.Module) -> bool:
    """True where decoding needs other kernels than the model's own to stay exact: a low-precision CPU model."""
    param = next(model.parameters())
    return param.dtype != torch.float32 and param.device.type == "cpu"


def kernels_for(target, stock: bool = False):
    """The kernels the reference backend decodes `target` on: row-invariant where needed (not `stock`), else its own."""
    return RowInvariantKernels() if not stock and needs_invariant(target.model) else nullcontext()


def describe_kernels(model: nn.Module) -> str:
    """One line for reports: the kernels the reference backend decodes on and why."""
    if needs_invariant(model):
        return ("row-invariant kernels on the reference backend (one-row products run as two rows, attention in "
                "float64 rounded once), so that speculative output equals plain greedy output token for token in low "
                "precision; the speed baseline ar@hf-stock runs the stock kernels")
    return ("the stock kernels (MKL/oneDNN linears, SDPA attention) on the reference backend, ar included: in float32 "
            "their row-to-row rounding differences (1e-7) have not flipped a token in our runs")


def _is_linear_attention(m: nn.Module) -> bool:
    return hasattr(m, "A_log") and hasattr(m, "conv1d") and hasattr(m, "layer_idx")


def stepwise_forward(layer: nn.Module, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    """A linear-attention forward whose cached multi-token calls step one token at a time, bit for bit as decoding."""
    one = type(layer).forward
    n = hidden_states.shape[1]
    if n == 1 or cache_params is None or cache_params.get_conv_state(layer.layer_idx, state_idx=0) is None:
        return one(layer, hidden_states, cache_params, attention_mask, **kwargs)
    mask = (lambda i: None) if attention_mask is None else (lambda i: attention_mask[:, i : i + 1])
    return torch.cat([one(layer, hidden_states[:, i : i + 1], cache_params, mask(i), **kwargs) for i in range(n)],
                     dim=1)


def step_linear_attention(model: nn.Module) -> int:
    """At load: a low-precision CPU model's linear-attention layers forward stepwise; returns how many."""
    if not needs_invariant(model):
        return 0
    layers = [m for m in model.modules() if _is_linear_attention(m)]
    for m in layers:
        m.forward = functools.partial(stepwise_forward, m)
    return len(layers)

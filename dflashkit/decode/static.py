"""Plain decoding in the shape of gpt-fast (issue 38): a static KV cache sized to the run, the Llama step written out
over the target's weights, compiled once per width. Nothing here changes process state: the kernels are the
value a decoder is built with (`kernels`, by name), and the compiled step is a pure function of its inputs.

Why it is faster than our `ar` on a CPU: HF's modules, a DynamicCache and ~450 small ops a token cost more than the
weights take to read; compiled, the step is a few dozen fused kernels. Why the linears are reductions: at one row,
inductor's fused reduction (each weight read once, in its own dtype, summed in float32) reads bf16 weights faster
than the mm kernel does (27 vs 18 GB/s on a 2-core EPYC, benchmarks/static_decode_probe.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F

from dflashkit.errors import DFlashError

WIDTHS = (1, 32)  # one token a step; prompts in chunks of 32
PREFILL = WIDTHS[-1]
# inductor's C++ wrapper calls the step's kernels without Python between them: 12.9 -> 10.8 ms a token (SmolLM2,
# bf16, 2-core Zen 5); passed per compile, so nothing outside this decoder changes
COMPILE_OPTIONS = {"cpp_wrapper": True}
LLAMA_TYPES = ("llama", "qwen2", "qwen3", "mistral")
ALIGN = 64  # elements: every weight in the arena starts on a cache line (and a vector load) boundary
HUGE_PAGE = 2 << 20


def linear_mm(x, w):
    """x (float32) @ w.T in the weights' dtype, back to float32."""
    return (x.to(w.dtype) @ w.t()).float()


def linear_reduce(x, w):
    """x @ w.T as one reduction per output, summed in float32 (compiled: one fused kernel per weight)."""
    return (w.float() * x.float()[..., None, :]).sum(-1)


class Geometry(NamedTuple):
    """What a compiled step is specialised on, besides its inputs' sizes: two targets of one geometry share it."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int
    bias: bool  # q, k and v biases (Qwen2)
    qk_norm: bool  # per-head RMS norms of q and k (Qwen3)
    eps: float

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim

    def slots(self) -> list[tuple[str, tuple[int, ...]]]:
        """One layer's weights, in arena order."""
        qkv = self.q_size + 2 * self.kv_size
        s = [("n1", (self.hidden,)), ("n2", (self.hidden,)), ("qkv", (qkv, self.hidden))]
        s += [("qkv_bias", (qkv,))] if self.bias else []
        s += [("q_norm", (self.head_dim,)), ("k_norm", (self.head_dim,))] if self.qk_norm else []
        return s + [("o", (self.hidden, self.q_size)), ("gu", (2 * self.inter, self.hidden)),
                    ("down", (self.hidden, self.inter))]

    def layout(self) -> tuple[dict, int, dict, int]:
        """Offsets in the arena: one layer's {name: (offset, shape)}, the distance between layers, the final
        norm's and head's, and the arena's size."""
        def place(entries, off):
            out = {}
            for name, shape in entries:
                out[name] = (off, shape)
                off += -(-torch.Size(shape).numel() // ALIGN) * ALIGN
            return out, off
        layer, stride = place(self.slots(), 0)
        tail, end = place([("norm", (self.hidden,)), ("head", (self.vocab, self.hidden))], stride * self.layers)
        return layer, stride, tail, end


def _view(arena, off, shape):
    return arena[off: off + torch.Size(shape).numel()].view(shape)


def geometry_of(target) -> Geometry:
    """The target's geometry, or a refusal naming what the static step does not compute."""
    cfg = target.config
    kind = getattr(cfg, "model_type", "?")
    use = "; use method 'ar' for this one"
    if kind not in LLAMA_TYPES or getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        raise DFlashError(f"target {target.name} ({kind}): the static decoder runs dense-attention Llama-type targets "
                          f"({', '.join(LLAMA_TYPES)}, no sliding window) so far{use}")
    if target.device.type != "cpu" and not torch.cuda.is_available():
        raise DFlashError(f"target {target.name} is on {target.device}: the static decoder runs on cpu or cuda")
    a, p = target.decoder.layers[0].self_attn, target.decoder.layers[0].mlp
    biases = [x.bias is not None for x in (a.q_proj, a.k_proj, a.v_proj)]
    others = [x.bias is not None for x in (a.o_proj, p.gate_proj, p.up_proj, p.down_proj)]
    if any(others) or len(set(biases)) > 1:
        raise DFlashError(f"target {target.name}: biases on o_proj or the MLP (or on only some of q, k, v) are not "
                          f"in the static step{use}")
    nh = cfg.num_attention_heads
    return Geometry(len(target.decoder.layers), cfg.hidden_size, nh, cfg.num_key_value_heads,
                    getattr(cfg, "head_dim", None) or cfg.hidden_size // nh, cfg.intermediate_size,
                    target.lm_head.weight.shape[0], all(biases), getattr(a, "q_norm", None) is not None,
                    float(cfg.rms_norm_eps))


def _layer_weights(layer) -> dict:
    a, p = layer.self_attn, layer.mlp
    return dict(
        n1=layer.input_layernorm.weight, n2=layer.post_attention_layernorm.weight,
        qkv=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
        qkv_bias=torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]) if a.q_proj.bias is not None else None,
        q_norm=getattr(getattr(a, "q_norm", None), "weight", None),
        k_norm=getattr(getattr(a, "k_norm", None), "weight", None),
        o=a.o_proj.weight, gu=torch.cat([p.gate_proj.weight, p.up_proj.weight]), down=p.down_proj.weight)


def _empty_arena(numel: int, dtype, device) -> torch.Tensor:
    """An untouched buffer; on a Linux CPU the kernel is first asked to back it with 2 MiB pages (madvise): a step
    streams every weight once, and on 4 KiB pages the TLB misses cost 6-12% of it (2-core Zen 5, side by side).
    Where the hint is refused, 4 KiB pages: same numbers, a little slower."""
    nbytes = numel * dtype.itemsize
    if device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    raw = torch.empty(nbytes + 2 * HUGE_PAGE, dtype=torch.uint8)  # big enough that malloc maps it fresh
    start = -raw.data_ptr() % HUGE_PAGE
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.madvise(ctypes.c_void_p(raw.data_ptr() + start), ctypes.c_size_t(-(-nbytes // HUGE_PAGE) * HUGE_PAGE), 14)
    except (OSError, AttributeError):
        pass  # not glibc
    return raw[start: start + nbytes].view(dtype)


def pack_weights(target, geo: Geometry) -> torch.Tensor:
    """The target's weights in the step's layout, one buffer (its own copy: q, k, v and gate, up are
    concatenated, so a step reads each layer's weights as four matrices)."""
    layer, stride, tail, size = geo.layout()
    arena = _empty_arena(size, target.dtype, target.device)
    for i, lw in enumerate(_layer_weights(m) for m in target.decoder.layers):
        for name, (off, shape) in layer.items():
            _view(arena, i * stride + off, shape).copy_(lw[name])
    for name, w in (("norm", target.final_norm.weight), ("head", target.lm_head.weight)):
        _view(arena, tail[name][0], tail[name][1]).copy_(w)
    return arena


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float()


def _rope(x, cos, sin):
    h = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., h:], x[..., :h]], -1) * sin


def attend_reduce(q, k, v, mask, kvh):
    """Softmax attention written out over the whole static cache (grouped heads, float32), its two products
    as reductions like the linears: a query's output then does not depend on how many share the step, and
    compiled it fuses into a few kernels (SDPA's CPU kernel costs 0.6 ms a layer on a 1024-slot cache)."""
    _, nh, n, hd = q.shape
    g = nh // kvh
    qg = q.reshape(1, kvh, g * n, 1, hd)
    s = (qg * k[:, :, None]).sum(-1) * hd ** -0.5  # [1, kvh, g*n, L]
    s = s.view(1, kvh, g, n, -1).masked_fill(~mask, float("-inf"))
    o = (s.softmax(-1).view(1, kvh, g * n, -1, 1) * v[:, :, None]).sum(-2)
    return o.reshape(1, nh, n, hd)


def attend_mm(q, k, v, mask, kvh):
    """The same attention with its products as batched matrix products: for a prompt's 32-token chunk, where the
    reductions cost 0.64 ms a layer (half the chunk's time, SmolLM2 on a 2-core Zen 5)."""
    _, nh, n, hd = q.shape
    g = nh // kvh
    s = (q.reshape(1, kvh, g * n, hd) @ k.transpose(-1, -2)) * hd ** -0.5
    s = s.view(1, kvh, g, n, -1).masked_fill(~mask, float("-inf"))
    return (s.softmax(-1).view(1, kvh, g * n, -1) @ v).reshape(1, nh, n, hd)


def linear_native(x, w):
    """dflashkit::linear (native.cpp, loaded by the decoder that uses it): a fixed-order float32 dot per row
    and output, each weight read once a call."""
    return torch.ops.dflashkit.linear(x, w)


# a step's kernels: (linear, attention), by name; the one-token and verify steps use `native` on a CPU
KERNELS = {"mm": (linear_mm, attend_mm), "reduce": (linear_reduce, attend_reduce),
           "native": (linear_native, attend_reduce)}


def step(arena, embed, rope, kv, ids, pos, keep, span, *, geo: Geometry, kernels: str, layer_ids):
    """The Llama step as a pure function of its inputs, so that decoders of one geometry share its compile and
    dynamo guards a handful of tensors, not every weight: the packed weights, the embedding table, rope's
    (cos, sin), the caches `kv` (per-layer K and V lists, written in place), ids [n] at absolute positions pos [n]
    -> logits [k, V] of the `keep` rows (and, with `layer_ids`, those layers' hidden states of all n rows
    [1, n, len(layer_ids) * H]). Attention reads the first len(`span`) slots of the cache (span = 0..S-1)."""
    layout, stride, tail, _ = geo.layout()
    linear, attend = KERNELS[kernels]
    n, eps, nh, kvh, hd = ids.shape[0], geo.eps, geo.heads, geo.kv_heads, geo.head_dim
    x = F.embedding(ids, embed)[None].float()
    cos, sin = rope[0][pos][None, None], rope[1][pos][None, None]
    S = span.shape[0]
    mask = span[None, :] <= pos[:, None]
    captured = {}
    for i in range(geo.layers):
        w = {name: _view(arena, i * stride + off, shape) for name, (off, shape) in layout.items()}
        qkv = linear(_rms(x, w["n1"], eps), w["qkv"])
        if geo.bias:
            qkv = qkv + w["qkv_bias"].float()
        q, k, v = qkv.split([geo.q_size, geo.kv_size, geo.kv_size], -1)
        q, k = q.view(1, n, nh, hd), k.view(1, n, kvh, hd)
        if geo.qk_norm:
            q, k = _rms(q, w["q_norm"], eps), _rms(k, w["k_norm"], eps)
        q, k = _rope(q.transpose(1, 2), cos, sin), _rope(k.transpose(1, 2), cos, sin)
        kv[0][i].index_copy_(2, pos, k)
        kv[1][i].index_copy_(2, pos, v.view(1, n, kvh, hd).transpose(1, 2))
        o = attend(q, kv[0][i][:, :, :S], kv[1][i][:, :, :S], mask, kvh)
        x = x + linear(o.transpose(1, 2).reshape(1, n, geo.q_size), w["o"])
        g, u = linear(_rms(x, w["n2"], eps), w["gu"]).chunk(2, -1)
        x = x + linear(F.silu(g) * u, w["down"])
        if layer_ids is not None and i in layer_ids:
            captured[i] = x
    norm, head = (_view(arena, *tail[k]) for k in ("norm", "head"))
    logits = linear(_rms(x.index_select(1, keep), norm, eps), head)[0]
    return (logits, torch.cat([captured[i] for i in layer_ids], -1)) if layer_ids is not None else logits


@functools.cache
def compiled_step(geo: Geometry, kernels: str, layer_ids: tuple | None):
    """`step` for one geometry, compiled on its first call per input shape. One per geometry in a process, shared
    by every decoder of it: a decoder rebuilt for a longer run adds dynamo one entry per width, not a copy of
    every one (dynamo keeps 8 per function)."""
    f = functools.partial(step, geo=geo, kernels=kernels, layer_ids=layer_ids)
    return torch.compile(f, fullgraph=True, dynamic=False, options=COMPILE_OPTIONS)


class StaticDecoder:
    """One target, one run length: `forward(ids, pos)` (and `prefill`, `verify`) write the KV of positions
    pos..pos+len(ids)-1 and return logits. Rejected positions need no crop: the causal mask hides every slot past
    the query's position and the next write overwrites them."""

    def __init__(self, target, max_len: int, kernels: str = "auto", prefill_kernels: str = "mm", compile: bool = True,
                 layer_ids: list[int] | None = None, verify_width: int | None = None):
        geo = geometry_of(target)
        if verify_width is not None and not 1 < verify_width < PREFILL:
            raise DFlashError(f"verify width {verify_width}: the static decoder verifies 2..{PREFILL - 1} tokens")
        if verify_width is not None and layer_ids is None:
            raise DFlashError("static decoder: a verify step returns the drafter's features; give layer_ids with it")
        if kernels == "auto":  # our C++ linear on a CPU (native.cpp), inductor's reductions elsewhere
            kernels = "native" if target.device.type == "cpu" else "reduce"
        for name in (kernels, prefill_kernels):
            if name not in KERNELS:
                raise DFlashError(f"kernels {name!r}: use auto or one of {', '.join(KERNELS)}")
        if "native" in (kernels, prefill_kernels):
            if target.device.type != "cpu":
                raise DFlashError(f"kernels 'native' run on a CPU; target {target.name} is on {target.device}: "
                                  "use kernels='reduce' (or auto)")
            from dflashkit.decode import native

            native.load()
        cfg, dev = target.config, target.device
        self.target, self.max_len = target, max_len
        self.arena, self.embed = pack_weights(target, geo), target.embed_tokens.weight
        theta = cfg.rope_parameters["rope_theta"] if getattr(cfg, "rope_parameters", None) else cfg.rope_theta
        inv = 1.0 / (theta ** (torch.arange(0, geo.head_dim, 2, device=dev).float() / geo.head_dim))
        f = torch.outer(torch.arange(max_len, device=dev).float(), inv)
        emb = torch.cat([f, f], -1)
        self.rope = (emb.cos(), emb.sin())
        # activations and the KV stay in float32 and only the weights are in the target's dtype: a rounding to bf16
        # between two ops is kept or skipped by inductor as it fuses them, which differs from one width to another;
        # with none, a verify's rows are the one-token step's bit for bit. One buffer per layer: an in-place write
        # into a view of one stacked buffer makes inductor copy it whole, and rows of one flat buffer written by
        # index cost 15% of a step (SmolLM2, side by side). One slot more than the run uses: a prompt chunk's
        # symbolic span then never equals the buffer (which would specialise its compile on that case).
        self.kv = tuple([torch.zeros(1, geo.kv_heads, max_len + 1, geo.head_dim, device=dev)
                         for _ in range(geo.layers)] for _ in "kv")
        self.full_span = torch.arange(max_len, device=dev)
        self.first = torch.zeros(1, dtype=torch.long, device=dev)  # a one-token step keeps its only row
        # per width, its kernels and whether it returns features: a prompt's chunks use matrix products (mm reads
        # each weight once for all 32 rows, a reduction 32 times); a verify uses the one-token step's reductions,
        # so that each of its rows is bit for bit what plain decoding computes (tests/test_static_decoder.py)
        self.layer_ids = list(layer_ids) if layer_ids is not None else None
        ids = tuple(self.layer_ids) if self.layer_ids is not None else None
        kinds = {1: (kernels, None), PREFILL: (prefill_kernels, ids)}
        if verify_width is not None:
            kinds[verify_width] = (kernels, ids)
        self.verify_width = verify_width
        self.steps = {w: compiled_step(geo, k, f) if compile else
                      functools.partial(step, geo=geo, kernels=k, layer_ids=f) for w, (k, f) in kinds.items()}
        self.compile_s: dict[int, float] = {}

    def _check_room(self, pos: int, n: int) -> None:
        if pos + n > self.max_len:
            raise DFlashError(f"static decoder: position {pos + n} is past its length {self.max_len}; "
                              "build it with a larger max_len (prompt + new tokens + a verify)")

    @torch.no_grad()
    def forward(self, ids: list[int], pos: int) -> torch.Tensor:
        """Logits [V] of the last of `ids` placed at pos..pos+len-1 (a prompt, or one token)."""
        if len(ids) == 1:
            self._check_room(pos, 1)
            dev = self.embed.device
            return self._call(1, torch.tensor(ids, device=dev), torch.tensor([pos], device=dev), self.first)[0]
        out = self.prefill(ids, pos)
        return out[0] if self.layer_ids is not None else out

    @torch.no_grad()
    def prefill(self, ids: list[int], pos: int = 0):
        """A prompt in chunks of PREFILL, the last one padded (padding writes slots past the real ones, which the
        mask hides and the next write replaces): the last token's logits [V] (and with layer_ids, every prompt
        position's features [1, len(ids), F])."""
        self._check_room(pos, len(ids))
        dev, feats = self.embed.device, []
        for s in range(0, len(ids), PREFILL):
            chunk = ids[s:s + PREFILL]
            padded = torch.tensor(chunk + [0] * (PREFILL - len(chunk)), device=dev)
            p = torch.arange(pos + s, pos + s + PREFILL, device=dev).clamp(max=self.max_len - 1)
            out = self._call(PREFILL, padded, p, torch.tensor([len(chunk) - 1], device=dev),
                             min(self.max_len, pos + s + PREFILL))
            if self.layer_ids is not None:
                out, f = out
                feats.append(f[:, :len(chunk)])
        return (out[0], torch.cat(feats, 1)) if self.layer_ids is not None else out[0]

    @torch.no_grad()
    def verify(self, block: torch.Tensor, pos: int):
        """A block of verify_width tokens at pos..: logits of every row [B, V] and their features [1, B, F]."""
        B = self.verify_width
        if B is None or block.shape[0] != B:
            raise DFlashError(f"static decoder: built to verify {B} tokens, given {block.shape[0]}")
        self._check_room(pos, B)
        return self._call(B, block, torch.arange(pos, pos + B, device=block.device),
                          torch.arange(B, device=block.device))

    @torch.no_grad()  # as every call after it: grad mode is in dynamo's guards, so a warm-up with it on compiles twice
    def warm(self) -> None:
        """Compile (or load from inductor's cache) every width now. Writes slots from 0 on, which the next
        prompt overwrites."""
        dev = self.embed.device
        for w in self.steps:
            if w not in self.compile_s:
                self._call(w, torch.zeros(w, dtype=torch.long, device=dev), torch.arange(w, device=dev),
                           torch.zeros(1 if w in (1, PREFILL) else w, dtype=torch.long, device=dev), w)

    def _call(self, width: int, ids, pos, keep, span: int | None = None):
        """One step of `width` tokens. A prompt's chunk attends to the slots up to its last position, that length
        compiled symbolic (a 100-token prompt: 150 instead of 199 ms, 512 slots); the decode and verify steps read
        the whole cache, where a symbolic length made the one-token step 12% slower (2-core Zen 5, side by side).
        `span`: the slots a prompt chunk reads (its last position + 1)."""
        slots = self.full_span
        if width == PREFILL:
            slots = torch.arange(span, device=ids.device)
            torch._dynamo.mark_dynamic(slots, 0, min=2, max=self.max_len)
        args = (self.arena, self.embed, self.rope, self.kv, ids, pos, keep, slots)
        if width in self.compile_s:
            return self.steps[width](*args)
        t0 = time.perf_counter()
        out = self.steps[width](*args)  # the first call compiles (inductor's cache makes a later process quick)
        self.compile_s[width] = time.perf_counter() - t0
        return out


def decoder_for(target, state: dict, length: int, proposer=None, log=None) -> StaticDecoder:
    """`state`'s decoder for `target` (with `proposer`'s layers and block when given, so that ar-static and
    chain-static share one set of steps), compiled before it is returned (so no answer's time includes it),
    rebuilt longer when a turn needs more slots than it has: `length` (prompt + new tokens) plus room for the
    last verify, rounded up to 512 (fewer rebuilds, each compiled anew). `log(message)` hears of a compile."""
    length += proposer.block_size if proposer is not None else 0
    d = state.get("static")
    if d is None or d.max_len < length:
        drafting = {} if proposer is None else {"layer_ids": proposer.layer_ids, "verify_width": proposer.block_size}
        d = state["static"] = StaticDecoder(target, max(512, -(-length // 512) * 512), **drafting)
        if log is not None:
            log(f"compiling the static decoder for {d.max_len} positions (about 3 min the first time on 2 cores, "
                "seconds once inductor's cache holds it)")
        d.warm()
        if log is not None:
            log(f"compiled in {sum(d.compile_s.values()):.0f} s")
    return d


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off for one decode loop, and back as it was after (also on an error).
    A loaded target and its tokenizer are ~500k tracked objects: the collections that a step's few allocations
    trigger cost 5-6% of a 12 ms step (SmolLM2, 2-core Zen 5, side by side with gc on, frozen and off), and the
    loop makes no cyclic garbage worth collecting before it ends."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def check_greedy(temperature: float) -> None:
    if temperature != 0:
        raise DFlashError(f"method ar-static decodes greedily; --temperature {temperature} needs method ar")


@torch.no_grad()
def generate_static_ar(decoder: StaticDecoder, prompt_ids: list[int], max_new_tokens: int = 256, stop_ids=None):
    """Greedy plain decoding on a StaticDecoder: the same Generation record as `generate_ar`."""
    from dflashkit.decode.speculative import Generation, _begin, emit

    timer, stops, _ = _begin(decoder.target, stop_ids)
    with timer("prefill"):
        token = int(decoder.forward(prompt_ids, 0).argmax())
    tokens: list[int] = []
    done = emit(tokens, [token], stops, max_new_tokens)
    pos, accepted = len(prompt_ids), []
    with collector_paused():
        while not done:
            with timer("verify"):
                token = int(decoder.forward([token], pos).argmax())
            accepted.append(1)
            pos += 1
            done = emit(tokens, [token], stops, max_new_tokens)
    return Generation("ar-static", tokens, accepted, timer.finish())


@torch.no_grad()
def generate_static_chain(decoder: StaticDecoder, proposer, prompt_ids: list[int], max_new_tokens: int = 256,
                          stop_ids=None):
    """Greedy chain speculative decoding on the decoder's compiled steps: one drafter pass and one verify of B
    tokens a round. The verify's rows are plain decoding's own one-token rows, so the output is ar-static's
    token for token; a rejected draft needs no crop (the next verify overwrites its slots)."""
    from dflashkit.decode.sampling import GREEDY
    from dflashkit.decode.speculative import Generation, _begin, draft_block, emit, greedy_accepted

    if decoder.verify_width != proposer.block_size or decoder.layer_ids != proposer.layer_ids:
        raise DFlashError(f"static decoder built for block {decoder.verify_width}, layers {decoder.layer_ids}; "
                          f"the drafter needs block {proposer.block_size}, layers {proposer.layer_ids}")
    timer, stops, _ = _begin(decoder.target, stop_ids)
    with timer("prefill"):
        logits, feats = decoder.prefill(prompt_ids)
    bonus = logits.argmax()[None]
    tokens: list[int] = []
    done = emit(tokens, bonus.tolist(), stops, max_new_tokens)
    proposer.reset(prompt_ids)
    start, accepted = len(prompt_ids), []
    with collector_paused():
        while not done:
            with timer("draft"):
                drafts, _ = draft_block(proposer, feats, bonus, start, GREEDY, None)
            block = torch.cat([bonus, drafts])
            with timer("verify"):
                logits, feats = decoder.verify(block, start)
            posterior = logits.argmax(-1)
            a = greedy_accepted(block, posterior)
            feats, bonus = feats[:, : a + 1], posterior[a : a + 1]
            accepted.append(a + 1)
            start += a + 1
            done = emit(tokens, block[1 : a + 1].tolist() + bonus.tolist(), stops, max_new_tokens)
    return Generation("chain-static", tokens, accepted, timer.finish())

"""Plain decoding in the shape of gpt-fast (issue 38): a static KV cache sized to the run, the Llama step written out
over the target's own weights, compiled once per width. Nothing here changes process state: the kernels are the
`linear` value a decoder is built with, and every compiled step belongs to its decoder.

Why it is faster than our `ar` on a CPU: HF's modules, a DynamicCache and ~450 small ops a token cost more than the
weights take to read; compiled, the step is a few dozen fused kernels. Why the linears are reductions: at one row,
inductor's fused reduction (each weight read once, in its own dtype, summed in float32) reads bf16 weights faster
than the mm kernel does (27 vs 18 GB/s on a 2-core EPYC, benchmarks/static_decode_probe.py).
"""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F

from dflashkit.errors import DFlashError

WIDTHS = (1, 32)  # one token a step; prompts in chunks of 32
PREFILL = WIDTHS[-1]
# inductor's C++ wrapper calls the step's kernels without Python between them: 12.9 -> 10.8 ms a token (SmolLM2,
# bf16, 2-core Zen 5); passed per compile, so nothing outside this decoder changes
COMPILE_OPTIONS = {"cpp_wrapper": True}
LLAMA_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def linear_mm(x, w):
    """x (float32) @ w.T in the weights' dtype, back to float32."""
    return F.linear(x.to(w.dtype), w).float()


def linear_reduce(x, w):
    """x @ w.T as one reduction per output, summed in float32 (compiled: one fused kernel per weight)."""
    return (w.float() * x.float()[..., None, :]).sum(-1)


LINEARS = {"mm": linear_mm, "reduce": linear_reduce}


def _check_family(target) -> None:
    cfg = target.config
    kind = getattr(cfg, "model_type", "?")
    if kind not in LLAMA_TYPES or getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        raise DFlashError(f"target {target.name} ({kind}): the static decoder runs dense-attention Llama-type targets "
                          f"({', '.join(LLAMA_TYPES)}, no sliding window) so far; use method 'ar' for this one")
    if target.device.type != "cpu" and not torch.cuda.is_available():
        raise DFlashError(f"target {target.name} is on {target.device}: the static decoder runs on cpu or cuda")


class StaticDecoder:
    """One target, one run length: `forward(ids, pos)` (and `prefill`, `verify`) write the KV of positions
    pos..pos+len(ids)-1 and return logits. Rejected positions need no crop: the causal mask hides every slot past
    the query's position and the next write overwrites them."""

    def __init__(self, target, max_len: int, linear: str = "reduce", prefill_linear: str = "mm", compile: bool = True,
                 layer_ids: list[int] | None = None, verify_width: int | None = None):
        _check_family(target)
        if verify_width is not None and not 1 < verify_width < PREFILL:
            raise DFlashError(f"verify width {verify_width}: the static decoder verifies 2..{PREFILL - 1} tokens")
        if verify_width is not None and layer_ids is None:
            raise DFlashError("static decoder: a verify step returns the drafter's features; give layer_ids with it")
        for name in (linear, prefill_linear):
            if name not in LINEARS:
                raise DFlashError(f"linear {name!r}: use one of {', '.join(LINEARS)}")
        cfg, m = target.config, target.decoder
        self.target, self.max_len = target, max_len
        self.nh, self.kvh = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nh
        self.eps = cfg.rms_norm_eps
        self.layers = [self._layer_weights(layer) for layer in m.layers]
        dev = target.device
        # activations and the KV stay in float32 and only the weights are in the target's dtype: a rounding to bf16
        # between two ops is kept or skipped by inductor as it fuses them, which differs from one width to another;
        # with none, a verify's rows are the one-token step's bit for bit. One buffer per layer: an in-place write
        # into a view of one stacked buffer makes inductor copy it whole.
        self.k = [torch.zeros(1, self.kvh, max_len, self.hd, device=dev) for _ in self.layers]
        self.v = [torch.zeros(1, self.kvh, max_len, self.hd, device=dev) for _ in self.layers]
        theta = cfg.rope_parameters["rope_theta"] if getattr(cfg, "rope_parameters", None) else cfg.rope_theta
        inv = 1.0 / (theta ** (torch.arange(0, self.hd, 2, device=dev).float() / self.hd))
        f = torch.outer(torch.arange(max_len, device=dev).float(), inv)
        emb = torch.cat([f, f], -1)
        self.cos, self.sin = emb.cos(), emb.sin()
        self.embed, self.norm, self.head = target.embed_tokens.weight, target.final_norm.weight, target.lm_head.weight
        # per width, its linears and whether it returns features: a prompt's chunks use matrix products (mm reads
        # each weight once for all 32 rows, a reduction 32 times); a verify uses the one-token step's reductions,
        # so that each of its rows is bit for bit what plain decoding computes (tests/test_static_decoder.py)
        self.layer_ids = list(layer_ids) if layer_ids is not None else None
        kinds = {1: (LINEARS[linear], False), PREFILL: (LINEARS[prefill_linear], self.layer_ids is not None)}
        if verify_width is not None:
            kinds[verify_width] = (LINEARS[linear], True)
        self.verify_width = verify_width
        self.steps = {w: functools.partial(self._step, linear=lin, features=f) for w, (lin, f) in kinds.items()}
        if compile:
            self.steps = {w: torch.compile(f, fullgraph=True, dynamic=False, options=COMPILE_OPTIONS)
                          for w, f in self.steps.items()}
        self.compile_s: dict[int, float] = {}

    def _layer_weights(self, layer) -> dict:
        a, p = layer.self_attn, layer.mlp
        bias = [x.bias for x in (a.q_proj, a.k_proj, a.v_proj)]
        return dict(
            n1=layer.input_layernorm.weight, n2=layer.post_attention_layernorm.weight,
            qkv=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).contiguous(),
            qkv_bias=torch.cat(bias) if all(b is not None for b in bias) else None,
            q_norm=getattr(getattr(a, "q_norm", None), "weight", None),
            k_norm=getattr(getattr(a, "k_norm", None), "weight", None),
            o=a.o_proj.weight, gu=torch.cat([p.gate_proj.weight, p.up_proj.weight]).contiguous(), down=p.down_proj.weight)

    def _rms(self, x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w.float()

    def _rope(self, x, cos, sin):
        x1, x2 = x[..., : self.hd // 2], x[..., self.hd // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def _attend(self, q, k, v, mask):
        """Softmax attention written out over the whole static cache (grouped heads, float32), its two products
        as reductions like the linears: a query's output then does not depend on how many share the step, and
        compiled it fuses into a few kernels (SDPA's CPU kernel costs 0.6 ms a layer on a 1024-slot cache)."""
        g, n = self.nh // self.kvh, q.shape[2]
        qg = q.reshape(1, self.kvh, g * n, 1, self.hd)
        s = (qg * k[:, :, None]).sum(-1) * self.hd ** -0.5  # [1, kvh, g*n, L]
        s = s.view(1, self.kvh, g, n, -1).masked_fill(~mask, float("-inf"))
        o = (s.softmax(-1).view(1, self.kvh, g * n, -1, 1) * v[:, :, None]).sum(-2)
        return o.reshape(1, self.nh, n, self.hd)

    def _step(self, ids, pos, keep, linear, features: bool):
        """ids [n], pos [n] absolute positions, keep [k] rows -> their logits [k, V] (and, with `features`, the
        layer_ids' hidden states of all n rows [1, n, len(layer_ids) * H]); writes the n positions' KV."""
        n = ids.shape[0]
        x = F.embedding(ids, self.embed)[None].float()
        cos, sin = self.cos[pos][None, None], self.sin[pos][None, None]
        mask = torch.arange(self.max_len, device=ids.device)[None, :] <= pos[:, None]
        q_size, kv_size = self.nh * self.hd, self.kvh * self.hd
        captured = {}  # the drafter's layers' hidden states, where this width returns features
        for i, w in enumerate(self.layers):
            qkv = linear(self._rms(x, w["n1"]), w["qkv"])
            if w["qkv_bias"] is not None:
                qkv = qkv + w["qkv_bias"].float()
            q, k, v = qkv.split([q_size, kv_size, kv_size], -1)
            q, k = q.view(1, n, self.nh, self.hd), k.view(1, n, self.kvh, self.hd)
            if w["q_norm"] is not None:
                q, k = self._rms(q, w["q_norm"]), self._rms(k, w["k_norm"])
            q = self._rope(q.transpose(1, 2), cos, sin)
            k = self._rope(k.transpose(1, 2), cos, sin)
            self.k[i].index_copy_(2, pos, k)
            self.v[i].index_copy_(2, pos, v.view(1, n, self.kvh, self.hd).transpose(1, 2))
            o = self._attend(q, self.k[i], self.v[i], mask)
            x = x + linear(o.transpose(1, 2).reshape(1, n, q_size), w["o"])
            g, u = linear(self._rms(x, w["n2"]), w["gu"]).chunk(2, -1)
            x = x + linear(F.silu(g) * u, w["down"])
            if features and i in self.layer_ids:
                captured[i] = x
        logits = linear(self._rms(x.index_select(1, keep), self.norm), self.head)[0]
        return (logits, torch.cat([captured[i] for i in self.layer_ids], -1)) if features else logits

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
            return self._call(1, torch.tensor(ids, device=dev), torch.tensor([pos], device=dev),
                              torch.zeros(1, dtype=torch.long, device=dev))[0]
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
            out = self._call(PREFILL, padded, p, torch.tensor([len(chunk) - 1], device=dev))
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

    def warm(self) -> None:
        """Compile (or load from inductor's cache) every width now. Writes slots from 0 on, which the next
        prompt overwrites."""
        dev = self.embed.device
        for w in self.steps:
            if w not in self.compile_s:
                self._call(w, torch.zeros(w, dtype=torch.long, device=dev), torch.arange(w, device=dev),
                           torch.zeros(1 if w in (1, PREFILL) else w, dtype=torch.long, device=dev))

    def _call(self, width: int, ids, pos, keep):
        if width in self.compile_s:
            return self.steps[width](ids, pos, keep)
        t0 = time.perf_counter()
        out = self.steps[width](ids, pos, keep)  # the first call compiles (inductor's cache makes a later process quick)
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

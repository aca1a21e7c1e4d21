"""The DFlash drafter: one non-causal forward drafts a whole block from target-layer features (docs/design.md
section 2). The fused context (`fc` + `hidden_norm`) enters every layer only as extra keys/values; RoPE uses absolute
positions; there is no embedding or lm_head: the caller applies the target's."""

from __future__ import annotations

import functools
import heapq

import torch
import torch.nn.functional as F
from torch import nn

from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.head import scaled
from dflashkit.errors import DFlashError
from dflashkit.tree import Tree


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        y = x.float()
        return self.weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rope_init(cfg: DrafterConfig) -> tuple:
    """(inv_freq, longrope's long inv_freq, attention scale, longrope's original context) as transformers builds them."""
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":  # partial rotary: frequencies over the rotated dims only, as transformers computes them
        dim = rotary_dim(cfg)
        return 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), None, 1.0, None
    if "dynamic" in kind:
        raise DFlashError(f"rope_scaling {scaling}: dynamic RoPE (frequencies recomputed as the sequence grows) is not "
                          "supported by the drafter; use a fixed scaling (linear, yarn, llama3, longrope) or default RoPE")
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if kind not in ROPE_INIT_FUNCTIONS:
        raise DFlashError(f"rope_scaling {scaling}: unknown rope_type {kind!r}; known: default, "
                          f"{', '.join(k for k in ROPE_INIT_FUNCTIONS if 'dynamic' not in k)}")
    hf = Qwen3Config(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads, head_dim=cfg.head_dim,
                     max_position_embeddings=cfg.max_position_embeddings,
                     rope_parameters={"rope_theta": cfg.rope_theta, **scaling, "rope_type": kind,
                                      "partial_rotary_factor": cfg.partial_rotary_factor})
    inv_freq, scale = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
    if kind != "longrope":
        return inv_freq.float(), None, float(scale), None
    original = int(hf.rope_parameters["original_max_position_embeddings"])
    return inv_freq.float(), ROPE_INIT_FUNCTIONS[kind](hf, "cpu", seq_len=original + 1)[0].float(), float(scale), original


def rotary_dim(cfg: DrafterConfig) -> int:
    """The first head dims RoPE rotates (llama.cpp's `rope.dimension_count`); the rest pass through."""
    return int(cfg.head_dim * cfg.partial_rotary_factor)


def apply_rope(x, cos, sin):
    """x [b, h, T, d]; cos/sin [b, T, r]: the first r <= d dims rotate (partial rotary), the rest pass."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.unsqueeze(1) + torch.cat((-x2, x1), dim=-1) * sin.unsqueeze(1)


SLOT0 = ("seed", "mask")  # what slot 0 of a block holds: "seed" (the last accepted token) is every engine's


def block_ids(anchor_ids, block_size: int, mask_id: int, slot0: str = "seed") -> torch.Tensor:
    """[..., B] block inputs, slot 0 the anchor and the rest the mask id (slot0="mask": the engines' bug, for tests)."""
    if slot0 not in SLOT0:
        raise DFlashError(f"slot0={slot0!r} is not one of: {', '.join(SLOT0)}")
    anchor_ids = torch.as_tensor(anchor_ids)
    ids = torch.full((*anchor_ids.shape, block_size), mask_id, dtype=torch.long, device=anchor_ids.device)
    if slot0 == "seed":
        ids[..., 0] = anchor_ids
    return ids


class ContextKV:
    """Post-RoPE context keys/values per layer: each committed position is projected once, and block keys never enter."""

    def __init__(self, num_layers: int):
        self.kv: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        old = self.kv[layer]  # contiguous either way, so that a compiled drafter sees one layout (decode.speculative)
        k, v = (k.contiguous(), v.contiguous()) if old is None else (torch.cat([old[0], k], 2), torch.cat([old[1], v], 2))
        self.kv[layer] = (k, v)
        return k, v

    def get_seq_length(self) -> int:
        return 0 if self.kv[0] is None else self.kv[0][0].shape[2]


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig, layer: int):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.layer, self.n_heads, self.n_kv, self.head_dim = layer, cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=False)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=False)
        self.q_norm, self.k_norm = RMSNorm(d, cfg.rms_norm_eps), RMSNorm(d, cfg.rms_norm_eps)

    def _heads(self, x, n):
        return x.view(*x.shape[:2], n, self.head_dim)

    def forward(self, h, ctx, cos_ctx, sin_ctx, cos_q, sin_q, mask, kv: ContextKV | None, linear=F.linear):
        """h [b, Q, H] block states; ctx [b, T, H] fused context (new positions only when `kv` holds the rest)."""
        q = apply_rope(self.q_norm(self._heads(linear(h, self.q_proj.weight), self.n_heads)).transpose(1, 2), cos_q, sin_q)
        k_blk = apply_rope(self.k_norm(self._heads(linear(h, self.k_proj.weight), self.n_kv)).transpose(1, 2), cos_q, sin_q)
        v_blk = self._heads(linear(h, self.v_proj.weight), self.n_kv).transpose(1, 2)
        k_ctx = apply_rope(self.k_norm(self._heads(linear(ctx, self.k_proj.weight), self.n_kv)).transpose(1, 2),
                           cos_ctx, sin_ctx)
        v_ctx = self._heads(linear(ctx, self.v_proj.weight), self.n_kv).transpose(1, 2)
        if kv is not None:
            k_ctx, v_ctx = kv.append(self.layer, k_ctx, v_ctx)
        k, v = torch.cat([k_ctx, k_blk], dim=2), torch.cat([v_ctx, v_blk], dim=2)
        if self.n_kv != self.n_heads:
            k, v = (x.repeat_interleave(self.n_heads // self.n_kv, dim=1) for x in (k, v))
        return linear(attend(q, k, v, mask).transpose(1, 2).reshape(*h.shape[:2], -1), self.o_proj.weight)


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x, linear=F.linear):
        return linear(F.silu(linear(x, self.gate_proj.weight)) * linear(x, self.up_proj.weight), self.down_proj.weight)


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP; DFlash2 wraps each sublayer in a grouped dynamic causal convolution."""

    def __init__(self, cfg: DrafterConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        if cfg.arch == "dflash2":
            self.attention_conv = GroupedDynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
            self.mlp_conv = GroupedDynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    def forward(self, h, ctx, rope, mask, context_kv, segment: int, linear=F.linear):
        x = self.input_layernorm(h)
        if hasattr(self, "attention_conv"):
            x, kept = self.attention_conv.prepare(x, segment)
            h = h + self.attention_conv.finish(self.self_attn(x, ctx, *rope, mask, context_kv, linear), kept, segment)
            x, kept = self.mlp_conv.prepare(self.post_attention_layernorm(h), segment)
            return h + self.mlp_conv.finish(self.mlp(x, linear), kept, segment)
        h = h + self.self_attn(x, ctx, *rope, mask, context_kv, linear)
        return h + self.mlp(self.post_attention_layernorm(h), linear)


def dynamic_conv(x, delta, base, segment: int, group: int):
    """out[p] = sum_t x[p - t] * (base[t] + delta[p, t]), delta one value per channel group; taps reaching before
    p's block (p mod `segment` < t) read nothing, so packed blocks never mix. x [b, L, H]; delta [b, L, K, H/group]."""
    L = x.shape[1]
    slot = torch.arange(L, device=x.device) % segment
    out = torch.zeros_like(x)
    for t in range(base.shape[0]):
        xs = x if t == 0 else F.pad(x, (0, 0, t, 0))[:, :L] * (slot >= t)[None, :, None].to(x.dtype)
        out = out + base[t].to(x.dtype) * xs
        out = out + delta[:, :, t].repeat_interleave(group, dim=-1) * xs
    return out


class GroupedDynamicConv(nn.Module):
    """DFlash2's convolution pair around a sublayer, both dynamic taps from one projection of its input; identity at init."""

    def __init__(self, hidden: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel_size * (hidden // group_size), bias=False)
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x, segment: int):
        delta = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, -1)
        return dynamic_conv(x, delta[..., 0, :, :], self.base_kernel[0], segment, self.group_size), delta[..., 1, :, :]

    def finish(self, x, delta, segment: int):
        return dynamic_conv(x, delta, self.base_kernel[1], segment, self.group_size)


def mix_greedy(q, sample, mix: float, generator):
    """Per row, keep `sample` with probability `mix`, else q's argmax; returns (picks, q' = mix * q + (1 - mix) *
    onehot(argmax)), the law the picks follow, which accepts at least match's rate (docs/design.md section 4)."""
    if mix >= 1:
        return sample, q
    greedy = q.argmax(-1)
    keep = torch.rand(sample.shape, generator=generator).to(sample.device) < mix
    return torch.where(keep, sample, greedy), (q * mix).scatter_add_(-1, greedy[..., None],
                                                                    torch.full_like(q[..., :1], 1 - mix))


class CandidateSelector(nn.Module):
    """DFlash2's reranker: each position's top-k logits rescored as unary(c) + < pred[prev] * proj(h), succ[c] >, prev
    the token chosen before it; the codebooks are bare parameters, named as in z-lab's checkpoints."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.top_k = cfg.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(cfg.vocab_size, cfg.selector_rank))
        self.successor_codebook = nn.Parameter(torch.empty(cfg.vocab_size, cfg.selector_rank))
        self.hidden_projection = nn.Linear(cfg.hidden_size, cfg.selector_rank, bias=False)
        nn.init.normal_(self.predecessor_codebook, std=0.02)
        nn.init.normal_(self.successor_codebook, std=0.02)

    def scores(self, hidden, prev, candidates, unary):
        """hidden [..., H]; prev [...] token ids; candidates/unary [..., k] -> [..., k] selector scores."""
        context = self.predecessor_codebook[prev] * self.hidden_projection(hidden).to(self.predecessor_codebook.dtype)
        pair = torch.einsum("...r,...kr->...k", context, self.successor_codebook[candidates])
        return unary + pair.to(unary.dtype)

    def select(self, hidden, logits, anchor_ids, temperature: float = 0.0, to_tokens=None, generator=None,
               mix: float = 1.0):
        """hidden [b, L, H]; logits [b, L, V'] unary; anchor_ids [b] -> (path [b, L], candidates [b, L, k] token ids,
        q [b, L, k] or None at T=0): greedy at T=0, else drawn from softmax(scores / T) given the previous pick."""
        unary, index = torch.topk(logits, self.top_k, dim=-1, sorted=False)
        candidates = index if to_tokens is None else to_tokens(index)
        prev, path, qs = anchor_ids, [], []
        for i in range(hidden.shape[1]):
            s = self.scores(hidden[:, i], prev, candidates[:, i], unary[:, i])
            if temperature > 0:
                q = torch.softmax(s.float() / temperature, dim=-1)
                pick, q = mix_greedy(q, torch.multinomial(q, 1, generator=generator)[:, 0], mix, generator)
                qs.append(q)
            else:
                pick = s.argmax(dim=-1)
            prev = candidates[:, i].gather(-1, pick[:, None])[:, 0]
            path.append(prev)
        return torch.stack(path, 1), candidates, (torch.stack(qs, 1) if qs else None)

    @torch.no_grad()
    def tree(self, hidden, logits, anchor: int, budget: int, to_tokens=None) -> Tree:
        """DDTree of the `budget` most probable prefixes, children scored by the selector given their parent's token;
        best-first, so the budget-b tree is the first b pops. hidden [L, H]; logits [L, V']; node tokens index V'."""
        unary, index = torch.topk(logits.float(), min(self.top_k, logits.shape[-1]), dim=-1)  # [L, k]
        cands = index if to_tokens is None else to_tokens(index)

        def children(depth: int, prev: int):
            s = self.scores(hidden[depth], torch.tensor(prev, device=cands.device), cands[depth], unary[depth])
            lp, order = s.float().log_softmax(-1).sort(descending=True)
            return lp.tolist(), index[depth][order].tolist(), cands[depth][order].tolist()

        tokens, ids, depths, parents, lps = [anchor], [anchor], [0], [-1], [0.0]
        kids = {0: children(0, anchor)}
        heap = [(-kids[0][0][0], 0, 0)]  # (-prefix log-prob, parent node, rank among its children)
        while heap and len(tokens) <= budget:
            neg, parent, rank = heapq.heappop(heap)
            lp, idx, tok = kids[parent]
            node = len(tokens)
            tokens.append(idx[rank]), ids.append(tok[rank]), depths.append(depths[parent] + 1)
            parents.append(parent), lps.append(-neg)
            if rank + 1 < len(lp):
                heapq.heappush(heap, (-(lps[parent] + lp[rank + 1]), parent, rank + 1))
            if depths[node] < hidden.shape[0]:
                kids[node] = children(depths[node], ids[node])
                heapq.heappush(heap, (-(lps[node] + kids[node][0][0]), node, 0))
        return Tree.of(tokens, depths, parents, lps)


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config, h = cfg, cfg.hidden_size
        self.fc = nn.Linear(cfg.num_features * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        if cfg.arch == "dflash2":
            self.candidate_selector = CandidateSelector(cfg)
        # yarn / longrope scale cos and sin (rope_scaling_factor), as transformers does
        inv_freq, long_inv_freq, self.rope_scaling_factor, self.rope_original_max = rope_init(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("long_inv_freq", long_inv_freq, persistent=False)  # longrope only
        self.load_report: list[str] = []
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, GroupedDynamicConv):
            m.reset_parameters()

    # ---- z-lab's call surface around the backbone: input scale, logits, DFlash2's proposal --------------------
    def embed_block(self, embed_tokens, ids, dtype=None):
        """Block inputs times input_embedding_scale (the reference scales them before forward(), so it does not)."""
        e = embed_tokens(ids)
        if self.config.input_embedding_scale != 1.0:
            e = e * self.config.input_embedding_scale
        return e if dtype is None else e.to(dtype)

    def scale_logits(self, logits):
        """output_multiplier, then c * tanh(logits / c) with c = final_logit_softcapping, as the reference does."""
        return scaled(logits, self.config.output_multiplier, self.config.final_logit_softcapping)[0]

    def compute_logits(self, hidden, output_head):
        """z-lab's name: the target's output head applied to drafter states, then scaled."""
        return self.scale_logits(output_head(hidden))

    def propose(self, hidden, anchor_ids, output_head, temperature: float = 0.0):
        """z-lab's DFlash2 proposal: (tokens [b, L], candidates [b, L, k], q [b, L, k] or None at T=0)."""
        if self.config.arch != "dflash2":
            raise DFlashError("propose() needs a DFlash2 drafter (a candidate selector); this one is DFlash")
        return self.candidate_selector.select(hidden, self.compute_logits(hidden, output_head), anchor_ids, temperature)

    def new_context_kv(self) -> ContextKV:
        return ContextKV(len(self.layers))

    def _rope(self, positions, seq_len: int | None = None):
        """cos/sin of absolute positions, scaled; longrope's long frequencies past the original context (seq_len)."""
        long = self.long_inv_freq is not None and (seq_len or int(positions.max()) + 1) > self.rope_original_max
        freqs = positions[..., None].float() * (self.long_inv_freq if long else self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        dtype = self.norm.weight.dtype  # (a decoding copy may hold its matrices in blocks: decode/static.py)
        return (emb.cos() * self.rope_scaling_factor).to(dtype), (emb.sin() * self.rope_scaling_factor).to(dtype)

    def _layer_masks(self, mask, q_pos, k_pos) -> list:  # k_pos: a callable, only a restricted layer needs keys
        """Each layer's mask: `mask` narrowed by the layer's causality and window (position_mask)."""
        kinds = [self.config.attention_kind(i) for i in range(len(self.layers))]
        masks = {}
        for causal, window in set(kinds):
            if not causal and window is None:
                masks[causal, window] = mask
            elif isinstance(mask, (ChunkedBlocks, FlexBlocks)):
                masks[causal, window] = mask.restricted(causal, window)
            else:
                near = position_mask(q_pos, k_pos(), causal, window)[:, None]
                masks[causal, window] = near if mask is None else mask & near
        return [masks[k] for k in kinds]

    def run(self, target_hidden, block_embeds, ctx_positions, q_positions, mask=None, context_kv=None, segment=None,
            linear=F.linear):
        """target_hidden [b, T, K*H] (new context only when context_kv holds the rest); block_embeds [b, Q, H]; mask
        [b, 1, Q, T_total + Q] bool or None (all visible); segment: rows per DFlash2 block. -> final-normed [b, Q, H]."""
        ctx = self.hidden_norm(linear(target_hidden, self.fc.weight))
        n = int(q_positions.max()) + 1 if self.long_inv_freq is not None else None  # one frequency set per forward
        rope = (*self._rope(ctx_positions, n), *self._rope(q_positions, n))
        past = context_kv.get_seq_length() if context_kv is not None else 0
        # context positions are contiguous from 0 in every caller that keeps a context KV: prepend the past ones
        prev = lambda: ctx_positions[:, :1] - past + torch.arange(past, device=ctx_positions.device)
        masks = self._layer_masks(mask, q_positions, lambda: torch.cat([prev(), ctx_positions, q_positions], dim=1))
        h = block_embeds
        for layer, layer_mask in zip(self.layers, masks):
            h = layer(h, ctx, rope, layer_mask, context_kv, segment or h.shape[1], linear)
        return self.norm(h)

    def forward(self, target_hidden, noise_embedding, position_ids, past_key_values=None, use_cache=False,
                linear=F.linear):
        """z-lab's call, keywords included: position_ids [b, T + B], the new context's then the block's; a ContextKV."""
        t = target_hidden.shape[1]
        return self.run(target_hidden, noise_embedding, position_ids[:, :t], position_ids[:, t:], None, past_key_values,
                        linear=linear)

    def forward_blocks(self, target_hidden, block_embeds, anchors, valid=None, attention="auto"):
        """Many blocks of one sequence under build_block_mask: target_hidden [b, T, K*H]; block_embeds [b, n*B, H];
        anchors, valid [b, n] -> [b, n*B, H]. attention: dense (the reference), chunked, flex or auto, all equal."""
        b, T, _ = target_hidden.shape
        B, n = self.config.block_size, anchors.shape[1]
        if block_embeds.shape[:2] != (b, n * B):
            raise DFlashError(f"forward_blocks: block_embeds {tuple(block_embeds.shape)} does not hold {n} blocks of "
                              f"{B} rows for a batch of {b} (expected [{b}, {n * B}, H])")
        valid = torch.ones_like(anchors, dtype=torch.bool) if valid is None else valid.bool()
        dev = target_hidden.device
        kind = pick_attention(attention, dev)
        order = None
        if kind == "chunked":  # sort blocks by anchor so that each chunk needs only a short context
            order = anchors.masked_fill(~valid, 0).argsort(dim=1, stable=True)
            anchors, valid = anchors.gather(1, order), valid.gather(1, order)
            block_embeds = block_embeds.gather(1, _rows(order, B)[..., None].expand(-1, -1, block_embeds.shape[-1]))
        q_pos = (anchors[:, :, None] + torch.arange(B, device=dev)).reshape(b, n * B)
        mask = (build_block_mask(anchors, T, B, valid) if kind == "dense"
                else (ChunkedBlocks if kind == "chunked" else FlexBlocks)(anchors, valid, T, B))
        out = self.run(target_hidden, block_embeds, torch.arange(T, device=dev).expand(b, T), q_pos, mask, segment=B)
        if order is not None:  # back to the caller's block order
            out = out.gather(1, _rows(order.argsort(dim=1), B)[..., None].expand(-1, -1, out.shape[-1]))
        return out


def build_block_mask(anchors, ctx_len: int, block_size: int, valid=None) -> torch.Tensor:
    """[b, 1, n*B, T + n*B] bool (True = may attend): context < anchor (strict: the anchor's own state does not
    exist yet at inference), own block bidirectional, nothing across blocks; a padding block's rows see only
    their own slot (a row that sees nothing is NaN in some kernels). The one definition of who sees what."""
    (b, n), dev, B = anchors.shape, anchors.device, block_size
    blk = torch.arange(n, device=dev).repeat_interleave(B)  # block index of each query row
    ctx_ok = torch.arange(ctx_len, device=dev)[None, None, :] < anchors[:, blk][:, :, None]  # [b, nB, T]
    same = (blk[:, None] == blk[None, :]).expand(b, -1, -1)  # [b, nB, nB]
    if valid is not None:
        ok = valid[:, blk][:, :, None]  # [b, nB, 1]
        ctx_ok = ctx_ok & ok
        same = same & (ok | torch.eye(n * B, dtype=torch.bool, device=dev))
    return torch.cat([ctx_ok, same], dim=-1)[:, None]


# ---- block-sparse attention for forward_blocks ------------------------------------------------------------

ATTENTION_KINDS = ("auto", "flex", "chunked", "dense")
CHUNK_BLOCKS = 32  # blocks per chunk: at 512 anchors x 3K tokens ~1/6 of the dense work, ~70 MB of scores a chunk


def pick_attention(name: str, device: torch.device) -> str:
    """auto -> flex on CUDA (torch >= 2.5 has it), chunked elsewhere; checks the name."""
    if name not in ATTENTION_KINDS:
        raise DFlashError(f"attention={name!r} is not one of: {', '.join(ATTENTION_KINDS)}")
    if name == "auto":
        return "flex" if device.type == "cuda" else "chunked"
    return name


def attend(q, k, v, mask):
    """q [b, h, Q, d], k/v [b, h, S, d]; mask: None, bool [b, 1, Q, S] (every row must see a key) or a block plan."""
    if mask is None or isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return mask(q, k, v)


def _rows(order, B: int):
    """[b, n] block order -> [b, n*B] row order (each block's B rows stay together)."""
    return (order[:, :, None] * B + torch.arange(B, device=order.device)).flatten(1)


def position_mask(q_pos, k_pos, causal: bool, window: int | None) -> torch.Tensor:
    """[b, Q, S] bool from absolute positions: causal -> key <= query; window -> query - key < window, and
    key - query < window as well when not causal (dflash 0.1.0's sliding layers)."""
    d = q_pos[:, :, None] - k_pos[:, None, :]
    ok = d >= 0 if causal else torch.ones_like(d, dtype=torch.bool)
    if window is not None:
        ok &= (d < window) & ((-d < window) | causal)
    return ok


class ChunkedBlocks:
    """forward_blocks' attention without the dense mask: CHUNK_BLOCKS blocks at a time, each seeing context up to its
    last anchor and its own rows (sorted anchors save the most; any order is correct). keys k [b, h, T + n*B, d]."""

    def __init__(self, anchors, valid, ctx_len: int, B: int, chunk: int | None = None, causal: bool = False,
                 window: int | None = None):
        chunk = chunk or CHUNK_BLOCKS
        self.T = ctx_len
        self.parts = []  # (first row, last row, L, mask [b, 1, rows, L + rows])
        live = anchors.masked_fill(~valid, 0)
        for s in range(0, anchors.shape[1], chunk):
            a, ok = anchors[:, s:s + chunk], valid[:, s:s + chunk]
            L = min(ctx_len, int(live[:, s:s + chunk].max()) + 1)
            m = build_block_mask(a, L, B, ok)
            if causal or window is not None:  # position_mask over context 0..L-1 + the chunk's blocks
                q_pos = (a[:, :, None] + torch.arange(B, device=a.device)).flatten(1)
                k_pos = torch.cat([torch.arange(L, device=a.device).expand(a.shape[0], -1), q_pos], dim=1)
                m = m & position_mask(q_pos, k_pos, causal, window)[:, None]
            self.parts.append((s * B, (s + a.shape[1]) * B, L, m))
        self.restricted = functools.partial(ChunkedBlocks, anchors, valid, ctx_len, B, chunk)  # (causal, window)

    def __call__(self, q, k, v):
        T, outs = self.T, []
        for r0, r1, L, m in self.parts:
            kc, vc = (torch.cat([x[:, :, :L], x[:, :, T + r0:T + r1]], dim=2) for x in (k, v))
            outs.append(F.scaled_dot_product_attention(q[:, :, r0:r1], kc, vc, attn_mask=m))
        return torch.cat(outs, dim=2)


@functools.cache
def _flex_attention(cuda: bool):
    """torch.compile'd flex_attention on CUDA (the eager one materializes every score); eager elsewhere."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention) if cuda else flex_attention


class FlexBlocks:
    """forward_blocks' attention as FlexAttention: only 128 x 128 tiles holding a visible key (of build_block_mask) run."""

    def __init__(self, anchors, valid, ctx_len: int, B: int, causal: bool = False, window: int | None = None):
        from torch.nn.attention.flex_attention import create_block_mask

        T, (b, n) = ctx_len, anchors.shape
        self.restricted = functools.partial(FlexBlocks, anchors, valid, ctx_len, B)  # (causal, window)

        def mask_mod(bi, h, q, kv):
            blk = q // B
            a, ok = anchors[bi, blk], valid[bi, blk]
            ctx = (kv < T) & (kv < a) & ok
            if window is not None:
                ctx = ctx & (a + q % B - kv < window)
            own = (kv >= T) & ((kv - T) // B == blk) & (ok | (kv - T == q))
            d = q % B - (kv - T) % B  # query slot - key slot inside the block
            if causal:
                own = own & (d >= 0)
            if window is not None:
                own = own & (d < window) & ((-d < window) | causal)
            return ctx | own

        self.mask_mod = mask_mod
        self.block_mask = create_block_mask(mask_mod, b, None, n * B, T + n * B, device=anchors.device)

    def __call__(self, q, k, v):
        if torch.is_grad_enabled() and not q.is_cuda and q.requires_grad:
            raise DFlashError("attention=flex: FlexAttention has no backward on CPU; train with attention=chunked "
                              "(or auto)")
        dtype = torch.get_autocast_dtype(q.device.type) if torch.is_autocast_enabled(q.device.type) else v.dtype
        return _flex_attention(q.is_cuda)(q.to(dtype), k.to(dtype), v.to(dtype), block_mask=self.block_mask)

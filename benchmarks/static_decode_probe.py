"""Feasibility probe for issue 38: how fast can torch decode one token of SmolLM2 on this CPU, gpt-fast style?

A static KV cache, the Llama step written out over stacked weights, compiled once by inductor; tokens/s of plain
greedy decoding against our `ar` on the same target, dtype and threads, and the memory floor. Prints one table.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from dflashkit.decode import static


def linear_reduce(x, w):
    """The static decoder's reduction linear (dflashkit/decode/static.py), rounded back to the probe's dtype."""
    return static.linear_reduce(x, w).to(x.dtype)


class StaticLlama(torch.nn.Module):
    def __init__(self, hf, max_len: int, linear=F.linear):
        super().__init__()
        self.linear = linear
        cfg = hf.config
        m = hf.model
        self.nh, self.kvh, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.embed = m.embed_tokens.weight
        self.head = hf.lm_head.weight
        self.norm = m.norm.weight
        self.layers = []
        for layer in m.layers:
            a, p = layer.self_attn, layer.mlp
            self.layers.append(dict(
                n1=layer.input_layernorm.weight, n2=layer.post_attention_layernorm.weight,
                qkv=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).contiguous(),
                o=a.o_proj.weight, gu=torch.cat([p.gate_proj.weight, p.up_proj.weight]).contiguous(),
                down=p.down_proj.weight))
        dt = self.embed.dtype
        L = len(self.layers)
        # one buffer per layer: an in-place write into a view of one stacked buffer makes inductor copy it whole
        self.k = [torch.zeros(1, self.kvh, max_len, self.hd, dtype=dt) for _ in range(L)]
        self.v = [torch.zeros(1, self.kvh, max_len, self.hd, dtype=dt) for _ in range(L)]
        inv = 1.0 / (cfg.rope_parameters["rope_theta"] ** (torch.arange(0, self.hd, 2).float() / self.hd))
        f = torch.outer(torch.arange(max_len).float(), inv)
        emb = torch.cat([f, f], -1)
        self.cos, self.sin = emb.cos().to(dt), emb.sin().to(dt)
        self.max_len = max_len

    def rms(self, x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * w

    def rope(self, x, cos, sin):
        x1, x2 = x[..., : self.hd // 2], x[..., self.hd // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def attend(self, q, k, v, mask):
        """Softmax attention written out (grouped heads): compiled, it fuses into a few kernels, where SDPA's
        CPU flash kernel costs 0.6 ms a layer on a 1024-slot cache."""
        g = self.nh // self.kvh
        qg = q.reshape(1, self.kvh, g * q.shape[2], self.hd)
        s = (qg.float() @ k.float().transpose(-1, -2)) * self.hd ** -0.5
        s = s.view(1, self.kvh, g, q.shape[2], -1).masked_fill(~mask, float("-inf"))
        o = s.softmax(-1).view(1, self.kvh, g * q.shape[2], -1) @ v.float()
        return o.reshape(1, self.nh, q.shape[2], self.hd).to(q.dtype)

    def forward(self, ids, pos):
        """ids [1, n], pos [n] absolute positions; returns logits [1, n, V] and writes the cache."""
        n = ids.shape[1]
        x = F.embedding(ids, self.embed)
        cos, sin = self.cos[pos][None, None], self.sin[pos][None, None]
        mask = torch.arange(self.max_len)[None, :] <= pos[:, None]
        q_size, kv_size = self.nh * self.hd, self.kvh * self.hd
        for i, w in enumerate(self.layers):
            h = self.rms(x, w["n1"])
            qkv = self.linear(h, w["qkv"])
            q, k, v = qkv.split([q_size, kv_size, kv_size], -1)
            q = self.rope(q.view(1, n, self.nh, self.hd).transpose(1, 2), cos, sin)
            k = self.rope(k.view(1, n, self.kvh, self.hd).transpose(1, 2), cos, sin)
            v = v.view(1, n, self.kvh, self.hd).transpose(1, 2)
            self.k[i].index_copy_(2, pos, k)
            self.v[i].index_copy_(2, pos, v)
            o = self.attend(q, self.k[i], self.v[i], mask)
            x = x + self.linear(o.transpose(1, 2).reshape(1, n, q_size), w["o"])
            h = self.rms(x, w["n2"])
            g, u = self.linear(h, w["gu"]).chunk(2, -1)
            x = x + self.linear(F.silu(g) * u, w["down"])
        return self.linear(self.rms(x, self.norm), self.head)


def decode(step, prompt, n_new, prefill):
    ids = torch.tensor([prompt])
    logits = prefill(ids, torch.arange(len(prompt)))
    tok = int(logits[0, -1].argmax())
    out = [tok]
    t0 = time.perf_counter()
    for i in range(n_new - 1):
        pos = torch.tensor([len(prompt) + i])
        tok = int(step(torch.tensor([[tok]]), pos)[0, -1].argmax())
        out.append(tok)
    return out, (n_new - 1) / (time.perf_counter() - t0)


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--mode", default="default")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--cpp-wrapper", action="store_true")
    ap.add_argument("--freezing", action="store_true")
    ap.add_argument("--linear", choices=["mm", "reduce"], default="mm", help="mm: F.linear; reduce: linear_reduce")
    args = ap.parse_args()
    from dflashkit.decode.speculative import generate
    from dflashkit.targets.model import load_target

    t = load_target("smollm2-135m", device="cpu", dtype=args.dtype)
    prompt = t.chat_ids([{"role": "user", "content": "Write a Python function that checks whether a number is prime."}])
    t0 = time.perf_counter()
    g = generate(t, prompt, "ar", max_new_tokens=args.new)
    ar_tps = len(g.tokens) / (time.perf_counter() - t0)
    eng = StaticLlama(t.model, args.max_len, F.linear if args.linear == "mm" else linear_reduce)
    import torch._inductor.config as ic

    ic.cpp_wrapper = args.cpp_wrapper
    ic.freezing = args.freezing
    step = torch.compile(eng.forward, mode=args.mode, fullgraph=True, dynamic=False)
    c0 = time.perf_counter()
    decode(step, prompt, 3, eng.forward)
    compile_s = time.perf_counter() - c0
    out, tps = decode(step, prompt, args.new, eng.forward)
    eager_out, eager_tps = decode(StaticLlama(t.model, 1024).forward, prompt, min(args.new, 32), eng.forward)
    same = out[: len(g.tokens)] == g.tokens[: len(out)]
    nbytes = sum(p.numel() * p.element_size() for p in t.model.parameters())
    print(f"dtype {args.dtype} threads {torch.get_num_threads()} mode {args.mode} cpp_wrapper {args.cpp_wrapper} "
          f"freezing {args.freezing} linear {args.linear}")
    print(f"ours ar          {ar_tps:7.1f} tok/s")
    print(f"static eager     {eager_tps:7.1f} tok/s")
    print(f"static compiled  {tps:7.1f} tok/s  ({tps / ar_tps:.2f}x ar; compile {compile_s:.0f} s; "
          f"equal to ar: {same}; weights {nbytes / 1e6:.0f} MB)")


if __name__ == "__main__":
    main()

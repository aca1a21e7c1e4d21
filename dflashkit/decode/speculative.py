"""Online speculative decoding against the live target: plain (ar), chain, DDTree, n-gram and hybrid trees, each
written once over a backend, lossless at any temperature (docs/design.md sections 4-5 and "The decoding loops in
detail"). The drafter enters through a small `Proposer` interface, so tests can inject an oracle."""

from __future__ import annotations

from contextlib import contextmanager
from time import perf_counter
from typing import Protocol

import torch

from dflashkit.decode.backends import open_backend, backend_for
from dflashkit.decode.methods import AUTO_BUDGET, needs_drafter, parse_method
from dflashkit.decode.sampling import GREEDY, Sampling
from dflashkit.decode.session import Backend, DecodeSession, Generation, Timer
from dflashkit.decode.static import TREE_WIDTHS
from dflashkit.drafter.head import FEW_ROWS, DraftHead, few_rows_linear
from dflashkit.drafter.model import block_ids, mix_greedy
from dflashkit.errors import DFlashError
from dflashkit.ngram import NgramLookup
from dflashkit.tree import Tree, TreeDrafts, draft_tree, rooted, walk

# ---- the drafter, behind a small interface ----------------------------------------------------------------

class Proposer(Protocol):
    block_size: int  # B: the anchor plus B-1 drafts
    layer_ids: list[int] | None  # target layer features the proposer reads

    def reset(self, prompt_ids: list[int]) -> None: ...

    def propose(self, features: torch.Tensor, anchor: torch.Tensor, start: int) -> torch.Tensor:
        """features [1, n, K*H] of the n newly committed positions start-n..start-1; anchor [1] the bonus token
        at position `start`. Returns float32 logits [B-1, V'] for positions start+1..start+B-1."""

    def to_tokens(self, idx: torch.Tensor) -> torch.Tensor: ...


class DFlashProposer:
    """A DFlash drafter: block [anchor, MASK x (B-1)] through the drafter, logits through its DraftHead. Its context
    KV holds context positions only, so each call passes just the newly committed features."""

    def __init__(self, target, drafter, block_size: int | None = None, selector_trees: bool = False,
                 slot0: str = "seed"):
        self.target, self.drafter = target, drafter
        # DFlash2: DDTree children scored by the candidate selector given their parent, or (default: no gain
        # measured, benchmarks/results/cpu-2026-12-01-selector-trees.md) the marginals as the reference does
        self.selector_trees = selector_trees and drafter.config.arch == "dflash2"
        self.head = DraftHead.for_drafter(target, drafter)
        self.to_tokens = self.head.to_tokens
        self.block_size = int(block_size or drafter.config.block_size)
        self.layer_ids = list(drafter.config.target_layer_ids)
        self.slot0, self.mask_id = slot0, drafter.config.mask_token_id  # slot0: see block_ids (always "seed" in use)
        block_ids(torch.zeros((), dtype=torch.long), self.block_size, self.mask_id, slot0)  # checks the name now
        self.dtype = drafter.fc.weight.dtype
        self.context_kv, self.call, self.fresh, self._compiled = None, drafter, True, {}
        self.head_linear = few_rows_linear  # a backend's own for the head where it has one (static: the blocks)
        self.module, self.linear = drafter, few_rows_linear  # the module a round calls, and its products

    @torch.no_grad()
    def compiled(self, module=None, linear=few_rows_linear):
        """The drafter's call (or `module`'s, a copy of it whose products `linear` computes) compiled for the static
        backend (its ~370 small ops cost more than its products), warmed for the context sizes a round passes; its
        drafts differ from eager ones by rounding, which the verify absorbs."""
        module = module or self.drafter
        if id(module) in self._compiled:
            return self._compiled[id(module)]
        call = self._compiled[id(module)] = torch.compile(module, dynamic=True)
        kv, width, dev = module.new_context_kv(), self.drafter.fc.weight.shape[1], self.drafter.fc.weight.device
        block = torch.zeros(1, self.block_size, self.drafter.config.hidden_size, dtype=self.dtype, device=dev)
        start = 0
        for n in (7, 1, 2, 3, FEW_ROWS + 6):  # first sizes that no later size or stride equals (dynamo guards on it)
            pos = torch.arange(start, start + n + self.block_size, device=dev)[None]  # context, then the block
            (call if start else module)(torch.zeros(1, n, width, dtype=self.dtype, device=dev), block, pos,
                                        past_key_values=kv, linear=linear)
            start += n
        return call

    @contextmanager
    def calling(self, call, head_linear=None, module=None, linear=None):
        """The drafter called through `call` while the context is (a backend's own compiled call), its head through
        `head_linear` where given; `module` and `linear`: a copy of the drafter in another format, and its products."""
        was = self.call, self.head_linear, self.module, self.linear
        self.call, self.head_linear = call, head_linear or self.head_linear
        self.module, self.linear = module or self.drafter, linear or few_rows_linear
        try:
            yield
        finally:
            self.call, self.head_linear, self.module, self.linear = was

    def reset(self, prompt_ids) -> None:
        self.context_kv, self.fresh = self.drafter.new_context_kv(), True

    @torch.no_grad()
    def propose(self, features, anchor, start: int) -> torch.Tensor:
        n = features.shape[1]
        ids = block_ids(anchor[0], self.block_size, self.mask_id, self.slot0)
        block_embeds = self.drafter.embed_block(self.target.embed, ids, self.dtype)[None]  # [1, B, H]
        positions = torch.arange(start - n, start + self.block_size, device=block_embeds.device)[None]  # context, block
        call, self.fresh = self.module if self.fresh else self.call, False  # a prompt's first call: eager, once
        features = features.to(self.dtype).clone(memory_format=torch.contiguous_format)  # one layout: one compile
        h = call(features, block_embeds, positions, past_key_values=self.context_kv, use_cache=True,
                 linear=self.linear)  # decoding's products
        self.hidden, self.anchor = h[:, 1:], anchor  # DFlash2's selector reads them in draft()
        return self.head.logits(h[0, 1:], self.head_linear)  # [B-1, V']

    @torch.no_grad()
    def draft(self, features, anchor, start: int, temperature: float = 0.0, generator=None, mix: float = 1.0):
        """The block's B-1 drafts as the reference proposes them (sample_drafts; DFlash2: its candidate selector's
        path). Returns (tokens [B-1], q [B-1, V] over the target's vocabulary, None at T=0)."""
        logits = self.propose(features, anchor, start)
        if self.drafter.config.arch != "dflash2":
            return sample_drafts(logits, temperature, generator, self.to_tokens, self.target.vocab_size, mix)
        path, q = selector_drafts(self.drafter.candidate_selector, self.hidden, logits[None], self.anchor,
                                  temperature, generator, self.to_tokens, self.target.vocab_size, mix)
        return path[0], None if q is None else q[0]

    def tree(self, logits, budget: int, anchor) -> Tree:
        """The round's DDTree: over the marginals, or (DFlash2) over the selector's conditional scores."""
        if not self.selector_trees:
            return draft_tree(logits, budget, anchor, self.to_tokens)
        t = self.drafter.candidate_selector.tree(self.hidden[0], logits, int(anchor), budget, self.to_tokens)
        return rooted(t, anchor, self.to_tokens, logits.device)


def sample_drafts(logits, temperature: float, generator, to_tokens, vocab_size: int, mix: float = 1.0):
    """Drafts from logits [L, V']: argmax at T=0 (q None), else samples of q = softmax(logits / T) (mix_greedy), with
    q over the full vocabulary [L, vocab_size] (zero outside a draft vocabulary)."""
    if temperature <= 0:
        return to_tokens(logits.argmax(-1)), None
    q = torch.softmax(logits.float() / temperature, dim=-1)
    idx, q = mix_greedy(q, torch.multinomial(q, 1, generator=generator)[:, 0], mix, generator)
    all_ids = to_tokens(torch.arange(q.shape[1], device=q.device))
    return to_tokens(idx), torch.zeros(q.shape[0], vocab_size, device=q.device).index_copy_(1, all_ids, q)


def selector_drafts(selector, hidden, logits, anchor, temperature: float, generator, to_tokens, vocab_size: int,
                    mix: float = 1.0):
    """DFlash2's drafts for b blocks (hidden [b, L, H], logits [b, L, V'], anchor [b]): the candidate selector's
    path [b, L] and its q scattered over the full vocabulary [b, L, vocab_size] (None at T=0)."""
    path, candidates, q = selector.select(hidden, logits, anchor, temperature, to_tokens, generator, mix)
    full = None if q is None else torch.zeros(*q.shape[:2], vocab_size, device=q.device).scatter_(2, candidates, q)
    return path, full


def draft_block(proposer, features, anchor, start: int, sampling: Sampling, generator):
    """(tokens [B-1], q or None). `match` drafts greedily, accepted iff equal to the target's own choice; `rejection`
    samples them from q and accepts with min(1, p/q): any q keeps the output exact."""
    t_q, mix = sampling.q_temperature, sampling.draft_mix
    if hasattr(proposer, "draft"):
        return proposer.draft(features, anchor, start, t_q, generator, mix)
    logits = proposer.propose(features, anchor, start)
    return sample_drafts(logits, t_q, generator, proposer.to_tokens, logits.shape[-1], mix)


def rejection_accept(drafts, q, logits, temperature: float, generator) -> tuple[int, torch.Tensor]:
    """Speculative sampling over a chain (docs/design.md section 4): drafts [L], q [L, V], logits [L+1, V] of the
    verify, or b chains at once ([b, ...] each). Returns (accepted count, next token [1]), or tensors [b] and [b, 1]."""
    batched = drafts.dim() == 2
    if not batched:
        drafts, q, logits = drafts[None], q[None], logits[None]
    p = torch.softmax(logits.float() / temperature, dim=-1)  # [b, L+1, V]
    q = torch.cat([q.to(p.device).float(), torch.zeros_like(p[:, :1])], dim=1)  # no q after the last draft
    b, L = drafts.shape
    pick = lambda t, idx: t.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
    p_d, q_d = pick(p[:, :L], drafts), pick(q[:, :L], drafts)
    u = torch.rand(b, L, generator=generator).to(p.device)
    a = (u * q_d < p_d).long().cumprod(-1).sum(-1)  # [b]
    rows = torch.arange(b, device=p.device)
    p_a, q_a = p[rows, a], q[rows, a]  # at a == L: p after the last draft, q zero
    residual = (p_a - q_a).clamp_min(0)
    total = residual.sum(-1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp_min(1e-30), p_a)
    next_token = torch.multinomial(residual, 1, generator=generator)  # [b, 1]
    return (a, next_token) if batched else (int(a[0]), next_token[0])


# ---- small pieces the loops share ---------------------------------------------------------------------------

def choose(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(-1)
    return torch.multinomial(torch.softmax(logits.float() / temperature, dim=-1), 1, generator=generator)[:, 0]


def emit(out: list[int], new: list[int], stops: set[int], max_new_tokens: int) -> bool:
    """Append tokens one by one as plain decoding would; True once a stop token or max_new_tokens ends it."""
    for t in new:
        out.append(t)
        if t in stops or len(out) >= max_new_tokens:
            return True
    return False


@contextmanager
def _prefilled(b: Backend, prompt_ids: list[int], layer_ids, max_new_tokens: int, sampling: Sampling, generator,
               stop_ids):
    """Every loop starts here: the backend in its session, after the prefill. Yields (timer, features, the first new
    token [1], the new tokens, whether they are done, put(new) -> done)."""
    timer, stops, tokens = Timer(b.target.device), set(b.target.stop_token_ids if stop_ids is None else stop_ids), []
    with b.session(timer):
        with timer("prefill"):
            logits, feats = b.prefill(prompt_ids, layer_ids)
        first = choose(logits, sampling.temperature, generator)  # not yet run
        put = lambda new: emit(tokens, new, stops, max_new_tokens)
        yield timer, feats, first, tokens, put(first.tolist()), put


# ---- the loops, each written once over a backend -----------------------------------------------------------

@torch.no_grad()
def generate_ar(b: Backend, prompt_ids: list[int], max_new_tokens: int = 256, sampling: Sampling = GREEDY,
                generator: torch.Generator | None = None, stop_ids=None) -> Generation:
    """Plain decoding, one target forward per token: the baseline every speedup is measured against."""
    temperature, accepted = sampling.temperature, []
    with _prefilled(b, prompt_ids, None, max_new_tokens, sampling, generator, stop_ids) as (
            timer, _, token, tokens, done, put):
        while not done:
            with timer("verify"):
                logits = b.verify(token)
            b.commit([0])
            token = choose(logits, temperature, generator)
            accepted.append(1)
            done = put(token.tolist())
    return Generation("ar", tokens, accepted, timer.finish(), b.engine, [1] * len(accepted), [False] * len(accepted))


@torch.no_grad()
def generate_chain(b: Backend, proposer: Proposer, prompt_ids: list[int], max_new_tokens: int = 256,
                   sampling: Sampling = GREEDY, generator: torch.Generator | None = None, stop_ids=None) -> Generation:
    """Chain speculative decoding (docs/design.md section 4): one drafter pass and one B-token verify per round."""
    temperature, accepted = sampling.temperature, []
    with _prefilled(b, prompt_ids, proposer.layer_ids, max_new_tokens, sampling, generator, stop_ids) as (
            timer, feats, bonus, tokens, done, put):
        proposer.reset(prompt_ids)
        while not done:
            with timer("draft"):
                drafts, q = draft_block(proposer, feats, bonus, b.start, sampling, generator)
            block = torch.cat([bonus, drafts])  # [B]: the bonus, then B-1 drafts
            with timer("verify"):
                logits = b.verify(block)
            if q is None:
                posterior = choose(logits, temperature, generator)  # [B]: target's token after block[:i+1]
                a = int((block[1:] == posterior[:-1]).cumprod(0).sum())  # drafts equal to the target's choices
                bonus = posterior[a : a + 1]
            else:
                a, bonus = rejection_accept(block[1:], q, logits, temperature, generator)
            feats = b.commit(list(range(a + 1)))
            accepted.append(a + 1)
            done = put(block[1 : a + 1].tolist() + bonus.tolist())
    return Generation("chain", tokens, accepted, timer.finish(), b.engine, [proposer.block_size] * len(accepted),
                      [True] * len(accepted))


@torch.no_grad()
def generate_tree(b: Backend, drafts: TreeDrafts, prompt_ids: list[int], max_new_tokens: int = 256,
                  sampling: Sampling = GREEDY, generator: torch.Generator | None = None, stop_ids=None,
                  method: str = "tree") -> Generation:
    """Tree verification (docs/design.md section 5): a node is accepted iff it is the target's own choice, whatever the
    acceptance rule; a tree wider than the backend verifies is refused, never cut."""
    temperature, accepted, widths, drafted = sampling.temperature, [], [], []
    with _prefilled(b, prompt_ids, drafts.layer_ids, max_new_tokens, sampling, generator, stop_ids) as (
            timer, feats, bonus, tokens, done, put):
        drafts.reset(prompt_ids)
        while not done:
            t_round, t_verify, t_draft = perf_counter(), timer.times["verify"], timer.times["draft"]
            tree = drafts.propose(feats, bonus, b.start, timer)
            drafted.append(drafts.drafted)
            if b.widest is not None and len(tree) > b.widest:
                raise DFlashError(f"method {method}: a tree of {len(tree)} nodes, past the {b.engine} backend's widest "
                                  f"verify ({b.widest} nodes); use a smaller budget or --engine hf")
            with timer("verify"):
                node_logits = b.verify(tree.tokens, tree)
            widths.append(b.verified_tokens(tree))  # what the cost model prices
            choice = choose(node_logits, temperature, generator)  # [n]: the target's token after each node
            path = walk(tree, choice.tolist())
            keep = [0] + path  # root (the bonus) + accepted nodes
            feats = b.commit(keep)
            accepted.append(len(path) + 1)
            new = tree.tokens[path].tolist()
            bonus = choice[keep[-1]:keep[-1] + 1]
            drafts.observe(new)
            done = put(new + bonus.tolist())
            spent = perf_counter() - t_round - (timer.times["verify"] - t_verify) - (timer.times["draft"] - t_draft)
            drafts.round_took(spent)
    return Generation(method, tokens, accepted, timer.finish(), b.engine, widths, drafted)


def _transformers_generate(target, prompt_ids: list[int], max_new_tokens: int, stop_ids, **options):
    """transformers' `generate` with our stop ids and a pad id (the tokenizer's, else the first stop id): its output,
    and the new tokens cut where plain decoding stops."""
    stops = sorted(set(target.stop_token_ids if stop_ids is None else stop_ids))
    pad = target.tokenizer.pad_token_id
    ids = torch.tensor([prompt_ids], device=target.device)
    out = target.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                eos_token_id=stops or None, top_k=None, top_p=None,
                                pad_token_id=pad if pad is not None else (stops[0] if stops else 0), **options)
    tokens: list[int] = []
    emit(tokens, out[0, len(prompt_ids):].tolist(), set(stops), max_new_tokens)
    return out, tokens


def generate_hf(target, prompt_ids: list[int], max_new_tokens: int = 256, temperature: float = 0.0,
                lookup_tokens: int | None = None, stop_ids=None) -> Generation:
    """transformers' own `generate`, greedy or sampled, or its prompt-lookup decoding; timed end to end."""
    timer = Timer(target.device)
    _, tokens = _transformers_generate(target, prompt_ids, max_new_tokens, stop_ids, do_sample=temperature > 0,
                                       temperature=temperature or None, prompt_lookup_num_tokens=lookup_tokens)
    return Generation(f"prompt-lookup-{lookup_tokens}" if lookup_tokens else "hf-generate", tokens, [], timer.finish())


def generate_transformers_dflash(target, proposer, prompt_ids: list[int], max_new_tokens: int = 256,
                                 stop_ids=None) -> Generation:
    """transformers' own DFlash loop, the one an HF user tries first, with our drafter as its drafter class; greedy."""
    from dflashkit.drafter.transformers_format import assistant

    timer, helper = Timer(target.device), assistant(proposer.drafter, target)
    cached = []  # the target cache's length as each of its forwards starts: the prefill, then one per round
    hook = target.model.register_forward_pre_hook(lambda m, a, kw: cached.append(
        kw["past_key_values"].get_seq_length() if kw.get("past_key_values") is not None else 0), with_kwargs=True)
    try:
        out, tokens = _transformers_generate(target, prompt_ids, max_new_tokens, stop_ids, assistant_model=helper,
                                             speculation_type="dflash", do_sample=False, temperature=None)
    finally:
        hook.remove()
    ends = cached[1:] + [out.shape[1] - 1]
    return Generation("transformers-dflash", tokens, [b - a for a, b in zip(ends, ends[1:])], timer.finish())


def new_lookup(method: str):
    """A method's n-gram lookup: one 10-token continuation as transformers' prompt lookup; -auto trees cut two of 16."""
    return NgramLookup(max_tokens=16, branches=2) if parse_method(method)[1] == "auto" else NgramLookup()


def tree_drafts(method: str, proposer: Proposer | None, budget: int = 8, cost=None, ngram=None,
                path_cost=None) -> TreeDrafts:
    """The round proposer of a tree method. `ngram`: a shared NgramLookup (its statistics carry over between prompts);
    `cost` is required for -auto; `path_cost` prices a tree its backend verifies one path a row."""
    kind, n = parse_method(method)
    auto = n == "auto"
    if auto and cost is None:
        raise ValueError(f"method {method!r} needs the target's cost curve (measure.curve.measure_cost_curve)")
    lookup = (ngram or new_lookup(method)) if kind in ("ngram", "hybrid") else None
    drafter = proposer if kind in ("ddtree", "hybrid") else None
    size = AUTO_BUDGET if auto else (n or budget)
    return TreeDrafts(drafter, size if drafter is not None else 0, lookup, cost if auto else None, path_cost=path_cost)


def generate(target, prompt_ids: list[int], method: str = "chain", proposer: Proposer | None = None, budget: int = 8,
             max_new_tokens: int = 256, sampling: Sampling = GREEDY, generator=None, stop_ids=None, cost=None,
             ngram=None, engine: str = "hf", session: DecodeSession | None = None) -> Generation:
    """One entry point for every method name of `parse_method`, on the backend `engine`. `budget` applies to a bare
    'ddtree' or 'hybrid'; `cost` is hf's cost curve for -auto trees (the static backend reads its own step times)."""
    kind, n = parse_method(method)
    session = session or DecodeSession(target, proposer)
    engine = backend_for(session, engine, method)
    if needs_drafter(method) and proposer is None:
        raise ValueError(f"method {method!r} needs a drafter")
    if kind in ("prompt-lookup", "hf-generate"):
        return generate_hf(target, prompt_ids, max_new_tokens, sampling.temperature,
                           (n or 10) if kind == "prompt-lookup" else None, stop_ids)
    if kind == "transformers-dflash":
        return generate_transformers_dflash(target, proposer, prompt_ids, max_new_tokens, stop_ids)
    name = method if n is not None or kind == "ngram" else f"{kind}-{budget}"
    if engine == "static" and kind not in ("ar", "chain") and n != "auto":  # refused before the decoder compiles
        if (most := tree_drafts(method, proposer, budget, None, ngram).most_nodes()) > TREE_WIDTHS[-1]:
            raise DFlashError(f"method {name}: its trees reach {most} nodes, past the static backend's widest verify "
                              f"({TREE_WIDTHS[-1]}); use a smaller budget, its -auto variant or --engine hf")
    backend = open_backend(session, engine, method, len(prompt_ids) + max_new_tokens,
                           proposer if kind != "ar" or engine == "static" else None, cost)
    if kind == "ar":
        return generate_ar(backend, prompt_ids, max_new_tokens, sampling, generator, stop_ids)
    if kind == "chain":
        return generate_chain(backend, proposer, prompt_ids, max_new_tokens, sampling, generator, stop_ids)
    drafts = tree_drafts(method, proposer, budget, backend.cost, ngram, backend.path_cost)
    return generate_tree(backend, drafts, prompt_ids, max_new_tokens, sampling, generator, stop_ids, method=name)

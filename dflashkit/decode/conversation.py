"""Multi-turn decoding as MT-Bench and Spec-Bench run it: each user turn follows the target's own answer before it."""

from __future__ import annotations

from dataclasses import dataclass, field

from dflashkit.decode.session import Generation


@dataclass
class Conversation:
    """One conversation decoded by one method: the Generation of its turns joined, and each turn's own."""

    generation: Generation
    prompts: list[list[int]] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)  # new tokens per turn; they sum to len(generation.tokens)
    answers: list[str] = field(default_factory=list)


def decode_conversation(target, item, run) -> Conversation:
    """`item`: a PromptItem or a single prompt's token ids; `run(prompt_ids)` decodes one turn. Each answer's text
    goes back into the chat for the next turn, as the benchmarks' reference loops do."""
    chat = hasattr(item, "turn")  # else a one-turn conversation
    out = Conversation(Generation("", [], []))
    for k in range(item.num_turns if chat else 1):
        ids = target.chat_ids(item.turn(k, out.answers)) if chat else list(item)
        g = run(ids)
        out.answers.append(target.decode(g.tokens))
        out.prompts.append(ids)
        out.lengths.append(len(g.tokens))
        j = out.generation
        j.method, j.engine, j.tokens, j.accepted = g.method, g.engine, j.tokens + g.tokens, j.accepted + g.accepted
        j.widths, j.drafted = j.widths + g.widths, j.drafted + g.drafted
        j.times = {key: j.times.get(key, 0.0) + v for key, v in g.times.items()}
    return out


def turn_of(lengths: list[int], i: int) -> tuple[int, int]:
    """(turn, offset in that turn's answer) of token i of the joined answers."""
    for k, n in enumerate(lengths):
        if i < n:
            return k, i
        i -= n
    return len(lengths) - 1, i + lengths[-1]

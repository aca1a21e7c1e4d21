"""How a decode samples, as one value handed whole down to the loops, so that no option is parsed and then dropped."""

from __future__ import annotations

from dataclasses import dataclass

from dflashkit.errors import DFlashError

ACCEPTANCE_RULES = ("match", "rejection")


@dataclass(frozen=True)
class Sampling:
    """temperature: 0 = greedy. acceptance: the chain's rule at T>0 (speculative.draft_block). draft_temperature:
    rejection's q temperature (None: T). draft_mix: rejection's share of draft positions sampled from q (mix_greedy).
    seed: prompt i's generator starts at seed + i."""

    temperature: float = 0.0
    acceptance: str = "match"
    draft_temperature: float | None = None
    draft_mix: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise DFlashError(f"temperature {self.temperature} (--temperature): must be 0 (greedy) or positive")
        if self.acceptance not in ACCEPTANCE_RULES:
            raise DFlashError(f"acceptance {self.acceptance!r} (--acceptance): must be one of {', '.join(ACCEPTANCE_RULES)}")
        if self.draft_temperature is not None and not self.draft_temperature >= 0:
            raise DFlashError(f"draft temperature {self.draft_temperature} (--draft-temperature): must be 0 (greedy "
                              "drafts) or positive")
        if not 0 <= self.draft_mix <= 1:
            raise DFlashError(f"draft mix {self.draft_mix} (--draft-mix): must be between 0 (greedy drafts) and 1 "
                              "(drafts sampled from q)")

    @property
    def sampled_drafts(self) -> bool:
        """Rejection at T>0: drafts come from q and are accepted with min(1, p/q); otherwise drafts are greedy."""
        return self.acceptance == "rejection" and self.temperature > 0

    @property
    def q_temperature(self) -> float:
        """The temperature the drafter's q is sampled at: 0 (greedy drafts) unless sampled_drafts."""
        if not self.sampled_drafts:
            return 0.0
        return self.temperature if self.draft_temperature is None else self.draft_temperature

    def record(self) -> dict:
        """What shaped the run, for results files; options that had no effect are None, so alike runs record alike."""
        return {"temperature": self.temperature, "acceptance": self.acceptance if self.temperature > 0 else None,
                "draft_temperature": self.q_temperature if self.sampled_drafts else None,
                "draft_mix": self.draft_mix if self.sampled_drafts else None, "seed": self.seed}

    def describe(self) -> str:
        """One phrase for reports: 'temperature 0.7, rejection acceptance (q at T 0.35, draft mix 0.5)'."""
        if self.temperature == 0:
            return "temperature 0 (greedy)"
        text = f"temperature {self.temperature:g}, {self.acceptance} acceptance"
        if self.sampled_drafts:
            text += f" (q at T {self.q_temperature:g}, draft mix {self.draft_mix:g})"
        return text


GREEDY = Sampling()

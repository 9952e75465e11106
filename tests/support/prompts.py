"""Random prompts for the tiny random model: distinct, so it answers each differently."""

from __future__ import annotations

import random

# Syllables, digits and punctuation: short random prompts the tokenizer splits differently.
WORDS = (*(c + v for c in "bdfgklmnprstvz" for v in "aeiou"), *"0123456789!?,.")


def random_prompts(count: int, seed: int, words: tuple[int, int] = (2, 9)) -> list[str]:
    """``count`` distinct prompts of ``words`` (fewest, most) random words; the same seed
    gives the same prompts."""
    rng = random.Random(seed)
    found: dict[str, None] = {}
    while len(found) < count:
        found[" ".join(rng.choice(WORDS) for _ in range(rng.randint(*words)))] = None
    return list(found)

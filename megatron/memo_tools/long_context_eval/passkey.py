"""Passkey retrieval (Mohtashami and Jaggi, "Landmark Attention", 2023): a random number hidden
at some depth of a long stretch of filler, asked for at the end.

The prompt is the paper's, word for word::

    There is an important info hidden inside a lot of irrelevant text. Find it and memorize
    them. I will quiz you about the important information there.
     The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.
     ... (filler) ... The pass key is 71432. Remember it. 71432 is the pass key. ... (filler)
     What is the pass key? The pass key is

It is assembled from tokens, not text, so that its length is exact: each piece is tokenized on
its own (every piece after the first starts with a space, where a byte-level BPE splits anyway)
and the filler is the filler sentences' tokens repeated and cut to the token. ``depth`` places
the needle after that fraction of the filler: 0 right after the header, 1 right before the
question. The model's greedy continuation is right when its first run of digits is the key.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Optional, Sequence

HEADER = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
          "memorize them. I will quiz you about the important information there.\n")
FILLER = (" The grass is green. The sky is blue. The sun is yellow. Here we go. There and back"
          " again.")
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"
ANSWER = " {key}"

_DIGITS = re.compile(r"\d+")


@dataclass(frozen=True)
class PasskeyCase:
    """One prompt: its length in tokens (the prompt and the generated tokens), the needle's
    depth in the filler, and the key."""

    length: int
    depth: float
    key: str


def draw_keys(count: int, digits: int, rng: random.Random) -> list[str]:
    """``count`` keys of exactly ``digits`` digits (no leading zero), uniformly drawn."""
    return [str(rng.randrange(10 ** (digits - 1), 10 ** digits)) for _ in range(count)]


def passkey_cases(lengths: Sequence[int], depths: Sequence[float], samples: int, digits: int,
                  seed: int) -> list[PasskeyCase]:
    """``samples`` cases for each length and depth, their keys drawn from ``seed`` (the same
    arguments give the same keys: a training corpus can leave them out)."""
    rng = random.Random(seed)
    return [PasskeyCase(length, depth, key) for length in lengths for depth in depths
            for key in draw_keys(samples, digits, rng)]


def parse_answer(text: str) -> Optional[str]:
    """The first run of digits in a continuation, or None."""
    match = _DIGITS.search(text)
    return match.group(0) if match else None


class PasskeyPrompts:
    """Token ids of prompts and answers for one tokenizer (``tokenize(text) -> ids``)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.header = tokenizer.tokenize(HEADER)
        self.filler = tokenizer.tokenize(FILLER)
        self.question = tokenizer.tokenize(QUESTION)

    def needle(self, key: str) -> list[int]:
        return self.tokenizer.tokenize(NEEDLE.format(key=key))

    def answer(self, key: str) -> list[int]:
        """The continuation a model that found the key gives (the key after a space)."""
        return self.tokenizer.tokenize(ANSWER.format(key=key))

    def shortest(self, key: str) -> int:
        """Tokens of a prompt without filler."""
        return len(self.header) + len(self.needle(key)) + len(self.question)

    def prompt(self, tokens: int, depth: float, key: str) -> list[int]:
        """A prompt of exactly ``tokens`` ids with ``key`` at ``depth`` (0..1) of the filler."""
        needle = self.needle(key)
        filler_tokens = tokens - self.shortest(key)
        if filler_tokens < 0:
            raise ValueError(f"a passkey prompt needs at least {self.shortest(key)} tokens "
                             f"without filler; {tokens} asked")
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"passkey depth {depth} is outside [0, 1]")
        repeats = -(-filler_tokens // len(self.filler))
        filler = (self.filler * repeats)[:filler_tokens]
        cut = round(depth * filler_tokens)
        return self.header + filler[:cut] + needle + filler[cut:] + self.question

"""Prompts for the tiny test model (``make_tiny.py``): random token ids inside its vocabulary, so that greedy
output is varied (a wrong KV load changes the tokens). Tests import ``tests.e2e.tiny_prompts``."""

from __future__ import annotations

import random

__all__ = ["tiny_prompt", "tiny_tokens"]


def tiny_tokens(rng: random.Random, tokens: int) -> list[int]:
    """The next ``tokens`` token ids drawn from ``rng`` (prompts that share a stream of draws)."""
    return [rng.randrange(3, 350) for _ in range(tokens)]


def tiny_prompt(seed: int, tokens: int) -> list[int]:
    """``tokens`` token ids drawn from ``random.Random(seed)``."""
    return tiny_tokens(random.Random(seed), tokens)

"""The task interface (generator + exact verifier + fixed held-out split) and the prompt format.

A task produces plain-text `Example`s: `prompt` is what a user sends as the single user message,
`answer` is one reference completion (without EOS). The shipped cover-tiny model is trained on the
chat-templated prompt (`chat_prompt_ids`), and `check` accepts ANY valid completion, not only the
reference one. This module is not the eval harness and knows nothing about models.
"""

from __future__ import annotations

import random
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from cover_vllm.tokenizer import apply_chat_template

EOS_TEXT = "<|endoftext|>"


@dataclass(frozen=True)
class Example:
    """One problem: the user's prompt text and a reference answer text (EOS not included)."""

    prompt: str
    answer: str


class Task(ABC):
    """A synthetic task: `sample(rng)` draws a problem, `check(prompt, output)` verifies exactly."""

    name: str = ""
    max_tokens: int = 32      # generation slots: answer + EOS + EOS padding (LLaDA SFT layout)
    block_length: int = 32    # semi-autoregressive block length used for this task's evals

    @abstractmethod
    def sample(self, rng: random.Random) -> Example:
        """Draw one problem (and a reference answer) using only `rng`."""

    @abstractmethod
    def check(self, prompt: str, output_text: str) -> bool:
        """True iff `output_text` (the decoded generation) correctly solves `prompt`."""

    def eval_split(self, n: int = 300) -> list[Example]:
        """The fixed held-out split: the first `n` problems of a stream seeded by the task name.

        Training must skip these prompts (see `eval_prompts`); the same `n` always gives the same
        list, and a larger `n` extends a smaller one.
        """
        if n < 0:
            raise ValueError(f"eval_split(n={n}): n must be >= 0")
        rng = random.Random(zlib.crc32(f"cover-tiny-eval/{self.name}".encode()))
        return [self.sample(rng) for _ in range(n)]

    def eval_prompts(self, n: int = 1000) -> frozenset[str]:
        """Prompts of the first `n` held-out problems (a training sampler rejects these)."""
        return frozenset(ex.prompt for ex in self.eval_split(n))


def clean_output(output_text: str) -> str:
    """The generation up to its first EOS text (if special tokens were not skipped), stripped."""
    return output_text.split(EOS_TEXT, 1)[0].strip()


def chat_prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of `prompt` in the format cover-tiny was trained on: one user turn, then the
    assistant header (`<|user|>{prompt}<|assistant|>`), via the tokenizer's chat template."""
    return apply_chat_template(tokenizer, [{"role": "user", "content": prompt}])

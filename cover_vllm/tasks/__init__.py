"""Synthetic tasks with exact verifiers (cover-tiny's training data and `cover-vllm eval`).

`get_task(name)` returns a task instance; `list_tasks()` the valid names. Each task has
`sample(rng)`, `check(prompt, output_text)`, `eval_split(n)`, `max_tokens` and `block_length`.
"""

from __future__ import annotations

from typing import Callable

from cover_vllm.tasks.arith import ArithSteps
from cover_vllm.tasks.base import EOS_TEXT, Example, Task, chat_prompt_ids, clean_output
from cover_vllm.tasks.sudoku import Sudoku4
from cover_vllm.tasks.word import WordProblems

TASKS: dict[str, Callable[[], Task]] = {
    Sudoku4.name: Sudoku4,
    ArithSteps.name: ArithSteps,
    WordProblems.name: WordProblems,
}


def list_tasks() -> list[str]:
    return sorted(TASKS)


def get_task(name: str) -> Task:
    """A fresh instance of the task called `name`; ValueError lists the valid names."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks: {list_tasks()}")
    return TASKS[name]()


__all__ = ["EOS_TEXT", "Example", "Task", "ArithSteps", "Sudoku4", "WordProblems",
           "chat_prompt_ids", "clean_output", "get_task", "list_tasks"]

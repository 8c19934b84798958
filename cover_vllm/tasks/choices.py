"""Multiple-choice problems from cover-tiny's held-out `arith` split, for likelihood scoring: the
worked answer against corrupted ones (final sum +-1 and +-10, one line's column sum changed).

Each candidate is the whole answer followed by one `<|endoftext|>`, after the chat-formatted
prompt, so it scores like an lm-eval multiple-choice request (context, continuation) with an
empty target delimiter. Written out as JSON lines, the problems make a local lm-eval task
(`write_lm_eval_tasks`).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from cover_vllm.tasks.arith import ArithSteps
from cover_vllm.tasks.base import EOS_TEXT


@dataclass(frozen=True)
class ChoiceProblem:
    prompt: str                 # the user's text, e.g. "384+250="
    context: str                # the chat-formatted prompt ("<|user|>...<|assistant|>")
    choices: list[str]          # candidate answers, each ending with one EOS text
    label: int                  # index of the correct one
    answer: str                 # the reference worked answer (no EOS)
    total: str                  # the sum's digits


def _corrupt(answer: str, rng: random.Random) -> list[str]:
    lines = answer.split("\n")
    total = int(lines[-1][1:])
    wrong = [answer.rsplit("=", 1)[0] + f"={total + d}" for d in (1, -1, 10, -10)]
    i = rng.randrange(len(lines) - 1)
    head, column = lines[i][:-2], lines[i][-2:]
    changed = f"{column[0]}{(int(column[1]) + 1 + rng.randrange(9)) % 10}"
    wrong.append("\n".join(lines[:i] + [head + changed] + lines[i + 1:]))
    return wrong


def arith_choices(n: int, chat_template) -> list[ChoiceProblem]:
    """The first n held-out arith problems as 6-way choices (the correct answer at a random
    index). `chat_template(user_text) -> context text`."""
    rng = random.Random(34)
    problems = []
    for ex in ArithSteps().eval_split(n):
        choices = [ex.answer + EOS_TEXT] + [w + EOS_TEXT for w in _corrupt(ex.answer, rng)]
        order = list(range(len(choices)))
        rng.shuffle(order)
        problems.append(ChoiceProblem(ex.prompt, chat_template(ex.prompt),
                                      [choices[k] for k in order], order.index(0), ex.answer,
                                      ex.answer.rsplit("=", 1)[1]))
    return problems


def chat_context(tokenizer):
    """`chat_template` for arith_choices: the tokenizer's template, one user turn."""
    def apply(prompt: str) -> str:
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                             tokenize=False, add_generation_prompt=True)
    return apply


TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {output_type}
doc_to_text: "{{{{context}}}}"
target_delimiter: ""
{extra}"""

MC_EXTRA = """doc_to_choice: "{{choices}}"
doc_to_target: label
metric_list:
  - metric: acc
"""

GEN_EXTRA = """doc_to_target: "{{total}}"
generation_kwargs:
  until: ["<|endoftext|>"]
  max_gen_toks: 32
filter_list:
  - name: sum
    filter:
      - function: regex
        regex_pattern: "=(\\\\d+)\\\\s*$"
      - function: take_first
metric_list:
  - metric: exact_match
"""


def write_lm_eval_tasks(problems: list[ChoiceProblem], folder: str | Path) -> Path:
    """A local lm-eval task folder: `cover_arith_mc` (multiple choice, acc) and
    `cover_arith_gen` (generate_until, exact match of the sum) over `problems`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "arith_choices.jsonl"
    data.write_text("".join(json.dumps(asdict(p)) + "\n" for p in problems))
    for name, kind, extra in (("cover_arith_mc", "multiple_choice", MC_EXTRA),
                              ("cover_arith_gen", "generate_until", GEN_EXTRA)):
        (folder / f"{name}.yaml").write_text(TASK_YAML.format(
            name=name, data=data, output_type=kind, extra=extra))
    return folder

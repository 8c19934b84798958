"""`cover-vllm bench structured`: what a structured-output constraint costs and how much parallel
decoding survives it, per decoding x constraint ("none": the same requests unconstrained).

`--task arith` runs cover-tiny's worked additions instead (chat prompts from the task's
held-out split) with the constraint `worked`, a regex of the answer's layout, which the model's
own answers already match: what a constraint costs when it agrees with the model, and the
task's accuracy next to validity.

Per row: the share of outputs that validate, forwards per request (NFE), generation slots
decoded per step (`tokens_per_step`, EOS padding included, as RequestMetrics counts it), mean
step time, and the constraint's own time per step (RequestMetrics.constraint_s summed over the
requests, over the engine's steps) with its share of the step. All requests of a row run as one
batch, after the same batch once untimed and a garbage collection (without them the first
constrained row in a process measured up to 6x its steady constraint time).
"""

from __future__ import annotations

import gc
import json
import re
import statistics
from dataclasses import dataclass

from cover_vllm.engine.observer import PHASES, StepTimes
from cover_vllm.llm import LLM
from cover_vllm.sampling_params import SamplingParams, StructuredOutputsParams

PROMPTS = ["347+158=", "What is 12+7?", "Q: 5+8=", "hello", "212+399=", "Name a color.",
           "Sort: c a b", "x", "Answer in JSON.", "How many legs has a cat?"]
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}},
                 "required": ["answer"]}
REGEX = r"[0-9]{1,3}(\.[0-9]+)?"
CHOICES = ["yes", "no", "maybe"]
WORKED = r"([0-9]\+[0-9]\+[0-9]=[0-9]{2}\n){3}=[0-9]{3}"    # arith's 3-digit worked answer
CONSTRAINTS = {"none": None, "json": dict(json=ANSWER_SCHEMA),
               "json_compact": dict(json=ANSWER_SCHEMA, disable_any_whitespace=True),
               "regex": dict(regex=REGEX), "choice": dict(choice=CHOICES),
               "worked": dict(regex=WORKED)}


def valid(constraint: str, text: str) -> bool:
    """Whether `text` satisfies the named constraint ("none": always)."""
    if constraint.startswith("json"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return False
        return isinstance(value, dict) and type(value.get("answer")) is int
    if constraint == "regex":
        return re.fullmatch(REGEX, text) is not None
    if constraint == "worked":
        return re.fullmatch(WORKED, text) is not None
    if constraint == "choice":
        return text in CHOICES
    return True


@dataclass(frozen=True)
class StructuredSpec:
    model: str = "cover-tiny"
    decodings: tuple[str, ...] = ("cover", "threshold", "low_confidence")
    constraints: tuple[str, ...] = tuple(CONSTRAINTS)
    num_prompts: int = 10
    max_tokens: int = 32
    seed: int = 0
    threads: int | None = None
    task: str | None = None          # "arith": the task's prompts, accuracy reported

    def __post_init__(self) -> None:
        bad = [c for c in self.constraints if c not in CONSTRAINTS]
        if bad:
            raise ValueError(f"--constraint {bad}: choose from {list(CONSTRAINTS)}")


def run_structured(spec: StructuredSpec) -> list[dict]:
    llm = LLM(spec.model, seed=spec.seed, num_threads=spec.threads)
    prompts, check = _prompts(spec, llm)
    rows = []
    for decoding in spec.decodings:
        for name in spec.constraints:
            kind = CONSTRAINTS[name]
            params = SamplingParams(max_tokens=spec.max_tokens, decoding=decoding,
                                    structured_outputs=None if kind is None
                                    else StructuredOutputsParams(**kind))
            llm.generate(prompts, params, use_tqdm=False)      # warm-up: the same batch once
            gc.collect()            # no collection of the warm-up's garbage inside a timed step
            times = StepTimes()
            llm.engine.add_observer(times)
            try:
                outs = llm.generate(prompts, params, use_tqdm=False)
            finally:
                llm.engine.remove_observer(times)
            step_s = sum(sum(t[p] for p in PHASES) for t in times.rows)
            constraint_s = sum(o.metrics.constraint_s for o in outs)
            rows.append({
                "decoding": decoding, "constraint": name,
                "valid": statistics.mean(valid(name, o.outputs[0].text) for o in outs),
                "accuracy": None if check is None else statistics.mean(
                    check(i, o.outputs[0].text) for i, o in enumerate(outs)),
                "nfe": statistics.mean(o.metrics.nfe for o in outs),
                "tokens_per_step": statistics.mean(o.metrics.tokens_per_step for o in outs),
                "step_ms": 1e3 * step_s / len(times.rows),
                "constraint_ms_per_step": 1e3 * constraint_s / len(times.rows),
                "constraint_share": constraint_s / step_s if step_s else 0.0,
                "example": outs[0].outputs[0].text})
    llm.shutdown()
    return rows


def _prompts(spec: StructuredSpec, llm: LLM) -> tuple[list, object]:
    """The requests' prompts, and a checker of output i (None without a task)."""
    if spec.task is None:
        return [PROMPTS[i % len(PROMPTS)] for i in range(spec.num_prompts)], None
    from cover_vllm.tasks import chat_prompt_ids, get_task

    task = get_task(spec.task)
    examples = task.eval_split(spec.num_prompts)
    prompts = [{"prompt_token_ids": chat_prompt_ids(llm.tokenizer, ex.prompt)}
               for ex in examples]
    return prompts, lambda i, text: float(task.check(examples[i].prompt, text))


def format_structured(rows: list[dict]) -> str:
    head = ("| decoding | constraint | valid | accuracy | NFE/request | tokens/step | step ms | "
            "constraint ms/step | constraint share | example |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        accuracy = "-" if r["accuracy"] is None else f"{r['accuracy']:.0%}"
        lines.append(f"| {r['decoding']} | {r['constraint']} | {r['valid']:.0%} | {accuracy} | "
                     f"{r['nfe']:.1f} | {r['tokens_per_step']:.2f} | {r['step_ms']:.2f} | "
                     f"{r['constraint_ms_per_step']:.3f} | {r['constraint_share']:.1%} | "
                     f"`{r['example'][:40]!r}` |")
    return "\n".join(lines)

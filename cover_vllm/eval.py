"""`cover-vllm eval`: accuracy and cost of decoding strategies on the verifiable synthetic tasks.

Every strategy runs on the same prompts in one process; each row reports the task verifier's
accuracy and per-request means of the engine's counters. Fixed-schedule strategies (e.g.
`low_confidence`) run once per `--tokens-per-step` value (steps = max_tokens / k); adaptive ones
(threshold, cover, ...) once. Every row runs once per cache mode (`--kv-cache`) and, for the
approximate modes, once per refresh policy (`--cache-refresh`); `flops_per_token` is model FLOPs
per generated token (cover_vllm/flops.py), so a refresh's cost is visible beside NFE.

`--baseline` pairs each row with the same row of an earlier run on the same problems (a model
in fp32 against its quantized form, one decoder against another's JSON) problem by problem: the
problems it lost and gained, and the exact two-sided sign test of those discordant pairs
(McNemar's exact test), so a difference of a point or two can be told from the problems a
small change of the logits flips both ways.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass

from cover_vllm.llm import LLM
from cover_vllm.flops import flops_per_token
from cover_vllm.sampling_params import SamplingParams
from cover_vllm.strategies import strategy_class
from cover_vllm.tasks import Example, Task, chat_prompt_ids, get_task


@dataclass
class EvalRow:
    task: str
    decoding: str
    k: int | None               # fixed tokens per step (fixed-schedule strategies), else None
    kv_cache: str
    cache_refresh: str          # refresh policy ("-" for kv_cache="none": every step is one)
    num: int
    seed: int | None            # the problems: None the held-out split, else fresh draws
    accuracy: float
    nfe: float                  # per-request means from here on
    nfe_per_token: float        # NFE / decoded generation slots
    tokens_per_step: float
    tokens_per_s: float         # output tokens (up to EOS) / wall time of the whole run
    remasks: float
    flip_flops: float
    replaces: float
    keeps: float
    refreshes: float            # full-canvas forwards per request
    flops_per_token: float      # model FLOPs / generated tokens (cover_vllm/flops.py)
    seconds: float
    solved: str = ""            # "1"/"0" per problem, in order (what --baseline pairs)


@dataclass(frozen=True)
class EvalSpec:
    model: str
    tasks: tuple[str, ...]
    decodings: tuple[str, ...]
    num: int = 200
    seed: int | None = None            # None: the task's fixed held-out split
    tokens_per_step: tuple[int, ...] = (1,)
    kv_cache: str | tuple[str, ...] = "none"       # one mode or several (one row each)
    cache_refresh: tuple[str, ...] = ("block",)    # policies for the prefix/dual rows
    decoding_params: tuple = ()        # ((name, {params}), ...)
    use_tqdm: bool = True
    threads: int | None = None         # torch intra-op threads (None: the engine's default)
    dtype: str = "auto"                # EngineConfig.dtype
    quantization: str | None = None    # EngineConfig.quantization
    batch_invariant: bool = False      # EngineConfig.batch_invariant
    device: str = "cpu"                # EngineConfig.device


@dataclass(frozen=True)
class CacheChoice:
    """The cache mode and refresh policy of one eval row (None: the LLM's defaults)."""

    kv_cache: str | None = None
    cache_refresh: str | None = None


def cache_choices(spec: EvalSpec) -> list[CacheChoice]:
    """One choice per kv_cache mode; the approximate modes once per refresh policy."""
    modes = (spec.kv_cache,) if isinstance(spec.kv_cache, str) else tuple(spec.kv_cache)
    return [CacheChoice(kv, None if kv == "none" else policy) for kv in modes
            for policy in (("block",) if kv == "none" else spec.cache_refresh)]


def problems(task: Task, num: int, seed: int | None) -> list[Example]:
    """The held-out split, or `num` fresh draws from `seed`."""
    if seed is None:
        return task.eval_split(num)
    rng = random.Random(seed)
    return [task.sample(rng) for _ in range(num)]


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def evaluate_one(llm: LLM, task: Task, examples: list[Example], decoding: str, k: int | None,
                 params: dict | None, use_tqdm: bool, *, cache: CacheChoice | None = None,
                 seed: int | None = None) -> tuple[EvalRow, list]:
    """One row: `examples` (drawn from `seed`, None: the held-out split) decoded and checked."""
    prompts = [{"prompt_token_ids": chat_prompt_ids(llm.tokenizer, ex.prompt)} for ex in examples]
    steps = None if k is None else max(1, task.max_tokens // k)
    cache = cache or CacheChoice()
    sp = SamplingParams(max_tokens=task.max_tokens, block_length=task.block_length, steps=steps,
                        decoding=decoding, decoding_params=params, kv_cache=cache.kv_cache,
                        cache_refresh=cache.cache_refresh)
    kv = cache.kv_cache or llm.engine.config.kv_cache
    policy = "-" if kv == "none" else (cache.cache_refresh or llm.engine.refresh_policy.label)
    start = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=use_tqdm)
    seconds = time.perf_counter() - start
    correct = [task.check(ex.prompt, o.outputs[0].text) for ex, o in zip(examples, outs)]
    ms = [o.metrics for o in outs]
    row = EvalRow(
        task=task.name, decoding=decoding, k=k, kv_cache=kv, cache_refresh=policy,
        num=len(examples), seed=seed, accuracy=_mean(correct),
        nfe=_mean(m.nfe for m in ms),
        nfe_per_token=_mean(m.nfe / max(m.decoded_tokens, 1) for m in ms),
        tokens_per_step=_mean(m.tokens_per_step for m in ms),
        tokens_per_s=sum(len(o.outputs[0].token_ids) for o in outs) / seconds,
        remasks=_mean(m.remasks for m in ms), flip_flops=_mean(m.flip_flops for m in ms),
        replaces=_mean(m.replaces for m in ms), keeps=_mean(m.keeps for m in ms),
        refreshes=_mean(m.refreshes for m in ms), flops_per_token=flops_per_token(ms),
        seconds=seconds, solved="".join("1" if ok else "0" for ok in correct))
    return row, outs


def run_eval(spec: EvalSpec, on_row=None) -> list[EvalRow]:
    """Every (task, decoding, k) row; `on_row(row)` is called as each one finishes."""
    params = dict(spec.decoding_params)
    for name in spec.decodings:
        strategy_class(name)                       # unknown names fail before any work
    tasks = [get_task(name) for name in spec.tasks]
    choices = cache_choices(spec)
    llm = LLM(spec.model, decoding=spec.decodings[0], kv_cache=choices[0].kv_cache,
              num_threads=spec.threads, dtype=spec.dtype, quantization=spec.quantization,
              batch_invariant=spec.batch_invariant, device=spec.device)
    if llm.tokenizer is None:
        raise ValueError(f"model {spec.model!r} has no tokenizer; eval needs text prompts")
    rows = []
    for task in tasks:
        examples = problems(task, spec.num, spec.seed)
        evaluate_one(llm, task, examples[:2], spec.decodings[0], None, None, False)  # warm-up
        for decoding in spec.decodings:
            fixed = strategy_class(decoding).fixed_schedule
            for k in (spec.tokens_per_step if fixed else (None,)):
                for cache in choices:
                    llm.reset_prefix_cache()   # a row reuses no prompt block of another row
                    row, _ = evaluate_one(llm, task, examples, decoding, k, params.get(decoding),
                                          spec.use_tqdm, cache=cache, seed=spec.seed)
                    rows.append(row)
                    if on_row is not None:
                        on_row(row)
    return rows


COLUMNS = [("task", "{}"), ("decoding", "{}"), ("k", "{}"), ("kv_cache", "{}"),
           ("cache_refresh", "{}"), ("num", "{}"),
           ("accuracy", "{:.1%}"), ("nfe", "{:.1f}"), ("nfe_per_token", "{:.3f}"),
           ("tokens_per_step", "{:.2f}"), ("tokens_per_s", "{:.0f}"), ("remasks", "{:.2f}"),
           ("flip_flops", "{:.2f}"), ("replaces", "{:.2f}"), ("keeps", "{:.2f}"),
           ("refreshes", "{:.2f}"), ("flops_per_token", "{:.4g}")]


def format_table(rows: list[EvalRow]) -> str:
    """A markdown table, one line per (task, decoding, k)."""
    head = "| " + " | ".join(name for name, _ in COLUMNS) + " |"
    lines = [head, "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = [fmt.format(getattr(row, name)) if getattr(row, name) is not None else "-"
                 for name, fmt in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_json(rows: list[EvalRow], path: str) -> None:
    with open(path, "w") as f:
        json.dump([asdict(r) for r in rows], f, indent=2)


def row_key(row: dict) -> tuple:
    """What pairs two runs' rows: the task, decoder, k and cache choice."""
    return tuple(row[name] for name in ("task", "decoding", "k", "kv_cache", "cache_refresh"))


def load_baseline(path: str) -> dict[tuple, dict]:
    """`cover-vllm eval --json` rows by row_key; each must carry its problems' `solved`."""
    with open(path) as f:
        rows = json.load(f)
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"--baseline {path}: expected the list of rows `cover-vllm eval --json` "
                         "writes")
    for r in rows:
        missing = [k for k in ("task", "decoding", "k", "kv_cache", "cache_refresh", "num",
                               "seed", "solved") if k not in r]
        if missing or len(r["solved"]) != r["num"]:
            raise ValueError(f"--baseline {path}: a row lacks {missing or ['solved']} per problem "
                             "(a JSON written before 2026-11-26? rerun that eval with --json)")
    return {row_key(r): r for r in rows}


def lost_gained(baseline: str, run: str) -> tuple[int, int]:
    """Two runs' `solved` on the same problems -> (problems the baseline solved and the run did
    not, the other way round)."""
    pairs = list(zip(baseline, run, strict=True))
    return pairs.count(("1", "0")), pairs.count(("0", "1"))


def sign_test(lost: int, gained: int) -> float:
    """Exact two-sided p of `lost` vs `gained` discordant pairs under no difference (each
    flip equally likely either way): McNemar's exact test, the binomial(n, 1/2) tail."""
    n = lost + gained
    tail = sum(math.comb(n, i) for i in range(min(lost, gained) + 1))
    return min(1.0, 2 * tail / 2 ** n) if n else 1.0


@dataclass
class PairedRow:
    """One row against the baseline's row of the same key, on the same problems."""

    key: tuple
    baseline: float             # accuracies
    accuracy: float
    lost: int                   # problems the baseline solved and this run did not
    gained: int
    p_value: float              # sign_test(lost, gained)


def check_same_problems(base: dict, num: int, seed: int | None) -> None:
    """ValueError naming the row unless `base` ran `num` problems drawn from `seed`."""
    if (base["num"], base["seed"]) != (num, seed):
        raise ValueError(f"--baseline row {row_key(base)} ran num={base['num']}, "
                         f"seed={base['seed']}; this run num={num}, seed={seed}: pass the "
                         "same --num and --seed")


def compare(rows: list[EvalRow], baseline: dict[tuple, dict]) -> list[PairedRow]:
    """Each row that has a baseline row, problem by problem (the same problems: num and seed,
    else ValueError)."""
    paired = []
    for row in map(asdict, rows):
        base = baseline.get(row_key(row))
        if base is None:
            continue
        check_same_problems(base, row["num"], row["seed"])
        lost, gained = lost_gained(base["solved"], row["solved"])
        paired.append(PairedRow(row_key(row), base["accuracy"], row["accuracy"], lost, gained,
                                sign_test(lost, gained)))
    return paired


def format_paired(paired: list[PairedRow]) -> str:
    """A markdown table: baseline and this run's accuracy, the difference, the problems lost
    and gained, and the sign test's p."""
    lines = ["| task | decoding | k | kv_cache | cache_refresh | baseline | accuracy | delta | "
             "lost | gained | p |", "|" + "---|" * 11]
    for r in paired:
        key = ["-" if v is None else str(v) for v in r.key]
        lines.append("| " + " | ".join(key + [
            f"{r.baseline:.1%}", f"{r.accuracy:.1%}", f"{100 * (r.accuracy - r.baseline):+.1f}",
            str(r.lost), str(r.gained), f"{r.p_value:.3g}"]) + " |")
    return "\n".join(lines)

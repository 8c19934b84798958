"""`cover-vllm bench loglikelihood`: likelihood scoring through the engine against the official
research loop (one `model(batch)` of batch_size copies per mini-batch, scoring/reference.py) on
the same model, one run each.

Rows: requests/s, forwards/s and copies/s for 4-choice arith questions (the worked answer and
three corrupted ones after cover-tiny's chat prompt) at each mc_num; the 6-way accuracy (the
worked answer against 5 corruptions scores highest: tasks/choices.py) at each mc_num; and, with
a block-causal model, the rows saved by computing the clean context blocks once (per request,
and per question when the choices share them through the prefix cache).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from cover_vllm.llm import LLM
from cover_vllm.models.base import dense_forward
from cover_vllm.scoring.params import LoglikelihoodParams
from cover_vllm.scoring.reference import block_causal_logits, reference_loglikelihood
from cover_vllm.tasks.choices import arith_choices, chat_context


@dataclass(frozen=True)
class ScoringBenchSpec:
    model: str = "cover-tiny"
    mc_nums: tuple[int, ...] = (32, 128)
    batch_size: int = 32
    questions: int = 25               # 4-choice questions timed through the engine
    reference_requests: int = 8       # requests timed through the official loop
    rate_problems: int = 100          # 6-way problems for the accuracy rate (0: skip)
    block_model: str | None = None    # a block-causal checkpoint for the shared-context rows
    block_context: int = 64           # its context length (tokens)
    threads: int | None = None
    seed: int = 0


def _logits_fn(llm: LLM):
    model = llm.engine.executor.model
    kind = llm.engine.spec.attention
    if kind.is_block_causal:
        return block_causal_logits(model, kind.block_size)

    def run(batch: torch.Tensor) -> torch.Tensor:
        n = batch.shape[1]
        return dense_forward(model, batch, torch.arange(n).expand(batch.shape[0], n), None)

    return run


def _time_engine(llm: LLM, reqs: list, params: LoglikelihoodParams) -> dict:
    llm.reset_prefix_cache()
    llm.engine.step_times = []                    # one row per engine step (forward)
    start = time.perf_counter()
    outs = llm.loglikelihood(reqs, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    steps = len(llm.engine.step_times)
    llm.engine.step_times = None
    return {"seconds": seconds, "requests_per_s": len(reqs) / seconds,
            "forwards": steps, "forwards_per_s": steps / seconds,
            "copies_per_s": len(reqs) * params.mc_num / seconds,
            "rows": sum(o.metrics.forward_tokens for o in outs), "outputs": outs}


def _time_reference(llm: LLM, reqs: list[dict], params: LoglikelihoodParams) -> dict:
    spec, fn = llm.engine.spec, _logits_fn(llm)
    start = time.perf_counter()
    with torch.inference_mode():
        for r in reqs:
            reference_loglikelihood(fn, r["context_token_ids"], r["continuation_token_ids"],
                                    params, spec.mask_token_id, spec.logit_shift)
    seconds = time.perf_counter() - start
    forwards = len(reqs) * params.mc_num // params.batch_size
    rows = sum(len(r["context_token_ids"]) + len(r["continuation_token_ids"])
               for r in reqs) * params.mc_num
    return {"seconds": seconds, "requests_per_s": len(reqs) / seconds, "forwards": forwards,
            "forwards_per_s": forwards / seconds,
            "copies_per_s": len(reqs) * params.mc_num / seconds, "rows": rows}


def _ids(llm: LLM, pairs: list[tuple[str, str]]) -> list[dict]:
    from cover_vllm.scoring.prompts import encode_pair

    tok = llm.get_tokenizer()
    return [dict(zip(("context_token_ids", "continuation_token_ids"), encode_pair(tok, *p)))
            for p in pairs]


def _greedy_row(llm: LLM, ids: list[dict], spec: ScoringBenchSpec) -> dict:
    """The greedy check's cost: the engine stops at the first token that differs, the official
    check always runs T forwards (one canvas each)."""
    mc = spec.mc_nums[0]
    base = LoglikelihoodParams(mc_num=mc, batch_size=min(spec.batch_size, mc), seed=spec.seed)
    plain = _time_engine(llm, ids, base)
    greedy = _time_engine(llm, ids, LoglikelihoodParams(
        mc_num=mc, batch_size=base.batch_size, seed=spec.seed, check_greedy=True))
    outs = greedy.pop("outputs")
    return {"mc_num": mc, "seconds_without": plain["seconds"], "seconds_with": greedy["seconds"],
            "greedy_forwards_per_request": sum(o.metrics.greedy_forwards for o in outs)
            / len(outs),
            "official_greedy_forwards_per_request": sum(len(o.continuation_token_ids)
                                                        for o in outs) / len(outs),
            "greedy_rate": sum(o.is_greedy for o in outs) / len(outs)}


def _rate(llm: LLM, spec: ScoringBenchSpec, mc: int) -> dict:
    problems = arith_choices(spec.rate_problems, chat_context(llm.get_tokenizer()))
    reqs = [(p.context, c) for p in problems for c in p.choices]
    params = LoglikelihoodParams(mc_num=mc, batch_size=min(spec.batch_size, mc),
                                 seed=spec.seed)
    outs = llm.loglikelihood(reqs, params, use_tqdm=False)
    k = len(problems[0].choices)
    right = sum(max(range(k), key=lambda j: outs[i * k + j].logprob) == p.label
                for i, p in enumerate(problems))
    return {"mc_num": mc, "problems": len(problems), "rate": right / len(problems)}


def _block_rows(spec: ScoringBenchSpec, log) -> list[dict]:
    """The block-causal model: 4 continuations of one random context per question."""
    rows = []
    for caching in (False, True):
        llm = LLM(spec.block_model, enable_prefix_caching=caching, num_threads=spec.threads)
        vocab = llm.engine.spec.mask_token_id - 2
        gen = torch.Generator().manual_seed(spec.seed)
        reqs = []
        for _ in range(spec.questions):
            ctx = torch.randint(0, vocab, (spec.block_context,), generator=gen).tolist()
            reqs += [{"context_token_ids": ctx, "continuation_token_ids": torch.randint(
                0, vocab, (8,), generator=gen).tolist()} for _ in range(4)]
        params = LoglikelihoodParams(mc_num=spec.mc_nums[0], batch_size=spec.batch_size,
                                     seed=spec.seed)
        got = _time_engine(llm, reqs, params)
        official = _time_reference(llm, reqs[:spec.reference_requests], params)
        per_request = official["rows"] / min(len(reqs), spec.reference_requests)
        rows.append({"prefix_caching": caching, "requests_per_s": got["requests_per_s"],
                     "rows_per_request": got["rows"] / len(reqs),
                     "official_rows_per_request": per_request,
                     "official_requests_per_s": official["requests_per_s"]})
        log(f"block-causal prefix_caching={caching}: {rows[-1]}")
        llm.shutdown()
    return rows


def run_loglikelihood_bench(spec: ScoringBenchSpec, log=print) -> dict:
    llm = LLM(spec.model, num_threads=spec.threads)
    problems = arith_choices(spec.questions, chat_context(llm.get_tokenizer()))
    pairs = []
    for p in problems:                 # 4 choices: the answer first, then 3 corruptions
        others = [c for i, c in enumerate(p.choices) if i != p.label][:3]
        pairs += [(p.context, c) for c in [p.choices[p.label], *others]]
    ids = _ids(llm, pairs)
    llm.loglikelihood(ids[:4], LoglikelihoodParams(mc_num=8, batch_size=8), use_tqdm=False)
    report = {"spec": spec.__dict__, "throughput": [], "rate": [], "block_causal": []}
    for mc in spec.mc_nums:
        params = LoglikelihoodParams(mc_num=mc, batch_size=min(spec.batch_size, mc),
                                     seed=spec.seed)
        engine = _time_engine(llm, ids, params)
        engine.pop("outputs")
        official = _time_reference(llm, ids[:spec.reference_requests], params)
        row = {"mc_num": mc, "requests": len(ids), "engine": engine, "official": official,
               "speedup": engine["requests_per_s"] / official["requests_per_s"]}
        report["throughput"].append(row)
        log(f"mc_num={mc}: engine {engine['requests_per_s']:.1f} req/s, official "
            f"{official['requests_per_s']:.2f} req/s ({row['speedup']:.1f}x)")
        if spec.rate_problems:
            report["rate"].append(_rate(llm, spec, mc))
            log(f"mc_num={mc}: rate {report['rate'][-1]}")
    report["greedy"] = _greedy_row(llm, ids, spec)
    log(f"greedy check: {report['greedy']}")
    llm.shutdown()
    if spec.block_model is not None:
        report["block_causal"] = _block_rows(spec, log)
    return report


def format_loglikelihood(report: dict) -> str:
    lines = ["| mc_num | requests | engine req/s | engine forwards/s | engine copies/s | "
             "official req/s | official forwards/s | speed-up |", "|" + "---|" * 8]
    for r in report["throughput"]:
        e, o = r["engine"], r["official"]
        lines.append(f"| {r['mc_num']} | {r['requests']} | {e['requests_per_s']:.1f} | "
                     f"{e['forwards_per_s']:.1f} | {e['copies_per_s']:.0f} | "
                     f"{o['requests_per_s']:.2f} | {o['forwards_per_s']:.1f} | "
                     f"{r['speedup']:.1f}x |")
    g = report.get("greedy")
    if g:
        lines.append(f"\ngreedy check at mc_num {g['mc_num']}: "
                     f"{g['greedy_forwards_per_request']:.1f} forwards per request (official: "
                     f"T = {g['official_greedy_forwards_per_request']:.1f}); "
                     f"{g['seconds_without']:.1f} s without it, {g['seconds_with']:.1f} s with it")
    for r in report["rate"]:
        lines.append(f"\n6-way rate at mc_num {r['mc_num']}: {r['rate']:.3f} "
                     f"({r['problems']} problems)")
    if report["block_causal"]:
        lines += ["", "| prefix caching | req/s | rows/request | official rows/request | "
                  "official req/s |", "|---|---|---|---|---|"]
        for r in report["block_causal"]:
            lines.append(f"| {r['prefix_caching']} | {r['requests_per_s']:.1f} | "
                         f"{r['rows_per_request']:.0f} | {r['official_rows_per_request']:.0f} "
                         f"| {r['official_requests_per_s']:.2f} |")
    return "\n".join(lines)

"""The `cover-vllm generate` subcommand (registered by cli.py): one prompt, the server's sampling
fields as vLLM-spelled flags, n outputs and their logprobs printed readably.

stdout carries the output: with `--n 1` and no `--logprobs` just its text (token ids for a model
without a tokenizer), else per output a header line (`[output i] finish_reason ...`), its text
and, with `--logprobs k`, one line per generated token (position, token, logprob, the top k).
stderr carries the finish reason and the metrics (summed over the n outputs).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from cover_vllm.entrypoints.cli_types import ints, json_obj, positive_int
from cover_vllm.entrypoints.engine_flags import (MODEL_HELP, add_engine_flags,
                                                  add_vllm_only_flags, engine_kwargs)
from cover_vllm.outputs import CompletionOutput, Logprob
from cover_vllm.sampling_params import MAX_LOGPROBS, MAX_N


def _sampling_params(args: argparse.Namespace):
    """The flags as SamplingParams, checked before the model loads (max_tokens: the flag, else
    64 until the checkpoint's default replaces it)."""
    from cover_vllm import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens or 64, block_length=args.block_length,
        steps=args.steps, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop=args.stop, stop_token_ids=args.stop_token_ids,
        ignore_eos=args.ignore_eos, n=args.n, logprobs=args.logprobs,
        decoding_params=args.decoding_params, structured_outputs=args.structured_outputs,
        frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty,
        repetition_penalty=args.repetition_penalty, min_p=args.min_p,
        min_tokens=args.min_tokens, skip_special_tokens=args.skip_special_tokens,
        include_stop_str_in_output=args.include_stop_str_in_output)


def _token(text: str | None, token_id: int) -> str:
    return repr(text) if text is not None else str(token_id)


def format_logprobs(completion: CompletionOutput, k: int) -> list[str]:
    """One line per generated token: position, the token, its logprob and rank, then the k
    most likely tokens of that step with theirs."""
    lines = [f"  {'pos':>4}  {'token':<12} {'logprob':>9} {'rank':>5}  top {k}"]
    for pos, (token_id, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        chosen: Logprob = entry[token_id]
        top = sorted((lp.rank, t, lp) for t, lp in entry.items()
                     if lp.rank is not None and lp.rank <= k)
        alts = "  ".join(f"{_token(lp.decoded_token, t)} {lp.logprob:.3f}" for _, t, lp in top)
        lines.append(f"  {pos:>4}  {_token(chosen.decoded_token, token_id):<12} "
                     f"{chosen.logprob:>9.3f} {str(chosen.rank):>5}  {alts}")
    return lines


def cmd_generate(args: argparse.Namespace) -> None:
    from cover_vllm import LLM

    sp = _sampling_params(args)              # a bad flag fails before the model loads
    llm = LLM(args.model, **engine_kwargs(args))
    if args.max_tokens is None:
        sp = dataclasses.replace(sp, max_tokens=llm.get_default_sampling_params().max_tokens)
    if args.prompt_token_ids is not None:
        if args.chat:
            raise ValueError("--chat needs a text --prompt, not --prompt-token-ids")
        out = llm.generate({"prompt_token_ids": list(args.prompt_token_ids)}, sp,
                           use_tqdm=False)[0]
    elif args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], sp, use_tqdm=False)[0]
    else:
        out = llm.generate([args.prompt], sp, use_tqdm=False)[0]
    plain = sp.n == 1 and sp.logprobs is None
    for c in out.outputs:
        if not plain:
            stop = "" if c.stop_reason is None else f" stop_reason={c.stop_reason!r}"
            print(f"[output {c.index}] finish_reason={c.finish_reason}{stop} "
                  f"tokens={len(c.token_ids)}")
        print(c.text if llm.tokenizer is not None else " ".join(map(str, c.token_ids)))
        if sp.logprobs is not None:
            print("\n".join(format_logprobs(c, sp.logprobs)))
    m = out.metrics
    reasons = ",".join(sorted({str(c.finish_reason) for c in out.outputs}))
    print(f"[{reasons}] nfe={m.nfe} steps={m.steps} tokens/step={m.tokens_per_step:.2f} "
          f"remasks={m.remasks} latency={m.latency_s:.3f}s", file=sys.stderr)


def add_generate_parser(sub) -> None:
    """`generate` under the top-level subparsers `sub`: every engine option, and the server
    body's sampling fields under vLLM's flag spellings."""
    g = sub.add_parser("generate", help="generate once from a prompt")
    g.add_argument("model", help=MODEL_HELP)
    prompt = g.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-token-ids", type=ints, default=None,
                        help="prompt as comma-separated token ids (e.g. 5,6,7)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--decoding-params", type=json_obj, default=None,
                   help='the strategy\'s knobs as JSON, e.g. {"threshold": 0.8}')
    add_engine_flags(g)
    g.add_argument("--max-tokens", type=positive_int, default=None,
                   help="generation slots (default: the checkpoint's generation_config.json "
                        "max_new_tokens, else 64)")
    g.add_argument("--block-length", type=positive_int, default=None,
                   help="tokens per block (default: the model's)")
    g.add_argument("--steps", type=positive_int, default=None,
                   help="denoising steps of fixed-schedule strategies (default: theirs)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 is greedy; shapes only how candidates are sampled")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (0, 1]")
    g.add_argument("--top-k", type=int, default=-1, help="sample among the k most likely "
                   "tokens (-1: off)")
    g.add_argument("--n", type=int, default=1, help=f"outputs for the prompt, 1 to {MAX_N}, "
                   "each its own canvas; output i draws from seed + i")
    g.add_argument("--logprobs", type=int, default=None, help="print every generated token's "
                   f"logprob and the k most likely tokens at its step, k from 0 to "
                   f"{MAX_LOGPROBS} (default: off)")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop string (repeat for several); the output ends before it")
    g.add_argument("--stop-token-ids", type=ints, default=None,
                   help="comma-separated token ids that end the output")
    g.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past end-of-sequence")
    g.add_argument("--structured-outputs", type=json_obj, default=None,
                   help='the output must match one constraint, as JSON with vLLM\'s fields: '
                   '{"regex": ...}, {"json": {schema}}, {"choice": [...]}, {"grammar": ...} '
                   'or {"json_object": true}')
    _add_vllm_sampling_flags(g)
    add_vllm_only_flags(g)
    g.set_defaults(func=cmd_generate)


def _add_vllm_sampling_flags(g: argparse.ArgumentParser) -> None:
    """vLLM's logits processors and output switches (SamplingParams checks the values)."""
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="logit -= f x the token's count among the canvas's shown tokens")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="logit -= p for a token shown on the canvas")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide (positive) or multiply (negative) the logit of a token in "
                   "the prompt or on the canvas (1.0: off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this share of "
                   "the top token's probability (0: off)")
    g.add_argument("--min-tokens", type=int, default=0,
                   help="no EOS or stop token in the first N generated tokens")
    g.add_argument("--skip-special-tokens", action=argparse.BooleanOptionalAction, default=True,
                   help="leave special tokens out of the text")
    g.add_argument("--include-stop-str-in-output", action="store_true",
                   help="keep the stop string (or stop token's text) at the end of the text")

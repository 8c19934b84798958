"""LLM: the offline entry point (`LLM(model=...).generate(prompts, SamplingParams(...))`)."""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from tqdm.auto import tqdm

from cover_vllm.config import EngineConfig
from cover_vllm.engine.engine import Engine
from cover_vllm.outputs import Logprob, RequestOutput
from cover_vllm.sampling_params import SamplingParams
from cover_vllm.scoring.params import LoglikelihoodOutput, LoglikelihoodParams

PromptType = str | dict | list


class LLM:
    """A diffusion LM with an engine: continuous batching over a paged KV cache.

    model: built-in name ("cover-tiny", "llada-50m", ...), a local HF-format directory, or a
    Hugging Face repo id ("org/name": fetched once into the Hugging Face cache, honouring
    revision, download_dir, HF_TOKEN, HF_ENDPOINT and HF_HUB_OFFLINE; models/hub.py).
    options: any EngineConfig field (cover_vllm/config.py, where each one is documented), e.g.
    decoding="cover" (default strategy; per request in SamplingParams.decoding),
    kv_cache="dual" ("none" is exact), dtype="auto", seed=0, tensor_parallel_size=1,
    max_num_seqs=64, kv_cache_memory_bytes=None (sized from memory_utilization after the
    weights), load_format="auto", page_size=16, cache_refresh="block", and vLLM's common
    arguments (max_model_len, gpu_memory_utilization, trust_remote_code, enforce_eager,
    tokenizer, revision, tokenizer_revision, download_dir). A vLLM argument with no meaning
    here (swap_space, enable_lora, ...) raises ValueError with the reason (vllm_args.py); any
    other unknown keyword raises TypeError naming the valid ones.
    """

    def __init__(self, model: str, **options: Any):
        config = EngineConfig.from_options(model, **options)
        self.engine = Engine(config)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """The engine's tokenizer (as vLLM's `LLM.get_tokenizer`): `encode(text)` /
        `decode(ids)` / `apply_chat_template(...)`; None for a checkpoint without tokenizer
        files (prompts are token ids then)."""
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate(prompts)` uses when given no SamplingParams: the defaults, with
        max_tokens from the checkpoint's generation_config.json (`max_new_tokens`) when it has
        one (cover-tiny: 32, the length it was trained on)."""
        if self.engine.default_max_tokens is None:
            return SamplingParams()
        return SamplingParams(max_tokens=self.engine.default_max_tokens)

    def reset_prefix_cache(self) -> None:
        """Drop the automatic prefix cache: later requests compute every prompt block again
        (as vLLM's `LLM.reset_prefix_cache`; benchmarks call it between timed runs)."""
        self.engine.pool.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the engine's worker processes (tensor parallelism); also run on deletion."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:       # interpreter teardown: best effort
            pass

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        A prompt is a string, a list of token ids, or {"prompt_token_ids": [...]}. Every request
        is validated before any is queued, so one bad prompt raises and queues nothing. With
        SamplingParams.prompt_logprobs = k the prompts are scored after generating, one exact
        forward per prompt token (RequestOutput.prompt_logprobs).
        """
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("prompts is empty")
        params = (sampling_params if sampling_params is not None
                  else self.get_default_sampling_params())
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        scored = [p.prompt_logprobs is not None for p in params]
        if any(scored) and self.engine.spec.uniform_state:
            raise ValueError(f"SamplingParams.prompt_logprobs: {self.engine.spec.family} has no "
                             "[MASK] token, so a prompt token has no masked-model likelihood")
        outputs = self._add_and_run(prompts, params, use_tqdm, "Generating")
        wanted = [(o, p.prompt_logprobs) for o, p, s in zip(outputs, params, scored) if s]
        if wanted:
            self._add_prompt_logprobs(wanted, use_tqdm)
        return outputs

    def _add_prompt_logprobs(self, wanted: list[tuple[RequestOutput, int]],
                             use_tqdm: bool) -> None:
        """vLLM's prompt_logprobs on each (output, k): token i's log p(x_i | x_<i), exact, from
        one forward of x_<i followed by [MASK] (the likelihood estimator with a one-token
        continuation, as the server's echo + logprobs), with the k most likely tokens there;
        the first token has none. Every prompt's tokens are scored in one batch."""
        requests, params = [], []
        for out, k in wanted:
            ids = out.prompt_token_ids
            requests += [{"context_token_ids": ids[:i], "continuation_token_ids": [ids[i]]}
                         for i in range(1, len(ids))]
            params += [LoglikelihoodParams(mc_num=1, batch_size=1, seed=0, logprobs=k)] * (
                len(ids) - 1)
        scored = iter(self._add_and_run(requests, params, use_tqdm, "Scoring prompts")
                      if requests else [])
        for out, _ in wanted:
            out.prompt_logprobs = [None] + [self._prompt_entry(next(scored))
                                            for _ in out.prompt_token_ids[1:]]

    def _prompt_entry(self, scored: LoglikelihoodOutput) -> dict[int, Logprob]:
        """{token id: Logprob} for one scored prompt token: it and the top k (rank: place
        among the top k, None for a prompt token outside them)."""
        token, value = scored.continuation_token_ids[0], scored.logprob
        top = sorted((scored.top_logprobs or [{}])[0].items(), key=lambda kv: -kv[1])
        entry = {t: Logprob(v, rank, self._token_text(t))
                 for rank, (t, v) in enumerate(top, start=1)}
        if token not in entry:
            entry[token] = Logprob(value, None, self._token_text(token))
        return entry

    def _token_text(self, token: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token])

    def loglikelihood(self, requests: Any | Sequence[Any],
                      params: LoglikelihoodParams | Sequence[LoglikelihoodParams] | None = None,
                      use_tqdm: bool = True) -> list[LoglikelihoodOutput]:
        """The Monte-Carlo log-likelihood of each continuation given its context (the official
        LLaDA estimator; docs/architecture.md "Likelihood scoring"); results in request order.

        A request is {"context_token_ids": [...], "continuation_token_ids": [...]} or a
        (context, continuation) pair of strings (encoded as lm-eval's `_encode_pair`: trailing
        spaces of the context move to the continuation). `params`: one LoglikelihoodParams for
        all or one per request. Every request is validated before any is queued; scoring runs
        batched with whatever else the engine runs.
        """
        if isinstance(requests, dict) or (isinstance(requests, tuple) and len(requests) == 2
                                          and all(isinstance(s, str) for s in requests)):
            requests = [requests]
        requests = list(requests)
        if not requests:
            raise ValueError("requests is empty")
        params = LoglikelihoodParams() if params is None else params
        if isinstance(params, LoglikelihoodParams):
            params = [params] * len(requests)
        params = list(params)
        if len(params) != len(requests):
            raise ValueError(f"got {len(params)} LoglikelihoodParams for {len(requests)} "
                             "requests")
        if not all(isinstance(p, LoglikelihoodParams) for p in params):
            raise TypeError("params must be LoglikelihoodParams (or a list of them)")
        return self._add_and_run(requests, params, use_tqdm, "Scoring")

    def _add_and_run(self, prompts: list, params: list, use_tqdm: bool, desc: str) -> list:
        ids = [f"req-{next(self._ids)}" for _ in prompts]
        added = []
        try:
            for rid, prompt, p in zip(ids, prompts, params):
                self.engine.add_request(rid, prompt, p)
                added.append(rid)
        except Exception:
            for rid in added:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm, desc)

    def _run(self, ids: list[str], use_tqdm: bool, desc: str = "Generating") -> list:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc=desc, unit="req", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in ids:
                if rid not in done:
                    self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [done[rid] for rid in ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, **template_options: Any) -> list[RequestOutput]:
        """Generate for one conversation or a list of them, each rendered by the chat template.

        Messages are checked as the server checks them (roles system, developer, user,
        assistant; text content): a bad one raises ValueError naming messages[i].role (with a
        list of conversations, messages[c][i]...) before anything is queued.
        `template_options` are vLLM's: `chat_template` (a Jinja template, or a path to one,
        replacing the tokenizer's), `add_generation_prompt` (True), `continue_final_message`
        (False) and `chat_template_kwargs` (extra template variables): ChatTemplateOptions,
        cover_vllm/chat.py.
        """
        from cover_vllm.chat import check_messages
        from cover_vllm.tokenizer import apply_chat_template

        options = _template_options(template_options)
        single = isinstance(messages, (list, tuple)) and bool(messages) and isinstance(
            messages[0], dict)
        conversations = [messages] if single else messages
        if not isinstance(conversations, (list, tuple)) or not conversations:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': "
                             "...} dicts, or a list of such conversations")
        checked = [check_messages(conv, "messages" if single else f"messages[{c}]")
                   for c, conv in enumerate(conversations)]
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        prompts = [{"prompt_token_ids": apply_chat_template(self.tokenizer, conv, options)}
                   for conv in checked]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


def _template_options(given: dict[str, Any]):
    """ChatTemplateOptions from LLM.chat's keywords; TypeError naming an unknown one."""
    from cover_vllm.chat import ChatTemplateOptions

    known = set(ChatTemplateOptions.__dataclass_fields__)
    unknown = sorted(set(given) - known)
    if unknown:
        raise TypeError(f"LLM.chat() got unknown keyword(s) {unknown}; chat template options: "
                        f"{sorted(known)}")
    return ChatTemplateOptions(**given)

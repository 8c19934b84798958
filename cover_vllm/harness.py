"""lm-evaluation-harness model `cover_vllm`: loglikelihood / loglikelihood_rolling through
`LLM.loglikelihood` (the official LLaDA Monte-Carlo estimator), generate_until through
`LLM.generate` with any decoder.

    import cover_vllm.harness          # registers "cover_vllm" beside lm-eval's own models
    lm_eval.simple_evaluate(model="cover_vllm",
                            model_args="pretrained=cover-tiny,mc_num=128,batch_size=32,"
                                       "decoding=low_confidence", tasks=[...])

or `cover-vllm lm-eval --model cover_vllm --model_args ... --tasks ...`; lm-eval versions that
discover plugins find it through the package's `lm_eval.models` entry point with no import.
lm-eval is the optional `eval` extra (pyproject.toml says how its pins are kept).

model_args: `pretrained` (a model as `LLM(model=...)` takes it); the estimator's `mc_num`,
`batch_size` (its mini-batch, default 32: lm-eval's own --batch_size is ignored, the engine
batches by itself), `cfg_scale`, `check_greedy` (default true, as the official harness) and
`seed` (request i draws from seed + i, default 1234); generation's `decoding`, `max_tokens`
(instead of a task's max_gen_toks), `steps`, `block_length`, `temperature`, `kv_cache`,
`cache_refresh`; any EngineConfig field (dtype, tensor_parallel_size, max_num_seqs, ...); every
other key is a knob of the decoder (decoding_params, validated by it).
"""

from __future__ import annotations

import dataclasses
from typing import Any

try:
    import lm_eval.models  # noqa: F401  (lm-eval's models first: see _register)
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as exc:       # pragma: no cover - the optional extra is missing
    raise ImportError("cover_vllm.harness needs lm-evaluation-harness: pip install "
                      "'cover-vllm[eval]' (lm_eval==0.4.13)") from exc

from cover_vllm.config import EngineConfig
from cover_vllm.llm import LLM
from cover_vllm.sampling_params import SamplingParams
from cover_vllm.scoring.params import LoglikelihoodParams

SCORING_ARGS = ("mc_num", "batch_size", "cfg_scale", "check_greedy", "seed")
SAMPLING_ARGS = ("decoding", "max_tokens", "steps", "block_length", "temperature", "top_p",
                 "top_k", "kv_cache", "cache_refresh")
IGNORED_ARGS = ("max_batch_size", "device_map", "trust_remote_code")
ENGINE_ARGS = tuple(f.name for f in dataclasses.fields(EngineConfig) if f.name != "model")


def split_model_args(args: dict[str, Any]) -> tuple[dict, dict, dict, dict]:
    """model_args -> (LLM options, scoring, sampling, decoding_params)."""
    engine, scoring, sampling, knobs = {}, {}, {}, {}
    for key, value in args.items():
        if key in SCORING_ARGS:
            scoring[key] = value
        elif key in SAMPLING_ARGS:
            sampling[key] = value
        elif key in ENGINE_ARGS:
            engine[key] = value
        elif key not in IGNORED_ARGS:
            knobs[key] = value
    return engine, scoring, sampling, knobs


def _device(requested: str | None) -> str:
    """lm-eval's --device (its CLI default is cuda:0) as an engine device: "cuda" when asked
    for and present, else "cpu" (a `device=` in model_args is used as given)."""
    import torch

    if requested and requested.startswith("cuda") and torch.cuda.is_available():
        return "cuda"
    return "cpu"


class CoverVLLM(LM):
    """A diffusion LM behind the cover_vllm engine, as an lm-eval model."""

    def __init__(self, pretrained: str = "cover-tiny", device: str | None = None,
                 **kwargs: Any):
        super().__init__()
        engine, scoring, sampling, knobs = split_model_args(kwargs)
        engine.setdefault("device", _device(device))
        self.seed = int(scoring.pop("seed", 1234))
        scoring.setdefault("check_greedy", True)
        scoring.setdefault("batch_size", min(32, scoring.get("mc_num", 128)))
        self.scoring = LoglikelihoodParams(**scoring)      # ValueError names the field
        self.sampling, self.knobs = sampling, knobs
        self.llm = LLM(pretrained, **engine)
        self.tokenizer = self.llm.get_tokenizer()
        if self.tokenizer is None:
            raise ValueError(f"model {pretrained!r} has no tokenizer: lm-eval tasks are text")
        self._pretrained = pretrained

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        """model_args first; lm-eval's own batch_size / max_batch_size never override them."""
        extra = {k: v for k, v in (additional_config or {}).items()
                 if v is not None and k not in ("batch_size", "max_batch_size")}
        return cls(**{**extra, **arg_dict})

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @property
    def tokenizer_name(self) -> str:
        return str(self._pretrained).replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict],
                            add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    # ---- likelihood ------------------------------------------------------------------------
    def _params(self, n: int) -> list[LoglikelihoodParams]:
        return [dataclasses.replace(self.scoring, seed=self.seed + i) for i in range(n)]

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [tuple(r.args) for r in requests]
        outs = self.llm.loglikelihood(pairs, self._params(len(pairs)),
                                      use_tqdm=not disable_tqdm)
        results = [(o.logprob, o.is_greedy) for o in outs]
        for pair, result in zip(pairs, results):
            self.cache_hook.add_partial("loglikelihood", pair, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text in disjoint windows of at most max_model_len tokens, every window scored
        given the tokens before it (the first given the EOS id); the windows' sum."""
        prefix = self.llm.engine.spec.eos_token_ids[0]
        window = self.llm.engine.spec.max_model_len - 1
        texts = [r.args[0] for r in requests]
        owners, reqs = [], []
        for i, text in enumerate(texts):
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    ids, prefix_token=prefix, max_seq_len=window, context_len=1)):
                owners.append(i)
                reqs.append({"context_token_ids": list(ctx),
                             "continuation_token_ids": list(cont)})
        params = [dataclasses.replace(p, check_greedy=False) for p in self._params(len(reqs))]
        outs = self.llm.loglikelihood(reqs, params, use_tqdm=not disable_tqdm)
        totals = [0.0] * len(texts)
        for owner, out in zip(owners, outs):
            totals[owner] += out.logprob
        for text, total in zip(texts, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return totals

    # ---- generation ------------------------------------------------------------------------
    def _sampling(self, gen_kwargs: dict) -> SamplingParams:
        kwargs = dict(gen_kwargs)
        until = kwargs.pop("until", None)
        until = [until] if isinstance(until, str) else list(until or [])
        max_tokens = self.sampling.get("max_tokens") or kwargs.pop("max_gen_toks", 256)
        if not kwargs.pop("do_sample", False):
            kwargs.setdefault("temperature", 0.0)
        fields = {k: v for k, v in {**kwargs, **self.sampling}.items() if k in SAMPLING_ARGS}
        fields["max_tokens"] = int(max_tokens)
        return SamplingParams(stop=until or None, decoding_params=self.knobs or None, **fields)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        prompts = [r.args[0] for r in requests]
        params = [self._sampling(r.args[1]) for r in requests]
        outs = self.llm.generate(prompts, params, use_tqdm=not disable_tqdm)
        texts = []
        for (prompt, gen_kwargs), out in zip((r.args for r in requests), outs):
            text = out.outputs[0].text
            for stop in [gen_kwargs.get("until")] if isinstance(gen_kwargs.get("until"), str) \
                    else gen_kwargs.get("until") or []:
                text = text.split(stop, 1)[0]
            self.cache_hook.add_partial("generate_until", (prompt, gen_kwargs), text)
            texts.append(text)
        return texts


def _register() -> None:
    """Register "cover_vllm" (lm_eval.models was imported above: lm-eval's get_model imports
    its own models only while the registry is empty, so registering first would hide them). A
    plugin-discovering lm-eval may hold the entry point's "cover_vllm.harness:CoverVLLM"
    placeholder already; the registry upgrades it to the class."""
    try:
        register_model("cover_vllm")(CoverVLLM)
    except ValueError:      # this module re-imported (a reload): the first class stays
        pass


_register()


def run_cli(argv: list[str]) -> int:
    """lm-eval's command line with the model registered (`cover-vllm lm-eval ARGS...`)."""
    import sys

    from lm_eval.__main__ import cli_evaluate

    saved = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
    return 0


__all__ = ["CoverVLLM", "run_cli", "split_model_args"]

if __name__ == "__main__":       # python -m cover_vllm.harness ARGS == cover-vllm lm-eval ARGS
    import sys as _sys

    _sys.exit(run_cli(_sys.argv[1:]))
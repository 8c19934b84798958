"""vLLM's engine arguments that have no meaning here: each refused by name, with the reason.

A vLLM user passes `LLM(model, swap_space=4)` or `vllm serve ... --enable-lora` out of habit.
`check_vllm_args(options)` takes those keywords out of `options` before EngineConfig sees them:
a value that asks for what this engine does anyway (`pipeline_parallel_size=1`,
`kv_cache_dtype="auto"`, `enable_lora=False`, ...) is accepted and ignored; any other value
raises ValueError naming the argument and why it has no meaning here. A keyword vLLM does not
have either stays an "unknown engine option" TypeError (config.py).

Arguments vLLM has that this engine *does* take are EngineConfig fields (config.py):
`trust_remote_code`, `max_model_len`, `gpu_memory_utilization`, `enforce_eager`, `tokenizer`,
`revision`, `tokenizer_revision`, `download_dir`, `seed`, `dtype`, `quantization`,
`tensor_parallel_size`, `distributed_executor_backend`, `max_num_seqs`,
`kv_cache_memory_bytes`, `load_format`, `enable_prefix_caching`, `device`.

Accepted whatever the value (an instruction this engine already follows):
* `disable_log_stats`: the engine logs no periodic stats (the server's are on /metrics).
* `disable_custom_all_reduce`: tensor-parallel all-reduces are torch.distributed's; there is no
  custom all-reduce to turn off.
* `max_seq_len_to_capture`: CUDA graphs are captured up to 512 tokens a step whatever it says
  (see `enforce_eager`, worker/cuda_graphs.py).
* `use_tqdm_on_load`: loading shows no progress bar either way.
* `disable_log_requests`: the server logs no request contents to disable (uvicorn's access
  log, set by `serve --uvicorn-log-level`, lists each request's route and status).
`enable_log_requests` (vLLM's switch that logs every request's prompt and parameters) is
refused: the server keeps no such log.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

_ANY = object()     # in `same`: every value is what the engine does anyway


@dataclass(frozen=True)
class VllmOnly:
    reason: str
    same: tuple = ()          # values meaning what this engine does anyway: accepted, ignored
    switch: bool = False      # vLLM's flag is an on/off switch (`--enable-lora`), not a value

    def accepts(self, value: Any) -> bool:
        return _ANY in self.same or any(_equal(value, v) for v in self.same)

    def describe(self) -> str:
        """The reason, and the values accepted (as no-ops) if any."""
        if not self.same:
            return self.reason
        return f"{self.reason} (accepted only as {' or '.join(map(repr, self.same))})"


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b)
    return a == b


_LORA = "no LoRA adapters: the engine serves the checkpoint's own weights"
_SPEC = ("no speculative decoding: parallel decoding is what the strategies do (decoding=..., "
         "e.g. threshold or cover)")
_CONFIG = "config.json is read as written; edit a local copy of the checkpoint instead"
_TEXT = "text-only models: no images, audio or video inputs"

VLLM_ONLY: dict[str, VllmOnly] = {
    "swap_space": VllmOnly("the KV pool is never swapped to CPU: a request waits for pages "
                           "instead (on CPU the pool already lives in host memory)", (0,)),
    "cpu_offload_gb": VllmOnly("weights are never offloaded (on CPU they already live in host "
                               "memory); use quantization='int8' or 'int4' to shrink them", (0,)),
    "pipeline_parallel_size": VllmOnly("no pipeline parallelism: shard layers with "
                                       "tensor_parallel_size, replicate with `cover-vllm serve "
                                       "--data-parallel-size`", (1,)),
    "data_parallel_size": VllmOnly("one LLM is one engine; data parallelism is `cover-vllm "
                                   "serve --data-parallel-size N`", (1,)),
    "kv_cache_dtype": VllmOnly("the KV cache is stored in the model's dtype (dtype=...)",
                               ("auto",)),
    "block_size": VllmOnly("the KV page size is page_size here (a diffusion 'block' is the "
                           "decoding block: SamplingParams.block_length)", ()),
    "num_gpu_blocks_override": VllmOnly("the KV pool is sized by kv_cache_memory_bytes",
                                        (None,)),
    "enable_chunked_prefill": VllmOnly("a diffusion step runs the prompt with the canvas; "
                                       "there is no separate prefill to chunk", (False, None),
                                       switch=True),
    "max_num_batched_tokens": VllmOnly("a step's batch is bounded by max_num_seqs and the KV "
                                       "pages, not by a token budget", (None,)),
    "speculative_config": VllmOnly(_SPEC, (None,)),
    "speculative_model": VllmOnly(_SPEC, (None,)),
    "num_speculative_tokens": VllmOnly(_SPEC, (None,)),
    "enable_lora": VllmOnly(_LORA, (False,), switch=True),
    "max_lora_rank": VllmOnly(_LORA, ()),
    "max_loras": VllmOnly(_LORA, ()),
    "max_cpu_loras": VllmOnly(_LORA, (None,)),
    "fully_sharded_loras": VllmOnly(_LORA, (False,), switch=True),
    "tokenizer_mode": VllmOnly("tokenizers load one way: the fast tokenizer from "
                               "tokenizer.json (a checkpoint's tokenizer code is never run)",
                               ("auto",)),
    "skip_tokenizer_init": VllmOnly("the tokenizer is loaded when the checkpoint has one; a "
                                    "checkpoint without tokenizer files runs on token ids",
                                    (False,), switch=True),
    "code_revision": VllmOnly("no checkpoint code is ever run (see trust_remote_code)",
                              (None,)),
    "hf_overrides": VllmOnly(_CONFIG, (None, {})),
    "rope_scaling": VllmOnly(_CONFIG, (None, {})),
    "rope_theta": VllmOnly(_CONFIG, (None,)),
    "hf_token": VllmOnly("the token comes from the environment: set HF_TOKEN (or log in with "
                         "`hf auth login`)", (None,)),
    "limit_mm_per_prompt": VllmOnly(_TEXT, (None, {})),
    "mm_processor_kwargs": VllmOnly(_TEXT, (None, {})),
    "allowed_local_media_path": VllmOnly(_TEXT, (None, "")),
    "task": VllmOnly("generation is the only task (no embedding, pooling or scoring)",
                     ("auto", "generate")),
    "runner": VllmOnly("generation is the only runner (no pooling)", ("auto", "generate")),
    "convert": VllmOnly("models are not converted to pooling or scoring models",
                        ("auto", "none", None)),
    "model_impl": VllmOnly("every family is implemented by this engine (models/registry.py); "
                           "there is no Transformers fallback", ("auto",)),
    "config_format": VllmOnly("config.json in Hugging Face format is the only config",
                              ("auto", "hf")),
    "enable_sleep_mode": VllmOnly("no sleep / wake-up: an engine holds its memory until "
                                  "shutdown()", (False,), switch=True),
    "enable_expert_parallel": VllmOnly("MoE experts are sharded by tensor parallelism",
                                       (False,), switch=True),
    "kv_transfer_config": VllmOnly("no disaggregated prefill / KV transfer", (None,)),
    "compilation_config": VllmOnly("nothing is compiled; CUDA graphs are "
                                   "enforce_eager's", (None, 0, {})),
    "scheduling_policy": VllmOnly("requests are admitted first come, first served", ("fcfs",)),
    "override_generation_config": VllmOnly("pass the values in SamplingParams instead; "
                                           "generation_config.json gives only max_new_tokens",
                                           (None, {})),
    "generation_config": VllmOnly("generation_config.json is read from the checkpoint "
                                  "(max_new_tokens only)", ("auto",)),
    "served_model_name": VllmOnly("a server option: `cover-vllm serve --served-model-name`",
                                  (None,)),
    "worker_cls": VllmOnly("the worker is this engine's own", ("auto",)),
    "max_parallel_loading_workers": VllmOnly("each rank reads its own slice; there is no "
                                             "loading pool to size", (None,)),
    "calculate_kv_scales": VllmOnly("the KV cache is not quantized (kv_cache_dtype)",
                                    (None, False), switch=True),
    "disable_log_stats": VllmOnly("", (_ANY,), switch=True),
    "disable_custom_all_reduce": VllmOnly("", (_ANY,), switch=True),
    "max_seq_len_to_capture": VllmOnly("", (_ANY,)),
    "use_tqdm_on_load": VllmOnly("", (_ANY,), switch=True),
    "disable_log_requests": VllmOnly("", (_ANY,), switch=True),
    "enable_log_requests": VllmOnly("the server logs no request contents: uvicorn's access "
                                    "log (serve --uvicorn-log-level info, the default) lists "
                                    "each request, /metrics counts them", (False,),
                                    switch=True),
}


def check_vllm_args(options: dict[str, Any]) -> dict[str, Any]:
    """`options` without vLLM's arguments that mean nothing here: accepted ones dropped, the
    others refused together in one ValueError, each with its reason."""
    refused = [f"{name}={value!r}: {VLLM_ONLY[name].describe()}"
               for name, value in options.items()
               if name in VLLM_ONLY and not VLLM_ONLY[name].accepts(value)]
    if refused:
        raise ValueError("vLLM argument(s) with no meaning in cover_vllm:\n  "
                         + "\n  ".join(refused))
    return {k: v for k, v in options.items() if k not in VLLM_ONLY}

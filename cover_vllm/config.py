"""EngineConfig: one frozen object for engine-wide settings; 'auto' values are resolved into a copy."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field, fields, replace

from cover_vllm.cache_refresh import CacheRefresh, parse_cache_refresh
from cover_vllm.vllm_args import check_vllm_args

KV_CACHE_MODES = ("none", "prefix", "dual")
EXECUTOR_BACKENDS = (None, "uni", "mp", "ray")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}    # vLLM's other spellings
_DEFAULT_KV_BYTES = 2 << 30   # 2 GiB cap when the user gives no budget
DEFAULT_MEMORY_UTILIZATION = 0.9


def batch_invariant_env() -> bool:
    """VLLM_BATCH_INVARIANT=1 (vLLM's switch) turns `batch_invariant` on."""
    return os.environ.get("VLLM_BATCH_INVARIANT", "0").strip().lower() in ("1", "true", "yes",
                                                                            "on")


def option(default, help: str, *, kind: str = "str", choices: tuple | None = None,
           flags: tuple[str, ...] = ()):
    """An EngineConfig field with what its command-line flag needs: `kind` names the value
    parser (str, int, positive_int, float, positive_float), `flags` replaces the default flag
    `--field-name`. LLM(...) kwargs and every `cover-vllm` flag come from these fields."""
    return field(default=default,
                 metadata={"help": help, "kind": kind, "choices": choices, "flags": flags})


@dataclass(frozen=True)
class EngineConfig:
    """Every engine option, defined once (cover_vllm/entrypoints/engine_flags.py turns them
    into command-line flags; LLM(**kwargs) checks its keywords against them).

    vLLM's common arguments are fields under vLLM's names and meanings: `max_model_len`,
    `gpu_memory_utilization` (one fraction with `memory_utilization`: see `memory_fraction`),
    `trust_remote_code` (accepted; it changes nothing here, as its help says), `enforce_eager`
    (vLLM's knob: False, the default, runs the forward as CUDA graphs on CUDA, worker/
    cuda_graphs.py; ignored elsewhere),
    `tokenizer`, `revision`, `tokenizer_revision`, `download_dir`, `seed`. vLLM's arguments
    with no meaning here are refused by name with the reason (vllm_args.py).
    """

    model: str
    decoding: str | None = option(
        None, "default decoding strategy (per request: decoding); unset: the model family's, "
        "diffusion_gemma for DiffusionGemma (default: cover)")
    kv_cache: str = option("dual", "KV reuse between refreshes: none is exact",
                           choices=KV_CACHE_MODES)
    dtype: str = option("auto", "weights and activations (auto: the checkpoint's torch_dtype; "
                        "vLLM's half and float mean float16 and float32)",
                        choices=DTYPES + tuple(DTYPE_ALIASES))
    quantization: str | None = option(
        None, "quantized projections, computed at load: int8 (per output channel) or int4 / "
        "int4:G (a scale and zero per G input columns, default 128), weight-only; w8a8: int8 "
        "weights x int8 activations (per row, at run time); embeddings, norms and routers "
        "keep --dtype")
    seed: int = option(0, "engine seed", kind="int")
    tensor_parallel_size: int = option(1, "shard the model over N worker processes",
                                       kind="positive_int",
                                       flags=("--tensor-parallel-size", "-tp"))
    distributed_executor_backend: str | None = option(
        None, "how tensor-parallel workers run (default: mp)",
        choices=tuple(b for b in EXECUTOR_BACKENDS if b is not None))
    max_num_seqs: int = option(64, "requests decoded together", kind="positive_int")
    kv_cache_memory_bytes: int | None = option(
        None, "KV budget in bytes: pages and COVER's scratch slots together (default: "
        "max_num_seqs full canvases, at most 2 GiB and twice the weights or 256 MiB, within "
        "--memory-utilization)", kind="positive_int")
    memory_utilization: float | None = option(
        None, "share of memory for weights + KV cache: of the host's on CPU (all ranks "
        "together), of each device's on GPU (default 0.9; gpu_memory_utilization is the same "
        "fraction under vLLM's name)", kind="float")
    gpu_memory_utilization: float | None = option(
        None, "vLLM's name for memory_utilization: the device-memory fraction on GPU, the "
        "host-memory fraction on CPU; give one of the two (both only with the same value)",
        kind="float")
    load_format: str = option("auto", "dummy: random weights (the only choice for weightless "
                              "built-in shapes)", choices=LOAD_FORMATS)
    page_size: int = option(16, "tokens per KV page", kind="positive_int")
    attention_backend: str = option("sdpa", "attention: sdpa (fast) or reference (the "
                                    "slow oracle)")
    cache_refresh: str | CacheRefresh = option(
        "block", "when prefix/dual recompute cached K/V: block, interval:N or adaptive "
        "(per request: cache_refresh)")
    cache_refresh_interval: int | None = None   # deprecated alias: N == cache_refresh="interval:N"
    num_threads: int | None = option(
        None, "torch intra-op threads (default: 1 for a tiny model, else the cores not busy "
        "with other jobs)", kind="positive_int", flags=("--threads",))
    device: str = option("cpu", "torch device of the model")
    enable_prefix_caching: bool | None = option(
        None, "share the K/V of full prompt blocks across requests (default: on for "
        "block-causal models; full-attention models cannot)", kind="bool")
    distributed_timeout_s: float = option(
        60.0, "tensor parallelism: max wait on a collective or a worker's reply (seconds)",
        kind="positive_float")
    max_model_len: int | None = option(
        None, "longest canvas (prompt + max_tokens, rounded up to a whole block on "
        "block-causal models) a request may use; at most the model's own (config.json "
        "max_sequence_length / max_position_embeddings), which is the default; also sizes the "
        "default KV pool", kind="positive_int")
    trust_remote_code: bool = option(
        False, "accepted for vLLM compatibility: the engine implements every architecture "
        "itself and never runs code shipped with a checkpoint, so True and False load the "
        "same", kind="bool")
    enforce_eager: bool = option(
        False, "vLLM's knob, ignored off CUDA: on CUDA, False (default) runs the model forward "
        "as CUDA graphs, captured per batch shape at padded token counts up to 512 (eagerly "
        "beyond, with tensor parallelism, and in steps that measure attention statistics); "
        "True runs it eagerly. Padding changes no real row's attention; nothing is "
        "torch.compile'd",
        kind="bool")
    fast_norm: bool = option(
        False, "RMSNorm as one op (`F.rms_norm` with its weight: the weight multiplies in fp32 "
        "before the one rounding) instead of the official order (normalise in fp32, round to "
        "the model's dtype, then multiply by the weight). Changes bf16/fp16 logits by up to "
        "one unit in the last place, so tokens may differ from the official code's; fp32 is "
        "unchanged (issue #48)", kind="bool")
    tokenizer: str | None = option(
        None, "tokenizer from another local directory or Hugging Face repo id (default: the "
        "model's own files)")
    batch_invariant: bool = option(
        False, "a request's logits bitwise independent of the other requests in its step "
        "(fixed-tile GEMMs where the kernel needs them, per-sequence attention; "
        "layers/batch_invariant.py, docs/batch_invariance.md); VLLM_BATCH_INVARIANT=1 turns it "
        "on too. Same dtype, device kind and tensor_parallel_size only", kind="bool")
    revision: str | None = option(
        None, "branch, tag or commit of a Hugging Face repo id model (default: main)")
    tokenizer_revision: str | None = option(
        None, "branch, tag or commit of the tokenizer's repo (alone: the model repo's "
        "tokenizer at that revision)")
    download_dir: str | None = option(
        None, "where hub repo ids are downloaded (default: the Hugging Face cache, HF_HUB_CACHE "
        "or HF_HOME/hub)")

    def __post_init__(self) -> None:
        if self.kv_cache not in KV_CACHE_MODES:
            raise ValueError(f"kv_cache={self.kv_cache!r}; choose one of {list(KV_CACHE_MODES)}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format={self.load_format!r}; choose one of {list(LOAD_FORMATS)}")
        if self.dtype in DTYPE_ALIASES:
            object.__setattr__(self, "dtype", DTYPE_ALIASES[self.dtype])
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}; choose one of "
                             f"{list(DTYPES) + list(DTYPE_ALIASES)}")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend={self.distributed_executor_backend!r};"
                             f" choose one of {list(EXECUTOR_BACKENDS)}")
        for name in ("max_num_seqs", "page_size", "tensor_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be > 0 (or None for the default)")
        self._check_memory_fraction()
        if self.max_model_len is not None and (isinstance(self.max_model_len, bool) or not
                                               isinstance(self.max_model_len, int)
                                               or self.max_model_len <= 0):
            raise ValueError(f"max_model_len must be a positive int (or None: the model's), "
                             f"got {self.max_model_len!r}")
        if batch_invariant_env() and not self.batch_invariant:      # vLLM's switch
            object.__setattr__(self, "batch_invariant", True)
        for name in ("trust_remote_code", "enforce_eager", "batch_invariant",
                     "fast_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("tokenizer", "revision", "tokenizer_revision", "download_dir"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (str, os.PathLike)) or not str(value)):
                raise ValueError(f"{name} must be a non-empty string or None, got {value!r}")
        if self.cache_refresh_interval is not None:
            if isinstance(self.cache_refresh_interval, bool) or not isinstance(
                    self.cache_refresh_interval, int) or self.cache_refresh_interval <= 0:
                raise ValueError("cache_refresh_interval must be >= 1 or None")
            if parse_cache_refresh(self.cache_refresh).mode != "block":
                raise ValueError("give cache_refresh or the deprecated cache_refresh_interval, "
                                 "not both")
            warnings.warn("cache_refresh_interval=N is deprecated; use "
                          "cache_refresh='interval:N'", DeprecationWarning, stacklevel=3)
        parse_cache_refresh(self.cache_refresh)       # ValueError naming the allowed forms
        if isinstance(self.distributed_timeout_s, bool) or not isinstance(
                self.distributed_timeout_s, (int, float)) or self.distributed_timeout_s <= 0:
            raise ValueError(f"distributed_timeout_s must be a positive number of seconds, got "
                             f"{self.distributed_timeout_s!r}")
        if self.enable_prefix_caching not in (None, True, False):
            raise ValueError(f"enable_prefix_caching must be True, False or None (auto), got "
                             f"{self.enable_prefix_caching!r}")
        if not isinstance(self.seed, int):
            raise TypeError("seed must be an int")

    def _check_memory_fraction(self) -> None:
        for name in ("memory_utilization", "gpu_memory_utilization"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(
                    value, (int, float)) or not 0 < value <= 1):
                raise ValueError(f"{name} must be a fraction in (0, 1], got {value!r}")
        if None not in (self.memory_utilization, self.gpu_memory_utilization) and \
                self.memory_utilization != self.gpu_memory_utilization:
            raise ValueError(
                f"memory_utilization={self.memory_utilization} and gpu_memory_utilization="
                f"{self.gpu_memory_utilization} disagree: they are one fraction under two names "
                "(ours and vLLM's); give one of them")

    @property
    def memory_fraction(self) -> float:
        """The share of memory for weights + KV cache: memory_utilization or its vLLM name
        gpu_memory_utilization (the same value when both are given), else 0.9."""
        for value in (self.memory_utilization, self.gpu_memory_utilization):
            if value is not None:
                return float(value)
        return DEFAULT_MEMORY_UTILIZATION

    @property
    def memory_option(self) -> str:
        """`name=value` of the memory fraction as the user gave it (for error messages)."""
        name = ("gpu_memory_utilization" if self.memory_utilization is None
                and self.gpu_memory_utilization is not None else "memory_utilization")
        return f"{name}={self.memory_fraction}"

    @property
    def refresh_policy(self) -> CacheRefresh:
        """The engine-wide refresh policy (the deprecated interval alias resolved)."""
        if self.cache_refresh_interval is not None:
            return CacheRefresh("interval", self.cache_refresh_interval)
        return parse_cache_refresh(self.cache_refresh)

    def kv_budget_bytes(self, bytes_per_token: int, max_model_len: int,
                        bytes_per_seq: int = 0) -> int:
        """The KV pool size: the user's budget, else room for max_num_seqs full canvases (each
        also `bytes_per_seq`: a sliding-window ring) (capped; worker/memory.py lowers it further
        to what the memory budget leaves after the weights)."""
        if self.kv_cache_memory_bytes is not None:
            return self.kv_cache_memory_bytes
        return min(_DEFAULT_KV_BYTES,
                   self.max_num_seqs * (max_model_len * bytes_per_token + bytes_per_seq))

    @classmethod
    def from_options(cls, model: str, **options) -> "EngineConfig":
        """The config for `model` with keyword options (LLM(...), the server), an unknown
        keyword named with the valid ones."""
        valid = {f.name for f in fields(cls)} - {"model"}
        options = check_vllm_args(options)     # vLLM's own arguments: refused with the reason
        unknown = sorted(set(options) - valid)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; valid: {sorted(valid)}")
        return cls(model=str(model), **options)

    def with_overrides(self, **changes) -> "EngineConfig":
        return replace(self, **changes)

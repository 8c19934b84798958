"""The model-family registry: everything cover_vllm knows about a family, in one entry.

A `Family` declares the config.json `model_type` values it serves, its model class (imported only
when a model is built), the `architectures` name `make-checkpoint` writes, the logit shift, the
attention kind (a function of config.json), the default block length, the decoder quirks the
strategies read from `ModelSpec`, the checkpoint tensors that hold several pieces side by side,
the built-in shapes (`load_format="dummy"`, `make-checkpoint --shape`), and for families
whose checkpoints are not a flat masked-diffusion LM: how config.json is read (a multimodal
wrapper's `text_config`), whether there is a [MASK] token at all (uniform-state diffusion has
none), which checkpoint tensors are never loaded (a vision tower), and int4's default group.

Adding a family is its model file (a `DiffusionLM`, models/base.py, whose Linear-owning modules
declare `parallel_plan()`) plus one entry in `FAMILIES`; `ModelSpec.from_config`
(models/spec.py), the loader (models/loader.py), `make-checkpoint` (models/checkpoint_writer.py)
and the built-in names (models/builtin.py) all read this table and nothing else.

Checkpoint tensor names: every module uses the official tensor names as its parameter names, so
the mapping between the two is the identity for every family (no renaming anywhere).
"""

from __future__ import annotations

import fnmatch
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from cover_vllm.models import configs
from cover_vllm.models.attention_kind import AttentionKind
from cover_vllm.models.gemma4_config import flatten_config

Config = dict[str, Any]


def full_attention(config: Config) -> AttentionKind:
    """Every query row sees every key of the canvas (LLaDA, Dream, LLaDA-MoE)."""
    return AttentionKind()


@dataclass(frozen=True)
class BlockCausal:
    """Block-causal attention; the block size is config.json's `config_key` when present, else
    `default` (LLaDA2: 32, fixed by its `generate`; SDAR: its config's `block_size`)."""

    config_key: str | None = None
    default: int | None = None
    causal_commit: bool = False      # AttentionKind.causal_commit

    def __call__(self, config: Config) -> AttentionKind:
        size = config.get(self.config_key) if self.config_key else None
        size = self.default if size is None else size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"config.json {self.config_key or 'block size'}={size!r}: a "
                             "block-causal model needs an int block size >= 1")
        return AttentionKind("block_causal", size, self.causal_commit)


def no_fused_tensors(config: Config) -> dict[str, tuple[int, ...]]:
    return {}


def as_is(config: Config) -> Config:
    return config


def llada2_fused_tensors(config: Config) -> dict[str, tuple[int, ...]]:
    """LLaDA2's fused QKV: rows [q of H heads | k of KV heads | v of KV heads] x head_dim."""
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    d = config.get("head_dim") or config["hidden_size"] // heads
    return {"model.layers.*.attention.query_key_value.weight": (heads * d, kv * d, kv * d)}


@dataclass(frozen=True, eq=False)
class Family:
    """One model family (see the module docstring)."""

    name: str                              # = ModelSpec.family
    model_types: tuple[str, ...]           # config.json model_type values (lower-cased)
    model_class: tuple[str, str]           # (module, class), imported lazily
    architecture: str                      # config.json "architectures" make-checkpoint writes
    logit_shift: int = 0                   # 1: row j-1 predicts position j (Dream)
    attention: Callable[[Config], AttentionKind] = full_attention
    default_block_length: int = 32         # full-attention families; block-causal: the block
    threshold_quota: bool = False          # Fast-dLLM's per-step quota (ModelSpec.threshold_quota)
    saber_dream: bool = False              # Saber's Dream rules (ModelSpec.saber_dream)
    fused_tensors: Callable[[Config], dict[str, tuple[int, ...]]] = no_fused_tensors
    # checkpoint tensor-name pattern (fnmatch) -> row sizes of its pieces, for tensor
    # parallelism and quantization: such a tensor is several projections side by side
    shapes: dict[str, Config] = field(default_factory=dict)    # built-in name -> config.json
    flat_config: Callable[[Config], Config] = as_is
    # config.json -> the flat dict ModelSpec and the model read (DiffusionGemma nests its text
    # model's keys under `text_config`)
    mask_token: bool = True                # False: uniform-state diffusion, no [MASK] token
                                           # (ModelSpec.mask_token_id is None)
    ignored_tensors: tuple[str, ...] = ()  # checkpoint tensor-name patterns (fnmatch) never
                                           # loaded nor built (a text-only model's vision tower)
    int4_group: int | None = None          # `quantization="int4"`'s group for this family
                                           # (None: layers/quantization/format.py's default)
    default_decoding: str = "cover"        # the engine's decoder when `decoding` is unset

    def model_cls(self) -> type:
        module, cls = self.model_class
        return getattr(importlib.import_module(module), cls)

    def block_length(self, config: Config, attention: AttentionKind) -> int:
        """The default block length: config.json's `default_block_length` when set, else the
        model's attention block (block-causal), else the family default."""
        explicit = config.get("default_block_length")
        if explicit is not None:
            return int(explicit)
        return attention.block_size if attention.is_block_causal else self.default_block_length

    def ignores(self, tensor: str) -> bool:
        """Whether checkpoint tensor `tensor` is one the family never loads."""
        return any(fnmatch.fnmatchcase(tensor, p) for p in self.ignored_tensors)

    def fused_pieces(self, tensor: str, config: Config) -> tuple[int, ...] | None:
        """Row sizes of the pieces of checkpoint tensor `tensor`, or None if it is not fused."""
        for pattern, pieces in self.fused_tensors(config).items():
            if fnmatch.fnmatchcase(tensor, pattern):
                return pieces
        return None


FAMILIES: tuple[Family, ...] = (
    Family("llada", ("llada",), ("cover_vllm.models.llada", "LLaDAModelLM"), "LLaDAModelLM",
           shapes={"llada-50m": configs.LLADA_50M, "llada-300m": configs.LLADA_300M,
                   "llada-8b": configs.LLADA_8B, "llada-1.5": configs.LLADA_8B}),
    # Dream-Coder is a shape of Dream: same architecture and vocabulary (configs.py).
    Family("dream", ("dream",), ("cover_vllm.models.dream", "DreamModel"), "DreamModel",
           logit_shift=1, threshold_quota=True, saber_dream=True,
           shapes={"dream-7b": configs.DREAM_7B, "dream-coder-7b": configs.DREAM_7B}),
    Family("llada_moe", ("lladamoe", "llada_moe"),
           ("cover_vllm.models.llada_moe", "LLaDAMoEModelLM"), "LLaDAMoEModelLM",
           shapes={"llada-moe-7b": configs.LLADA_MOE_7B}),
    # block 4 when a config lacks `block_size` (JetAstra/SDAR README: the Chat models decode
    # with block_length 4)
    Family("sdar", ("sdar",), ("cover_vllm.models.sdar", "SDARForCausalLM"), "SDARForCausalLM",
           attention=BlockCausal("block_size", default=4),
           shapes={"sdar-1.7b": configs.SDAR_1_7B, "sdar-4b": configs.SDAR_4B,
                   "sdar-8b": configs.SDAR_8B}),
    # block 32: the official `generate`'s block_length default (the config has no block key)
    Family("llada2", ("llada2_moe",), ("cover_vllm.models.llada2", "LLaDA2MoeModelLM"),
           "LLaDA2MoeModelLM", attention=BlockCausal(default=32),
           fused_tensors=llada2_fused_tensors,
           shapes={"llada2-mini": configs.LLADA2_MINI, "llada2.1-mini": configs.LLADA2_MINI}),
    # Nemotron-Labs-Diffusion: block 32 (config.json `block_size`); its own decodings
    # (`nemotron`, `ar`, `linear_spec`: models/nemotron_decode.py) commit each block causally
    Family("nemotron_labs_diffusion", ("nemotron_labs_diffusion",),
           ("cover_vllm.models.nemotron", "NemotronLabsDiffusionModel"),
           "NemotronLabsDiffusionModel", attention=BlockCausal("block_size", default=32, causal_commit=True),
           default_decoding="nemotron",
           shapes={"nemotron-diffusion-3b": configs.NEMOTRON_DIFFUSION_3B,
                   "nemotron-diffusion-8b": configs.NEMOTRON_DIFFUSION_8B,
                   "nemotron-diffusion-14b": configs.NEMOTRON_DIFFUSION_14B}),
    # uniform-state canvases (no [MASK]) decoded by its own sampler; the canvas (`canvas_length`)
    # is its block; text only:
    # the vision tower is never loaded; int4 groups of 64: Gemma 4's widths 704 and 2112 are
    # multiples of 64, not of 128
    Family("diffusion_gemma", ("diffusion_gemma",),
           ("cover_vllm.models.diffusion_gemma", "DiffusionGemmaForBlockDiffusion"),
           "DiffusionGemmaForBlockDiffusion", default_block_length=256,
           flat_config=flatten_config, mask_token=False,
           ignored_tensors=("model.encoder.vision_tower.*", "model.encoder.embed_vision.*"),
           int4_group=64, default_decoding="diffusion_gemma",
           shapes={"diffusion-gemma-26b-a4b": configs.DIFFUSION_GEMMA_26B_A4B,
                   "diffusion-gemma-mini": configs.DIFFUSION_GEMMA_MINI}),
)

_BY_NAME = {f.name: f for f in FAMILIES}
_BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.model_types}


def family_named(name: str) -> Family:
    """The family whose `name` (= ModelSpec.family) is `name`."""
    if name not in _BY_NAME:
        raise ValueError(f"model family {name!r} is not registered; registered: "
                         f"{sorted(_BY_NAME)}")
    return _BY_NAME[name]


def family_for_config(config: Config) -> Family:
    """The family serving config.json's `model_type` (case-insensitive)."""
    model_type = str(config.get("model_type", "")).lower()
    if model_type not in _BY_MODEL_TYPE:
        raise ValueError(f"config.json model_type={model_type!r} is not supported; "
                         f"supported: {sorted(_BY_MODEL_TYPE)}")
    return _BY_MODEL_TYPE[model_type]


def builtin_shapes() -> dict[str, Config]:
    """Every family's built-in shape names -> config.json contents (shared, do not mutate)."""
    shapes: dict[str, Config] = {}
    for family in FAMILIES:
        for name, config in family.shapes.items():
            if name in shapes:
                raise RuntimeError(f"built-in shape {name!r} is declared twice")
            shapes[name] = config
    return shapes


def __getattr__(name: str) -> Any:
    """`DUMMY_CONFIGS`: every built-in shape by name (`builtin_shapes()`), the table older
    callers read from configs.py."""
    if name == "DUMMY_CONFIGS":
        return builtin_shapes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

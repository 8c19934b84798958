"""Model spec: every model fact a strategy or the engine needs, read once from config.json.

Strategies never hard-code a mask id, an EOS id or the logit shift: they read this object. The
family facts (logit shift, attention kind, default block, decoder quirks) come from the family's
entry in the registry (models/registry.py); nothing here knows a family by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from cover_vllm.models.attention_kind import AttentionKind
from cover_vllm.models.registry import family_for_config


@dataclass(frozen=True)
class ModelSpec:
    """Architecture-independent facts about one checkpoint."""

    family: str                      # registry name: "llada" | "dream" | "llada_moe" | ...
    vocab_size: int                  # rows of the output head
    mask_token_id: int | None        # None: uniform-state diffusion (DiffusionGemma) has none
    eos_token_ids: tuple[int, ...]   # any of these ends generation (EOS and end-of-turn)
    pad_token_id: int
    logit_shift: int                 # 0: position j predicted by row j; 1: by row j-1 (Dream)
    max_model_len: int
    default_block_length: int = 32
    hidden_size: int = 0             # model width (sizes defaults such as the thread count)
    # Fast-dLLM's threshold decoder for this family reveals at most a per-step quota (masks/steps
    # plus a carry of skipped positions) and scores in float32 (Dream: dream/model/
    # generation_utils.py `_sample`, alg="confidence_threshold"); False: no quota (LLaDA).
    threshold_quota: bool = False
    saber_dream: bool = False        # Saber's decoder is its Dream port (Dream/generation_utils.py)
    attention: AttentionKind = AttentionKind()   # which keys each query row sees
    default_decoding: str = "cover"  # the family's decoder when the engine's `decoding` is unset
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # generation_config.json (the engine sets it; {} for a weightless shape): decoder defaults
    generation_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def uniform_state(self) -> bool:
        """No [MASK] token: canvases start uniformly random (DiffusionGemma)."""
        return self.mask_token_id is None

    def predictor_row(self, position: int) -> int:
        """Row whose logits predict canvas `position` (ALGORITHMS.md §1.2, π(s))."""
        return max(position - self.logit_shift, 0)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "ModelSpec":
        family = family_for_config(config)
        config = family.flat_config(config)
        if family.mask_token and "mask_token_id" not in config:
            raise ValueError("config.json has no 'mask_token_id'; a masked diffusion LM needs one")
        eos = config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        extra = config.get("eot_token_id")
        if extra is not None and extra not in eos_ids:
            eos_ids = eos_ids + (extra,)
        vocab = config.get("embedding_size") or config["vocab_size"]
        max_len = (config.get("max_sequence_length") or config.get("max_position_embeddings")
                   or 4096)
        pad = config.get("pad_token_id")
        attention = family.attention(config)
        return cls(
            family=family.name,
            vocab_size=int(vocab),
            mask_token_id=int(config["mask_token_id"]) if family.mask_token else None,
            eos_token_ids=tuple(int(e) for e in eos_ids),
            pad_token_id=int(pad if pad is not None else (eos_ids[0] if eos_ids else 0)),
            logit_shift=family.logit_shift,
            max_model_len=int(max_len),
            default_block_length=family.block_length(config, attention),
            hidden_size=int(config.get("d_model") or config.get("hidden_size") or 0),
            threshold_quota=family.threshold_quota,
            saber_dream=family.saber_dream,
            attention=attention,
            default_decoding=family.default_decoding,
            hf_config=dict(config),
        )

    def with_max_model_len(self, max_model_len: int | None) -> "ModelSpec":
        """This spec with the engine's `max_model_len` cap (None: the model's own length); a
        cap beyond the model's own is a ValueError naming both."""
        if max_model_len is None or max_model_len == self.max_model_len:
            return self
        if max_model_len > self.max_model_len:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's maximum length "
                f"{self.max_model_len} (config.json max_sequence_length / "
                f"max_position_embeddings); give at most {self.max_model_len}, or leave it "
                "unset")
        return replace(self, max_model_len=max_model_len)

    def with_generation_config(self, generation_config: dict[str, Any]) -> "ModelSpec":
        """This spec with the checkpoint's generation_config.json (decoder defaults)."""
        return replace(self, generation_config=dict(generation_config))

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelSpec":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {str(model_dir)!r}")
        return cls.from_config(json.loads(path.read_text()))

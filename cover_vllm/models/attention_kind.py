"""`AttentionKind`: which keys a query row sees, the one model fact both the registry (a
family's attention, a function of config.json) and `ModelSpec` (models/spec.py) hold."""

from __future__ import annotations

from dataclasses import dataclass

ATTENTION_KINDS = ("full", "block_causal")


@dataclass(frozen=True)
class AttentionKind:
    """Which keys a query row sees. `full`: every key of the canvas (LLaDA, Dream, LLaDA-MoE).
    `block_causal`: the canvas is cut into blocks of `block_size` aligned to absolute position 0,
    and a query in block b sees every key in blocks <= b (LLaDA2.x, SDAR). Room is left for more
    kinds (a sliding window would add its width here)."""

    kind: str = "full"
    block_size: int | None = None    # block_causal: the model's own block (a request's
                                     # block_length overrides it)
    causal_commit: bool = False      # block_causal: a finished block's K/V come from a causal
                                     # forward (Nemotron-Labs-Diffusion): rows before the
                                     # current block see keys <= their own position only

    def __post_init__(self) -> None:
        if self.kind not in ATTENTION_KINDS:
            raise ValueError(f"attention kind {self.kind!r}; choose one of {list(ATTENTION_KINDS)}")
        if self.kind == "block_causal" and (not isinstance(self.block_size, int)
                                            or self.block_size < 1):
            raise ValueError(f"block_causal attention needs a block_size >= 1, got "
                             f"{self.block_size!r}")

    @property
    def is_block_causal(self) -> bool:
        return self.kind == "block_causal"

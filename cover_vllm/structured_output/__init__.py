"""Structured outputs for diffusion decoding: a request's StructuredOutputsParams compiled into a
grammar (backend.py, xgrammar) and enforced on every decision of every decoder (constraint.py).

Diffusion decoders commit tokens anywhere in a block and revocable ones (COVER, WINO, Saber)
take committed tokens back, so the grammar cannot simply follow the sampled stream as in an
autoregressive engine. The rule here: the generated tokens are always a grammar-valid prefix
followed by [MASK]s. The strategy decides freely (its frontier row sees only grammar-allowed
tokens); the engine then keeps the longest run of its commits that extends the prefix validly,
rolls the grammar back where a check revised a token of the prefix, and ends the request once
the grammar has accepted an end-of-sequence token.
"""

from cover_vllm.structured_output.backend import GrammarBackend
from cover_vllm.structured_output.constraint import (GrammarState, constrain_decision,
                                                      mask_frontiers)

__all__ = ["GrammarBackend", "GrammarState", "constrain_decision", "mask_frontiers"]

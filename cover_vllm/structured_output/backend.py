"""GrammarBackend: StructuredOutputsParams -> a compiled xgrammar grammar over the engine's
vocabulary, and a fresh GrammarState per request.

xgrammar (not outlines-core) by measurement on this project's CPUs (docs/benchmarks.md,
"Structured outputs"): at a 100k byte-level vocabulary it masks and advances in ~2 us a token
against ~35 us, compiles a small JSON schema in ~1 ms against ~18 ms, rolls a matcher back
natively, and compiles EBNF grammars (vLLM's `grammar=`), which outlines-core cannot.

One TokenizerInfo and one caching GrammarCompiler per engine (its cache of compiled grammars
bounded by GRAMMAR_CACHE_BYTES: xgrammar's default is unbounded, a leak for a long-running
server that sees many distinct schemas), built on the first structured
request (importing transformers for the vocabulary takes a few seconds, so engines that never
see one never pay it). The vocabulary is the model's (`vocab_size` rows of the LM head); special
tokens other than the end-of-sequence ids, and [MASK], are blanked so no grammar allows them.
"""

from __future__ import annotations

import json
import re
from typing import Any

from cover_vllm.logger import init_logger
from cover_vllm.sampling_params import StructuredOutputsParams
from cover_vllm.structured_output.completion import closing_candidates
from cover_vllm.structured_output.constraint import GrammarState

logger = init_logger(__name__)
GRAMMAR_CACHE_BYTES = 64 << 20    # compiled grammars kept for reuse (xgrammar evicts past it)


def _encoded_vocab(tokenizer: Any, vocab_size: int, stop_ids: list[int]) -> list[bytes]:
    """Each token id's bytes as xgrammar decodes them (its detection of byte-level / byte
    fallback vocabularies)."""
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    hf = tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not isinstance(tokenizer, PreTrainedTokenizerFast):
        hf = PreTrainedTokenizerFast(tokenizer_object=backend)     # cover_vllm's LocalTokenizer
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stop_ids)
    return list(info.decoded_vocab)


_LOG_PREFIX = re.compile(r"^\[\d\d:\d\d:\d\d\] \S+:\d+: (Check failed: .*? is false: )?")


def _message(exc: Exception) -> str:
    """xgrammar's error without its C++ log prefix ("[07:52:37] file.cc:4944: ...")."""
    return _LOG_PREFIX.sub("", str(exc).strip().splitlines()[0])[:300]


class GrammarBackend:
    """Compiles constraints for one engine; `new_state` is what Engine.add_request calls."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: tuple[int, ...],
                 forbidden_ids: tuple[int, ...] = ()):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_ids = [int(t) for t in stop_ids]
        self.forbidden_ids = forbidden_ids
        self._compiler = None
        self.candidates: tuple[list[int], int] = ([], 0)   # set with the compiler: the
                                            # completion search order, how many closers

    @property
    def compiler(self):
        if self._compiler is None:
            import xgrammar as xgr

            vocab = _encoded_vocab(self.tokenizer, self.vocab_size, self.stop_ids)
            special = set(getattr(self.tokenizer, "all_special_ids", ()) or ())
            for t in (special | set(self.forbidden_ids)) - set(self.stop_ids):
                if 0 <= t < len(vocab):
                    vocab[t] = b""       # an empty token is special to xgrammar: never allowed
            info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=self.vocab_size,
                                     stop_token_ids=self.stop_ids)
            self.candidates = closing_candidates(vocab)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1,
                                                 cache_limit_bytes=GRAMMAR_CACHE_BYTES)
            logger.info("structured outputs: xgrammar over a %d-token vocabulary",
                        self.vocab_size)
        return self._compiler

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar; a malformed schema, regex or grammar is a ValueError naming the
        field (nothing is queued)."""
        kind = params.kind
        compiler = self.compiler
        try:
            if kind == "json":
                schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
                return compiler.compile_json_schema(
                    schema, any_whitespace=not params.disable_any_whitespace)
                # strict by default: no properties beyond the schema's (what vLLM's
                # disable_additional_properties asks of its guidance backend)
            if kind == "json_object":         # a JSON object (OpenAI's json_object), any keys
                return compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=not params.disable_any_whitespace)
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":   # one alternative per choice, each a JSON-escaped literal
                return compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(c) for c in params.choice))
            return compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"structured_outputs.{kind} could not be compiled: "
                             f"{_message(exc)}") from None

    def new_state(self, params: StructuredOutputsParams, prompt_len: int) -> GrammarState:
        compiled = self.compile(params)
        return GrammarState(compiled, prompt_len, self.stop_ids, self.vocab_size,
                            self.candidates)

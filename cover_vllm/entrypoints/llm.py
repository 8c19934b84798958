"""`from cover_vllm.entrypoints.llm import LLM` (vLLM's import path) keeps working: LLM lives in
cover_vllm/llm.py, below the commands and applications that use it."""

from cover_vllm.llm import LLM

__all__ = ["LLM"]

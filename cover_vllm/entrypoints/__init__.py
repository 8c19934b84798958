"""User-facing entry points: the offline `LLM` and the `cover-vllm` command line."""

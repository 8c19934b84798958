"""Benchmarks behind `cover-vllm bench`: commands that print measurements (never timed tests)."""

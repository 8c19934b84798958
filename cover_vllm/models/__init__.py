"""Model families (LLaDA, Dream, LLaDA-MoE, LLaDA2.x, SDAR; models/registry.py), their spec, and
checkpoint loading."""

from cover_vllm.layers.base import AttentionFn, ModelDims
from cover_vllm.models.base import DenseAttention, DiffusionLM
from cover_vllm.models.builtin import resolve_model, resolve_model_dir
from cover_vllm.models.loader import build_model, load_model, resolve_dtype
from cover_vllm.models.spec import ModelSpec

__all__ = ["AttentionFn", "DenseAttention", "DiffusionLM", "ModelDims", "ModelSpec",
           "build_model", "load_model", "resolve_dtype", "resolve_model", "resolve_model_dir"]

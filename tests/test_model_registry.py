"""The family registry (models/registry.py) is the one place that knows a model family: every
entry builds, names its own class, resolves its own shapes, and nothing else in the package
tests a family by name."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import cover_vllm
from cover_vllm.models import ModelSpec
from cover_vllm.models.llada2 import LLaDA2Attention
from cover_vllm.models.loader import build_model
from cover_vllm.models.registry import (FAMILIES, BlockCausal, builtin_shapes, family_for_config,
                                        family_named)

from golden_cases import GOLDEN


def test_model_types_and_names_are_unique():
    types = [t for f in FAMILIES for t in f.model_types]
    assert len(types) == len(set(types)) and all(t == t.lower() for t in types)
    assert len({f.name for f in FAMILIES}) == len(FAMILIES)
    assert {f.name for f in FAMILIES} >= {"llada", "dream", "llada_moe", "llada2", "sdar"}


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_each_shape_builds_its_own_family(family):
    assert family.model_cls().__name__ == family.architecture
    for name, config in family.shapes.items():
        spec = ModelSpec.from_config(config)
        assert family_for_config(config) is family and spec.family == family.name, name
        model = build_model(spec, torch.bfloat16, "meta")
        assert type(model) is family.model_cls()


def test_builtin_shapes_and_the_old_table_agree():
    from cover_vllm.models.registry import DUMMY_CONFIGS

    shapes = builtin_shapes()
    assert DUMMY_CONFIGS == shapes
    assert {"llada2-mini", "llada2.1-mini", "sdar-1.7b", "sdar-4b", "sdar-8b",
            "llada-8b", "llada-1.5", "dream-7b", "dream-coder-7b", "llada-moe-7b"} <= set(shapes)


def test_spec_flags_come_from_the_entry():
    for family in FAMILIES:
        for config in family.shapes.values():
            spec = ModelSpec.from_config(config)
            assert (spec.logit_shift, spec.threshold_quota, spec.saber_dream) == (
                family.logit_shift, family.threshold_quota, family.saber_dream)
    assert family_named("dream").logit_shift == 1 and family_named("dream").saber_dream
    assert not family_named("sdar").threshold_quota


def test_attention_kinds():
    cfg = {"model_type": "sdar", "mask_token_id": 1, "vocab_size": 2}
    assert ModelSpec.from_config({**cfg, "block_size": 16}).attention.block_size == 16
    assert ModelSpec.from_config(cfg).attention.block_size == 4       # released block
    assert ModelSpec.from_config({**cfg, "block_size": 16,
                                  "default_block_length": 8}).default_block_length == 8
    llada2 = ModelSpec.from_config({**cfg, "model_type": "llada2_moe"})
    assert (llada2.attention.kind, llada2.attention.block_size) == ("block_causal", 32)
    assert not ModelSpec.from_config({**cfg, "model_type": "llada"}).attention.is_block_causal
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="block_size"):
            BlockCausal("block_size")({"block_size": bad})


def test_unknown_model_type_lists_the_supported_ones():
    with pytest.raises(ValueError, match=r"model_type='gpt2'.*llada2_moe.*sdar"):
        ModelSpec.from_config({"model_type": "gpt2", "mask_token_id": 1})


def test_llada2_declares_its_fused_qkv_and_the_module_agrees():
    config = json.loads((GOLDEN / "llada2" / "model" / "config.json").read_text())
    family = family_named("llada2")
    name = "model.layers.2.attention.query_key_value.weight"
    assert family.fused_pieces(name, config) == (64, 32, 32)       # q 4x16, k 2x16, v 2x16
    assert family.fused_pieces("model.layers.2.attention.dense.weight", config) is None
    assert family_named("llada").fused_pieces(name, config) is None
    model = build_model(ModelSpec.from_config(config), torch.float32, "meta")
    attn = model.model.layers[2].attention
    assert isinstance(attn, LLaDA2Attention)
    assert attn.parallel_plan().column_splits == {"query_key_value": (64, 32, 32)}
    assert attn.query_key_value.weight.shape[0] == 128


def test_no_family_name_tests_outside_the_registry():
    """Family knowledge lives in the registry: no `family ==` / `family in` anywhere else."""
    package = Path(cover_vllm.__file__).parent
    pattern = re.compile(r"\.family\s*(==|!=|in\b)|family\s*==\s*[\"']")
    hits = [f"{p.relative_to(package)}:{i}" for p in package.rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, hits

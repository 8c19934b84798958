"""Golden logits: each family, loaded by cover_vllm's own loader, matches the official code.

Fixtures are the in-repo copy of ../shared/golden (tests/fixtures/golden/README.md describes them).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cover_vllm.models.dream import dream_position_ids
from cover_vllm.models.loader import load_model

GOLDEN = Path(__file__).parent / "fixtures" / "golden"
LOGIT_TOL = 1e-4
FAMILIES = ["llada", "dream", "llada_moe"]


@pytest.fixture(scope="module")
def outputs() -> dict[str, tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]]:
    """family -> (golden tensors, logits with attention_mask, logits without)."""
    result = {}
    for family in FAMILIES:
        model = load_model(GOLDEN / family / "model")
        golden = load_file(str(GOLDEN / family / "forward.safetensors"))
        with torch.no_grad():
            masked = model(golden["input_ids"], attention_mask=golden["attention_mask"])
            unmasked = model(golden["input_ids"])
        result[family] = (golden, masked, unmasked)
    return result


@pytest.mark.parametrize("family", FAMILIES)
def test_spec_reads_golden_config(family: str) -> None:
    model = load_model(GOLDEN / family / "model")
    spec = model.spec
    assert spec.family == family
    assert (spec.vocab_size, spec.mask_token_id, spec.eos_token_ids) == (300, 299, (298,))
    assert spec.logit_shift == (1 if family == "dream" else 0)
    assert model.dims.vocab_size == 300


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_golden(family: str, outputs) -> None:
    golden, masked, unmasked = outputs[family]
    assert masked.shape == golden["logits"].shape
    assert (unmasked - golden["logits_nomask"]).abs().max().item() <= LOGIT_TOL
    if family == "dream":
        # Padded query rows are fully masked in the official run; only real rows are defined.
        real = golden["attention_mask"].bool()
        diff = (masked[real] - golden["logits"][real]).abs().max().item()
    else:
        # LLaDA-style padding hides padded keys only, so padded rows are compared too.
        diff = (masked - golden["logits"]).abs().max().item()
    assert diff <= LOGIT_TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_padding_actually_changes_logits(family: str, outputs) -> None:
    """Guard against a silently ignored mask: only row 2 (left-padded) may change."""
    _, masked, unmasked = outputs[family]
    assert not torch.allclose(masked[2], unmasked[2], atol=1e-3)
    torch.testing.assert_close(masked[:2], unmasked[:2], atol=LOGIT_TOL, rtol=0)


def test_dream_position_ids_match_golden() -> None:
    golden = load_file(str(GOLDEN / "dream" / "forward.safetensors"))
    assert torch.equal(dream_position_ids(golden["attention_mask"]), golden["position_ids"])
    ones = torch.ones(2, 5, dtype=torch.long)
    assert torch.equal(dream_position_ids(ones), torch.arange(5).expand(2, 5))

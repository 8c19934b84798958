"""Checkpoint loading (single file, sharded, bad checkpoints), built-in shapes, and tokenizers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from cover_vllm.models.builtin import resolve_model
from cover_vllm.models.loader import build_model, init_dummy_weights, load_model
from cover_vllm.models.spec import ModelSpec
from cover_vllm.tokenizer import apply_chat_template, load_tokenizer

TINY_LLADA = {
    "model_type": "llada", "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
    "mlp_hidden_size": 48, "vocab_size": 64, "embedding_size": 64, "mask_token_id": 63,
    "eos_token_id": 62, "pad_token_id": 62, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
    "max_sequence_length": 128, "weight_tying": False,
}


def _tiny_state() -> dict[str, torch.Tensor]:
    model = build_model(ModelSpec.from_config(TINY_LLADA))
    init_dummy_weights(model, seed=1, std=0.3)
    return {name: p.detach().clone() for name, p in model.state_dict().items()}


def _write_checkpoint(path: Path, state: dict[str, torch.Tensor], shards: int = 1) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY_LLADA))
    if shards == 1:
        save_file(state, str(path / "model.safetensors"))
        return path
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: state[n] for n in names[i::shards]}
        save_file(part, str(path / shard))
        weight_map.update({n: shard for n in part})
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


def _logits(model_dir: Path) -> torch.Tensor:
    ids = torch.randint(0, 62, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return load_model(model_dir)(ids)


def test_sharded_checkpoint_equals_single_file(tmp_path: Path) -> None:
    state = _tiny_state()
    single = _write_checkpoint(tmp_path / "single", state)
    sharded = _write_checkpoint(tmp_path / "sharded", state, shards=2)
    assert len(list(sharded.glob("*.safetensors"))) == 2
    assert torch.equal(_logits(single), _logits(sharded))


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    state = _tiny_state()
    del state["model.transformer.blocks.1.up_proj.weight"]
    with pytest.raises(ValueError, match=r"blocks\.1\.up_proj\.weight"):
        load_model(_write_checkpoint(tmp_path, state))


def test_unexpected_tensor_is_named(tmp_path: Path) -> None:
    state = _tiny_state()
    state["model.transformer.blocks.0.extra.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"blocks\.0\.extra\.weight"):
        load_model(_write_checkpoint(tmp_path, state))


def test_wrong_shape_is_named(tmp_path: Path) -> None:
    state = _tiny_state()
    state["model.transformer.ln_f.weight"] = torch.ones(31)
    with pytest.raises(ValueError, match=r"ln_f\.weight.*\(31,\)"):
        load_model(_write_checkpoint(tmp_path, state))


@pytest.mark.parametrize("name, expected", [("llada-8b", 8.02e9), ("dream-7b", 7.6e9)])
def test_builtin_parameter_counts(name: str, expected: float) -> None:
    spec = ModelSpec.from_config(resolve_model(name).config)
    model = build_model(spec, device="meta")
    count = sum(p.numel() for p in model.parameters())
    assert abs(count - expected) <= 0.005 * expected, count


def test_builtin_specs() -> None:
    llada = ModelSpec.from_config(resolve_model("llada-8b").config)
    assert (llada.family, llada.vocab_size, llada.mask_token_id) == ("llada", 126464, 126336)
    assert llada.eos_token_ids == (126081, 126348) and llada.logit_shift == 0
    dream = ModelSpec.from_config(resolve_model("dream-7b").config)
    assert (dream.family, dream.vocab_size, dream.mask_token_id) == ("dream", 152064, 151666)
    assert dream.eos_token_ids == (151643, 151645) and dream.logit_shift == 1


def test_load_tokenizer_names_missing_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json.*vocab\.json.*merges\.txt"):
        load_tokenizer(tmp_path)


def _write_tiny_tokenizer(path: Path, chat_template: str | None) -> dict[str, int]:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(
        ["[UNK]", "<eos>", "<mask>", "user", "assistant", ":", "hello", "world", "hi"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]",
              "eos_token": "<eos>", "mask_token": "<mask>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return vocab


def test_load_tokenizer_and_chat_template(tmp_path: Path) -> None:
    template = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                "{% if add_generation_prompt %}assistant :{% endif %}")
    vocab = _write_tiny_tokenizer(tmp_path, template)
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.eos_token_id == vocab["<eos>"]
    assert tokenizer.mask_token_id == vocab["<mask>"]
    ids = apply_chat_template(tokenizer, [{"role": "user", "content": "hello world"}])
    words = ["user", ":", "hello", "world", "assistant", ":"]
    assert ids == [vocab[w] for w in words]


def test_apply_chat_template_without_template(tmp_path: Path) -> None:
    _write_tiny_tokenizer(tmp_path, chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(load_tokenizer(tmp_path), [{"role": "user", "content": "hi"}])


TINY_MOE = {
    "model_type": "lladamoe", "hidden_size": 32, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 6,
    "num_experts_per_tok": 2, "expert_intermediate_size": 16, "dense_intermediate_size": 40,
    "shared_expert_intermediate_size": 24, "moe_layer_freq": [0, 1, 1], "qk_layernorm": True,
    "partial_rotary_factor": 0.5, "rope_theta": 50000.0, "vocab_size": 64, "mask_token_id": 63,
    "eos_token_id": 62, "pad_token_id": 62, "rms_norm_eps": 1e-5,
    "moe_router_enable_expert_bias": True,
}


def test_llada_moe_dense_layer_shared_expert_and_expert_bias() -> None:
    model = build_model(ModelSpec.from_config(TINY_MOE))
    names = set(dict(model.named_parameters()))
    assert "model.layers.0.mlp.gate_proj.weight" in names          # dense layer 0
    assert model.model.layers[0].mlp.gate_proj.weight.shape == (40, 32)
    assert "model.layers.1.mlp.experts.5.down_proj.weight" in names
    assert "model.layers.1.shared_expert.up_proj.weight" in names
    assert "model.layers.0.shared_expert.up_proj.weight" not in names
    assert "model.layers.2.mlp.expert_bias" in names
    init_dummy_weights(model, seed=2, std=0.3)
    ids = torch.randint(0, 62, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids)
    assert logits.shape == (2, 9, 64) and bool(torch.isfinite(logits).all())


def test_moe_dispatch_equals_per_token_reference() -> None:
    moe = build_model(ModelSpec.from_config(TINY_MOE)).model.layers[1].mlp
    init_dummy_weights(moe, seed=3, std=0.3)
    with torch.no_grad():
        moe.expert_bias.copy_(torch.linspace(-0.05, 0.05, 6))
        x = torch.randn(17, 32, generator=torch.Generator().manual_seed(4))
        weights, chosen = moe.route(x)
        reference = torch.stack([
            sum(w * moe.experts[int(e)](x[t:t + 1])[0] for w, e in zip(weights[t], chosen[t]))
            for t in range(x.shape[0])])
        torch.testing.assert_close(moe(x), reference, atol=1e-5, rtol=1e-5)


def test_tokenizer_with_custom_class_loads_without_remote_code(tmp_path: Path) -> None:
    """Dream's tokenizer_config.json names tokenization_dream.DreamTokenizer; no code is run."""
    vocab = _write_tiny_tokenizer(tmp_path, chat_template=None)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="DreamTokenizer",
                  auto_map={"AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]})
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer("hello world")["input_ids"] == [vocab["hello"], vocab["world"]]


def test_llm_loads_sharded_checkpoint_with_tokenizer_and_chats(tmp_path: Path) -> None:
    """The whole user path: a sharded HF-style directory with a chat template, through LLM."""
    from cover_vllm import LLM, SamplingParams

    model_dir = _write_checkpoint(tmp_path / "ckpt", _tiny_state(), shards=3)
    template = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                "{% if add_generation_prompt %}assistant :{% endif %}")
    vocab = _write_tiny_tokenizer(model_dir, template)
    llm = LLM(str(model_dir), decoding="low_confidence", kv_cache="dual")
    params = SamplingParams(max_tokens=8, block_length=4, ignore_eos=True)
    (out,) = llm.chat([{"role": "user", "content": "hello world"}], params, use_tqdm=False)
    expect = [vocab[w] for w in ["user", ":", "hello", "world", "assistant", ":"]]
    assert out.prompt_token_ids == expect
    assert len(out.outputs[0].token_ids) == 8 and out.metrics.nfe == 8
    (same,) = llm.generate([{"prompt_token_ids": expect}], params, use_tqdm=False)
    assert same.outputs[0].token_ids == out.outputs[0].token_ids
    assert isinstance(out.outputs[0].text, str)


def test_local_tokenizer_matches_hugging_face_on_cover_tiny() -> None:
    """cover-tiny's plain fast tokenizer loads without transformers and gives the same ids and
    text as PreTrainedTokenizerFast for everything the engine, server and tasks call."""
    import random

    from transformers import PreTrainedTokenizerFast

    from cover_vllm.models.builtin import resolve_model_dir
    from cover_vllm.tasks import get_task, list_tasks
    from cover_vllm.tokenizer import LocalTokenizer, hf_tokenizer

    path = resolve_model_dir("cover-tiny")
    local = load_tokenizer(path)
    hf = hf_tokenizer(path)               # what load_tokenizer builds when LocalTokenizer can't
    assert isinstance(local, LocalTokenizer) and isinstance(hf, PreTrainedTokenizerFast)
    for attr in ("eos_token_id", "pad_token_id", "mask_token_id", "unk_token_id",
                 "bos_token_id", "chat_template"):
        assert getattr(local, attr) == getattr(hf, attr), attr
    assert sorted(local.all_special_ids) == sorted(hf.all_special_ids)
    assert len(local) == len(hf)
    assert local.convert_tokens_to_ids(["<|user|>", "<|assistant|>"]) == \
        hf.convert_tokens_to_ids(["<|user|>", "<|assistant|>"])
    rng = random.Random(0)
    texts = ["", "héllo wörld\t\n", "Mia has 3 pens.<|endoftext|><|pad|>"]
    for name in list_tasks():
        texts += [t for ex in (get_task(name).sample(rng) for _ in range(20))
                  for t in (ex.prompt, ex.answer)]
    for text in texts:
        assert local.encode(text) == hf.encode(text)
        assert local(text)["input_ids"] == hf(text)["input_ids"]
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": text},
                    {"role": "assistant", "content": "ok"}, {"role": "user", "content": text}]
        for gen in (True, False):       # return_dict: transformers 5's default is True, 4's False
            assert local.apply_chat_template(messages, add_generation_prompt=gen) == list(
                hf.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True,
                                       return_dict=False))
            as_dict = hf.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True,
                                             return_dict=True)        # 4.x adds token_type_ids
            assert local.apply_chat_template(messages, add_generation_prompt=gen,
                                             return_dict=True) == {
                k: as_dict[k] for k in ("input_ids", "attention_mask")}
            assert local.apply_chat_template(messages, add_generation_prompt=gen,
                                             tokenize=False) == hf.apply_chat_template(
                messages, add_generation_prompt=gen, tokenize=False)
    for _ in range(200):                       # random ids, special tokens included
        ids = [rng.randrange(len(hf)) for _ in range(rng.randint(0, 30))]
        for skip in (False, True):
            assert local.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip)
    assert apply_chat_template(local, [{"role": "user", "content": "12+30="}]) == \
        apply_chat_template(hf, [{"role": "user", "content": "12+30="}])


def test_hugging_face_tokenizer_keeps_additional_special_tokens_special(tmp_path: Path) -> None:
    """A tokenizer_config.json saved by transformers 4.5x (`additional_special_tokens` and an
    empty `extra_special_tokens`), loaded through the Hugging Face class (here because decode
    cleans up spaces): the chat roles stay special under transformers 4 and 5 alike."""
    import shutil

    from cover_vllm.models.builtin import resolve_model_dir
    from cover_vllm.tokenizer import LocalTokenizer

    src = resolve_model_dir("cover-tiny")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["extra_special_tokens"] == {} and config["additional_special_tokens"]
    config["clean_up_tokenization_spaces"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(tmp_path)
    assert not isinstance(tok, LocalTokenizer)
    roles = tok.convert_tokens_to_ids(["<|system|>", "<|user|>", "<|assistant|>"])
    assert set(roles) <= set(tok.all_special_ids)
    ids = tok.encode("<|user|>12+30=<|assistant|>42", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "12+30=42"


def test_cover_tiny_loads_without_importing_transformers() -> None:
    import subprocess
    import sys

    code = ("import sys, time; t = time.perf_counter(); from cover_vllm import LLM; "
            "from cover_vllm import SamplingParams; llm = LLM('cover-tiny', kv_cache='none'); "
            "(o,) = llm.chat([{'role': 'user', 'content': '384+250='}], "
            "SamplingParams(max_tokens=32), use_tqdm=False); assert o.outputs[0].text.endswith('=634'), o.outputs[0].text; "
            "print('transformers' in sys.modules, round(time.perf_counter() - t, 2))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    imported, _seconds = out.stdout.split()
    assert imported == "False"


@pytest.mark.parametrize("family", ["llada", "dream", "llada_moe"])
def test_fused_projections_equal_separate_ones_and_never_go_stale(family):
    """Loading fuses q/k/v and gate/up into one GEMM each (their weights become views of one
    tensor); the logits equal the unfused layers', and a weight re-allocated behind the fused
    tensor's back (as `model.to(...)` does) makes the group fall back to separate GEMMs."""
    from cover_vllm.layers.common import FusedLinears

    golden = Path(__file__).parent / "fixtures" / "golden" / family / "model"
    model = load_model(golden)
    groups = [g for m in model.modules() if hasattr(m, "fused_groups") for g in m.fused_groups()]
    assert groups and all(isinstance(g, FusedLinears) and g._fused() for g in groups)
    ids = torch.arange(24).reshape(2, 12) % 200
    with torch.no_grad():
        fused = model(ids)
        first = groups[0].linears[0]
        first.weight.data = first.weight.data.clone()          # no longer a slice
        assert not groups[0]._fused()
        for g in groups:
            g.weight = None                                    # every group unfused
        separate = model(ids)
    assert (fused - separate).abs().max().item() <= 1e-5

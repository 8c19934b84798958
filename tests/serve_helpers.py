"""Test helpers for the server tests: the model to serve and a running in-process server.

The model is the shipped `cover-tiny` when it is installed, else a tiny random-weight LLaDA with
a word-level tokenizer and a chat template written to a temporary directory, so the tests work
before and after cover-tiny exists.
"""

from __future__ import annotations

import json
from pathlib import Path

from cover_vllm.models.builtin import BUILTIN_DIRS

WORDS = (["[UNK]", "<eos>", "<mask>", "user", "assistant", "system", ":", "what", "is", "hello",
          "world", "the", "sum", "of", "and", "?", "+", "=", "."]
         + [str(d) for d in range(10)])
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant :{% endif %}")
TINY_CONFIG = {
    "model_type": "llada", "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
    "mlp_hidden_size": 48, "vocab_size": 64, "embedding_size": 64, "mask_token_id": 2,
    "eos_token_id": 1, "pad_token_id": 1, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
    "max_sequence_length": 512, "weight_tying": False,
}
PROMPTS = ["what is 1 + 2 ?", "hello world", "the sum of 3 and 4 is", "what is 9 + 9 ?",
           "hello", "5 + 5 = 1 0 .", "what is the sum of 7 and 8 ?", "world hello world",
           "1 2 3 4", "is 6 + 1 = 7 ?", "the world", "hello 4 + 4", "what is 2 + 2 ?",
           "sum of 1 and 1", "9 8 7", "hello world ."]


def _write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(WORDS)}
    vocab.update({f"w{i}": i for i in range(len(WORDS), TINY_CONFIG["vocab_size"])})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)])
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]",
              "eos_token": "<eos>", "mask_token": "<mask>", "chat_template": CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def write_tiny_model(path: Path) -> str:
    """A random-weight LLaDA checkpoint with a tokenizer and chat template in `path`."""
    from safetensors.torch import save_file

    from cover_vllm.models.loader import build_model, init_dummy_weights
    from cover_vllm.models.spec import ModelSpec

    path.mkdir(parents=True, exist_ok=True)
    model = build_model(ModelSpec.from_config(TINY_CONFIG))
    init_dummy_weights(model, seed=3, std=0.3)
    for name, p in model.named_parameters():
        if p.dim() == 1:          # LLaDA has no biases: every vector is a norm weight (ln_f too)
            p.data.fill_(1.0)
    save_file({n: p.detach().clone() for n, p in model.state_dict().items()},
              str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(TINY_CONFIG))
    _write_tokenizer(path)
    return str(path)


def serving_model(tmp_root: Path) -> str:
    """cover-tiny when installed, else a tiny random checkpoint written under `tmp_root`."""
    if (BUILTIN_DIRS["cover-tiny"] / "config.json").is_file():
        return "cover-tiny"
    return write_tiny_model(tmp_root / "tiny-llada")


def start_server(model: str, api_key: str | None = None, **engine_kwargs):
    """A started ServerThread over a fresh engine (default decoding low_confidence); call
    .stop() when done."""
    from cover_vllm.config import EngineConfig
    from cover_vllm.engine.engine import Engine
    from cover_vllm.entrypoints.server import ServerThread

    config = EngineConfig(model=model, **{"decoding": "low_confidence", **engine_kwargs})
    return ServerThread(Engine(config), model_name="test-model", api_key=api_key).start()


def openai_client(server, timeout: float = 120):
    """The official `openai` client for a started server (no retries: a failure shows)."""
    import openai

    return openai.OpenAI(api_key="unused", base_url=server.url + "/v1", max_retries=0,
                         timeout=timeout)

"""Hugging Face repo ids as models, against a stand-in hub on 127.0.0.1 (tests/hub_stub.py: the
model-info and resolve routes huggingface_hub calls), not against mocks of the client: the CLI
downloads cover-tiny's files (and only the files the engine reads) with a progress bar, then runs
from the cache offline; revisions, download_dir, HF_TOKEN, a tokenizer repo, the server's model
name, and one download for every tensor-parallel rank."""

from __future__ import annotations

import json

import huggingface_hub.constants
import pytest
from hub_stub import HubStub, files_of

from cover_vllm import LLM
from cover_vllm.config import EngineConfig
from cover_vllm.entrypoints.cli import main
from cover_vllm.models.builtin import ASSETS, local_config, resolve_engine_model, resolve_model
from cover_vllm.models.hub import looks_like_repo_id

REPO = "cover-org/cover-tiny-chat"
TOKENIZER_REPO = "cover-org/tokenizer-only"
DECOYS = {"README.md": b"# model card", "modeling_llada.py": b"raise SystemExit('ran')",
          "pytorch_model.bin": b"\0" * 64}
CHAT = [{"role": "user", "content": "384+250="}]


def _repos() -> dict:
    tiny = files_of(ASSETS / "cover-tiny")
    v2 = dict(tiny, **{"generation_config.json": json.dumps({"max_new_tokens": 8}).encode()})
    tokenizer = {k: v for k, v in tiny.items() if k.startswith(("tokenizer", "special"))}
    return {REPO: {"main": {**tiny, **DECOYS}, "v2": v2},
            TOKENIZER_REPO: {"main": {**tokenizer, **DECOYS}}}


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """The stand-in hub, HF_ENDPOINT pointing at it, an empty HF_HOME, online."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE",
                 "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    # huggingface_hub reads these two once at import: a CI that exports HF_HUB_OFFLINE=1 or
    # disables progress bars must not turn this test's online hub off
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_PROGRESS_BARS", None)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    with HubStub(_repos()) as stub:
        monkeypatch.setenv("HF_ENDPOINT", stub.url)
        yield stub


def _downloaded(stub: HubStub) -> set[str]:
    return {path.rsplit("/", 1)[-1] for path in stub.fetched("GET") if "/resolve/" in path}


def _model_info_calls(stub: HubStub) -> int:
    """snapshot_download's first request, once per download (huggingface_hub 1.x/2.x then
    lists the commit's tree: a second /api/models/ request of the same download)."""
    return sum(path.startswith(f"/api/models/{REPO}/revision/") for path in stub.fetched())


def test_generate_downloads_from_the_hub_then_runs_offline_from_the_cache(hub, tmp_path,
                                                                          monkeypatch, capsys):
    argv = ["generate", REPO, "--prompt", "384+250=", "--chat", "--threads", "1"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert out.strip().endswith("=634")                  # cover-tiny's worked addition
    assert "Fetching 6 files" in err and "100%" in err   # huggingface_hub's progress bar
    assert _downloaded(hub) == {"config.json", "generation_config.json", "model.safetensors",
                                "special_tokens_map.json", "tokenizer.json",
                                "tokenizer_config.json"}           # no README, .py or .bin
    snapshot = tmp_path / "hf-home" / "hub" / "models--cover-org--cover-tiny-chat" / "snapshots"
    assert [p.name for p in snapshot.iterdir()] == [hub.sha(REPO)]

    hub.stop()                                           # the hub is gone: offline from cache
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(argv) == 0
    assert capsys.readouterr().out.strip().endswith("=634")

    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-home"))   # offline, nothing cached
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert REPO in err and "HF_HUB_OFFLINE" in err


def test_llm_takes_a_hub_id_with_revision_download_dir_and_token(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    llm = LLM(REPO, num_threads=1)
    assert llm.get_default_sampling_params().max_tokens == 32
    assert llm.chat(CHAT, use_tqdm=False)[0].outputs[0].text.endswith("=634")
    assert {auth for _, _, auth in hub.requests} == {"Bearer hf_test_token"}

    v2 = LLM(REPO, revision="v2", download_dir=str(tmp_path / "dl"), num_threads=1)
    assert v2.get_default_sampling_params().max_tokens == 8     # v2's generation_config.json
    assert v2.engine.tokenizer_dir == (tmp_path / "dl" / "models--cover-org--cover-tiny-chat"
                                       / "snapshots" / hub.sha(REPO, "v2"))
    assert f"/api/models/{REPO}/revision/v2" in hub.fetched()
    assert LLM(REPO, revision=hub.sha(REPO, "v2"), download_dir=str(tmp_path / "dl"),
               num_threads=1).get_default_sampling_params().max_tokens == 8   # a commit sha


def test_a_tokenizer_repo_for_a_checkpoint_without_one(hub, tmp_path):
    weights_only = tmp_path / "weights-only"
    weights_only.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (weights_only / name).write_bytes((ASSETS / "cover-tiny" / name).read_bytes())
    llm = LLM(str(weights_only), tokenizer=TOKENIZER_REPO, num_threads=1)
    assert llm.get_tokenizer().decode(llm.get_tokenizer().encode("384+250=")) == "384+250="
    assert llm.chat(CHAT, use_tqdm=False)[0].outputs[0].text.endswith("=634")
    assert not _downloaded(hub) & set(DECOYS)


@pytest.mark.parametrize("argv", [
    ["eval", "--model", REPO, "--task", "arith", "--num", "2", "--decoding", "low_confidence",
     "--no-tqdm"],
    ["bench", "latency", "--model", REPO, "--decoding", "low_confidence", "--repeats", "1",
     "--input-len", "8", "--output-len", "16"]], ids=["eval", "bench-latency"])
def test_every_command_takes_a_hub_id(hub, argv, capsys):
    assert main([*argv, "--threads", "1"]) == 0, capsys.readouterr().err
    assert "model.safetensors" in _downloaded(hub)


def test_hub_errors_name_the_repo_and_the_revision(hub):
    with pytest.raises(ValueError, match="cover-org/no-such-model"):
        resolve_model("cover-org/no-such-model")
    with pytest.raises(ValueError, match="revision='v9'"):
        resolve_model(REPO, revision="v9")


def test_ranks_and_replicas_get_the_local_snapshot(hub):
    """The driver resolves once; what TP ranks and DP replicas receive names no hub id."""
    config = EngineConfig(REPO, revision="v2", tokenizer=TOKENIZER_REPO)
    resolved = resolve_engine_model(config)
    local = local_config(config, resolved)
    assert local.model == str(resolved.path) and local.revision is None
    assert local.tokenizer == str(resolved.tokenizer_path) and local.tokenizer_revision is None
    before = len(hub.requests)
    assert resolve_engine_model(local).path == resolved.path
    assert len(hub.requests) == before                  # nothing asked of the hub again
    assert local_config(EngineConfig("cover-tiny"), resolve_model("cover-tiny")).model \
        == "cover-tiny"
    # tokenizer_revision alone: the model repo's tokenizer at that revision (as in vLLM)
    split = resolve_engine_model(EngineConfig(REPO, tokenizer_revision="v2"))
    assert (split.path.name, split.tokenizer_dir.name) == (hub.sha(REPO), hub.sha(REPO, "v2"))


@pytest.mark.parametrize("name,repo", [("org/name", True), ("GSAI-ML/LLaDA-8B-Instruct", True),
                                       ("./dir", False), ("../a/b", False), ("/abs/dir", False),
                                       ("a/b/c", False), ("cover-tiny", False),
                                       ("org/..", False)])
def test_what_counts_as_a_repo_id(name, repo):
    assert looks_like_repo_id(name) is repo


def test_serve_takes_a_hub_id_and_names_the_model_by_it(hub):
    pytest.importorskip("fastapi")
    import httpx

    from cover_vllm.entrypoints.cli import build_parser
    from cover_vllm.entrypoints.serve_cli import serve_args
    from cover_vllm.entrypoints.server import ServerThread

    ns = build_parser().parse_args(["serve", REPO, "--port", "0", "--threads", "1",
                                    "--max-model-len", "64", "--trust-remote-code"])
    with ServerThread.from_args(serve_args(ns)) as server:
        models = httpx.get(f"{server.url}/v1/models").json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [(REPO, 64)]
        reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": REPO, "messages": CHAT}).json()
        assert reply["choices"][0]["message"]["content"].endswith("=634")


@pytest.mark.slow
def test_tensor_parallel_ranks_do_not_download_again(hub):
    """Two mp ranks: the driver's one model-info call is the only one the hub sees."""
    with LLM(REPO, tensor_parallel_size=2, distributed_executor_backend="mp",
             num_threads=1) as llm:
        assert llm.chat(CHAT, use_tqdm=False)[0].outputs[0].text.endswith("=634")
    assert _model_info_calls(hub) == 1


@pytest.mark.slow
@pytest.mark.ray
def test_data_parallel_replicas_get_the_snapshot_not_the_hub_id(hub, ray_session):
    """`serve <hub id> -dp 2`: the server downloads once; each Ray replica loads the local
    snapshot (the replicas' environment does not even point at the stand-in hub)."""
    pytest.importorskip("fastapi")
    import httpx

    from cover_vllm.entrypoints.cli import build_parser
    from cover_vllm.entrypoints.serve_cli import serve_args
    from cover_vllm.entrypoints.server import ServerThread

    ns = build_parser().parse_args(["serve", REPO, "--port", "0", "--threads", "1",
                                    "--data-parallel-size", "2"])
    with ServerThread.from_args(serve_args(ns)) as server:
        reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": REPO, "messages": CHAT}).json()
        assert reply["choices"][0]["message"]["content"].endswith("=634")
    assert _model_info_calls(hub) == 1

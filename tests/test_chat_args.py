"""vLLM's chat surface (#41): `LLM.chat`'s template arguments and the server's checks of the
messages offline, `serve --chat-template` / `--model` / the logging flags, and
`cover-vllm --version`."""

import pytest

from cover_vllm import LLM, SamplingParams, __version__
from cover_vllm.chat import ChatTemplateOptions, load_chat_template
from cover_vllm.entrypoints.cli import build_parser, main

MSGS = [{"role": "user", "content": "384+250="}]
# cover-tiny's roles, each turn spelled out as a word: the prompt changes, the tokens stay its own
PLAIN = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
         "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("cover-tiny", num_threads=1)


def _prompt(llm: LLM, messages=MSGS, **options) -> list[int]:
    out = llm.chat(messages, SamplingParams(max_tokens=4), use_tqdm=False, **options)
    return out[0].prompt_token_ids


def _ids(llm: LLM, text: str) -> list[int]:
    return llm.get_tokenizer().encode(text, add_special_tokens=False)


def test_chat_takes_a_template_inline_or_from_a_file(llm, tmp_path):
    assert _prompt(llm) == _ids(llm, "<|user|>384+250=<|assistant|>")
    assert _prompt(llm, chat_template=PLAIN) == _ids(llm, "user: 384+250=\n<|assistant|>")
    path = tmp_path / "plain.jinja"
    path.write_text(PLAIN)
    assert _prompt(llm, chat_template=str(path)) == _prompt(llm, chat_template=PLAIN)


def test_chat_add_generation_prompt_false_leaves_the_assistant_turn_unopened(llm):
    assert _prompt(llm, add_generation_prompt=False) == _ids(llm, "<|user|>384+250=")


def test_chat_continue_final_message_continues_the_assistant_turn(llm):
    """The prompt ends inside the assistant's message (no <|endoftext|> after it), and the
    model picks up the worked addition where it stands."""
    msgs = MSGS + [{"role": "assistant", "content": "0+4+0=04\n"}]
    ids = _prompt(llm, msgs, add_generation_prompt=False, continue_final_message=True)
    assert ids == _ids(llm, "<|user|>384+250=<|assistant|>0+4+0=04\n")
    out = llm.chat(msgs, SamplingParams(max_tokens=32), use_tqdm=False,
                   add_generation_prompt=False, continue_final_message=True)
    assert out[0].outputs[0].text.startswith("5+8+0=13")
    with pytest.raises(ValueError, match="continue_final_message=True .* "
                                         "add_generation_prompt=False"):
        _prompt(llm, msgs, continue_final_message=True)


def test_chat_template_kwargs_reach_the_template(llm):
    template = "{% if terse %}<|user|>{% endif %}{{ messages[0]['content'] }}<|assistant|>"
    assert _prompt(llm, chat_template=template, chat_template_kwargs={"terse": True}) == \
        _ids(llm, "<|user|>384+250=<|assistant|>")
    assert _prompt(llm, chat_template=template) == _ids(llm, "384+250=<|assistant|>")


def test_chat_refuses_an_unknown_keyword_naming_the_valid_ones(llm):
    with pytest.raises(TypeError, match=r"\['tools'\].*add_generation_prompt"):
        llm.chat(MSGS, tools=[])


@pytest.mark.parametrize("messages,words", [
    ([{"role": "wizard", "content": "hi"}], "messages[0].role: role must be one of "
                                            "['system', 'developer', 'user', 'assistant']"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content"),
    ([{"role": "user"}], "messages[0] must be a dict with 'role' and 'content'"),
    ([MSGS, [{"role": "tool", "content": "x"}]], "messages[1][0].role"),
])
def test_chat_checks_messages_as_the_server_does(llm, messages, words):
    with pytest.raises(ValueError) as exc:
        llm.chat(messages, use_tqdm=False)
    assert words in str(exc.value)


def test_chat_template_values_are_read_as_vllm_reads_them(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        load_chat_template("missing.jinja")
    with pytest.raises(ValueError, match="does not parse as Jinja"):
        load_chat_template("{% for m in messages %}")
    assert load_chat_template("{{ x }}") == "{{ x }}"
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        ChatTemplateOptions(chat_template_kwargs=["x"])


# ---- command line and server ------------------------------------------------------------------
def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == __version__


def test_serve_takes_the_model_as_an_option_or_positional(capsys):
    from cover_vllm.entrypoints.serve_cli import serve_model

    parse = build_parser().parse_args
    assert serve_model(parse(["serve", "--model", "cover-tiny"])) == "cover-tiny"
    assert serve_model(parse(["serve", "cover-tiny"])) == "cover-tiny"
    assert main(["serve", "--port", "0"]) == 2
    assert "serve needs one model" in capsys.readouterr().err
    assert main(["serve", "cover-tiny", "--model", "llada-50m"]) == 2


def test_serve_logging_flags(capsys):
    ns = build_parser().parse_args(["serve", "cover-tiny", "--uvicorn-log-level", "warning",
                                    "--disable-log-requests", "--disable-log-stats"])
    assert ns.uvicorn_log_level == "warning"
    assert ns.vllm_only == {"disable_log_requests": True, "disable_log_stats": True}
    assert main(["serve", "cover-tiny", "--enable-log-requests"]) == 2
    assert "enable_log_requests=True: the server logs no request contents" in \
        capsys.readouterr().err


def _chat(server, **body) -> dict:
    import httpx

    body = {"model": "cover-tiny", "messages": MSGS, "max_tokens": 4,
            "return_token_ids": True, **body}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()


def test_serve_chat_template_changes_the_prompt_a_chat_request_produces(llm, tmp_path):
    pytest.importorskip("fastapi")
    from cover_vllm.entrypoints.serve_cli import serve_args
    from cover_vllm.entrypoints.server import ServerThread

    path = tmp_path / "plain.jinja"
    path.write_text(PLAIN)
    flags = ["serve", "--model", "cover-tiny", "--port", "0", "--threads", "1"]
    with ServerThread.from_args(serve_args(build_parser().parse_args(flags))) as server:
        default = _chat(server)["prompt_token_ids"]
        bad = _chat(server, messages=[{"role": "wizard", "content": "x"}])
        both = _chat(server, continue_final_message=True)
        unopened = _chat(server, add_generation_prompt=False)["prompt_token_ids"]
    with ServerThread.from_args(serve_args(build_parser().parse_args(
            flags + ["--chat-template", str(path)]))) as server:
        templated = _chat(server)["prompt_token_ids"]
    assert default == _ids(llm, "<|user|>384+250=<|assistant|>")
    assert templated == _ids(llm, "user: 384+250=\n<|assistant|>") != default
    assert unopened == _ids(llm, "<|user|>384+250=")
    assert bad["error"]["param"] == "messages.0.role"
    assert both["error"]["param"] == "continue_final_message"

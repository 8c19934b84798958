"""OpenAI chat fields that clients send by default, through the pinned openai client's own request
path: the ignored ones answer 200 (logged once), `tools` with `tool_choice: "none"` reach the chat
template, and what would change the answer silently is refused with the reason (issue #52)."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from serve_helpers import openai_client, serving_model, start_server  # noqa: E402

MESSAGES = [{"role": "user", "content": "hello"}]
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "add two numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}}]
TOOLS_TEMPLATE = ("{% if tools %}tools: {% for t in tools %}{{ t['function']['name'] }} "
                  "{% endfor %}{% endif %}{% for m in messages %}{{ m['content'] }} {% endfor %}")
IGNORED = {"store": False, "metadata": {"k": "v"}, "service_tier": "auto",
           "reasoning_effort": "low", "parallel_tool_calls": False, "user": "someone",
           "prediction": {"type": "content", "content": "hello"}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(serving_model(tmp_path_factory.mktemp("fields-model")))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def _chat(client, extra: dict | None = None, **fields):
    return client.chat.completions.create(model="test-model", messages=MESSAGES, max_tokens=4,
                                          temperature=0,
                                          extra_body={"block_length": 4, **(extra or {})},
                                          **fields)


@pytest.mark.parametrize("name", sorted(IGNORED))
def test_ignored_field_is_accepted(client, name) -> None:
    plain = _chat(client).choices[0].message.content
    assert _chat(client, **{name: IGNORED[name]}).choices[0].message.content == plain


def test_ignored_fields_are_logged_once(client, server, caplog) -> None:
    server.app.state.ctx.ignored_logged.clear()
    with caplog.at_level(logging.INFO, logger="cover_vllm.entrypoints.server.serving"):
        _chat(client, **IGNORED)
        _chat(client, **IGNORED)
    lines = [r.getMessage() for r in caplog.records if "accepted and ignored" in r.getMessage()]
    assert sorted(line.split("'")[1] for line in lines) == sorted(IGNORED)


def test_tools_reach_the_template(client, server) -> None:
    """The template's rendering of the tools is the prompt the model sees (usage counts it)."""
    ctx = server.app.state.ctx
    ctx.chat_template = TOOLS_TEMPLATE
    try:
        plain = _chat(client, tool_choice="none")
        with_tools = _chat(client, tools=TOOLS, tool_choice="none")
    finally:
        ctx.chat_template = None
    expected = len(ctx.tokenizer.encode("tools: add hello ", add_special_tokens=False))
    assert with_tools.usage.prompt_tokens == expected
    assert plain.usage.prompt_tokens < expected
    assert with_tools.choices[0].message.tool_calls is None


def test_tools_refused_when_the_template_cannot_render_them(client) -> None:
    with pytest.raises(openai.BadRequestError, match="never reads `tools`") as err:
        _chat(client, tools=TOOLS, tool_choice="none")
    assert err.value.body["param"] == "tools"


@pytest.mark.parametrize("choice", ["auto", "required",
                                    {"type": "function", "function": {"name": "add"}}])
def test_tool_choice_that_changes_the_answer_is_refused(client, choice) -> None:
    with pytest.raises(openai.BadRequestError, match="no tool-call parser") as err:
        _chat(client, tools=TOOLS, tool_choice=choice)
    assert err.value.body["param"] == "tool_choice"


def test_unknown_fields_are_still_refused(client) -> None:
    with pytest.raises(openai.BadRequestError, match="unknown or unsupported field 'decodng'"):
        _chat(client, {"decodng": "cover"})

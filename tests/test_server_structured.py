"""Structured outputs through the OpenAI server with the official `openai` client: OpenAI's
`response_format` (json_schema, json_object) and vLLM's `structured_outputs` extra field (regex,
choice, json, grammar) give output that parses and validates on every request, with the
`cover`, `threshold` and `low_confidence` decoders, streamed, and with n=2. Malformed formats and
constraints, both fields at once, vLLM's removed `guided_*` fields and a model without a
tokenizer are 400s naming the field, and the server keeps serving after each."""

from __future__ import annotations

import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from serve_helpers import start_server  # noqa: E402

from cover_vllm.models.builtin import BUILTIN_DIRS  # noqa: E402

DECODINGS = ["cover", "threshold", "low_confidence"]
PROMPTS = ["347+158=", "what is 2+2?", "hello", "The capital of France is", "1, 2, 3,",
           "Answer in JSON:"]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}},
          "required": ["answer"]}
JSON_SCHEMA = {"type": "json_schema",
               "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
REGEX = r"[0-9]{1,4}-[a-z]{2,6}"
CHOICES = ["positive", "negative", "neutral"]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def server():
    srv = start_server("cover-tiny")
    yield srv
    srv.stop()


def _check_answer(text: str) -> None:
    """`text` is a JSON document valid under SCHEMA."""
    obj = json.loads(text)
    assert isinstance(obj, dict) and "answer" in obj, text
    assert isinstance(obj["answer"], int) and not isinstance(obj["answer"], bool), text


def _check_regex(text: str) -> None:
    assert re.fullmatch(REGEX, text), text


def _check_choice(text: str) -> None:
    assert text in CHOICES, text


def _complete(client, extra: dict, **kwargs):
    return client.completions.create(model="test-model", prompt=PROMPTS, max_tokens=MAX_TOKENS,
                                     extra_body=extra, **kwargs)


def _chat(client, prompts: list[str], **kwargs) -> list:
    """One chat request per prompt, sent concurrently (batched by the engine)."""
    def one(prompt):
        return client.chat.completions.create(
            model="test-model", messages=[{"role": "user", "content": prompt}],
            max_tokens=MAX_TOKENS, **kwargs)

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


@pytest.mark.parametrize("decoding", DECODINGS)
def test_json_schema_response_format_validates_every_time(client, decoding) -> None:
    resp = _complete(client, {"decoding": decoding, "response_format": JSON_SCHEMA})
    assert len(resp.choices) == len(PROMPTS)
    for choice in resp.choices:
        _check_answer(choice.text)
        assert choice.finish_reason in ("stop", "length")
    chats = _chat(client, PROMPTS, response_format=JSON_SCHEMA,
                  extra_body={"decoding": decoding})
    for chat in chats:
        _check_answer(chat.choices[0].message.content)


@pytest.mark.parametrize("decoding", DECODINGS)
def test_structured_outputs_regex_and_choice_validate_every_time(client, decoding) -> None:
    regex = _complete(client, {"decoding": decoding, "structured_outputs": {"regex": REGEX}})
    assert len(regex.choices) == len(PROMPTS)
    for choice in regex.choices:
        _check_regex(choice.text)
    choice = _complete(client, {"decoding": decoding,
                                "structured_outputs": {"choice": CHOICES}})
    assert len(choice.choices) == len(PROMPTS)
    for c in choice.choices:
        _check_choice(c.text)
    chats = _chat(client, PROMPTS[:3], extra_body={
        "decoding": decoding, "structured_outputs": {"choice": CHOICES}})
    for chat in chats:
        _check_choice(chat.choices[0].message.content)


def test_json_object_json_and_grammar(client) -> None:
    for choice in _complete(client, {"response_format": {"type": "json_object"}}).choices:
        assert isinstance(json.loads(choice.text), dict), choice.text
    compact = _complete(client, {"structured_outputs": {
        "json": json.dumps(SCHEMA), "disable_any_whitespace": True}})
    for choice in compact.choices:
        _check_answer(choice.text)
        assert "\n" not in choice.text
    grammar = 'root ::= ("yes" | "no") ", " [0-9]+'
    for choice in _complete(client, {"structured_outputs": {"grammar": grammar}}).choices:
        assert re.fullmatch(r"(yes|no), [0-9]+", choice.text), choice.text
    plain = _complete(client, {"response_format": {"type": "text"}}, seed=0)
    assert len(plain.choices) == len(PROMPTS)
    text_and_choice = _complete(client, {"response_format": {"type": "text"},
                                         "structured_outputs": {"choice": CHOICES}})
    for choice in text_and_choice.choices:       # "text" is no constraint: no conflict
        _check_choice(choice.text)


def test_pydantic_model_schema(client) -> None:
    """The usual vLLM recipe: a pydantic model's JSON schema in, the model validated out."""
    from pydantic import BaseModel

    class Answer(BaseModel):
        answer: int
        unit: str

    fmt = {"type": "json_schema", "json_schema": {"name": "Answer",
                                                  "schema": Answer.model_json_schema()}}
    for chat in _chat(client, PROMPTS[:2], response_format=fmt):
        Answer.model_validate_json(chat.choices[0].message.content)


def test_streamed_constrained_output_validates(client) -> None:
    extra = {"decoding": "cover", "structured_outputs": {"regex": REGEX}}
    full = _complete(client, extra)
    chunks = list(_complete(client, extra, stream=True))
    for choice in full.choices:
        text = "".join(c.choices[0].text for c in chunks
                       if c.choices and c.choices[0].index == choice.index)
        _check_regex(text)
        assert text == choice.text
    stream = client.chat.completions.create(
        model="test-model", messages=[{"role": "user", "content": "what is 2+2?"}],
        max_tokens=MAX_TOKENS, response_format=JSON_SCHEMA, stream=True,
        extra_body={"decoding": "threshold"})
    _check_answer("".join(c.choices[0].delta.content or "" for c in stream if c.choices))


def test_n_two_constrained_outputs_both_validate(client) -> None:
    resp = _complete(client, {"structured_outputs": {"choice": CHOICES}}, n=2,
                     temperature=1.0, seed=3)
    assert len(resp.choices) == 2 * len(PROMPTS)
    for choice in resp.choices:
        _check_choice(choice.text)
    chat = client.chat.completions.create(
        model="test-model", messages=[{"role": "user", "content": "what is 2+2?"}],
        max_tokens=MAX_TOKENS, n=2, temperature=1.0, response_format=JSON_SCHEMA)
    assert len(chat.choices) == 2
    for choice in chat.choices:
        _check_answer(choice.message.content)


C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hello"}]

# (id, body fields, param the error names, words the message holds)
BAD = [
    ("format type unknown", {"response_format": {"type": "xml"}}, "response_format.type",
     "['text', 'json_object', 'json_schema']"),
    ("format type missing", {"response_format": {}}, "response_format.type", "required"),
    ("json_schema without json_schema", {"response_format": {"type": "json_schema"}},
     "response_format", "needs response_format.json_schema"),
    ("json_schema without schema", {"response_format": {
        "type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "required"),
    ("json_schema schema wrong type", {"response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}},
     "response_format.json_schema.schema", "dictionary"),
    ("json_schema unknown key", {"response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "bogus": 1}}},
     "response_format.json_schema.bogus", "'name', 'description', 'schema', 'strict'"),
    ("json_schema with json_object", {"response_format": {
        "type": "json_object", "json_schema": {"name": "x", "schema": SCHEMA}}},
     "response_format", "only with type 'json_schema'"),
    ("invalid schema", {"response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema", "could not be compiled"),
    ("both fields", {"response_format": {"type": "json_object"},
                     "structured_outputs": {"regex": "a+"}}, "structured_outputs",
     "pick one"),
    ("invalid regex", {"structured_outputs": {"regex": "([a-z"}}, "structured_outputs.regex",
     "could not be compiled"),
    ("invalid grammar", {"structured_outputs": {"grammar": 'rule ::= "a"'}},
     "structured_outputs.grammar", "could not be compiled"),
    ("invalid schema text", {"structured_outputs": {"json": "{not json"}},
     "structured_outputs.json", "could not be compiled"),
    ("no kind", {"structured_outputs": {}}, "structured_outputs", "exactly one of"),
    ("two kinds", {"structured_outputs": {"regex": "a", "choice": ["b"]}},
     "structured_outputs", "exactly one of"),
    ("empty choice", {"structured_outputs": {"choice": []}}, "structured_outputs.choice",
     "non-empty list"),
    ("regex wrong type", {"structured_outputs": {"regex": 5}}, "structured_outputs.regex",
     "string"),
    ("unknown structured field", {"structured_outputs": {"regexp": "a"}},
     "structured_outputs.regexp", "structured_outputs takes"),
    ("whitespace_pattern", {"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern", "not supported"),
    ("structural_tag", {"structured_outputs": {"structural_tag": "{}"}},
     "structured_outputs.structural_tag", "not supported"),
] + [(f"removed {name}", {name: value}, name, words) for name, value, words in [
         ("guided_json", SCHEMA, "send structured_outputs.json instead"),
         ("guided_regex", "a+", "send structured_outputs.regex instead"),
         ("guided_choice", ["a"], "send structured_outputs.choice instead"),
         ("guided_grammar", 'root ::= "a"', "send structured_outputs.grammar instead"),
         ("guided_whitespace_pattern", " ", "structured_outputs.disable_any_whitespace"),
         ("guided_decoding_backend", "xgrammar", "structured_outputs.<kind>")]]


@pytest.mark.parametrize("path", [C, CHAT])
@pytest.mark.parametrize("name,fields,param,words", BAD, ids=[b[0] for b in BAD])
def test_bad_constraints_are_400s_and_server_keeps_serving(server, path, name, fields, param,
                                                           words) -> None:
    base = {"prompt": "hello", "max_tokens": 8} if path == C else {"messages": MSG,
                                                                    "max_tokens": 8}
    resp = httpx.post(server.url + path, json={**base, **fields}, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and words in error["message"], error
    good = httpx.post(server.url + path, timeout=60, json={
        **base, "structured_outputs": {"choice": CHOICES}})
    assert good.status_code == 200, good.text
    body = good.json()["choices"][0]
    _check_choice(body["text"] if path == C else body["message"]["content"])


def test_removed_field_error_through_the_openai_client(client) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        _complete(client, {"guided_regex": REGEX})
    assert "structured_outputs.regex" in str(caught.value)


def test_model_without_tokenizer_refuses_constraints(tmp_path) -> None:
    model = tmp_path / "no-tokenizer"
    model.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(BUILTIN_DIRS["cover-tiny"] / name, model / name)
    srv = start_server(str(model))
    try:
        for fields, param in [({"structured_outputs": {"choice": CHOICES}}, "structured_outputs"),
                              ({"response_format": {"type": "json_object"}}, "response_format")]:
            resp = httpx.post(srv.url + C, timeout=60, json={
                "prompt": [106, 138, 85], "max_tokens": 8, **fields})
            assert resp.status_code == 400, resp.text
            error = resp.json()["error"]
            assert error["param"] == param and "no tokenizer" in error["message"], error
        plain = httpx.post(srv.url + C, timeout=60, json={
            "prompt": [106, 138, 85], "max_tokens": 8, "response_format": {"type": "text"}})
        assert plain.status_code == 200, plain.text
    finally:
        srv.stop()


def test_request_field_mirrors_structured_outputs_params() -> None:
    """The server's `structured_outputs` body takes exactly StructuredOutputsParams' fields."""
    import dataclasses

    from cover_vllm import StructuredOutputsParams
    from cover_vllm.entrypoints.server.structured import STRUCTURED_FIELDS

    assert STRUCTURED_FIELDS == [f.name for f in dataclasses.fields(StructuredOutputsParams)
                                 if f.init]

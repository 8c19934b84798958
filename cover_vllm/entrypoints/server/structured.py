"""The structured-output fields of a request body and their StructuredOutputsParams.

Two ways in, as in vLLM >= 0.12: OpenAI's `response_format` ({"type": "text"} is no constraint,
"json_object" any JSON object, "json_schema" the schema under json_schema.schema) and vLLM's extra
field `structured_outputs` (StructuredOutputsParams' fields: json, regex, choice, grammar,
json_object and its options). One request takes one of them. vLLM's removed `guided_*` fields get
a 400 that says which `structured_outputs.<kind>` replaces them (`unknown_field_hint`). Compiling
the constraint (a malformed schema, regex or grammar) is the engine's: its ValueError names
`structured_outputs.<kind>`, which `as_sent` turns back into the response_format field the client
sent.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cover_vllm.sampling_params import StructuredOutputsParams

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")

# vLLM < 0.12's request fields and what replaced them (removed in vLLM 0.12.0, vllm-project/vllm
# PR #29326; vLLM now ignores them silently, so the output comes back unconstrained).
REMOVED_FIELDS = {
    "guided_json": "structured_outputs.json",
    "guided_regex": "structured_outputs.regex",
    "guided_choice": "structured_outputs.choice",
    "guided_grammar": "structured_outputs.grammar",
    "guided_whitespace_pattern": "structured_outputs.whitespace_pattern",
    "guided_decoding_backend": "structured_outputs.<kind>",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class JsonSchemaSpec(_Strict):
    """response_format.json_schema (OpenAI's). `strict` is accepted and changes nothing: the
    schema is always enforced, token by token (no properties beyond the schema's unless it
    allows them: xgrammar's strict mode)."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: str
    json_schema: JsonSchemaSpec | None = None

    @field_validator("type")
    @classmethod
    def _type(cls, value):
        if value not in RESPONSE_FORMAT_TYPES:
            raise ValueError(f"must be one of {list(RESPONSE_FORMAT_TYPES)}, got {value!r} "
                             "(for a regex, a choice or a grammar send structured_outputs)")
        return value

    @model_validator(mode="after")
    def _schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs response_format.json_schema = "
                             "{'name': ..., 'schema': {...}}")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"response_format.json_schema is read only with type "
                             f"'json_schema', not {self.type!r}")
        return self

    def params(self) -> StructuredOutputsParams | None:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            return StructuredOutputsParams(json=self.json_schema.schema_)
        return None


class StructuredOutputsFields(_Strict):
    """vLLM's `structured_outputs` request field: StructuredOutputsParams' fields (checked there:
    exactly one kind; whitespace_pattern and structural_tag are refused by name)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")   # BaseModel has .json
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(**{name.rstrip("_"): getattr(self, name)
                                          for name in type(self).model_fields})


STRUCTURED_FIELDS = [name.rstrip("_") for name in StructuredOutputsFields.model_fields]


def check_one_constraint(response_format: ResponseFormat | None,
                         structured: StructuredOutputsFields | None) -> None:
    if structured is not None and response_format is not None and \
            response_format.type != "text":
        raise ValueError(f"pick one: response_format (type {response_format.type!r}) or "
                         "structured_outputs, not both")


def constraint(response_format: ResponseFormat | None,
               structured: StructuredOutputsFields | None) -> StructuredOutputsParams | None:
    """SamplingParams.structured_outputs of a request (ValueError / TypeError naming
    `structured_outputs.<field>` for a bad combination)."""
    if structured is not None:
        return structured.params()
    return response_format.params() if response_format is not None else None


def constraint_field(response_format: ResponseFormat | None,
                     structured: StructuredOutputsFields | None) -> str | None:
    """The request field that carries the constraint (None: unconstrained)."""
    if structured is not None:
        return "structured_outputs"
    if response_format is not None and response_format.type != "text":
        return "response_format"
    return None


def as_sent(response_format: ResponseFormat | None, message: str,
            param: str | None) -> tuple[str, str | None]:
    """An engine message naming `structured_outputs.json[_object]`, reworded for a client that
    sent response_format (the engine only knows StructuredOutputsParams)."""
    if response_format is None or response_format.type == "text" or not (
            param or "").startswith("structured_outputs"):
        return message, param
    field = ("response_format.json_schema.schema" if response_format.type == "json_schema"
             else "response_format")
    for old in ("structured_outputs.json_object", "structured_outputs.json",
                "structured_outputs"):
        message = message.replace(old, field)
    return message, field


def unknown_field_hint(param: str) -> str | None:
    """What to send instead of an unknown field, where there is an answer."""
    if param in REMOVED_FIELDS:
        instead, removed = REMOVED_FIELDS[param], f"'{param}' was removed in vLLM 0.12"
        if param == "guided_decoding_backend":
            return (f"{removed} and has no per-request replacement (this server always uses "
                    "xgrammar): send the constraint as structured_outputs.<kind>, one of "
                    f"{STRUCTURED_FIELDS[:5]}")
        if param == "guided_whitespace_pattern":
            return (f"{removed}; vLLM's replacement {instead} is not supported by this "
                    "server's grammar backend (xgrammar): send "
                    "structured_outputs.disable_any_whitespace=true for compact JSON")
        kind = instead.split(".")[1]
        return (f"{removed}: send {instead} instead "
                f"(extra_body={{'structured_outputs': {{'{kind}': ...}}}})")
    if param.startswith("structured_outputs."):
        return f"unknown field '{param}'; structured_outputs takes {STRUCTURED_FIELDS}"
    if param.startswith("response_format.json_schema."):
        return (f"unknown field '{param}'; response_format.json_schema takes "
                "['name', 'description', 'schema', 'strict']")
    return None

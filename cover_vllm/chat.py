"""Chat input shared by `LLM.chat` and the server: the messages' roles and content checked one
way (a bad role is a ValueError naming messages[i].role offline and a 400 naming it online), the
chat-template options vLLM takes (`ChatTemplateOptions`), and a `--chat-template` value read as
vLLM reads it (`load_chat_template`: a file, else the template itself).

Rendering the template is tokenizer.apply_chat_template's business; this module never loads a
tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cover_vllm.text_input import check_text

CHAT_ROLES = ("system", "developer", "user", "assistant")


def content_text(content: Any) -> str:
    """A message's content as text: a string, or a list of {'type': 'text', 'text': ...} parts
    (joined); other part types are refused with the reason."""
    if isinstance(content, str):
        return check_text(content, "content")
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        for j, p in enumerate(content):
            check_text(p["text"], f"content[{j}].text")
        return "".join(p["text"] for p in content)
    if isinstance(content, list):
        kinds = sorted({p.get("type") for p in content if isinstance(p, dict)} - {"text"}, key=str)
        if kinds:
            raise ValueError(f"content parts of type {kinds} are not supported: the models "
                             "served here take text only (image inputs included: a "
                             "DiffusionGemma checkpoint's vision tower is not loaded)")
    raise ValueError("content must be a string or a list of {'type': 'text', 'text': ...} parts")


def check_role(role: Any) -> str:
    if role not in CHAT_ROLES:
        raise ValueError(f"role must be one of {list(CHAT_ROLES)}, got {role!r}")
    return role


def check_messages(messages: Any, where: str = "messages") -> list[dict[str, str]]:
    """One conversation as [{'role', 'content'}] with text content; ValueError naming
    `where`[i].role / .content (the server's rules: ChatMessage in server/protocol.py)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"{where} must be a non-empty list of {{'role': ..., 'content': ...}} "
                         "dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"{where}[{i}] must be a dict with 'role' and 'content'")
        unknown = sorted(set(m) - {"role", "content", "name"})
        if unknown:
            raise ValueError(f"{where}[{i}] has unknown keys {unknown}; allowed: role, "
                             "content, name")
        try:
            role = check_role(m["role"])
        except ValueError as exc:
            raise ValueError(f"{where}[{i}].role: {exc}") from None
        try:
            text = content_text(m["content"])
        except ValueError as exc:
            raise ValueError(f"{where}[{i}].content: {exc}") from None
        out.append({"role": role, "content": text})
    return out


@dataclass(frozen=True)
class ChatTemplateOptions:
    """How a conversation becomes a prompt (vLLM's `LLM.chat` / chat-request arguments).

    `chat_template`: a Jinja template (text, or a file path: `load_chat_template`) replacing the
    tokenizer's; `add_generation_prompt` (default True) ends the prompt with the assistant
    turn's opening; `continue_final_message` instead ends it right after the last message's
    content, so the model continues that message (the two exclude each other);
    `chat_template_kwargs`: extra variables for the template (e.g. a system flag it reads).
    """

    chat_template: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        for name in ("add_generation_prompt", "continue_final_message"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool (True or False), got "
                                 f"{getattr(self, name)!r}")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("continue_final_message=True continues the last message, so it "
                             "needs add_generation_prompt=False (set one of them)")
        kwargs = self.chat_template_kwargs
        if kwargs is not None and not (isinstance(kwargs, dict)
                                       and all(isinstance(k, str) for k in kwargs)):
            raise ValueError("chat_template_kwargs must be a dict of template variables "
                             "(string keys)")
        if self.chat_template is not None:
            object.__setattr__(self, "chat_template", load_chat_template(self.chat_template))


def load_chat_template(value: str) -> str:
    """A chat template from `value`, as vLLM's --chat-template takes it: the contents of the
    file `value` names when there is one, else `value` itself when it reads as a template
    (holds '{', '}' or a newline); ValueError for a missing file or a template jinja cannot
    parse (naming chat_template)."""
    if not isinstance(value, str) or not value:
        raise ValueError("chat_template must be a Jinja template or a path to one")
    path = Path(value).expanduser()
    try:
        is_file = path.is_file()
    except OSError:                      # a long inline template is no valid path
        is_file = False
    if is_file:
        text = path.read_text()
    elif any(c in value for c in "{}\n"):
        text = value
    else:
        raise ValueError(f"chat_template={value!r}: no such file, and it is not a template "
                         "(a template holds '{', '}' or a newline)")
    from jinja2 import Environment, TemplateSyntaxError

    try:
        Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except TemplateSyntaxError as exc:
        raise ValueError(f"chat_template does not parse as Jinja: {exc}") from None
    return text


def template_reads(template: str, name: str) -> bool:
    """Whether the Jinja `template` reads the variable `name` (e.g. `tools`: a template that
    never reads it would drop them without a word)."""
    from jinja2 import Environment, meta

    parsed = Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    return name in meta.find_undeclared_variables(parsed)

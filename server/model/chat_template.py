"""A chat template rendered as transformers renders it, without importing transformers.

The environment matches transformers' (utils/chat_template_utils.py): a sandbox, whose
templates come from a model's files and are untrusted code; trim_blocks and lstrip_blocks;
loop controls; tojson that keeps non-ASCII text; raise_exception and strftime_now; dict
and namespace that refuse the attribute tricks a sandbox escape needs. A template that
uses transformers' {% generation %} tag is not handled here (PlainTokenizer refuses it).
"""

import json
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# What transformers appends to the final message when continuing it, to find where the
# template's rendering of that message ends.
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# Reasoning is passed under several names; templates read the first.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)  # fmt: skip


def _strftime_now(format):
    return datetime.now().strftime(format)


class _TemplateDict:
    """dict() in a template, without the class's own attributes."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """namespace() in a template, refusing underscore names (a way to CPython internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, "
                f"but got {name!r}."
            )


def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])  # fmt: skip
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_TemplateDict(), namespace=_TemplateNamespace)  # fmt: skip
    return env.from_string(source)


def plain_messages(messages: list) -> list[dict]:
    """Messages as the template sees them: copies without None values, reasoning under
    each of its names."""
    out = []
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, but got {message!r}.")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render(template: jinja2.Template, source: str, messages: list, *, add_generation_prompt: bool,
           continue_final_message: bool, tools=None, documents=None, **context) -> str:  # fmt: skip
    """The conversation rendered; with continue_final_message, cut where its last
    message's content ends, so a model continues that message. tools and documents are
    always passed (None when absent), as transformers passes them: templates test
    `tools is defined` as often as `tools`."""
    messages = plain_messages(messages)
    context.update(tools=tools, documents=documents)
    if not continue_final_message:
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               **context)  # fmt: skip
    if add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible.")
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str) or "content" not in source:
        raise ValueError("continue_final_message is set but the final message has no text "
                         "content the chat template reads")  # fmt: skip
    messages[-1]["content"] = final + CONTINUE_TAG
    rendered = template.render(messages=messages, add_generation_prompt=False, **context)
    if final.strip() not in rendered or CONTINUE_TAG.strip() not in rendered:
        raise ValueError("continue_final_message is set but the chat template dropped part "
                         "of the final message")  # fmt: skip
    cut = rendered.rindex(CONTINUE_TAG.strip())
    if rendered[cut : cut + len(CONTINUE_TAG)] == CONTINUE_TAG:
        return rendered[:cut]
    return rendered[:cut].rstrip()  # the template trimmed the message's trailing space

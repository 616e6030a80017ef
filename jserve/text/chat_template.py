"""Chat templates rendered with jinja2 the way Hugging Face transformers renders them.

Same environment (immutable sandbox, trim_blocks, lstrip_blocks, loop controls, a `generation`
block tag), the same globals (`raise_exception`, `strftime_now`) and the same non-escaping `tojson`.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

logger = logging.getLogger(__name__)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes HTML characters; transformers overrides it with plain json.dumps.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_chat_template(template: str) -> Any:
    """Compiles `template` (cached); raises jinja2.TemplateSyntaxError for a malformed template."""
    import jinja2
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for HF's masks; render the body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> list[nodes.Node]:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_chat_template(template: str | None, messages: Sequence[Mapping[str, Any]], *,
                         add_generation_prompt: bool = True, continue_final_message: bool = False,
                         special_tokens: Mapping[str, str] | None = None, **extra: Any) -> str:
    """Renders a conversation.

    Args:
      template: the jinja2 chat template; None raises ValueError.
      messages: [{"role": ..., "content": ...}, ...], passed to the template as `messages`.
      add_generation_prompt: open an assistant turn at the end.
      continue_final_message: cut the text right after the last message's content so the model
        continues it (transformers' semantics; incompatible with add_generation_prompt).
      special_tokens: template variables such as bos_token / eos_token.
      **extra: more template variables (tools, documents, ...); they override special_tokens.
    Returns:
      The rendered prompt text.
    """
    if template is None:
        raise ValueError("this tokenizer has no chat template (a base model's has none): give one, a jinja "
                         "template (--chat-template for jserve generate and serve, LLM(chat_template=...))")
    if isinstance(messages, (str, bytes)) or not all(isinstance(m, Mapping) for m in messages):
        raise ValueError(f"messages must be a list of dicts, got {messages!r:.200}")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message=True and add_generation_prompt=True are not compatible")
    if continue_final_message and not messages:
        raise ValueError("continue_final_message=True needs at least one message")
    variables: dict[str, Any] = {"tools": None, "documents": None, **(special_tokens or {}), **extra}
    rendered = compile_chat_template(template).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt, **variables)
    if continue_final_message:
        rendered = _cut_after_final_message(rendered, messages[-1])
    return rendered


def _cut_after_final_message(rendered: str, final: Mapping[str, Any]) -> str:
    content = final.get("content")
    if isinstance(content, (list, tuple)):  # multimodal content: continue its last text block
        texts = [block["text"] for block in content if isinstance(block, Mapping) and "text" in block]
        if not texts:
            raise ValueError("continue_final_message=True but the final message has no text to continue")
        content = texts[-1]
    if not isinstance(content, str) or content.strip() not in rendered:
        raise ValueError("continue_final_message=True but the final message's content does not appear "
                         "in the rendered chat")
    start = rendered.rindex(content.strip())
    if rendered[start:start + len(content.lstrip())] == content:
        return rendered[:start + len(content.lstrip())]
    return rendered[:start + len(content.strip())]  # the template trimmed trailing whitespace


# Characters a template has and a file path hardly does: vLLM's test for "--chat-template is the
# template itself, not a file".
_TEMPLATE_CHARS = "{}\n"


def load_chat_template(value: str | None) -> str | None:
    """A `--chat-template` argument as vLLM reads it: the file it names, else (when it cannot be
    opened and holds `{`, `}` or a newline) the template text itself; None for None. ValueError for
    a path that cannot be read or a template jinja2 cannot compile."""
    if value is None:
        return None
    try:
        with open(value, encoding="utf-8") as f:
            template = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"--chat-template {value!r} is not UTF-8 text: {e}") from None
    except (OSError, ValueError) as e:  # ValueError: a NUL character, which no path holds
        if not any(c in value for c in _TEMPLATE_CHARS):
            raise ValueError(f"--chat-template {value!r} looks like a file path, but it cannot be read: {e}") from None
        template = value
    import jinja2

    try:
        compile_chat_template(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: the template does not compile (line {e.lineno}): {e.message}") from None
    return template

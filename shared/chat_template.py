"""A model's own chat template rendered as Hugging Face renders it, in Jinja's immutable sandbox (templates are untrusted)."""

from __future__ import annotations

import json
from functools import lru_cache

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The model has no chat template, or its template refused these messages; ``str()`` says which."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


@lru_cache(maxsize=8)
def _compiled(template: str):
    # trim_blocks and lstrip_blocks as Hugging Face sets them: templates are written for that whitespace.
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    environment.globals["raise_exception"] = _raise_exception
    return environment.from_string(template)


def render_chat(template: str | None, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                special_tokens: dict[str, str] | None = None) -> str:
    """``messages`` (``{"role", "content"}`` each) as the model reads them, ending where the answer begins if asked;
    ``special_tokens``: ``bos_token`` ... Raises :class:`ChatTemplateError` when ``template`` is None or refuses the messages."""
    if not template:
        raise ChatTemplateError("this model has no chat template: send a prompt, not messages")
    try:
        return _compiled(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                          **(special_tokens or {}))
    except TemplateError as exc:
        raise ChatTemplateError(f"the model's chat template refused these messages: {exc}") from None


def chat_prompt(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """:func:`render_chat` with ``tokenizer``'s own template and special tokens (:class:`shared.tokenizer.HFTokenizer`)."""
    template = getattr(tokenizer, "chat_template", None)
    special = {}
    if template:
        special = {f"{name}_token": tokenizer.token_text(token_id)
                   for name, token_id in (("bos", tokenizer.bos_id), ("eos", tokenizer.eos_id)) if token_id is not None}
    return render_chat(template, messages, add_generation_prompt, special)

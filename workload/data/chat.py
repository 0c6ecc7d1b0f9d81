"""Chat documents for supervised fine-tuning (`training.objective: sft`): JSONL conversations rendered
with the tokenizer's chat template, the loss on the assistant's tokens only.

Each line of the jsonl files is `{"messages": [{"role": ..., "content": ...}, ...]}` (at most
MAX_MESSAGES messages, roles and contents strings). The template is the Hugging Face one beside
tokenizer.json: `chat_template` of tokenizer_config.json (a string, or the list of named templates, of
which `default`), else the file chat_template.jinja. It is user data: it is rendered by jinja2's
sandboxed environment (no access to Python's internals), with HF's variables (`messages`,
`add_generation_prompt` false, the config's `bos_token`, `eos_token`, `unk_token`, `pad_token`, and
`raise_exception`).

Which tokens count: the template renders the conversation's first k messages as a prefix of the first
k + 1 (checked; a template that does not is refused), so the text that assistant message k adds is
known. Its span starts where the message's content starts in that text (where a stand-in content
lands when rendered in its place: the role header before it is the template's, given at inference) and ends where the text ends (the template's end-of-turn markup
after the content is learnt with it). The whole text is encoded once, without the tokenizer's
post-processor (the template writes its own special tokens, as HF's `apply_chat_template` does), and
a token counts when its first character lies in an assistant span: weights 1, else 0. No EOS is
appended: the template ends each turn. Packing carries the weights with the tokens
(packing.Weighted), and the batch's loss mask is the packed mask times the target's weight.
"""

from __future__ import annotations

import numpy as np

from ..process.exits import UserError
from .text import LineDocuments
from .tokenizer import MAX_CONFIG_BYTES, Tokenizer, read_optional

# Rendering costs O(messages x text): the first k messages are rendered for every k.
MAX_MESSAGES = 256
# A stand-in content no conversation holds, to find where the template puts an assistant's content.
PROBE = "\x00tpujob-assistant-content\x00"


def template_of(tokenizer: Tokenizer) -> str:
    """The tokenizer's chat template (see the module's docstring)."""
    template = tokenizer.config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str):
        base = tokenizer.path.rsplit("/", 1)[0]
        raw = read_optional(base + "/chat_template.jinja", MAX_CONFIG_BYTES, "training.data.tokenizer")
        template = raw.decode() if raw is not None else None
    if not isinstance(template, str):
        raise UserError(
            f"training.objective: sft needs a chat template: none in tokenizer_config.json's chat_template "
            f"or chat_template.jinja beside {tokenizer.path}"
        )
    return template


class ChatTemplate:
    def __init__(self, tokenizer: Tokenizer):
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            self.template = env.from_string(template_of(tokenizer))
        except TemplateError as e:
            raise UserError(f"training.data.tokenizer: its chat template does not parse: {e}") from None
        tokens = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = tokenizer.config.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                tokens[key] = value
        self.tokens, self.error = tokens, TemplateError

    def render(self, messages: list[dict]) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=False, **self.tokens)
        except self.error as e:
            raise UserError(f"the chat template failed: {e}") from None

    def spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """(the conversation's text, the character spans of its assistant messages)."""
        text, spans = "", []
        for k, message in enumerate(messages):
            longer = self.render(messages[: k + 1])
            if not longer.startswith(text):
                raise UserError(
                    "training.objective: sft: the chat template does not render a conversation's first "
                    f"{k} messages as a prefix of its first {k + 1}, so the assistant's text is not known"
                )
            if message["role"] == "assistant":
                # Where the content starts: where a stand-in content lands (the header does not depend on
                # the content; searching for the content itself could find it in the header).
                probe = self.render([*messages[:k], {"role": "assistant", "content": PROBE}])
                at = probe.find(PROBE, len(text))
                spans.append((at if at >= 0 else len(text), len(longer)))
            text = longer
        return text, spans


def messages_of(docs: LineDocuments, i: int) -> list[dict]:
    """Document i's messages, checked: a list of at most MAX_MESSAGES {role, content} string pairs."""
    value = docs.value(i)
    if not isinstance(value, list) or not value or len(value) > MAX_MESSAGES:
        raise UserError(f"{docs.where(i)}: 'messages' is not a list of 1 to {MAX_MESSAGES} messages")
    for m in value:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise UserError(f"{docs.where(i)}: a message is not an object with string 'role' and 'content'")
    return [{"role": m["role"], "content": m["content"]} for m in value]  # other keys (tool calls) dropped


class ChatDocuments:
    """Conversations as packing reads them: `lengths()`, then `read(i, length)` -> (tokens, weights)."""

    def __init__(self, path: str, tokenizer: Tokenizer):
        self.docs = LineDocuments(path, "jsonl", "messages")
        self.tokenizer, self.template = tokenizer, ChatTemplate(tokenizer)

    def __len__(self) -> int:
        return len(self.docs)

    def encode(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        text, spans = self.template.spans(messages_of(self.docs, i))
        ids, starts = self.tokenizer.encode_offsets(text)
        weights = np.zeros(len(ids), np.float32)
        for a, b in spans:
            weights[(starts >= a) & (starts < b)] = 1.0
        return ids, weights

    def lengths(self) -> np.ndarray:
        return np.fromiter((len(self.encode(i)[0]) for i in range(len(self))), np.int64, count=len(self))

    def read(self, i: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        ids, weights = self.encode(i)
        return ids[:length], weights[:length]

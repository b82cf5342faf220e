"""Text around token ids: chat templates, stop strings and incremental detokenisation."""
from __future__ import annotations

import json

from glm5_jax import storage

# GLM's chat format (the chat_template of the GLM-4 / GLM-5 hub tokenizers, without tools):
# "[gMASK]<sop>" then "<|role|>\n" + content per message, then "<|assistant|>\n" to open the reply.
GLM_TEMPLATE = ("[gMASK]<sop>{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


class ChatTemplate:
    """A Jinja chat template (HF ``tokenizer_config.json``'s ``chat_template``), rendered in a sandbox."""

    def __init__(self, source: str = GLM_TEMPLATE):
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self.template = env.from_string(source)

    @classmethod
    def for_tokenizer(cls, tokenizer_path: str | None) -> "ChatTemplate":
        """The template in tokenizer_config.json beside the tokenizer, else GLM's format."""
        if tokenizer_path:
            folder = tokenizer_path if storage.isdir(tokenizer_path) else storage.dirname(tokenizer_path)
            config = storage.join(folder, "tokenizer_config.json")
            if storage.isfile(config):
                source = json.loads(storage.read_text(config)).get("chat_template")
                if isinstance(source, str):
                    return cls(source)
        return cls()

    def render(self, messages: list[dict]) -> str:
        return self.template.render(messages=messages, add_generation_prompt=True)


def _raise(message):
    raise ValueError(message)


def truncate_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """(text up to the earliest stop string, whether one occurred)."""
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[:min(cuts)], True) if cuts else (text, False)


class TextStream:
    """Turns a growing list of token ids into text deltas for streaming.

    Holds back what could still become a stop string, and a trailing incomplete UTF-8 sequence
    (decoded as U+FFFD until its last byte arrives).
    """

    def __init__(self, tokenizer, stops: list[str] | None):
        self.tokenizer, self.stops = tokenizer, list(stops or [])
        self.hold = max((len(s) - 1 for s in self.stops), default=0)
        self.sent = 0

    def full_text(self, ids: list[int]) -> tuple[str, bool]:
        return truncate_at_stop(self.tokenizer.decode(ids), self.stops)

    def delta(self, ids: list[int], finished: bool) -> str:
        text, stopped = self.full_text(ids)
        end = len(text)
        if not (finished or stopped):
            end -= self.hold
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
        end = max(end, self.sent)
        out, self.sent = text[self.sent:end], end
        return out

    def stop_check(self):
        """A Request.stop_check that ends generation once a stop string appears (None without stops)."""
        if not self.stops:
            return None
        return lambda ids: self.full_text(ids)[1]

"""Tap hints from a chat prompt's token ids (§7.1 priorities 2 and 3).

vLLM's chat endpoint renders the template and tokenizes; the engine sees token ids only. A
ChatML template (Qwen3.5: ``<|im_start|>role\\n ... <|im_end|>\\n``) opens every message with one
special token followed by the role name, so the two semantic positions the planner wants are
found in the ids:

- the generation opener: the last message start, when it opens an assistant message and the
  prompt ends there (the generation prompt). The next turn re-renders the history after it (for
  example with the thinking stripped), so it is the deepest position that turn shares;
- the end of the leading system block (tools included): the start of the second message, when
  the first is a system message. New conversations sharing the preamble resume there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from vllm_hpc.index.tap_planner import TapHint, TapSource

MESSAGE_START = "<|im_start|>"
OPENER_WHITESPACE = ("\n", "\n\n")
OPENER_TAGS = ("<think>", "</think>")
"""What a generation prompt may carry after the assistant role: newlines, an empty think block."""


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def get_vocab(self) -> dict[str, int]: ...


@dataclass(frozen=True, slots=True)
class ChatMarkers:
    """The chat format's token ids: the message start and the role names that follow it."""

    message_start: int
    system: tuple[int, ...]
    assistant: tuple[int, ...]
    opener_filler: frozenset[int] = frozenset()
    """Tokens allowed after the assistant role at the end of a prompt that ends in the opener."""
    max_filler: int = 6

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> ChatMarkers | None:
        """The markers of a ChatML tokenizer; None when it has no message-start token."""
        vocab = tokenizer.get_vocab()
        start = vocab.get(MESSAGE_START)
        if start is None:
            return None

        def role(name: str) -> tuple[int, ...]:
            # Encoded after the start token, as the template renders it (BPE merges stop there).
            ids = tokenizer.encode(MESSAGE_START + name, add_special_tokens=False)
            return tuple(ids[1:]) if ids and ids[0] == start else ()

        filler = {vocab[tag] for tag in OPENER_TAGS if tag in vocab}
        for text in OPENER_WHITESPACE:
            ids = tokenizer.encode(text, add_special_tokens=False)
            filler.update(ids if len(ids) == 1 else ())
        system, assistant = role("system"), role("assistant")
        if not system or not assistant:
            return None
        return cls(start, system, assistant, frozenset(filler))

    def hints(self, prompt: Sequence[int]) -> tuple[TapHint, ...]:
        """The structural end and the generation opener of ``prompt``, where it has them.

        Cost: one C-level ``index`` search for the second message start (pass a list) and a
        look at the last few tokens; nothing runs per token in Python.
        """
        found = []
        system_end = self._system_end(prompt)
        if system_end is not None:
            found.append(TapHint(system_end, TapSource.STRUCTURAL))
        opener = self._opener(prompt)
        if opener is not None:
            found.append(TapHint(opener, TapSource.OPENER))
        return tuple(found)

    def _system_end(self, prompt: Sequence[int]) -> int | None:
        k = len(self.system)
        if len(prompt) <= k or prompt[0] != self.message_start:
            return None
        if tuple(prompt[1 : 1 + k]) != self.system:
            return None
        try:
            return prompt.index(self.message_start, 1 + k)
        except ValueError:
            return None

    def _opener(self, prompt: Sequence[int]) -> int | None:
        n = len(prompt)
        role = len(self.assistant)
        window = 1 + role + self.max_filler
        for p in range(n - 1 - role, max(-1, n - 1 - window), -1):
            if prompt[p] != self.message_start:
                continue
            if tuple(prompt[p + 1 : p + 1 + role]) != self.assistant:
                return None
            tail = prompt[p + 1 + role : n]
            return p if all(t in self.opener_filler for t in tail) else None
        return None

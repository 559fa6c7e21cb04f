"""Generation-opener and structural tap hints from ChatML token ids (§7.1 priorities 2, 3)."""

from __future__ import annotations

import re
import time

from vllm_hpc.index import TapHint, TapSource
from vllm_hpc.runtime.template_hints import ChatMarkers

START, END, NL, SYSTEM, USER, ASSISTANT, THINK, UNTHINK = 100, 101, 10, 11, 12, 13, 14, 15
MARKERS = ChatMarkers(START, (SYSTEM,), (ASSISTANT,), frozenset({NL, THINK, UNTHINK}))


def message(role: int, content: list[int]) -> list[int]:
    return [START, role, NL, *content, END, NL]


def words(count: int, first: int = 1000) -> list[int]:
    return list(range(first, first + count))


def test_system_block_end_and_opener_of_a_first_turn() -> None:
    system, user = message(SYSTEM, words(40)), message(USER, words(90))
    prompt = system + user + [START, ASSISTANT, NL]
    assert MARKERS.hints(prompt) == (
        TapHint(len(system), TapSource.STRUCTURAL),
        TapHint(len(system) + len(user), TapSource.OPENER),
    )


def test_opener_may_end_in_an_empty_think_block() -> None:
    user = message(USER, words(5))
    prompt = [*user, START, ASSISTANT, NL, THINK, NL, UNTHINK, NL]
    assert MARKERS.hints(prompt) == (TapHint(len(user), TapSource.OPENER),)


def test_no_opener_unless_the_prompt_ends_in_an_assistant_opener() -> None:
    history = message(SYSTEM, words(3)) + message(USER, words(5))
    assert TapSource.OPENER not in {h.source for h in MARKERS.hints(history)}
    user_opener = [*history, START, USER, NL]
    assert TapSource.OPENER not in {h.source for h in MARKERS.hints(user_opener)}
    # The assistant started answering (a continued final message): content follows the role.
    continued = [*history, START, ASSISTANT, NL, 1000, 1001]
    assert TapSource.OPENER not in {h.source for h in MARKERS.hints(continued)}
    # A stray start token at the very end is not an opener either.
    assert TapSource.OPENER not in {h.source for h in MARKERS.hints([*history, START])}
    too_long = history + [START, ASSISTANT] + [NL] * (MARKERS.max_filler + 1)
    assert TapSource.OPENER not in {h.source for h in MARKERS.hints(too_long)}


def test_no_structural_end_without_a_leading_system_message() -> None:
    assert MARKERS.hints(message(USER, words(5)) + message(USER, words(5))) == ()
    assert MARKERS.hints([7, *message(SYSTEM, words(5)), *message(USER, words(5))]) == ()
    # A system message alone has no second message to end at.
    assert MARKERS.hints(message(SYSTEM, words(5))) == ()


def test_plain_token_ids_and_short_prompts_give_nothing() -> None:
    assert MARKERS.hints([]) == ()
    assert MARKERS.hints([START]) == ()
    assert MARKERS.hints([START, SYSTEM]) == ()
    assert MARKERS.hints(words(500)) == ()


def test_multi_token_roles() -> None:
    markers = ChatMarkers(START, (20, 21), (22, 23), frozenset({NL}))
    system = [START, 20, 21, NL, *words(4), END, NL]
    prompt = [*system, START, 20, 22, NL, 5, END, NL, START, 22, 23, NL]
    assert markers.hints(prompt) == (
        TapHint(len(system), TapSource.STRUCTURAL),
        TapHint(len(system) + 7, TapSource.OPENER),
    )
    assert markers.hints([*prompt[:-2], 22, NL]) == (TapHint(len(system), TapSource.STRUCTURAL),)


def test_fast_on_a_long_prompt() -> None:
    """Once per request on prompts of 100k tokens: a C-level search, not a Python loop."""
    prompt = message(SYSTEM, words(99_000)) + message(USER, words(900)) + [START, ASSISTANT, NL]
    begin = time.perf_counter()
    for _ in range(10):
        hints = MARKERS.hints(prompt)
    elapsed = (time.perf_counter() - begin) / 10
    assert hints == (
        TapHint(99_005, TapSource.STRUCTURAL),
        TapHint(len(prompt) - 3, TapSource.OPENER),
    )
    assert elapsed < 0.01, f"{elapsed * 1000:.1f} ms per 100k-token prompt"


class _Tokenizer:
    """Splits off the start token, newlines and words; ids from a fixed vocabulary."""

    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return self.vocab

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        pieces = re.findall(r"<\|im_start\|>|\n|[^\s]+", text)
        return [self.vocab.get(piece, 0) for piece in pieces]


def test_markers_from_a_tokenizer() -> None:
    vocab = {"<|im_start|>": START, "\n": NL, "system": SYSTEM, "assistant": ASSISTANT}
    markers = ChatMarkers.from_tokenizer(_Tokenizer(vocab))
    assert markers == ChatMarkers(START, (SYSTEM,), (ASSISTANT,), frozenset({NL}))
    with_tags = _Tokenizer({**vocab, "<think>": THINK, "</think>": UNTHINK})
    assert ChatMarkers.from_tokenizer(with_tags) == ChatMarkers(
        START, (SYSTEM,), (ASSISTANT,), frozenset({NL, THINK, UNTHINK})
    )
    assert ChatMarkers.from_tokenizer(_Tokenizer({"\n": NL})) is None

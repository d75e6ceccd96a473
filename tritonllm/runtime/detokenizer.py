"""Incremental detokenization and stop strings, for one generated sequence.

Text is produced with the prefix/read offset technique of vLLM and TGI: decode a short window of ids
(prefix_offset:) and the same window without the new ids (prefix_offset:read_offset); the difference is the
new text. Decoding a window instead of single ids keeps context-dependent pieces right (a leading space,
the bytes of one character spread over several byte-level tokens), and keeps each step O(window). When the
window's text ends in U+FFFD the last character is still incomplete, so nothing is emitted until more
ids arrive (or the sequence finishes, which flushes whatever is there).

Without stop strings, a detokenizer made with `lazy=True` (for requests whose text is only read at the end)
decodes nothing per step: the window then holds every id since the last read, and the next read decodes it in
one go, which gives the same text as decoding step by step.

Stop strings are searched across chunk boundaries: the match chosen is the one that a reader going
character by character would complete first, so the result does not depend on how text arrived. While
streaming, a tail of the text that could still grow into a stop string is held back.
"""

from collections.abc import Sequence
from typing import Protocol

from tritonllm.sampling_params import SamplingParams

# Prompt tokens decoded before the first generated one, for context (a leading space, say).
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


def find_stop(text: str, stop: Sequence[str], new_chars: int) -> tuple[str, int] | None:
    """The first stop string completed within the last `new_chars` characters of `text`, and where it starts.

    'First completed' = smallest end index; among those, the one that starts first. Occurrences that end
    before the new characters were already checked when those characters arrived.
    """
    checked = len(text) - new_chars
    best: tuple[int, int, str] | None = None  # (end, start, stop string)
    for s in stop:
        start = text.find(s, max(0, checked - len(s) + 1))
        if start != -1 and (best is None or (start + len(s), start) < best[:2]):
            best = (start + len(s), start, s)
    return None if best is None else (best[2], best[1])


def stop_prefix_len(text: str, stop: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string (0 if none)."""
    longest = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


class IncrementalDetokenizer:
    """Text of one sequence as its tokens arrive.

    Call `update(new_token_ids)` after each step; it returns the stop string that ended the text, if any.
    `output_text` is the text so far (cut at a stop string; when lazy, as of the last read);
    `get_next_output_text` gives what may be shown.
    """

    def __init__(
        self,
        tokenizer: Decoder,
        params: SamplingParams | None = None,
        prompt_token_ids: Sequence[int] = (),
        lazy: bool = False,
    ):
        params = params or SamplingParams()
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop: list[str] = list(params.stop or [])
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.lazy = lazy and not self.stop  # stop strings are matched against the text as it grows
        self.token_ids: list[int] = []  # generated ids (all of them, decoded or not)
        self.output_text = ""
        self.stop_reason: str | None = None  # the stop string that ended the text
        self.finished = False
        # Window ids: a few prompt tokens for context, then the generated ones that are decoded.
        context = list(prompt_token_ids)[-(PROMPT_CONTEXT_TOKENS + 1) :]
        self._ids = context
        self._prefix_offset = max(len(context) - PROMPT_CONTEXT_TOKENS, 0)
        self._read_offset = len(context)
        self._shown = 0  # characters handed out by get_next_output_text(delta=True)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_new(self, flush: bool) -> str:
        """Text the ids past the read offset add; '' while it would end inside a character (unless flush)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith(REPLACEMENT_CHAR) and not flush):
            # Nothing yet, or a character is incomplete: keep the offsets so the window grows.
            if flush:
                self._prefix_offset = self._read_offset = len(self._ids)
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text[len(prefix_text) :]

    def update(
        self, new_token_ids: Sequence[int], *, stop_terminated: bool = False, finished: bool = False
    ) -> str | None:
        """Add the ids of one step. Returns the stop string if it ended the text now, else None.

        stop_terminated: the last id is EOS or a stop token; it is kept in token_ids but its text is not
        added (unless include_stop_str_in_output). finished: the sequence ends with this step for any reason,
        so a trailing incomplete character is flushed as U+FFFD.
        """
        if self.finished:
            raise RuntimeError("update() after the sequence finished")
        new_token_ids = list(new_token_ids)
        self.token_ids.extend(new_token_ids)
        if stop_terminated and new_token_ids and not self.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        self._ids.extend(new_token_ids)
        self.finished = finished or stop_terminated
        if self.lazy:
            return None  # decoded when the text is read
        new_text = self._decode_new(flush=self.finished)
        self.output_text += new_text
        if not self.stop or not new_text:
            return None
        match = find_stop(self.output_text, self.stop, len(new_text))
        if match is None:
            return None
        stop_str, start = match
        end = start + len(stop_str) if self.include_stop_str_in_output else start
        self.output_text = self.output_text[:end]
        self.stop_reason = stop_str
        self.finished = True
        return stop_str

    def get_next_output_text(self, finished: bool = False, delta: bool = False) -> str:
        """Text that may be shown now: all of it once finished; while streaming, without a tail that could
        still become a stop string (which would be cut away). delta=True: only what was not handed out yet."""
        if self.lazy:
            self.output_text += self._decode_new(flush=self.finished)
        text = self.output_text
        if not (finished or self.finished) and self.stop and not self.include_stop_str_in_output:
            text = text[: len(text) - stop_prefix_len(text, self.stop)]
        if not delta:
            return text
        chunk = text[self._shown :]
        self._shown = max(self._shown, len(text))
        return chunk

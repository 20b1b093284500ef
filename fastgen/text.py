"""Incremental detokenization with stop strings.

Tokens are turned into text with ``tokenizers``' own ``DecodeStream`` (it yields nothing
until the bytes decoded so far form whole UTF-8 characters). Text that might be the start
of a stop string is held back, so a stop string split across tokens is still matched and
never reaches the user.
"""
from __future__ import annotations

from tokenizers.decoders import DecodeStream


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...]) -> None:
        self._tokenizer = tokenizer          # a tokenizers.Tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._stop = stop
        self._pending = ""
        self.text = ""                       # released so far

    def push(self, token_id: int, check_stop: bool) -> tuple[str, bool]:
        """Feed one generated token. Returns (newly released text, whether a stop string matched)."""
        piece = self._stream.step(self._tokenizer, token_id)
        if piece:
            self._pending += piece
        if check_stop and self._stop:
            cut = min((i for i in (self._pending.find(s) for s in self._stop) if i >= 0), default=-1)
            if cut >= 0:
                delta = self._pending[:cut]
                self._pending = ""
                self.text += delta
                return delta, True
        hold = self._held_back()
        delta = self._pending[:len(self._pending) - hold]
        self._pending = self._pending[len(self._pending) - hold:]
        self.text += delta
        return delta, False

    def flush(self) -> str:
        """Release what was held back (at the end of a generation that did not stop on a string)."""
        delta, self._pending = self._pending, ""
        self.text += delta
        return delta

    def _held_back(self) -> int:
        """Length of the longest suffix of the pending text that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(self._pending)), best, -1):
                if self._pending.endswith(s[:k]):
                    best = k
                    break
        return best

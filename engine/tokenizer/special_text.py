"""SpecialText: special tokens written in untrusted text stay text, never control tokens.

A chat template draws the conversation's boundaries with special tokens (``<|im_start|>``,
``<|im_end|>``); text inside a message, a retrieved document or a tool's result must not draw them
too. Tokenizing the rendered prompt as a whole would turn such text into the real ids, so:

- :meth:`SpecialText.protect` replaces each special token's string inside untrusted text, before the
  template renders it, by a placeholder: private-use characters around this process's random nonce
  and the token's index. No template treats it specially and no caller can forge one.
- :meth:`SpecialText.encode` tokenizes a rendered prompt that holds placeholders: the special strings
  the template itself wrote become sentinels (other private-use strings with the nonce), the
  placeholders become the strings they stood for, and a copy of the tokenizer encodes the whole text
  in one call, so normalizers and pre-tokenizers see what they would have seen (SentencePiece's
  first-word space included). The copy has ``encode_special_tokens`` on, so the restored strings come
  out as the text pieces transformers' ``split_special_tokens=True`` gives, and knows each sentinel as
  an added (non-special, so still split out) token with its special token's options, whose new id maps
  back to the real one. A copy, built once, rather than flipping the flag on the shared tokenizer that
  other threads encode with.

Text without placeholders is not touched here: the tokenizer's own encode runs, so its ids are
exactly what they always were. Non-special added tokens (Qwen's ``<tool_call>``, ``<think>``) are the
model's vocabulary, not boundaries, and are left alone: templates split on them (Qwen 3 drops an
assistant turn's reasoning up to ``</think>``), so hiding them would change what ordinary conversations
render, and the copy keeps their ids (sentinels are appended, no token is renumbered).
"""

from __future__ import annotations

import re
import secrets
import threading
from collections.abc import Sequence
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

_PLACEHOLDER = ("\ue000", "\ue001")  # around the nonce and a token index: a protected string in text
_SENTINEL = ("\ue002", "\ue003")  # the same, for the copy's tokenizer: a special token the template wrote


class SpecialText:
    """Protects untrusted text for one tokenizer and encodes rendered prompts that hold protected text."""

    def __init__(self, backend: BackendTokenizer, special_contents: Sequence[str]) -> None:
        self._backend = backend
        self._nonce = secrets.token_hex(8)
        # Longest first, so the alternation matches leftmost-longest as the tokenizer's own matching does.
        self._contents = sorted(set(special_contents), key=lambda c: (-len(c), c))
        self._index = {content: i for i, content in enumerate(self._contents)}
        self._pattern = re.compile("|".join(map(re.escape, self._contents))) if self._contents else None
        self.marker = _PLACEHOLDER[0] + self._nonce
        self._placeholder_pattern = re.compile(re.escape(self.marker) + "([0-9a-f]+)" + _PLACEHOLDER[1])
        self._copy: tuple[BackendTokenizer, dict[int, int]] | None = None
        self._copy_lock = threading.Lock()

    def protect(self, text: str) -> str:
        """``text`` with every special token's string in it replaced by its placeholder."""
        if self._pattern is None:
            return text
        return self._pattern.sub(lambda m: self._mark(_PLACEHOLDER, self._index[m.group()]), text)

    def protect_tree(self, value: Any) -> Any:
        """:meth:`protect` on every string inside nested dicts and lists (keys included)."""
        if isinstance(value, str):
            return self.protect(value)
        if isinstance(value, dict):
            return {self.protect(k) if isinstance(k, str) else k: self.protect_tree(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(self.protect_tree(v) for v in value)
        return value

    def holds_protected(self, text: str) -> bool:
        return self.marker in text

    def revealed(self, text: str) -> str:
        """``text`` with its placeholders back to the strings they stood for: what the caller wrote, to
        size it as sent."""
        if self.marker not in text:
            return text
        return self._placeholder_pattern.sub(lambda m: self._contents[int(m.group(1), 16)], text)

    def encode(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        """Token ids of rendered prompts holding placeholders (see the module doc); batch API, so the
        tokenizer runs with the GIL released."""
        copy, real_ids = self._tokenizer_copy()
        prepared = [self._prepared(text) for text in texts]
        encodings = copy.encode_batch(prepared, add_special_tokens=add_special_tokens)
        return [[real_ids.get(i, i) for i in encoding.ids] for encoding in encodings]

    def _prepared(self, text: str) -> str:
        if self._pattern is not None:
            text = self._pattern.sub(lambda m: self._mark(_SENTINEL, self._index[m.group()]), text)
        return self.revealed(text)

    def _mark(self, marks: tuple[str, str], index: int) -> str:
        return f"{marks[0]}{self._nonce}{index:x}{marks[1]}"

    def _tokenizer_copy(self) -> tuple[BackendTokenizer, dict[int, int]]:
        """The copy that encodes protected prompts, and its sentinels' ids -> the real special ids."""
        with self._copy_lock:
            if self._copy is None:
                copy = BackendTokenizer.from_str(self._backend.to_str())
                copy.no_padding()
                copy.no_truncation()
                copy.encode_special_tokens = True
                sentinels: dict[str, int] = {}
                added: list[AddedToken] = []
                for token_id, token in self._backend.get_added_tokens_decoder().items():
                    if token.special and token.content in self._index:
                        sentinel = self._mark(_SENTINEL, self._index[token.content])
                        sentinels[sentinel] = token_id
                        added.append(AddedToken(sentinel, single_word=token.single_word, lstrip=token.lstrip,
                                                rstrip=token.rstrip, normalized=token.normalized, special=False))
                # One call: each call rebuilds the tokenizer's added-token matcher (Gemma 3 has 6,249 specials).
                copy.add_tokens(added)
                self._copy = copy, {copy.token_to_id(sentinel): real for sentinel, real in sentinels.items()}
            return self._copy

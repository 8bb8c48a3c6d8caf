"""Tokenizer: text <-> ids, raw token bytes and chat prompts, from a GGUF file or a Hugging Face directory."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

from gguf import GGUFReader
from tokenizers import Tokenizer as BackendTokenizer

from protoserve.engine.loader.errors import ModelLoadError
from protoserve.engine.tokenizer.chat_template import ChatTemplate, ChatTemplateError
from protoserve.engine.tokenizer.gguf_tokenizer import load_gguf_tokenizer, special_tokens_processor
from protoserve.engine.tokenizer.special_text import SpecialText

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPM_SPACE = "\u2581"  # ▁
# Pre-tokenizers that split text without dropping any of it (Split and Punctuation only
# unless their behaviour is "Removed").
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"})
_MAX_UTF8_CHAR_BYTES = 4
_COUNT_PIECE_CHARS = 1 << 20  # fewest_tokens encodes this much at a time


@lru_cache(maxsize=1)
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable stand-in character -> byte value.

    Byte-level BPE spells every byte as a printable character (bytes that are
    already printable stand for themselves, the rest map to U+0100 onwards).
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _decoder_steps(backend: BackendTokenizer) -> list[dict[str, Any]]:
    """The backend's decoder as a flat list of JSON steps (Sequence decoders unrolled)."""
    if backend.decoder is None:
        return []
    root = json.loads(backend.decoder.__getstate__())

    def walk(step: dict[str, Any]) -> Iterator[dict[str, Any]]:
        if step.get("type") == "Sequence":
            for child in step.get("decoders", []):
                yield from walk(child)
        else:
            yield step

    return list(walk(root))


class Tokenizer:
    """Text <-> token ids for one model, plus what streaming and chat need.

    Wraps a ``tokenizers.Tokenizer``. Build it with :meth:`from_gguf`,
    :meth:`from_hf_dir` or :meth:`from_path`. Besides encode/decode it knows
    the raw UTF-8 bytes each token contributes (:meth:`token_bytes`), so an
    incremental detokenizer can hold back incomplete characters, and renders
    the model's chat template.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
        source: str | os.PathLike[str] = "<memory>",
    ) -> None:
        self.backend = backend
        # Serving encodes one text at a time; tokenizer.json may carry padding/truncation for training.
        backend.no_padding()
        backend.no_truncation()
        self.source = os.fspath(source)
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token is not None else None
        eos_ids = list(dict.fromkeys(int(i) for i in eos_token_ids))
        if not eos_ids and eos_token is not None and backend.token_to_id(eos_token) is not None:
            eos_ids = [backend.token_to_id(eos_token)]
        self.eos_token_ids: list[int] = eos_ids
        added = backend.get_added_tokens_decoder()
        self.all_special_ids: list[int] = sorted(i for i, token in added.items() if token.special)
        # Untrusted text (messages, documents, tool results) keeps special-token strings as text.
        self.special_text = SpecialText(backend, [added[i].content for i in self.all_special_ids])
        self._chat_template = (
            ChatTemplate(chat_template, bos_token=bos_token, eos_token=eos_token) if chat_template else None
        )
        self._byte_table, self.strips_leading_space = _token_byte_table(backend)

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_gguf(
        cls, source: str | os.PathLike[str] | GGUFReader, path: str | os.PathLike[str] | None = None
    ) -> Tokenizer:
        """The tokenizer a GGUF file describes (``source`` may be an opened reader, then pass ``path``)."""
        spec = load_gguf_tokenizer(source, path)
        origin = path if isinstance(source, GGUFReader) else source
        return cls(
            spec.backend,
            bos_token=spec.bos_token,
            eos_token=spec.eos_token,
            eos_token_ids=spec.eos_token_ids,
            chat_template=spec.chat_template,
            source=origin if origin is not None else "<gguf>",
        )

    @classmethod
    def from_hf_dir(cls, directory: str | os.PathLike[str]) -> Tokenizer:
        """Load ``tokenizer.json`` (+ ``tokenizer_config.json``, ``generation_config.json``) from a directory."""
        directory = Path(directory)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(tokenizer_file, "missing tokenizer file")
        try:
            backend = BackendTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # tokenizers raises a bare Exception for malformed JSON
            raise ModelLoadError(tokenizer_file, f"unreadable tokenizer ({exc})") from exc
        config = _read_json(directory / "tokenizer_config.json")
        generation = _read_json(directory / "generation_config.json")

        bos_token = _token_content(config.get("bos_token"))
        eos_token = _token_content(config.get("eos_token"))
        if "add_bos_token" in config or "add_eos_token" in config:
            # An explicit flag wins over the post-processor tokenizer.json was saved with, as in transformers.
            add_bos, add_eos = bool(config.get("add_bos_token")), bool(config.get("add_eos_token"))
            backend.post_processor = special_tokens_processor(
                bos_token if add_bos else None,
                backend.token_to_id(bos_token) if bos_token else None,
                eos_token if add_eos else None,
                backend.token_to_id(eos_token) if eos_token else None,
            )
        eos_ids = generation.get("eos_token_id")
        eos_ids = [eos_ids] if isinstance(eos_ids, int) else list(eos_ids or [])
        if (
            eos_token is not None
            and (eos_id := backend.token_to_id(eos_token)) is not None
            and eos_id not in eos_ids
        ):
            eos_ids.append(eos_id)
        return cls(
            backend,
            bos_token=bos_token,
            eos_token=eos_token,
            eos_token_ids=eos_ids,
            chat_template=_hf_chat_template(directory, config),
            source=directory,
        )

    @classmethod
    def from_path(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """A Hugging Face directory or a ``.gguf`` file."""
        path = Path(path)
        if path.is_dir():
            return cls.from_hf_dir(path)
        return cls.from_gguf(path)

    # -- ids ------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for ``text``; ``add_special_tokens`` adds BOS/EOS if the model wants them.

        Special tokens written in the text (``<|im_start|>``) encode as their single id, except inside
        text that went through :meth:`protect_special` (special_text.py): those stay text.
        """
        if self.special_text.holds_protected(text):
            return self.special_text.encode([text], add_special_tokens)[0]
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_unlocked(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """:meth:`encode` with the GIL released while the Rust tokenizer runs: for worker threads.

        ``tokenizers`` releases the GIL only in its batch API; a long text encoded with
        ``encode`` in a worker thread would still stop every other Python thread (a
        server's event loop) until it is done. A little slower than ``encode`` for short texts.
        """
        if self.special_text.holds_protected(text):
            return self.special_text.encode([text], add_special_tokens)[0]
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def protect_special(self, text: str) -> str:
        """Untrusted ``text`` to put into a prompt: its special-token strings will encode as text."""
        return self.special_text.protect(text)

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on ``len(encode(text))``, found without tokenizing; 0 when none holds.

        Every token stands for at most :attr:`max_token_span_bytes` bytes of the text, and
        bytes the vocabulary cannot spell (a byte-level BPE may lack a few control bytes) are
        dropped, so the text's other bytes need at least that many tokens. One pass over the
        text, in pieces, so other threads get the GIL in between.
        """
        bound = self._span_bound
        if bound is None:
            return 0
        span, dropped = bound
        text = self.special_text.revealed(text)  # placeholders are longer than what they stand for
        kept = 0
        for start in range(0, len(text), _COUNT_PIECE_CHARS):
            piece = text[start : start + _COUNT_PIECE_CHARS].encode("utf-8", "surrogatepass")
            kept += len(piece.translate(None, dropped)) if dropped else len(piece)
        return -(-kept // span)

    @property
    def max_token_span_bytes(self) -> int | None:
        """The most bytes of text one token can stand for; None when no such bound holds."""
        return self._span_bound[0] if self._span_bound is not None else None

    @cached_property
    def _span_bound(self) -> tuple[int, bytes] | None:
        """(most text bytes per token, byte values the encoding drops), or None.

        Holds when nothing between the text and the model folds input: no normalizer but
        ones that only grow it, pre-tokenizers that keep every character, added tokens that
        absorb no whitespace around them, and a model that spells every byte (a byte-level
        alphabet, less the byte values it lacks, which are dropped; byte fallback) or gives
        each unknown character a token of its own.
        """
        backend = self.backend
        pre_tokenizers = _steps_of(backend.pre_tokenizer)
        normalizers = _steps_of(backend.normalizer)
        if not _growing_normalizer(normalizers) or not _keeping_pre_tokenizer(pre_tokenizers):
            return None
        if any(t.lstrip or t.rstrip for t in backend.get_added_tokens_decoder().values()):
            return None
        longest = max((len(b) for b in self._byte_table), default=0)
        model = backend.model
        kind = type(model).__name__
        if kind in ("BPE", "Unigram") and getattr(model, "byte_fallback", False):
            if all(backend.token_to_id(f"<0x{b:02X}>") is not None for b in range(256)):
                return longest, b""
            return None
        if kind != "BPE":
            return None
        if any(step.get("type") == "ByteLevel" for step in pre_tokenizers) and not normalizers:
            alphabet = byte_level_alphabet()
            dropped = bytes(sorted(b for c, b in alphabet.items() if backend.token_to_id(c) is None))
            return longest, dropped
        if model.unk_token and not model.fuse_unk:
            return max(longest, _MAX_UTF8_CHAR_BYTES), b""  # one unknown token per character
        return None  # unknown characters are dropped, or a run of them is one token

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text for ``ids`` (invalid UTF-8 becomes U+FFFD)."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of ``token_id`` as stored (byte-level or ``▁`` spelling)."""
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes ``token_id`` adds to the decoded text, possibly part of a UTF-8 character.

        Concatenating these for a sequence gives ``decode(ids, skip_special_tokens=False)``
        encoded as UTF-8, except that tokenizers with ``strips_leading_space``
        drop one leading space from the whole text (SentencePiece's prefix space).
        """
        if not 0 <= token_id < len(self._byte_table):
            raise ValueError(f"token id {token_id} is outside the vocabulary of {len(self._byte_table)}")
        return self._byte_table[token_id]

    # -- chat -----------------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    def set_chat_template(self, source: str) -> None:
        """Use ``source`` as the chat template (a checkpoint without one gets its family's)."""
        self._chat_template = ChatTemplate(source, bos_token=self.bos_token, eos_token=self.eos_token)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template.source if self._chat_template is not None else None

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **variables: Any
    ) -> str:
        """The prompt text for a conversation; ChatTemplateError if the model has no template."""
        if self._chat_template is None:
            raise ChatTemplateError(
                f"{self.source}: this model has no chat template; send a plain prompt instead of chat messages"
            )
        return self._chat_template.render(messages, add_generation_prompt=add_generation_prompt, **variables)


def _steps_of(component: Any) -> list[dict[str, Any]]:
    """A normalizer's or pre-tokenizer's JSON steps, Sequences unrolled ([] for None)."""
    if component is None:
        return []
    return list(_unrolled(json.loads(component.__getstate__())))


def _unrolled(step: dict[str, Any]) -> Iterator[dict[str, Any]]:
    if step.get("type") == "Sequence":
        for child in step.get("normalizers", step.get("pretokenizers", [])):
            yield from _unrolled(child)
    else:
        yield step


def _growing_normalizer(steps: list[dict[str, Any]]) -> bool:
    """True when every step only adds text: Prepend, or Replace of a fixed string by one no shorter."""
    for step in steps:
        kind = step.get("type")
        if kind == "Prepend":
            continue
        pattern = step.get("pattern", {}).get("String") if kind == "Replace" else None
        if pattern is None or len(step.get("content", "").encode()) < len(pattern.encode()):
            return False
    return True


def _keeping_pre_tokenizer(steps: list[dict[str, Any]]) -> bool:
    """True when no step drops text (whitespace splitters and "Removed" splits do)."""
    return all(
        step.get("type") in _KEEPING_PRE_TOKENIZERS and step.get("behavior") != "Removed" for step in steps
    )


def _token_byte_table(backend: BackendTokenizer) -> tuple[list[bytes], bool]:
    """Raw bytes of every token id, and whether decoding strips one leading space.

    Mirrors what the backend's decoder does per token: byte-level BPE maps each
    stand-in character back to its byte (tokens outside that alphabet, such as
    some added tokens, are their own UTF-8); SentencePiece turns ``<0xNN>`` into
    byte NN and ``▁`` into a space.
    """
    steps = _decoder_steps(backend)
    kinds = {step.get("type") for step in steps}
    byte_level = "ByteLevel" in kinds
    sentencepiece = bool(kinds & {"ByteFallback", "Metaspace"}) or any(
        step.get("type") == "Replace" and step.get("pattern", {}).get("String") == _SPM_SPACE
        for step in steps
    )
    strips = any(step.get("type") == "Strip" and step.get("start", 0) > 0 for step in steps) or any(
        step.get("type") == "Metaspace" and step.get("prepend_scheme", "always") != "never" for step in steps
    )
    alphabet = byte_level_alphabet()
    added = backend.get_added_tokens_decoder()
    table: list[bytes] = []
    for token_id in range(backend.get_vocab_size(with_added_tokens=True)):
        token = backend.id_to_token(token_id)
        if token is None:
            table.append(b"")
        elif byte_level and all(c in alphabet for c in token):
            table.append(bytes(alphabet[c] for c in token))
        elif sentencepiece and token_id not in added and (match := _BYTE_TOKEN.fullmatch(token)):
            table.append(bytes([int(match.group(1), 16)]))
        elif sentencepiece:
            table.append(token.replace(_SPM_SPACE, " ").encode("utf-8"))
        else:
            table.append(token.encode("utf-8"))
    return table, strips


def _read_json(path: Path) -> dict[str, Any]:
    """An optional JSON config file as a dict ({} when absent); malformed JSON is ModelLoadError."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(path, f"unreadable JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(path, "expected a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken-like dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _hf_chat_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    """The default chat template: tokenizer_config.json, else chat_template.jinja / .json."""
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    if isinstance(template, str):
        return template
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(directory / "chat_template.json").get("chat_template")
    return template if isinstance(template, str) else None

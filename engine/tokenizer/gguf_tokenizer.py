"""Build a ``tokenizers.Tokenizer`` from a GGUF file's ``tokenizer.ggml.*`` metadata.

A GGUF carries no tokenizer.json, only llama.cpp's description of one: the
vocabulary, token types, merges or scores, and a pre-tokenizer *name*. We
rebuild the equivalent Hugging Face pipeline, following llama.cpp (the
program that defines what these files mean) where it and transformers differ:

* ``gpt2`` (byte-level BPE): the pre-tokenizer regexes llama.cpp applies for
  ``tokenizer.ggml.pre``, each one splitting the pieces of the previous one.
* ``llama`` (SentencePiece BPE): merges ranked by token score, ``<0xNN>``
  byte fallback, ``▁`` for spaces and an optional space prefix.

Control and unknown tokens become special added tokens and user-defined ones
plain added tokens, so each encodes as one id wherever it appears in text.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from gguf import GGUFReader
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from protoserve.engine.loader.errors import ModelLoadError
from protoserve.engine.loader.gguf_checkpoint import eog_token_ids, metadata_value, open_gguf

logger = logging.getLogger(__name__)

# llama.cpp's token types (llama_token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK3 = (
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")

# tokenizer.ggml.pre -> the regexes llama.cpp (llama-vocab.cpp) splits text with, in order.
PRE_TOKENIZER_REGEXES: dict[str, tuple[str, ...]] = {
    "default": _DEFAULT,
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe", "chatglm-bpe"), (_LLAMA3,)
    ),
    **dict.fromkeys(
        ("gpt-2", "phi-2", "roberta-bpe", "mpt", "olmo", "jais", "trillion", "granite-docling", "gigachat"),
        (_GPT2,),
    ),
    **dict.fromkeys(
        ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"), (r"\p{N}", _GPT2)
    ),
    **dict.fromkeys(("qwen2", "stablelm2", "deepseek-r1-qwen", "megrez", "hunyuan"), (_QWEN2,)),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), (_GPT4O,)),
    **dict.fromkeys(("poro-chat", "bloom", "gpt3-finnish"), (_BLOOM,)),
    "viking": (_BLOOM, r"\p{N}"),
    "tekken": (_TEKKEN,),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"),
    "deepseek-coder": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"),
    "deepseek-v3": (r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+", _DEEPSEEK3),
}
# Pre-tokenizers whose BPE looks a whole pre-token up in the vocabulary before merging,
# and which add BOS unless the file says otherwise (llama.cpp's per-type defaults).
_IGNORE_MERGES = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "tekken"})
_ADD_BOS_BY_DEFAULT = _IGNORE_MERGES | {"chameleon"}

_SPM_SPACE = "\u2581"  # ▁


@dataclass
class GGUFTokenizer:
    """A tokenizer rebuilt from GGUF metadata, plus the facts the engine needs about it."""

    backend: BackendTokenizer
    model: str  # tokenizer.ggml.model: "gpt2" or "llama"
    bos_token: str | None
    eos_token: str | None
    eos_token_ids: list[int] = field(default_factory=list)
    chat_template: str | None = None
    add_bos: bool = False
    add_eos: bool = False


def load_gguf_tokenizer(
    source: str | os.PathLike[str] | GGUFReader, path: str | os.PathLike[str] | None = None
) -> GGUFTokenizer:
    """Build the tokenizer a GGUF file describes.

    ``source`` is a path, or an already opened reader (pass ``path`` too, for
    error messages) so the file is not parsed twice. A missing or unsupported
    tokenizer is a ModelLoadError.
    """
    if isinstance(source, GGUFReader):
        reader, path = source, Path(path if path is not None else "<gguf>")
    else:
        path = Path(source)
        reader = open_gguf(path)

    model = metadata_value(reader, "tokenizer.ggml.model")
    tokens_field = reader.fields.get("tokenizer.ggml.tokens")
    if model is None or tokens_field is None:
        raise ModelLoadError(path, "no tokenizer in the GGUF metadata (tokenizer.ggml.model / tokens)")
    tokens: list[str] = tokens_field.contents()
    types: list[int] = metadata_value(reader, "tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ModelLoadError(path, f"{len(tokens)} tokens but {len(types)} token types")

    pre = metadata_value(reader, "tokenizer.ggml.pre", "default")
    if model == "gpt2":
        merges = metadata_value(reader, "tokenizer.ggml.merges")
        if merges is None:
            raise ModelLoadError(path, "byte-level BPE tokenizer without tokenizer.ggml.merges")
        backend = _byte_level_bpe(tokens, merges, pre)
        add_bos_default = pre in _ADD_BOS_BY_DEFAULT
    elif model == "llama":
        scores = metadata_value(reader, "tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise ModelLoadError(path, "SentencePiece tokenizer without one score per token")
        add_prefix = bool(metadata_value(reader, "tokenizer.ggml.add_space_prefix", True))
        unk_token = _token_text(
            path, tokens, metadata_value(reader, "tokenizer.ggml.unknown_token_id"), "unknown"
        )
        backend = _sentencepiece_bpe(tokens, scores, add_prefix, unk_token)
        add_bos_default = True
    else:
        raise ModelLoadError(path, f"unsupported tokenizer model {model!r} (supported: gpt2, llama)")

    _add_special_tokens(backend, tokens, types)

    bos_id = metadata_value(reader, "tokenizer.ggml.bos_token_id")
    eos_id = metadata_value(reader, "tokenizer.ggml.eos_token_id")
    bos_token = _token_text(path, tokens, bos_id, "bos")
    eos_token = _token_text(path, tokens, eos_id, "eos")
    add_bos = (
        bool(metadata_value(reader, "tokenizer.ggml.add_bos_token", add_bos_default))
        and bos_token is not None
    )
    add_eos = bool(metadata_value(reader, "tokenizer.ggml.add_eos_token", False)) and eos_token is not None
    backend.post_processor = special_tokens_processor(
        bos_token if add_bos else None, bos_id, eos_token if add_eos else None, eos_id
    )
    return GGUFTokenizer(
        backend=backend,
        model=model,
        bos_token=bos_token,
        eos_token=eos_token,
        eos_token_ids=eog_token_ids(reader),
        chat_template=metadata_value(reader, "tokenizer.chat_template"),
        add_bos=add_bos,
        add_eos=add_eos,
    )


def pre_tokenizer_regexes(pre: str) -> tuple[str, ...]:
    """llama.cpp's split regexes for a ``tokenizer.ggml.pre`` name (unknown names get ``default``, as there)."""
    regexes = PRE_TOKENIZER_REGEXES.get(pre)
    if regexes is None:
        logger.warning("unknown GGUF pre-tokenizer %r; using llama.cpp's 'default' regexes", pre)
        return _DEFAULT
    return regexes


def special_tokens_processor(
    bos_token: str | None, bos_id: int | None, eos_token: str | None, eos_id: int | None
) -> processors.TemplateProcessing:
    """A post-processor that wraps each sequence in BOS/EOS (either may be absent)."""
    specials: list[tuple[str, int]] = []
    bos: list[str] = []
    eos: list[str] = []
    if bos_token is not None and bos_id is not None:
        bos, specials = [bos_token], [*specials, (bos_token, int(bos_id))]
    if eos_token is not None and eos_id is not None:
        eos, specials = [eos_token], [*specials, (eos_token, int(eos_id))]
    single = [f"{t}:0" for t in bos] + ["$A:0"] + [f"{t}:0" for t in eos]
    pair = single + [f"{t}:1" for t in bos] + ["$B:1"] + [f"{t}:1" for t in eos]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str) -> BackendTokenizer:
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre in _IGNORE_MERGES))
    splits = [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in pre_tokenizer_regexes(pre)]
    # The regexes do the splitting; ByteLevel only maps bytes to its printable alphabet.
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(
    tokens: list[str], scores: list[float], add_prefix: bool, unk_token: str | None
) -> BackendTokenizer:
    vocab = {token: i for i, token in enumerate(tokens)}
    model = models.BPE(
        vocab=vocab,
        merges=merges_from_scores(tokens, scores),
        unk_token=unk_token,
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = BackendTokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPM_SPACE, prepend_scheme="first" if add_prefix else "never", split=False
    )
    steps = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score-driven merging.

    SentencePiece merges the adjacent pair whose concatenation has the best
    score; as BPE ranks that is every split ``(left, right)`` of a vocabulary
    token into two vocabulary tokens, best merged score first (ties: longer
    left piece, then longer right piece, then lower ids), the same order
    transformers derives for vocab-only checkpoints.
    """
    vocab = {token: i for i, token in enumerate(tokens)}
    candidates: list[tuple[str, str, float]] = []
    for token, score in dict(zip(tokens, scores, strict=True)).items():
        local = [
            (token[:i], token[i:], score)
            for i in range(1, len(token))
            if token[:i] in vocab and token[i:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        candidates.extend(local)
    candidates.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in candidates]


def _add_special_tokens(backend: BackendTokenizer, tokens: list[str], types: list[int]) -> None:
    """Register control/unknown tokens as special and user-defined ones as added tokens.

    Their text equals their vocabulary entry, so tokenizers keeps the
    existing ids; without this they would be split into pieces.
    """
    special = [
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(tokens, types, strict=True)
        if kind in (TOKEN_CONTROL, TOKEN_UNKNOWN) and token
    ]
    user = [
        AddedToken(token, special=False, normalized=False)
        for token, kind in zip(tokens, types, strict=True)
        if kind == TOKEN_USER_DEFINED and token
    ]
    backend.add_special_tokens(special)
    backend.add_tokens(user)


def _token_text(path: Path, tokens: list[str], token_id: int | None, role: str) -> str | None:
    if token_id is None:
        return None
    if not 0 <= token_id < len(tokens):
        raise ModelLoadError(path, f"{role} token id {token_id} is outside the vocabulary of {len(tokens)}")
    return tokens[token_id]

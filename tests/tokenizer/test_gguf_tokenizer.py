"""GGUF tokenizers: SmolLM2 against transformers, llama.cpp pre-tokenizer semantics, SentencePiece, HF directories."""

from __future__ import annotations

import json
import random
import unicodedata
from pathlib import Path

import gguf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import pre_tokenizers

from protoserve.engine.loader.errors import ModelLoadError
from protoserve.engine.tokenizer.gguf_tokenizer import PRE_TOKENIZER_REGEXES, merges_from_scores
from protoserve.engine.tokenizer.tokenizer import Tokenizer, byte_level_alphabet

# -- SmolLM2 against transformers --------------------------------------------------------------------

_WORDS = [
    "hello", "World", "the", "don't", "I'm", "we'll", "they've", "IT'S", "HTTP", "naïve", "café", "Zürich",
    "straße", "Ελληνικά", "русский", "текст", "日本語", "中文", "你好", "世界", "한국어", "العربية", "हिन्दी",
    "ไทย", "😀", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷", "❤️", "∑", "≠", "→", "€100", "$5.99", "3.14159", "2024",
    "1,000,000", "0x1F", "e=mc^2", "C++", "<html>", "</div>", '{"a": 1}', "def", "return", "x**2", "//",
    "/*", "*/", "#include", "snake_case", "camelCase", "URL:", "https://example.com/a?b=c", "user@example.com",
    "...", "!!!", "?!", "—", "–", "«", "»", "“quoted”", "'single'", "`code`", "a", "I", "x1", "ŉ", "ǅ",
    "ﬁ", "Ａｂｃ", "\u200b", "é", "e\u0301",
]  # fmt: skip
_SEPARATORS = [" ", " ", " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ", "    ", "", "\u00a0", "\u3000"]
_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>", "<file_sep>", "<jupyter_code>"]
_FIXED = [
    "",
    " ",
    "\n",
    "    ",
    "\n\n\n\n",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    'for (int i = 0; i < 10; ++i) {\n\tprintf("%d\\n", i);\n}',
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "trailing spaces   ",
    "   leading spaces",
    "mixed\ttabs\tand  spaces\r\nand CRLF",
    "I'll say it's 'quoted' and \"double\"",
    "<|im_start|><|im_end|><|endoftext|>",
    "not special: <|im_start |> <im_start> |im_end|",
]


def _generated_texts(count: int = 220, seed: int = 1234) -> list[str]:
    rng = random.Random(seed)
    texts = list(_FIXED)
    while len(texts) < count:
        parts = []
        for _ in range(rng.randint(1, 12)):
            parts.append(rng.choice(_SPECIALS) if rng.random() < 0.08 else rng.choice(_WORDS))
            parts.append(rng.choice(_SEPARATORS))
        text = "".join(parts)
        if rng.random() < 0.2:
            text = rng.choice(_SEPARATORS) + text
        texts.append(text if rng.random() < 0.7 else text.rstrip())
    return texts


TEXTS = _generated_texts()


def test_generated_texts_are_varied():
    assert len(TEXTS) >= 200 and len(set(TEXTS)) >= 200
    joined = "".join(TEXTS)
    for needle in ("<|im_start|>", "😀", "你好", "\n\n", "\r\n", "    ", "don't"):
        assert needle in joined


def _has_numeral(text: str) -> bool:
    return any(unicodedata.category(c).startswith("N") for c in text)


@pytest.fixture(scope="module")
def hf_smollm2_published_pre_tokenizer(hf_smollm2_tokenizer) -> BackendTokenizer:
    """transformers' GGUF conversion with the pre-tokenizer SmolLM2's own tokenizer.json declares.

    transformers ignores the file's `smollm` pre-tokenizer and splits with the GPT-2 regex alone;
    llama.cpp and SmolLM2's tokenizer.json first isolate every numeral (Digits(individual_digits)).
    """
    backend = BackendTokenizer.from_str(hf_smollm2_tokenizer.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return backend


@pytest.mark.slow
def test_encode_matches_transformers_with_published_pre_tokenizer(
    smollm2_tokenizer, hf_smollm2_published_pre_tokenizer
):
    reference = hf_smollm2_published_pre_tokenizer
    mismatches = [
        (text, ours, theirs)
        for text in TEXTS
        for add in (True, False)
        if (ours := smollm2_tokenizer.encode(text, add_special_tokens=add))
        != (theirs := reference.encode(text, add_special_tokens=add).ids)
    ]
    assert mismatches == []


@pytest.mark.slow
def test_encode_matches_transformers_gguf_tokenizer(smollm2_tokenizer, hf_smollm2_tokenizer):
    """Unmodified transformers agrees on every text without numerals (see the fixture above for why not those)."""
    compared = [text for text in TEXTS if not _has_numeral(text)]
    assert len(compared) >= 100
    mismatches = [
        (text, ours, theirs)
        for text in compared
        for add in (True, False)
        if (ours := smollm2_tokenizer.encode(text, add_special_tokens=add))
        != (theirs := hf_smollm2_tokenizer.encode(text, add_special_tokens=add))
    ]
    assert mismatches == []


@pytest.mark.slow
def test_decode_matches_transformers(smollm2_tokenizer, hf_smollm2_tokenizer):
    mismatches = []
    for text in TEXTS:
        ids = hf_smollm2_tokenizer.encode(text)
        for skip in (True, False):
            ours = smollm2_tokenizer.decode(ids, skip_special_tokens=skip)
            theirs = hf_smollm2_tokenizer.decode(ids, skip_special_tokens=skip)
            if ours != theirs:
                mismatches.append((text, skip, ours, theirs))
    assert mismatches == []


@pytest.mark.slow
def test_vocabulary_and_special_ids_match_transformers(smollm2_tokenizer, hf_smollm2_tokenizer):
    assert smollm2_tokenizer.vocab_size == len(hf_smollm2_tokenizer) == 49152
    for token_id in (0, 1, 2, 17, 100, 5000, 49151):
        assert smollm2_tokenizer.id_to_token(token_id) == hf_smollm2_tokenizer.convert_ids_to_tokens(token_id)
    assert set(hf_smollm2_tokenizer.all_special_ids) <= set(smollm2_tokenizer.all_special_ids)
    assert smollm2_tokenizer.bos_token_id == hf_smollm2_tokenizer.bos_token_id
    assert smollm2_tokenizer.eos_token_ids[0] == hf_smollm2_tokenizer.eos_token_id


def test_roundtrip_is_lossless(smollm2_tokenizer):
    bad = [
        t
        for t in TEXTS
        if smollm2_tokenizer.decode(smollm2_tokenizer.encode(t), skip_special_tokens=False) != t
    ]
    assert bad == []


def test_token_bytes_concatenate_to_decoded_text(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert not tok.strips_leading_space
    for text in TEXTS:
        ids = tok.encode(text)
        assert (
            b"".join(tok.token_bytes(i) for i in ids) == tok.decode(ids, skip_special_tokens=False).encode()
        )


def test_token_bytes_can_split_a_character(smollm2_tokenizer):
    """Emoji span several byte-level tokens; some tokens alone are not valid UTF-8."""
    tok = smollm2_tokenizer
    ids = tok.encode("👨‍👩‍👧‍👦")
    pieces = [tok.token_bytes(i) for i in ids]
    assert b"".join(pieces) == "👨‍👩‍👧‍👦".encode()

    def valid(data: bytes) -> bool:
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            return False
        return True

    assert not all(valid(p) for p in pieces)
    assert tok.token_bytes(tok.encode("<|im_start|>")[0]) == b"<|im_start|>"
    with pytest.raises(ValueError):
        tok.token_bytes(tok.vocab_size)


def test_smollm2_special_tokens(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert tok.encode("<|im_start|>user") == [1, *tok.encode("user")]
    assert tok.encode("<|endoftext|>") == [0]
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>")) == "hi"
    assert tok.all_special_ids == list(range(17))  # the file's 17 control tokens
    assert (tok.bos_token_id, tok.eos_token_ids) == (1, [2, 0])
    assert tok.encode("hi")[0] != tok.bos_token_id  # SmolLM2 adds no BOS


def test_smollm2_isolates_every_numeral_like_llama_cpp(smollm2_tokenizer):
    """The `smollm` pre-tokenizer splits off each numeral before the GPT-2 regex runs, so a
    whitespace run before a digit stays whole and non-ASCII numerals stand alone."""
    tok = smollm2_tokenizer
    assert [tok.id_to_token(i) for i in tok.encode("x 2024")] == ["x", "Ġ", "2", "0", "2", "4"]
    assert [tok.id_to_token(i) for i in tok.encode("a\n\n1.")] == ["a", "ĊĊ", "1", "."]
    assert [tok.id_to_token(i) for i in tok.encode(" ²")] == ["Ġ", "Â²"]


# -- synthetic GGUF tokenizers -----------------------------------------------------------------------


def write_tokenizer_gguf(path: Path, model: str, tokens: list[str], **fields: object) -> Path:
    """A GGUF with tokenizer metadata only."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    for key, value in fields.items():
        if key == "types":
            writer.add_token_types(value)
        elif key == "merges":
            writer.add_token_merges(value)
        elif key == "scores":
            writer.add_token_scores(value)
        elif key == "pre":
            writer.add_tokenizer_pre(value)
        elif key == "chat_template":
            writer.add_chat_template(value)
        elif key in ("add_bos", "add_eos", "add_space_prefix"):
            writer.add_bool(f"tokenizer.ggml.{key}{'_token' if key != 'add_space_prefix' else ''}", value)
        elif key.endswith("_id"):
            writer.add_uint32(f"tokenizer.ggml.{key.replace('_id', '_token_id')}", value)
        else:
            raise KeyError(key)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _byte_level_vocab() -> tuple[list[str], list[str], list[int]]:
    """256 byte tokens, a few merges, and two control tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # the reference GPT-2 byte alphabet

    alphabet = bytes_to_unicode()
    tokens = [alphabet[b] for b in range(256)]
    merges = ["1 2", "12 3", "4 5", "45 6", "h e", "he l", "hel l", "hell o", "Ġ w"]
    tokens += [m.replace(" ", "") for m in merges] + ["<bos>", "<eos>"]
    types = [1] * (len(tokens) - 2) + [3, 3]
    return tokens, merges, types


def test_byte_level_alphabet_matches_gpt2():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    assert byte_level_alphabet() == {c: b for b, c in bytes_to_unicode().items()}


@pytest.mark.parametrize(
    ("pre", "expected"),
    [
        ("gpt-2", ["123", "45", "Ġ", "6", "Ġw", "hello"]),
        ("qwen2", ["1", "2", "3", "4", "5", "Ġ", "6", "Ġw", "hello"]),
        ("smollm", ["1", "2", "3", "4", "5", "Ġ", "6", "Ġw", "hello"]),
        ("llama-bpe", ["123", "45", "Ġ", "6", "Ġw", "hello"]),
        ("no-such-pre", ["123", "45", "Ġ", "6", "Ġw", "hello"]),
    ],
)
def test_pre_tokenizer_regexes_follow_llama_cpp(tmp_path, pre, expected):
    tokens, merges, types = _byte_level_vocab()
    path = write_tokenizer_gguf(
        tmp_path / "bpe.gguf", "gpt2", tokens, types=types, merges=merges, pre=pre, add_bos=False
    )
    tok = Tokenizer.from_gguf(path)
    ids = tok.encode("12345 6 whello")
    assert [tok.id_to_token(i) for i in ids] == expected
    assert tok.decode(ids) == "12345 6 whello"


def test_default_pre_tokenizer_splits_digit_triples_before_bpe(tmp_path):
    """llama.cpp's `default` ends with [0-9]{3}: "4512" -> "451" + "2", so the "1 2" merge cannot apply."""
    tokens, merges, types = _byte_level_vocab()
    spellings = {}
    for pre in ("default", "gpt-2"):
        path = write_tokenizer_gguf(
            tmp_path / f"{pre}.gguf", "gpt2", tokens, types=types, merges=merges, pre=pre
        )
        tok = Tokenizer.from_gguf(path)
        spellings[pre] = [tok.id_to_token(i) for i in tok.encode("4512")]
    assert spellings == {"default": ["45", "1", "2"], "gpt-2": ["45", "12"]}
    assert {"llama-bpe", "qwen2", "smollm", "default"} <= set(PRE_TOKENIZER_REGEXES)


@pytest.mark.parametrize(
    ("pre", "flags", "bos", "eos"),
    [
        ("gpt-2", {}, False, False),
        ("llama-bpe", {}, True, False),  # llama.cpp adds BOS for llama3 vocabularies unless told otherwise
        ("llama-bpe", {"add_bos": False}, False, False),
        ("qwen2", {"add_bos": True, "add_eos": True}, True, True),
    ],
)
def test_bos_and_eos_flags(tmp_path, pre, flags, bos, eos):
    tokens, merges, types = _byte_level_vocab()
    n = len(tokens)
    path = write_tokenizer_gguf(
        tmp_path / "f.gguf",
        "gpt2",
        tokens,
        types=types,
        merges=merges,
        pre=pre,
        bos_id=n - 2,
        eos_id=n - 1,
        **flags,
    )
    tok = Tokenizer.from_gguf(path)
    body = tok.encode("hello", add_special_tokens=False)
    assert tok.encode("hello") == [n - 2] * bos + body + [n - 1] * eos
    assert tok.encode("<bos>hello<eos>", add_special_tokens=False) == [n - 2, *body, n - 1]
    assert (tok.bos_token_id, tok.eos_token_ids) == (n - 2, [n - 1])


def _spm_vocab() -> tuple[list[str], list[float], list[int]]:
    pieces = {
        "▁": -1.0, "h": -2.0, "e": -2.0, "l": -2.0, "o": -2.0, "w": -2.0, "r": -2.0, "d": -2.0,
        "▁h": -3.0, "▁he": -4.0, "ll": -3.5, "llo": -5.0, "▁hello": -6.0, "▁w": -3.0, "or": -3.2,
        "▁wor": -5.5, "ld": -3.3, "▁world": -7.0, "he": -3.1, "lo": -3.4,
    }  # fmt: skip
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(pieces) + ["<|user|>"]
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + list(pieces.values()) + [0.0]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [4]
    return tokens, scores, types


SPM_TEXTS = [
    "hello world",
    "hello",
    " hello",
    "hello  world ",
    "héllo wörld 😀",
    "<s>hello</s>",
    "world<|user|>hello",
    "",
    "\n",
    "hello\nworld",
    "lo he ll",
]


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory) -> Path:
    tokens, scores, types = _spm_vocab()
    return write_tokenizer_gguf(
        tmp_path_factory.mktemp("spm") / "spm.gguf",
        "llama",
        tokens,
        scores=scores,
        types=types,
        bos_id=1,
        eos_id=2,
        unknown_id=0,
    )


def test_sentencepiece_matches_transformers(spm_gguf):
    transformers = pytest.importorskip("transformers")
    ours = Tokenizer.from_gguf(spm_gguf)
    theirs = transformers.AutoTokenizer.from_pretrained(str(spm_gguf.parent), gguf_file=spm_gguf.name)
    for text in SPM_TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False), (
            text
        )


def test_sentencepiece_pieces_bytes_and_specials(spm_gguf):
    tok = Tokenizer.from_gguf(spm_gguf)
    assert [tok.id_to_token(i) for i in tok.encode("hello world", add_special_tokens=False)] == [
        "▁hello",
        "▁world",
    ]
    assert tok.encode("hello")[0] == tok.bos_token_id == 1  # SentencePiece vocabularies add BOS by default
    assert tok.eos_token_ids == [2] and 0 in tok.all_special_ids and 1 in tok.all_special_ids
    user = tok.token_to_id("<|user|>")
    assert user in tok.encode("a<|user|>b") and user not in tok.all_special_ids
    # é is not in the vocabulary: byte fallback, two <0xNN> tokens whose bytes form the character.
    ids = tok.encode("é", add_special_tokens=False)
    assert [tok.id_to_token(i) for i in ids][-2:] == ["<0xC3>", "<0xA9>"]
    assert [tok.token_bytes(i) for i in ids[-2:]] == [b"\xc3", b"\xa9"]
    assert tok.token_bytes(tok.token_to_id("▁hello")) == b" hello"
    assert tok.strips_leading_space
    for text in SPM_TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        raw = b"".join(tok.token_bytes(i) for i in ids)
        assert raw.removeprefix(b" ") == tok.decode(ids, skip_special_tokens=False).encode(), text


def test_no_space_prefix_flag(tmp_path):
    tokens, scores, types = _spm_vocab()
    path = write_tokenizer_gguf(
        tmp_path / "np.gguf", "llama", tokens, scores=scores, types=types, add_space_prefix=False
    )
    tok = Tokenizer.from_gguf(path)
    assert [tok.id_to_token(i) for i in tok.encode("hello", add_special_tokens=False)] == ["he", "llo"]
    assert not tok.strips_leading_space


def test_merges_from_scores_prefers_better_merged_score():
    merges = merges_from_scores(["a", "b", "c", "ab", "bc", "abc"], [0, 0, 0, -2.0, -1.0, -3.0])
    assert merges == [("b", "c"), ("a", "b"), ("ab", "c"), ("a", "bc")]


def test_gguf_without_tokenizer_is_model_load_error(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "none.gguf"), "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="no tokenizer"):
        Tokenizer.from_gguf(tmp_path / "none.gguf")


def test_unsupported_tokenizer_model(tmp_path):
    path = write_tokenizer_gguf(tmp_path / "bert.gguf", "bert", ["[CLS]", "a"])
    with pytest.raises(ModelLoadError, match="unsupported tokenizer model 'bert'") as info:
        Tokenizer.from_gguf(path)
    assert str(path) in str(info.value)


def test_missing_tokenizer_file(tmp_path):
    with pytest.raises(ModelLoadError) as info:
        Tokenizer.from_path(tmp_path / "missing.gguf")
    assert "missing.gguf" in str(info.value)
    with pytest.raises(ModelLoadError) as info:
        Tokenizer.from_hf_dir(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(info.value)


# -- Hugging Face directories -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_hf_dir(tmp_path_factory, smollm2_tokenizer) -> Path:
    """SmolLM2's tokenizer saved the way a Hugging Face checkpoint ships it."""
    directory = tmp_path_factory.mktemp("smollm2_hf")
    smollm2_tokenizer.backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": {"content": "<|im_start|>", "special": True},
                "eos_token": "<|im_end|>",
                "chat_template": smollm2_tokenizer.chat_template,
            }
        )
    )
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], "bos_token_id": 1}))
    return directory


def test_hf_dir_tokenizer(smollm2_hf_dir, smollm2_tokenizer):
    tok = Tokenizer.from_path(smollm2_hf_dir)
    assert (tok.bos_token_id, tok.eos_token_ids) == (1, [2, 0])
    assert tok.all_special_ids == smollm2_tokenizer.all_special_ids
    for text in TEXTS[:60]:
        assert tok.encode(text) == smollm2_tokenizer.encode(text)
    messages = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(messages) == smollm2_tokenizer.apply_chat_template(messages)


def test_hf_dir_add_bos_flag_and_separate_template(tmp_path, smollm2_hf_dir):
    for name in ("tokenizer.json", "generation_config.json"):
        (tmp_path / name).write_bytes((smollm2_hf_dir / name).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|im_start|>", "add_bos_token": True})
    )
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.encode("hi")[0] == 1 and tok.encode("hi", add_special_tokens=False)[0] != 1
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"


def test_hf_dir_malformed_config(tmp_path, smollm2_hf_dir):
    (tmp_path / "tokenizer.json").write_bytes((smollm2_hf_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError) as info:
        Tokenizer.from_hf_dir(tmp_path)
    assert "tokenizer_config.json" in str(info.value)


# -- token counts bounded from bytes, and encoding without the GIL ------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_fewest_tokens_never_exceeds_the_encoding(smollm2_tokenizer, text):
    assert smollm2_tokenizer.fewest_tokens(text) <= len(smollm2_tokenizer.encode(text, add_special_tokens=False))


def test_smollm2_token_span_bound(smollm2_tokenizer):
    """A token stands for at most its longest vocabulary entry's bytes; bytes SmolLM2 cannot spell are dropped."""
    span = smollm2_tokenizer.max_token_span_bytes
    assert span == max(len(smollm2_tokenizer.token_bytes(i)) for i in range(smollm2_tokenizer.vocab_size))
    for text in [*TEXTS, "\n" + " " * 200, "x" * 10_000, "<|im_start|>" * 50]:
        assert smollm2_tokenizer.fewest_tokens(text) <= len(smollm2_tokenizer.encode(text, add_special_tokens=False))
    assert smollm2_tokenizer.fewest_tokens("x" * (10 * span)) == 10
    # \x04 is not in SmolLM2's vocabulary: encoding drops it, so a text of them proves nothing.
    assert smollm2_tokenizer.encode("\x04" * 1000, add_special_tokens=False) == []
    assert smollm2_tokenizer.fewest_tokens("\x04" * 1000) == 0


def test_sentencepiece_with_byte_fallback_has_a_span_bound(spm_gguf):
    tok = Tokenizer.from_gguf(spm_gguf)
    assert tok.max_token_span_bytes == len("<|user|>")  # the longest entry is the added token
    for text in SPM_TEXTS:
        assert tok.fewest_tokens(text) <= len(tok.encode(text, add_special_tokens=False)), text


def test_no_span_bound_where_input_can_fold_or_vanish():
    from tokenizers import models, normalizers

    vocab = {"[UNK]": 0, "a": 1, "b": 2}
    folding = BackendTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    folding.normalizer = normalizers.NFKC()
    splitting = BackendTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    splitting.pre_tokenizer = pre_tokenizers.Whitespace()  # drops every space
    fused = BackendTokenizer(models.BPE(vocab, [], unk_token="[UNK]", fuse_unk=True))
    for backend in (folding, splitting, fused):
        tok = Tokenizer(backend)
        assert tok.max_token_span_bytes is None and tok.fewest_tokens("a" * 1000) == 0


def test_encode_unlocked_matches_encode(smollm2_tokenizer):
    for text in TEXTS:
        for special in (True, False):
            assert smollm2_tokenizer.encode_unlocked(text, special) == smollm2_tokenizer.encode(text, special)

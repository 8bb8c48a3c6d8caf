"""EmbeddingModel against sentence-transformers on the same directory (the reference pipeline)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from protoserve.engine.embedding.bert import parse_bert_config
from protoserve.engine.embedding.default_model import default_embedding_model_dir
from protoserve.engine.embedding.errors import EmbeddingInputTooLong
from protoserve.engine.embedding.model import EmbeddingModel
from protoserve.engine.errors import ContextLengthError
from protoserve.engine.loader.errors import ModelLoadError


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_attributes(embedding_model):
    assert embedding_model.name == "all-MiniLM-L6-v2"
    assert embedding_model.dimensions == 384
    assert embedding_model.max_tokens == 256
    assert embedding_model.special_tokens == 2


def test_engine_code_does_not_need_transformers():
    # A fresh interpreter: this test session imports sentence-transformers (and so transformers) itself.
    import subprocess

    code = (
        "import sys; from protoserve.engine.embedding.model import EmbeddingModel;"
        "from protoserve.engine.embedding.worker import EmbeddingWorker;"
        "m = EmbeddingModel.load(); m.embed_texts(['x']);"
        "assert 'transformers' not in sys.modules and 'sentence_transformers' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_vectors_match_sentence_transformers(embedding_model, reference_model, varied_texts):
    assert reference_model.max_seq_length == 256
    ours = embedding_model.embed_texts(varied_texts)
    # The directory's modules end in Normalize, so encode() already returns unit vectors.
    reference = reference_model.encode(varied_texts, batch_size=32, normalize_embeddings=False)
    assert ours.dtype == np.float32 and ours.shape == (len(varied_texts), 384)
    np.testing.assert_allclose(np.linalg.norm(reference, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    cosines = _cosines(ours, reference)
    worst = int(cosines.argmin())
    assert cosines.min() >= 0.9999, (worst, varied_texts[worst], cosines[worst])
    # The test set really spans the window, not just short texts.
    counts = embedding_model.count_tokens(varied_texts)
    assert min(counts) == 2 and max(counts) >= 240


def test_count_tokens_matches_hf_tokenizer(embedding_model, reference_model, varied_texts):
    longer = [" ".join(varied_texts[i : i + 8]) for i in range(0, 40, 8)]  # past the window: not truncated
    texts = varied_texts + longer
    expected = [len(ids) for ids in reference_model.tokenizer(texts, truncation=False)["input_ids"]]
    assert embedding_model.count_tokens(texts) == expected
    assert max(expected) > 256


def test_window_boundary_and_too_long_names_the_index(embedding_model):
    fits = "a " * 254  # 254 tokens + [CLS] + [SEP] = 256
    assert embedding_model.count_tokens([fits]) == [256]
    assert embedding_model.embed_texts([fits]).shape == (1, 384)
    with pytest.raises(EmbeddingInputTooLong) as info:
        embedding_model.embed_texts(["short", fits, fits + "a", "also short"])
    err = info.value
    assert (err.index, err.tokens, err.max_tokens) == (2, 257, 256)
    assert "input 2" in str(err) and "257" in str(err) and "256" in str(err)
    assert isinstance(err, ContextLengthError)  # the server maps it like an LLM context overflow


def test_token_ids_path_equals_text_path(embedding_model, varied_texts):
    texts = varied_texts[:40]
    ids = embedding_model.tokenize(texts)
    assert all(101 not in row and 102 not in row for row in ids)  # no specials
    for text, row in zip(texts[:10], ids[:10], strict=True):
        np.testing.assert_allclose(
            embedding_model.embed_token_ids([row]), embedding_model.embed_texts([text]), atol=1e-6
        )
    assert _cosines(embedding_model.embed_token_ids(ids), embedding_model.embed_texts(texts)).min() >= 0.99999


def test_token_ids_validation(embedding_model):
    with pytest.raises(ValueError, match=r"ids\[1\]\[2\] = 30522"):
        embedding_model.embed_token_ids([[7592], [7592, 2088, 30522]])
    with pytest.raises(ValueError, match=r"ids\[0\]\[0\] = -1"):
        embedding_model.embed_token_ids([[-1]])
    with pytest.raises(TypeError, match=r"ids\[0\]\[1\]"):
        embedding_model.embed_token_ids([[7592, 1.5]])
    with pytest.raises(EmbeddingInputTooLong) as info:
        embedding_model.embed_token_ids([[7592] * 254, [7592] * 255])
    assert (info.value.index, info.value.tokens) == (1, 257)


def test_texts_validation(embedding_model):
    with pytest.raises(TypeError, match=r"texts\[1\]"):
        embedding_model.embed_texts(["ok", b"bytes"])
    with pytest.raises(TypeError, match="texts must be a list"):
        embedding_model.embed_texts("not a list")
    with pytest.raises(ValueError, match="batch_size"):
        embedding_model.embed_texts(["ok"], batch_size=0)
    assert embedding_model.embed_texts([]).shape == (0, 384)


def test_batching_does_not_change_vectors(embedding_model, varied_texts):
    texts = varied_texts[::10]  # 20 texts of very different lengths, so batches pad a lot
    one_by_one = np.concatenate([embedding_model.embed_texts([t]) for t in texts])
    for batch_size in (3, 32):
        batched = embedding_model.embed_texts(texts, batch_size=batch_size)
        assert _cosines(batched, one_by_one).min() >= 0.99999


def test_load_by_path_takes_directory_name(tmp_path):
    copy = tmp_path / "my-minilm"
    shutil.copytree(default_embedding_model_dir(), copy)
    model = EmbeddingModel.load(str(copy))
    assert model.name == "my-minilm" and model.dimensions == 384
    assert EmbeddingModel.load(default_embedding_model_dir()).name == "all-MiniLM-L6-v2"


def _copy_with(tmp_path: Path, edit) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(default_embedding_model_dir(), copy)
    edit(copy)
    return copy


def test_refuses_pipelines_it_does_not_implement(tmp_path):
    def add_dense(d: Path) -> None:
        modules = json.loads((d / "modules.json").read_text())
        modules.insert(
            2, {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
        )
        (d / "modules.json").write_text(json.dumps(modules))

    with pytest.raises(ModelLoadError, match="Dense"):
        EmbeddingModel.load(_copy_with(tmp_path / "a", add_dense))

    def weighted_pooling(d: Path) -> None:
        config = json.loads((d / "1_Pooling/config.json").read_text())
        config |= {"pooling_mode_mean_tokens": False, "pooling_mode_weightedmean_tokens": True}
        (d / "1_Pooling/config.json").write_text(json.dumps(config))

    with pytest.raises(ModelLoadError, match="weightedmean"):
        EmbeddingModel.load(_copy_with(tmp_path / "b", weighted_pooling))

    with pytest.raises(ModelLoadError, match="modules.json"):
        EmbeddingModel.load(_copy_with(tmp_path / "c", lambda d: (d / "modules.json").unlink()))


def test_bert_config_refusals():
    raw = json.loads((default_embedding_model_dir() / "config.json").read_text())
    assert parse_bert_config(raw, Path("config.json")).hidden_act == "gelu"
    with pytest.raises(ModelLoadError, match="hidden_act 'swish'"):
        parse_bert_config(raw | {"hidden_act": "swish"}, Path("config.json"))
    with pytest.raises(ModelLoadError, match="position_embedding_type"):
        parse_bert_config(raw | {"position_embedding_type": "relative_key"}, Path("config.json"))
    with pytest.raises(ModelLoadError, match="num_hidden_layers"):
        parse_bert_config({k: v for k, v in raw.items() if k != "num_hidden_layers"}, Path("config.json"))


def test_bert_prefixed_checkpoint_loads(tmp_path):
    from safetensors.torch import load_file, save_file

    def prefix(d: Path) -> None:
        tensors = load_file(d / "model.safetensors")
        save_file({f"bert.{k}": v.contiguous() for k, v in tensors.items()}, d / "model.safetensors")

    model = EmbeddingModel.load(_copy_with(tmp_path, prefix))
    reference = EmbeddingModel.load()
    np.testing.assert_allclose(
        model.embed_texts(["prefixed"]), reference.embed_texts(["prefixed"]), atol=1e-6
    )

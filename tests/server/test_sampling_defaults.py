"""Server-side sampling defaults (vLLM's --generation-config): the model's own, the --default-* flags over
them, what GetModel reports, and the parameter count GetModel reports.

A tiny random Llama written with transformers, with a generation_config.json, served by a real
ServerApp in this process over a real channel.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from grpc_status_helpers import failure_of

from protoserve.engine.loader.sampling_defaults import gguf_sampling_defaults, hf_sampling_defaults
from protoserve.openai.v1 import openai_pb2 as oa
from protoserve.openai.v1 import openai_pb2_grpc
from protoserve.server.app import ServerApp, ServerConfig
from protoserve.server.models.model_spec import ModelSpec
from protoserve.server.models.sampling_mapping import served_defaults
from protoserve.server.security.auth import Authenticator
from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc

VOCAB = 300  # 256 byte tokens, the EOS, and a padded tail
EOS = 256
RECOMMENDED = {"temperature": 0.5, "top_k": 1, "top_p": 0.9, "do_sample": True}
PROMPT = "hello there, tiny model"


def write_tiny_llama(directory: Path) -> int:
    """A random Llama with a byte-level tokenizer and RECOMMENDED as its generation config; its size."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    from protoserve.engine.tokenizer.tokenizer import byte_level_alphabet

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, eos_token_id=EOS, bos_token_id=None,
        pad_token_id=None, tie_word_embeddings=False, initializer_range=0.2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(directory, safe_serialization=True)
    (directory / "generation_config.json").write_text(json.dumps({**RECOMMENDED, "eos_token_id": EOS}))
    alphabet = sorted(byte_level_alphabet().items(), key=lambda kv: kv[1])
    tokenizer = Tokenizer(models.BPE(vocab={char: byte for char, byte in alphabet}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|endoftext|>"])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return model.num_parameters()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> tuple[Path, int]:
    directory = tmp_path_factory.mktemp("tiny-llama-with-generation-config")
    return directory, write_tiny_llama(directory)


async def serving(model_dir: Path, **defaults: float) -> ServerApp:
    config = ServerConfig(models=(ModelSpec(str(model_dir)),), port=0, http_port=None, grace_period_s=1.0, progress=False,
                          quantization="none", sampling_defaults=defaults,
                          # Several apps of this module are up at once; a RAG store opens in one at a time.
                          embeddings=False)
    app = ServerApp(config, auth=Authenticator())
    await app.start()
    await app.load_model()
    return app


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def model_defaults(tiny_model):
    """The tiny model served with its own recommendation only."""
    app = await serving(tiny_model[0])
    channel = grpc.aio.insecure_channel(app.grpc_target)
    yield inference_pb2_grpc.InferenceServiceStub(channel), openai_pb2_grpc.OpenAIServiceStub(channel)
    await channel.close()
    await app.stop()


def generate(**sampling) -> pb.GenerateRequest:
    fields = {"max_tokens": 6, "ignore_eos": True, "logprobs": True, "seed": 3, **sampling}
    return pb.GenerateRequest(prompt=PROMPT, sampling=pb.SamplingParams(**fields))


def logprobs(response: pb.GenerateResponse) -> list[tuple[int, float]]:
    return [(p.chosen.token_id, p.chosen.logprob) for p in response.choices[0].logprobs]


@pytest.mark.asyncio(loop_scope="module")
async def test_get_model_reports_the_model_defaults_and_its_parameter_count(model_defaults, tiny_model):
    stub, _ = model_defaults
    (info,) = (await stub.ListModels(pb.ListModelsRequest())).models
    assert info.num_parameters == tiny_model[1] > 0
    reported = info.sampling_defaults
    assert reported.temperature == pytest.approx(0.5) and reported.top_k == 1
    assert reported.top_p == pytest.approx(0.9)
    # The fields the model does not recommend are reported with the built-in default, and nothing else is set.
    assert reported.HasField("min_p") and reported.min_p == 0.0
    assert reported.repetition_penalty == 1.0
    assert {f.name for f, _ in reported.ListFields()} == {
        "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
    }


@pytest.mark.asyncio(loop_scope="module")
async def test_a_request_that_leaves_them_unset_gets_the_model_defaults(model_defaults):
    stub, openai = model_defaults
    unset = await stub.Generate(generate())
    # Logprobs are taken after temperature: the same as an explicit 0.5, not as the built-in 1.0.
    assert logprobs(unset) == logprobs(await stub.Generate(generate(temperature=0.5, top_k=1, top_p=0.9)))
    assert logprobs(unset) != logprobs(await stub.Generate(generate(temperature=1.0, top_k=1, top_p=0.9)))
    # top_k=1 keeps the most likely token only: the greedy tokens.
    greedy = await stub.Generate(generate(temperature=0.0))
    assert unset.choices[0].token_ids == greedy.choices[0].token_ids
    # Even at a flat temperature the model's top_k=1 keeps the greedy tokens; a request's top_k=0 lifts it.
    greedy = await stub.Generate(generate(temperature=0.0, max_tokens=24))
    flat = await stub.Generate(generate(temperature=5.0, max_tokens=24))
    assert flat.choices[0].token_ids == greedy.choices[0].token_ids
    free = await stub.Generate(generate(temperature=5.0, top_k=0, top_p=1.0, max_tokens=24))
    assert free.choices[0].token_ids != greedy.choices[0].token_ids
    # The OpenAI API maps the same fields by the same names.
    completion = oa.CreateCompletionRequest(max_tokens=6, ignore_eos=True, seed=3, logprobs=0)
    completion.prompt.string_value = PROMPT
    answer = await openai.CreateCompletion(completion)
    assert answer.choices[0].logprobs.token_logprobs == pytest.approx([lp for _, lp in logprobs(unset)])


@pytest.mark.asyncio(loop_scope="module")
async def test_the_flags_win_over_the_model(tiny_model):
    app = await serving(tiny_model[0], temperature=0.25, min_p=0.05)
    try:
        async with grpc.aio.insecure_channel(app.grpc_target) as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            (info,) = (await stub.ListModels(pb.ListModelsRequest())).models
            unset = await stub.Generate(generate())
            explicit = await stub.Generate(generate(temperature=0.25, top_k=1, top_p=0.9, min_p=0.05))
    finally:
        await app.stop()
    defaults = info.sampling_defaults
    assert defaults.temperature == pytest.approx(0.25) and defaults.min_p == pytest.approx(0.05)
    assert defaults.top_k == 1 and defaults.top_p == pytest.approx(0.9)  # still the model's
    assert logprobs(unset) == logprobs(explicit)


@pytest.mark.asyncio(loop_scope="module")
async def test_max_tokens_minus_one_is_one_violation(model_defaults):
    stub, openai = model_defaults
    failure = await failure_of(stub.Generate(pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(max_tokens=-1))))
    assert failure.code == grpc.StatusCode.INVALID_ARGUMENT and failure.fields == {"sampling.max_tokens"}
    chat = oa.CreateChatCompletionRequest(max_tokens=-1, messages=[oa.ChatCompletionRequestMessage(role="user")])
    chat.messages[0].content.string_value = "hi"
    failure = await failure_of(openai.CreateChatCompletion(chat))
    assert failure.fields == {"max_tokens"}, failure.message


def test_generation_config_values_are_read_by_field_and_type(tmp_path, caplog):
    path = tmp_path / "generation_config.json"
    found = hf_sampling_defaults(
        {"temperature": 0.6, "top_k": 20.0, "top_p": "high", "min_p": None, "repetition_penalty": 1, "do_sample": 1},
        path,
    )
    assert found == {"temperature": 0.6, "top_k": 20, "repetition_penalty": 1.0}
    assert "'high' is not a number" in caplog.text
    assert hf_sampling_defaults(None, path) == {}


def test_gguf_sampling_metadata_is_read(tmp_path):
    from gguf import GGUFReader, GGUFWriter

    path = tmp_path / "sampling.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_sampling_temp(0.7)
    writer.add_sampling_top_k(40)
    writer.add_sampling_top_p(0.95)
    writer.add_sampling_min_p(0.05)
    writer.add_sampling_penalty_repeat(1.1)
    writer.add_sampling_mirostat(2)  # not a default the server applies
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    found = gguf_sampling_defaults(GGUFReader(path), path)
    assert found == pytest.approx(
        {"temperature": 0.7, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.1}
    )
    assert isinstance(found["top_k"], int)


def test_a_recommendation_the_engine_would_refuse_is_left_out(caplog):
    with caplog.at_level(logging.WARNING):
        merged = served_defaults({"temperature": 0.7, "top_p": 0.0, "top_k": -5}, {"temperature": 0.1}, "m")
    assert merged == {"temperature": 0.1}
    assert "top_p 0.0 is not used" in caplog.text and "top_k -5 is not used" in caplog.text


def test_a_bad_default_flag_is_a_usage_error_before_any_loading():
    result = subprocess.run(
        [sys.executable, "-m", "protoserve.server.cli", "serve", "--default-top-p", "2", "--default-top-k", "-3", "--no-http"],
        cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr == "protoserve: --default-top-k must be non-negative (0 disables); --default-top-p must be in (0, 1]\n"

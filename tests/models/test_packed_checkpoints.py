"""GPTQ and AWQ checkpoints, packed in the test from known float weights (tests/models/packed_checkpoints.py).

The dequantized weights equal the grid-rounded reference bit for bit; the model serves logits of
that reference (float), or its own codes (int4 under ``--quantization auto``); every malformed
pack and every layout we cannot read is refused naming the tensor or the config key.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from decoder_test_helpers import Driver, chunked, paged_cache
from family_checkpoints import hf_greedy
from packed_checkpoints import VARIANTS, make_packed_checkpoint
from safetensors.torch import load_file, save_file
from torch import nn

from protoserve.engine.loader.errors import ModelLoadError
from protoserve.engine.loader.hf_checkpoint import open_hf_checkpoint
from protoserve.engine.loader.load import load_model
from protoserve.engine.loader.packed_checkpoint import load_packed_tensors
from protoserve.engine.models import families
from protoserve.engine.models.linear import Int4Linear, Linear, dequantize_int4
from protoserve.kernels.cpu import packed_linear as kernel
from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 32, 84, 104, 101, 32, 99, 97, 116]
LAYER = "model.layers.1.self_attn.k_proj"


@pytest.fixture(scope="session")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, nn.Module]]:
    built: dict[str, tuple[Path, nn.Module]] = {}

    def get(variant: str) -> tuple[Path, nn.Module]:
        if variant not in built:
            directory = tmp_path_factory.mktemp(f"packed-{variant}")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                built[variant] = (directory, make_packed_checkpoint(directory, VARIANTS[variant]))
        return built[variant]

    return get


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_dequantized_weights_equal_the_grid_rounded_reference(packed, variant: str) -> None:
    directory, reference = packed(variant)
    ckpt = open_hf_checkpoint(directory)
    read = load_packed_tensors(ckpt, families.hf_shapes(ckpt.config), progress=False)
    want = reference.state_dict()
    assert set(read.weights) == set(want)
    for name, weight in read.weights.items():
        assert torch.equal(weight.float(), want[name]), name
    assert len(read.grids) == 2 * 7  # every decoder linear was packed


def served_weight(module: nn.Module) -> torch.Tensor:
    """A layer's weight as it is served: from the kernel's pack, else the PyTorch path's form."""
    if module.packed is not None:
        return kernel.unpack(module.packed)
    if isinstance(module, Int4Linear):
        q, scales, mins = module._kernel_form
        return dequantize_int4(q, scales, mins, module.group_size)
    return module.weight.float()


@pytest.mark.parametrize(
    "variant, mode, group_size",
    [("gptq", "int4", 32), ("gptq-v2-sym-64", "int4", 64), ("awq", "int4", 32),
     ("gptq-act-order", "int8", None), ("gptq-8bit", "int8", None)],
)
def test_auto_serves_the_checkpoints_own_precision(packed, one_thread, variant: str, mode: str,
                                                   group_size: int | None) -> None:
    """int4 in the file's groups where they fit the kernels, keeping the file's codes: each served weight
    is the reference's within the float16 rounding of min = -zero * scale (rounding the float weights
    afresh would be off by up to half a step, ~0.05 here); int8 where they do not (act-order, 8 bits)."""
    directory, _ = packed(variant)
    loaded = load_model(directory, quantization="auto", progress=False)
    assert (loaded.quantization, loaded.group_size) == (mode, group_size)
    if mode != "int4":
        return
    floats = load_model(directory, quantization="none", progress=False).model
    int4 = {name: m for name, m in loaded.model.named_modules() if isinstance(m, Int4Linear)}
    assert len(int4) == 2 * 4  # qkv, o, gate_up, down in each layer
    for name, layer in int4.items():
        assert layer.group_size == group_size
        want = served_weight(floats.get_submodule(name))
        assert (served_weight(layer) - want).abs().max() <= 2e-3, name


@pytest.mark.parametrize("variant", ["gptq", "gptq-act-order", "awq"])
def test_served_logits_match_the_grid_rounded_model(packed, one_thread, variant: str) -> None:
    directory, reference = packed(variant)
    with torch.no_grad():
        want = reference(torch.tensor([PROMPT])).logits[0]
    floats = load_model(directory, quantization="none", progress=False).model
    # Prefill in chunks, so cached positions are read back too.
    got = Driver(floats, paged_cache(floats)).run([PROMPT], chunked(5))[0]
    assert (got - want).abs().max() < 1e-4
    if variant != "gptq-act-order":  # the checkpoint's codes on the int4 kernels, int8-coded activations
        int4 = load_model(directory, quantization="auto", progress=False).model
        got = Driver(int4, paged_cache(int4)).run([PROMPT], chunked(5))[0]
        assert (got - want).abs().max() < 0.25


# -- malformed packs --------------------------------------------------------------------------------


def _copy(directory: Path, tmp_path: Path) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(directory, target)
    return target


def _edit_tensors(directory: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(str(directory / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(directory / "model.safetensors"))


def _drop(suffix: str) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda t: t.pop(f"{LAYER}.{suffix}")


def _replace(suffix: str, make: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(t: dict[str, torch.Tensor]) -> None:
        t[f"{LAYER}.{suffix}"] = make(t[f"{LAYER}.{suffix}"]).contiguous()

    return edit


MALFORMED = {
    "gptq-missing-qzeros": ("gptq", _drop("qzeros"), "qzeros", "missing tensor"),
    "gptq-missing-scales": ("gptq", _drop("scales"), "scales", "missing tensor"),
    "gptq-missing-g_idx": ("gptq-act-order", _drop("g_idx"), "g_idx", "missing tensor"),
    "awq-missing-qzeros": ("awq", _drop("qzeros"), "qzeros", "missing tensor"),
    "gptq-qweight-transposed": ("gptq", _replace("qweight", lambda q: q.t()), "qweight", "has shape"),
    "awq-scales-wrong-groups": ("awq", _replace("scales", lambda s: s[:1]), "scales", "has shape"),
    "gptq-qzeros-float": ("gptq", _replace("qzeros", lambda z: z.float()), "qzeros", "expected torch.int32"),
    "gptq-g_idx-out-of-range": ("gptq-act-order", _replace("g_idx", lambda g: g + 1), "g_idx", "group indices"),
    "awq-scales-nan": ("awq", _replace("scales", lambda s: torch.full_like(s, float("nan"))), "scales",
                       "not finite"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_pack_is_refused_naming_the_tensor(packed, tmp_path: Path, case: str) -> None:
    variant, edit, suffix, problem = MALFORMED[case]
    directory = _copy(packed(variant)[0], tmp_path)
    _edit_tensors(directory, edit)
    with pytest.raises(ModelLoadError, match=problem) as caught:
        load_model(directory, quantization="none", progress=False)
    assert f"'{LAYER}.{suffix}'" in str(caught.value)


UNSUPPORTED = {
    "method": ("gptq", {"quant_method": "bitsandbytes"}, "quantization_config.quant_method 'bitsandbytes'"),
    "gptq-bits": ("gptq", {"bits": 3}, "quantization_config.bits 3"),
    "gptq-marlin": ("gptq", {"checkpoint_format": "marlin"}, "quantization_config.checkpoint_format 'marlin'"),
    "gptq-is-marlin": ("gptq", {"is_marlin_format": True}, "quantization_config.is_marlin_format True"),
    "gptq-group-size": ("gptq", {"group_size": 0}, "quantization_config.group_size 0"),
    "awq-bits": ("awq", {"bits": 8}, "quantization_config.bits 8"),
    "awq-gemv": ("awq", {"version": "gemv"}, "quantization_config.version 'gemv'"),
    "awq-exllama": ("awq", {"version": "exllama"}, "quantization_config.version 'exllama'"),
    "awq-no-zero-point": ("awq", {"zero_point": False}, "quantization_config.zero_point False"),
    "awq-llm-awq": ("awq", {"backend": "llm-awq"}, "quantization_config.backend 'llm-awq'"),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_an_unsupported_variant_is_refused_naming_the_config_key(packed, tmp_path: Path, case: str) -> None:
    variant, change, message = UNSUPPORTED[case]
    directory = _copy(packed(variant)[0], tmp_path)
    raw = json.loads((directory / "config.json").read_text())
    raw["quantization_config"].update(change)
    (directory / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="config.json") as caught:
        load_model(directory, progress=False)
    assert message in str(caught.value)


def test_a_config_naming_gptq_over_float_weights_is_refused(tmp_path: Path, tiny_checkpoint) -> None:
    directory = _copy(tiny_checkpoint("llama")[0], tmp_path)
    raw = json.loads((directory / "config.json").read_text())
    raw["quantization_config"] = VARIANTS["gptq"].quantization_config()
    (directory / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="no layer is packed"):
        load_model(directory, progress=False)


def test_an_unconverted_module_stays_float(packed, tmp_path: Path, one_thread) -> None:
    """AWQ's modules_to_not_convert: a layer stored as a float weight loads as one next to packed ones."""
    directory, reference = packed("awq")
    directory = _copy(directory, tmp_path)
    float_weight = reference.get_submodule(LAYER).weight.detach().clone()

    def unconvert(t: dict[str, torch.Tensor]) -> None:
        for suffix in ("qweight", "qzeros", "scales"):
            t.pop(f"{LAYER}.{suffix}")
        t[f"{LAYER}.weight"] = float_weight

    _edit_tensors(directory, unconvert)
    ckpt = open_hf_checkpoint(directory)
    read = load_packed_tensors(ckpt, families.hf_shapes(ckpt.config), progress=False)
    assert LAYER not in read.grids and torch.equal(read.weights[f"{LAYER}.weight"], float_weight)
    assert isinstance(load_model(directory, quantization="auto", progress=False).model.layers[1].self_attn.o_proj,
                      Int4Linear)


# -- served by `protoserve serve` -------------------------------------------------------------------


@pytest.mark.live
@pytest.mark.parametrize("variant", ["gptq-act-order", "awq"])
def test_serve_answers_with_the_reference_models_tokens(packed, spawn_server, variant: str) -> None:
    directory, reference = packed(variant)
    server = spawn_server("--model", str(directory), "--quantization", "none", "--no-http", "--no-embedding-model")
    with server.sync_channel() as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        reply = stub.Generate(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=PROMPT), sampling=pb.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)),
            timeout=120)
        models = stub.ListModels(pb.ListModelsRequest(), timeout=30)
    assert list(reply.choices[0].token_ids) == hf_greedy(reference, PROMPT, 16)
    assert [m.quantization for m in models.models] == ["none"]


@pytest.mark.live
def test_serve_under_auto_reports_int4_for_a_gptq_checkpoint(packed, spawn_server) -> None:
    directory, _ = packed("gptq")
    server = spawn_server("--model", str(directory), "--no-http", "--no-embedding-model")
    with server.sync_channel() as channel:
        models = inference_pb2_grpc.InferenceServiceStub(channel).ListModels(pb.ListModelsRequest(), timeout=30)
    assert [m.quantization for m in models.models] == ["int4"]


def test_float_linear_layers_are_untouched_by_a_float_load(packed) -> None:
    """quantization none serves the dequantized float weights (Linear, not a quantized layer)."""
    directory, _ = packed("gptq")
    model = load_model(directory, quantization="none", progress=False).model
    assert all(type(m) is Linear for m in (model.layers[0].self_attn.qkv_proj, model.layers[0].mlp.down_proj))

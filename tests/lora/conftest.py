"""Fixtures for the LoRA tests: the model tests' tiny random checkpoints and PEFT adapters made on them.

``tiny_family(family)`` -> (checkpoint dir, transformers model), one per family, built once.
``make_adapter(family, targets, r=8, seed=..., **config)`` -> directory of a PEFT adapter saved with
``save_pretrained`` on that family's checkpoint; lora_B gets random non-zero weights (PEFT inits it
to zero, which would make every comparison trivial).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))
from decoder_test_helpers import make_hf_checkpoint  # noqa: E402
from tiny_families import checkpoint_cache  # noqa: E402

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Any]]:
    return checkpoint_cache(tmp_path_factory, make_hf_checkpoint, prefix="lora-base-")


def peft_model(base: Any, targets: list[str], r: int = 8, seed: int = 0, **config) -> Any:
    """A PeftModel over a copy of ``base`` with random non-zero A and B."""
    import copy

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=r, target_modules=targets, lora_dropout=0.0, **config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.normal_(0.0, 0.2)
    return model.eval()


@pytest.fixture(scope="session")
def make_adapter(tiny_family, tmp_path_factory) -> Callable[..., tuple[Path, Any]]:
    """-> (adapter dir, PeftModel) for a family's checkpoint; the same arguments give the same adapter."""
    made: dict[tuple, tuple[Path, Any]] = {}

    def make(family: str, targets: list[str] | None = None, r: int = 8, seed: int = 0, **config):
        key = (family, tuple(targets or ALL_TARGETS), r, seed, tuple(sorted(config.items())))
        if key not in made:
            _, base = tiny_family(family)
            model = peft_model(base, list(targets or ALL_TARGETS), r, seed, **config)
            directory = tmp_path_factory.mktemp(f"lora-{family}-r{r}-s{seed}")
            model.save_pretrained(directory)
            made[key] = (directory, model)
        return made[key]

    return make

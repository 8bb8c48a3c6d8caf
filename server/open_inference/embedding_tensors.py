"""The embedding model's tensors: ``text_input`` (BYTES [-1], one text per element) in, ``embedding``
(FP32 [-1, dimensions], one unit vector per text, the vectors of /v1/embeddings) out."""

from __future__ import annotations

from protoserve.server.open_inference.tensors import Tensor, TensorSpec, check_tensor, tensor_error, text_of

TEXT_INPUT = TensorSpec("text_input", "BYTES", (-1,))
EMBEDDING = "embedding"


def inputs() -> tuple[TensorSpec, ...]:
    return (TEXT_INPUT,)


def outputs(dimensions: int) -> tuple[TensorSpec, ...]:
    return (TensorSpec(EMBEDDING, "FP32", (-1, dimensions)),)


def read_texts(model: str, tensors: dict[str, Tensor]) -> list[str]:
    """The texts to embed; INVALID_ARGUMENT naming the tensor at fault."""
    for name, tensor in tensors.items():
        if name != TEXT_INPUT.name:
            raise tensor_error(name, f"is not an input of {model}; it takes {TEXT_INPUT.name}")
        check_tensor(tensor, TEXT_INPUT)
    if TEXT_INPUT.name not in tensors:
        raise tensor_error(TEXT_INPUT.name, "is required (BYTES [-1]: the texts to embed)")
    return text_of(tensors[TEXT_INPUT.name])

"""Where the generated protobuf and gRPC modules come from.

A built wheel carries its own copy under ``protoserve_client._pb`` (generated
from ``proto/`` at build time, see ``build_backend/``). An editable install
inside the protoserve repo has none and uses the repo's ``gen/python`` tree
(``make proto``), which the repo's venv puts on ``sys.path``.
"""

from __future__ import annotations

try:
    from protoserve_client._pb.protoserve.v1 import (
        agent_pb2,
        agent_pb2_grpc,
        embeddings_pb2,
        embeddings_pb2_grpc,
        inference_pb2,
        inference_pb2_grpc,
        rag_pb2,
        rag_pb2_grpc,
    )
except ModuleNotFoundError as packaged_missing:
    # Only a missing ``_pb`` means "no packaged copy"; any other missing module
    # (say google.api) is a broken install and must surface as is.
    if not (packaged_missing.name or "").startswith("protoserve_client._pb"):
        raise
    try:
        # Type checkers see the packaged branch first; this one is its twin.
        from protoserve.v1 import (  # type: ignore  # noqa: PGH003 - checkers see one branch only
            agent_pb2,
            agent_pb2_grpc,
            embeddings_pb2,
            embeddings_pb2_grpc,
            inference_pb2,
            inference_pb2_grpc,
            rag_pb2,
            rag_pb2_grpc,
        )
    except ModuleNotFoundError as repo_missing:
        raise ImportError(
            "protoserve_client has no generated gRPC stubs: install a built wheel "
            "(pip install clients/python) or, inside the protoserve repo, run `make proto`"
        ) from repo_missing

__all__ = [
    "agent_pb2",
    "agent_pb2_grpc",
    "embeddings_pb2",
    "embeddings_pb2_grpc",
    "inference_pb2",
    "inference_pb2_grpc",
    "rag_pb2",
    "rag_pb2_grpc",
]

"""The RAG search as an agent tool, bound to one caller: the run's model searches that caller's documents.

Each run gets its own instance (AgentService builds it from the authenticated identity), so a tool
call can never name another owner: the arguments hold only the query. Its query's tokens count
against the caller's tpm and usage as any search's do; a search over the limit is the tool's error,
which the model reads next step.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from protoserve.server.agent.tool_registry import FunctionTool
from protoserve.server.errors import ServiceError
from protoserve.server.services.embeddings import Retrieval
from protoserve.server.tool_calls.call import ToolSpec

if TYPE_CHECKING:
    from protoserve.server.calls.inflight import InflightRequests
    from protoserve.server.security.auth import Identity

SPEC = ToolSpec(
    "search_documents",
    "Search the user's indexed documents and return the passages most relevant to a query.",
    {
        "type": "object",
        "properties": {
            "query": {"type": "string", "minLength": 1, "maxLength": 200, "description": "What to look for."},
            "top_k": {
                "type": "integer",
                "minimum": 1,
                "maximum": 10,
                "description": "Passages to return [3].",
            },
        },
        "required": ["query"],
        "additionalProperties": False,
    },
)


def search_tool(identity: Identity, retrieval: Retrieval, inflight: InflightRequests) -> FunctionTool:
    """``search_documents`` over ``identity``'s documents, metered to it (the agent run took its request)."""
    owner = identity.id

    async def search(arguments: dict[str, Any]) -> str:
        embedder, store = retrieval.embedder, retrieval.store
        if embedder is None or store is None:
            raise RuntimeError("RAG is not available on this server")
        meter = embedder.meter(inflight, identity, request=False)
        try:
            embedded = await embedder.embed_texts([arguments["query"]], "query", tenant=owner, charge=meter.charge)
        except ServiceError as exc:
            raise ValueError(exc.message) from None
        finally:
            meter.record()
        hits = await asyncio.to_thread(store.search, owner, embedded.vectors[0], arguments.get("top_k", 3))
        if not hits:
            return "No indexed document matches."
        return "\n\n".join(f"[{hit.document_id}] {hit.text}" for hit in hits)

    return FunctionTool(SPEC, search)

"""Every cap the server puts on what one request may carry, in one place.

A field with no natural bound gets a cap here, and a request over it is refused
with INVALID_ARGUMENT naming the field and the cap (the servicers and the
served model check them; the README's Errors section lists them). Text caps count
characters (Unicode code points), byte caps count UTF-8 bytes.
"""

from __future__ import annotations

# -- whole messages --------------------------------------------------------------------------

# The largest gRPC request the server reads (``protoserve serve --max-message-bytes``); grpc
# itself answers a larger one with RESOURCE_EXHAUSTED before any handler runs. 16 MiB holds a
# full 128K-token context as token ids (at most 5 bytes an id) many times over, and a Batch of
# 256 requests with prompts of up to ~60 KB (~15K tokens) each, while one message stays far below
# the server's memory.
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# The largest response the server sends: Batch results and logprobs can outgrow any request.
MAX_SEND_MESSAGE_BYTES = 64 * 1024 * 1024
# protobuf's decoder (upb) refuses a message whose messages nest deeper than this below the
# top-level one; not ours to change. Such a request, like any undecodable one, is refused with
# INVALID_ARGUMENT (server/calls/request_decoding.py). In JSON, each array level of a free-form field
# (``prompt``, ``stop``, ``content``) takes 2 levels, each object level 3.
MAX_MESSAGE_DEPTH = 100

# -- text fields -----------------------------------------------------------------------------

MAX_MODEL_NAME_CHARS = 256  # a longer name cannot name a loaded model: NOT_FOUND, as any unknown one
MAX_REQUEST_ID_CHARS = 256  # client-chosen request ids travel in logs, metadata and Cancel
MAX_USER_ID_CHARS = 256  # the x-user-id header
MAX_STOP_STRING_CHARS = 256  # each stop string; text that could start one is held back from streams
MAX_CHAT_NAME_CHARS = 256  # a chat message's ``name``
# A LoRA adapter's name (LoadAdapter, --lora): it is a ``model`` on the OpenAI routes, listed in every
# caller's /v1/models, and a path segment of DELETE /v1/adapters/{name}; its characters are in
# server/models/adapter_input.py.
MAX_ADAPTER_NAME_CHARS = 128
# A LoRA adapter's directory (LoadAdapter, --lora): Linux's PATH_MAX; a longer path names no directory.
MAX_ADAPTER_PATH_CHARS = 4096
# An output constraint's text (a JSON Schema as compact JSON, a regex, a GBNF grammar; a choice's
# strings together): the grammar engine compiles it on a server thread, and a compiled grammar
# stays cached, so its size bounds both the compile time and the cache's memory.
MAX_CONSTRAINT_CHARS = 64 * 1024

# -- lists -----------------------------------------------------------------------------------

MAX_BATCH_REQUESTS = 256  # requests in one Batch call; each holds engine memory while it waits
MAX_STOP_STRINGS = 16  # stop strings of one InferenceService request (OpenAI's API allows 4)
OPENAI_MAX_STOP_STRINGS = 4  # OpenAI's own limit, kept by the OpenAI-compatible API
# Prompts in one OpenAI completion request: each becomes an engine request, as a Batch item does,
# so the same cap keeps one call from filling the engine's queue.
MAX_COMPLETION_PROMPTS = MAX_BATCH_REQUESTS
# Messages of one conversation (OpenAI chat, or InferenceService chat input). Each costs at least
# a few template tokens, so more than this cannot fit any context the server runs; the cap stops
# a long list before the chat template renders it.
MAX_CHAT_MESSAGES = 2048
# Inputs of one embeddings request (OpenAI's own limit); each is a forward row of the embedding model.
MAX_EMBEDDING_INPUTS = 2048
# UTF-8 bytes of one embedding input (an Embed text, an OpenAI input, a RAG query). The window is a
# few hundred tokens, a few KB of any real text; a larger input could only be refused after
# tokenizing it all, so it is refused by its size first.
MAX_EMBEDDING_INPUT_BYTES = 64 * 1024
# Documents of one IndexDocuments call, and the UTF-8 bytes of one document's text.
MAX_INDEX_DOCUMENTS = 256
MAX_DOCUMENT_BYTES = 4 * 1024 * 1024
# Chunks one document may make, and the overlap of consecutive chunks as a share of ``chunk_tokens``.
# Every chunk is an embedding forward and a stored vector: small chunks with a large overlap turned
# 96 KB of text into 7,137 chunks. A 4 MiB document of prose makes ~4,500 chunks at the defaults
# (256 tokens, 32 overlap); past the cap chunking stops and the call is refused before embedding.
MAX_DOCUMENT_CHUNKS = 8192
MAX_OVERLAP_PERCENT = 50
# Chunks a search may return, and chunks retrieve-and-generate may put into a prompt.
MAX_SEARCH_TOP_K = 100
MAX_RAG_CONTEXT_CHUNKS = 20
# Characters of a document id, a metadata key or value, and metadata entries per document.
MAX_DOCUMENT_ID_CHARS = 256
MAX_METADATA_CHARS = 256
MAX_METADATA_ENTRIES = 64
# Documents per ListDocuments page.
MAX_PAGE_SIZE = 1000
# Tools of one chat request, OpenAI's own limit; each is rendered into the prompt and the call grammar.
MAX_TOOLS = 128
# Entries of a logit_bias map; the engine applies every entry to every sequence at every step.
MAX_LOGIT_BIAS_ENTRIES = 1024
# Strings of a choice constraint.
MAX_CONSTRAINT_CHOICES = 256
# Choices per request (``n``) are capped by the engine at 16 (engine.sampling_params).

# -- prompts ---------------------------------------------------------------------------------

# Text input (a prompt, or a conversation's texts together) is tokenized only up to this many
# bytes, or the model's context bound where that is larger: a prompt the context cannot hold is
# refused before tokenizing it (OUT_OF_RANGE), and the truncating context policies, which accept
# over-long prompts, still tokenize at most this much (about 2 s of one core).
MAX_PROMPT_BYTES = 4 * 1024 * 1024

# -- echoes of input -------------------------------------------------------------------------

# User text quoted in an error message, its metadata or the request log is cut to this many
# characters (plus its size), so no echo can outgrow gRPC's 8 KB metadata or a log line.
ECHO_CHARS = 64

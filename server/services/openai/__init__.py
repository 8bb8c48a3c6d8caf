"""OpenAI's API over gRPC, one module per surface (as vLLM's ``serving_*``).

``translation`` reads OpenAI's request fields into the engine's terms, ``preparation`` turns a
surface's prompts or chat turns into checked engine requests, ``streaming`` runs them (and writes
OpenAI's chunked streams), ``outputs`` holds the response pieces the surfaces share; ``completions``,
``chat``, ``embeddings`` and ``models`` are the surfaces, and ``service`` the servicer that composes them.
"""

"""The Responses API's conversation state: each caller's stored responses and their input items.

``store.ResponseStore`` keeps them in SQLite, one database per identity partition, every row tagged
with its owner's identity; ``items`` reads a request's input items into chat turns and ``events``
builds the typed stream events. The servicer is ``server.services.openai.responses``.
"""

"""The WebSocket streaming route ``GET /v1/ws/completions``: OpenAI completions multiplexed on one socket.

``protocol`` (messages and frames), ``session`` (one socket's requests and send
queue), ``endpoint`` (the upgrade, its authorization, shutdown), ``close_codes``.
"""

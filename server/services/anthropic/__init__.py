"""Anthropic's Messages API over gRPC, on the chat machinery the OpenAI surfaces share.

``conversion`` reads a request's system prompt, content blocks, tools and tool choice into the
served model's chat turns and tool specs; ``replies`` turns the model's output into Anthropic's
content blocks and stream events; ``messages`` is the surface (create, stream, count tokens) and
``service`` the servicer.
"""

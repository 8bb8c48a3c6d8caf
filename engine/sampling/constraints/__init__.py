"""Constrained decoding: a request's output held to a JSON Schema, a regex, a GBNF grammar or a choice.

``constraint.py`` is the plain data a request carries; ``compiler.py`` turns it
into an llguidance grammar once per text and tokenizer (cached); ``masks.py``
computes each constrained row's allowed-token bitmask for the sampler;
``grammar_state.py`` feeds a choice's matcher each token it takes.
Only ``constraint.py`` is imported without llguidance.
"""

"""Speculative decoding: proposers that draft tokens, the options a request opts in with, and the
Speculator that drafts before a step and verifies after it (speculator.py).

The target model scores a row's last token plus its drafts in one forward, and verification
walks the rows in order with the engine's own sampler.
"""

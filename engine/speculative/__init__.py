"""Speculative decoding: proposers that draft tokens, and the options a request opts in with.

Verification lives in the engine step (``LLMEngine._verify``): the target model scores a
row's last token plus its drafts in one forward, and the sampler walks the rows in order.
"""

"""Token ids of the tiny test checkpoint, importable by a name no other test folder uses.

(`from conftest import ...` breaks when several test folders each have a conftest.)
"""

TINY_VOCAB = 320  # 256 byte tokens + <|endoftext|> in the tokenizer; ids above have no text
TINY_EOS = 256

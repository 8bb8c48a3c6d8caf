"""Tokenizers built from GGUF metadata or Hugging Face files (tokenizer.py), and chat templates (chat_template.py).

Nothing is imported here, so ``protoserve.engine.tokenizer.chat_template`` stays importable without torch.
"""

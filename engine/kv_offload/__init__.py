"""Prefix-cache blocks persisted on disk, so a conversation's KV survives a restart or an eviction."""

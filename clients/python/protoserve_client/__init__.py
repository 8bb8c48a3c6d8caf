"""Typed Python client for protoserve."""

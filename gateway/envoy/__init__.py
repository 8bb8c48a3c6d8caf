"""Envoy as an alternative REST/JSON front: config template and a launcher (see gateway/README.md)."""

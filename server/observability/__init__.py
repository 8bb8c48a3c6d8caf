"""Prometheus metrics, OpenTelemetry tracing, request logs and per-identity usage."""

"""Benchmarks. The in-process paths (engine, transformers) run under the server's OpenMP wait policy."""

from protoserve.engine.api import prefer_passive_omp_wait

prefer_passive_omp_wait()

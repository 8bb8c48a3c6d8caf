"""The gRPC server. Importing it sets the engine's OpenMP wait policy (see engine/execution/omp_policy.py)."""

from protoserve.engine.execution.omp_policy import prefer_passive_omp_wait

prefer_passive_omp_wait()

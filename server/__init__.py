"""The gRPC server. Importing it sets the engine's OpenMP wait policy (see engine/omp_policy.py)."""

from engine.omp_policy import prefer_passive_omp_wait

prefer_passive_omp_wait()

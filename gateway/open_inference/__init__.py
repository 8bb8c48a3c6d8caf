"""The Open Inference Protocol (KServe v2 REST, Triton generate) on the gateway."""

"""The Open Inference Protocol (KServe v2 / Triton): its servicer and its tensors."""

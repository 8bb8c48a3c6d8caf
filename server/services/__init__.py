"""The gRPC servicers: each turns its service's requests into served-model and engine calls."""

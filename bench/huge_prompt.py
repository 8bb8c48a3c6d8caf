"""One huge prompt over gRPC, from a process of its own: ``python -m bench.huge_prompt TARGET BYTES``.

Connects, builds a Generate request whose prompt is BYTES of text, prints
``ready``, waits for a line on stdin, sends the request and prints one JSON
line: the status code the server answered and the seconds the call took. Its
own process, so building and sending 20 MB costs the measuring client's event
loop (and GIL) nothing: what the streams beside it see is the server's doing.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex every jolly bunny "
CALL_TIMEOUT_S = 300.0


def text_of(size: int) -> str:
    """``size`` bytes of ASCII prose (words and spaces, as a pasted document would be)."""
    return (WORDS * (size // len(WORDS) + 1))[:size]


def main(argv: Sequence[str] | None = None) -> int:
    import grpc

    from protoserve.v1 import inference_pb2 as pb
    from protoserve.v1 import inference_pb2_grpc

    target, size = (argv if argv is not None else sys.argv[1:])[:2]
    request = pb.GenerateRequest(prompt=text_of(int(size)), sampling=pb.SamplingParams(max_tokens=1))
    with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", -1)]) as channel:
        grpc.channel_ready_future(channel).result(timeout=CALL_TIMEOUT_S)
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        print("ready", flush=True)
        sys.stdin.readline()
        started = time.perf_counter()
        try:
            stub.Generate(request, timeout=CALL_TIMEOUT_S)
            code = "OK"
        except grpc.RpcError as exc:
            code = exc.code().name
        print(json.dumps({"code": code, "seconds": time.perf_counter() - started}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

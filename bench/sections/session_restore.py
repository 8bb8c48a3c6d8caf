"""Session restore: the next turn of a ~3,000-token conversation after ``serve`` restarts with
``--kv-offload-dir``, its prefix loaded from disk, against the same turn recomputed (issue 47).

One server (``--kv-offload-dir`` in a fresh directory) runs turn 1 of ``conversations`` chats
(3,000-token prompt, 16 greedy tokens, EOS ignored), then stops (SIGTERM: the prefix cache is written
at shutdown). A second server on the same directory and data dir (the same identities) runs each
chat's turn 2 (turn 1's prompt and reply plus 32 new tokens, 16 tokens out) twice: as the chat's own
identity, whose blocks come off disk, and as another identity (``x-user-id``), which recomputes the
whole prompt; the order alternates per chat (ABBA). The figures are each way's TTFT median and
restored / recomputed (target <= 0.2).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.context import BenchContext
from bench.figures import Figure, Target
from bench.resources import Server
from bench.runner import Step
from bench.server_process import ServerProcess
from bench.stats import median, significant

SECTION = "session_restore"
WORKLOAD = 23
REPLY_TOKENS = 16
NEXT_TURN = 32
RATIO_TARGET = Target(0.2, "lower")


@dataclass(frozen=True)
class Sizes:
    prompt: int
    conversations: int


SIZES = {"smoke": Sizes(600, 1), "default": Sizes(3000, 3), "full": Sizes(3000, 5)}


def _generate(server: Any, token_ids: list[int], user: str = "") -> tuple[float, list[int]]:
    """One streamed greedy request: its time to first token and its output ids."""
    import grpc

    from protoserve.v1 import inference_pb2 as pb
    from protoserve.v1 import inference_pb2_grpc

    request = pb.GenerateStreamRequest(request=pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=token_ids),
        sampling=pb.SamplingParams(max_tokens=REPLY_TOKENS, temperature=0.0, ignore_eos=True)))
    metadata = (("x-user-id", user),) if user else ()
    out: list[int] = []
    first = None
    with grpc.insecure_channel(server.grpc_target) as channel:
        sent = time.perf_counter()
        for message in inference_pb2_grpc.InferenceServiceStub(channel).GenerateStream(
                request, metadata=metadata, timeout=600):
            if message.HasField("delta") and message.delta.token_ids:
                first = first if first is not None else time.perf_counter() - sent
                out.extend(message.delta.token_ids)
    if first is None:
        raise RuntimeError("no token came back")
    return first, out


def session_figures(restored: list[float], recomputed: list[float], sizes: Sizes) -> list[Figure]:
    load = {"prompt_tokens": sizes.prompt, "conversations": len(restored)}
    ratio = median(restored) / median(recomputed)
    return [
        Figure(f"{SECTION}.ttft.restored", median(restored), "s", SECTION, better="lower",
               details={**load, "min": significant(min(restored)), "max": significant(max(restored))},
               note="turn 2 after a restart, prefix loaded from --kv-offload-dir"),
        Figure(f"{SECTION}.ttft.recomputed", median(recomputed), "s", SECTION, better="lower",
               details={**load, "min": significant(min(recomputed)), "max": significant(max(recomputed))},
               note="the same turn as another identity: the whole prompt computed"),
        Figure(f"{SECTION}.ttft_ratio", ratio, "x", SECTION, better="lower", target=RATIO_TARGET,
               details={"restored_s": significant(median(restored)),
                        "recomputed_s": significant(median(recomputed))}),
    ]  # fmt: skip


def _step(ctx: BenchContext, sizes: Sizes, scratch: Path) -> Step:
    variant = ctx.profile.serving_variant
    args = ("--kv-offload-dir", str(scratch / "kv"))
    data_dir = scratch / "data"  # both servers': the same identity secret, so the same identities

    def run(server: Any) -> list[Figure]:
        factory = ctx.factory(WORKLOAD)
        chats = []
        for _ in range(sizes.conversations):
            prompt = list(factory.prompt(sizes.prompt))
            chats.append(prompt + _generate(server, prompt)[1] + list(factory.prompt(NEXT_TURN)))
        server.stop()  # writes the cached blocks
        log = server.log_path.with_name(server.log_path.stem + "-restarted.log")
        import torch

        # The harness's threads (bench.run sets this process's to --threads, as its servers').
        restarted = ServerProcess.start(log, variant, torch.get_num_threads(), data_dir=data_dir, extra_args=args)
        restored, recomputed = [], []
        try:
            for i, chat in enumerate(chats):
                for own in (True, False) if i % 2 == 0 else (False, True):
                    ttft = _generate(restarted, chat, "" if own else f"bench-stranger-{i}")[0]
                    (restored if own else recomputed).append(ttft)
        finally:
            restarted.stop()
        return session_figures(restored, recomputed, sizes)

    expects = ((f"{SECTION}.ttft.restored", "s"), (f"{SECTION}.ttft.recomputed", "s"),
               (f"{SECTION}.ttft_ratio", "x"))
    server = Server(variant, label="session-restore", args=args, env=(("PROTOSERVE_DATA_DIR", str(data_dir)),))
    return Step(SECTION, server,
                f"{sizes.prompt}-token chat, next turn after a restart: restored vs recomputed", run, expects)


def steps(ctx: BenchContext) -> list[Step]:
    scratch = Path(tempfile.mkdtemp(prefix="bench-session-restore-"))
    return [_step(ctx, SIZES.get(ctx.profile.name, SIZES["default"]), scratch)]

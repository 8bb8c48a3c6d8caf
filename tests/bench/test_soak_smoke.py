"""bench/soak.py runs end to end: a few seconds of its mixed load on the shared live server.

The real soak (``make soak``) starts a server of its own and runs for minutes;
this checks the harness itself: twins, every route and behaviour from two
tenants, each tenant's report line, the drain, RSS and log checks, and a
passing verdict with no failed request.
"""

from __future__ import annotations

import asyncio

from bench.soak import FAILED, TENANTS, Target, build_parser, soak


def test_a_short_soak_passes(live_server, capsys) -> None:
    target = Target(
        grpc_target=live_server.grpc_target,
        http_base_url=f"http://127.0.0.1:{live_server.http_port}",
        pid=live_server.process.pid,
        log_path=live_server.log_path,
        identity_secret=(live_server.data_dir / "identity_secret").read_bytes().strip(),
    )
    args = build_parser().parse_args(["--duration-s", "4", "--warmup-s", "1", "--clients", "6", "--prompts", "1"])
    code = asyncio.run(soak(target, args))
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    assert "PASS" in out.out and "KV pool after drain: 100.0% free" in out.out
    rows = {line.split()[0]: line.split()[1:] for line in out.out.splitlines() if line.split()[:1]}
    assert int(rows["completed"][-1]) > 0
    for outcome in FAILED:
        assert int(rows[outcome][-1]) == 0, out.out
    for tenant in TENANTS:  # both tenants were served, and named in the report
        served = int(rows[tenant][2])
        assert served > 0 and "TTFT p50" in out.out, out.out

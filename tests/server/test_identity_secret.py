"""Caller identities are keyed hashes under a server secret that lives in the data dir (server/security/identity_secret.py).

Unit tests cover where the secret comes from and how it is stored; the live
tests start ``protoserve serve`` (without waiting for the model: a refused call
is logged with its identity too) and read the identity from the request log.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
import time

import grpc
import pytest

from protoserve.server.security.auth import Authenticator, identity_hash
from protoserve.server.security.identity_secret import (
    SECRET_ENV,
    SECRET_FILE_NAME,
    default_data_dir,
    load_identity_secret,
)
from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc


@pytest.fixture
def no_secret_env(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)


def test_identity_is_a_keyed_hash_not_sha256_of_the_key():
    auth = Authenticator(["weak"], secret=b"s" * 32)
    identity = auth.identify([("authorization", "Bearer weak")])
    assert identity.id != hashlib.sha256(b"weak").hexdigest()
    assert identity.id == identity_hash(b"s" * 32, "weak", "")
    assert Authenticator(["weak"], secret=b"t" * 32).identity_for("weak", "").id != identity.id


def test_key_and_user_id_cannot_run_into_each_other():
    secret = b"s" * 32
    assert identity_hash(secret, "ab", "c") != identity_hash(secret, "a", "bc")
    assert identity_hash(secret, "", "abc") != identity_hash(secret, "abc", "")


def test_cache_salt_and_quota_follow_the_identity():
    auth = Authenticator(["key"])
    alice, bob = auth.identity_for("key", "alice"), auth.identity_for("key", "bob")
    assert alice.cache_salt != bob.cache_salt  # users of one key never share cached KV
    assert alice.quota_id == bob.quota_id == auth.identity_for("key", "").id
    open_server = Authenticator()
    assert open_server.identity_for("", "alice").quota_id == open_server.identity_for("", "alice").id


def test_admin_keys_are_api_keys_that_see_everything():
    auth = Authenticator(["user-key"], admin_keys=["admin-key"])
    assert auth.identify([("authorization", "Bearer admin-key")]).admin
    assert not auth.identify([("authorization", "Bearer user-key")]).admin
    # Admin keys alone turn auth on.
    only_admin = Authenticator(admin_keys=["admin-key"])
    assert only_admin.enabled and only_admin.identify([("authorization", "Bearer admin-key")]).admin


def test_first_start_creates_a_private_secret_and_later_starts_reuse_it(tmp_path, no_secret_env):
    data_dir = tmp_path / "data"
    first = load_identity_secret(None, data_dir)
    path = data_dir / SECRET_FILE_NAME
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(data_dir.stat().st_mode) == 0o700
    assert len(first) == 64  # 32 random bytes, hex
    assert load_identity_secret(None, data_dir) == first
    assert load_identity_secret(None, tmp_path / "elsewhere") != first
    assert os.listdir(data_dir) == [SECRET_FILE_NAME]  # no temporary files left behind


def test_servers_starting_together_agree_on_one_secret(tmp_path, no_secret_env):
    secrets: list[bytes] = []
    start = threading.Barrier(8)

    def load() -> None:
        start.wait()
        secrets.append(load_identity_secret(None, tmp_path))

    threads = [threading.Thread(target=load) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(secrets) == 8 and len(set(secrets)) == 1


def test_flag_then_environment_then_data_dir(tmp_path, monkeypatch):
    flag_file = tmp_path / "secret"
    flag_file.write_text("f" * 40 + "\n")
    monkeypatch.setenv(SECRET_ENV, "e" * 40)
    assert load_identity_secret(flag_file, tmp_path / "data") == b"f" * 40
    assert load_identity_secret(None, tmp_path / "data") == b"e" * 40
    assert not (tmp_path / "data").exists()  # a given secret writes nothing


def test_short_secrets_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "too-short")
    with pytest.raises(ValueError, match="at least 32"):
        load_identity_secret(None, tmp_path)


def test_an_unusable_data_dir_says_how_to_fix_it(tmp_path, no_secret_env):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    with pytest.raises(OSError, match="--data-dir, --identity-secret-file or \\$PROTOSERVE_IDENTITY_SECRET"):
        load_identity_secret(None, blocked / "data")


def test_default_data_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("PROTOSERVE_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert default_data_dir() == tmp_path / "protoserve"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_data_dir() == tmp_path / ".local" / "share" / "protoserve"
    monkeypatch.setenv("PROTOSERVE_DATA_DIR", str(tmp_path / "mine"))
    assert default_data_dir() == tmp_path / "mine"


# ---- live ------------------------------------------------------------------------------------


def logged_identity(server, key: str) -> str:
    """Send one call with ``key`` and return the identity its request-log line names."""
    marker = f"id-probe-{time.monotonic_ns()}"
    with server.sync_channel() as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        # Refused or served, whether the model is loaded yet or not: either way it is logged.
        with pytest.raises(grpc.RpcError):
            stub.Generate(
                pb.GenerateRequest(request_id=marker, prompt="x", sampling=pb.SamplingParams(temperature=-1)),
                metadata=(("authorization", f"Bearer {key}"),),
                timeout=30,
            )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for line in server.log_path.read_text(errors="replace").splitlines():
            if marker in line and line.startswith("{"):
                return json.loads(line)["identity"]
        time.sleep(0.1)
    raise AssertionError(f"no request-log line for {marker}:\n{server.log()}")


def test_identities_survive_a_restart_with_the_same_data_dir(spawn_server, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("restart-key\n")
    args = ("--no-http", "--api-keys-file", str(keys))

    def identity_with(data_dir) -> str:
        server = spawn_server(*args, "--data-dir", str(data_dir), wait_ready=False)
        try:
            return logged_identity(server, "restart-key")
        finally:
            server.stop()

    first = identity_with(tmp_path / "one")
    assert stat.S_IMODE((tmp_path / "one" / SECRET_FILE_NAME).stat().st_mode) == 0o600
    assert identity_with(tmp_path / "one") == first
    assert identity_with(tmp_path / "two") != first
    secret = (tmp_path / "one" / SECRET_FILE_NAME).read_bytes().strip()
    assert first == identity_hash(secret, "restart-key", "") != hashlib.sha256(b"restart-key").hexdigest()

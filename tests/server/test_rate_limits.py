"""Per-caller rate limits (server/security/rate_limit.py) and who sees whose usage (server/services/metrics_service.py).

The token bucket and the limiter run on a fake clock. The live tests run one
``protoserve serve`` with API keys, an admin key, ``--rate-limit-rpm 2``, a
per-key overrides file and a known identity secret, and check the answers over
gRPC (RESOURCE_EXHAUSTED + RetryInfo), HTTP (429 + Retry-After, OpenAI error
body) and the official ``openai`` client. Each test uses its own API key, so
their buckets are apart; two requests per minute refill one every 30 s, longer
than any test here takes.
"""

from __future__ import annotations

import hashlib
import math
import uuid

import grpc
import httpx
import openai
import pytest
from grpc_status import rpc_status

from protoserve.server import errors
from protoserve.server.security.auth import Authenticator, identity_hash
from protoserve.server.security.rate_limit import Limits, RateLimiter, TokenBucket, load_key_limits
from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc, metrics_pb2, metrics_pb2_grpc

# ---- the token bucket ------------------------------------------------------------------------


def test_bucket_bursts_to_capacity_then_refills_at_its_rate():
    bucket = TokenBucket(capacity=3, rate=0.5, now=100.0)
    assert [bucket.take(1, 100.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take(1, 100.0) == pytest.approx(2.0)  # one unit at 0.5/s
    assert bucket.take(1, 101.0) == pytest.approx(1.0)  # a refused take takes nothing
    assert bucket.take(1, 102.0) == 0.0
    # Never above capacity however long it rests.
    assert bucket.wait_s(3, 1_000_000.0) == 0.0 and bucket.level == 3


def test_bucket_wait_counts_the_missing_part_and_inf_beyond_capacity():
    bucket = TokenBucket(capacity=60, rate=1.0, now=0.0)
    assert bucket.take(50, 0.0) == 0.0
    assert bucket.wait_s(30, 0.0) == pytest.approx(20.0)  # 10 there, 20 more at 1/s
    assert bucket.wait_s(61, 0.0) == math.inf
    assert bucket.take(61, 0.0) == math.inf and bucket.level == 10


def test_bucket_give_returns_unused_but_never_above_capacity():
    bucket = TokenBucket(capacity=10, rate=1.0, now=0.0)
    bucket.take(8, 0.0)
    bucket.give(5, 0.0)
    assert bucket.level == 7
    bucket.give(100, 0.0)
    assert bucket.level == 10
    bucket.give(-4, 0.0)  # used more than reserved: charged
    assert bucket.level == 6


# ---- the limiter -----------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def limited(code_of: pytest.ExceptionInfo) -> tuple[grpc.StatusCode, int, float | None]:
    err = code_of.value
    return err.code, err.reason, err.retry_after_s


def test_one_caller_limited_the_other_still_served():
    auth = Authenticator(["key-a", "key-b"])
    clock = FakeClock()
    limiter = RateLimiter(Limits(rpm=2), clock=clock)
    a, b = auth.identity_for("key-a", ""), auth.identity_for("key-b", "")
    limiter.admit_request(a)
    limiter.admit_request(a)
    with pytest.raises(errors.ServiceError) as refused:
        limiter.admit_request(a)
    code, reason, retry = limited(refused)
    assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, pb.ERROR_REASON_RATE_LIMIT_EXCEEDED)
    assert retry == pytest.approx(30.0)  # 2 per minute: one more in 30 s
    limiter.admit_request(b)  # another key has its own bucket
    limiter.admit_request(b)
    clock.now += 30.0
    limiter.admit_request(a)  # refilled exactly when RetryInfo said


def test_user_ids_share_their_keys_quota_with_auth_on_and_not_with_auth_off():
    clock = FakeClock()
    with_auth = RateLimiter(Limits(rpm=1), clock=clock)
    auth = Authenticator(["key-a"])
    with_auth.admit_request(auth.identity_for("key-a", "u1"))
    with pytest.raises(errors.ServiceError):
        # The key holder picks x-user-id: a new one buys no new quota.
        with_auth.admit_request(auth.identity_for("key-a", "u2"))

    open_server = Authenticator()
    without_auth = RateLimiter(Limits(rpm=1), clock=clock)
    without_auth.admit_request(open_server.identity_for("", "u1"))
    without_auth.admit_request(open_server.identity_for("", "u2"))  # the user id is the caller
    with pytest.raises(errors.ServiceError):
        without_auth.admit_request(open_server.identity_for("", "u1"))


def test_tokens_reserved_at_admission_and_the_unused_part_given_back():
    auth = Authenticator(["key-a"])
    clock = FakeClock()
    limiter = RateLimiter(Limits(tpm=600), clock=clock)  # 10 tokens a second
    caller = auth.identity_for("key-a", "")
    first = limiter.reserve_tokens(caller, 500)  # prompt + max_tokens
    with pytest.raises(errors.ServiceError) as refused:
        limiter.reserve_tokens(caller, 200)
    assert limited(refused)[2] == pytest.approx(10.0)  # 100 left, 100 more at 10/s
    limiter.release(first, 300)  # it used 300 of its 500: 200 back
    second = limiter.reserve_tokens(caller, 300)
    assert second is not None and second.tokens == 300
    with pytest.raises(errors.ServiceError):
        limiter.reserve_tokens(caller, 1)  # exactly used up


def test_a_request_larger_than_the_limit_is_refused_without_retry_info():
    limiter = RateLimiter(Limits(tpm=100), clock=FakeClock())
    caller = Authenticator().identity_for("", "")
    with pytest.raises(errors.ServiceError) as refused:
        limiter.reserve_tokens(caller, 101)
    code, reason, retry = limited(refused)
    assert (code, reason, retry) == (grpc.StatusCode.RESOURCE_EXHAUSTED, pb.ERROR_REASON_RATE_LIMIT_EXCEEDED, None)
    assert "101 tokens" in refused.value.message and "100 tokens per minute" in refused.value.message
    assert limiter.reserve_tokens(caller, 100) is not None  # nothing was taken


def test_no_limits_means_no_buckets():
    limiter = RateLimiter()
    caller = Authenticator().identity_for("", "")
    assert not limiter.enabled
    for _ in range(1000):
        limiter.admit_request(caller)
    assert limiter.reserve_tokens(caller, 10**9) is None


def test_idle_callers_are_forgotten():
    clock = FakeClock()
    limiter = RateLimiter(Limits(rpm=1), clock=clock)
    auth = Authenticator()
    for i in range(100):
        limiter.admit_request(auth.identity_for("", f"user-{i}"))
    clock.now += 61.0  # every bucket full again
    limiter.admit_request(auth.identity_for("", "late"))
    assert len(limiter._buckets) == 1


def test_per_key_overrides_from_toml(tmp_path):
    path = tmp_path / "limits.toml"
    path.write_text('# team A\n[keys."key-a"]\nrpm = 5\n\n[keys."key-b"]\ntpm = 0\nrpm = 0\n')
    assert load_key_limits(path, Limits(rpm=1, tpm=1000)) == {
        "key-a": Limits(rpm=5, tpm=1000),  # a field left out keeps the default
        "key-b": Limits(rpm=0, tpm=0),  # 0 lifts the limit
    }
    auth = Authenticator(["key-a", "key-b", "key-c"])
    limiter = RateLimiter.from_config(1, 1000, str(path), auth)
    assert limiter.limits(auth.identity_for("key-a", "any-user")) == Limits(rpm=5, tpm=1000)
    assert limiter.limits(auth.identity_for("key-c", "")) == Limits(rpm=1, tpm=1000)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('[keys."sk-secret-typo"]\nrpm = -1\n', "rpm must be a whole number >= 0"),
        ('[keys."sk-secret-typo"]\nrpm = "many"\n', "rpm must be a whole number >= 0"),
        ('[keys."sk-secret-typo"]\nrqm = 1\n', "unknown fields ['rqm']"),
        ('[key."sk-secret-typo"]\nrpm = 1\n', "unknown top-level entries ['key']"),
        ('[keys."sk-secret-typo"\n', "not valid TOML"),
    ],
)
def test_bad_limits_files_name_the_problem_never_the_key(tmp_path, text, problem):
    path = tmp_path / "limits.toml"
    path.write_text(text)
    with pytest.raises(ValueError) as bad:
        load_key_limits(path)
    assert problem in str(bad.value) and "sk-secret" not in str(bad.value)


def test_limits_file_needs_auth_and_known_keys(tmp_path):
    path = tmp_path / "limits.toml"
    path.write_text('[keys."sk-secret-typo"]\nrpm = 1\n')
    with pytest.raises(ValueError, match="needs auth"):
        RateLimiter.from_config(0, 0, str(path), Authenticator())
    with pytest.raises(ValueError, match="1 of its keys are not API keys") as bad:
        RateLimiter.from_config(0, 0, str(path), Authenticator(["sk-secret"]))
    assert "sk-secret" not in str(bad.value).replace(str(path), "")
    with pytest.raises(ValueError, match="--rate-limit-rpm must be >= 0"):
        RateLimiter.from_config(-1, 0, None, Authenticator())


# ---- live ------------------------------------------------------------------------------------

SECRET = "live-test-identity-secret-0123456789abcdef"
KEYS = ("rl-grpc", "rl-http", "rl-openai", "rl-batch", "rl-tokens", "rl-refund", "rl-other", "rl-view-a", "rl-view-b")
ADMIN_KEY = "rl-admin"
TPM = 120  # rl-tokens and rl-refund only


@pytest.fixture(scope="module")
def limited_server(spawn_server, tmp_path_factory):
    directory = tmp_path_factory.mktemp("rate-limits")
    (directory / "keys").write_text("\n".join(KEYS) + "\n")
    (directory / "admin").write_text(ADMIN_KEY + "\n")
    (directory / "secret").write_text(SECRET)
    (directory / "limits.toml").write_text(
        f'[keys."rl-tokens"]\nrpm = 0\ntpm = {TPM}\n\n[keys."rl-refund"]\nrpm = 0\ntpm = {TPM}\n\n'
        '[keys."rl-view-a"]\nrpm = 0\n\n[keys."rl-view-b"]\nrpm = 0\n'
    )
    server = spawn_server(
        "--api-keys-file", str(directory / "keys"),
        "--admin-keys-file", str(directory / "admin"),
        "--identity-secret-file", str(directory / "secret"),
        "--rate-limit-rpm", "2",
        "--rate-limits-file", str(directory / "limits.toml"),
    )  # fmt: skip
    assert server.http_port is not None
    yield server
    server.stop()


def md(key: str, user_id: str | None = None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),) + ((("x-user-id", user_id),) if user_id else ())


def details_of(error: grpc.RpcError) -> dict[str, object]:
    from google.rpc import error_details_pb2

    status = rpc_status.from_call(error)
    found: dict[str, object] = {}
    for any_detail in status.details:
        for kind in (error_details_pb2.ErrorInfo, error_details_pb2.RetryInfo):
            if any_detail.Is(kind.DESCRIPTOR):
                message = kind()
                any_detail.Unpack(message)
                found[kind.__name__] = message
    return found


def short(max_tokens: int = 2) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt="Hello", sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_grpc_over_the_limit_is_resource_exhausted_with_retry_info(limited_server):
    with limited_server.sync_channel() as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        stub.Generate(short(), metadata=md("rl-grpc"), timeout=60)
        list(stub.GenerateStream(pb.GenerateStreamRequest(request=short()), metadata=md("rl-grpc"), timeout=60))
        with pytest.raises(grpc.RpcError) as refused:
            stub.Generate(short(), metadata=md("rl-grpc"), timeout=60)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        details = details_of(refused.value)
        assert details["ErrorInfo"].reason == "RATE_LIMIT_EXCEEDED"
        delay = details["RetryInfo"].retry_delay.ToTimedelta().total_seconds()
        assert 0 < delay <= 30
        # Streams are refused the same way, and another key is still served.
        with pytest.raises(grpc.RpcError) as refused_stream:
            list(stub.GenerateStream(pb.GenerateStreamRequest(request=short()), metadata=md("rl-grpc"), timeout=60))
        assert refused_stream.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert stub.Generate(short(), metadata=md("rl-other"), timeout=60).choices


def test_http_over_the_limit_is_429_with_retry_after(limited_server):
    base = f"http://127.0.0.1:{limited_server.http_port}"
    headers = {"authorization": "Bearer rl-http"}
    body = {"model": "x", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    body["model"] = httpx.get(f"{base}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    for _ in range(2):
        assert httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=60).status_code == 200
    reply = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert reply.status_code == 429
    assert 1 <= int(reply.headers["retry-after"]) <= 30
    error = reply.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    assert "2 requests per minute" in error["message"]
    # The native route too (google.rpc.Status body there).
    native = httpx.post(f"{base}/v1/generate", json={"prompt": "Hi"}, headers=headers, timeout=60)
    assert native.status_code == 429 and "retry-after" in native.headers


def test_openai_client_sees_rate_limit_error(limited_server):
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{limited_server.http_port}/v1", api_key="rl-openai", max_retries=0
    )
    model = client.models.list().data[0].id
    for _ in range(2):
        client.completions.create(model=model, prompt="Hi", max_tokens=2)
    with pytest.raises(openai.RateLimitError) as refused:
        client.completions.create(model=model, prompt="Hi", max_tokens=2)
    assert refused.value.response.headers["retry-after"]


def test_each_batch_item_counts(limited_server):
    with limited_server.sync_channel() as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        reply = stub.Batch(pb.BatchRequest(requests=[short(), short(), short()]), metadata=md("rl-batch"), timeout=60)
    outcomes = sorted(r.WhichOneof("result") for r in reply.results)
    assert outcomes == ["error", "response", "response"]
    [error] = [r.error for r in reply.results if r.HasField("error")]
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


def test_tokens_per_minute_reserve_prompt_plus_max_tokens(limited_server):
    with limited_server.sync_channel() as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        # Alone more than a minute's allowance: refused, and no RetryInfo since waiting cannot help.
        with pytest.raises(grpc.RpcError) as too_large:
            stub.Generate(short(max_tokens=TPM), metadata=md("rl-tokens"), timeout=60)
        assert too_large.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "RetryInfo" not in details_of(too_large.value)
        # Most of the minute: served (ignore_eos, so it uses all it reserved) ...
        prompt_tokens = len(stub.Tokenize(pb.TokenizeRequest(text="Hello"), metadata=md("rl-tokens")).token_ids)
        big = short(max_tokens=TPM - prompt_tokens - 10)
        assert stub.Generate(big, metadata=md("rl-tokens"), timeout=120).usage.completion_tokens == big.sampling.max_tokens
        # ... and the next request for more than is left waits for the refill (2 tokens a second).
        with pytest.raises(grpc.RpcError) as refused:
            stub.Generate(short(max_tokens=TPM - prompt_tokens - 1), metadata=md("rl-tokens"), timeout=60)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert details_of(refused.value)["RetryInfo"].retry_delay.ToTimedelta().total_seconds() > 0
        # rpm is lifted for this key, so small requests that fit still go through.
        assert stub.Generate(short(max_tokens=1), metadata=md("rl-tokens"), timeout=60).choices


def test_unused_tokens_are_given_back(limited_server):
    with limited_server.sync_channel() as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        text = "The capital of France is"
        prompt_tokens = len(stub.Tokenize(pb.TokenizeRequest(text=text), metadata=md("rl-refund")).token_ids)
        # Reserves the whole minute, but stops at the first space: a few tokens used.
        first = pb.GenerateRequest(
            prompt=text, sampling=pb.SamplingParams(max_tokens=TPM - prompt_tokens, temperature=0, stop=[" "])
        )
        reply = stub.Generate(first, metadata=md("rl-refund"), timeout=120)
        used = reply.usage.completion_tokens
        assert used < 20, reply.choices[0].text
        # Only the refund can make room for this one (the refill is 2 tokens a second).
        second = pb.GenerateRequest(
            prompt=text, sampling=pb.SamplingParams(max_tokens=TPM - prompt_tokens - used - 20, ignore_eos=True)
        )
        assert stub.Generate(second, metadata=md("rl-refund"), timeout=120).usage.completion_tokens > 0


def _usage(server, key: str, user_id: str | None = None) -> dict[str, metrics_pb2.IdentityUsage]:
    with server.sync_channel() as channel:
        reply = metrics_pb2_grpc.MetricsServiceStub(channel).GetMetrics(
            metrics_pb2.GetMetricsRequest(), metadata=md(key, user_id), timeout=30
        )
    return dict(reply.snapshot.usage_by_identity)


def test_callers_see_only_their_own_usage_and_admin_sees_all(limited_server):
    user = f"u-{uuid.uuid4().hex[:8]}"
    a, a_user = identity_hash(SECRET.encode(), "rl-view-a", ""), identity_hash(SECRET.encode(), "rl-view-a", user)
    b = identity_hash(SECRET.encode(), "rl-view-b", "")
    with limited_server.sync_channel() as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        stub.Generate(short(), metadata=md("rl-view-a"), timeout=60)
        stub.Generate(short(), metadata=md("rl-view-a", user), timeout=60)
        stub.Generate(short(), metadata=md("rl-view-b"), timeout=60)
    assert set(_usage(limited_server, "rl-view-a")) == {a}
    assert set(_usage(limited_server, "rl-view-a", user)) == {a_user}
    assert set(_usage(limited_server, "rl-view-b")) == {b}
    everyone = _usage(limited_server, ADMIN_KEY)
    assert {a, a_user, b} <= set(everyone) and everyone[b].requests == 1
    # The same over HTTP; the identities are keyed hashes, not sha256 of the key.
    base = f"http://127.0.0.1:{limited_server.http_port}"
    rows = httpx.get(f"{base}/v1/metrics", headers={"authorization": "Bearer rl-view-b"}, timeout=30).json()
    assert list(rows["snapshot"]["usage_by_identity"]) == [b]
    assert b != hashlib.sha256(b"rl-view-b").hexdigest()


def test_key_weights_from_toml_reach_every_user_id_of_the_key(tmp_path):
    path = tmp_path / "limits.toml"
    path.write_text('[keys."key-a"]\nweight = 3\n[keys."key-b"]\nrpm = 5\n')
    assert load_key_limits(path) == {"key-a": Limits(weight=3), "key-b": Limits(rpm=5)}
    auth = Authenticator(["key-a", "key-b"])
    limiter = RateLimiter.from_config(0, 0, str(path), auth)
    assert limiter.limits(auth.identity_for("key-a", "any-user")).weight == 3
    assert limiter.limits(auth.identity_for("key-b", "")).weight == 1
    path.write_text('[keys."sk-secret-typo"]\nweight = 0\n')
    with pytest.raises(ValueError, match="weight must be a whole number >= 1") as bad:
        load_key_limits(path)
    assert "sk-secret" not in str(bad.value)

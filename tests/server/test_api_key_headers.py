"""The key as ``authorization: Bearer`` or as Anthropic's ``x-api-key``: the same caller either way."""

from __future__ import annotations

import grpc
import pytest

from protoserve.server.errors import ServiceError
from protoserve.server.security.auth import Authenticator


@pytest.fixture
def auth() -> Authenticator:
    return Authenticator(["key-one", "key-two"], secret=b"s" * 32)


def test_x_api_key_is_the_same_identity_as_the_bearer_key(auth):
    bearer = auth.identify([("authorization", "Bearer key-one"), ("x-user-id", "ann")])
    header = auth.identify([("x-api-key", "key-one"), ("x-user-id", "ann")])
    assert header == bearer
    assert auth.identify([("x-api-key", "key-two")]).id != bearer.id


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ([], "missing API key"),
        ([("x-api-key", "wrong")], "invalid API key"),
        ([("x-api-key", "  ")], "missing API key"),
        # A key in another scheme is refused rather than passed over for x-api-key.
        ([("authorization", "Basic a2V5LW9uZQ=="), ("x-api-key", "key-one")], "must be 'Bearer <key>'"),
        ([("authorization", "Bearer wrong"), ("x-api-key", "key-one")], "invalid API key"),
    ],
)
def test_missing_malformed_or_wrong_keys_are_unauthenticated(auth, metadata, message):
    with pytest.raises(ServiceError) as refused:
        auth.identify(metadata)
    assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert message in refused.value.message

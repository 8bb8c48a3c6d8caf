"""Usage per identity: two callers, different counts, keyed by the identity hash and never the key;
each caller sees its own row only (the admin view is tested in tests/server/test_rate_limits.py)."""

from __future__ import annotations

import uuid

import httpx
from obs_stack import API_KEYS, auth_headers


def test_usage_is_kept_apart_per_identity(obs):
    # Fresh user ids, so earlier tests' usage of the same keys does not count.
    alpha_user, beta_user = f"alpha-{uuid.uuid4().hex}", f"beta-{uuid.uuid4().hex}"
    alpha = obs.app.auth.identity_for(API_KEYS[0], alpha_user).id
    beta = obs.app.auth.identity_for(API_KEYS[1], beta_user).id
    expected = {alpha: [0, 0, 0], beta: [0, 0, 0]}
    workload = [(API_KEYS[0], alpha_user, alpha, 3), (API_KEYS[0], alpha_user, alpha, 4), (API_KEYS[1], beta_user, beta, 7)]
    for key, user, identity, max_tokens in workload:
        body = {"prompt": f"usage for {user[:5]}", "sampling": {"max_tokens": max_tokens, "ignore_eos": True}}
        reply = httpx.post(obs.http_url + "/v1/generate", json=body, headers=auth_headers(key, user), timeout=60)
        assert reply.status_code == 200, reply.text
        usage = reply.json()["usage"]
        expected[identity][0] += 1
        expected[identity][1] += usage["prompt_tokens"]
        expected[identity][2] += usage["completion_tokens"]

    assert expected[alpha] != expected[beta]
    for key, user, identity in ((API_KEYS[0], alpha_user, alpha), (API_KEYS[1], beta_user, beta)):
        reply = httpx.get(obs.http_url + "/v1/metrics", headers=auth_headers(key, user), timeout=30)
        assert reply.status_code == 200
        requests, input_tokens, output_tokens = expected[identity]
        # The caller's own row and nobody else's.
        assert reply.json()["snapshot"]["usage_by_identity"] == {
            identity: {
                "requests": str(requests),
                "input_tokens": str(input_tokens),
                "output_tokens": str(output_tokens),
            }
        }
        # Keyed by hash: neither the API keys nor the user ids appear anywhere in the answer.
        for secret in (*API_KEYS, alpha_user, beta_user):
            assert secret not in reply.text

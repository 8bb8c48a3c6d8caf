"""Who is calling: API keys and identities, the identity secret, rate limits."""

"""FairShare: virtual token counters, so tenants competing for the engine get equal (weighted) service.

After Sheng et al., "Fairness in Serving Large Language Models" (OSDI 2024): every tenant has a
counter of the service it has received, in tokens: each prompt token computed for it costs
``PROMPT_TOKEN_COST``, each token generated for it ``OUTPUT_TOKEN_COST`` (the paper's w_p = 1,
w_q = 2), divided by its weight. The scheduler admits the least-served backlogged tenant's work
first and, when it needs room, preempts the most-served tenant's, so the counters of two
backlogged tenants stay within a bound of each other however much either one sends.

Two levels: a tenant is an identity within a group (an API key and its user ids). Groups compete
with each other by their counters and weights; the identities of one group compete among
themselves with equal weight. A key that mints user ids gets no more than its key's share.

A tenant that had no work joins with its counter lifted to just below the least counter among the
backlogged tenants minus ``margin`` (never lowered): idle time banks no credit beyond the margin,
and a newcomer is owed room by everyone backlogged, so its first request runs in the next step.
A tenant's running work is preempted for another's only while its counter is more than ``margin``
ahead of the other's: without that hysteresis two backlogged tenants would trade sequences every
step, each trade recomputing a sequence's KV.

Counters are integers: weights divide ``WEIGHT_SCALE`` units per token (exactly for weights 1-16).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

from protoserve.engine.request import Tenant

PROMPT_TOKEN_COST = 1  # per prompt token computed for the first time (prefix-cache hits are free)
OUTPUT_TOKEN_COST = 2  # per generated token: a decode step costs more per token than a prefill chunk
WEIGHT_SCALE = 720_720  # lcm(1, ..., 16)
# Counters of tenants with no work are kept for their next arrival, at most this many (oldest dropped:
# a dropped counter comes back lifted to the floor, which is where an old one would land too).
MAX_IDLE_ACCOUNTS = 4096


@dataclass
class _Account:
    service: int = 0  # weighted tokens served, in WEIGHT_SCALE units
    live: int = 0  # sequences waiting or running


class _Level:
    """The accounts of one level (groups, or the identities of every group)."""

    def __init__(self) -> None:
        self.accounts: dict[Hashable, _Account] = {}
        self._idle: OrderedDict[Hashable, None] = OrderedDict()

    def account(self, name: Hashable) -> _Account:
        account = self.accounts.get(name)
        if account is None:
            account = self.accounts[name] = _Account()
        return account

    def join(self, name: Hashable, floor: int | None) -> None:
        account = self.account(name)
        if account.live == 0:
            self._idle.pop(name, None)
            if floor is not None:
                account.service = max(account.service, floor)
        account.live += 1

    def leave(self, name: Hashable) -> None:
        account = self.accounts[name]
        account.live -= 1
        if account.live == 0:
            self._idle[name] = None
            while len(self._idle) > MAX_IDLE_ACCOUNTS:
                oldest, _ = self._idle.popitem(last=False)
                del self.accounts[oldest]

    def service(self, name: Hashable) -> int:
        account = self.accounts.get(name)
        return account.service if account is not None else 0


class FairShare:
    """The counters of every tenant with work, or with work lately; used by the scheduler's thread only."""

    def __init__(self, margin_tokens: int) -> None:
        self.margin = margin_tokens * WEIGHT_SCALE
        self.groups = _Level()
        self.identities = _Level()
        self._members: dict[str, set[tuple[str, str]]] = {}  # group -> its identities with work

    def join(self, tenant: Tenant) -> None:
        """A sequence of ``tenant`` arrives (a new request, or a choice forked off one)."""
        group, identity = tenant.group, _identity_key(tenant)
        others = [self.groups.accounts[g].service for g in self._members if g != group]
        self.groups.join(group, min(others) - self.margin - 1 if others else None)
        members = self._members.setdefault(group, set())
        peers = [self.identities.accounts[i].service for i in members if i != identity]
        self.identities.join(identity, min(peers) - self.margin - 1 if peers else None)
        members.add(identity)

    def leave(self, tenant: Tenant) -> None:
        """A sequence of ``tenant`` finished or was aborted."""
        group, identity = tenant.group, _identity_key(tenant)
        if self.identities.accounts[identity].live == 1:
            members = self._members[group]
            members.discard(identity)
            if not members:
                del self._members[group]
        self.identities.leave(identity)
        self.groups.leave(group)

    def charge(self, tenant: Tenant, units: int) -> None:
        """Count ``units`` of cost (PROMPT_TOKEN_COST / OUTPUT_TOKEN_COST per token) as served to ``tenant``."""
        if units <= 0:
            return
        self.groups.account(tenant.group).service += units * WEIGHT_SCALE // tenant.weight
        self.identities.account(_identity_key(tenant)).service += units * WEIGHT_SCALE

    def rank(self, tenant: Tenant) -> tuple[int, int]:
        """Sort key: the least-served group first, and within it the least-served identity."""
        return self.groups.service(tenant.group), self.identities.service(_identity_key(tenant))

    def ahead(self, victim: Tenant, candidate: Tenant) -> bool:
        """Whether ``victim`` has been served more than ``margin`` beyond ``candidate``, at the level
        where they differ (never for the same identity): only then may its work make room for the other's."""
        if victim.group != candidate.group:
            return self.groups.service(victim.group) > self.groups.service(candidate.group) + self.margin
        if victim.identity != candidate.identity:
            return (self.identities.service(_identity_key(victim))
                    > self.identities.service(_identity_key(candidate)) + self.margin)
        return False

    def served(self, tenant: Tenant) -> float:
        """The tenant's counter in weighted tokens (for stats and tests)."""
        return self.groups.service(tenant.group) / WEIGHT_SCALE


def _identity_key(tenant: Tenant) -> tuple[str, str]:
    # Identities are accounted within their group: the same name under two groups is two tenants. A
    # tuple of the two strings hashes from their cached hashes (the scheduler asks every step, per row).
    return tenant.group, tenant.identity

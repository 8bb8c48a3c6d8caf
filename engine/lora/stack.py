"""AdapterStack: the engine's registry of LoRA adapters and the ``max_loras`` slots they run from.

A registered adapter is known by name and path; a *resident* one also holds its deltas in
one of ``max_loras`` slots, and a forward batch names adapters by slot index. Requests pin
their adapter (``acquire`` on admission, ``release`` when the request leaves the engine):
a pinned adapter is never evicted or unloaded. When a slot is needed and none is free, the
least recently used unpinned adapter leaves memory (it stays registered, and is read back
from its path the next time a request asks for it); when every slot is pinned the request
is refused with AdapterCapacityError (retry later). An adapter whose files changed or vanished
since it was loaded cannot be read back: it is marked as needing a reload (the cause logged
here, with its path, for the admin) and its requests get AdapterReloadNeededError, which names
no path, until an admin unloads it and loads it again.

Thread safety: the server loads and unloads on its own threads while the step thread
acquires, releases and reads slots, so every method takes one lock. A forward reads a
slot's deltas once, at its start; slots it reads are pinned, so no change lands under it.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from protoserve.engine.errors import AdapterCapacityError, AdapterReloadNeededError, InvalidRequestError
from protoserve.engine.lora.adapter import AdapterError, LoraAdapter, load_adapter
from protoserve.engine.models.config import ModelConfig

log = logging.getLogger(__name__)

NO_ADAPTER = -1  # slot of rows that run the base model alone


class AdapterInUseError(Exception):
    """Unloading an adapter that waiting or running requests use."""

    def __init__(self, name: str, requests: int) -> None:
        self.name = name
        self.requests = requests
        super().__init__(f"adapter {name!r} is in use by {requests} request(s); unload it once they finish")


class UnknownAdapterError(KeyError):
    """No adapter of that name is registered."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(name)

    def __str__(self) -> str:
        return f"no adapter named {self.name!r} is loaded"


@dataclass(frozen=True)
class AdapterInfo:
    """What ListAdapters shows of one adapter."""

    name: str
    path: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    resident: bool  # holds a slot now (else read back from path on next use)
    active_requests: int
    needs_reload: bool  # its files changed since it was loaded: its requests are refused


@dataclass
class _Entry:
    path: Path
    digest: bytes
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    slot: int = NO_ADAPTER
    pins: int = 0
    needs_reload: bool = False


class AdapterStack:
    """Registered adapters by name, at most ``max_loras`` of them resident in slots."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {max_loras}")
        self.config = config
        self.dtype = dtype
        self.max_loras = max_loras
        self.slots: list[LoraAdapter | None] = [None] * max_loras
        self._entries: dict[str, _Entry] = {}
        self._lru: OrderedDict[str, None] = OrderedDict()  # resident names, least recently used first
        self._lock = threading.Lock()

    # -- admin ---------------------------------------------------------------

    def load(self, name: str, path: str | Path) -> AdapterInfo:
        """Read, check and register an adapter (made resident when a slot is free or idle).

        AdapterError on a malformed adapter or a name already loaded; nothing changes then. The
        name is the caller's to check (the server's rules for names are the API's, not the engine's).
        """
        adapter = load_adapter(name, path, self.config, self.dtype)  # outside the lock: file reads
        with self._lock:
            if name in self._entries:
                raise AdapterError(f"an adapter named {name!r} is already loaded; unload it first", "name")
            entry = _Entry(adapter.path, adapter.digest, adapter.rank, adapter.alpha, adapter.target_modules)
            self._entries[name] = entry
            slot = self._free_slot()
            if slot is not None:
                self._place(name, entry, adapter, slot)
            return self._info(name, entry)

    def unload(self, name: str) -> None:
        """Forget an adapter; AdapterInUseError while requests use it, UnknownAdapterError if not loaded."""
        with self._lock:
            entry = self._entry(name)
            if entry.pins:
                raise AdapterInUseError(name, entry.pins)
            self._evict(name, entry)
            del self._entries[name]

    def list(self) -> list[AdapterInfo]:
        with self._lock:
            return [self._info(n, e) for n, e in sorted(self._entries.items())]

    def __contains__(self, name: str) -> bool:
        with self._lock:
            return name in self._entries

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._entries)

    # -- requests ------------------------------------------------------------

    def check(self, name: str) -> None:
        """InvalidRequestError on ``adapter`` unless an adapter of that name is registered."""
        with self._lock:
            if name not in self._entries:
                known = ", ".join(sorted(self._entries)) or "none"
                raise InvalidRequestError([("adapter", f"no adapter named {name!r} is loaded (loaded: {known})")])

    def acquire(self, name: str) -> None:
        """Pin an adapter for a request and make it resident (reading it back if it was evicted)."""
        with self._lock:
            if name not in self._entries:
                raise InvalidRequestError([("adapter", f"no adapter named {name!r} is loaded")])
            entry = self._entries[name]
            if entry.needs_reload:
                raise AdapterReloadNeededError(name)
            if entry.slot == NO_ADAPTER:
                slot = self._free_slot()
                if slot is None:
                    raise AdapterCapacityError(name, self.max_loras)
                self._place(name, entry, self._read_back(name, entry), slot)
            entry.pins += 1
            self._lru.move_to_end(name)

    def release(self, name: str) -> None:
        with self._lock:
            entry = self._entries.get(name)
            if entry is not None and entry.pins > 0:
                entry.pins -= 1

    def slot_of(self, name: str | None) -> int:
        """The slot a pinned adapter runs from (NO_ADAPTER for None)."""
        if name is None:
            return NO_ADAPTER
        with self._lock:
            return self._entries[name].slot

    def cache_salt(self, salt: bytes, name: str | None) -> bytes:
        """The prefix-cache salt of a request under ``name``: the adapter's name and content mixed in,
        so blocks computed under one adapter (or none) never serve another."""
        if name is None:
            return salt
        with self._lock:
            digest = self._entry(name).digest
        return hashlib.sha256(b"protoserve-lora\x00" + salt + b"\x00" + name.encode() + b"\x00" + digest).digest()

    def adapters_for(self, slots: list[int]) -> dict[int, LoraAdapter]:
        """The resident adapters of ``slots`` (NO_ADAPTER skipped), read once for a forward."""
        with self._lock:
            out = {}
            for s in slots:
                if s != NO_ADAPTER:
                    adapter = self.slots[s]
                    if adapter is None:
                        raise RuntimeError(f"LoRA slot {s} is empty but a batch row uses it")
                    out[s] = adapter
            return out

    # -- internals (lock held) -----------------------------------------------

    def _read_back(self, name: str, entry: _Entry) -> LoraAdapter:
        """An evicted adapter read again from its path; AdapterReloadNeededError (and the entry so
        marked) when its files changed or vanished since it was loaded."""
        try:
            adapter = load_adapter(name, entry.path, self.config, self.dtype)
        except AdapterError as exc:
            cause = f"it could not be read back ({exc})"
        else:
            if adapter.digest == entry.digest:
                return adapter
            cause = "its files changed since it was loaded"
        entry.needs_reload = True
        log.warning("LoRA adapter %r from %s must be reloaded: %s", name, entry.path, cause)
        raise AdapterReloadNeededError(name)

    def _entry(self, name: str) -> _Entry:
        if name not in self._entries:
            raise UnknownAdapterError(name)
        return self._entries[name]

    def _free_slot(self) -> int | None:
        for i, a in enumerate(self.slots):
            if a is None:
                return i
        for victim in self._lru:  # least recently used first
            entry = self._entries[victim]
            if entry.pins == 0:
                slot = entry.slot
                self._evict(victim, entry)
                return slot
        return None

    def _place(self, name: str, entry: _Entry, adapter: LoraAdapter, slot: int) -> None:
        self.slots[slot] = adapter
        entry.slot = slot
        self._lru[name] = None
        self._lru.move_to_end(name)

    def _evict(self, name: str, entry: _Entry) -> None:
        if entry.slot != NO_ADAPTER:
            self.slots[entry.slot] = None
            entry.slot = NO_ADAPTER
        self._lru.pop(name, None)

    def _info(self, name: str, entry: _Entry) -> AdapterInfo:
        return AdapterInfo(name, str(entry.path), entry.rank, entry.alpha, entry.target_modules,
                           entry.slot != NO_ADAPTER, entry.pins, entry.needs_reload)


def adapter_problems(stack: AdapterStack | None, name: str | None) -> list[tuple[str, str]]:
    """The request's ``adapter`` field's problems (none when it names a loaded adapter or is unset)."""
    if name is None:
        return []
    if stack is None:
        return [("adapter", f"adapter {name!r} requested, but this engine serves no LoRA adapters")]
    if name not in stack:
        known = ", ".join(stack.names()) or "none"
        return [("adapter", f"no adapter named {name!r} is loaded (loaded: {known})")]
    return []

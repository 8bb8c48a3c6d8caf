"""KVOffloader: the prefix cache's blocks written to a BlockStore when the pool evicts them (and at
shutdown), and read back into free blocks when a new request's prefix is on disk but not in memory.

Writes: the step thread copies an evicted block's K/V (it is about to be overwritten) and the worker
thread writes the file. Reads: a request whose prefix continues on disk past what the pool holds is
parked when it arrives while the worker reads those blocks; the next step (or, on an idle engine, the
step that waits for it) publishes them in free blocks as cached blocks and hands the request to the
scheduler, whose prefix match then takes them exactly like blocks that never left memory.

A block file that is damaged, names another block, or was written under another fingerprint is not
loaded: its tokens are recomputed, with a warning (block_store.py).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from protoserve.engine.config import EngineConfig
from protoserve.engine.kv_offload.block_store import BlockStore
from protoserve.engine.kv_offload.fingerprint import KVFingerprint, checkpoint_identity
from protoserve.engine.loader.load import LoadedModel
from protoserve.engine.models.kv_cache import PagedKVCache
from protoserve.engine.scheduling.block_manager import BlockManager
from protoserve.engine.scheduling.scheduler import Scheduler
from protoserve.engine.scheduling.sequence import Sequence

log = logging.getLogger(__name__)


@dataclass
class ParkedSequence:
    """A new sequence waiting for its prefix blocks to come off disk."""

    seq: Sequence
    hashes: list[bytes]  # the blocks being read, in order
    payloads: Future[list[torch.Tensor]]  # as many as could be read, in order from the first


@dataclass
class OffloadCounters:
    blocks_written: int = 0
    blocks_loaded: int = 0


@dataclass
class KVOffloader:
    store: BlockStore
    pools: list[torch.Tensor]  # every layer's K pool, then every layer's V pool (if not shared): [num_blocks, ...]
    block_manager: BlockManager
    counters: OffloadCounters = field(default_factory=OffloadCounters)
    _parked: list[ParkedSequence] = field(default_factory=list)
    _queued: set[Path] = field(default_factory=set)  # files being written: readable once the worker gets there
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # One thread, so a read queued after a write of the same file finds it written.
    _worker: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-offload"))

    def __post_init__(self) -> None:
        self.block_manager.on_evict = self._save

    # -- the step thread ------------------------------------------------------

    def park(self, seq: Sequence) -> bool:
        """Start reading the blocks of ``seq``'s prefix that are on disk and not in the pool; True when
        there are some, and ``seq`` waits here for them (``restored``) instead of in the scheduler."""
        bm = self.block_manager
        hashes = seq.full_block_hashes(bm.block_size)
        usable = hashes[: (seq.num_tokens - 1) // bm.block_size]  # the last token is computed for its logits
        run = []
        for h in usable[len(bm.match_prefix(usable)) :]:
            path = self.store.path(seq.cache_salt, h)
            if not self._on_disk(path):
                break
            run.append((path, h))
        if not run:
            return False
        future = self._worker.submit(self._read_run, run)
        self._parked.append(ParkedSequence(seq, [h for _, h in run], future))
        return True

    def park_preempted(self, scheduler: Scheduler) -> None:
        """A preempted sequence recomputes its prefix when it is admitted again, and blocks of that prefix
        evicted from the pool since may be on disk: it waits for them as a new request does, once the free
        blocks could hold it (until then more of its blocks may go). Once per preemption, so a pool too
        tight to keep them until it runs cannot keep it parked."""
        bm = self.block_manager
        for seq in [s for s in scheduler.waiting if s.num_preemptions > s.num_preemptions_reloaded
                    and bm.num_free_blocks >= bm.blocks_for(s.num_tokens)]:
            if self.park(seq):
                seq.num_preemptions_reloaded = seq.num_preemptions
                scheduler.set_aside(seq)

    def hand_back(self, scheduler: Scheduler) -> None:
        """Give the scheduler the parked sequences whose prefix blocks came off disk; with nothing else to
        run, wait for them."""
        if not self._parked:
            return
        for seq in self.restored(wait=not scheduler.has_unfinished()):
            if seq.num_preemptions:  # still its tenant's since the preemption
                scheduler.put_back(seq)
            else:
                scheduler.add(seq)

    def restored(self, wait: bool) -> list[Sequence]:
        """The parked sequences whose blocks are read, with those blocks published in the pool (as many as
        it has free); ``wait``: wait for every read (the engine has nothing else to do)."""
        ready, still = [], []
        for parked in self._parked:
            if wait or parked.payloads.done():
                self._install(parked)
                ready.append(parked.seq)
            else:
                still.append(parked)
        self._parked = still
        return ready

    def drop(self, seq: Sequence) -> bool:
        """Forget a parked sequence (its request was aborted); False when it is not parked."""
        for i, parked in enumerate(self._parked):
            if parked.seq is seq:
                del self._parked[i]
                return True
        return False

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def parked_request_ids(self) -> set[str]:
        return {p.seq.request_id for p in self._parked}

    def persist(self) -> None:
        """At shutdown, once no step runs: write every cached block not on disk yet, and wait for the writes."""
        for h, block_id in list(self.block_manager.cached.items()):
            self._save(block_id, h, self.block_manager.blocks[block_id].salt)
        self._worker.shutdown(wait=True)
        log.info("kv offload: %d blocks written, %d loaded; %s holds %.1f MiB", self.counters.blocks_written,
                 self.counters.blocks_loaded, self.store.root, self.store.num_bytes / 2**20)

    def _save(self, block_id: int, h: bytes, salt: bytes) -> None:
        """Write-back of a cached block (on eviction, before its K/V are overwritten), unless on disk."""
        path = self.store.path(salt, h)
        if self._on_disk(path):
            return
        snapshot = torch.stack([pool[block_id] for pool in self.pools])  # a copy: the pool may change next
        with self._lock:
            self._queued.add(path)
        self._worker.submit(self._write, path, h, snapshot)

    def _install(self, parked: ParkedSequence) -> None:
        bm = self.block_manager
        payloads = parked.payloads.result()
        # Adopting takes the free queue's front, where the part of the prefix still in memory may sit
        # (a preempted sequence's own blocks): those go to the back first, so the loaded ones continue them.
        bm.touch(bm.match_prefix(parked.seq.full_block_hashes(bm.block_size)))
        # Each adopted block takes the free queue's front: never more than it holds, so none evicts another.
        for h, data in zip(parked.hashes, payloads[: bm.num_free_blocks], strict=False):
            block_id = bm.adopt(h, parked.seq.cache_salt)
            if block_id is None:
                if h in bm.cached:  # computed meanwhile by another sequence
                    continue
                break
            for pool, part in zip(self.pools, data.to(self.pools[0].device), strict=True):
                pool[block_id].copy_(part)
            self.counters.blocks_loaded += 1

    def _on_disk(self, path: Path) -> bool:
        with self._lock:
            if path in self._queued:
                return True
        return self.store.contains(path)

    # -- the worker thread ----------------------------------------------------

    def _write(self, path: Path, h: bytes, snapshot: torch.Tensor) -> None:
        try:
            self.store.write(path, h, snapshot.cpu().contiguous().view(torch.uint8).numpy().tobytes())
            self.counters.blocks_written += 1
        except OSError as exc:  # a full or read-only disk costs the recompute later, never the request
            log.warning("kv offload: could not write %s (%s)", path, exc)
        finally:
            with self._lock:
                self._queued.discard(path)

    def _read_run(self, run: list[tuple[Path, bytes]]) -> list[torch.Tensor]:
        """The blocks of ``run`` in order, up to the first that cannot be read."""
        out = []
        shape = (len(self.pools), *self.pools[0].shape[1:])
        for path, h in run:
            payload = self.store.read(path, h)
            if payload is None:
                break
            out.append(torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self.pools[0].dtype).view(shape))
        return out


def start_offload(config: EngineConfig, loaded: LoadedModel, kv_cache: object,
                  block_manager: BlockManager) -> KVOffloader | None:
    """The offloader of ``config.kv_offload_dir`` over this engine's pool; None when it is unset."""
    if config.kv_offload_dir is None:
        return None
    if not isinstance(kv_cache, PagedKVCache):
        raise ValueError(f"kv_offload_dir needs the paged KV cache, and this model runs {type(kv_cache).__name__}")
    fingerprint = KVFingerprint(
        model=checkpoint_identity(loaded.source), dtype=str(loaded.dtype), kv_dtype=str(kv_cache.dtype),
        quantization=loaded.quantization, group_size=loaded.group_size,
        activation_precision=config.activation_precision, deterministic=config.deterministic,
        device=config.device, block_size=config.block_size, num_layers=kv_cache.num_layers,
        num_kv_heads=kv_cache.num_kv_heads, head_dim=kv_cache.head_dim,
    )
    pools = [*kv_cache.k, *([] if kv_cache.v is kv_cache.k else kv_cache.v)]  # MLA's one shared pool once
    payload_bytes = sum(pool[0].numel() * pool.element_size() for pool in pools)
    store = BlockStore(config.kv_offload_dir, fingerprint.digest(), config.kv_offload_max_bytes, payload_bytes)
    return KVOffloader(store, pools, block_manager)

"""Where a job's prefill and decode go: the prompt's block hashes under the deployment's KV
layout, then for each role the worker with the longest cached prefix among the least loaded
(`Registry.pick` with the cached prefix as affinity: the same policy and slack for both
roles; the `router.prefix_index` follows every prefill and decode worker's KV events), and
the items the prefill worker's prefix covers entirely, which need no encoding. A decode
worker that holds a conversation's earlier turns pulls only the blocks it lacks, so
multi-turn chats stay where their KV is unless load says otherwise. Admission uses the same
choice (`chooser`)."""

from __future__ import annotations

from dataclasses import dataclass

from common.kv.hashing import block_hashes
from common.kv.layout import layout_root
from router.calls import Job
from router.prefix_index import PrefixIndex
from router.registry import Registry
from router.workers import Role, WorkerRecord


@dataclass(frozen=True, slots=True)
class PrefillRoute:
    """Where a job's prefill goes and which items it will not need embeddings for."""

    worker: WorkerRecord | None  # the chosen prefill worker (None: pick at call time)
    skip: frozenset[int]  # items inside the worker's cached prefix: not encoded
    cached_blocks: int = 0  # leading blocks the worker is known to cache (usable ones)


class PrefillRouting:
    """Cache-aware choice of prefill workers (see the module docstring)."""

    def __init__(
        self, registry: Registry, prefix: PrefixIndex, cache_aware: bool, slack: int = 2
    ) -> None:
        self.registry = registry
        self.prefix = prefix  # cached prefixes per prefill worker, from their KV events
        self.cache_aware = cache_aware  # False: no hashes, the least loaded worker
        self.slack = slack  # requests beyond the least loaded a cached prefix may add

    def hashes(self, job: Job) -> list[bytes] | None:
        """The prompt's block hashes for cache-aware routing (None: not cache aware, or no
        prefill worker yet, or a layout the hashes cannot cover)."""
        workers = [w for w in self.registry.workers(Role.PREFILL) if not w.draining]
        # The registry keeps every KV layout equal, so the first one roots every hash.
        layout = workers[0].layout if workers else None
        if not self.cache_aware or layout is None:
            return None
        for w in [*workers, *self.registry.workers(Role.DECODE)]:
            self.prefix.track(w.address, w.role)
        try:
            return block_hashes(
                job.prompt.prompt_token_ids,
                layout.block_size,
                job.prompt.params,
                cache_salt=job.cache_salt,
                root=layout_root(layout),
            )
        except ValueError:
            return None

    def chooser(self, hashes: list[bytes] | None) -> Chooser:
        """Admission's worker choice: prefill and decode each by cached prefix among the
        least loaded (when cache aware; else by load); never a worker in `exclude` (no
        room)."""
        return Chooser(self.registry, self.prefix, hashes, self.slack)

    def route(
        self,
        job: Job,
        hashes: list[bytes] | None,
        worker: WorkerRecord | None,
        choose: Chooser | None = None,
    ) -> PrefillRoute:
        """The prefill worker (`worker`, or the one with the longest known cached prefix
        among the least loaded) and the items its cached prefix covers entirely (see
        `router.orchestrator`); `hashes` are `hashes(job)`, `choose` the chooser admission
        used for them (its prefixes are reused), if any."""
        if hashes is None:
            return PrefillRoute(worker, frozenset())
        if choose is None or choose.hashes is not hashes:
            choose = self.chooser(hashes)
        if worker is None:
            worker = choose(Role.PREFILL, frozenset())
        assert worker.layout is not None  # a prefill worker
        block_size = worker.layout.block_size
        tokens = job.prompt.prompt_token_ids
        blocks = min(choose.cached_blocks(worker), (len(tokens) - 1) // block_size)
        covered = blocks * block_size
        items = job.prompt.params.items
        skip = frozenset(i for i, it in enumerate(items) if it.end <= covered)
        return PrefillRoute(worker, skip, blocks)


class Chooser:
    """One routing decision's worker choice (`PrefillRouting.chooser`): called with a role
    and the addresses to exclude. Every worker's cached prefix of `hashes` is looked up
    once, at the first call, and serves every later call (the other role, a retry)."""

    def __init__(
        self,
        registry: Registry,
        prefix: PrefixIndex,
        hashes: list[bytes] | None,
        slack: int = 2,
    ):
        self.registry = registry
        self.prefix = prefix
        self.hashes = hashes  # None: by load alone
        self.slack = slack  # `Registry.pick`'s
        self._prefixes: dict[str, int] | None = None

    def cached_blocks(self, worker: WorkerRecord) -> int:
        """Leading blocks of the hashes `worker` is known to cache."""
        if self.hashes is None:
            return 0
        if self._prefixes is None:
            self._prefixes = self.prefix.cached_prefixes(self.hashes)
        return self._prefixes.get(worker.address, 0)

    def __call__(self, role: Role, exclude: frozenset[str]) -> WorkerRecord:
        if self.hashes is None:
            return self.registry.pick(role, exclude=exclude)
        return self.registry.pick(
            role, exclude=exclude, affinity=self.cached_blocks, slack=self.slack
        )

"""How much host memory this process may still allocate, as Linux says: the kernel's
`MemAvailable`, or less where a memory cgroup holding the process (its own or one above it,
cgroup v2 or v1) leaves less under its limit. A KV pool larger than that is refused before
it is zeroed (`common.kv.cache.PagedKvCache`): zeroing touches every page, and the kernel
killed such a pool's process with no line saying why.

What a cgroup leaves is its limit less what it uses, not counting the page cache the kernel
may drop first (shared memory, counted in that cache, stays). The process's cgroup comes
from `/proc/self/cgroup`, read under the cgroup mount: the root files alone hold the host's
value where the process has no cgroup namespace (a runner's, a systemd unit's, a Slurm
job's), and a limit may be set on a parent (a pod's, where each container sets none).
"""

from __future__ import annotations

from pathlib import Path

# A v1 cgroup's limit at or past this is none (the kernel writes 2^63 less a page).
_NO_LIMIT = 1 << 62


def host_bytes_free(
    proc: Path = Path("/proc"), cgroups: Path = Path("/sys/fs/cgroup")
) -> int | None:
    """Bytes of host memory an allocation may take now (see the module docstring); None
    where Linux says nothing of it."""
    sizes = [
        size for size in (_mem_available(proc), _cgroup_room(proc, cgroups)) if size is not None
    ]
    return min(sizes) if sizes else None


def _mem_available(proc: Path) -> int | None:
    try:
        for line in (proc / "meminfo").read_text(encoding="ascii").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room(proc: Path, cgroups: Path) -> int | None:
    """The least room any memory cgroup holding this process leaves (None: no limit)."""
    try:
        lines = (proc / "self" / "cgroup").read_text(encoding="ascii").splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        parts = line.split(":", 2)  # hierarchy-id:controllers:path
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2: one hierarchy
            files = ("memory.max", "memory.current", "file", "shmem")
            mount = cgroups / "unified" if (cgroups / "unified").is_dir() else cgroups
        elif "memory" in controllers.split(","):  # v1: the memory controller's
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_cache", "total_shmem")
            mount = cgroups / "memory"
        else:
            continue
        folder = mount / path.lstrip("/")
        while True:  # the process's cgroup, then each one above it
            room = _room(folder, *files)
            if room is not None:
                rooms.append(room)
            if folder == mount or mount not in folder.parents:
                break
            folder = folder.parent
    return min(rooms) if rooms else None


def _room(
    folder: Path, limit_file: str, usage_file: str, cache_key: str, shmem_key: str
) -> int | None:
    """`folder`'s cgroup limit less its use without the page cache the kernel may drop
    (shared memory, /dev/shm's, counts in the cache but stays: a Ray object store's);
    None: no limit, or none readable there ("max" in v2)."""
    try:
        limit = int((folder / limit_file).read_text(encoding="ascii"))
    except (OSError, ValueError):
        return None
    if limit >= _NO_LIMIT:
        return None
    try:
        used = int((folder / usage_file).read_text(encoding="ascii"))
        stat = dict(
            line.split(" ", 1) for line in (folder / "memory.stat").read_text().splitlines()
        )
        droppable = int(stat.get(cache_key, 0)) - int(stat.get(shmem_key, 0))
    except (OSError, ValueError):
        return limit  # the limit alone is known: the most it may leave
    return max(0, limit - max(0, used - max(0, droppable)))

"""`common.host_memory.host_bytes_free` against fake /proc and cgroup trees: the process's
own cgroup and the ones above it, v2 and v1, less what they use without page cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.host_memory import host_bytes_free

GIB = 1 << 30


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def fake(
    tmp_path: Path, cgroup: str, files: dict[str, str], available_gib: int = 64
) -> tuple[Path, Path]:
    proc, cgroups = tmp_path / "proc", tmp_path / "cgroup"
    write(proc, {"meminfo": f"MemTotal: 1 kB\nMemAvailable: {available_gib * GIB // 1024} kB\n"})
    write(proc, {"self/cgroup": cgroup})
    write(cgroups, files)
    return proc, cgroups


def test_no_cgroup_limit_leaves_mem_available(tmp_path: Path) -> None:
    proc, cgroups = fake(tmp_path, "0::/\n", {"memory.max": "max\n"})
    assert host_bytes_free(proc, cgroups) == 64 * GIB


def test_v2_the_process_cgroup_less_what_it_uses_without_cache(tmp_path: Path) -> None:
    # The root's files hold the host's value without a cgroup namespace: the process's
    # own cgroup, under the mount, holds the limit (s37diff review: only the root was read).
    files = {
        "memory.max": "max\n",
        "pod/box/memory.max": f"{8 * GIB}\n",
        "pod/box/memory.current": f"{3 * GIB}\n",
        "pod/box/memory.stat": f"anon {2 * GIB}\nfile {1 * GIB}\nshmem 0\n",
    }
    proc, cgroups = fake(tmp_path, "0::/pod/box\n", files)
    assert host_bytes_free(proc, cgroups) == 6 * GIB  # 8 less 2 used (1 of cache)
    # Shared memory (/dev/shm: a Ray object store) counts in `file` but is not dropped.
    files["pod/box/memory.stat"] = f"anon {1 * GIB}\nfile {2 * GIB}\nshmem {2 * GIB}\n"
    proc, cgroups = fake(tmp_path / "shm", "0::/pod/box\n", files)
    assert host_bytes_free(proc, cgroups) == 5 * GIB  # 8 less 3 used, none droppable


def test_v2_a_parents_limit_counts(tmp_path: Path) -> None:
    files = {
        "pod/memory.max": f"{4 * GIB}\n",
        "pod/memory.current": f"{1 * GIB}\n",
        "pod/memory.stat": "file 0\n",
        "pod/box/memory.max": "max\n",
    }
    proc, cgroups = fake(tmp_path, "0::/pod/box\n", files)
    assert host_bytes_free(proc, cgroups) == 3 * GIB


def test_v1_the_memory_controllers_cgroup(tmp_path: Path) -> None:
    # As this runner: `4:memory:/process_api/<id>`, the root reading 2^63 less a page.
    files = {
        "memory/memory.limit_in_bytes": "9223372036854771712\n",
        "memory/api/job/memory.limit_in_bytes": f"{24 * GIB}\n",
        "memory/api/job/memory.usage_in_bytes": f"{10 * GIB}\n",
        "memory/api/job/memory.stat": f"cache 1\ntotal_cache {5 * GIB}\ntotal_shmem {GIB}\n",
    }
    cgroup = "9:name=systemd:/\n4:memory:/api/job\n0::/\n"
    proc, cgroups = fake(tmp_path, cgroup, files)
    assert host_bytes_free(proc, cgroups) == 18 * GIB  # 24 less 6 used (4 of cache)
    proc, cgroups = fake(tmp_path / "less", cgroup, files, available_gib=5)
    assert host_bytes_free(proc, cgroups) == 5 * GIB  # MemAvailable, where less


@pytest.mark.parametrize("usage", ["", "junk"])
def test_an_unreadable_usage_leaves_the_limit(tmp_path: Path, usage: str) -> None:
    files = {"box/memory.max": f"{2 * GIB}\n", "box/memory.current": usage}
    proc, cgroups = fake(tmp_path, "0::/box\n", files)
    assert host_bytes_free(proc, cgroups) == 2 * GIB


def test_nothing_readable_is_none(tmp_path: Path) -> None:
    assert host_bytes_free(tmp_path / "none", tmp_path / "none") is None

"""Whether this process runs inside a container, and which kind, from the files a runtime leaves.

    detect_container(root=Path("/")) -> Container | None

Docker creates /.dockerenv in every container; Podman creates /run/.containerenv. Under cgroup v1
the cgroup path of PID 1 names the runtime (/docker/<id>, /kubepods/..., cri-containerd-<id>);
under cgroup v2 that path is just "/", but Docker's bind mount of /etc/hostname still shows
/docker/containers/<id>/ in /proc/self/mountinfo. `root` lets tests point all of this at a fake tree.
WSL2 itself is detected from /proc/version by `worker.memory_probe.detect_platform` (a container on
WSL2 shares the WSL2 kernel, so that check holds inside Docker too).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# (substring of a cgroup line, runtime it names); the first match wins
_CGROUP_MARKS = (
    ("/docker/", "docker"),
    ("docker-", "docker"),
    ("kubepods", "kubernetes"),
    ("containerd", "containerd"),
    ("libpod", "podman"),
)


@dataclass(frozen=True)
class Container:
    runtime: str  # docker | podman | kubernetes | containerd
    evidence: str  # the file that said so


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def detect_container(root: Path = Path("/")) -> Container | None:
    """The container runtime this process runs in, or None on a plain host (or WSL2 distro)."""
    if (root / ".dockerenv").exists():
        return Container("docker", "/.dockerenv")
    if (root / "run" / ".containerenv").exists():
        return Container("podman", "/run/.containerenv")
    for line in _read(root / "proc" / "1" / "cgroup").splitlines():
        for mark, runtime in _CGROUP_MARKS:
            if mark in line:
                return Container(runtime, "/proc/1/cgroup")
    for line in _read(root / "proc" / "self" / "mountinfo").splitlines():
        if "/docker/containers/" in line:
            return Container("docker", "/proc/self/mountinfo")
    return None

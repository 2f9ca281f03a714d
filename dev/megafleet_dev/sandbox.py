"""The real node's Linux sandbox: its network and mount namespaces, the veth link to the host, its
cgroups, and the teardown that removes all of them.

Used by :mod:`megafleet_dev.realnode` to build the node and by :meth:`cluster.LocalCluster.stop`
(so ``megafleet dev down`` and the test fixtures) to take it apart. What was made is written to
``<state>/realnode/sandbox.json`` the moment it exists, so a teardown from another process (or
after a failed start) finds it.

Invariants (the network rule of these machines): traffic goes only to loopback or into the node's
own namespace; the node's netns has no route out (no default route: only its pods, Services, its
own addresses and the host end of its link); no machine-wide kernel setting is changed: the three
global sysctls the kubelet insists on are bind-mounted files inside the node's private mount
namespace, and the only sysctl written (``net.ipv4.ip_forward``) is the node netns's own.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

SANDBOX_FILE = Path("realnode") / "sandbox.json"
CGROUP_ROOT = Path("/sys/fs/cgroup")
CGROUP_CONTROLLERS = ("cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "blkio", "pids", "systemd")
# Hierarchies the node's programs may add cgroups to besides (the hybrid layout's cgroup2 mount).
CGROUP_CLEANED = (*CGROUP_CONTROLLERS, "unified")
# The global sysctls the kubelet checks (and would set): their values as the node sees them.
FAKE_SYSCTLS = {"vm/overcommit_memory": "1", "kernel/panic": "10", "kernel/panic_on_oops": "1"}
# Host folders that containerd, runc, CNI and the kubelet write to by fixed paths: inside the node
# they are private tmpfs mounts, so nothing lands on the host and everything goes with the node.
# (An empty mount point is created on the host where one is missing.)
PRIVATE_TMPFS = ("/run", "/var/lib/cni", "/var/log/containers")

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18


class NodeCommandError(RuntimeError):
    """A command run inside the node's namespaces failed; the message holds its stderr."""


@dataclasses.dataclass
class Sandbox:
    """What exists of one real node outside its processes' own memory."""

    holder_pid: int
    netns_inode: int
    host_link: str
    cgroup: str
    """The node's cgroup parent (e.g. ``/megafleet-node-1a2b``), in every v1 hierarchy."""

    def save(self, state_dir: Path) -> None:
        path = state_dir / SANDBOX_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def load(cls, state_dir: Path) -> Sandbox | None:
        path = state_dir / SANDBOX_FILE
        return cls(**json.loads(path.read_text())) if path.is_file() else None


# -- entering namespaces (run in a child between fork and exec) ----------------------------------


def libc_call(name: str, *args: object) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(*args) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{name}: {os.strerror(errno)}")


def holder_preexec(fakes: dict[str, Path]) -> Callable[[], None]:
    """For the holder process: new network and mount namespaces, mounts made private, a tmpfs on
    each of :data:`PRIVATE_TMPFS`, and each ``/proc/sys/<key>`` in ``fakes`` covered by a bind
    mount of the given file."""
    for folder in PRIVATE_TMPFS:
        Path(folder).mkdir(parents=True, exist_ok=True)

    def enter() -> None:
        libc_call("unshare", CLONE_NEWNET | CLONE_NEWNS)
        libc_call("mount", None, b"/", None, _MS_REC | _MS_PRIVATE, None)
        for folder in PRIVATE_TMPFS:
            libc_call("mount", b"tmpfs", folder.encode(), b"tmpfs", 0, b"mode=755")
        for key, source in fakes.items():
            libc_call("mount", str(source).encode(), f"/proc/sys/{key}".encode(), None, _MS_BIND, None)

    return enter


def enter_preexec(holder_pid: int, cwd: Path) -> Callable[[], None]:
    """For the node's programs: join the holder's network and mount namespaces (so the kubelet's
    volume mounts are the ones runc sees), then ``cwd``."""

    def enter() -> None:
        for kind, flag in (("net", CLONE_NEWNET), ("mnt", CLONE_NEWNS)):
            fd = os.open(f"/proc/{holder_pid}/ns/{kind}", os.O_RDONLY)
            try:
                libc_call("setns", fd, flag)
            finally:
                os.close(fd)
        os.chdir(cwd)

    return enter


def netns_inode(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def in_node(holder_pid: int, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a short command inside the node's namespaces (``ip``, ``sysctl``, ``ctr``)."""
    result = subprocess.run(
        ["nsenter", "-t", str(holder_pid), "-n", "-m", "--", *argv], capture_output=True, text=True, check=False
    )
    if check and result.returncode != 0:
        what = " ".join(argv)
        raise NodeCommandError(f"{what} failed in the node (exit {result.returncode}): {result.stderr.strip()}")
    return result


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], capture_output=True, text=True, check=True)


def connect(holder_pid: int, host_link: str, node_link: str, host_ip: str, node_ip: str, routed: str) -> None:
    """The veth pair host <-> node (a /30), a host route to the pod network ``routed`` through the
    node, and in the node: loopback up and forwarding on. The node has no default route: what is
    not for a pod, a Service, the node or the host end of the link is unreachable."""
    _ip("link", "add", host_link, "type", "veth", "peer", "name", node_link)
    try:
        _ip("link", "set", node_link, "netns", str(holder_pid))
        _ip("addr", "add", f"{host_ip}/30", "dev", host_link)
        _ip("link", "set", host_link, "up")
        for argv in (
            ("ip", "link", "set", "lo", "up"),
            ("ip", "addr", "add", f"{node_ip}/30", "dev", node_link),
            ("ip", "link", "set", node_link, "up"),
            ("sysctl", "-qw", "net.ipv4.ip_forward=1"),
        ):
            in_node(holder_pid, *argv)
        _ip("route", "add", routed, "via", node_ip, "dev", host_link)
    except (subprocess.CalledProcessError, NodeCommandError, OSError):
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "del", host_link)
        raise


def make_cgroups(cgroup: str) -> None:
    """The node's cgroup parent in every v1 hierarchy (cpuset needs its CPUs and memory nodes)."""
    for controller in CGROUP_CONTROLLERS:
        path = CGROUP_ROOT / controller / cgroup.lstrip("/")
        path.mkdir(parents=True, exist_ok=True)
        if controller == "cpuset":
            for name in ("cpuset.cpus", "cpuset.mems"):
                (path / name).write_text((CGROUP_ROOT / controller / name).read_text())


# -- teardown ------------------------------------------------------------------------------------


def _cgroup_dirs(cgroup: str) -> Iterator[Path]:
    """Every cgroup under the node's parent, deepest first, in every hierarchy."""
    for controller in CGROUP_CLEANED:
        top = CGROUP_ROOT / controller / cgroup.lstrip("/")
        if top.is_dir():
            # os.walk passes over folders that vanish while it walks (the kubelet removing a pod's
            # cgroup during a teardown); Path.rglob raised FileNotFoundError there.
            below = [Path(folder) for folder, _, _ in os.walk(top)][1:]
            yield from sorted(below, key=lambda p: -len(p.parts))
            yield top


def _pids_in_cgroups(cgroup: str) -> set[int]:
    pids: set[int] = set()
    for folder in _cgroup_dirs(cgroup):
        with contextlib.suppress(OSError):
            pids |= {int(line) for line in (folder / "cgroup.procs").read_text().split()}
    return pids


def _pids_in_netns(inode: int) -> set[int]:
    found: set[int] = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(entry / "ns" / "net").st_ino == inode:
                    found.add(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    """False for a zombie (dead, waiting for its parent to reap it) or a process that is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill_all(pids: Callable[[], set[int]], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = {pid for pid in pids() - {os.getpid()} if _alive(pid)}
        if not left:
            return
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)
        time.sleep(0.1)


def teardown(state_dir: Path) -> None:
    """Remove everything the real node of ``state_dir`` made: the containers and pods (every
    process in its cgroups), every process in its netns (containerd, its shims, the kubelet,
    kube-proxy, CoreDNS, the holder; the namespaces and their mounts die with the last one), the
    host link and route, and its cgroups. Idempotent; does nothing when there is no real node."""
    box = Sandbox.load(state_dir)
    if box is None:
        return
    _kill_all(lambda: _pids_in_cgroups(box.cgroup))
    if box.netns_inode != netns_inode(os.getpid()):  # never the host's own namespace
        _kill_all(lambda: _pids_in_netns(box.netns_inode))
    with contextlib.suppress(subprocess.CalledProcessError):
        _ip("link", "del", box.host_link)
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        for folder in _cgroup_dirs(box.cgroup):
            with contextlib.suppress(OSError):
                folder.rmdir()
        if not any(True for _ in _cgroup_dirs(box.cgroup)):
            break
        time.sleep(0.1)
    (state_dir / SANDBOX_FILE).unlink()


def leftovers(box: Sandbox) -> list[str]:
    """What of ``box`` still exists (empty after a teardown): for ``dev down``'s check and the tests."""
    pids = _pids_in_cgroups(box.cgroup) | _pids_in_netns(box.netns_inode)
    left = [f"process {pid}" for pid in sorted(pids) if _alive(pid)]
    left += [f"cgroup {folder}" for folder in _cgroup_dirs(box.cgroup)]
    if Path(f"/sys/class/net/{box.host_link}").exists():
        left.append(f"link {box.host_link}")
    return left

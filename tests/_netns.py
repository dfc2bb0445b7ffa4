"""A small lab of "hosts" on this machine: Linux network namespaces joined by veth pairs to a bridge.

    with NetnsLab(["head", "node1", "node2"]) as lab:      # 10.77.0.1, .2, .3 on a private /24
        lab.popen("node1", ["ray", "start", ...])           # runs inside node1's namespace, hostname "node1"
        lab.cut("node2")                                    # pull node2's cable (its switch port goes down)

Everything lives in namespaces this lab creates: the bridge ("switch") sits in a namespace of its own, each
host's veth pair is created directly between the switch namespace and the host namespace, so the root
namespace's interfaces, routes and firewall are never touched and no host namespace has a default route
(traffic can only go to loopback and to the lab's own addresses). Each host also gets its own hostname (a UTS
namespace per process tree), so code that identifies a node by `socket.gethostname()` sees distinct hosts.

Cleanup is guaranteed on every exit path (exceptions, KeyboardInterrupt, interpreter exit through atexit):
every process in each namespace is SIGKILLed (`ip netns pids`), then the namespaces are deleted (which deletes
their veths and the bridge). Namespaces left by a lab whose process died without cleaning up (kill -9) are
removed by the next lab (names carry the owner's pid).
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from typing import Sequence

PREFIX = "rsmn"
IFNAME = "mn0"  # the interface name inside every host namespace (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)
_NAME_RE = re.compile(rf"^{PREFIX}(\d+)-")
ETC_NETNS = "/etc/netns"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip() or r.stdout.strip()}")
    return r


def available() -> str | None:
    """None when a lab can be built here, else the reason it cannot (for pytest.skip)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed: apt-get install iproute2"
    if shutil.which("unshare") is None:
        return "`unshare` (util-linux) is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"`ip netns add` does not work here: {r.stderr.strip()}"
    try:
        r = _ip("-n", probe, "link", "add", "vprobe0", "type", "veth", "peer", "name", "vprobe1", check=False)
        if r.returncode != 0:
            return f"veth pairs cannot be created here: {r.stderr.strip()}"
        r = _ip("-n", probe, "link", "add", "brprobe", "type", "bridge", check=False)
        if r.returncode != 0:
            return f"bridges cannot be created here: {r.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def _pids(ns: str) -> list[int]:
    r = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in r.stdout.split()] if r.returncode == 0 else []


def _kill_namespace(ns: str, wait_s: float = 10.0) -> None:
    """SIGKILL every process in the namespace (repeatedly: a dying process may have just forked), then delete it."""
    deadline = time.time() + wait_s
    while True:
        pids = _pids(ns)
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not pids or time.time() > deadline:
            break
        time.sleep(0.2)
    _ip("netns", "del", ns, check=False)


def _rmdir_if_empty(path: str) -> None:
    try:
        os.rmdir(path)  # only when empty (it usually did not exist before)
    except OSError:
        pass


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Delete namespaces left by labs whose owning process is gone."""
    r = _ip("netns", "list", check=False)
    removed = []
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = _NAME_RE.match(name)
        if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            _kill_namespace(name)
            shutil.rmtree(os.path.join(ETC_NETNS, name), ignore_errors=True)
            removed.append(name)
    if os.path.isdir(ETC_NETNS):
        for name in os.listdir(ETC_NETNS):
            m = _NAME_RE.match(name)
            if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
                shutil.rmtree(os.path.join(ETC_NETNS, name), ignore_errors=True)
        _rmdir_if_empty(ETC_NETNS)
    return removed


class NetnsLab:
    """Hosts in network namespaces on 10.77.0.0/24 (by default), joined by a bridge in a switch namespace."""

    def __init__(self, hosts: Sequence[str], subnet: str = "10.77.0", tag: str | None = None):
        if len(set(hosts)) != len(hosts) or not hosts:
            raise ValueError(f"host names must be unique and non-empty: {hosts}")
        self.tag = tag or f"{PREFIX}{os.getpid()}"
        if not _NAME_RE.match(self.tag + "-"):
            raise ValueError(f"tag {self.tag!r} must look like {PREFIX}<pid>")
        self.hosts = list(hosts)
        self.switch = f"{self.tag}-sw"
        self.ns = {h: f"{self.tag}-{i}" for i, h in enumerate(self.hosts, start=1)}
        self.ip = {h: f"{subnet}.{i}" for i, h in enumerate(self.hosts, start=1)}
        self._created: list[str] = []
        self._etc: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._closed = False
        self._old_term = None

    # ------------------------------------------------------------ lifecycle
    def __enter__(self) -> "NetnsLab":
        remove_stale()
        atexit.register(self.close)
        # SIGTERM (a CI timeout, `kill`) would end the interpreter without running finally blocks or atexit.
        self._old_term = None
        if threading.current_thread() is threading.main_thread():
            old = signal.signal(signal.SIGTERM, _raise_exit)
            self._old_term = old if old is not None else signal.SIG_DFL
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._created.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def _build(self) -> None:
        self._add_ns(self.switch)
        # `ip netns exec NS` bind-mounts /etc/netns/NS/hosts over /etc/hosts: each host resolves the lab's names
        # (its own hostname included) like a machine on a real cluster network.
        hosts = "127.0.0.1 localhost\n" + "".join(f"{self.ip[h]} {h}\n" for h in self.hosts)
        for h in self.hosts:
            d = os.path.join(ETC_NETNS, self.ns[h])
            os.makedirs(d, exist_ok=True)
            self._etc.append(d)
            with open(os.path.join(d, "hosts"), "w") as fh:
                fh.write(hosts)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, h in enumerate(self.hosts, start=1):
            ns = self.ns[h]
            self._add_ns(ns)
            port = f"p{i}"
            # Both ends are created directly inside their namespaces: nothing appears in the root namespace.
            _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", IFNAME, "netns", ns)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{self.ip[h]}/24", "dev", IFNAME)
            _ip("-n", ns, "link", "set", IFNAME, "up")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for p in self._procs:  # our direct children first (their own process groups)
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for ns in reversed(self._created):
            _kill_namespace(ns)
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._created.clear()
        for d in self._etc:
            shutil.rmtree(d, ignore_errors=True)
        self._etc.clear()
        _rmdir_if_empty(ETC_NETNS)
        try:
            atexit.unregister(self.close)
        except Exception:
            pass
        if self._old_term is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None

    # ------------------------------------------------------------ running things
    def wrap(self, host: str, cmd: Sequence[str]) -> list[str]:
        """cmd run inside host's network namespace, in a UTS namespace whose hostname is the host name."""
        return ["ip", "netns", "exec", self.ns[host], "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', host, *cmd]

    def popen(self, host: str, cmd: Sequence[str], **kw) -> subprocess.Popen:
        kw.setdefault("start_new_session", True)
        p = subprocess.Popen(self.wrap(host, cmd), **kw)
        self._procs.append(p)
        return p

    def run(self, host: str, cmd: Sequence[str], **kw) -> subprocess.CompletedProcess:
        kw.setdefault("start_new_session", True)
        return subprocess.run(self.wrap(host, cmd), **kw)

    def pids(self, host: str) -> list[int]:
        return _pids(self.ns[host])

    # ------------------------------------------------------------ faults
    def cut(self, host: str) -> None:
        """Pull the host's cable: its switch port goes down (the host keeps running, unreachable)."""
        _ip("-n", self.switch, "link", "set", f"p{self.hosts.index(host) + 1}", "down")

    def reconnect(self, host: str) -> None:
        _ip("-n", self.switch, "link", "set", f"p{self.hosts.index(host) + 1}", "up")

    def kill_host(self, host: str) -> None:
        """Power the host off: every process in its namespace is killed."""
        for p in _pids(self.ns[host]):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def namespaces(self) -> list[str]:
        return list(self._created)

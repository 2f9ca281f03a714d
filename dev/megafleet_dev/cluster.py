"""A real Kubernetes control plane on loopback: etcd, kube-apiserver, controller-manager, scheduler,
and KWOK simulating GPU nodes.

Used by ``megafleet dev up|down|status`` (:mod:`megafleet_dev.cli`) and by the pytest fixtures in
``tests/conftest.py``. Every process listens on 127.0.0.1 on a free port, is started in its own
process session (so ``dev up`` can return and leave it running) and is stopped by the PID recorded in
``state.json``, after checking that the PID still runs the program we started. kube-scheduler and
kube-controller-manager run under :mod:`megafleet_dev.supervise`, which restarts them when they exit
(as a kubelet restarts a real control plane's static pods); the chaos drills restart etcd and
kube-apiserver themselves (:meth:`LocalCluster.restart`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import ipaddress
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from megafleet_dev import kube, nodes, pki, progress, sandbox, toolchain

ADMIN_TOKEN_USER = "megafleet-admin"
KUBELET_CLIENT_USER = "megafleet:apiserver-kubelet-client"  # bound to system:kubelet-api-admin by the real node
FRONT_PROXY_USER = "front-proxy-client"
SERVICE_CIDR = "10.96.0.0/16"  # ClusterIPs are data only: nothing ever connects to them.
START_TIMEOUT_SECONDS = 120.0  # generous: two shared cores also run the test suite
STOP_TIMEOUT_SECONDS = 15.0
STATE_FILE = "state.json"


class ClusterError(RuntimeError):
    """The local control plane could not start or be reached; the message names the log to read."""


@dataclasses.dataclass
class ProcessRecord:
    """One started program: enough to find and stop it from another process later."""

    name: str
    pid: int
    argv: list[str]
    log: str

    def alive(self) -> bool:
        """True while ``pid`` still runs our program (guards against PID reuse)."""
        try:
            cmdline = Path(f"/proc/{self.pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        if not _not_zombie(self.pid):
            return False
        # The command line reads empty for an instant while a process execs: that is still ours.
        return cmdline == [b""] or cmdline[0].decode(errors="replace") == self.argv[0]


def _not_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@dataclasses.dataclass
class ClusterState:
    """What ``state.json`` records about a running cluster."""

    state_dir: str
    kubeconfig: str
    api_server: str
    pod_network: str
    pools: list[str]
    processes: list[ProcessRecord]

    def save(self) -> None:
        path = Path(self.state_dir) / STATE_FILE
        path.write_text(json.dumps(dataclasses.asdict(self), indent=2))

    @classmethod
    def load(cls, state_dir: Path) -> ClusterState | None:
        path = state_dir / STATE_FILE
        if not path.is_file():
            return None
        raw = json.loads(path.read_text())
        raw["processes"] = [ProcessRecord(**record) for record in raw["processes"]]
        return cls(**raw)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class LocalCluster:
    """Start, inspect and stop one local control plane whose files live in ``state_dir``."""

    def __init__(
        self,
        state_dir: Path,
        *,
        pools: tuple[nodes.NodePool, ...] = nodes.DEFAULT_POOLS,
        pod_network: str = "127.64.0.0/12",
        report: progress.Progress = progress.print_progress,
        apiserver_args: tuple[str, ...] = (),
        controllers: str = "*",
    ) -> None:
        """``apiserver_args``: more kube-apiserver flags (the control-plane benchmark's audit log);
        ``controllers``: kube-controller-manager's ``--controllers`` (a benchmark's diagnostic runs)."""
        self.state_dir = state_dir
        self.apiserver_args = apiserver_args
        self.controllers = controllers
        self.pools = pools
        self.pod_network = ipaddress.IPv4Network(pod_network)
        self.report = report
        self._records: list[ProcessRecord] = []
        # How to tell each control-plane program is serving again, for :meth:`restart`.
        self._ready_checks: dict[str, Callable[[], str | None]] = {}
        # Our own children, kept so they are reaped by wait() rather than left to the GC.
        self._children: dict[int, subprocess.Popen[bytes]] = {}

    # -- paths ---------------------------------------------------------------------------------

    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / "kubeconfig"

    @property
    def ca_file(self) -> Path:
        return self.state_dir / "pki" / "apiserver.crt"

    @property
    def token_file(self) -> Path:
        return self.state_dir / "admin-token"

    @property
    def client_ca(self) -> Path:
        """The CA (``.crt``/``.key``) whose client certificates the API server accepts (the real node's)."""
        return self.state_dir / "pki" / "client-ca"

    @property
    def front_proxy_ca(self) -> Path:
        """The CA (``.crt``/``.key``) of the aggregation layer's front-proxy client certificate."""
        return self.state_dir / "pki" / "front-proxy-ca"

    @property
    def api_port(self) -> int:
        state = ClusterState.load(self.state_dir)
        if state is None or not state.api_server:
            raise ClusterError(f"no running cluster in {self.state_dir}")
        return int(state.api_server.rsplit(":", 1)[1])

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> ClusterState:
        """Build what is missing, start every component, create the nodes and wait until Ready."""
        existing = ClusterState.load(self.state_dir)
        if existing is not None and any(record.alive() for record in existing.processes):
            raise ClusterError(
                f"a cluster is already running from {self.state_dir}; stop it first (megafleet dev down)"
            )
        toolchain.ensure_built(("etcd", "kubernetes", "kwok"), report=self.report)
        started = time.monotonic()
        self._prepare_state_dir()
        try:
            api_port = self._start_etcd_and_apiserver()
            self._start_controllers()
            self._start_kwok()
            state = self._record_state(api_port)
            self._create_nodes()
        except BaseException:
            self.stop()
            raise
        self.report(
            f"control plane ready in {time.monotonic() - started:.1f} s: "
            f"{sum(pool.node_count for pool in self.pools)} simulated nodes, kubeconfig {self.kubeconfig}"
        )
        return state

    def stop(self) -> None:
        """Stop every process this cluster started (in reverse start order), by PID; a real node's
        containers, namespace, network links and cgroups go first (:func:`sandbox.teardown`)."""
        sandbox.teardown(self.state_dir)
        state = ClusterState.load(self.state_dir)
        records = list(self._records) or (state.processes if state else [])
        for record in reversed(records):
            child = self._children.pop(record.pid, None)
            if child is not None:
                _stop_child(child)
            else:
                _terminate(record)
        self._records = []

    def restart(self, name: str, *, down_seconds: float = 0.0) -> float:
        """Kill control-plane program ``name`` (``etcd``, ``kube-apiserver``) with SIGKILL, keep it down
        ``down_seconds``, start it again with the same arguments (same ports, etcd's data kept) and
        wait until it serves; returns the seconds it was unavailable. For the chaos drills
        (``tests/chaos``); only a cluster this object started can be restarted."""
        record = next(r for r in reversed(self._records) if r.name == name)
        child = self._children.pop(record.pid)
        killed = time.monotonic()
        child.kill()
        child.wait()
        index = self._records.index(record)
        self._records.remove(record)
        time.sleep(down_seconds)  # the outage the caller asked for
        self.spawn(name, record.argv)
        self._records.insert(index, self._records.pop())  # keep the stop order (reverse start order)
        self._wait(name, self._ready_checks[name])
        return time.monotonic() - killed

    def stop_processes(self, records: list[ProcessRecord]) -> None:
        """Stop some of this cluster's processes before the rest (Prometheus and KEDA at the end of
        their tests, :mod:`megafleet_dev.autoscale`), last started first, and forget them."""
        for record in reversed(records):
            child = self._children.pop(record.pid, None)
            if child is not None:
                _stop_child(child)
            else:
                _terminate(record)
        pids = {record.pid for record in records}
        self._records = [record for record in self._records if record.pid not in pids]
        saved = ClusterState.load(self.state_dir)
        if saved is not None:
            saved.processes = [record for record in saved.processes if record.pid not in pids]
            saved.save()

    # -- components ----------------------------------------------------------------------------

    def _prepare_state_dir(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        for sub in ("logs", "pki", "etcd", "certs"):
            (self.state_dir / sub).mkdir(exist_ok=True)
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        (self.state_dir / "sa.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.TraditionalOpenSSL,
                serialization.NoEncryption(),
            )
        )
        token = os.urandom(24).hex()
        self.token_file.write_text(token)
        os.chmod(self.token_file, 0o600)
        (self.state_dir / "tokens.csv").write_text(f'{token},{ADMIN_TOKEN_USER},{ADMIN_TOKEN_USER},"system:masters"\n')
        # Client certificates, as a real cluster's nodes use: the API server trusts this CA, and
        # calls kubelets with a certificate of its own (the real node's kubelet trusts the CA too).
        pki.make_ca(self.client_ca)
        pki.issue(self.client_ca, self.state_dir / "pki" / "apiserver-kubelet-client", KUBELET_CLIENT_USER)
        # The aggregation layer's front proxy: the API server forwards requests for aggregated APIs
        # (KEDA's external.metrics.k8s.io, megafleet_dev.autoscale) with this certificate and the
        # user in headers, which the extension server trusts through this CA.
        pki.make_ca(self.front_proxy_ca, common_name="megafleet-dev-front-proxy-ca")
        pki.issue(self.front_proxy_ca, self.state_dir / "pki" / "front-proxy-client", FRONT_PROXY_USER)

    def _start_etcd_and_apiserver(self) -> int:
        client_port, peer_port = free_port(), free_port()
        etcd = toolchain.program_path("etcd")
        self.spawn(
            "etcd",
            [
                str(etcd),
                "--name=node0",
                f"--data-dir={self.state_dir / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{client_port}",
                f"--advertise-client-urls=http://127.0.0.1:{client_port}",
                f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-cluster=node0=http://127.0.0.1:{peer_port}",
                "--unsafe-no-fsync=true",
                "--auto-compaction-retention=1",
                "--quota-backend-bytes=8589934592",
                "--log-level=warn",
            ],
        )
        self._ready_checks["etcd"] = functools.partial(http_not_ok, f"http://127.0.0.1:{client_port}/health")
        self._wait("etcd", self._ready_checks["etcd"])

        api_port = free_port()
        sa_key = self.state_dir / "sa.key"
        self.spawn(
            "kube-apiserver",
            [
                str(toolchain.program_path("kube-apiserver")),
                f"--etcd-servers=http://127.0.0.1:{client_port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={api_port}",
                f"--cert-dir={self.state_dir / 'pki'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                f"--service-account-issuer=https://127.0.0.1:{api_port}/",
                f"--service-account-key-file={sa_key}",
                f"--service-account-signing-key-file={sa_key}",
                f"--token-auth-file={self.state_dir / 'tokens.csv'}",
                f"--client-ca-file={self.client_ca.with_suffix('.crt')}",
                f"--kubelet-client-certificate={self.state_dir / 'pki' / 'apiserver-kubelet-client.crt'}",
                f"--kubelet-client-key={self.state_dir / 'pki' / 'apiserver-kubelet-client.key'}",
                f"--requestheader-client-ca-file={self.front_proxy_ca.with_suffix('.crt')}",
                f"--requestheader-allowed-names={FRONT_PROXY_USER}",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                f"--proxy-client-cert-file={self.state_dir / 'pki' / 'front-proxy-client.crt'}",
                f"--proxy-client-key-file={self.state_dir / 'pki' / 'front-proxy-client.key'}",
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                # Reach kubelets (the real node's) by their InternalIP, never by a DNS lookup.
                "--kubelet-preferred-address-types=InternalIP",
                "--allow-privileged=true",
                # Endpoints may not hold loopback addresses, so the 'kubernetes' Service has none.
                "--endpoint-reconciler-type=none",
                "--profiling=false",
                *self.apiserver_args,
            ],
        )
        self._ready_checks["kube-apiserver"] = functools.partial(
            http_not_ok, f"https://127.0.0.1:{api_port}/readyz?verbose", verify=str(self.ca_file)
        )
        self._wait("kube-apiserver", self._ready_checks["kube-apiserver"])
        self._write_kubeconfig(api_port)
        return api_port

    def _start_controllers(self) -> None:
        kubeconfig = str(self.kubeconfig)
        common = [
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1",
            "--leader-elect=false",
        ]
        kcm_port, scheduler_port = free_port(), free_port()
        # Both run under a supervisor that restarts them when they exit, as a kubelet restarts the
        # static pods of a real control plane: kube-scheduler exits on purpose when an event
        # contradicts its cache (after a watch gap across an etcd restart, see megafleet_dev.supervise).
        supervised = [sys.executable, "-m", "megafleet_dev.supervise"]
        self.spawn(
            "kube-controller-manager",
            [
                *supervised,
                str(toolchain.program_path("kube-controller-manager")),
                *common,
                f"--secure-port={kcm_port}",
                f"--cert-dir={self.state_dir / 'certs' / 'kcm'}",
                f"--service-account-private-key-file={self.state_dir / 'sa.key'}",
                f"--root-ca-file={self.ca_file}",
                f"--controllers={self.controllers}",
                "--use-service-account-credentials=false",
                "--kube-api-qps=200",
                "--kube-api-burst=400",
            ],
        )
        self.spawn(
            "kube-scheduler",
            [
                *supervised,
                str(toolchain.program_path("kube-scheduler")),
                *common,
                f"--secure-port={scheduler_port}",
                f"--cert-dir={self.state_dir / 'certs' / 'scheduler'}",
            ],
        )
        for name, port in (("kube-controller-manager", kcm_port), ("kube-scheduler", scheduler_port)):
            self._wait(name, functools.partial(http_not_ok, f"https://127.0.0.1:{port}/healthz", verify=False))

    def _start_kwok(self) -> None:
        port = free_port()
        self.spawn(
            "kwok",
            [
                str(toolchain.program_path("kwok")),
                f"--kubeconfig={self.kubeconfig}",
                f"--config={toolchain.program_path('kwok.yaml')}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={nodes.KWOK_ANNOTATION}=fake",
                # Fallback only: every node carries its own loopback podCIDR.
                f"--cidr={self.pod_network}",
                "--node-ip=127.0.0.1",
                f"--server-address=127.0.0.1:{port}",
                "--node-lease-duration-seconds=40",
            ],
        )
        self._wait("kwok", functools.partial(http_not_ok, f"http://127.0.0.1:{port}/healthz"))

    def _create_nodes(self) -> None:
        manifests = nodes.node_manifests(self.pools, self.pod_network)
        self.report(f"creating {len(manifests)} simulated nodes ({', '.join(map(str, self.pools))})")
        with self.kube() as client:
            for manifest in manifests:
                client.create("/api/v1/nodes", manifest)
            self._wait("simulated nodes", functools.partial(_nodes_not_ready, client, len(manifests)))

    # -- helpers -------------------------------------------------------------------------------

    def kube(self) -> kube.Kube:
        """An admin client for this cluster's API server."""
        return kube.Kube.from_kubeconfig(self.kubeconfig)

    def _write_kubeconfig(self, api_port: int) -> None:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "megafleet-dev",
                    "cluster": {"server": f"https://127.0.0.1:{api_port}", "certificate-authority": str(self.ca_file)},
                }
            ],
            "users": [{"name": ADMIN_TOKEN_USER, "user": {"token": self.token_file.read_text().strip()}}],
            "contexts": [{"name": "megafleet-dev", "context": {"cluster": "megafleet-dev", "user": ADMIN_TOKEN_USER}}],
            "current-context": "megafleet-dev",
        }
        self.kubeconfig.write_text(json.dumps(config, indent=2))
        os.chmod(self.kubeconfig, 0o600)

    def _record_state(self, api_port: int) -> ClusterState:
        state = ClusterState(
            state_dir=str(self.state_dir),
            kubeconfig=str(self.kubeconfig),
            api_server=f"https://127.0.0.1:{api_port}",
            pod_network=str(self.pod_network),
            pools=[str(pool) for pool in self.pools],
            processes=self._records,
        )
        state.save()
        return state

    def spawn(
        self,
        name: str,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        preexec_fn: Callable[[], None] | None = None,
    ) -> ProcessRecord:
        """Start another long-running process that belongs to this cluster (the operator, the pod
        runner, the real node's programs); ``stop`` and ``megafleet dev down`` stop it with the rest.
        ``preexec_fn`` runs in the child before exec (the real node enters its namespaces there, so
        ``argv[0]`` stays the program that runs and the PID check in :meth:`ProcessRecord.alive` holds)."""
        log = self.state_dir / "logs" / f"{name}.log"
        self.report(f"starting {name}")
        with log.open("ab") as sink:
            proc = subprocess.Popen(
                argv,
                stdout=sink,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=self.state_dir,
                env=env,
                preexec_fn=preexec_fn,
            )
        self._children[proc.pid] = proc
        record = ProcessRecord(name=name, pid=proc.pid, argv=argv, log=str(log))
        self._records.append(record)
        # Keep the state on disk at once, so 'dev down' can clean up even after a failed start.
        saved = ClusterState.load(self.state_dir)
        ClusterState(
            str(self.state_dir),
            str(self.kubeconfig),
            saved.api_server if saved else "",
            str(self.pod_network),
            [str(pool) for pool in self.pools],
            self._records,
        ).save()
        return record

    def wait_for(self, what: str, not_ready: Callable[[], str | None]) -> None:
        """Wait until ``not_ready`` returns None (it returns why not), failing if ``what`` exits."""
        self._wait(what, not_ready)

    def _wait(self, what: str, not_ready: Callable[[], str | None]) -> None:
        """Poll ``not_ready`` (None means ready, else why not) for a process that offers no watch."""
        started = time.monotonic()
        deadline = started + START_TIMEOUT_SECONDS
        next_report = started + 15.0
        record = next((r for r in reversed(self._records) if r.name == what), None)
        reason: str | None = "not checked yet"
        while time.monotonic() < deadline:
            if record is not None and not record.alive():
                raise ClusterError(f"{what} exited during start-up; see {record.log}:\n{_tail(record.log)}")
            reason = not_ready()
            if reason is None:
                return
            if time.monotonic() >= next_report:
                self.report(f"still waiting for {what} ({time.monotonic() - started:.0f} s): {reason}")
                next_report += 15.0
            time.sleep(0.2)
        log = record.log if record else self.state_dir / "logs"
        raise ClusterError(f"{what} was not ready after {START_TIMEOUT_SECONDS:.0f} s ({reason}); see {log}")


def http_not_ok(url: str, *, verify: bool | str = True) -> str | None:
    """None when ``url`` answers 200, else a short reason (status and body, or the error): the
    readiness probe of every component the dev cluster starts (:meth:`LocalCluster.wait_for`)."""
    try:
        context = ssl.create_default_context(cafile=verify) if isinstance(verify, str) else verify
        response = httpx.get(url, verify=context, timeout=2.0)
    except (httpx.HTTPError, OSError) as error:  # OSError: the serving certificate is not written yet
        return f"{type(error).__name__}: {error}"
    if response.status_code == 200:
        return None
    return f"HTTP {response.status_code}: {response.text[-500:]}"


def _nodes_not_ready(client: kube.Kube, expected: int) -> str | None:
    items = client.list("/api/v1/nodes", label_selector="type=kwok")["items"]
    ready = sum(1 for item in items if (kube.condition(item, "Ready") or {}).get("status") == "True")
    return None if ready >= expected else f"{ready} of {expected} nodes Ready"


def _tail(path: str, lines: int = 20) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _stop_child(child: subprocess.Popen[bytes]) -> None:
    """Stop a process this object started: SIGTERM, then SIGKILL after the grace period."""
    if child.poll() is not None:
        return
    child.terminate()
    try:
        child.wait(timeout=STOP_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def _terminate(record: ProcessRecord) -> None:
    """Stop a process another invocation started (``megafleet dev down``), by its recorded PID."""
    if not record.alive():
        return
    try:
        os.kill(record.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + STOP_TIMEOUT_SECONDS
    while time.monotonic() < deadline and record.alive():
        _reap(record.pid)
        time.sleep(0.1)
    if record.alive():
        os.kill(record.pid, signal.SIGKILL)
        while record.alive():
            _reap(record.pid)
            time.sleep(0.05)
    _reap(record.pid)


def _reap(pid: int) -> None:
    """Collect our own child's exit status so it does not linger as a zombie."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def running_processes(state_dir: Path) -> Iterator[ProcessRecord]:
    state = ClusterState.load(state_dir)
    for record in state.processes if state else []:
        if record.alive():
            yield record

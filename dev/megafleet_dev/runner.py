"""The local pod runner: makes engine pods on KWOK nodes real processes bound to their pod IPs.

Development and test tooling only (never in an image). KWOK marks pods Running without running
anything; this runner watches pods labelled ``megafleet.dev/component=engine`` that ask for no GPU
and, once such a pod is Running with a (loopback) pod IP, starts its container command as a local process with the pod's
environment: ``fieldRef`` values are resolved, Secret volumes and ``secretKeyRef`` values are read
from the API and written to a private folder, and the shard's master address (a headless-Service
DNS name) is mapped to pod 0's IP. A deleted pod's process is stopped, and a deleted pod that a
finalizer keeps (Kueue's, on the pods of a queued fleet) is then reported Failed, as a kubelet ends a
deleted pod's phase (KWOK would leave it Running, and its finalizer's owner waiting); one that exits makes its pod
Failed with the engine's termination message in its container status, as a kubelet reports it (the
engine writes it to ``MEGAFLEET_TERMINATION_LOG``, a file of the pod's folder here). Pods of the real
node (routable pod IPs) are left to its kubelet. Started by
``megafleet dev up`` and by the end-to-end test fixtures.
"""

from __future__ import annotations

import base64
import dataclasses
import ipaddress
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from megafleet_dev import kube
from megafleet_protocol import env as pod_env

log = logging.getLogger(__name__)

ENGINE_SELECTOR = "megafleet.dev/component=engine"
STOP_SECONDS = 10.0
TERMINATION_MESSAGE_BYTES = 4096
"""What a kubelet keeps of a container's termination message."""


@dataclasses.dataclass
class _Process:
    uid: str
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    termination_log: Path


class Runner:
    """Watch engine pods and keep one local process per Running pod."""

    def __init__(self, client: kube.Kube, workdir: Path, *, python: str = sys.executable) -> None:
        self.client = client
        self.workdir = workdir
        self.python = python
        self.processes: dict[str, _Process] = {}  # by pod uid
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._loop, name="megafleet-runner", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for uid in list(self.processes):
            self._kill(uid)

    def log_of(self, pod_name: str) -> str:
        for process in self.processes.values():
            if process.name == pod_name:
                return process.log.read_text(errors="replace")
        return ""

    # -- watching ------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._sync_once()
            except Exception:  # the runner must outlive API hiccups; the next pass retries
                log.exception("runner pass failed")
            self._stop.wait(0.5)  # a polling loop in test tooling; pods are few

    def _sync_once(self) -> None:
        pods = self.client.list("/api/v1/pods", label_selector=ENGINE_SELECTOR)["items"]
        live = {}
        for pod in pods:
            uid = pod["metadata"]["uid"]
            running = pod.get("status", {}).get("phase") == "Running" and pod["status"].get("podIP")
            # A pod of the real node (a routable pod IP) runs in a real container: not ours.
            if running and not ipaddress.ip_address(pod["status"]["podIP"]).is_loopback:
                continue
            if pod["metadata"].get("deletionTimestamp") and running and pod["metadata"].get("finalizers"):
                self._report_deleted(pod)
            if pod["metadata"].get("deletionTimestamp") or not running or _wants_gpus(pod):
                continue
            live[uid] = pod
        for uid in list(self.processes):
            if uid not in live:
                self._kill(uid)
        for uid, pod in live.items():
            process = self.processes.get(uid)
            if process is None:
                self._launch(pod, pods)
            elif process.popen.poll() is not None:
                self._report_exit(pod, process)

    # -- processes -----------------------------------------------------------------------------

    def _launch(self, pod: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        namespace, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        container = pod["spec"]["containers"][0]
        folder = self.workdir / namespace / name
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        mounts = self._materialise_volumes(pod, container, folder)
        env = self._environment(pod, container, pods, mounts)
        termination_log = Path(env.setdefault(pod_env.TERMINATION_LOG, str(folder / "termination-log")))
        termination_log.touch()  # the kubelet makes it empty; the engine writes why it exited
        command = [*container.get("command", []), *container.get("args", [])]
        if command and command[0] == "megafleet-engine":
            command = [self.python, "-m", "megafleet_engine.cli", *command[1:]]
        log_path = folder / "engine.log"
        with log_path.open("wb") as sink:
            popen = subprocess.Popen(
                command,
                env=env,
                stdout=sink,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=folder,
                start_new_session=True,
            )
        self.processes[pod["metadata"]["uid"]] = _Process(
            pod["metadata"]["uid"], name, popen, log_path, termination_log
        )
        log.info("started %s/%s as pid %d on %s", namespace, name, popen.pid, pod["status"]["podIP"])

    def _materialise_volumes(self, pod: dict[str, Any], container: dict[str, Any], folder: Path) -> dict[str, Path]:
        """Secret volumes become files in ``folder``; returns mount path -> local folder."""
        namespace = pod["metadata"]["namespace"]
        volumes = {volume["name"]: volume for volume in pod["spec"].get("volumes", [])}
        mounts: dict[str, Path] = {}
        for mount in container.get("volumeMounts", []):
            volume = volumes.get(mount["name"], {})
            local = folder / "volumes" / mount["name"]
            local.mkdir(parents=True, exist_ok=True)
            if "secret" in volume:
                secret = self.client.get(f"/api/v1/namespaces/{namespace}/secrets/{volume['secret']['secretName']}")
                for key, value in ((secret or {}).get("data") or {}).items():
                    (local / key).write_bytes(base64.b64decode(value))
                    os.chmod(local / key, 0o600)
            mounts[mount["mountPath"]] = local
        return mounts

    def _environment(
        self, pod: dict[str, Any], container: dict[str, Any], pods: list[dict[str, Any]], mounts: dict[str, Path]
    ) -> dict[str, str]:
        env = {key: value for key, value in os.environ.items() if not key.startswith("MEGAFLEET_")}
        namespace = pod["metadata"]["namespace"]
        defined: dict[str, str] = {}  # the container's own variables, which $(NAME) may refer to
        for item in container.get("env", []):
            value = expand(item.get("value", ""), defined)
            source = item.get("valueFrom", {})
            if "fieldRef" in source:
                value = _field(pod, source["fieldRef"]["fieldPath"])
            elif "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                secret = self.client.get(f"/api/v1/namespaces/{namespace}/secrets/{ref['name']}") or {}
                value = base64.b64decode((secret.get("data") or {}).get(ref["key"], "")).decode()
            env[item["name"]] = defined[item["name"]] = _local_path(value, mounts)
        master = env.get("MEGAFLEET_MASTER_ADDR", "")
        env["MEGAFLEET_MASTER_ADDR"] = _resolve(master, namespace, pods) or master
        return env

    def _report_exit(self, pod: dict[str, Any], process: _Process) -> None:
        """An engine that exited makes its pod Failed, as a kubelet would report it: the container
        terminated, with its exit code and termination message."""
        code = process.popen.returncode
        self.processes.pop(process.uid)
        namespace, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        status = status_patch(pod, exit_status(pod, code, process.termination_log))
        try:
            self.client.patch(f"/api/v1/namespaces/{namespace}/pods/{name}/status", status)
        except kube.KubeError:
            log.exception("could not report the exit of %s/%s", namespace, name)

    def _report_deleted(self, pod: dict[str, Any]) -> None:
        """Stop a deleted pod's process and end its phase (Failed), as a kubelet does before the pod
        goes: what the finalizer's owner waits for."""
        uid, namespace, name = pod["metadata"]["uid"], pod["metadata"]["namespace"], pod["metadata"]["name"]
        if uid in self.processes:
            self._kill(uid)
        status = status_patch(pod, {"phase": "Failed", "reason": "Terminated", "message": "the pod was deleted"})
        try:
            self.client.patch(f"/api/v1/namespaces/{namespace}/pods/{name}/status", status)
        except kube.KubeError:
            log.exception("could not end the phase of deleted %s/%s", namespace, name)

    def _kill(self, uid: str) -> None:
        process = self.processes.pop(uid)
        if process.popen.poll() is None:
            os.killpg(process.popen.pid, signal.SIGTERM)
            try:
                process.popen.wait(timeout=STOP_SECONDS)
            except subprocess.TimeoutExpired:
                os.killpg(process.popen.pid, signal.SIGKILL)
                process.popen.wait()


def status_patch(pod: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
    """A merge patch of ``pod``'s status that names its uid, as a kubelet's does: the API server
    refuses it (the uid cannot change) once the pod is gone and a new pod has its name, as a shard
    placed again has (its engine's end, reported after the old pod's finalizer let it go, must not
    end the new pod)."""
    return {"metadata": {"uid": pod["metadata"]["uid"]}, "status": status}


def exit_status(pod: dict[str, Any], code: int, termination_log: Path) -> dict[str, Any]:
    """The status of a pod whose engine process exited with ``code`` (negative: the signal), as a
    kubelet reports a container that ended: Failed, the container terminated with its exit code and
    what the engine wrote to ``termination_log`` (as much as a kubelet keeps)."""
    try:
        with termination_log.open("rb") as file:
            message = file.read(TERMINATION_MESSAGE_BYTES).decode(errors="replace").strip()
    except OSError:
        message = ""
    terminated: dict[str, Any] = {
        "exitCode": code if code >= 0 else 128 - code,
        "reason": "Completed" if code == 0 else "Error",
        **({"message": message} if message else {}),
    }
    container = pod["spec"]["containers"][0]
    return {
        "phase": "Failed",
        "reason": "EngineExited",
        "message": f"engine exited with code {code}",
        "containerStatuses": [
            {
                "name": container["name"],
                "image": container.get("image", ""),
                "imageID": "",
                "ready": False,
                "restartCount": 0,
                "started": False,
                "state": {"terminated": terminated},
            }
        ],
    }


def expand(value: str, defined: dict[str, str]) -> str:
    """An env value as the kubelet passes it on: ``$$`` becomes ``$``, ``$(NAME)`` the value of an
    earlier variable (left as written when there is none), anything else stays."""
    out, i = [], 0
    while i < len(value):
        following = value[i + 1 : i + 2]
        end = value.find(")", i + 2) if following == "(" and value[i] == "$" else -1
        if value[i] == "$" and following == "$":
            out.append("$")
            i += 2
        elif end != -1:
            out.append(defined.get(value[i + 2 : end], value[i : end + 1]))
            i = end + 1
        else:
            out.append(value[i])
            i += 1
    return "".join(out)


def _wants_gpus(pod: dict[str, Any]) -> bool:
    """GPU pods on simulated nodes stay simulated: there is no GPU here to run their engines on."""
    for container in pod["spec"].get("containers", []):
        limits = (container.get("resources") or {}).get("limits") or {}
        if any(key.endswith("/gpu") and str(value) not in ("0", "") for key, value in limits.items()):
            return True
    return False


def _field(pod: dict[str, Any], path: str) -> str:
    value: Any = pod
    for part in path.split("."):
        value = value.get(part, "") if isinstance(value, dict) else ""
    return str(value)


def _local_path(value: str, mounts: dict[str, Path]) -> str:
    for mount_path, local in mounts.items():
        if value == mount_path or value.startswith(mount_path + "/"):
            return str(local) + value[len(mount_path) :]
    return value


def _resolve(dns_name: str, namespace: str, pods: list[dict[str, Any]]) -> str | None:
    """``<hostname>.<subdomain>.<namespace>.svc`` -> that pod's IP (there is no cluster DNS here)."""
    parts = dns_name.split(".")
    if len(parts) < 3 or parts[2] != namespace:
        return None
    for pod in pods:
        spec = pod.get("spec", {})
        if (
            pod["metadata"]["namespace"] == namespace
            and spec.get("hostname") == parts[0]
            and spec.get("subdomain") == parts[1]
        ):
            ip: str | None = pod.get("status", {}).get("podIP")
            return ip
    return None

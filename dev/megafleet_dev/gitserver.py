"""A git repository served over HTTP on loopback, for Flux's source-controller to clone.

Used by the GitOps tier (``tests/e2e/test_gitops.py``) and ``megafleet dev up --gitops``
(:mod:`megafleet_dev.gitops`). Flux accepts only ``http``, ``https`` and ``ssh`` URLs, and its git
client (go-git) speaks only git's smart HTTP protocol, so static files are not enough: every request
is handed to git's own ``git http-backend`` as a CGI program, as a web server in front of a real git
host would. The server is a thread of the calling process bound to 127.0.0.1 on a free port; it
serves one folder of bare repositories, read-only (``receive-pack`` stays off: commits are pushed to
the bare repository by path, see :class:`Repository`).
"""

from __future__ import annotations

import http.server
import os
import shutil
import subprocess
import threading
from pathlib import Path

from megafleet_dev import cluster

BACKEND_TIMEOUT_SECONDS = 60
AUTHOR = ("megafleet-dev", "megafleet-dev@localhost.invalid")


class GitError(RuntimeError):
    """A git command failed; the message holds its output."""


def _git(args: list[str], *, cwd: Path) -> str:
    env = dict(
        os.environ,
        GIT_AUTHOR_NAME=AUTHOR[0],
        GIT_AUTHOR_EMAIL=AUTHOR[1],
        GIT_COMMITTER_NAME=AUTHOR[0],
        GIT_COMMITTER_EMAIL=AUTHOR[1],
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL=os.devnull,
    )
    result = subprocess.run(
        ["git", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=BACKEND_TIMEOUT_SECONDS, check=False
    )
    if result.returncode != 0:
        raise GitError(f"git {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
    return result.stdout.strip()


class Repository:
    """A bare repository ``<root>/<name>.git`` and a work tree beside it that commits are made in and
    pushed from (by path: nothing is pushed over HTTP)."""

    def __init__(self, root: Path, name: str, *, branch: str = "main") -> None:
        self.name = name
        self.branch = branch
        self.bare = root / f"{name}.git"
        self.work = root / f"{name}.work"
        _git(["init", "--quiet", "--bare", f"--initial-branch={branch}", str(self.bare)], cwd=root)
        _git(["init", "--quiet", f"--initial-branch={branch}", str(self.work)], cwd=root)
        _git(["remote", "add", "origin", str(self.bare)], cwd=self.work)

    def commit(self, files: dict[str, str | None], message: str) -> str:
        """Write (text) or remove (None) ``files`` (paths relative to the work tree), commit, push;
        returns the new commit's hash."""
        for name, text in files.items():
            path = self.work / name
            if text is None:
                path.unlink(missing_ok=True)
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
        _git(["add", "--all", "."], cwd=self.work)
        _git(["commit", "--quiet", "--allow-empty", "-m", message], cwd=self.work)
        _git(["push", "--quiet", "origin", f"HEAD:refs/heads/{self.branch}"], cwd=self.work)
        return _git(["rev-parse", "HEAD"], cwd=self.work)


class _Handler(http.server.BaseHTTPRequestHandler):
    """Runs ``git http-backend`` once per request (CGI/1.1) and relays its answer."""

    server: _Server

    def do_GET(self) -> None:
        self._backend()

    def do_POST(self) -> None:
        self._backend()

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: the e2e logs are the controllers'."""

    def _backend(self) -> None:
        path, _, query = self.path.partition("?")
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "GIT_PROJECT_ROOT": str(self.server.root),
            "GIT_HTTP_EXPORT_ALL": "1",
            "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": os.devnull,
            "GATEWAY_INTERFACE": "CGI/1.1",
            "REQUEST_METHOD": self.command,
            "PATH_INFO": path,
            "QUERY_STRING": query,
            "CONTENT_TYPE": self.headers.get("Content-Type", ""),
            "CONTENT_LENGTH": str(len(body)),
            "REMOTE_ADDR": self.client_address[0],
            "SERVER_PROTOCOL": self.request_version,
        }
        if self.headers.get("Git-Protocol"):
            env["GIT_PROTOCOL"] = self.headers["Git-Protocol"]
        if self.headers.get("Content-Encoding"):
            env["HTTP_CONTENT_ENCODING"] = self.headers["Content-Encoding"]
        result = subprocess.run(
            ["git", "http-backend"], input=body, env=env, capture_output=True, timeout=BACKEND_TIMEOUT_SECONDS
        )
        head, _, payload = result.stdout.partition(b"\r\n\r\n")
        status, headers = 200, []
        for line in head.decode("latin-1").split("\r\n"):
            name, _, value = line.partition(":")
            if name.lower() == "status":
                status = int(value.strip().split()[0])
            elif name:
                headers.append((name, value.strip()))
        if result.returncode != 0 and not head:
            status, payload = 500, result.stderr
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, root: Path, port: int) -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        self.root = root


class GitServer:
    """Serves every bare repository under ``root`` at ``http://127.0.0.1:<port>/<name>.git``."""

    def __init__(self, root: Path) -> None:
        if shutil.which("git") is None:
            raise GitError("git is not installed: the GitOps tier serves its repository with git http-backend")
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self._server = _Server(root, cluster.free_port())
        self._thread = threading.Thread(target=self._server.serve_forever, name="megafleet-git", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def url(self, repository: Repository) -> str:
        return f"http://127.0.0.1:{self.port}/{repository.bare.name}"

    def repository(self, name: str) -> Repository:
        return Repository(self.root, name)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

"""The Dockerfile's images, built without Docker: a Debian base made with mmdebstrap, the
``operator`` and ``engine`` targets built by buildah (daemonless), exported as image archives that
containerd imports.

Called by ``megafleet dev images`` and by the real node (:mod:`megafleet_dev.realnode`), which
imports the archives into its containerd. Every product is cached under ``<cache>/images/`` by a
content hash of its inputs (the Dockerfile, the build context's files, the base), so it is rebuilt
only when an input changes; a build writes to a temporary name renamed into place, so an
interrupted build never looks finished. buildah runs in a private mount namespace
(``unshare -m``): the overlay mounts it makes vanish with it, whatever happens.

Disk: the engine image is ~6 GB and the cache is shared by every checkout and CI on the machine, so
one build at a time (a file lock), a clear error before a build the free space cannot hold
(:data:`BUILD_NEEDS_GB`), and after each build buildah's storage keeps only the current image of
each target (its layers are the cache of the next build), or none when free space is short
(:data:`KEEP_STORAGE_FREE_GB`: the archive is then the only cache).

Development tooling only: real users build the same Dockerfile with their own builder and the
public bases (the bases are build arguments).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
import tomllib
from collections.abc import Iterable, Iterator
from pathlib import Path

from megafleet_dev import progress, toolchain

REPO_ROOT = Path(__file__).resolve().parents[2]
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
# python3 and venv for the images' venv, passwd for useradd, CA certificates for pip.
BASE_PACKAGES = ("python3", "python3-venv", "passwd", "ca-certificates")
BASE_NAME = "localhost/megafleet/debian-python"
CONTEXT_ENTRIES = ("Dockerfile", "pyproject.toml", "README.md", "docker", "protocol", "operator", "engine", "dev")
# Copied but not hashed: the wheel lists the dev package (both images delete it after the install)
# and takes README.md as its long description; editing either does not rebuild the images.
UNHASHED_ENTRIES = ("dev", "README.md")
TARGETS = ("operator", "engine")
PAUSE_REFERENCE = "localhost/megafleet/pause:catatonit"
# Free GB a build needs on the cache's filesystem, measured (docs/development.md, "Real containers"): ``cold``
# when buildah's storage holds no image of the target (every layer is built), ``warm`` when it
# does (the dependency layers are usually reused; the export still writes the whole archive).
BUILD_NEEDS_GB = {"engine": {"cold": 16.0, "warm": 8.0}, "operator": {"cold": 2.0, "warm": 1.0}}
# After an export, the storage copy of the image (its layer cache) is kept only while this much stays
# free: a real node then imports the archive (twice its size: containerd's content and snapshot).
KEEP_STORAGE_FREE_GB = 25.0
_SKIPPED_PARTS = {"__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache"}


class ImageError(RuntimeError):
    """An image could not be built; the message names the log to read."""


@dataclasses.dataclass(frozen=True)
class Image:
    """A built image: ``reference`` is the name pods use, ``archive`` the docker-archive holding it
    (tagged ``reference`` and ``localhost/megafleet/<target>:<key>``)."""

    target: str
    reference: str
    archive: Path
    key: str


def images_dir() -> Path:
    return toolchain.cache_root() / "images"


def project_version() -> str:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    return str(project["version"])


def reference(target: str) -> str:
    """The name pods give the image: ``megafleet/<target>:<version>`` as containerd normalizes it
    (the API's default ``spec.engine.image`` is ``megafleet/engine:<version>``)."""
    return f"docker.io/megafleet/{target}:{project_version()}"


# -- hashing (pure) ------------------------------------------------------------------------------


def context_files(root: Path, entries: Iterable[str] = CONTEXT_ENTRIES) -> list[Path]:
    """Every file of the build context, relative to ``root``, sorted, caches left out."""
    found: list[Path] = []
    for entry in entries:
        path = root / entry
        if path.is_file():
            found.append(Path(entry))
            continue
        for item in path.rglob("*"):
            relative = item.relative_to(root)
            if item.is_file() and not _SKIPPED_PARTS & set(relative.parts) and item.suffix != ".pyc":
                found.append(relative)
    return sorted(found)


def content_key(root: Path, files: Iterable[Path], *extra: str) -> str:
    """A short hash of the files' names and contents plus ``extra`` strings (target, base key)."""
    digest = hashlib.sha256()
    for value in extra:
        digest.update(value.encode() + b"\0")
    for relative in files:
        digest.update(str(relative).encode() + b"\0")
        digest.update(hashlib.sha256((root / relative).read_bytes()).digest())
    return digest.hexdigest()[:16]


def base_key() -> str:
    return hashlib.sha256(" ".join((DEBIAN_SUITE, "minbase", *BASE_PACKAGES)).encode()).hexdigest()[:16]


# -- building ------------------------------------------------------------------------------------


def _buildah(*args: str) -> list[str]:
    """A buildah command on the cache's storage. Its temporary files (a commit's diff, an export's
    blobs: gigabytes) go to the cache's ``tmp``, which a build under :func:`_build_lock` empties
    first: a killed buildah leaves them behind (it did, in ``/var/tmp``)."""
    root = images_dir() / "storage"
    return [
        "env",
        f"TMPDIR={images_dir() / 'tmp'}",
        "unshare",
        "-m",
        "--propagation",
        "private",
        "buildah",
        "--root",
        str(root / "root"),
        "--runroot",
        str(root / "run"),
        "--storage-driver",
        "overlay",
        *args,
    ]


def _require(program: str, package: str) -> None:
    if shutil.which(program) is None:
        raise ImageError(
            f"{program} is not installed; install Debian's {package} package "
            "(apt-get install -y --no-install-recommends buildah mmdebstrap containerd runc "
            "containernetworking-plugins catatonit iptables)"
        )


def _run(cmd: list[str], *, log: Path, report: progress.Progress, what: str) -> None:
    """Run a long command into ``log``, reporting buildah's STEP lines and a heartbeat every 30 s."""
    started = time.monotonic()
    next_beat = started + 30.0
    with log.open("a", buffering=1) as sink:  # line-buffered: the log is readable while it runs
        sink.write(f"$ {' '.join(cmd)}\n")
        sink.flush()
        with subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            env=dict(os.environ, BUILDAH_ISOLATION="chroot"),
        ) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                sink.write(line)
                if line.startswith("STEP ") or time.monotonic() >= next_beat:
                    shown = line.strip()[:110] if line.startswith("STEP ") else "still running"
                    report(f"{what} ({time.monotonic() - started:.0f} s): {shown}")
                    next_beat = time.monotonic() + 30.0
            code = proc.wait()
    if code != 0:
        tail = log.read_text(errors="replace").splitlines()[-25:]
        raise ImageError(f"{what} failed (exit {code}); the last lines of {log}:\n" + "\n".join(tail))


def _has_image(name: str) -> bool:
    result = subprocess.run(_buildah("inspect", "--type", "image", name), capture_output=True, check=False)
    return result.returncode == 0


# -- disk ----------------------------------------------------------------------------------------


def free_gb(path: Path) -> float:
    """Free space, in GB (10^9 bytes, as ``df -H`` says), on the filesystem of ``path``."""
    return shutil.disk_usage(path).free / 1e9


def require_free(needed_gb: float, what: str, folder: Path | None = None) -> None:
    """Fail clearly when the filesystem of ``folder`` (default: the images cache) has less than
    ``needed_gb`` free, instead of a builder's "no space left on device" halfway through."""
    folder = folder or images_dir()
    folder.mkdir(parents=True, exist_ok=True)
    free = free_gb(folder)
    if free < needed_gb:
        raise ImageError(
            f"{what} needs about {needed_gb:.0f} GB free on the filesystem of {folder}, and {free:.1f} GB "
            f"are free. Free some space: the images cache {images_dir()} can be deleted as a whole (it is "
            "rebuilt), and `megafleet dev down` deletes a cluster's real node with its containerd store."
        )


def stale_names(names: Iterable[str], target: str, keep: str | None) -> list[str]:
    """The image names of ``target`` in buildah's storage other than its ``keep`` key (all of them
    when ``keep`` is None) (pure)."""
    prefix = f"localhost/megafleet/{target}:"
    return sorted(name for name in names if name.startswith(prefix) and name != f"{prefix}{keep}")


def _stored_names() -> list[str]:
    listed = subprocess.run(_buildah("images", "--json"), capture_output=True, text=True, check=False)
    if listed.returncode != 0 or not listed.stdout.strip():
        return []
    return [name for image in json.loads(listed.stdout) for name in image.get("names") or []]


def prune_storage(names: Iterable[str], *, log: Path) -> None:
    """Remove from buildah's storage the images ``names`` (with the layer images only they used),
    then the untagged ones left (layers of failed or replaced builds) and the working containers
    of interrupted builds. Called under :func:`_build_lock`: no build of this tooling is running."""
    with log.open("a") as sink:
        for cmd in (
            _buildah("rm", "--all"),
            *(_buildah("rmi", name) for name in names),
            _buildah("rmi", "--prune"),
        ):
            sink.write(f"$ {' '.join(cmd)}\n")
            sink.flush()
            subprocess.run(cmd, stdout=sink, stderr=subprocess.STDOUT, check=False)


@contextlib.contextmanager
def _build_lock() -> Iterator[None]:
    """One build or prune of the shared cache at a time, across processes (CI, checkouts)."""
    folder = images_dir()
    (folder / "tmp").mkdir(parents=True, exist_ok=True)
    with (folder / "build.lock").open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_base(report: progress.Progress = progress.print_progress) -> str:
    """The local Debian base in buildah's storage (mmdebstrap rootfs, cached); returns its name."""
    key = base_key()
    name = f"{BASE_NAME}:{key}"
    folder = images_dir()
    folder.mkdir(parents=True, exist_ok=True)
    rootfs = folder / f"base-{DEBIAN_SUITE}-{key}.tar"
    log = folder / "base.log"
    if not rootfs.is_file():
        _require("mmdebstrap", "mmdebstrap")
        started = time.monotonic()
        report(f"making the Debian {DEBIAN_SUITE} base with mmdebstrap (about a minute); log: {log}")
        partial = rootfs.with_suffix(".partial.tar")
        excludes = [f"--dpkgopt=path-exclude=/usr/share/{d}/*" for d in ("man", "doc", "locale", "info")]
        cmd = [
            "mmdebstrap",
            "--variant=minbase",
            f"--include={','.join(BASE_PACKAGES)}",
            *excludes,
            DEBIAN_SUITE,
            str(partial),
            DEBIAN_MIRROR,
        ]
        _run(cmd, log=log, report=report, what="mmdebstrap")
        partial.rename(rootfs)
        report(f"made the base rootfs in {time.monotonic() - started:.0f} s ({rootfs.stat().st_size >> 20} MiB)")
    if not _has_image(name):
        _require("buildah", "buildah")
        with _build_lock():
            _import_base(rootfs, name, key, log=log, report=report)
    return name


def _import_base(rootfs: Path, name: str, key: str, *, log: Path, report: progress.Progress) -> None:
    container = f"megafleet-base-{key}"
    subprocess.run(_buildah("rm", container), capture_output=True, check=False)
    _run(_buildah("from", "--name", container, "scratch"), log=log, report=report, what="base image")
    try:
        _run(_buildah("add", container, str(rootfs), "/"), log=log, report=report, what="base image")
        path = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        _run(_buildah("config", "--env", path, "--cmd", "python3", container), log=log, report=report, what="base")
        _run(_buildah("commit", "--rm", container, name), log=log, report=report, what="base image")
    except BaseException:
        subprocess.run(_buildah("rm", container), capture_output=True, check=False)
        raise


def host_trust_volumes() -> list[str]:
    """``--volume`` arguments lending the host's CA certificates and pip configuration to the
    build's RUN steps (a TLS-intercepting proxy's CA, a package mirror); volumes are never
    committed, so nothing of the host ends up in an image."""
    volumes = []
    for path in ("/etc/ssl/certs", "/etc/pip.conf"):
        if Path(path).exists():
            volumes += ["--volume", f"{path}:{path}:ro"]
    return volumes


def _export(image: str, archive: Path, ref: str, *, log: Path, report: progress.Progress, what: str) -> None:
    """Write ``image`` as a docker-archive named ``ref`` (and its local tag), which ``ctr images
    import`` reads. Its layers are plain tars by the format: no compression pass over gigabytes
    (buildah 1.28 compresses OCI archives even with ``-D``)."""
    partial = archive.with_suffix(".partial")
    partial.unlink(missing_ok=True)
    _run(_buildah("push", "-q", image, f"docker-archive:{partial}:{ref}"), log=log, report=report, what=what)
    partial.rename(archive)


def ensure_image(target: str, report: progress.Progress = progress.print_progress) -> Image:
    """Build one Dockerfile target from the local base unless its archive for these inputs exists."""
    base = ensure_base(report)
    hashed = context_files(REPO_ROOT, [entry for entry in CONTEXT_ENTRIES if entry not in UNHASHED_ENTRIES])
    key = content_key(REPO_ROOT, hashed, target, base)
    archive = images_dir() / f"{target}-{key}.image.tar"
    if archive.is_file():
        return Image(target, reference(target), archive, key)
    _require("buildah", "buildah")
    with _build_lock():
        if not archive.is_file():  # another process may have built it while this one waited
            _build(target, key, base, archive, report)
    return Image(target, reference(target), archive, key)


def _build(target: str, key: str, base: str, archive: Path, report: progress.Progress) -> None:
    """Build, export and prune (under the build lock): stale archives of the target go first, and
    its older images in the storage too when the free space is short for a build that reuses them."""
    folder = images_dir()
    log = folder / f"{target}.log"
    log.write_text("")
    for stale in folder.glob(f"{target}-*.image.tar"):
        stale.unlink()
    shutil.rmtree(folder / "tmp", ignore_errors=True)  # what killed builds left
    (folder / "tmp").mkdir()
    # Untagged layers of a failed build stay (the next build resumes from them) unless space is short.
    subprocess.run(_buildah("rm", "--all"), capture_output=True, check=False)
    # Warm: the storage holds an image of this target, whose layers the build may reuse.
    older = stale_names(_stored_names(), target, None)
    needs = BUILD_NEEDS_GB[target]["warm" if older else "cold"]
    if free_gb(folder) < needs:
        prune_storage(older, log=log)
        needs = BUILD_NEEDS_GB[target]["cold"]
    require_free(needs, f"building the {target} image", folder)
    started = time.monotonic()
    report(f"building the {target} image with buildah ({target} {key}); log: {log}")
    tag = f"localhost/megafleet/{target}:{key}"
    with tempfile.TemporaryDirectory(prefix=f"megafleet-{target}-context-") as context:
        for relative in context_files(REPO_ROOT):  # only the inputs travel (no .venv, .git or caches)
            (Path(context) / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO_ROOT / relative, Path(context) / relative)
        cmd = _buildah(
            "bud",
            "--isolation",
            "chroot",
            "--layers",
            "--force-rm",  # a failed step leaves no working container (its upper folder: gigabytes)
            "--pull=never",
            *host_trust_volumes(),
            "--target",
            target,
            "--build-arg",
            f"{target.upper()}_BASE={base}",
            "-t",
            tag,
            "-f",
            str(Path(context) / "Dockerfile"),
            context,
        )
        _run(cmd, log=log, report=report, what=f"building {target}")
    _export(tag, archive, reference(target), log=log, report=report, what=f"exporting {target}")
    short = free_gb(folder) < KEEP_STORAGE_FREE_GB
    prune_storage(stale_names(_stored_names(), target, None if short else key), log=log)
    kept = "the archive only: free space is short" if short else "the archive and the layer cache"
    report(
        f"built the {target} image in {time.monotonic() - started:.0f} s "
        f"({archive.stat().st_size >> 20} MiB; kept {kept}; {free_gb(folder):.1f} GB free)"
    )


def ensure_pause(report: progress.Progress = progress.print_progress) -> Image:
    """The sandbox ("pause") image: Debian's static catatonit in pause mode, one file."""
    catatonit = shutil.which("catatonit")
    if catatonit is None:
        raise ImageError("catatonit is not installed; install Debian's catatonit package")
    key = hashlib.sha256(Path(catatonit).read_bytes()).hexdigest()[:16]
    folder = images_dir()
    folder.mkdir(parents=True, exist_ok=True)
    archive = folder / f"pause-{key}.image.tar"
    if archive.is_file():
        return Image("pause", PAUSE_REFERENCE, archive, key)
    with _build_lock():
        if not archive.is_file():  # another process may have built it while this one waited
            _build_pause(catatonit, key, archive, report)
    return Image("pause", PAUSE_REFERENCE, archive, key)


def _build_pause(catatonit: str, key: str, archive: Path, report: progress.Progress) -> None:
    log = images_dir() / "pause.log"
    container = f"megafleet-pause-{key}"
    subprocess.run(_buildah("rm", container), capture_output=True, check=False)
    _run(_buildah("from", "--name", container, "scratch"), log=log, report=report, what="pause image")
    try:
        _run(_buildah("copy", container, catatonit, "/pause"), log=log, report=report, what="pause image")
        _run(_buildah("config", "--entrypoint", '["/pause", "-P"]', container), log=log, report=report, what="pause")
        _run(
            _buildah("commit", "--rm", container, f"localhost/megafleet/pause:{key}"),
            log=log,
            report=report,
            what="pause",
        )
    except BaseException:
        subprocess.run(_buildah("rm", container), capture_output=True, check=False)
        raise
    _export(f"localhost/megafleet/pause:{key}", archive, PAUSE_REFERENCE, log=log, report=report, what="pause image")


def ensure_all(targets: Iterable[str] = TARGETS, report: progress.Progress = progress.print_progress) -> list[Image]:
    """Every named target (and the pause image), built only where the inputs changed."""
    return [ensure_pause(report), *(ensure_image(target, report) for target in targets)]

"""Install the project's dependencies into an image in a few layers of about 1.5-2 GB each.

Called by the Dockerfile's RUN steps (standard library only: it runs on the image's bare python3).
A single ``pip install`` of the engine's dependencies makes one ~6 GB layer, and committing a layer
takes about three times its size at once (the container's upper folder, the diff's temporary blob,
the new layer); several smaller layers keep that peak near three times the largest group.

``requirements PYPROJECT [EXTRA...]``  print the requirements (the dependencies and the extras').
``resolve PYPROJECT PINS [EXTRA...]``   resolve them once (``pip install --dry-run --report``) and
                                        write, per group, the exact ``name==version`` pins to PINS.
``install PINS GROUP``                  install one group's pins with ``--no-deps`` (the resolution
                                        already chose every version; no group re-resolves).

The groups (:data:`GROUPS`) are tried in order and a distribution goes to the first that matches, so
the last one, ``rest``, takes everything else: every resolved distribution is installed exactly once.
The project itself is installed afterwards (``pip install .[extras]``) and finds them all present.
"""

from __future__ import annotations

import fnmatch
import json
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

# Sizes installed, CUDA 13 wheels of torch 2.15 (Linux x86-64): cudnn 0.85 GB, nccl, cusparselt and
# nvshmem 0.2 GB each; the other nvidia libraries (cu13: cublas, cufft, cusolver, ...) 1.6 GB;
# torch and triton 2.2 GB; the rest (transformers, numpy, sympy, the operator's) 0.5 GB.
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("cuda-comm", ("nvidia-cudnn-*", "nvidia-nccl-*", "nvidia-cusparselt-*", "nvidia-nvshmem-*")),
    ("cuda", ("nvidia-*", "cuda-*")),
    ("torch", ("torch", "triton")),
    ("rest", ("*",)),
)


def normalize(name: str) -> str:
    """A distribution's name as PEP 503 compares them (``Nvidia_NCCL.cu13`` -> ``nvidia-nccl-cu13``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def group_of(name: str) -> str:
    """The first group whose patterns match the distribution ``name``."""
    normal = normalize(name)
    for group, patterns in GROUPS:
        if any(fnmatch.fnmatchcase(normal, pattern) for pattern in patterns):
            return group
    raise AssertionError("the last group matches everything")


def requirements(pyproject: dict[str, Any], extras: list[str]) -> list[str]:
    """The project's dependencies plus those of ``extras`` (pyproject.toml's ``[project]`` table)."""
    project = pyproject["project"]
    found = list(project["dependencies"])
    for extra in extras:
        found += project["optional-dependencies"][extra]
    return found


def pins(report: dict[str, Any]) -> dict[str, list[str]]:
    """Every group's ``name==version`` pins from a ``pip install --report`` (each group present,
    maybe empty; sorted, so the same resolution writes the same file)."""
    grouped: dict[str, list[str]] = {group: [] for group, _ in GROUPS}
    for item in report["install"]:
        metadata = item["metadata"]
        grouped[group_of(metadata["name"])].append(f"{normalize(metadata['name'])}=={metadata['version']}")
    return {group: sorted(found) for group, found in grouped.items()}


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def main(argv: list[str]) -> int:
    command, *args = argv
    if command == "requirements":
        pyproject = tomllib.loads(Path(args[0]).read_text())
        sys.stdout.write("".join(f"{line}\n" for line in requirements(pyproject, args[1:])))
    elif command == "resolve":
        pyproject = tomllib.loads(Path(args[0]).read_text())
        with tempfile.TemporaryDirectory() as folder:
            listed = Path(folder) / "requirements.txt"
            listed.write_text("\n".join(requirements(pyproject, args[2:])) + "\n")
            report = Path(folder) / "report.json"
            _pip("install", "--dry-run", "--quiet", "--report", str(report), "-r", str(listed))
            grouped = pins(json.loads(report.read_text()))
        Path(args[1]).write_text(json.dumps(grouped, indent=1) + "\n")
        for group, found in grouped.items():
            sys.stdout.write(f"{group}: {len(found)} distributions\n")
    elif command == "install":
        found = json.loads(Path(args[0]).read_text())[args[1]]
        if found:
            _pip("install", "--no-deps", *found)
    else:
        sys.stderr.write(__doc__ or "")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

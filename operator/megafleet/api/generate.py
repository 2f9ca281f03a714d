"""``megafleet crds``: write (or check) every file generated from the API models.

The generated files are checked in: ``crds/*.yaml``, the same files in ``charts/megafleet/crds/``
(Helm installs CRDs from there, never templated) and ``docs/api.md``.
"""

from __future__ import annotations

from pathlib import Path

from megafleet.api import crd, reference, v1alpha1


def generated_files(root: Path) -> dict[Path, str]:
    """Every generated file under the repository ``root`` and its expected content."""
    files: dict[Path, str] = {}
    for info in v1alpha1.KINDS:
        text = crd.render(info)
        files[root / "crds" / crd.file_name(info)] = text
        files[root / "charts" / "megafleet" / "crds" / crd.file_name(info)] = text
    peering = crd.render_peering()
    files[root / "crds" / "kopf.dev_clusterkopfpeerings.yaml"] = peering
    files[root / "charts" / "megafleet" / "crds" / "kopf.dev_clusterkopfpeerings.yaml"] = peering
    files[root / "docs" / "api.md"] = reference.render()
    return files


def stale_files(root: Path) -> list[Path]:
    """Generated files that are missing or differ from what the models produce."""
    return [path for path, text in generated_files(root).items() if not path.is_file() or path.read_text() != text]


def write(root: Path) -> list[Path]:
    """Rewrite the stale generated files; returns what changed."""
    changed = stale_files(root)
    for path, text in generated_files(root).items():
        if path in changed:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    return changed

"""The Dockerfile, read without a Docker engine: each target's entrypoint is a console script the
image installs, the operator image holds no torch, and both images run as a non-root user.

A small parser: stages from ``FROM image AS name``, continuation lines joined, ENTRYPOINT/CMD in
JSON (exec) form, ``pip install`` targets with their extras resolved through pyproject.toml. The
engine's dependencies are installed by ``docker/deps.py`` in one layer per group: its grouping is
tested here too (loaded from its file: it is a build script, not a package).
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
NON_ROOT = "65532:65532"


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def last(self, keyword: str) -> str | None:
        found = [argument for name, argument in self.instructions if name == keyword]
        return found[-1] if found else None

    def exec_form(self, keyword: str) -> list[str] | None:
        argument = self.last(keyword)
        if argument is None:
            return None
        value = json.loads(argument)  # shell form would raise: exec form is required (signals reach PID 1)
        assert isinstance(value, list) and all(isinstance(item, str) for item in value)
        return value

    def pip_targets(self) -> list[str]:
        targets = []
        for name, argument in self.instructions:
            if name != "RUN":
                continue
            lexer = shlex.shlex(argument, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            command: list[str] = []
            for word in [*lexer, "&&"]:
                if word not in ("&&", "||", ";", "|"):
                    command.append(word)
                    continue
                if command[:2] in (["pip", "install"], ["pip3", "install"]):
                    words = command[2:]
                    # ``-r FILE`` installs the dependencies first (their own layer), not a target.
                    targets += [
                        item
                        for i, item in enumerate(words)
                        if not item.startswith("-") and (i == 0 or words[i - 1] != "-r")
                    ]
                command = []
        return targets


def parse(text: str) -> dict[str, Stage]:
    joined = re.sub(r"\\\n", " ", text)
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    build_args: dict[str, str] = {}  # ARGs before the first FROM: the bases' defaults
    for raw in joined.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, argument = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "ARG" and current is None:
            name, _, default = argument.strip().partition("=")
            build_args[name] = default
        elif keyword == "FROM":
            match = re.fullmatch(r"(?:--\S+\s+)*(\S+)\s+AS\s+(\S+)", argument.strip(), flags=re.IGNORECASE)
            assert match, f"every stage is named: {line}"
            base = re.sub(r"\$\{(\w+)\}", lambda m: build_args[m.group(1)], match.group(1))
            current = stages[match.group(2)] = Stage(match.group(2), base)
        else:
            assert current is not None, f"instruction before FROM: {line}"
            current.instructions.append((keyword, argument.strip()))
    return stages


def load_deps() -> ModuleType:
    spec = importlib.util.spec_from_file_location("megafleet_docker_deps", ROOT / "docker" / "deps.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclass-free, but keep the usual import invariants
    spec.loader.exec_module(module)
    return module


deps = load_deps()


@pytest.fixture(scope="module")
def stages() -> dict[str, Stage]:
    return parse((ROOT / "Dockerfile").read_text())


@pytest.fixture(scope="module")
def project() -> dict[str, Any]:
    project: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project


def requirements(project: dict[str, Any], target: str) -> list[str]:
    """The distributions ``pip install <target>`` brings for this project (``.`` or ``.[a,b]``)."""
    match = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", target)
    assert match, f"images install the project itself, not {target}"
    extras = match.group(1).split(",") if match.group(1) else []
    found = list(project["dependencies"])
    for extra in extras:
        found += project["optional-dependencies"][extra]
    return [re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower() for requirement in found]


def test_the_parser_reads_stages_and_exec_forms() -> None:
    parsed = parse(
        'FROM a:1 AS one\nRUN pip install \\\n  ".[x]" && true\nENTRYPOINT ["p", "q"]\nFROM b AS two\nCMD ["c"]\n'
    )
    assert list(parsed) == ["one", "two"]
    assert parsed["one"].base == "a:1"
    assert parsed["one"].pip_targets() == [".[x]"]
    with_args = parse("ARG B=img:2\nFROM ${B} AS s\nRUN pip install -r req.txt && pip install .\n")["s"]
    assert with_args.base == "img:2"
    assert with_args.pip_targets() == ["."]
    assert parsed["one"].exec_form("ENTRYPOINT") == ["p", "q"]
    assert parsed["two"].exec_form("ENTRYPOINT") is None
    with pytest.raises(json.JSONDecodeError):
        parse("FROM a AS s\nENTRYPOINT megafleet operator\n")["s"].exec_form("ENTRYPOINT")


def test_both_targets_exist(stages: dict[str, Stage]) -> None:
    assert set(stages) == {"operator", "engine"}
    assert stages["operator"].base.startswith("python:3.12-slim")
    assert stages["engine"].base.startswith("nvidia/cuda:")


@pytest.mark.parametrize(
    ("stage", "script", "module"),
    [("operator", "megafleet", "megafleet.cli:main"), ("engine", "megafleet-engine", "megafleet_engine.cli:main")],
    ids=["operator", "engine"],
)
def test_the_entrypoint_is_a_console_script_the_image_installs(
    stages: dict[str, Stage], project: dict[str, Any], stage: str, script: str, module: str
) -> None:
    entrypoint = stages[stage].exec_form("ENTRYPOINT")
    assert entrypoint == [script]
    assert project["scripts"][script] == module
    assert stages[stage].pip_targets(), "the image installs the project (which installs its scripts)"


def test_the_operator_image_runs_the_operator_by_default(stages: dict[str, Stage]) -> None:
    assert stages["operator"].exec_form("CMD") == ["operator"]


def test_the_operator_image_installs_no_torch(stages: dict[str, Stage], project: dict[str, Any]) -> None:
    operator = stages["operator"]
    installed = [name for target in operator.pip_targets() for name in requirements(project, target)]
    assert "kopf" in installed
    assert not {"torch", "transformers", "megatron-core"} & set(installed)
    assert not any("torch" in argument for _, argument in operator.instructions)


@pytest.mark.parametrize("stage", ["operator", "engine"])
def test_both_images_copy_every_package_the_install_builds(stages: dict[str, Stage], stage: str) -> None:
    copied = {argument.split()[0] for keyword, argument in stages[stage].instructions if keyword == "COPY"}
    assert {"protocol", "operator", "engine", "dev"} <= copied


def test_the_operator_image_removes_the_engine_and_the_dev_tooling(stages: dict[str, Stage]) -> None:
    removal = [a for k, a in stages["operator"].instructions if k == "RUN" and "rmtree" in a]
    assert removal and "'megafleet_engine'" in removal[0] and "'megafleet_dev'" in removal[0]


def test_the_engine_image_installs_torch_and_megatron(stages: dict[str, Stage], project: dict[str, Any]) -> None:
    installed = {name for target in stages["engine"].pip_targets() for name in requirements(project, target)}
    assert {"torch", "transformers", "megatron-core", "fastapi", "uvicorn"} <= installed


@pytest.mark.parametrize("stage", ["operator", "engine"])
def test_images_run_as_the_non_root_user_of_the_pods(stages: dict[str, Stage], stage: str) -> None:
    assert stages[stage].last("USER") == NON_ROOT
    creates_user = [a for k, a in stages[stage].instructions if k == "RUN" and "useradd" in a]
    assert creates_user and "--uid 65532" in creates_user[0] and "--gid 65532" in creates_user[0]
    # A read-only root filesystem: HOME (and caches) live on the /tmp emptyDir of every pod.
    environment = " ".join(a for k, a in stages[stage].instructions if k == "ENV")
    assert "HOME=/tmp" in environment


def deps_runs(stage: Stage) -> list[list[str]]:
    """The ``python3 deps.py ...`` RUN steps of a stage, as argument lists (one per instruction)."""
    found = []
    for keyword, argument in stage.instructions:
        words = shlex.split(argument) if keyword == "RUN" else []
        if words[:2] == ["python3", "deps.py"]:
            found.append(words[2 : words.index(">")] if ">" in words else words[2:])
    return found


def test_the_engine_installs_its_dependencies_one_group_per_layer(stages: dict[str, Stage]) -> None:
    engine = stages["engine"]
    copied = [argument.split() for keyword, argument in engine.instructions if keyword == "COPY"]
    assert ["pyproject.toml", "docker/deps.py", "./"] in copied  # deps.py sits next to pyproject.toml
    runs = deps_runs(engine)
    final_extras = re.fullmatch(r"\.\[([\w,-]+)\]", engine.pip_targets()[-1])
    assert final_extras, "the project is installed last, with its extras"
    # One resolution of exactly the extras the project is installed with, then each group in its
    # own RUN (its own layer), in the order of deps.GROUPS.
    assert runs[0] == ["resolve", "pyproject.toml", "pins.json", *final_extras.group(1).split(",")]
    assert runs[1:] == [["install", "pins.json", group] for group, _ in deps.GROUPS]


def test_the_operator_lists_its_requirements_with_the_same_script(stages: dict[str, Stage]) -> None:
    assert deps_runs(stages["operator"]) == [["requirements", "pyproject.toml"]]


def test_the_readme_is_copied_after_the_dependencies(stages: dict[str, Stage]) -> None:
    """The layer cache of the dependencies is keyed by what was copied before them: pyproject.toml
    and deps.py, not the README (a documentation edit must not reinstall gigabytes)."""
    for stage in stages.values():
        steps = [(keyword, argument.split()[0]) for keyword, argument in stage.instructions]
        dependencies = next(i for i, (k, a) in enumerate(stage.instructions) if k == "RUN" and "deps.py" in a)
        assert ("COPY", "README.md") in steps[dependencies:]
        assert ("COPY", "README.md") not in steps[:dependencies]


@pytest.mark.parametrize(
    ("name", "group"),
    [
        ("nvidia-cudnn-cu13", "cuda-comm"),
        ("nvidia_nccl_cu13", "cuda-comm"),
        ("nvidia-cusparselt-cu13", "cuda-comm"),
        ("nvidia-nvshmem-cu13", "cuda-comm"),
        ("nvidia-cublas", "cuda"),
        ("NVIDIA-cuda-runtime", "cuda"),
        ("cuda-toolkit", "cuda"),
        ("torch", "torch"),
        ("triton", "torch"),
        ("torchvision", "rest"),
        ("transformers", "rest"),
        ("kopf", "rest"),
    ],
)
def test_each_distribution_goes_to_the_first_group_that_matches(name: str, group: str) -> None:
    assert deps.group_of(name) == group


def test_the_pins_install_every_resolved_distribution_exactly_once() -> None:
    names = ["nvidia-nccl-cu13", "nvidia-cufft", "torch", "triton", "Jinja2", "pydantic_core", "cuda-bindings"]
    report = {"install": [{"metadata": {"name": name, "version": f"1.{i}"}} for i, name in enumerate(names)]}
    pins = deps.pins(report)
    assert list(pins) == [group for group, _ in deps.GROUPS]
    assert pins["cuda-comm"] == ["nvidia-nccl-cu13==1.0"]
    assert pins["cuda"] == ["cuda-bindings==1.6", "nvidia-cufft==1.1"]
    assert pins["torch"] == ["torch==1.2", "triton==1.3"]
    assert pins["rest"] == ["jinja2==1.4", "pydantic-core==1.5"]
    flat = [pin for group in pins.values() for pin in group]
    assert len(flat) == len(set(flat)) == len(names)


def test_the_requirements_are_the_dependencies_and_the_extras(project: dict[str, Any]) -> None:
    listed = deps.requirements({"project": project}, ["engine"])
    assert listed == project["dependencies"] + project["optional-dependencies"]["engine"]
    assert deps.requirements({"project": project}, []) == project["dependencies"]

"""Is this interpreter fit to run the kit? The launchers ask it first, in whatever Python they were given.

Standard library only, so that it answers even where torch or half the kit is missing: it reads the kit's
dependencies from pyproject.toml and compares them with what importlib.metadata finds. Versions compare on
their release numbers only, so a container's torch `2.6.0a0+ecf3bae40a.nv25.01` counts as 2.6 (pip would call it
older than 2.6 and replace it). The fix it prints pins the installed torch, so pip never touches it.

  python -m dskit.env.python_env probe     check, then print "GPUS PYTHON TORCH CUDA DEEPSPEED" for the launcher
  python -m dskit.env.python_env missing   the requirements to install (for an install over a given interpreter)
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
import platform
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from model_utils.repo import REPO_ROOT

MIN_PYTHON = (3, 11)
# distributions whose import name is not their name with '-' -> '_'
IMPORT_NAMES = {"pyyaml": "yaml"}
_REQUIREMENT = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*((?:[<>=!~]=?\s*[0-9][0-9.]*\s*,?\s*)*)$")
_SPEC = re.compile(r"([<>=!~]=?)\s*([0-9][0-9.]*)")
_MARKER = re.compile(r"""^(sys_platform|platform_machine)\s*(==|!=)\s*['"]([^'"]*)['"]$""")
_RELEASE = re.compile(r"^\d+(\.\d+)*")


@dataclass(frozen=True)
class Requirement:
    name: str
    specs: tuple[tuple[str, tuple[int, ...]], ...]
    text: str  # as pyproject writes it, without the marker: what pip is asked for

    def allows(self, version: str) -> bool:
        have = release(version)
        return all(_compare(have, op, want) for op, want in self.specs)


def release(version: str) -> tuple[int, ...]:
    match = _RELEASE.match(version)
    return tuple(int(x) for x in match.group(0).split(".")) if match else ()


def _compare(have: tuple[int, ...], op: str, want: tuple[int, ...]) -> bool:
    width = max(len(have), len(want))
    a, b = have + (0,) * (width - len(have)), want + (0,) * (width - len(want))
    return {
        ">=": a >= b,
        ">": a > b,
        "<=": a <= b,
        "<": a < b,
        "==": a == b,
        "!=": a != b,
        "~=": a >= b and a[: len(want) - 1] == b[: len(want) - 1],
    }[op]


def _marker_holds(marker: str) -> bool:
    values = {"sys_platform": sys.platform, "platform_machine": platform.machine()}
    for clause in marker.split(" and "):
        match = _MARKER.match(clause.strip())
        assert match, (
            f"pyproject.toml marker {marker!r}: only sys_platform/platform_machine ==/!= are read here"
        )
        name, op, value = match.groups()
        if (values[name] == value) != (op == "=="):
            return False
    return True


def parse(line: str) -> Requirement | None:
    """One pyproject dependency; None when its marker excludes this machine."""
    spec, _, marker = line.partition(";")
    if marker.strip() and not _marker_holds(marker.strip()):
        return None
    match = _REQUIREMENT.match(spec.strip())
    assert match, f"pyproject.toml dependency {line!r} is not NAME[OP VERSION, ...]"
    specs = tuple((op, release(v)) for op, v in _SPEC.findall(match.group(2)))
    return Requirement(name=match.group(1).lower(), specs=specs, text=spec.strip().replace(" ", ""))


def requirements(repo: Path) -> list[Requirement]:
    """From the checkout's pyproject.toml, else (the kit installed as a wheel) from its installed metadata."""
    import tomllib

    pyproject = repo / "pyproject.toml"
    if pyproject.is_file():
        lines = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    else:
        lines = importlib.metadata.requires("dskit") or []
    return [r for r in (parse(line) for line in lines) if r is not None]


def installed_version(name: str) -> str | None:
    """The version of an importable distribution (metadata and its top-level module both present)."""
    try:
        version = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    module = IMPORT_NAMES.get(name, name.replace("-", "_"))
    return version if importlib.util.find_spec(module) is not None else None


def unmet(reqs: list[Requirement]) -> list[tuple[Requirement, str | None]]:
    """The requirements this interpreter does not meet, with the version it has (None: missing)."""
    out = []
    for req in reqs:
        version = installed_version(req.name)
        if version is None or not req.allows(version):
            out.append((req, version))
    return out


def install_arguments(problems: list[tuple[Requirement, str | None]]) -> list[str]:
    """What to hand pip: the unmet requirements, and the installed torch pinned so that pip leaves it alone."""
    words = [req.text for req, _ in problems]
    torch = installed_version("torch")
    if torch is not None and not any(req.name == "torch" for req, _ in problems):
        words.append(f"torch=={torch}")
    return words


def check(repo: Path) -> str | None:
    """None when this interpreter can run the kit, else the one line saying what is wrong and the fix."""
    here = ".".join(map(str, sys.version_info[:3]))
    if sys.version_info[:2] < MIN_PYTHON:
        return (
            f"{sys.executable} is Python {here}; the kit needs {'.'.join(map(str, MIN_PYTHON))} or newer: "
            "set DSKIT_PYTHON to a newer interpreter"
        )
    problems = unmet(requirements(repo))
    if not problems:
        return None
    what = ", ".join(
        f"{req.name} {version} (needs {req.text})" if version else f"{req.name} (missing)"
        for req, version in problems
    )
    pip = " ".join(f"'{w}'" for w in install_arguments(problems))
    torch_note = (
        "(installs torch: this interpreter has none, or one too old)"
        if any(req.name == "torch" for req, _ in problems)
        else "(pins the installed torch so that pip leaves it alone)"
    )
    return (
        f"{sys.executable} (Python {here}) lacks what the kit needs: {what}. Fix: {sys.executable} -m pip install "
        f"{pip} {torch_note}, or offline from a wheelhouse: WHEELHOUSE=DIR (built by `make wheelhouse`)"
    )


def torch_build() -> tuple[str, str | None]:
    """torch's version and CUDA version as `torch.__version__` and `torch.version.cuda` give them, read from its
    version.py without importing torch (a ~2 CPU-s import the launcher's probe does not need)."""
    spec = importlib.util.find_spec("torch")  # a top-level package: found, not executed
    assert spec is not None and spec.origin is not None, "check() ran first and found torch"
    values: dict[str, str | None] = {}
    for node in ast.parse((Path(spec.origin).parent / "version.py").read_text()).body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and isinstance(getattr(node, "value", None), ast.Constant):
            values[target.id] = node.value.value  # type: ignore[union-attr]
    return str(values.get("__version__") or importlib.metadata.version("torch")), values.get("cuda")


NVIDIA_GPUS = Path(
    "/proc/driver/nvidia/gpus"
)  # one entry per GPU the driver exposes here (a container's own)
NVIDIA_DRIVER = (Path("/dev/nvidiactl"), Path("/proc/driver/nvidia"))


def visible_gpus(torch_cuda: str | None, env: Mapping[str, str] = os.environ) -> int:
    """The GPUs torch.cuda.device_count() would count, without importing torch where the answer is certain: none
    for a CPU build or a node without the NVIDIA driver; the driver's GPUs narrowed by CUDA_VISIBLE_DEVICES
    (indices, as CUDA reads them: up to the first invalid one). Else (UUIDs, MIG) torch counts. The doctor
    compares this count with torch's (DSKIT_NODE_GPUS) before any rank starts."""
    if torch_cuda is None or not any(path.exists() for path in NVIDIA_DRIVER):
        return 0
    try:
        physical = len(list(NVIDIA_GPUS.iterdir()))
    except OSError:
        physical = 0
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if physical and visible is None:
        return physical
    if physical and visible is not None:
        entries = [entry.strip() for entry in visible.split(",")]
        if not any(entry.startswith(("GPU-", "MIG-")) for entry in entries):  # UUIDs: torch resolves them
            valid = [entry.isdigit() and int(entry) < physical for entry in entries]
            return valid.index(False) if False in valid else len(valid)  # CUDA stops at the first invalid one
    import torch

    return torch.cuda.device_count()


def probe() -> str:
    """The launcher's line: GPUs visible, then the versions this run uses."""
    torch_version, torch_cuda = torch_build()
    return " ".join(
        [
            str(visible_gpus(torch_cuda)),
            platform.python_version(),
            torch_version,
            torch_cuda or "none",
            importlib.metadata.version("deepspeed"),
        ]
    )


def main(argv: list[str]) -> int:
    repo = REPO_ROOT
    if argv == ["missing"]:
        problems = unmet(requirements(repo))
        print("\n".join(install_arguments(problems) if problems else []))
        return 0
    if argv == ["probe"]:
        problem = check(repo)
        if problem is not None:
            print(f"error: {problem}", file=sys.stderr)
            return 2
        print(probe())
        return 0
    print("usage: python -m dskit.env.python_env probe|missing", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

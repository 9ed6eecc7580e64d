"""Air-gapped installs: a wheelhouse of every locked dependency, built on a connected machine, installed offline.

`dskit wheelhouse build` (`make wheelhouse`) reads uv.lock, picks for each package of the target environment
(Python version, CPU architecture, glibc) the wheel pip would pick, downloads it from the URL in the lock and
checks it against the lock's sha256; packages published only as a source archive (DeepSpeed) are built into
pure-Python wheels, and the kit's own wheel is added. The directory then holds the wheels, requirements.txt
(every pin with the sha256 of the file beside it) and dskit-wheelhouse.json (what it was built for).

`install` runs on the cluster under the base interpreter, standard library only, with no network: it makes
`.venv` (a plain venv with every pin installed by pip --no-index --require-hashes; or, over DSKIT_PYTHON, a venv
that sees that interpreter's packages and gets only what it lacks, its torch pinned so pip leaves it alone).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

from dskit.env.uv import uv_command
from model_utils.repo import REPO_ROOT

MANIFEST = "dskit-wheelhouse.json"
REQUIREMENTS = "requirements.txt"
# pytest for the gpu tests of `make gpu-check` (a container with no network has no pytest either)
TEST_REQUIREMENTS = "requirements-test.txt"
TEST_TOOLS = ("pytest", "pytest-timeout")
# Beside the venv's interpreter: which wheelhouse and base interpreter made it (a later launch skips the install).
STAMP = "dskit-wheelhouse.json"
FORMAT = 1


class WheelhouseError(Exception):
    """A user-fixable problem: printed as one `error:` line, exit 2."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def lock_digest(repo: Path) -> str:
    return _sha256(repo / "uv.lock")


# --- build (a connected machine, the kit's environment) ------------------------------------------------------


def target_environment(python: str, machine: str) -> dict[str, str]:
    """PEP 508 marker values of a Linux CPython target (the clusters the kit runs on)."""
    return {
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "python_version": python,
        "python_full_version": f"{python}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "os_name": "posix",
        "platform_machine": machine,
        "implementation_version": f"{python}.0",
        "platform_release": "",
        "platform_version": "",
        "extra": "",
    }


def target_tags(python: str, machine: str, glibc: str) -> list:
    """The wheel tags a target accepts, best first: manylinux down from its glibc, then pure Python."""
    from packaging import tags

    major, minor = (int(x) for x in glibc.split("."))
    platforms = [f"manylinux_{major}_{m}_{machine}" for m in range(minor, 4, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    platforms += [f"{legacy[m]}_{machine}" for m in legacy if m <= minor]
    version = tuple(int(x) for x in python.split("."))
    return [
        *tags.cpython_tags(version, platforms=platforms),
        *tags.compatible_tags(version, f"cp{version[0]}{version[1]}", platforms),
    ]


def locked_pins(repo: Path, environment: dict[str, str]) -> list[tuple[str, str]]:
    """(name, version) of every runtime dependency of the kit for this target (uv export, markers evaluated)."""
    from packaging.markers import Marker

    export = ["export", "--project", str(repo), "--frozen", "--no-dev", "--no-emit-project", "--no-hashes"]
    export += ["--no-header", "--no-annotate", "--format", "requirements-txt"]
    out = subprocess.run(
        [*_uv(), *export],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    pins = []
    for line in out.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        spec, _, marker = line.partition(";")
        name, _, version = spec.strip().partition("==")
        assert version, f"uv export gave an unpinned line: {line}"
        if marker.strip() and not Marker(marker.strip()).evaluate(environment):
            continue
        pins.append((name.strip(), version.strip()))
    return pins


def closure(lock: dict, roots: tuple[str, ...], environment: dict[str, str]) -> list[tuple[str, str]]:
    """(name, version) of the roots and everything they need on the target, from the lock's dependency graph."""
    from packaging.markers import Marker
    from packaging.utils import canonicalize_name

    by_name: dict[str, list[dict]] = {}
    for package in lock["package"]:
        by_name.setdefault(canonicalize_name(package["name"]), []).append(package)
    seen: dict[str, str] = {}
    todo = [{"name": root} for root in roots]
    while todo:
        dep = todo.pop()
        name = canonicalize_name(dep["name"])
        if name in seen or ("marker" in dep and not Marker(dep["marker"]).evaluate(environment)):
            continue
        candidates = [p for p in by_name[name] if dep.get("version") in (None, p["version"])]
        assert len(candidates) == 1, f"uv.lock: {name} is ambiguous here ({len(candidates)} entries)"
        seen[name] = candidates[0]["version"]
        todo += candidates[0].get("dependencies", [])
    return sorted(seen.items())


def choose_files(lock: dict, pins: list[tuple[str, str]], tag_order: list) -> list[dict]:
    """For each pin, the lock's best wheel for the target (by tag order), else its source archive."""
    from packaging.utils import canonicalize_name, parse_wheel_filename

    rank = {tag: i for i, tag in enumerate(tag_order)}
    packages = {(canonicalize_name(p["name"]), p.get("version")): p for p in lock["package"]}
    chosen = []
    for name, version in pins:
        package = packages.get((canonicalize_name(name), version))
        assert package is not None, f"{name}=={version} from uv export is not in uv.lock"
        best = None
        for wheel in package.get("wheels", []):
            filename = wheel["url"].rsplit("/", 1)[-1]
            score = min((rank[t] for t in parse_wheel_filename(filename)[3] if t in rank), default=None)
            if score is not None and (best is None or score < best[0]):
                best = (score, wheel, filename)
        if best is not None:
            chosen.append({"name": name, "version": version, "file": best[2], **best[1], "build": False})
        elif "sdist" in package:
            sdist = package["sdist"]
            filename = sdist["url"].rsplit("/", 1)[-1]
            chosen.append({"name": name, "version": version, "file": filename, **sdist, "build": True})
        else:
            raise WheelhouseError(
                f"{name}=={version} has no wheel for this target and no source archive in uv.lock: "
                "pick another --python/--machine/--glibc"
            )
    return chosen


def _uv() -> list[str]:
    """uv as `make env` bootstrapped it (on PATH, or `python3 -m uv`)."""
    uv = uv_command()
    if uv is None:
        raise WheelhouseError("uv not found (neither `uv` nor `python3 -m uv`): python3 -m pip install uv")
    return uv


def _download(url: str, expected: str, dest: Path) -> None:
    import urllib.request

    algorithm, _, want = expected.partition(":")
    assert algorithm == "sha256", expected
    if dest.exists() and _sha256(dest) == want:
        return
    partial = dest.with_name(dest.name + ".part")
    with urllib.request.urlopen(url, timeout=60) as response, partial.open("wb") as f:
        shutil.copyfileobj(response, f, length=1 << 20)
    got = _sha256(partial)
    if got != want:
        partial.unlink()
        raise WheelhouseError(f"{dest.name}: sha256 {got} is not the lock's {want}: download it again")
    partial.replace(dest)


def build(repo: Path, out: Path, python: str, machine: str, glibc: str) -> dict:
    import tomllib
    from concurrent.futures import ThreadPoolExecutor

    if out.exists() and any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise WheelhouseError(f"{out} exists and is not a wheelhouse: give an empty or new directory")
    out.mkdir(parents=True, exist_ok=True)
    lock = tomllib.loads((repo / "uv.lock").read_text())
    environment, tags = target_environment(python, machine), target_tags(python, machine, glibc)
    files = choose_files(lock, locked_pins(repo, environment), tags)
    from packaging.utils import canonicalize_name

    runtime = {canonicalize_name(f["name"]) for f in files}
    test_files = choose_files(
        lock, [p for p in closure(lock, TEST_TOOLS, environment) if p[0] not in runtime], tags
    )
    downloads = [f for f in files + test_files if not f["build"]]
    print(
        f"wheelhouse: {len(downloads)} wheels to fetch for Python {python} {machine} glibc {glibc}",
        flush=True,
    )
    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(lambda f: _download(f["url"], f["hash"], out / f["file"]), downloads))
    builds = out / ".build"
    builds.mkdir(exist_ok=True)
    for f in files:
        if f["build"]:
            _download(f["url"], f["hash"], builds / f["file"])
            f["file"] = _build_wheel(builds / f["file"], out, f["name"])
            f["hash"] = f"sha256:{_sha256(out / f['file'])}"  # the wheel's now, not the source archive's
    kit = _build_wheel(repo, out, "dskit")
    shutil.rmtree(builds)
    keep = {f["file"] for f in files + test_files} | {kit}
    for stale in out.glob("*.whl"):
        if stale.name not in keep:
            stale.unlink()
    lines = [f"{f['name']}=={f['version']} --hash={f['hash']}" for f in files]
    # the kit too (its `dskit` command; the launchers still run the checkout's code, first on PYTHONPATH)
    lines.append(f"dskit=={kit.split('-')[1]} --hash=sha256:{_sha256(out / kit)}")
    (out / REQUIREMENTS).write_text("\n".join(lines) + "\n")
    tests = [f"{f['name']}=={f['version']} --hash={f['hash']}" for f in test_files]
    (out / TEST_REQUIREMENTS).write_text("\n".join(tests) + "\n")
    size = sum((out / name).stat().st_size for name in keep)
    manifest = {
        "format": FORMAT,
        "lock_sha256": lock_digest(repo),
        "python": python,
        "machine": machine,
        "glibc": glibc,
        "kit_wheel": kit,
        "packages": len(lines),
        "test_packages": len(tests),
        "bytes": size,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _build_wheel(source: Path, out: Path, name: str) -> str:
    """A pure-Python wheel from a source archive or tree (uv build); platform wheels must come from the index."""
    before = set(out.glob("*.whl"))
    proc = subprocess.run(
        [*_uv(), "build", "--wheel", "--quiet", "--out-dir", str(out), str(source)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise WheelhouseError(f"building a wheel of {name} failed: {proc.stderr.strip().splitlines()[-1:]}")
    made = [p for p in out.glob("*.whl") if p not in before] or sorted(
        out.glob(f"{name.replace('-', '_')}-*.whl")
    )
    assert made, f"uv build wrote no wheel of {name}"
    wheel = made[0].name
    if not wheel.endswith("-none-any.whl"):
        raise WheelhouseError(
            f"{name} builds a platform wheel ({wheel}): build the wheelhouse on a machine like the target"
        )
    return wheel


# --- install (the cluster: standard library only, no network) ------------------------------------------------


def read_manifest(wheelhouse: Path) -> dict:
    path = wheelhouse / MANIFEST
    if not path.is_file():
        raise WheelhouseError(
            f"WHEELHOUSE={wheelhouse} has no {MANIFEST}: build one with `make wheelhouse` on a connected machine "
            "and copy the whole directory"
        )
    return json.loads(path.read_text())


def check_target(manifest: dict, wheelhouse: Path, repo: Path) -> None:
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if manifest.get("lock_sha256") != lock_digest(repo):
        raise WheelhouseError(
            f"WHEELHOUSE={wheelhouse} was built from another uv.lock than this repo's: rebuild it from this "
            "checkout with `make wheelhouse`"
        )
    if manifest.get("python") != here or manifest.get("machine") != platform.machine():
        raise WheelhouseError(
            f"WHEELHOUSE={wheelhouse} is for Python {manifest.get('python')} on {manifest.get('machine')}, this "
            f"interpreter ({sys.executable}) is Python {here} on {platform.machine()}: rebuild it with "
            f"`make wheelhouse WHEELHOUSE_PYTHON={here} WHEELHOUSE_MACHINE={platform.machine()}`"
        )


def install(wheelhouse: Path, venv: Path, repo: Path, overlay: bool, test_tools: bool = False) -> None:
    """Make `venv` from the wheelhouse with this interpreter as its base (overlay: see its packages too).

    Jobs that start at once (an array's tasks, two launches) take turns: the first installs, the others then
    find it up to date.
    """
    import fcntl

    venv = venv.absolute()
    with open(venv.parent / f".{venv.name}.install-lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _install(wheelhouse.resolve(), venv, repo, overlay)
        if test_tools:
            _install_test_tools(wheelhouse.resolve(), venv, overlay)


def _install_test_tools(wheelhouse: Path, venv: Path, overlay: bool) -> None:
    """pytest for `make gpu-check`'s gpu tests (pip leaves what is there already as it is)."""
    pip = _pip_install(venv, wheelhouse)
    if overlay:  # the base may have its own pytest: keep it
        _pip([*pip, *TEST_TOOLS])
    else:
        _pip([*pip, "--no-deps", "--require-hashes", "-r", str(wheelhouse / TEST_REQUIREMENTS)])


def _install(wheelhouse: Path, venv: Path, repo: Path, overlay: bool) -> None:
    manifest = read_manifest(wheelhouse)
    check_target(manifest, wheelhouse, repo)
    want = {
        "lock_sha256": manifest["lock_sha256"],
        "base": os.path.realpath(sys.executable),
        "overlay": overlay,
    }
    stamp = venv / STAMP
    if venv.exists():
        if not stamp.is_file():
            raise WheelhouseError(
                f"{venv} exists and was not installed from a wheelhouse (uv's environment?): move it away "
                f"(mv {venv} {venv}.uv) or unset WHEELHOUSE"
            )
        have = json.loads(stamp.read_text())
        if have == want:
            print(f"Python: {venv} from the wheelhouse (up to date)", flush=True)
            return
        if have.get("base") != want["base"] or have.get("overlay") != overlay:
            raise WheelhouseError(
                f"{venv} was made over {have.get('base')}, not {want['base']}: remove it (rm -rf {venv}) "
                "to install it again"
            )
        stamp.unlink()
    start = time.monotonic()
    if not venv.exists():
        proc = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise WheelhouseError(
                f"{sys.executable} -m venv failed ({_last_line(proc.stderr)}): install the venv module "
                "(e.g. apt-get install python3-venv)"
            )
        if overlay:
            _see_base_packages(venv)
    python = venv / "bin" / "python"
    pip = _pip_install(venv, wheelhouse)
    if overlay:
        missing = subprocess.run(
            [str(python), "-m", "dskit.env.python_env", "missing"], capture_output=True, text=True, check=True
        ).stdout.split()
        what = f"{len(missing)} requirement(s) the base lacks: {' '.join(missing)}" if missing else "nothing"
        print(f"Python: {venv} over {sys.executable}; installing {what}", flush=True)
        if missing:
            _pip([*pip, *missing])
    else:
        print(
            f"Python: installing {manifest['packages']} locked packages from {wheelhouse} into {venv}",
            flush=True,
        )
        _pip([*pip, "--no-deps", "--require-hashes", "-r", str(wheelhouse / REQUIREMENTS)])
    tmp = stamp.with_name(stamp.name + ".tmp")
    tmp.write_text(json.dumps(want) + "\n")
    tmp.replace(stamp)
    print(f"Python: {venv} installed from the wheelhouse in {time.monotonic() - start:.0f} s", flush=True)


def _see_base_packages(venv: Path) -> None:
    """Let the venv import this interpreter's packages (after its own): torch stays where the image put it.

    Through a .pth file rather than --system-site-packages, which would reach only the base installation's
    packages when this interpreter is itself a venv's; addsitedir also reads the .pth files found there.
    """
    import site

    dirs = [d for d in site.getsitepackages() if Path(d).is_dir()]
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    lines = [f"import site; site.addsitedir({d!r})" for d in dirs]
    (venv / "lib" / version / "site-packages" / "_dskit_base_packages.pth").write_text(
        "\n".join(lines) + "\n"
    )


def _pip_install(venv: Path, wheelhouse: Path) -> list[str]:
    """The venv's `pip install`, from the wheelhouse only."""
    pip = [
        str(venv / "bin" / "python"),
        "-m",
        "pip",
        "install",
        "--no-index",
        "--find-links",
        str(wheelhouse),
    ]
    return [*pip, "--disable-pip-version-check", "--quiet"]


def _pip(command: list[str]) -> None:
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        raise WheelhouseError(
            f"pip install from the wheelhouse failed: {_last_line(proc.stderr or proc.stdout)}"
        )


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dskit wheelhouse", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser(
        "build", help="download/build every locked dependency for a target into DIR (needs network)"
    )
    b.add_argument("out", type=Path, help="the wheelhouse directory (created; rebuilt in place)")
    b.add_argument(
        "--python", default=f"{sys.version_info[0]}.{sys.version_info[1]}", help="target Python X.Y"
    )
    b.add_argument("--machine", default=platform.machine(), choices=("x86_64", "aarch64"), help="target CPU")
    b.add_argument("--glibc", default=None, help="the target's glibc X.Y (default: this machine's)")
    i = sub.add_parser(
        "install", help="make a venv from a wheelhouse with no network (the launchers run this)"
    )
    i.add_argument("wheelhouse", type=Path)
    i.add_argument("--venv", type=Path, default=Path(".venv"))
    i.add_argument(
        "--overlay", action="store_true", help="a venv that sees this interpreter's packages (DSKIT_PYTHON)"
    )
    i.add_argument("--test_tools", action="store_true", help="also pytest, for make gpu-check's gpu tests")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    repo = REPO_ROOT
    try:
        if args.command == "build":
            glibc = args.glibc or platform.libc_ver()[1]
            if not glibc or glibc.count(".") != 1:
                raise WheelhouseError(f"glibc {glibc!r}: give the target's as --glibc X.Y (e.g. 2.28)")
            manifest = build(repo, args.out, args.python, args.machine, glibc)
            print(
                f"wheelhouse: {args.out}: {manifest['packages']} packages (the kit's own among them), "
                f"{manifest['bytes'] / 2**30:.2f} GiB; on the cluster: WHEELHOUSE={args.out} ./train-singlenode.sh"
            )
        else:
            install(args.wheelhouse, args.venv, repo, args.overlay, args.test_tools)
    except WheelhouseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

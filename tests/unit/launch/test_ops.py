"""DeepSpeed's JIT-built ops (launch/ops.py): a TORCH_CUDA_ARCH_LIST DeepSpeed can parse, the environment's own ninja,
the set-up `make warm` shares with training, and a first build announced (around stand-in builders: a real first
build takes 20 s to minutes here)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from model_utils.errors import ConfigError
from model_utils.launch import ops
from support.fake_commands import executable

REPO = Path(__file__).resolve().parents[3]


# --- TORCH_CUDA_ARCH_LIST and DeepSpeed's op builder --------------------------------------------------------


def _deepspeed_capability_args(arch_list: str, jit: bool, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """DeepSpeed 0.19.8's own parse of TORCH_CUDA_ARCH_LIST (CUDAOpBuilder.compute_capability_args), as
    jit_load (jit=True) or a pre-build (jit=False) runs it; an explicit arch list needs no GPU."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    monkeypatch.setenv(ops.ARCH_LIST_ENV, arch_list)  # the builder rewrites it; monkeypatch restores it
    builder = FusedAdamBuilder()
    builder.jit_mode = jit
    builder._jit_arch_list = arch_list if jit else None  # what jit_load captures from the environment
    return builder.compute_capability_args()


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        ("8.0;9.0a", "8.0;9.0"),
        ("9.0a+PTX", "9.0+PTX"),
        ("8.0 9.0 10.0f", "8.0;9.0;10.0"),
        ("9.0;9.0a", "9.0"),
    ],
)
@pytest.mark.parametrize("jit", [True, False])
def test_arch_suffixes_break_deepspeed_and_normalising_fixes_it(
    raw: str, normal: str, jit: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match=r"invalid literal for int\(\) with base 10: '0[af]'"):
        _deepspeed_capability_args(raw, jit, monkeypatch)
    assert ops.normalize_cuda_arch_list(raw) == normal
    args = _deepspeed_capability_args(normal, jit, monkeypatch)
    if not jit:
        assert "-gencode=arch=compute_90,code=sm_90" in args


def test_prepare_jit_env_rewrites_only_what_deepspeed_cannot_parse(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    venv_first = {"PATH": str(Path(sys.executable).parent)}  # as prepare_jit_env leaves it (the next test)
    env = {ops.ARCH_LIST_ENV: "8.0;9.0a", **venv_first}
    ops.prepare_jit_env(env)
    assert env == {
        ops.ARCH_LIST_ENV: "8.0;9.0",
        ops.EXTENSIONS_DIR_ENV: str(REPO / ".cache" / "torch_extensions"),  # one build per checkout
        **venv_first,
    }
    assert "TORCH_CUDA_ARCH_LIST='8.0;9.0a' -> '8.0;9.0'" in capsys.readouterr().out
    env = {ops.ARCH_LIST_ENV: "8.0 9.0+PTX", ops.EXTENSIONS_DIR_ENV: "/shared/ext", **venv_first}
    ops.prepare_jit_env(env)
    assert env == {
        ops.ARCH_LIST_ENV: "8.0 9.0+PTX",
        ops.EXTENSIONS_DIR_ENV: "/shared/ext",
        **venv_first,
    }
    assert capsys.readouterr().out == ""
    with pytest.raises(ConfigError, match="'Hopper', which DeepSpeed's op builder cannot parse: use numeric"):
        ops.prepare_jit_env({ops.ARCH_LIST_ENV: "Hopper"})


def test_every_entry_builds_ops_with_the_environments_own_ninja() -> None:
    """`make warm` (the system PATH) and a job (.venv/bin first) found different ninjas, whose build logs differ:
    every fresh job rebuilt the ops. prepare_jit_env, which both run, puts this Python's ninja first."""
    venv_bin = Path(sys.executable).parent
    if not (venv_bin / "ninja").is_file():
        pytest.skip("no ninja installed beside this Python")
    for path in ("/usr/bin:/bin", f"/usr/bin:{venv_bin}:/bin", str(venv_bin)):
        env = {"PATH": path, ops.EXTENSIONS_DIR_ENV: "/x"}
        ops.prepare_jit_env(env)
        ops.prepare_jit_env(env)  # idempotent
        assert shutil.which("ninja", path=env["PATH"]) == str(venv_bin / "ninja")
        assert env["PATH"].split(":").count(str(venv_bin)) == 1
        assert env["PATH"].split(":")[1:] == [p for p in path.split(":") if p != str(venv_bin)]


def test_training_and_the_warm_step_share_the_jit_env_setup() -> None:
    makefile = (REPO / "Makefile").read_text()
    warm = makefile[makefile.index("\nwarm:") :].split("\n\n")[0]
    assert "ops.warm_deepspeed_ops(" in warm
    assert "kernels.optimize_model(" in (REPO / "src" / "model_utils" / "loop" / "trainer.py").read_text()


def test_make_tools_says_what_the_tests_install_and_why_before_it_does(tmp_path: Path) -> None:
    """As root on Debian, `make tools` (the first step of `make test`) installs what the tests lack: it names each
    package and why before apt-get runs, and the SLURM tests' packages, which tests/slurm/cluster.sh installs
    later; nothing when all is there. apt-get, dpkg-query and `id` are stand-ins (nothing is installed here), and
    PATH has nothing else but sed, so shellcheck and ccache are missing."""
    out = tmp_path / "out"
    bin_dir = tmp_path / "bin"
    executable(bin_dir / "id", "#!/bin/sh\necho 0\n")  # root
    executable(bin_dir / "dpkg-query", "#!/bin/sh\nexit 1\n")  # no package installed
    executable(bin_dir / "apt-get", '#!/bin/sh\necho "apt-get $*" >> "$OUT"\n')
    (bin_dir / "sed").symlink_to(shutil.which("sed"))
    make = [shutil.which("make"), "-s", "-C", str(REPO), "tools"]
    with out.open("a") as stdout:  # the stand-in apt-get appends to the same file: the order is kept
        subprocess.run(make, env={"PATH": str(bin_dir), "OUT": str(out)}, stdout=stdout, check=True)
    assert out.read_text().splitlines() == [
        "As root on Debian, the tests install with apt-get what they lack (with its dependencies):",
        "  shellcheck, now: it lints the rendered launchers",
        "  ccache, now: DeepSpeed's ops compile through it, for other checkouts here to reuse (ops built before "
        "it are rebuilt once)",
        "  munge slurmctld slurmd slurm-client iproute2 util-linux, when the SLURM tests start (make test): their "
        "2-node cluster on this machine (tests/slurm/cluster.sh)",
        "apt-get install -y -qq shellcheck",
        "apt-get install -y -qq ccache",
    ]
    executable(bin_dir / "dpkg-query", "#!/bin/sh\necho 'install ok installed'\n")
    for tool in ("shellcheck", "ccache"):
        executable(bin_dir / tool, "#!/bin/sh\n")
    out.write_text("")
    with out.open("a") as stdout:
        subprocess.run(make, env={"PATH": str(bin_dir), "OUT": str(out)}, stdout=stdout, check=True)
    assert out.read_text() == ""  # all there: nothing said, nothing installed


def test_the_warm_step_builds_the_ops_the_default_cpu_run_loads() -> None:
    """`make warm` names its ops (one process each, side by side): those of the embedded default on CPU ranks, as
    the engine says (engines.jit_ops, which the ranks build and the doctor checks), so no timed test builds one."""
    import re

    from model_utils import engines
    from model_utils.config.arguments import parse_args
    from model_utils.resolve import train_settings

    warm_ops = re.search(r"^WARM_OPS := (.+)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert warm_ops is not None
    settings = train_settings.resolve(parse_args([]))
    default_ops = engines.jit_ops(settings.backend, settings.deepspeed_json(1, 1), "cpu")
    assert sorted(warm_ops.group(1).split()) == sorted(default_ops)


# --- DeepSpeed's JIT ops: a first build announced (build_ops) -------------------------------------------------
# Around a stand-in builder: a real first build of an op takes 20 s to minutes of this machine's 2 cores.


class StandInBuilder:
    """An op builder whose load() "builds" by writing the op's library where torch's cpp_extension would."""

    def __init__(self, name: str, root: Path, error: Exception | None = None) -> None:
        self.name, self.root, self.error, self.loads = name, root, error, []

    def load(self, verbose: bool = True) -> None:
        self.loads.append(verbose)
        if self.error is not None:
            raise self.error
        (self.root / self.name).mkdir(parents=True, exist_ok=True)
        (self.root / self.name / f"{self.name}.so").write_bytes(b"")


@pytest.fixture
def extensions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(ops.EXTENSIONS_DIR_ENV, str(tmp_path / "ext"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RANK", "0")
    return tmp_path / "ext"


def test_a_first_build_is_announced_with_its_time_and_then_its_result(
    extensions: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    builder = StandInBuilder("cpu_adam", extensions)
    ops.build_ops(["CPUAdamBuilder"], "cpu", {"CPUAdamBuilder": builder}.get)
    lines = [line.split(" | ", 1)[1] for line in capsys.readouterr().out.splitlines()]
    assert lines[0] == (
        "Building DeepSpeed op cpu_adam (first use on this machine; about 1-3 min on CPU; cached in ext; "
        "the other ranks wait for it) ..."
    )
    assert re.fullmatch(r"Built DeepSpeed op cpu_adam in \d+s", lines[1]), lines
    assert len(lines) == 2 and builder.loads == [False]  # torch's compiler lines stay out of the log


def test_other_ranks_build_without_a_word(
    extensions: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    builder = StandInBuilder("deepspeed_shm_comm", extensions)
    monkeypatch.setenv("RANK", "1")
    ops.build_ops(["ShareMemCommBuilder", "NoSuchBuilder"], "cpu", {"ShareMemCommBuilder": builder}.get)
    assert builder.loads == [False] and capsys.readouterr().out == ""  # rank 1 waits on the build, quietly


# A real op of torch's JIT build, where what is asked is whether a build holds: ninja decides it from the build
# file torch writes, the commands it last ran and the files' times.
TINY_OP_SOURCE = 'extern "C" int dskit_tiny_op() { return 42; }\n'
BUILD_IN_A_PROCESS = (
    "import sys; from model_utils.launch import ops; ops.prepare_jit_env(); "
    "from torch.utils import cpp_extension; cpp_extension.load(sys.argv[1], [sys.argv[2]], is_python_module=False)"
)


class TinyOpBuilder:
    """An op loaded as DeepSpeed's builders load theirs (torch's cpp_extension.load): one C++ file without torch's
    headers, so it builds in a second where DeepSpeed's take minutes. `loads`: the names it was loaded under."""

    def __init__(self, name: str, source: Path) -> None:
        self.name, self.source, self.loads = name, source, []

    def load(self, verbose: bool = False) -> str:
        from torch.utils import cpp_extension

        self.loads.append(self.name)
        return cpp_extension.load(self.name, [str(self.source)], is_python_module=False, verbose=verbose)


def tiny_op_built_without_ccache(name: str, tmp_path: Path) -> TinyOpBuilder:
    """The op built as `make warm` built the ops on a machine without ccache (no compiler wrapper), in a process
    of its own as by an earlier launch (torch remembers the ops it loaded in a process)."""
    source = tmp_path / f"{name}.cpp"
    source.write_text(TINY_OP_SOURCE)
    env = {**os.environ, "TORCH_NO_COMPILER_WRAPPER": "1"}
    subprocess.run([sys.executable, "-c", BUILD_IN_A_PROCESS, name, str(source)], env=env, check=True)
    return TinyOpBuilder(name, source)


def test_an_op_whose_build_no_longer_holds_is_rebuilt_and_says_so(
    extensions: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """ccache installed after the ops were built (`make test` installs it as root): torch then compiles through
    it, so ninja recompiles every op at its next load. That rebuild is announced like a first one; an op whose
    build holds is left to DeepSpeed without a word."""
    builder = tiny_op_built_without_ccache("kernels_tiny_op", tmp_path)
    library = extensions / "kernels_tiny_op" / "kernels_tiny_op.so"
    built_at = library.stat().st_mtime_ns
    create = {"TinyOpBuilder": builder}.get
    monkeypatch.setenv("TORCH_NO_COMPILER_WRAPPER", "1")  # as it was built
    ops.build_ops(["TinyOpBuilder"], "cpu", create)
    assert capsys.readouterr().out == "" and "kernels_tiny_op" not in builder.loads
    assert library.stat().st_mtime_ns == built_at
    # A ccache on PATH (a stand-in that runs the compiler; torch puts the ccache it finds before the compiler).
    monkeypatch.delenv("TORCH_NO_COMPILER_WRAPPER")
    executable(tmp_path / "ccache-bin" / "ccache", '#!/bin/sh\nexec "$@"\n')
    monkeypatch.setenv("PATH", f"{tmp_path / 'ccache-bin'}{os.pathsep}{os.environ['PATH']}")
    ops.build_ops(["TinyOpBuilder"], "cpu", create)
    lines = [line.split(" | ", 1)[1] for line in capsys.readouterr().out.splitlines()]
    assert lines[0] == (
        "Rebuilding DeepSpeed op kernels_tiny_op (out of date since its last build, ninja: command line changed "
        "for kernels_tiny_op.o; a few minutes on CPU; cached in ext; the other ranks wait for it) ..."
    ), lines
    assert re.fullmatch(r"Built DeepSpeed op kernels_tiny_op in \d+s", lines[1]) and len(lines) == 2, lines
    assert library.stat().st_mtime_ns != built_at  # rebuilt, as said
    assert "cxx = ccache c++" in (extensions / "kernels_tiny_op" / "build.ninja").read_text()
    assert ops.build_reason(builder, extensions) is None  # the next load takes it as it is


def test_a_failed_build_is_one_line_naming_the_op_with_its_output_kept(
    extensions: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    error = RuntimeError(
        "Error building extension 'fused_adam'\nfused_adam.cu:1: fatal error: cuda.h missing"
    )
    builder = StandInBuilder("fused_adam", extensions, error)
    with pytest.raises(ConfigError) as raised:
        ops.build_ops(["FusedAdamBuilder"], "cuda", {"FusedAdamBuilder": builder}.get)
    message = str(raised.value)
    assert "\n" not in message and message.startswith(
        "DeepSpeed op fused_adam did not build (0s): Error building"
    )
    assert "full output: ext/fused_adam/build-error.log" in message and "ds_report" in message
    assert "cuda.h missing" in (extensions / "fused_adam" / "build-error.log").read_text()
    assert "a few minutes on CUDA" in capsys.readouterr().out

"""`make test`: the suite as three pytest processes side by side.

One after the other, the tests leave a core idle much of the time: the SLURM tests and the tests that drive a
whole launcher (marked `slurm` and `launcher`) mostly wait, on the scheduler, a requeue's start-up delay, a
launcher's preflight or a subprocess. So they run beside the tests that compute, in three tiers of about the same
length: "e2e" (the multi-rank runs in process), "unit+slurm" (the unit tests beside the SLURM tests' waits) and
"launchers". The first tier reports live; the others' reports follow once all are done.

    python tools/test_tiers.py [PYTEST ARGS...]      # the args go to every tier (e.g. -x, -k EXPR, paths)

Tests marked `quiet` (they compare ranks' timings on one machine) run while the other tiers pause between two
of their tests: every tier gets DSKIT_TEST_TIER_LOCK (tests/support/tier_lock.py).

Exit status: 0 when every tier passes, else the first non-zero one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# (name, marker expression): together they select every test once.
TIERS = (
    ("e2e", "e2e and not (slurm or launcher)"),
    ("unit+slurm", "slurm or not (e2e or launcher)"),
    ("launchers", "launcher and not slurm"),
)
NO_TESTS_COLLECTED = 5  # pytest's status for a tier with nothing selected (e.g. a -k that matches none of it)


def _pytest(marker: str, args: list[str]) -> list[str]:
    named = any(not a.startswith("-") and (REPO / a.split("::")[0]).exists() for a in args)
    # The slowest tests of each tier at the end: where the suite's time goes, from every run.
    return [
        sys.executable, "-m", "pytest", *([] if named else ["tests"]), "-q", "--durations=15", "-m", marker, *args,
    ]  # fmt: skip


def main(args: list[str]) -> int:
    started = time.monotonic()
    env = {**os.environ, "DSKIT_TEST_TIER_LOCK": str(REPO / ".cache" / "test-tiers.lock")}
    (first, first_marker), *others = TIERS
    logs = {name: REPO / ".cache" / f"test-tier-{name.replace('+', '-')}.log" for name, _ in others}
    ended: dict[str, float] = {}
    background: dict[str, subprocess.Popen] = {}
    try:
        for name, marker in others:
            logs[name].parent.mkdir(parents=True, exist_ok=True)
            with logs[name].open("w") as out:
                # Its own process group, so an interrupted run ends all of its processes; no cache plugin, whose
                # end-of-run write would race the first tier's.
                background[name] = subprocess.Popen(
                    [*_pytest(marker, args), "-p", "no:cacheprovider"],
                    cwd=REPO,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            print(f"tier {name} ({marker}): running beside this one, reported at the end", flush=True)

        def watch(name: str, proc: subprocess.Popen) -> None:
            proc.wait()
            ended[name] = time.monotonic()

        watchers = [threading.Thread(target=watch, args=item, daemon=True) for item in background.items()]
        for watcher in watchers:
            watcher.start()
        statuses = {first: subprocess.run(_pytest(first_marker, args), cwd=REPO, env=env).returncode}
        ended[first] = time.monotonic()
        for watcher in watchers:
            watcher.join()
    except BaseException:
        for proc in background.values():
            os.killpg(proc.pid, signal.SIGTERM)
        raise
    for name, _ in others:
        print(f"\n===== tier {name}, from {logs[name].relative_to(REPO)} =====", flush=True)
        sys.stdout.write(logs[name].read_text(errors="replace"))
        statuses[name] = background[name].returncode
    said = ", ".join(f"{name} exit {statuses[name]} in {ended[name] - started:.0f} s" for name, _ in TIERS)
    print(f"\ntiers: {said} (wall {time.monotonic() - started:.0f} s)")
    return next((s for s in statuses.values() if s not in (0, NO_TESTS_COLLECTED)), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

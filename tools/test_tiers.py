"""`make test`: the suite as two pytest processes side by side.

Run one after the other, the tiers leave one of two cores idle about half the time: the SLURM tests and the
tests that drive a whole launcher (marked `slurm` and `launcher`) mostly wait on the scheduler, a requeue's
start-up delay, a launcher's preflight or a subprocess. So they run as the "launchers" tier beside the "main"
tier (everything else). The main tier reports live; the launchers tier's report follows it once both are done.

    python tools/test_tiers.py [PYTEST ARGS...]      # the args go to both tiers (e.g. -x, -k EXPR, paths)

Tests marked `quiet` (they compare ranks' timings on one machine) run while the other tier pauses between two
of its tests: both tiers get DSKIT_TEST_TIER_LOCK (tests/support/tier_lock.py).

Exit status: 0 when both tiers pass, else the first non-zero one.
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
LAUNCHERS = "slurm or launcher"
NO_TESTS_COLLECTED = 5  # pytest's status for a tier with nothing selected (e.g. a -k that matches none of it)


def _pytest(marker: str, args: list[str]) -> list[str]:
    named = any(not a.startswith("-") and (REPO / a.split("::")[0]).exists() for a in args)
    # The slowest tests of each tier at the end: where the suite's time goes, from every run.
    return [
        sys.executable, "-m", "pytest", *([] if named else ["tests"]), "-q", "--durations=15", "-m", marker, *args,
    ]  # fmt: skip


def main(args: list[str]) -> int:
    log = REPO / ".cache" / "test-tier-launchers.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    env = {**os.environ, "DSKIT_TEST_TIER_LOCK": str(REPO / ".cache" / "test-tiers.lock")}
    with log.open("w") as out:
        # Its own process group, so an interrupted run ends all of its processes; no cache plugin, whose end-of-run
        # write would race the main tier's.
        launchers = subprocess.Popen(
            [*_pytest(LAUNCHERS, args), "-p", "no:cacheprovider"],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    ended: list[float] = []  # when the launchers tier ended (it may end before the main tier)
    watcher = threading.Thread(target=lambda: (launchers.wait(), ended.append(time.monotonic())), daemon=True)
    watcher.start()
    try:
        print(f"tier launchers ({LAUNCHERS}): running beside this one, reported at the end", flush=True)
        main_status = subprocess.run(_pytest(f"not ({LAUNCHERS})", args), cwd=REPO, env=env).returncode
        main_seconds = time.monotonic() - started
        watcher.join()
    except BaseException:
        os.killpg(launchers.pid, signal.SIGTERM)
        raise
    launchers_status = launchers.returncode
    launchers_seconds = ended[0] - started
    print(f"\n===== tier launchers ({LAUNCHERS}), from {log.relative_to(REPO)} =====", flush=True)
    sys.stdout.write(log.read_text(errors="replace"))
    statuses = [0 if s == NO_TESTS_COLLECTED else s for s in (main_status, launchers_status)]
    print(
        f"\ntiers: main exit {main_status} in {main_seconds:.0f} s, launchers exit {launchers_status} in "
        f"{launchers_seconds:.0f} s (wall {time.monotonic() - started:.0f} s)"
    )
    return next((s for s in statuses if s != 0), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`accelerate launch --config_file X --main_process_port 0 SCRIPT OUT` for each config, one after the other in one
process: the console script's own code (accelerate.commands.launch: its parser, `launch_command`, its launchers
and their torchrun), with accelerate and torch imported once instead of once per launch (8 launches side by side
took 25-53 s of a `make test`'s wall time, mostly those imports). Run as a script (tests/e2e/test_accelerate_env.py):

    python accelerate_launches.py SCRIPT NAME=CONFIG_YAML:OUT_JSON ...

Exits 1 with the name of the first launch that failed, after its own output.
"""

from __future__ import annotations

import sys

from accelerate.commands.launch import launch_command, launch_command_parser


def main(script: str, launches: list[str]) -> int:
    parser = launch_command_parser()
    for launch in launches:
        name, _, paths = launch.partition("=")
        config, _, out = paths.partition(":")
        args = parser.parse_args(["--config_file", config, "--main_process_port", "0", script, out])
        try:
            launch_command(args)
        except (Exception, SystemExit) as failed:
            print(f"accelerate launch of {name} failed: {failed!r}", file=sys.stderr, flush=True)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))

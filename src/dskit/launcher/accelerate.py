"""`accelerate launch`'s options for NODES nodes of RANKS ranks each (launcher: accelerate), one a line:

    python3 -m dskit.launcher.accelerate NODES RANKS CONFIG [MASTER_ADDR MASTER_PORT]

CONFIG: accelerate's --config_file (ACCELERATE_CONFIG, relative to the repo), which picks the distributed type: no
type flag is added then, as one would override the file's. Empty: plain data parallel (--multi_gpu, which needs at
least 2 ranks in all), accelerate's defaults said out loud so that it does not warn about each. Across nodes
(train.sbatch): one world at the first node, a c10d rendezvous at MASTER_ADDR (never localhost, which would form
one world per node), and DeepSpeed's `standard` multi-node launcher (its default, pdsh, makes every node a
master); each node adds its own --machine_rank. On one machine accelerate picks a free port itself.
"""

from __future__ import annotations

from pathlib import Path

from dskit.launcher import main, say
from model_utils.errors import ConfigError


def options(nodes: int, ranks: int, config: str, master: tuple[str, str] | None = None) -> list[str]:
    total = nodes * ranks
    found = [f"--num_machines={nodes}", f"--num_processes={total}"]
    if config:
        if not Path(config).is_file():
            raise ConfigError(
                f"ACCELERATE_CONFIG={config}: no such file (an accelerate config YAML, relative to the repo)"
            )
        found.append(f"--config_file={config}")
    else:
        if total < 2:
            raise ConfigError(
                f"accelerate without a config file launches --multi_gpu, which needs at least 2 ranks in all "
                f"({total} here): set ACCELERATE_CONFIG to an accelerate config, or use launcher torchrun"
            )
        found += ["--multi_gpu", "--mixed_precision=no", "--dynamo_backend=no"]
    if master is None:
        found.append("--main_process_port=0")
    else:
        found += [f"--main_process_ip={master[0]}", f"--main_process_port={master[1]}", "--rdzv_backend=c10d"]
        found.append("--deepspeed_multinode_launcher=standard")
    say(
        f"accelerate launch: {nodes} machine(s) x {ranks} process(es)"
        + (f", config {config}" if config else "")
    )
    return found


def _main(argv: list[str]) -> int:
    if len(argv) not in (3, 5) or not (argv[0].isdigit() and argv[1].isdigit()):
        raise ConfigError(
            "usage: python3 -m dskit.launcher.accelerate NODES RANKS CONFIG [MASTER_ADDR MASTER_PORT]"
        )
    master = (argv[3], argv[4]) if len(argv) == 5 else None
    print("\n".join(options(int(argv[0]), int(argv[1]), argv[2], master)))
    return 0


if __name__ == "__main__":
    main(_main)

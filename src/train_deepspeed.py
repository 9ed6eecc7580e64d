"""Train a Hugging Face causal LM with DeepSpeed ZeRO. Launch with torchrun (the launchers do):

    torchrun --nproc_per_node=2 src/train_deepspeed.py --max_steps 100

Flags and defaults: `python src/train_deepspeed.py --help` (model_utils/config/arguments.py).
"""

from __future__ import annotations

from functools import partial

from model_utils.config.arguments import parse_args
from model_utils.errors import CheckpointSaveFailed, ConfigError, NodeUnhealthy, RunDiverged
from model_utils.launch import preemption, startup
from model_utils.observe.log import error_line, let_rank0_print, print0


def main(argv: list[str] | None = None) -> int:
    startup.fewer_full_collections()  # before the heavy imports below (launch/startup.py)
    preemption.install()  # a Ctrl-C or USR1 during start-up is a stop request too, not a traceback
    try:
        cfg = parse_args(argv)
        from model_utils.checkpoint import lease, protocol
        from model_utils.launch import distributed
        from model_utils.loop.trainer import Trainer
        from model_utils.observe import watchdog
        from model_utils.resolve import resolver

        hang_timeout = cfg.loop.hang_timeout
        dist = distributed.init_distributed(
            watchdog.collective_timeout_s(hang_timeout) if hang_timeout else None, cfg.optim.sequence_parallel
        )
        if cfg.loop.health_gate == "on":  # before anything is loaded: a bad node costs seconds, not hours
            from model_utils.launch import health_gate

            health_gate.run_gate(
                dist.rank, dist.world_size, dist.device, cfg.loop.health_min_busbw, print0, error_line
            )
        decide_on_main = partial(distributed.decide_on_main, info=dist)
        # One run per checkpoint dir, taken before anything reads or writes it (a second run is refused here).
        with lease.held_on_main(cfg.checkpoint.checkpoint_dir, dist.is_main, decide_on_main):
            # Every rank checks its share of the resume candidates' files; rank 0's choice in prepare reads none again.
            protocol.verify_in_parallel(cfg.checkpoint.checkpoint_dir, cfg.checkpoint.resume_from_checkpoint)
            run = resolver.prepare_on_ranks(cfg, dist)
            trainer = Trainer(run, dist)
            try:
                trainer.fit()
            finally:
                trainer.close()
    except ConfigError as e:
        error_line(str(e))
        let_rank0_print()
        return 2
    except CheckpointSaveFailed:
        return 3  # its line is out already
    except NodeUnhealthy:
        from model_utils.observe.watchdog import HANG_EXIT

        return HANG_EXIT  # its lines are out; train.sbatch requeues without the node (docs/hangs.md)
    except RunDiverged as e:
        error_line(str(e))
        let_rank0_print()
        return 4
    print0("Validation finished" if cfg.loop.validation_only else "Training finished")
    return 0


if __name__ == "__main__":
    from model_utils.launch import process_exit

    process_exit.exit_now(
        main()
    )  # without the ~2 CPU-s teardown of torch's, transformers' and DeepSpeed's modules

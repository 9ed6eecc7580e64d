"""`dskit plot --schedules [TRAINING FLAGS] [-o OUT.png]`: the four lr schedules for these flags, in one PNG.

Each curve is the lr every optimizer step runs at, computed by the scheduler that trains it (DeepSpeed's own for
cosine and constant, the kit's for wsd and linear): the same values `dskit config` prints at a few steps.
"""

from __future__ import annotations

from pathlib import Path

from dskit.plot.png import save_png
from model_utils.config.arguments import SCHEDULES, parse_args
from model_utils.errors import ConfigError, first_line
from model_utils.resolve import train_settings

WSD_ONLY = ("--decay_fraction", "--decay_type", "--decay_from_step")
DEFAULT_OUTPUT = "lr-schedules.png"


def _split_output(argv: list[str]) -> tuple[list[str], Path]:
    flags, out = [], Path(DEFAULT_OUTPUT)
    tokens = iter(argv)
    for token in tokens:
        if token in ("-o", "--output"):
            value = next(tokens, None)
            if value is None:
                raise ConfigError(f"{token} needs a file name, e.g. -o {DEFAULT_OUTPUT}")
            out = Path(value)
        elif token.startswith("--output="):
            out = Path(token.split("=", 1)[1])
        else:
            flags.append(token)
    return flags, out


def _without_wsd_flags(flags: list[str]) -> list[str]:
    kept, skip = [], False
    for token in flags:
        if skip:
            skip = False
            continue
        name = token.split("=", 1)[0]
        if name in WSD_ONLY:
            skip = "=" not in token
            continue
        kept.append(token)
    return kept


def curves(flags: list[str]) -> tuple[int, dict[str, list[float]]]:
    """(max_steps, the lr of every step per schedule) for these training flags."""
    if any(token.split("=", 1)[0] == "--lr_schedule" for token in flags):
        raise ConfigError("dskit plot --schedules draws every schedule: drop --lr_schedule")
    out: dict[str, list[float]] = {}
    total = 0
    for kind in SCHEDULES:
        own = flags if kind == "wsd" else _without_wsd_flags(flags)
        cfg = parse_args([*own, "--lr_schedule", kind])
        total = cfg.loop.max_steps
        out[kind] = train_settings.resolve(cfg).lr_at(total, list(range(1, total + 1)))
    return total, out


def main(argv: list[str]) -> int:
    flags, out = _split_output(argv)
    total, lrs = curves(flags)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    try:
        steps = list(range(1, total + 1))
        for kind, values in lrs.items():
            ax.plot(steps, values, label=kind, linewidth=1.8)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("learning rate")
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        ax.set_title("dskit lr schedules: " + (" ".join(flags) or "default flags"))
        ax.legend()
        fig.tight_layout()
        try:
            save_png(fig, out)
        except OSError as err:
            raise ConfigError(
                f"cannot write {out}: {first_line(err)}: choose a writable output (-o)"
            ) from err
    finally:
        plt.close(fig)
    print(f"wrote {out}: {', '.join(lrs)} over {total} steps")
    return 0

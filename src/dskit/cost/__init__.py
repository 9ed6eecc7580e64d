"""`dskit cost [RUN]`: where a run's paid time went and what it cost, from its goodput ledger.

RUN is a checkpoint dir (or its dskit-ledger.jsonl; default: ./checkpoints), written by every attempt of the run
(model_utils/loop/observers/ledger.py has the records). Each attempt's paid time runs from its launch to its exit (a crashed
attempt's: to its last record) on every node it held, and splits into:

    productive      trained steps that stand
    start-up        launch to the first step: set-up, preflight, loading, resuming
    checkpoint      saves, as the loop waited for them
    validation      validation passes
    samples         generating from --sample_prompts (the loop's evaluation point)
    restarts        steps trained again after a crash, preemption or requeue resumed from an earlier checkpoint
    rollbacks       steps trained again after the spike guard went back to a checkpoint
    discarded       turns that trained nothing (spike-guard skips, the step a rollback threw away)
    other           the rest: logging, the end of the run, shutting down

Queue wait (submit to launch, where the scheduler says) is reported beside it, unpaid. Goodput is the productive
share of the paid node-hours; the money is node-hours x the instance's hourly price (prices.json beside this
file, dated, with its source; --prices FILE or --price_per_hour for your own).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from model_utils.errors import CommandParser, ConfigError
from model_utils.observe.ledger_file import LEDGER

PRICES = Path(__file__).with_name("prices.json")
CAUSES = ("startup", "checkpoint", "validation", "samples", "restarts", "rollbacks", "discarded", "other")
# The evaluations (ledger "evaluation" records, by watchdog phase) with a cause of their own; others stay in "other".
EVALUATION_CAUSES = ("samples",)


@dataclass
class Attempt:
    launched_at: float
    ended_at: float
    nodes: int
    instance_type: str | None
    start_step: int
    queue_s: float | None
    tokens_per_step: int
    ended: str  # the loop's end reason, "crashed" when the attempt left no end record
    seconds: dict[str, float] = field(default_factory=dict)  # productive + CAUSES, filled by account()

    @property
    def wall_s(self) -> float:
        return self.ended_at - self.launched_at


@dataclass
class Account:
    attempts: list[Attempt]
    trained_steps: int  # steps that stand at the end of the ledger
    tokens: int

    def node_seconds(self, what: str | None = None) -> float:
        return sum((a.wall_s if what is None else a.seconds[what]) * a.nodes for a in self.attempts)

    @property
    def goodput(self) -> float:
        paid = self.node_seconds()
        return self.node_seconds("productive") / paid if paid > 0 else 0.0


def read(path: Path) -> list[dict[str, Any]]:
    """The ledger's records; a torn last line (a crash mid-write) is left out."""
    records = []
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except ValueError:
            if number != len(lines):
                raise ConfigError(f"{path}: line {number} is not JSON: the ledger is damaged") from None
    return records


class _Standing:
    """Trained steps that stand, as runs of (first, last, seconds per step, the attempt that trained them); what
    a restart or rollback takes back goes to that attempt's waste."""

    def __init__(self) -> None:
        self.runs: list[tuple[int, int, float, int]] = []

    def add(self, first: int, last: int, seconds: float, attempt: int) -> None:
        if last >= first:
            self.runs.append((first, last, seconds / (last - first + 1), attempt))

    def take_back_after(self, step: int) -> dict[int, float]:
        """Remove every step after `step`: their seconds by the attempt that trained them."""
        taken: dict[int, float] = {}
        kept = []
        for first, last, per_step, attempt in self.runs:
            if last > step:
                taken[attempt] = taken.get(attempt, 0.0) + (last - max(first, step + 1) + 1) * per_step
            if first <= step:
                kept.append((first, min(last, step), per_step, attempt))
        self.runs = kept
        return taken

    def steps(self) -> int:
        return sum(last - first + 1 for first, last, _, _ in self.runs)

    def reach(self, step: int, attempt: int) -> None:
        """Steps up to `step` stand: those no steps record reached are `attempt`'s, their time unknown."""
        reached = max((last for _, last, _, _ in self.runs), default=0)
        if step > reached:
            self.runs.append((reached + 1, step, 0.0, attempt))

    def seconds_by_attempt(self) -> dict[int, float]:
        out: dict[int, float] = {}
        for first, last, per_step, attempt in self.runs:
            out[attempt] = out.get(attempt, 0.0) + (last - first + 1) * per_step
        return out


def account(records: list[dict[str, Any]]) -> Account:
    """Each attempt's paid time split by cause. Steps trained again later (a resume from an earlier checkpoint,
    a rollback) count as waste of the attempt that first trained them, not as its productive time."""
    attempts: list[Attempt] = []
    standing = _Standing()

    def take_back(step: int, cause: str) -> None:
        for index, seconds in standing.take_back_after(step).items():
            attempts[index].seconds[cause] += seconds

    for record in records:
        event = record["event"]
        if event == "start":
            job = record.get("job") or {}
            submitted = job.get("submitted_at")
            previous_end = attempts[-1].ended_at if attempts else None
            # A requeue keeps the job's submit time: its queue wait runs from the previous attempt's end.
            queued_from = (
                max(submitted, previous_end)
                if submitted is not None and previous_end is not None
                else submitted
            )
            attempts.append(
                Attempt(
                    launched_at=record["launched_at"],
                    ended_at=record["t"],
                    nodes=int(record.get("nodes", 1)),
                    instance_type=record.get("instance_type"),
                    start_step=int(record.get("step", 0)),
                    queue_s=None if queued_from is None else max(0.0, record["launched_at"] - queued_from),
                    tokens_per_step=int(record.get("tokens_per_step", 0)),
                    ended="crashed",
                    seconds=dict.fromkeys(("productive", *CAUSES), 0.0),
                )
            )
            attempts[-1].seconds["startup"] = float("nan")  # set by the attempt's first steps record
            take_back(attempts[-1].start_step, "restarts")
            if len(attempts) > 1:
                # A resume proves its checkpoint's steps trained: the attempt before may have ended after that save
                # and before its next steps record. Those steps stand; their time stays in that attempt's "other".
                standing.reach(attempts[-1].start_step, len(attempts) - 2)
            continue
        if not attempts:
            raise ConfigError(f"ledger record {event!r} before any start record: the ledger is damaged")
        current = attempts[-1]
        current.ended_at = max(current.ended_at, record["t"])
        if event == "steps":
            if current.seconds["startup"] != current.seconds["startup"]:  # NaN: the attempt's first steps
                current.seconds["startup"] = record["started_at"] - current.launched_at
            if record.get("trained"):
                standing.add(record["first"], record["last"], record["trained_s"], len(attempts) - 1)
            current.seconds["discarded"] += record.get("untrained_s", 0.0)
        elif event in ("checkpoint", "validation"):
            current.seconds[event] += record["seconds"]
        elif event == "evaluation" and record.get("phase") in EVALUATION_CAUSES:
            current.seconds[record["phase"]] += record["seconds"]
        elif event == "rollback":
            take_back(record["to_step"], "rollbacks")
        elif event == "end":
            current.ended = record["reason"]
    for index, seconds in standing.seconds_by_attempt().items():
        attempts[index].seconds["productive"] = seconds
    for attempt in attempts:
        if attempt.seconds["startup"] != attempt.seconds["startup"]:  # no step at all: all of it start-up
            attempt.seconds["startup"] = attempt.wall_s
        known = sum(attempt.seconds[k] for k in ("productive", *CAUSES) if k != "other")
        attempt.seconds["other"] = attempt.wall_s - known
    tokens = (attempts[-1].tokens_per_step if attempts else 0) * standing.steps()
    return Account(attempts=attempts, trained_steps=standing.steps(), tokens=tokens)


# --- prices --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Price:
    per_hour: float
    what: str  # where it came from, for the report


def load_prices(path: Path) -> dict[str, Any]:
    try:
        table = json.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"--prices {path}: {e.strerror}: give a JSON file like {PRICES}") from None
    except ValueError as e:
        raise ConfigError(f"--prices {path}: not JSON ({e}): give a JSON file like {PRICES}") from None
    if not isinstance(table, dict) or not isinstance(table.get("on_demand", {}), dict):
        raise ConfigError(
            f'--prices {path}: expected an object with "on_demand" prices by instance type, like {PRICES}'
        )
    return table


def price_for(
    instance: str | None, market: str, table: dict[str, Any], per_hour: float | None
) -> Price | None:
    if per_hour is not None:
        return Price(per_hour, "--price_per_hour")
    if instance is None:
        return None
    value = (table.get(market.replace("-", "_")) or {}).get(instance)
    if value is None:
        return None
    return Price(
        float(value),
        f"{market} {table.get('region', '')} prices of {table.get('dated', '?')}".replace("  ", " "),
    )


# --- the report ----------------------------------------------------------------------------------------------


def _duration(seconds: float) -> str:
    if abs(seconds) < 120:
        return f"{seconds:.1f} s"
    if abs(seconds) < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def report(ledger: Path, acct: Account, price: Price | None, instance: str | None, why_no_price: str) -> str:
    paid = acct.node_seconds()
    lines = [
        f"{ledger}: {len(acct.attempts)} attempt{'s' if len(acct.attempts) != 1 else ''}, "
        f"{acct.trained_steps} steps standing ({acct.tokens:,} tokens), instance {instance or 'unknown'}",
        f"paid: {paid / 3600:.4g} node-hours ({_duration(sum(a.wall_s for a in acct.attempts))} of wall time)"
        + (
            f" = ${paid / 3600 * price.per_hour:,.2f} at ${price.per_hour:g}/h ({price.what})"
            if price
            else ""
        ),
        f"goodput: {acct.goodput:.1%} of the paid time trained steps that stand",
    ]
    for what in ("productive", *CAUSES):
        seconds = acct.node_seconds(what)
        share = seconds / paid if paid > 0 else 0.0
        money = f"  ${seconds / 3600 * price.per_hour:,.2f}" if price else ""
        lines.append(f"  {what:<11} {share:6.1%}  {_duration(seconds):>10}{money}")
    queued = [a.queue_s for a in acct.attempts if a.queue_s is not None]
    if queued:
        lines.append(f"queue wait (not paid): {_duration(sum(queued))} over {len(queued)} start(s)")
    if price and acct.tokens:
        lines.append(f"${paid / 3600 * price.per_hour / acct.tokens * 1e9:,.2f} per billion tokens trained")
    if price is None:
        lines.append(f"no price: {why_no_price}")
    return "\n".join(lines)


def _ledger_path(run: str) -> Path:
    path = Path(run)
    if path.is_dir():
        path = path / LEDGER
    if not path.is_file():
        raise ConfigError(
            f"no ledger at {path}: give a run's checkpoint dir (a run of this kit writes {LEDGER} there)"
        )
    return path


def build_parser() -> CommandParser:
    parser = CommandParser(prog="dskit cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("run", nargs="?", default="checkpoints", help="checkpoint dir or ledger file")
    parser.add_argument("--instance_type", help="what the run ran on (default: what its hosts said)")
    parser.add_argument("--market", choices=("on-demand", "spot"), default="on-demand")
    parser.add_argument("--prices", type=Path, default=PRICES, help=f"price table (default {PRICES.name})")
    parser.add_argument("--price_per_hour", type=float, help="price of one node (instance) per hour")
    parser.add_argument("--json", action="store_true", help="the account as JSON, for scripts")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.price_per_hour is not None and args.price_per_hour < 0:
        raise ConfigError("--price_per_hour must be 0 or more")
    ledger = _ledger_path(args.run)
    acct = account(read(ledger))
    if not acct.attempts:
        raise ConfigError(f"{ledger} has no start record: no attempt of the run got as far as its first step")
    instance = args.instance_type or acct.attempts[-1].instance_type
    table = load_prices(args.prices)
    price = price_for(instance, args.market, table, args.price_per_hour)
    why = (
        "the hosts did not say what they are: pass --instance_type or --price_per_hour"
        if instance is None
        else f"{instance} has no {args.market} price in {args.prices}: pass --price_per_hour or --prices FILE"
        + (f" ({table['notes'][instance]})" if instance in table.get("notes", {}) else "")
    )
    if args.json:
        out = {
            "ledger": str(ledger),
            "instance_type": instance,
            "price_per_hour": None if price is None else price.per_hour,
            "paid_node_seconds": acct.node_seconds(),
            "goodput": acct.goodput,
            "trained_steps": acct.trained_steps,
            "tokens": acct.tokens,
            "by_cause_node_seconds": {k: acct.node_seconds(k) for k in ("productive", *CAUSES)},
            "cost": None if price is None else acct.node_seconds() / 3600 * price.per_hour,
            "attempts": [{**asdict(a), "wall_s": a.wall_s} for a in acct.attempts],
        }
        print(json.dumps(out, indent=2))
    else:
        print(report(ledger, acct, price, instance, why))
    return 0

"""Checkpoints that never lie: crash-safe saves, verified resume with fallback, and rotation.

The protocol sits above the engine seam (engines/base.py): an engine writes and reads only its own sharded state
inside the directory it is handed, and answers for its own files (which tag it wrote, how it converts one for
another world size), so every engine gets the same guarantees.

Save: every rank writes into a staging dir `.staging-<tag>` and checksums its own files right after writing them
(each rank's shards named by the engine: writer_rank); the ranks' checksums are gathered with their outcome
(also the barrier), and rank 0 writes a manifest of every file's size and checksum (hashing only the files no rank
claimed), renames the staging dir to `<tag>` (atomic), and only then replaces `latest` (temp file,
fsync, rename). An engine's own `latest` (DeepSpeed's is a plain open() before its last barrier) is never used, so a crash
at any point leaves the previous checkpoints and a `latest` that names a complete one.

Resume: the newest tag whose manifest verifies (sizes and checksums). The ranks verify first, in parallel, each its
own share of a tag's files (verify_in_parallel); the main rank's choice then re-reads none of them. A tag with a missing, short or corrupt file,
or without a manifest, is skipped with a warning naming it; a `latest` that is empty, truncated or names a bad tag
is reported and ignored the same way.

Layout of a tag: the engine's files (each engine module lists them; DeepSpeed: mp_rank_00_model_states.pt with our
client state, one optimizer shard per rank; FSDP: dcp/ with one .distcp shard file per rank and DCP's .metadata,
and fsdp_client_state.pt with our client state and the lr scheduler's), rng_state_rank<R>.pt, hf_config/ (model
config and tokenizer, with the chat template the run trains with, for export), launch.json (how the run was
launched, the resolved run and that chat template) and dskit_manifest.json, written last.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from model_utils import engines, launch_env
from model_utils.checkpoint import launch_record
from model_utils.engines.base import CheckpointFormat, Engine
from model_utils.errors import CheckpointSaveFailed, ConfigError, first_line
from model_utils.observe import step_line
from model_utils.observe.log import error_line, print0, warn0
from model_utils.storage import file_manifest

CLIENT_KEY = "dskit"
HF_CONFIG_DIR = "hf_config"
LAUNCH_FILE = "launch.json"
STAGING_PREFIX = ".staging-"
_TAG_RE = re.compile(r"^(?P<name>[^.].*)-(?P<step>\d+)steps$")
_RNG_RE = re.compile(r"^rng_state_rank(\d+)\.pt$")
# Fault injection for the crash tests: the process SIGKILLs itself at the named point of a save; with ":stop"
# after the point's name it SIGSTOPs itself there instead (a rank frozen in a save: the hang watchdog's test).
FAULT_ENV = launch_env.FAULT_INJECT
FREEZE_SUFFIX = ":stop"


def checkpoint_tag(model_short_name: str, step: int) -> str:
    return f"{model_short_name}-{step}steps"


def tag_step(tag: str) -> int | None:
    m = _TAG_RE.match(tag)
    return int(m["step"]) if m else None


def check_writable(directory: str) -> None:
    """Fail before training if checkpoints could not be written (not after an hour of compute)."""
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as e:
        raise ConfigError(
            f"checkpoint dir {directory} is not writable ({e.strerror or e}): pass --checkpoint_dir with a writable path"
        ) from None


# --- choosing what to resume from -----------------------------------------------------------------------


@dataclass(frozen=True)
class ResumeTarget:
    load_dir: Path
    tag: str

    @property
    def path(self) -> Path:
        return self.load_dir / self.tag


def is_tag_dir(path: Path) -> bool:
    """Whether path is one checkpoint (a tag dir), not a dir of them: some engine's files are in it."""
    return path.is_dir() and engines.engine_of_tag(path) is not None


def _tags_newest_first(root: Path) -> list[str]:
    tags = (
        [p.name for p in root.iterdir() if p.is_dir() and tag_step(p.name) is not None]
        if root.is_dir()
        else []
    )
    return sorted(tags, key=lambda t: tag_step(t) or 0, reverse=True)


def _report_latest(root: Path, chosen: str | None) -> None:
    latest = root / "latest"
    if not latest.exists():
        return
    named = latest.read_text(errors="replace").strip()
    if not named:
        warn0(f"{latest} is empty (a crash during a save?): ignoring it")
    elif named != chosen:
        warn0(f"{latest} names {named!r}, which is not the newest verified checkpoint: ignoring it")


def newest_verified(root: Path) -> ResumeTarget | None:
    """The newest tag under root whose manifest verifies; warns about every tag it skips."""
    chosen = None
    for tag in _tags_newest_first(root):
        problem = file_manifest.verify(root / tag)
        if problem is None:
            chosen = ResumeTarget(root, tag)
            break
        warn0(f"skipping checkpoint {root / tag}: {problem}")
    _report_latest(root, chosen.tag if chosen else None)
    return chosen


def select_resume(checkpoint_dir: str, resume_from: str | None) -> ResumeTarget | None:
    """--resume_from_checkpoint (a checkpoint dir, or one tag dir) if given, else the newest verified tag in
    --checkpoint_dir, else None: a fresh start."""
    if resume_from is None:
        return newest_verified(Path(checkpoint_dir))
    path = Path(resume_from)
    if is_tag_dir(path):
        if (path / file_manifest.MANIFEST).is_file():
            problem = file_manifest.verify(path)
            if problem:
                raise ConfigError(
                    f"--resume_from_checkpoint {resume_from} is damaged ({problem}): pick another tag"
                )
        else:
            warn0(
                f"{path} has no {file_manifest.MANIFEST} (not saved by dskit?): resuming from it unverified"
            )
        return ResumeTarget(path.parent, path.name)
    target = newest_verified(path)
    if target is None:
        raise ConfigError(
            f"--resume_from_checkpoint {resume_from} holds no verified checkpoint: point it at a checkpoint dir "
            "or a tag dir, or drop the flag"
        )
    return target


def writer_rank(engine: type[CheckpointFormat] | CheckpointFormat | None, rel: str) -> int | None:
    """The rank that wrote a tag's file `rel`: the protocol's own files (RNG states; rank 0's hf_config/ and
    launch.json), else the engine's shards (CheckpointFormat.writer_rank; a built engine's too); None if unknown."""
    if (m := _RNG_RE.match(rel)) is not None:
        return int(m[1])
    if rel == LAUNCH_FILE or rel.startswith(f"{HF_CONFIG_DIR}/"):
        return 0
    return None if engine is None else engine.writer_rank(rel)


def _verify_candidates(checkpoint_dir: str, resume_from: str | None) -> list[Path]:
    """The tag dirs select_resume would check, in its order."""
    if resume_from is not None and is_tag_dir(Path(resume_from)):
        path = Path(resume_from)
        return [path] if (path / file_manifest.MANIFEST).is_file() else []
    root = Path(resume_from if resume_from is not None else checkpoint_dir)
    return [root / tag for tag in _tags_newest_first(root)]


def verify_in_parallel(checkpoint_dir: str, resume_from: str | None = None) -> None:
    """On every rank, before the main rank picks the checkpoint to resume (select_resume, newest_verified): the
    candidate tags are checked newest first, each rank reading its own share of a tag's files (those it wrote, at
    the same world size; the rest spread over the ranks), until one matches on every rank. The main rank learns
    which files matched (file_manifest.remember_verified) and reads none of them again; a tag with a bad file is
    left to its check, which names the file."""
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    candidates: list[Any] = [_verify_candidates(checkpoint_dir, resume_from) if rank == 0 else None]
    torch.distributed.broadcast_object_list(candidates, src=0)
    for tag_dir in candidates[0]:
        manifest = file_manifest.read(tag_dir)
        problem, keys = "absent", []  # a rank that cannot see the tag (node-local dirs) leaves it to rank 0
        if manifest is not None:
            engine_type = _engine_type(tag_dir)
            files = sorted(manifest["files"])
            mine = [rel for i, rel in enumerate(files) if _verifier(engine_type, rel, i, world) == rank]
            problem, keys = file_manifest.check_files(tag_dir, manifest, mine)
        outcomes: list[Any] = [None] * world
        torch.distributed.all_gather_object(outcomes, (problem, keys))
        if rank == 0:
            file_manifest.remember_verified([k for _, ks in outcomes for k in ks])
        if all(p in (None, "absent") for p, _ in outcomes):
            return  # verified everywhere, or as far as the ranks can see it: rank 0's check finishes it


def _verifier(engine_type: type[CheckpointFormat] | None, rel: str, index: int, world: int) -> int:
    """The rank that checks a file at resume: its writer (whose node may still cache it), else one by turns."""
    writer = writer_rank(engine_type, rel)
    return (index if writer is None else writer) % world


def _engine_type(tag_dir: Path) -> type[CheckpointFormat] | None:
    name = engines.engine_of_tag(tag_dir)
    return None if name is None else engines.checkpoint_format(name)


# --- saving ---------------------------------------------------------------------------------------------


def _inject_fault(point: str, tag_dir: Path | None = None) -> None:
    if os.environ.get(FAULT_ENV) == point + FREEZE_SUFFIX:
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    if os.environ.get(FAULT_ENV) != point:
        return
    if point == "mid_file" and tag_dir is not None:
        # What a kill during a write leaves behind: a file cut short.
        # (the largest shard: DeepSpeed's .pt files, DCP's .distcp files)
        shards = (p for p in tag_dir.rglob("*") if p.suffix in (".pt", ".distcp"))
        victim = max(shards, key=lambda p: p.stat().st_size)
        with victim.open("r+b") as f:
            f.truncate(victim.stat().st_size // 2)
    os.kill(os.getpid(), signal.SIGKILL)


def _rng_file(tag_dir: Path, rank: int) -> Path:
    return tag_dir / f"rng_state_rank{rank}.pt"


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


@dataclass
class SaveRequest:
    checkpoint_dir: str
    tag: str
    step: int
    train_state: dict[str, Any]
    config: dict[str, Any]
    launch: dict[str, Any]


Digests = dict[str, dict[str, Any]]  # a tag's file (relative path) -> its size and checksum


def _write_rank_files(
    engine: Engine, req: SaveRequest, staging: Path, rank: int, model_config: Any, tokenizer: Any
) -> tuple[BaseException | None, Digests]:
    """This rank's files and their checksums, computed right after the writes (still in this rank's page cache);
    the error that stopped them, if any, once the engine's save is over on every rank."""
    try:
        engine.save(staging, {CLIENT_KEY: {"train_state": req.train_state, "config": req.config}})
    except (OSError, RuntimeError) as e:  # torch.save reports ENOSPC as a RuntimeError
        engine.after_failed_save()
        return e, {}
    try:
        torch.save(_rng_state(), _rng_file(staging, rank))
        if rank == 0:
            model_config.save_pretrained(staging / HF_CONFIG_DIR)
            # The tokenizer carries the chat template the run trains with (the resolver sets it): every export
            # is prompted as the run was trained. launch.json records it too, for a resume to compare.
            tokenizer.save_pretrained(staging / HF_CONFIG_DIR)
            launch = {**req.launch, launch_record.CHAT_TEMPLATE: getattr(tokenizer, "chat_template", None)}
            file_manifest.atomic_write_text(
                staging / LAUNCH_FILE, json.dumps(launch, indent=1, sort_keys=True, default=str)
            )
        return None, _digest_own_files(engine, staging, rank)
    except (OSError, RuntimeError) as e:
        return e, {}


def _digest_own_files(engine: Engine, staging: Path, rank: int) -> Digests:
    """Size and checksum of the files this rank wrote (writer_rank), fsynced; another rank's are not touched,
    nor files no one claims (rank 0 hashes those after every rank is done)."""
    digests = {}
    for path in staging.rglob("*"):
        rel = str(path.relative_to(staging))
        if writer_rank(engine, rel) == rank and path.is_file():
            digests[rel] = file_manifest.digest_written(path)
    return digests


def _first_failure(failure: BaseException | None, digests: Digests, root: Path) -> tuple[str | None, Digests]:
    """Every rank's outcome and checksums, gathered (so also a barrier: every rank is done writing): the first
    failed rank's reason, the same on every rank, or None when all wrote their files; and all ranks' checksums."""
    reason = None
    if failure is not None:
        reason = first_line(failure)
        if _out_of_space(failure, root) and os.strerror(errno.ENOSPC) not in reason:
            reason = f"{os.strerror(errno.ENOSPC)}: {reason}"
    outcomes: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(outcomes, (reason, digests))
    everyone: Digests = {rel: d for _, rank_digests in outcomes for rel, d in rank_digests.items()}
    failed = [(r, why) for r, (why, _) in enumerate(outcomes) if why is not None]
    if not failed:
        return None, everyone
    r, why = failed[0]
    return (why if r == 0 else f"rank {r}: {why}"), everyone


def _commit(root: Path, staging: Path, req: SaveRequest, digests: Digests) -> Path:
    """Rank 0, after every rank's files are on disk: manifest (the ranks' checksums), atomic rename, `latest`."""
    _inject_fault("before_manifest")
    _inject_fault("mid_file", staging)
    manifest = file_manifest.build(staging, {"tag": req.tag, "step": req.step}, digests)
    file_manifest.write(staging, manifest)
    _inject_fault("before_rename")
    final = root / req.tag
    if final.exists():  # an unverified leftover of the same name (a verified one would have been resumed)
        shutil.rmtree(final)
    os.rename(staging, final)
    file_manifest.fsync_dir(root)
    _inject_fault("before_latest")
    file_manifest.atomic_write_text(root / "latest", req.tag)
    return final


def save(engine: Engine, req: SaveRequest, rank: int, model_config: Any, tokenizer: Any) -> Path | None:
    """Crash-safe save on all ranks; returns the verified tag dir on rank 0 (None elsewhere)."""
    started = time.perf_counter()
    root = Path(req.checkpoint_dir)
    staging = root / f"{STAGING_PREFIX}{req.tag}"
    if rank == 0 and staging.exists():
        shutil.rmtree(staging)  # debris of a save that crashed
    torch.distributed.barrier()
    failure, digests = _write_rank_files(engine, req, staging, rank, model_config, tokenizer)
    if rank == 1:
        _inject_fault("rank1_before_barrier")
    failed, digests = _first_failure(failure, digests, root)
    if failed is not None:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        error = CheckpointSaveFailed(
            f"saving checkpoint {req.tag} in {root} failed ({failed}); older checkpoints are intact: "
            "free space or pass --checkpoint_dir on a larger filesystem"
        )
        # Said here, before any rank can exit: a launcher ends the other ranks at the first exit it sees.
        error_line(str(error))
        torch.distributed.barrier()
        raise error
    final = _commit(root, staging, req, digests) if rank == 0 else None
    torch.distributed.barrier()
    print0(step_line.saved_line(root / req.tag, _throughput(root / req.tag, time.perf_counter() - started)))
    return final


def _out_of_space(err: BaseException, root: Path) -> bool:
    """ENOSPC, also where torch.save hides it ("[enforce fail at inline_container.cc] unexpected pos ..."): the
    failed write then left the filesystem with less than a few blocks free (the staging dir is not removed yet)."""
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        return True
    try:
        return shutil.disk_usage(root).free < 1 << 16
    except OSError:
        return False


def _throughput(tag_dir: Path, seconds: float) -> str:
    size = sum(p.stat().st_size for p in tag_dir.rglob("*") if p.is_file()) if tag_dir.is_dir() else 0
    return f"{size / 1e9:.3f} GB in {seconds:.2f} s, {size / 1e9 / max(seconds, 1e-9):.2f} GB/s"


def rotate(
    root: Path,
    keep: int,
    protect: set[str],
    keep_every: int | None = None,
    engine: type[CheckpointFormat] | None = None,
) -> list[str]:
    """Delete all but the newest `keep` complete tags; never a protected one (e.g. the one resumed from), nor,
    with `keep_every`, one whose step is a multiple of it (kept permanently). `engine`: the run's, whose copies
    of a tag converted for another world size (convert_universal) go with the tag."""
    complete = [t for t in _tags_newest_first(root) if (root / t / file_manifest.MANIFEST).is_file()]
    if keep_every is not None:
        protect = protect | {t for t in complete if (tag_step(t) or 0) % keep_every == 0}
    doomed = [t for t in complete[keep:] if t not in protect]
    for tag in doomed:
        shutil.rmtree(root / tag, ignore_errors=True)
        copy = None if engine is None else engine.converted_tag(tag)
        if copy is not None:
            shutil.rmtree(root / copy, ignore_errors=True)  # its universal copy goes with it
    if doomed:
        print0(f"Removed old checkpoints (keeping {keep}): {', '.join(doomed)}")
    return doomed


# --- another world size: a universal copy (engines that do not reshard on load) ----------------------


def _source_id(source: Path) -> str:
    """Which checkpoint a universal copy was converted from: its manifest's checksum (or, for a tag without
    one, saved by something else, its path)."""
    manifest = source / file_manifest.MANIFEST
    return file_manifest.file_digest(manifest) if manifest.is_file() else str(source.resolve())


def convert_universal(
    engine: type[CheckpointFormat] | CheckpointFormat, source: ResumeTarget, root: Path
) -> tuple[ResumeTarget, float | None]:
    """Rank 0: the universal copy of `source` in `root` (named by engine.converted_tag), converted once by the
    engine with the save's crash-safe protocol (staging dir, manifest, atomic rename) and reused while it
    verifies and was converted from this very checkpoint. Returns it and the conversion's seconds (None: reused)."""
    name = engine.converted_tag(source.tag)
    assert name is not None, f"{engine} reshards on load: it converts nothing"
    final = root / name
    source_id = _source_id(source.path)
    verified = final.is_dir() and file_manifest.verify(final) is None
    if verified and (file_manifest.read(final) or {}).get("universal_of") == source_id:
        return ResumeTarget(root, name), None
    started = time.perf_counter()
    staging = root / f"{STAGING_PREFIX}{name}"
    if staging.exists():
        shutil.rmtree(staging)  # debris of a conversion that crashed
    staging.mkdir(parents=True)
    # The engine writes its output dir and may write beside it (DeepSpeed: `latest_universal`): all inside the
    # staging dir.
    out = staging / name
    try:
        engine.convert_universal(source.path, out)
    except Exception as e:  # any failure of the converter means: no universal copy (weights only)
        shutil.rmtree(staging, ignore_errors=True)
        raise ConfigError(
            f"could not convert {source.path} for a new world size ({type(e).__name__}: {first_line(e)})"
        ) from None
    for item in source.path.iterdir():  # dskit's own files: RNG states, hf_config/, launch.json
        if item.name.startswith("rng_state_rank") or item.name in (HF_CONFIG_DIR, LAUNCH_FILE):
            (shutil.copytree if item.is_dir() else shutil.copy2)(item, out / item.name)
    step = tag_step(source.tag)
    _inject_fault("universal_before_manifest")
    file_manifest.write(out, file_manifest.build(out, {"tag": name, "step": step, "universal_of": source_id}))
    _inject_fault("universal_before_rename")
    if final.exists():  # unverified, or converted from another checkpoint of the same name
        shutil.rmtree(final)
    os.rename(out, final)
    file_manifest.fsync_dir(root)
    shutil.rmtree(staging, ignore_errors=True)
    return ResumeTarget(root, name), time.perf_counter() - started


# --- loading --------------------------------------------------------------------------------------------


def has_local_copy(target: ResumeTarget) -> bool:
    """The tag is on this rank's disk: its dir and the manifest rank 0 commits it with."""
    return (target.path / file_manifest.MANIFEST).is_file()


def read_train_state(tag_dir: Path) -> dict[str, Any]:
    """The train state a tag holds (step, run id, tracker runs), read without an engine; a ConfigError when the
    tag is not a dskit checkpoint."""
    engine_type = _engine_type(tag_dir)
    client_state = engine_type.read_client_state(tag_dir) if engine_type is not None else {}
    if CLIENT_KEY not in client_state:
        raise ConfigError(f"checkpoint {tag_dir} holds no dskit train state: pass a tag of a dskit run")
    return client_state[CLIENT_KEY]["train_state"]


def load(
    engine: Engine, target: ResumeTarget, rank: int, weights_only: bool, universal: bool = False
) -> dict[str, Any]:
    """Load weights (and, unless weights_only, optimizer and scheduler) plus our client state. `universal`:
    target is a universal copy (convert_universal)."""
    started = time.perf_counter()
    client_state = engine.load(target.path, weights_only, universal)
    if not client_state or CLIENT_KEY not in client_state:
        raise ConfigError(f"checkpoint {target.path} could not be loaded: it is not a dskit checkpoint")
    print0(f"Loaded checkpoint {target.path} ({_throughput(target.path, time.perf_counter() - started)})")
    rng_file = _rng_file(target.path, rank)
    if rng_file.is_file() and not weights_only:
        _set_rng_state(torch.load(rng_file, weights_only=False))
    else:
        warn0(f"no RNG state restored for rank {rank} from {target.tag}: continuing with fresh RNG")
    return client_state[CLIENT_KEY]["train_state"]

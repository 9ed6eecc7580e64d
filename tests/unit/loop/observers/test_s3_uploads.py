"""The S3 uploads at the loop's points, over a stand-in for the S3 tier (the tier itself: test_s3_tier.py):
rotation keeps the tag just saved and every tag still uploading, rank 0 queues the verified dir, and the end of
the loop waits for the uploads only when some are left."""

from __future__ import annotations

from pathlib import Path

import pytest

from model_utils.loop.hooks import SavedCheckpoint
from model_utils.loop.observers.s3_uploads import S3Uploads
from model_utils.loop.state import TrainState


class Tier:
    def __init__(self) -> None:
        self.queued: list[Path] = []
        self.waited = 0

    def upload_async(self, tag_dir: Path) -> None:
        self.queued.append(tag_dir)

    def pending(self) -> list[str]:
        return [p.name for p in self.queued]

    def wait(self) -> bool:
        self.waited += 1
        self.queued.clear()
        return True


def test_rotation_keeps_the_new_tag_and_the_uploads_in_flight(capsys: pytest.CaptureFixture[str]) -> None:
    tier = Tier()
    uploads = S3Uploads(tier)  # type: ignore[arg-type]
    assert uploads.tags_in_use("t-2steps") == {"t-2steps"}
    uploads.after_checkpoint_saved(SavedCheckpoint(2, "t-2steps", Path("ck/t-2steps"), 0.5))
    uploads.after_checkpoint_saved(
        SavedCheckpoint(2, "t-2steps", None, 0.5)
    )  # another rank's: nothing to send
    assert tier.queued == [Path("ck/t-2steps")]
    assert uploads.tags_in_use("t-4steps") == {"t-2steps", "t-4steps"}
    uploads.on_end(TrainState(step=4), "done")
    assert tier.waited == 1 and "Waiting for checkpoint uploads to S3 to finish" in capsys.readouterr().out
    uploads.on_end(TrainState(step=4), "done")  # nothing left: no wait, no line
    assert tier.waited == 1 and capsys.readouterr().out == ""

"""--s3_checkpoint_uri on rank 0: each verified checkpoint is uploaded in the background (training does not
wait), rotation keeps a tag's local copy until its upload is done, and the loop's end waits for the uploads.

boto3 is imported only when the feature is on (checkpoint/s3_tier.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from model_utils.loop.hooks import Observer, SavedCheckpoint
from model_utils.loop.state import TrainState
from model_utils.observe.log import print0

if TYPE_CHECKING:
    from model_utils.checkpoint.s3_tier import S3Tier
    from model_utils.loop.observers.context import LoopContext


class S3Uploads(Observer):
    def __init__(self, tier: S3Tier) -> None:
        self.tier = tier

    @classmethod
    def from_loop(cls, ctx: LoopContext) -> S3Uploads | None:
        uri = ctx.run.config.checkpoint.s3_checkpoint_uri
        if uri is None or not ctx.dist.is_main:
            return None
        from model_utils.checkpoint.s3_tier import S3Tier

        return cls(S3Tier(uri))  # access was checked in preflight, before the first step

    def tags_in_use(self, tag: str) -> set[str]:
        return {tag, *self.tier.pending()}  # `tag` is uploaded next

    def after_checkpoint_saved(self, saved: SavedCheckpoint) -> None:
        if saved.path is not None:
            self.tier.upload_async(saved.path)

    def on_end(self, state: TrainState, reason: str) -> None:
        if self.tier.pending():
            print0("Waiting for checkpoint uploads to S3 to finish")
            self.tier.wait()  # warns about any tag that failed; the local copy stays

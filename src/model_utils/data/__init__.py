"""Data: documents from every source, the prepared token shards, the block cache and the step batches."""

"""What `dskit sagemaker submit` and the job's entry (entry.py) agree on: where the job's tree is, the training flags
the job sets itself, the input modes the kit reads. Its own module, so that the package (submit) does not import
the entry: `python -m dskit.sagemaker.entry` then runs the entry once, as __main__, not also as an imported module
beside it (runpy's warning at the top of every job's log, and two copies of the entry's stop state)."""

DEFAULT_BASE = "/opt/ml"
# Training flags the job sets from the contract: a hyperparameter naming one is refused (submit checks too).
OWNED_FLAGS = {
    "model": "the model channel",
    "dataset": "the train channel",
    "validation_dataset": "the validation channel",
    "checkpoint_dir": "checkpoints/ under the job's base dir (synced to the CheckpointConfig S3 URI)",
    "data_cache_dir": "a dir on the ML storage volume",
}
# What the kit reads: files on the instance. Pipe streams a channel through a FIFO the ranks cannot list.
READABLE_INPUT_MODES = ("File", "FastFile")

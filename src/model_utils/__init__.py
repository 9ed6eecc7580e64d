"""dskit's runtime: what a training rank imports (the tools a person types are src/dskit, which imports this).

Its packages form layers, bottom to top: a module imports from its own package, its layer and the layers below,
never from one above, at module level, inside functions and under TYPE_CHECKING alike (tests/unit/
test_packages.py checks every import; docs/architecture.md draws this order).
"""

LAYERS = (
    ("errors", "repo", "assets", "launch_env", "processes", "scratch"),  # modules that import none of the kit
    ("compat",),  # the adapters to other libraries' internals
    ("config",),  # the flags, the run file, the DeepSpeed-format config as given
    ("observe",),  # the log, records, trackers, the watchdog
    ("storage",),  # files, locks, S3
    ("launch",),  # the process group, DeepSpeed's ops, signals, the launcher's supervision
    ("optim",),
    ("model",),
    ("data",),
    ("engines",),  # the training step, checkpoint format and memory model of each engine
    ("checkpoint",),
    ("resolve",),  # a run's settings, decided once before the ranks start
    ("loop",),  # the trainer and its observers
)

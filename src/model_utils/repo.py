"""The checkout this code runs from: the launchers, DeepSpeed configs, templates and uv.lock sit beside src/.
One definition, so a module that moves between subpackages cannot silently point elsewhere."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# DeepSpeed's JIT-built ops: one build per checkout, shared by every node and every entry (the launchers, the
# Makefile, a rank started by accelerate, `dskit doctor` run alone), unless TORCH_EXTENSIONS_DIR names another.
EXTENSIONS_DIR = REPO_ROOT / ".cache" / "torch_extensions"

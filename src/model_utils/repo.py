"""The checkout this code runs from: the launchers, DeepSpeed configs, templates and uv.lock sit beside src/.
One definition, so a module that moves between subpackages cannot silently point elsewhere."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

"""The environment variables between the launchers and the ranks: one name each, set where the ranks read them."""

from __future__ import annotations

from model_utils import launch_env
from model_utils.repo import REPO_ROOT


def variables() -> dict[str, str]:
    return {name: value for name, value in vars(launch_env).items() if name.isupper()}


def test_names_are_distinct_and_the_kits_own() -> None:
    names = variables()
    assert len(names) >= 10
    assert len(set(names.values())) == len(names)  # no two constants for one variable
    assert all(value.startswith("DSKIT_") for value in names.values()), names


def test_the_launchers_set_what_the_ranks_read() -> None:
    """A name drifting between the shell and Python would leave the ranks reading an unset variable."""
    templates = "\n".join(p.read_text() for p in (REPO_ROOT / "templates").glob("*.j2"))
    for name in ("LOG_FILE", "TTY", "SINGLENODE_LOGGED", "STOP_REASON_FILE"):
        assert f"{getattr(launch_env, name)}=" in templates, name

"""The faults (launch_env.SPIKE_FAULT) the spike guard's real-run tests inject: KIND@N once, KIND@N+ from draw N on,
anything else refused in one line."""

from __future__ import annotations

import pytest

from model_utils.errors import ConfigError
from model_utils.loop import faults


def test_the_test_faults_parse_and_hit_the_draws_they_name() -> None:
    once, lasting = faults.Fault.parse("loss@3"), faults.Fault.parse("grad@5+")
    assert [once.hits(d) for d in (2, 3, 4)] == [False, True, False]
    assert [lasting.hits(d) for d in (4, 5, 9)] == [False, True, True]
    for bad in ("loss", "boom@3", "loss@0", "loss@x"):
        with pytest.raises(ConfigError, match="is not KIND@N"):
            faults.Fault.parse(bad)

"""The fault injector's spec and kinds: the tests that use it rely on a fault touching only the requests and
the stage it names."""

from __future__ import annotations

import pytest

from omnistage.core.errors import RequestError
from omnistage.pipeline import faults as faults_module
from omnistage.pipeline.faults import SLOW_STEP_S, FaultInjector, parse_faults


def test_each_kind_acts_on_its_stage_and_requests_only(monkeypatch):
    sleeps = []
    monkeypatch.setattr(faults_module.time, "sleep", sleeps.append)
    faults = FaultInjector(parse_faults("thinker:bad-*, talker:crash-*:crash, code2wav:slow-*:slow"))
    with pytest.raises(RequestError) as err:
        faults.check("thinker", ["ok-1", "bad-2"])
    assert err.value.req_id == "bad-2"
    with pytest.raises(RuntimeError, match="batch of 2"):
        faults.check("talker", ["ok-1", "crash-1"])
    faults.check("thinker", ["crash-1", "slow-1"])  # other stages' patterns do nothing here
    faults.check("code2wav", ["ok-1", "bad-1"])
    assert sleeps == []
    faults.check("code2wav", ["slow-1", "slow-2", "ok-1"])  # one pause per step, however many match
    assert sleeps == [SLOW_STEP_S]


@pytest.mark.parametrize("spec", ["thinker", "thinker:a:b:c", "thinker:a:sometimes", ":a"])
def test_a_malformed_spec_is_refused(spec):
    with pytest.raises(ValueError):
        parse_faults(spec)

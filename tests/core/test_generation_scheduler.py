import pytest

from omnistage.core import GenerationScheduler


def drive(sched: GenerationScheduler, steps: int) -> list[tuple[list[str], dict, set, list[str]]]:
    log = []
    for _ in range(steps):
        out = sched.schedule()
        done = sched.update_from_output(out)
        log.append((out.req_ids, out.payloads, out.finished_req_ids, done))
    return log


def test_round_robin_is_fair_and_payloads_are_fifo():
    sched = GenerationScheduler(max_num_seqs=2)
    for req_id in "abc":
        sched.add_request(req_id)
    for i in range(3):
        for req_id in "abc":
            sched.add_input(req_id, f"{req_id}{i}", finished=i == 2)
    assert sched.num_pending == 9 and sched.num_requests == 3
    log = drive(sched, 6)
    batches = [ids for ids, *_ in log]
    assert batches[:5] == [["a", "b"], ["c", "a"], ["b", "c"], ["a", "b"], ["c"]]
    served = {}
    for ids, payloads, *_ in log:
        assert list(payloads) == ids
        for req_id in ids:
            served.setdefault(req_id, []).append(payloads[req_id])
    assert served == {r: [f"{r}0", f"{r}1", f"{r}2"] for r in "abc"}
    # Finished once their last payload went through; reported in the next schedule().
    assert log[3][3] == ["a", "b"] and log[4][3] == ["c"]
    assert log[4][2] == {"a", "b"} and log[5][2] == {"c"}
    assert not sched.has_unfinished() and sched.num_pending == 0


def test_request_waits_for_input_and_does_not_block_others():
    sched = GenerationScheduler(max_num_seqs=4)
    sched.add_request("slow")
    sched.add_request("fast")
    sched.add_input("fast", "f0", finished=True)
    out = sched.schedule()
    assert out.req_ids == ["fast"]
    assert sched.update_from_output(out) == ["fast"]
    out = sched.schedule()
    assert out.is_empty and out.finished_req_ids == {"fast"}
    assert sched.update_from_output(out) == []
    sched.add_input("slow", "s0", finished=False)
    out = sched.schedule()
    assert out.payloads == {"slow": "s0"}
    assert sched.update_from_output(out) == []
    # End of input without a payload still finishes the request.
    sched.add_input("slow", None, finished=True)
    out = sched.schedule()
    assert out.is_empty
    assert sched.update_from_output(out) == ["slow"]
    assert not sched.has_unfinished()


def test_in_flight_request_is_not_scheduled_twice():
    sched = GenerationScheduler(max_num_seqs=4)
    sched.add_request("a")
    sched.add_input("a", 1, finished=False)
    sched.add_input("a", 2, finished=True)
    first = sched.schedule()
    assert sched.schedule().is_empty  # payload 2 must wait until payload 1's step is closed
    assert sched.update_from_output(first) == []
    second = sched.schedule()
    assert second.payloads == {"a": 2}
    assert sched.update_from_output(second) == ["a"]


def test_abort_drops_payloads_and_late_input():
    sched = GenerationScheduler(max_num_seqs=2)
    sched.add_request("a")
    sched.add_request("b")
    sched.add_input("a", "a0", finished=False)
    sched.add_input("a", "a1", finished=False)
    sched.add_input("b", "b0", finished=True)
    out = sched.schedule()
    sched.abort("a")  # while its payload is in flight
    sched.abort("a")
    sched.abort("unknown")
    assert sched.num_pending == 0
    assert sched.update_from_output(out) == ["b"]  # aborted requests are not "finished" outputs
    assert sched.add_input("a", "a2", finished=True) is False
    out = sched.schedule()
    assert out.is_empty and out.finished_req_ids == {"a", "b"}
    assert not sched.has_unfinished() and not sched.has_finished_to_report()


def test_errors():
    with pytest.raises(ValueError, match="max_num_seqs"):
        GenerationScheduler(0)
    sched = GenerationScheduler(1)
    sched.add_request("a")
    with pytest.raises(ValueError, match="already registered"):
        sched.add_request("a")
    sched.add_input("a", 1, finished=True)
    with pytest.raises(ValueError, match="already marked finished"):
        sched.add_input("a", 2, finished=True)

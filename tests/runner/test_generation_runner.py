"""Generation runner: rows back to their requests, per-request state committed only after success."""

import pytest
import torch

from omnistage.core.generation_scheduler import GenerationScheduler
from omnistage.runner.generation_runner import GenerationRunner


class CountingModel:
    """Row b = payload b's values, shifted by how many chunks that request decoded before (its state)."""

    def __init__(self):
        self.fail = False

    def forward_batch(self, payloads, states):
        width = max(len(p) for p in payloads)
        audio = torch.zeros(len(payloads), width)
        for i, (p, s) in enumerate(zip(payloads, states)):
            audio[i, : len(p)] = torch.tensor(p, dtype=torch.float32) + 100 * s.get("chunks", 0)
        if self.fail:
            raise RuntimeError("boom")
        return ({"audio": audio, "audio_lengths": torch.tensor([len(p) for p in payloads])},
                [{"chunks": s.get("chunks", 0) + 1} for s in states])


def test_rows_reach_their_requests_and_state_is_committed_after_success():
    model = CountingModel()
    sched, runner = GenerationScheduler(max_num_seqs=2), GenerationRunner(model)
    for r in ("a", "b", "c"):
        sched.add_request(r)
        runner.add_request(r)
    sched.add_input("a", [1.0, 2.0], finished=False)
    sched.add_input("b", [3.0], finished=False)
    sched.add_input("c", [4.0, 5.0, 6.0], finished=True)
    so = sched.schedule()
    out = runner.execute(so)
    assert {r: v["audio"].tolist() for r, v in out.items()} == {"a": [1.0, 2.0], "b": [3.0]}
    sched.update_from_output(so)
    sched.add_input("a", [7.0], finished=True)
    so = sched.schedule()  # round robin: c (never served), then a
    assert so.req_ids == ["c", "a"]
    model.fail = True
    with pytest.raises(RuntimeError):
        runner.execute(so)
    sched.cancel_step(so)
    model.fail = False
    so = sched.schedule()
    assert so.req_ids == ["c", "a"] and so.payloads == {"c": [4.0, 5.0, 6.0], "a": [7.0]}
    out = runner.execute(so)
    # a's second chunk sees one committed chunk (the failed attempt did not count)
    assert out["a"]["audio"].tolist() == [107.0] and out["c"]["audio"].tolist() == [4.0, 5.0, 6.0]
    assert sorted(sched.update_from_output(so)) == ["a", "c"]
    for r in ("a", "b", "c"):
        assert runner.free(r)
    assert not runner.free("a") and not runner.records

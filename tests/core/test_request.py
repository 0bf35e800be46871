import pytest
import torch

from omnistage.core import Request, RequestStatus, SamplingParams, finished_status_for


def test_token_bookkeeping():
    r = Request("a", [1, 2, 3], SamplingParams(), eos_token_ids=7)
    assert r.eos_token_ids == (7,)
    assert r.num_prompt_tokens == 3 and r.num_output_tokens == 0 and r.num_tokens == 3
    r.append_prompt_token_ids([4])
    r.append_output_token_ids([9, torch.tensor(8)])
    assert r.all_token_ids == [1, 2, 3, 4, 9, 8]
    assert r.num_tokens == 6 and r.num_output_tokens == 2
    assert all(type(t) is int for t in r.all_token_ids)
    # Direct appends to the public lists are picked up too.
    r.output_token_ids.append(5)
    assert r.all_token_ids == [1, 2, 3, 4, 9, 8, 5]


def test_prompt_cannot_grow_after_output_and_tokens_are_checked():
    r = Request("a", [1])
    r.append_output_token_ids([2])
    with pytest.raises(ValueError, match="after output"):
        r.append_prompt_token_ids([3])
    with pytest.raises(ValueError, match="non-negative"):
        Request("b", [1, -1])
    with pytest.raises(ValueError, match="non-negative"):
        Request("b", [1.5])
    with pytest.raises(ValueError, match="req_id"):
        Request("", [1])


def test_status_helpers():
    finished = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
                RequestStatus.FINISHED_ERROR}
    for status in RequestStatus:
        assert (status in finished) == status.is_finished
    assert finished_status_for("stop") is RequestStatus.FINISHED_STOPPED
    assert finished_status_for("length") is RequestStatus.FINISHED_LENGTH
    assert finished_status_for("abort") is RequestStatus.FINISHED_ABORTED
    assert finished_status_for("error") is RequestStatus.FINISHED_ERROR
    assert RequestStatus.FINISHED_ABORTED.finish_reason == "abort"
    with pytest.raises(ValueError, match="finish reason"):
        finished_status_for("done")

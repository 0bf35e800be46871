"""The persistent batch: swap-remove keeps it dense and really reorders; spans follow the current order."""

import pytest

from omnistage.runner.input_batch import InputBatch, pad_to_bucket, request_token_spans


def test_swap_remove_moves_the_last_request_into_the_hole():
    batch = InputBatch()
    for r in "abcd":
        batch.add(r)
    batch.remove("b")
    assert batch.req_ids == ["a", "d", "c"]
    batch.remove("c")  # the last one: nothing moves
    assert batch.req_ids == ["a", "d"]
    batch.remove("zz")  # unknown: no-op
    batch.add("e")
    assert batch.req_ids == ["a", "d", "e"] and "e" in batch and "b" not in batch and len(batch) == 3
    with pytest.raises(ValueError, match="already in the batch"):
        batch.add("a")


def test_scheduled_requests_join_in_scheduling_order_and_rows_follow_batch_order():
    batch = InputBatch()
    batch.add("a")
    batch.add("b")
    order = batch.scheduled_order({"c": 2, "b": 1, "a": 0, "d": 3})  # a not scheduled this step
    assert batch.req_ids == ["a", "b", "c", "d"] and order == ["b", "c", "d"]
    assert request_token_spans(order, {"b": 1, "c": 2, "d": 3}) == {"b": (0, 1), "c": (1, 3), "d": (3, 6)}


def test_pad_to_bucket():
    assert pad_to_bucket(5, None) == 5
    assert pad_to_bucket(5, (8, 4, 16)) == 8
    assert pad_to_bucket(17, (4, 8, 16)) == 17

import pytest
import torch

from omnistage.runner.ownership import OwnedBatchTensor, snapshot, take


def test_snapshot_of_reused_buffer_keeps_its_values():
    torch.manual_seed(0)
    buf = torch.randn(4, 3)
    expected = buf.clone()
    rows = buf[1:3]  # a view a consumer might hold on to
    snap = snapshot(rows)
    taken = take(rows)
    buf.fill_(-1.0)  # the next step overwrites the persistent buffer
    assert torch.equal(snap, expected[1:3]) and torch.equal(taken, expected[1:3])
    assert torch.equal(rows, torch.full((2, 3), -1.0))  # the plain view did not keep them
    assert snap.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()


def test_owned_tensor_passes_through_without_copy():
    t = torch.arange(6.0).reshape(2, 3)
    out = take(OwnedBatchTensor(t))
    assert out is t


def test_snapshot_detaches_and_rejects_non_tensors():
    w = torch.ones(2, requires_grad=True)
    assert not snapshot(w * 2).requires_grad
    with pytest.raises(TypeError):
        take([1, 2])
    with pytest.raises(TypeError):
        OwnedBatchTensor("not a tensor")

import pytest
import torch

from omnistage.runner.host_copy import HostCopyBatch, HostCopyNotReadyError

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def sources(device: str = "cpu") -> list[torch.Tensor]:
    torch.manual_seed(0)
    base = torch.randn(6, 5, device=device)
    return [
        base,
        base.t(),  # transposed
        base[1:5:2, ::2],  # strided slice
        base[:, 3],  # column
        torch.arange(24, device=device).reshape(2, 3, 4).permute(2, 0, 1),  # permuted ints
    ]


def test_cpu_copies_preserve_logical_layout_after_wait():
    srcs = sources()
    batch = HostCopyBatch()
    handles = [batch.copy(s) for s in srcs]
    assert batch.num_pending == len(srcs)
    batch.wait()
    assert batch.num_pending == 0
    for src, h in zip(srcs, handles):
        assert h.ready and h.value.shape == src.shape and h.value.dtype == src.dtype
        assert torch.equal(h.value, src)
        assert h.value.is_contiguous()


def test_read_before_wait_raises():
    batch = HostCopyBatch()
    h = batch.copy(torch.ones(3))
    assert not h.ready
    with pytest.raises(HostCopyNotReadyError):
        _ = h.value
    batch.wait()
    assert torch.equal(h.value, torch.ones(3))


def test_copy_is_independent_of_the_source_buffer_and_batch_is_reusable():
    buf = torch.arange(8.0)
    batch = HostCopyBatch()
    first = batch.copy(buf[2:6])
    batch.wait()
    buf.fill_(0.0)  # the source buffer is reused for the next step
    assert torch.equal(first.value, torch.tensor([2.0, 3.0, 4.0, 5.0]))
    second = batch.copy(buf)
    with pytest.raises(HostCopyNotReadyError):
        _ = second.value  # a copy issued after the previous wait needs a new wait
    assert first.ready
    batch.wait()
    assert torch.equal(second.value, torch.zeros(8))


def test_rejects_non_tensor():
    with pytest.raises(TypeError):
        HostCopyBatch().copy([1, 2, 3])


@needs_cuda
def test_cuda_pinned_non_contiguous_default_stream():
    srcs = sources("cuda")
    batch = HostCopyBatch()
    handles = [batch.copy(s) for s in srcs]
    with pytest.raises(HostCopyNotReadyError):
        _ = handles[0].value
    batch.wait()
    for src, h in zip(srcs, handles):
        assert h.value.device.type == "cpu" and h.value.is_pinned()
        assert torch.equal(h.value, src.cpu())


@needs_cuda
def test_cuda_copies_issued_on_a_side_stream_where_the_data_is_produced():
    side = torch.cuda.Stream()
    batch = HostCopyBatch()
    with torch.cuda.stream(side):
        big = torch.randn(2048, 1024, device="cuda")
        produced = (big @ big.t())[::3, 1::2]  # long kernel, non-contiguous result
        handle = batch.copy(produced)
        expected = produced.clone()
    batch.wait()  # must wait for the side stream, not the default one
    torch.cuda.synchronize()
    assert handle.value.is_pinned()
    assert torch.equal(handle.value, expected.cpu())


@needs_cuda
def test_cuda_copies_on_a_dedicated_copy_stream_wait_for_the_producer():
    copy_stream = torch.cuda.Stream()
    batch = HostCopyBatch(stream=copy_stream)
    big = torch.randn(2048, 1024, device="cuda")
    produced = (big @ big.t()).t()[:, 5:700]  # produced on the current stream, non-contiguous
    handle = batch.copy(produced)
    del produced  # the batch keeps the device source alive until the copy completes
    batch.wait()
    torch.cuda.synchronize()
    assert torch.equal(handle.value, (big @ big.t()).t()[:, 5:700].cpu())

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    from omnistage.testing.checkpoint import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("tiny"), preset="tiny", seed=0)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # 2-core CI machines: torch's spinning worker threads cost more than they give on tiny models.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

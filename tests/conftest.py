"""Test set-up shared by every tier.

TRITON_INTERPRET must be set before any ``@triton.jit`` function is defined, so it is set here, first.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def isolated_kernel_cache(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - a generator fixture
    """Compiled Triton kernels go to a fresh cache directory for the module, not the user's ~/.cache."""
    from autopar.codegen.kernels import cache as kcache

    old = os.environ.get(kcache.ENV_CACHE)
    os.environ[kcache.ENV_CACHE] = str(tmp_path_factory.mktemp("kernels"))
    yield
    if old is None:
        del os.environ[kcache.ENV_CACHE]
    else:
        os.environ[kcache.ENV_CACHE] = old


@pytest.fixture
def fake_world():  # noqa: ANN201 - a generator fixture
    """``fake_world(n)`` starts a one-process fake process group of world size ``n`` (torch's FakeStore), so a
    64-rank mesh can be built and its collectives counted without spawning; torn down after the test."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init(world: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()

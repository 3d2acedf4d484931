"""``tandem profile`` on a tiny model end to end, and planning from its output."""

from __future__ import annotations

import json

import pytest

from tandem.profile import ModelProfile
from tests.conftest import run_here

pytestmark = pytest.mark.pure


def test_profile_then_plan(tmp_path) -> None:
    target = tmp_path / "mlp.json"
    done = run_here("profile", "--model", "mlp", "--batch-size", "8", "--repeats", "2",
                    "--warmup", "1", "-o", str(target), "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout.strip().splitlines()[-1])
    profile = ModelProfile.load(str(target))
    assert profile.to_dict() == data and profile.batch_size == 8
    assert f"tandem plan --profile {target} -o OUT/plan.json" in done.stderr  # how to keep a split
    assert profile.num_layers >= 2 and profile.is_chain
    assert all(layer.forward_s > 0 and layer.backward_s > 0 for layer in profile.layers)
    assert profile.layers[0].parameter_bytes > 0 and profile.layers[-1].activation_bytes > 0
    done = run_here("plan", "--profile", str(target), "--devices", "2", "--bandwidth", "10Gb/s",
                    "--json")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["stages"][-1]["end"] == profile.num_layers


def test_profile_unknown_model() -> None:
    done = run_here("profile", "--model", "nosuch", "--batch-size", "8")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1


def test_profile_of_gpt_records_its_tensor_allreduces(tmp_path) -> None:
    """A reference model's profile says how ``--tensor-parallel`` splits each layer: a GPT
    block two allreduces each way (attention and MLP pairs), embedding and head none; a model
    with dropout, which cannot be split, records nothing."""
    target = tmp_path / "gpt.json"
    done = run_here("profile", "--model", "gpt:layers=2,dim=16,heads=2", "--data",
                    "tokens:n=64,seq=8,vocab=16", "--batch-size", "4", "--repeats", "1",
                    "--warmup", "0", "-o", str(target))
    assert done.returncode == 0, done.stderr
    counts = [layer.tensor_allreduces for layer in ModelProfile.load(str(target)).layers]
    assert counts == [(0, 0), (2, 2), (2, 2), (0, 0)]
    done = run_here("profile", "--model", "gpt:layers=1,dim=16,heads=2,dropout=0.1", "--data",
                    "tokens:n=64,seq=8,vocab=16", "--batch-size", "4", "--repeats", "1",
                    "--warmup", "0", "-o", str(target))
    assert done.returncode == 0, done.stderr
    assert all(layer.tensor_allreduces is None for layer in ModelProfile.load(str(target)).layers)

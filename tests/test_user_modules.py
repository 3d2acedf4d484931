"""What the README promises a user's own code: the sampler import, and ``--model
package.module:function`` found in the current directory by the ``tandem`` script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from tandem.data import GlobalBatchSampler, RankBatchSampler

SKIP_MODEL = '''
import torch
from torch import nn


class Skip(nn.Module):
    """Not an nn.Sequential: a skip connection around a BatchNorm block."""

    def __init__(self, info):
        super().__init__()
        self.hidden = nn.Linear(64, 64)
        self.norm = nn.BatchNorm1d(64)
        self.out = nn.Linear(64, info.num_classes)

    def forward(self, x):
        x = x.flatten(1)
        return self.out(torch.relu(self.norm(self.hidden(x))) + x)


def build(info):
    return Skip(info)
'''


@pytest.mark.pure
def test_rank_batch_sampler_is_importable_and_shares_each_global_batch() -> None:
    dataset = TensorDataset(torch.arange(100))
    sampler = GlobalBatchSampler(len(dataset), global_batch_size=10, seed=1)
    seen = []
    for rank in range(3):
        loader = DataLoader(dataset, batch_sampler=RankBatchSampler(sampler, rank=rank, world_size=3))
        seen.append([batch[0].tolist() for batch in loader])
    first_step = sorted(sum((shares[0] for shares in seen), []))
    assert first_step == sorted(sampler.global_indices(0).tolist())
    assert [len(shares[0]) for shares in seen] == [4, 3, 3]


@pytest.mark.cli
def test_the_tandem_script_finds_a_module_in_the_current_directory(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "tandem"
    if not script.exists():
        pytest.skip("the tandem console script is not installed next to this Python")
    (tmp_path / "skipnet.py").write_text(SKIP_MODEL)
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    result = subprocess.run(
        [str(script), "train", "--model", "skipnet:build", "--nproc", "2", "--steps", "3",
         "--batch-size", "32", "--json", "--no-progress"],
        capture_output=True, text=True, cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1"},
        timeout=180)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert (summary["model"], summary["world_size"], summary["steps"]) == ("skipnet:build", 2, 3)

"""``--sync-batchnorm`` (issue 29): a BatchNorm CNN on 2 and 4 workers, and sharded on 2, ends
where one process does, running statistics included; without the flag each worker normalizes
its own share and the runs differ. On CPUs the layers are tandem's ``GlobalBatchNorm`` (torch's
``SyncBatchNorm`` runs on GPUs only)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tandem.sync.sync_batchnorm import GlobalBatchNorm, sync_batchnorms
from tests.conftest import SharedRun, max_abs_diff, run_here

BN = ("--model", "tests.bn_models:resnet", "--data", "digits", "--steps", "6",
      "--batch-size", "32", "--lr", "0.05", "--seed", "2")


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", [("--nproc", "2"), ("--nproc", "4"),
                                    ("--nproc", "2", "--shard", "2")],
                         ids=["2 workers", "4 workers", "sharded 2"])
def test_a_batchnorm_cnn_ends_where_one_process_does(shared_run: SharedRun,
                                                     layout: tuple[str, ...]) -> None:
    single, _ = shared_run(*BN, "--nproc", "1")
    out, summary = shared_run(*BN, *layout, "--sync-batchnorm")
    assert summary["sync_batchnorm"] is True
    assert max_abs_diff(single / "final.pt", out / "final.pt") <= 1e-5


@pytest.mark.multiprocess
def test_without_it_each_worker_normalizes_its_own_share(shared_run: SharedRun) -> None:
    single, _ = shared_run(*BN, "--nproc", "1")
    out, summary = shared_run(*BN, "--nproc", "2")
    assert "sync_batchnorm" not in summary
    assert max_abs_diff(single / "final.pt", out / "final.pt") > 1e-4


@pytest.mark.pure
def test_the_layers_keep_their_tensors_and_names() -> None:
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4),
                          nn.Sequential(nn.Flatten(), nn.BatchNorm1d(4 * 6 * 6, affine=False)))
    before = dict(model.state_dict(keep_vars=True))
    converted = sync_batchnorms(model, torch.device("cpu"))
    assert isinstance(converted[1], GlobalBatchNorm) and isinstance(converted[2][1],
                                                                     GlobalBatchNorm)
    after = dict(converted.state_dict(keep_vars=True))
    assert list(after) == list(before) and all(after[k] is before[k] for k in before)
    x = torch.randn(5, 1, 8, 8)  # one process: the layer is BatchNorm itself
    reference = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4))
    reference.load_state_dict({k: v for k, v in before.items() if k.startswith(("0.", "1."))})
    torch.testing.assert_close(converted[:2](x), reference(x))


@pytest.mark.multiprocess  # tandem train starts the forkserver before its checks
@pytest.mark.parametrize("args, message", [
    (("--model", "mlp", "--nproc", "2"),
     "--sync-batchnorm: the model has no BatchNorm layer to synchronize; drop --sync-batchnorm"),
    (("--model", "tests.bn_models:resnet", "--strategy", "pipeline", "--stages", "2",
      "--nproc", "2"), "--sync-batchnorm applies to --strategy dp only"),
])
def test_it_is_refused_where_it_does_not_apply(args: tuple[str, ...], message: str) -> None:
    result = run_here("train", *args, "--data", "digits", "--steps", "2", "--sync-batchnorm")
    assert result.returncode == 2 and message in result.stderr.strip().splitlines()[-1]


def _halves(rank: int, world: int, dtype: str) -> list[float]:
    """Rank ``rank``'s half of a batch through a ``GlobalBatchNorm`` in ``dtype``, against
    ``nn.BatchNorm2d`` in fp32 on the whole batch: the largest difference of the output and of
    the input's gradient, and whether any value is not finite."""
    torch.manual_seed(0)
    whole = torch.randn(2 * 64, 3, 32, 32) * 3 + 1  # 65,536 values a channel per worker
    weights = torch.randn_like(whole)  # a loss whose gradient the normalization does not cancel
    reference = nn.BatchNorm2d(3)
    x = whole.clone().requires_grad_(True)
    (reference(x) * weights).sum().backward()
    layer = sync_batchnorms(nn.Sequential(nn.BatchNorm2d(3)), torch.device("cpu"))
    mine = whole[rank * 64:(rank + 1) * 64].to(getattr(torch, dtype)).requires_grad_(True)
    out = layer(mine)
    (out.float() * weights[rank * 64:(rank + 1) * 64]).sum().backward()
    assert mine.grad is not None and x.grad is not None
    expected = reference(whole)[rank * 64:(rank + 1) * 64]
    return [float((out.float() - expected).abs().max()),
            float((mine.grad.float() - x.grad[rank * 64:(rank + 1) * 64]).abs().max()
                  / x.grad.abs().max()),
            float(not torch.isfinite(out).all())]


@pytest.mark.multiprocess
@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-5), ("float16", 2e-3),
                                              ("bfloat16", 2e-2)])
def test_the_statistics_are_taken_in_fp32_whatever_the_input(dtype: str,
                                                             tolerance: float) -> None:
    """64 samples of 32 x 32 a worker: 65,536 values a channel, which fp16 cannot count."""
    from tests.distributed import run_distributed

    for output, gradient, infinite in run_distributed(_halves, 2, dtype, timeout_s=90):
        assert not infinite and output <= tolerance * 10 and gradient <= tolerance, \
            (output, gradient)

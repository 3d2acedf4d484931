"""A user's own data, loss and model: ``--data package.module:function``, ``--data folder:PATH``,
``--loss``, and the Python API ``tandem.fit``, each against an independent reference."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn import functional as F

import tandem
from tandem.data import GlobalBatchSampler, load_data
from tandem.errors import UsageError
from tests import user_data
from tests.conftest import max_abs_diff, run_here, run_json

SMALL = ("--steps", "20", "--batch-size", "32", "--lr", "0.05", "--momentum", "0.9",
         "--seed", "5", "--no-progress")


def _write_digit_pngs(root: Path) -> int:
    """The 1,797 digits as 8-bit grayscale PNG files, one folder per class."""
    from PIL import Image
    from sklearn.datasets import load_digits

    raw = load_digits()
    for index, (image, label) in enumerate(zip(raw.images, raw.target)):
        folder = root / f"digit{label}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray((image * 255 / 16).astype(np.uint8), mode="L").save(
            folder / f"{index:04d}.png")
    return len(raw.images)


@pytest.mark.multiprocess
@pytest.mark.statistical
def test_a_folder_of_1797_png_digits_trains_to_95_percent(tmp_path: Path) -> None:
    count = _write_digit_pngs(tmp_path / "digits")
    assert count == 1797 and len(list((tmp_path / "digits").rglob("*.png"))) == 1797
    data = load_data(f"folder:{tmp_path / 'digits'}")
    assert data.info.num_classes == 10 and data.info.input_shape == (1, 8, 8)
    assert len(data.train) + len(data.test) == 1797
    summary = run_json("train", "--data", f"folder:{tmp_path / 'digits'}", "--nproc", "2",
                       "--steps", "500", "--batch-size", "64")
    assert summary["test_accuracy"] >= 0.95, summary


@pytest.mark.pure
def test_a_folder_with_train_and_test_subfolders_keeps_its_split(tmp_path: Path) -> None:
    from PIL import Image

    for part, count in (("train", 6), ("test", 2)):
        for label in ("cat", "dog"):
            folder = tmp_path / part / label
            folder.mkdir(parents=True)
            for i in range(count):
                Image.new("RGB", (4, 4), (i * 30, 0, 0)).save(folder / f"{i}.png")
    data = load_data(f"folder:{tmp_path}")
    assert (len(data.train), len(data.test)) == (12, 4)
    assert data.info.input_shape == (3, 4, 4) and data.info.num_classes == 2


@pytest.mark.multiprocess
def test_user_data_function_with_dict_inputs_matches_single_process(tmp_path: Path) -> None:
    """A map-style dataset whose inputs are dicts and a module with a skip connection: 2 workers
    end equal to 1. (Without BatchNorm: on CPU each worker normalises over its own share of the
    batch, as DDP does, since SyncBatchNorm needs GPUs; tests/test_buffers.py holds buffers.)
    The launcher (this process) calls the data function once per run, its checks included."""
    from tests import user_data

    args = ("train", "--model", "tests.user_data:skip_net:norm=False", "--data",
            "tests.user_data:digit_dicts", *SMALL)
    run_json(*args, "--nproc", "1", "--out", str(tmp_path / "one"))
    user_data.CALLS["digit_dicts"] = 0
    run_json(*args, "--nproc", "2", "--out", str(tmp_path / "two"))
    assert user_data.CALLS["digit_dicts"] == 1
    assert max_abs_diff(tmp_path / "one" / "final.pt", tmp_path / "two" / "final.pt") <= 1e-5


@pytest.mark.multiprocess
def test_user_loss_of_a_structured_output_equals_a_plain_pytorch_loop(tmp_path: Path) -> None:
    """``--loss`` on a model that returns a dict, against a hand-written training loop over the
    same global batches (the sampler's order) with the same initial parameters."""
    summary = run_json("train", "--model", "tests.user_data:pair_net", "--data",
                       "tests.user_data:digit_pairs", "--loss", "tests.user_data:smoothed_loss",
                       *SMALL, "--nproc", "2", "--out", str(tmp_path))
    torch.manual_seed(5)
    model = user_data.pair_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    train, _ = user_data.digit_pairs()
    sampler = GlobalBatchSampler(len(train), global_batch_size=32, seed=5)
    for step in range(20):
        items = [train[i] for i in sampler.global_indices(step).tolist()]
        x = torch.stack([item[0] for item in items])
        y = torch.tensor([item[1] for item in items])
        optimizer.zero_grad()
        user_data.smoothed_loss(model(x), y).backward()
        optimizer.step()
    trained = torch.load(tmp_path / "final.pt")
    assert max(float((trained[k] - v).abs().max()) for k, v in model.state_dict().items()) <= 1e-5
    assert summary["test_accuracy"] is not None


BAD = {
    "data function raises": (("--data", "tests.user_data:broken:n=3"),
                             "--data tests.user_data:broken:n=3: tests.user_data.broken() raised "
                             "FileNotFoundError: no such file: shard-3.bin; fix the function or "
                             "its options"),
    "data function returns no datasets": (("--data", "tests.user_data:not_datasets"),
                                          "returned int; return (train, test) datasets"),
    "loss returns one value per sample": (("--loss", "tests.user_data:per_sample_loss"),
                                          "--loss tests.user_data:per_sample_loss returned a "
                                          "float32 tensor of shape (1,); it must return a scalar"),
    "loss is not importable": (("--loss", "nosuch.module:fn"), "cannot import module 'nosuch.module'"),
    "loss without a function": (("--loss", "torch.nn"), "--loss 'torch.nn' is not package.module:function"),
    "folder without images": (("--data", "folder:{empty}"), "has no class subfolders"),
    "folder that does not exist": (("--data", "folder:/no/such/dir"),
                                   "/no/such/dir is not a directory"),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_user_data_and_loss_are_one_line_and_status_2(tmp_path: Path, case: str) -> None:
    args, expected = BAD[case]
    args = tuple(arg.replace("{empty}", str(tmp_path)) for arg in args)
    result = run_here("train", "--steps", "2", "--no-progress", *args)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert expected in lines[0], lines[0]


@pytest.mark.pure
def test_folder_of_images_of_different_sizes_says_how_to_resize(tmp_path: Path) -> None:
    from PIL import Image

    (tmp_path / "a").mkdir()
    Image.new("L", (4, 4)).save(tmp_path / "a" / "x.png")
    Image.new("L", (5, 5)).save(tmp_path / "a" / "y.png")
    with pytest.raises(UsageError, match="different sizes .*size=S"):
        load_data(f"folder:{tmp_path}:test=0.5")  # (two images: the default test=0.2 of them
        # would leave no test image, which is said first: the split is listed before reading)
    assert load_data(f"folder:{tmp_path}:size=3,test=0.5").info.input_shape == (1, 3, 3)


@pytest.mark.multiprocess
def test_fit_trains_the_users_module_in_place_and_equals_a_plain_loop() -> None:
    """The Python API with objects: a module, two Datasets and a loss function, on 2 workers;
    the module given is updated with the result, equal to a hand-written loop."""
    torch.manual_seed(1)
    model = user_data.pair_net()
    start = copy.deepcopy(model)
    train, test = user_data.digit_pairs()
    result = tandem.fit(model, train, test, loss=user_data.smoothed_loss, nproc=2, steps=10,
                        batch_size=16, lr=0.1, momentum=0.0, seed=2)
    assert result.model is model and result.summary["steps"] == 10
    assert result.summary["test_accuracy"] is not None
    optimizer = torch.optim.SGD(start.parameters(), lr=0.1)
    sampler = GlobalBatchSampler(len(train), global_batch_size=16, seed=2)
    for step in range(10):
        items = [train[i] for i in sampler.global_indices(step).tolist()]
        optimizer.zero_grad()
        user_data.smoothed_loss(start(torch.stack([i[0] for i in items])),
                                torch.tensor([i[1] for i in items])).backward()
        optimizer.step()
    for key, value in start.state_dict().items():
        assert torch.allclose(model.state_dict()[key], value, atol=1e-5), key


@pytest.mark.multiprocess
def test_fit_reads_an_iterable_dataset_and_takes_plan_options(tmp_path: Path) -> None:
    result = tandem.fit(user_data.pair_net, user_data.DigitStream(), user_data.DigitPairs("test"),
                        strategy="ps", servers=1, nproc=3, steps=30, batch_size=32,
                        out=tmp_path)
    assert result.summary["strategy"] == "ps" and result.summary["steps"] == 30
    assert (tmp_path / "final.pt").exists() and isinstance(result.model, user_data.PairNet)


@pytest.mark.pure
def test_fit_refuses_unknown_options_and_unpicklable_objects() -> None:
    with pytest.raises(UsageError, match="unknown option 'stepz'; did you mean 'steps'"):
        tandem.fit("mlp", data="digits", stepz=3)
    with pytest.raises(UsageError, match="the loss cannot be sent to the worker processes"):
        tandem.fit("mlp", data="digits", loss=lambda out, y: F.cross_entropy(out, y), steps=2)
    with pytest.raises(UsageError, match="needs the training data"):
        tandem.fit("mlp")


@pytest.mark.multiprocess
def test_fit_runs_a_plan_object_with_its_workers(tmp_path: Path) -> None:
    from tandem.strategy import plan_from_flags

    plan = plan_from_flags("localsgd", {"--period": 2}, num_processes=2, num_blocks=None)
    plan.save(str(tmp_path / "plan.json"))
    for given in (plan, str(tmp_path / "plan.json")):
        result = tandem.fit(user_data.pair_net, user_data.DigitPairs("train"), plan=given,
                            steps=6, batch_size=16)
        assert result.summary["strategy"] == "localsgd" and result.summary["world_size"] == 2
        assert result.summary["scored_on"].startswith("training data")
    with pytest.raises(UsageError, match="--servers conflicts with --plan"):
        tandem.fit(user_data.pair_net, user_data.DigitPairs("train"), plan=plan, servers=1)

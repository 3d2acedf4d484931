"""Tensor parallelism of users' models through a plan naming their linear layers
(``--tensor-layers``, ``tensor_layers=`` in ``tandem.fit``, ``"tensor_layers"`` in a plan file).

Two models nobody wrote for tandem, split with T = 2 on one 2-process gloo group, end equal to
one process after 20 SGD steps: a Hugging Face BERT classifier (attention by its separate query,
key and value layers, the MLP as a pair) and :class:`SkipNet` (skip connections, a dict output, a
row-wise layer with no column-wise one before it and a column-wise one with no row-wise one
after it). The whole job runs once through ``tandem.fit``; bad plans are one line and exit
status 2, before any worker starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tandem.data.info import DataInfo
from tandem.plan import Plan, Stage

from tests.conftest import run_cli
from tests.distributed import run_distributed

STEPS, BATCH, LR, MOMENTUM, SEED = 20, 8, 0.05, 0.9, 3
VOCAB, SEQ = 32, 8


class Block(nn.Module):
    """Pre-norm residual MLP block."""

    def __init__(self, dim: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm(x)))))


class SkipNet(nn.Module):
    """Flattened images -> a whole-input stem, batch norm, two residual blocks, a projection,
    and a dict of logits and features."""

    def __init__(self, inputs: int = 64, dim: int = 24, hidden: int = 48, classes: int = 10,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.stem = nn.Linear(inputs, dim)
        self.norm = nn.BatchNorm1d(dim)
        self.blocks = nn.Sequential(Block(dim, hidden, dropout), Block(dim, hidden, dropout))
        self.proj = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        features = torch.tanh(self.proj(self.blocks(self.norm(self.stem(x.flatten(1))))))
        return {"logits": self.head(features), "features": features}


def skip_net(info: DataInfo, dropout: float = 0.0) -> nn.Module:
    """``--model tests.test_tensor_user_plan:skip_net``."""
    return SkipNet(inputs=int(torch.tensor(info.input_shape).prod()), classes=info.num_classes,
                   dropout=dropout)


def tied_net(info: DataInfo) -> nn.Module:
    """SkipNet whose second block's first layer is the first block's (one weight, twice)."""
    model = skip_net(info)
    model.blocks[1].fc1.weight = model.blocks[0].fc1.weight
    return model


SKIP_LAYERS = {"stem": "rowwise", "blocks.0.fc1": "colwise", "blocks.0.fc2": "rowwise",
               "blocks.1.fc1": "colwise", "blocks.1.fc2": "rowwise", "proj": "colwise"}
"""The stem has no column-wise layer before it, the projection no row-wise one after it."""


def bert() -> nn.Module:
    """A 2-layer Hugging Face BERT classifier with dropout off (random init, no download)."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=32, max_position_embeddings=SEQ,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)
    return BertForSequenceClassification(config)


BERT_LAYERS = {f"bert.encoder.layer.{index}.{name}": style for index in range(2)
               for name, style in [("attention.self.query", "colwise"),
                                   ("attention.self.key", "colwise"),
                                   ("attention.self.value", "colwise"),
                                   ("attention.output.dense", "rowwise"),
                                   ("intermediate.dense", "colwise"),
                                   ("output.dense", "rowwise")]}
"""Megatron's BERT: heads by the query, key and value layers, the output projection by rows,
the MLP as a pair; embeddings, norms, the pooler and the classifier whole."""

IMAGES = DataInfo(task="classify", input_shape=(1, 8, 8), num_classes=10)


def _batches(name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(SEED)
    if name == "bert":
        inputs = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ), generator=generator)
        labels = torch.randint(0, 3, (STEPS, BATCH), generator=generator)
    else:
        inputs = torch.randn(STEPS, BATCH, 1, 8, 8, generator=generator)
        labels = torch.randint(0, 10, (STEPS, BATCH), generator=generator)
    return list(zip(inputs, labels))


def _build(name: str) -> tuple[nn.Module, dict[str, str]]:
    torch.manual_seed(SEED)
    return (bert(), BERT_LAYERS) if name == "bert" else (skip_net(IMAGES), SKIP_LAYERS)


def _train(name: str, model: nn.Module) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for inputs, targets in _batches(name):
        output = model(inputs)
        logits = output.logits if name == "bert" else output["logits"]
        loss = F.cross_entropy(logits, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _split_training(rank: int, world_size: int) -> dict[str, Any]:
    """Both models split over this 2-rank group and trained: their whole gathered state."""
    from torch.distributed.device_mesh import init_device_mesh

    from tandem.models.tensor import tensor_plan
    from tandem.runtime.tensor_parallel import gathered_state_dict, split_model

    mesh = init_device_mesh("cpu", (world_size,))
    results: dict[str, Any] = {}
    for name in ("bert", "skipnet"):
        model, layers = _build(name)
        plan = tensor_plan(None, model, world_size, layers)
        split_model(model, plan, mesh)
        _train(name, model)
        state = gathered_state_dict(model, plan, mesh)
        local = {key: tuple(value.to_local().shape) for key, value in model.state_dict().items()
                 if hasattr(value, "to_local")}
        results[name] = {"state": {key: value.numpy() for key, value in state.items()},
                         "local": local}
    return results if rank == 0 else {}


@pytest.fixture(scope="module")
def split_results() -> dict[str, Any]:
    return run_distributed(_split_training, 2, timeout_s=300)[0]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["bert", "skipnet"])
def test_users_model_split_by_its_plan_equals_one_process(split_results: dict[str, Any],
                                                          name: str) -> None:
    model, layers = _build(name)
    _train(name, model)
    expected = model.state_dict()
    got = split_results[name]
    assert list(got["state"]) == list(expected)  # parameters and buffers, the model's own names
    for key, value in expected.items():
        assert float((torch.from_numpy(got["state"][key]) - value).abs().max()) <= 1e-5, key
    split = {f"{layer}.weight" for layer in layers}
    assert set(got["local"]) >= split  # every named layer was split, and only halves are held
    for key in split:
        assert got["local"][key][0] * got["local"][key][1] * 2 == expected[key].numel(), key


@pytest.mark.multiprocess
def test_fit_with_tensor_layers_equals_one_process(tmp_path: Path) -> None:
    """The whole job, through ``tandem.fit``: the same run on one process and on two."""
    import tandem
    from tandem.data import load_data

    data = load_data("digits")
    options = dict(steps=10, batch_size=32, lr=0.05, momentum=0.9, seed=SEED)
    single = tandem.fit(skip_net, data.train, data.test, nproc=1, out=tmp_path / "one",
                        **options)
    split = tandem.fit(skip_net, data.train, data.test, nproc=2, tensor_parallel=2,
                       tensor_layers=SKIP_LAYERS, out=tmp_path / "two", **options)
    assert split.summary["tensor_parallel"] == 2
    assert split.model is not None and single.model is not None
    for (key, value), (_, whole) in zip(split.model.state_dict().items(),
                                        single.model.state_dict().items()):
        assert float((value - whole).abs().max()) <= 1e-5, key


@pytest.mark.pure
def test_plan_file_keeps_the_tensor_layers(tmp_path: Path) -> None:
    plan = Plan(stages=[Stage(start=0, end=1, replicas=1)], num_layers=1, num_devices=2,
                tensor_degree=2, tensor_layers={"fc1": "colwise", "fc2": "rowwise"})
    plan.save(str(tmp_path / "plan.json"))
    assert Plan.load(str(tmp_path / "plan.json")).tensor_layers == plan.tensor_layers
    old = plan.to_dict()
    del old["tensor_layers"]  # a plan written before the field existed
    assert Plan.from_dict(json.loads(json.dumps(old))).tensor_layers is None


MODEL = ("--model", "tests.test_tensor_user_plan:skip_net", "--data", "digits")
TWO = ("--tensor-parallel", "2", "--nproc", "2")
BAD = {
    "not a module": ((*MODEL, *TWO, "--tensor-layers", "blocks.0.fc=colwise"),
                     "tensor layer 'blocks.0.fc' is not a module of the model; did you mean "
                     "'blocks.0.fc2' or 'blocks.0.fc1'"),
    "not a linear layer": ((*MODEL, *TWO, "--tensor-layers", "blocks.0.norm=colwise"),
                           "tensor layer 'blocks.0.norm' is a LayerNorm, but style colwise "
                           "splits an nn.Linear or a Conv1D; name an nn.Linear, Conv1D or "
                           "nn.Conv2d inside it"),
    "not a convolution": ((*MODEL, *TWO, "--tensor-layers", "stem=channels"),
                          "tensor layer 'stem' is a Linear, but style channels splits an "
                          "nn.Conv2d; use colwise or rowwise or heads"),
    "unknown style": ((*MODEL, *TWO, "--tensor-layers", "stem=diagonal"),
                      "tensor layer 'stem' has style 'diagonal'; use one of colwise, rowwise, "
                      "heads, channels"),
    "not NAME=STYLE": ((*MODEL, *TWO, "--tensor-layers", "stem"),
                       "write NAME=STYLE pairs separated by commas"),
    "degree": ((*MODEL, "--tensor-parallel", "5", "--nproc", "5", "--tensor-layers",
                "blocks.0.fc1=colwise"),
               "--tensor-parallel 5 does not divide the 48 output features of tensor layer "
               "'blocks.0.fc1' (colwise); use --tensor-parallel 2 or 3 or 4 or 6, or leave "
               "'blocks.0.fc1' whole"),
    "heads alone": ((*MODEL, *TWO, "--tensor-layers", "blocks.1.fc1=heads"),
                    "tensor layer 'blocks.1.fc1' (heads) has no rowwise layer after it"),
    "tied": (("--model", "tests.test_tensor_user_plan:tied_net", "--data", "digits", *TWO,
              "--tensor-layers", "blocks.0.fc1=colwise,blocks.0.fc2=rowwise"),
             "tensor layer 'blocks.0.fc1' has its parameter 'blocks.0.fc1.weight' tied to "
             "'blocks.1.fc1.weight'"),
    "dropout": (("--model", "tests.test_tensor_user_plan:skip_net:dropout=0.1", "--data",
                 "digits", *TWO, "--tensor-layers", "stem=rowwise"),
                "needs a model without dropout (module blocks.0.drop drops 0.1; its masks on a "
                "worker's share would differ from one process's); set the model's dropout "
                "probabilities to 0"),
    "degree 1": ((*MODEL, "--tensor-layers", "stem=rowwise"),
                 "--tensor-layers names the layers to split, but the tensor degree is 1"),
    "no plan": ((*MODEL, *TWO), "name its layers to split with --tensor-layers"),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_tensor_layers_are_one_line(capsys: pytest.CaptureFixture[str], name: str) -> None:
    args, message = BAD[name]
    code, _, err = run_cli(capsys, "train", "--steps", "2", "--batch-size", "8", *args)
    assert code == 2, err
    assert err.count("\n") == 1 and message in err, err

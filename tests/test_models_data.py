"""Reference models, datasets and the spec syntax that names them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tandem.data import build_dataset
from tandem.errors import UsageError
from tandem.models import build_model
from tandem.spec.options import split_spec

pytestmark = pytest.mark.pure

DIGITS = build_dataset("digits")


def test_digits_is_the_real_dataset() -> None:
    assert len(DIGITS.train) + len(DIGITS.test) == 1797
    assert DIGITS.train.inputs.shape[1:] == (1, 8, 8)
    assert 0.0 <= float(DIGITS.train.inputs.min()) and float(DIGITS.train.inputs.max()) <= 1.0
    assert set(DIGITS.test.targets.tolist()) == set(range(10))


def test_synthetic_data_sizes_and_determinism() -> None:
    images = build_dataset("images:n=100,size=16,channels=1,classes=3,test=0.25")
    assert len(images.train) == 75 and images.train.inputs.shape[1:] == (1, 16, 16)
    again = build_dataset("images:n=100,size=16,channels=1,classes=3,test=0.25")
    assert torch.equal(images.train.inputs, again.train.inputs)
    tokens = build_dataset("tokens:n=20,seq=12,vocab=16")
    assert tokens.train.inputs.shape[1:] == (12,) and tokens.info.task == "lm"
    assert torch.equal(tokens.train.inputs[:, 1:], tokens.train.targets[:, :-1])


@pytest.mark.parametrize(("spec", "num_blocks"), [
    ("mlp", 4), ("mlp:layers=6,hidden=32", 6), ("resnet", 11), ("resnet:depth=50,width=4", 18),
    ("vgg:width=0.0625", 16),
])
def test_image_models_are_sequential_blocks(spec: str, num_blocks: int) -> None:
    model = build_model(spec, DIGITS.info)
    assert isinstance(model, nn.Sequential) and len(model) == num_blocks
    assert model(DIGITS.train.inputs[:3]).shape == (3, 10)


def test_resnet50_layout() -> None:
    images = build_dataset("images:n=4,size=64,channels=3")
    model = build_model("resnet:depth=50,width=8", images.info)
    bottlenecks = [m for m in model if type(m).__name__ == "Bottleneck"]
    assert len(bottlenecks) == 16  # 3 + 4 + 6 + 3
    assert model(images.train.inputs[:2]).shape == (2, 10)


def test_vgg16_has_13_convolutions_and_3_linear_layers() -> None:
    model = build_model("vgg:width=0.0625", DIGITS.info)
    kinds = [type(m).__name__ for m in model.modules()]
    assert kinds.count("Conv2d") == 13 and kinds.count("Linear") == 3


def test_gpt_is_causal() -> None:
    tokens = build_dataset("tokens:n=8,seq=10,vocab=20")
    torch.manual_seed(0)
    model = build_model("gpt:layers=2,dim=32,heads=4", tokens.info).eval()
    x = tokens.train.inputs[:2]
    changed = x.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 20
    assert model(x).shape == (2, 10, 20)
    assert torch.allclose(model(x)[:, :-1], model(changed)[:, :-1], atol=1e-6)


def test_user_model_from_import_path() -> None:
    model = build_model("tests.faulty_models:crash:rank=5,after=2", DIGITS.info)
    assert model.rank == 5 and model.after == 2


@pytest.mark.parametrize(("spec", "message"), [
    ("nosuch", "unknown model 'nosuch'"),
    ("mlp:hidden", "malformed model option 'hidden'"),
    ("mlp:layers=1", "layers must be at least 2"),
    ("gpt:dim=30,heads=4", "heads (4) must divide dim (30)"),
    ("resnet:depth=21", "6n+2"),
    ("tests.no_such_module:build", "cannot import module 'tests.no_such_module'"),
    ("tests.faulty_models:nothing", "has no function 'nothing'"),
])
def test_model_errors_name_the_value(spec: str, message: str) -> None:
    info = build_dataset("tokens:n=8").info if spec.startswith("gpt") else DIGITS.info
    with pytest.raises(UsageError) as error:
        build_model(spec, info)
    assert message in str(error.value)


def test_spec_syntax() -> None:
    assert split_spec("gpt:layers=4, dim=128", what="model") == ("gpt", {"layers": "4", "dim": "128"})
    with pytest.raises(UsageError, match="given twice"):
        split_spec("gpt:layers=4,layers=2", what="model")
    with pytest.raises(UsageError, match="unknown dataset option 'size'"):
        build_dataset("digits:size=3")

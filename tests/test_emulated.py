"""The emulated model: blocks from a profile that wait the profiled times and pass profiled sizes.

Timing is asserted loosely (never faster than the profile; an upper bound only generous enough
to catch a wrong factor), since this machine's other processes can delay any wake-up.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tandem.data import build_dataset
from tandem.errors import UsageError
from tandem.models import build_model
from tandem.models.emulated import _Emulate
from tandem.profile import LayerProfile, ModelProfile

pytestmark = pytest.mark.pure

IMAGES = build_dataset("images:n=64,size=4,channels=1,classes=5")
TOKENS = build_dataset("tokens:n=16,seq=6,vocab=11")
PROFILES = Path(__file__).parent / "data" / "profiles"


def write_profile(path: Path, *, batch_size: int | None = 8) -> str:
    """Three layers: 30/20/10 ms forward, twice that backward, 4 KB / 2 KB / 1 KB outputs."""
    layers = [
        LayerProfile(name=f"layer{i}", forward_s=f, backward_s=2 * f, activation_bytes=a,
                     parameter_bytes=p)
        for i, (f, a, p) in enumerate([(0.03, 4096, 800), (0.02, 2048, 0), (0.01, 1024, 400)])
    ]
    ModelProfile(layers=layers, batch_size=batch_size).save(str(path / "profile.json"))
    return str(path / "profile.json")


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def test_blocks_have_the_profiled_sizes_and_logits_last(tmp_path: Path) -> None:
    model = build_model(f"emulated:profile={write_profile(tmp_path)}", IMAGES.info)
    assert len(model) == 3
    x = IMAGES.train.inputs[:4]
    out0 = model[0](x)
    assert out0.shape == (4, 4096 // 8 // 4) and out0.dtype == torch.float32  # bytes per sample
    assert model[1](out0).shape == (4, 2048 // 8 // 4)
    assert model(x).shape == (4, 5)  # the last block gives the dataset's classes
    assert all(p.numel() == 2 for p in model[:2].parameters())  # params=small


def test_token_data_gets_logits_per_position(tmp_path: Path) -> None:
    model = build_model(f"emulated:profile={write_profile(tmp_path)},scale=0", TOKENS.info)
    logits = model(TOKENS.train.inputs[:3])
    assert logits.shape == (3, 6, 11)
    targets = TOKENS.train.targets[:3].reshape(-1)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), targets)
    loss.backward()
    assert model[-1].weight.grad is not None and model[-1].weight.grad.abs().sum() > 0


def test_bytes_scale_and_profiled_parameters(tmp_path: Path) -> None:
    spec = f"emulated:profile={write_profile(tmp_path)},bytes_scale=0.5,params=profiled,scale=0"
    model = build_model(spec, IMAGES.info)
    assert model[0](IMAGES.train.inputs[:2]).shape == (2, 4096 // 2 // 8 // 4)
    # 800 B * 0.5 = 100 floats; 0 B still gets its shift and gain; 400 B * 0.5 = 50 floats
    assert [block.weight.numel() for block in model] == [100, 2, 50]


def test_forward_and_backward_wait_the_profiled_times(tmp_path: Path) -> None:
    model = build_model(f"emulated:profile={write_profile(tmp_path)}", IMAGES.info)
    x = IMAGES.train.inputs[:4]  # half the profile's batch of 8: half the profiled times
    out = model(x)  # warm-up
    forward_s = timed(lambda: model(x))
    out = model(x)
    backward_s = timed(lambda: out.sum().backward())
    assert 0.030 <= forward_s < 0.030 + 0.5
    assert 0.060 <= backward_s < 0.060 + 0.5


def test_without_a_reference_batch_waits_are_per_call(tmp_path: Path) -> None:
    spec = f"emulated:profile={write_profile(tmp_path, batch_size=None)},scale=0.5"
    model = build_model(spec, IMAGES.info)
    assert model[0](IMAGES.train.inputs[:1]).shape == (1, 4096 // 4)  # whole activation per sample
    assert timed(lambda: model[2](torch.zeros(1, 256))) >= 0.005
    assert timed(lambda: model[2](torch.zeros(16, 256))) >= 0.005
    spec = f"emulated:profile={write_profile(tmp_path, batch_size=None)},batch=2,scale=0"
    assert build_model(spec, IMAGES.info)[0](IMAGES.train.inputs[:1]).shape == (1, 4096 // 2 // 4)


def test_saved_activation_is_the_output(tmp_path: Path) -> None:
    model = build_model(f"emulated:profile={write_profile(tmp_path)},scale=0", IMAGES.info)
    x = torch.zeros(8, 1000, requires_grad=True)
    saved: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model[0](x)
    assert max(saved) == 4096  # the profiled activation of the whole (reference) batch of 8


@pytest.mark.parametrize("index", [0, 2])
def test_gradients_are_exact(tmp_path: Path, index: int) -> None:
    model = build_model(f"emulated:profile={write_profile(tmp_path)},scale=0", IMAGES.info)
    timing = model[index].timing
    x = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(model[index].weight.numel(), dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, w: _Emulate.apply(a, w, timing), (x, weight))


def test_pipedream_graph_profiles_build_in_topological_order() -> None:
    spec = f"emulated:profile={PROFILES / 'resnet50.graph.txt'},batch=64,scale=0,bytes_scale=1e-4"
    model = build_model(spec, IMAGES.info)
    assert len(model) > 100
    assert model(IMAGES.train.inputs[:2]).shape == (2, 5)


@pytest.mark.parametrize(("options", "message"), [
    ("", "profile=PATH"),
    ("profile=/nonexistent.json", "cannot read profile"),
    ("profile=PROFILE,params=huge", "params must be small or profiled"),
    ("profile=PROFILE,bytes_scale=0", "bytes_scale"),
    ("profile=PROFILE,scale=-1", "scale"),
])
def test_bad_options_are_one_clear_error(tmp_path: Path, options: str, message: str) -> None:
    options = options.replace("PROFILE", write_profile(tmp_path))
    with pytest.raises(UsageError, match=message):
        build_model(f"emulated:{options}" if options else "emulated", IMAGES.info)

"""LARS, LAMB and learning-rate scaling: the papers' formulas written out, and the real CLI."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tandem.errors import UsageError
from tandem.runtime.learning_rate import (StepSchedule, build_optimizer, constant_lr,
                                         lr_factor, scaled_lr)
from tandem.runtime.config import RunConfig

from tests.conftest import max_abs_diff, run_cli, run_json

STEPS = 5


def small_model() -> nn.Sequential:
    """Weights (ndim 2) and excluded parameters: biases and a LayerNorm's weight and bias."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 6, generator=generator),
             torch.randint(0, 3, (16,), generator=generator)) for _ in range(STEPS)]


def gradients(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    F.cross_entropy(model(inputs), targets).backward()
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def moved(params: list[torch.Tensor]) -> float:
    """How far ``params`` are from the model's initial ones (the test trains at all)."""
    initial = small_model().parameters()
    return max(float((a - b.detach()).abs().max()) for a, b in zip(params, initial))


def train_with_tandem(config: RunConfig) -> list[torch.Tensor]:
    model = small_model()
    optimizer = build_optimizer(config, model.named_parameters())
    for inputs, targets in batches():
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.pure
def test_lars_follows_the_paper() -> None:
    """You, Gitman, Ginsburg 2017, Algorithm 1: local lr = eta ||w|| / (||g|| + beta ||w||),
    v = m v + lr * local_lr * (g + beta w), w = w - v; biases and norms: local lr 1, no decay."""
    lr, eta, beta, m = 2.0, 0.001, 0.01, 0.9
    config = RunConfig(optimizer="lars", lr=lr, weight_decay=beta, momentum=m)
    model = small_model()
    ws = [p.detach().clone() for p in model.parameters()]
    vs = [torch.zeros_like(w) for w in ws]
    for inputs, targets in batches():
        with torch.no_grad():
            for p, w in zip(model.parameters(), ws):
                p.copy_(w)
        for i, g in enumerate(gradients(model, inputs, targets)):
            w = ws[i]
            if w.ndim <= 1:
                local_lr, decay = 1.0, 0.0
            else:
                w_norm, g_norm = w.norm().item(), g.norm().item()
                local_lr = eta * w_norm / (g_norm + beta * w_norm) if w_norm and g_norm else 1.0
                decay = beta
            vs[i] = m * vs[i] + lr * local_lr * (g + decay * w)
            ws[i] = w - vs[i]
    got = train_with_tandem(config)
    assert max(float((a - b).abs().max()) for a, b in zip(got, ws)) <= 1e-6
    assert moved(got) > 1e-3


@pytest.mark.pure
def test_lamb_follows_the_paper() -> None:
    """You et al. 2019, Algorithm 2 (phi the identity): Adam's moments with bias correction,
    r = m_hat / (sqrt(v_hat) + eps), u = r + lambda w, w = w - lr ||w|| / ||u|| u; biases and
    norms: ratio 1, no decay."""
    lr, beta1, beta2, eps, decay = 0.01, 0.9, 0.999, 1e-6, 0.1
    config = RunConfig(optimizer="lamb", lr=lr, weight_decay=decay)
    model = small_model()
    ws = [p.detach().clone() for p in model.parameters()]
    ms = [torch.zeros_like(w) for w in ws]
    vs = [torch.zeros_like(w) for w in ws]
    for t, (inputs, targets) in enumerate(batches(), start=1):
        with torch.no_grad():
            for p, w in zip(model.parameters(), ws):
                p.copy_(w)
        for i, g in enumerate(gradients(model, inputs, targets)):
            w = ws[i]
            ms[i] = beta1 * ms[i] + (1 - beta1) * g
            vs[i] = beta2 * vs[i] + (1 - beta2) * g * g
            r = (ms[i] / (1 - beta1 ** t)) / (torch.sqrt(vs[i] / (1 - beta2 ** t)) + eps)
            if w.ndim <= 1:
                ws[i] = w - lr * r
                continue
            u = r + decay * w
            ratio = w.norm().item() / u.norm().item()
            ws[i] = w - lr * ratio * u
    got = train_with_tandem(config)
    assert max(float((a - b).abs().max()) for a, b in zip(got, ws)) <= 1e-6
    assert moved(got) > 1e-3


@pytest.mark.pure
def test_biases_and_norms_are_grouped_out() -> None:
    """ndim <= 1 parameters: their own group, no weight decay and no trust ratio."""
    model = small_model()
    for name in ("lars", "lamb"):
        optimizer = build_optimizer(RunConfig(optimizer=name, weight_decay=0.1), model.parameters())
        trusted, excluded = optimizer.param_groups
        assert [p.ndim for p in trusted["params"]] == [2, 2]
        assert [tuple(p.shape) for p in excluded["params"]] == [(8,), (8,), (8,), (3,)]
        assert (trusted["trust"], trusted["weight_decay"]) == (True, 0.1)
        assert (excluded["trust"], excluded["weight_decay"]) == (False, 0.0)


@pytest.mark.pure
@pytest.mark.parametrize("name", ["lars", "lamb"])
def test_an_excluded_parameter_steps_as_plain_sgd_or_adam(name: str) -> None:
    """A vector alone (as a bias): LARS is SGD with momentum and LAMB is Adam, decay ignored."""
    target = torch.linspace(-1, 1, 5)
    ours = nn.Parameter(torch.randn(5))
    theirs = nn.Parameter(ours.detach().clone())
    optimizer = build_optimizer(RunConfig(optimizer=name, lr=0.1, weight_decay=0.5,
                                          momentum=0.8), [ours])
    reference = (torch.optim.SGD([theirs], lr=0.1, momentum=0.8) if name == "lars"
                 else torch.optim.Adam([theirs], lr=0.1, eps=1e-6))
    for _ in range(STEPS):
        for param, opt in ((ours, optimizer), (theirs, reference)):
            opt.zero_grad()
            ((param - target) ** 2).sum().backward()
            opt.step()
    assert float((ours - theirs).detach().abs().max()) <= 1e-6


@pytest.mark.pure
def test_lars_local_lr_is_one_for_a_zero_weight() -> None:
    weight = nn.Parameter(torch.zeros(3, 2))
    optimizer = build_optimizer(RunConfig(optimizer="lars", lr=0.1, weight_decay=0.5), [weight])
    weight.grad = torch.ones(3, 2)
    optimizer.step()
    assert torch.equal(weight.detach(), torch.full((3, 2), -0.1))


@pytest.mark.pure
def test_lr_scaling_values() -> None:
    def lr(**settings: object) -> float:
        return scaled_lr(RunConfig(lr=0.1, batch_size=256, **settings))  # type: ignore[arg-type]

    assert lr() == 0.1
    assert lr(lr_scaling="linear", base_batch=32) == pytest.approx(0.8)
    assert lr(lr_scaling="sqrt", base_batch=32) == pytest.approx(0.1 * math.sqrt(8))
    assert lr(lr_scaling="linear") == pytest.approx(0.4)  # base batch 64
    config = RunConfig(lr=0.1, batch_size=256, lr_scaling="linear", base_batch=32)
    assert scaled_lr(config, 64) == pytest.approx(0.2)  # a batch schedule's current batch
    for name in ("sgd", "adam", "lars", "lamb"):
        optimizer = build_optimizer(RunConfig(**{**_fields(config), "optimizer": name}),
                                    small_model().parameters())
        assert [group["lr"] for group in optimizer.param_groups] == pytest.approx(
            [0.8] * len(optimizer.param_groups))


@pytest.mark.pure
@pytest.mark.parametrize("flags", [{}, {"warmup_steps": 3}, {"lr_schedule": "cosine"},
                                   {"lr_schedule": "step:0.5@4"}])
def test_step_schedule_is_lambda_lr(flags: dict[str, object]) -> None:
    """The schedule that only counts its steps where the rate is constant gives LambdaLR's
    rates and state at every step, also loaded into a fresh one halfway (a resume)."""
    config = RunConfig(lr=0.1, steps=8, **flags)  # type: ignore[arg-type]
    assert constant_lr(config) == (not flags)

    def pair() -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        return (torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1),
                torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1))

    ours_opt, ref_opt = pair()
    multiplier = lambda step: lr_factor(config, step)  # noqa: E731
    ours = StepSchedule(ours_opt, multiplier, constant=constant_lr(config))
    reference = torch.optim.lr_scheduler.LambdaLR(ref_opt, multiplier)
    for step in range(config.steps):
        assert ours.get_last_lr() == pytest.approx(reference.get_last_lr()), step
        assert ours.last_epoch == reference.last_epoch
        ours_opt.step(), ref_opt.step(), ours.step(), reference.step()
        if step == 4:
            resumed_opt, _ = pair()
            resumed_opt.load_state_dict(ours_opt.state_dict())
            resumed = StepSchedule(resumed_opt, multiplier, constant=constant_lr(config))
            resumed.load_state_dict(ours.state_dict())
            ours, ours_opt = resumed, resumed_opt
    assert ours_opt.param_groups[0]["lr"] == pytest.approx(ref_opt.param_groups[0]["lr"])


@pytest.mark.pure
def test_easgd_moves_at_the_scaled_lr() -> None:
    """EASGD's moving rate is lr * rho at the run's (scaled) learning rate."""
    from tandem.runtime.run import make_job
    from tandem.runtime.strategies import build_strategy

    job = make_job("easgd", {"--rho": 0.5}, nproc=2, batch_size=128, lr=0.05,
                   lr_scaling="linear", base_batch=32)
    strategy = build_strategy(job, 0, 2)
    assert strategy.alpha == pytest.approx(0.05 * 4 * 0.5)  # type: ignore[attr-defined]


def _fields(config: RunConfig) -> dict[str, object]:
    return {name: getattr(config, name) for name in RunConfig.__dataclass_fields__}


@pytest.mark.pure
@pytest.mark.parametrize(("flags", "message"), [
    (["--lr-scaling", "cubic"], "--lr-scaling 'cubic' is not one of: linear, sqrt"),
    (["--lr-scaling", "linear", "--base-batch", "0"], "--base-batch must be at least 1 (got 0)"),
    (["--base-batch", "32"], "--base-batch 32 is the batch --lr is for, which only --lr-scaling"),
    (["--optimizer", "lion!"], "--optimizer 'lion!' is neither a torch.optim class name nor "
                               "package.module:Class"),
])
def test_bad_input_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], flags: list[str],
                                          message: str) -> None:
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RunConfig(**_settings(flags))
    code, _, err = run_cli(capsys, "train", "--steps", "2", "--no-progress", *flags)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and message in err


def _settings(flags: list[str]) -> dict[str, object]:
    names = {"--lr-scaling": "lr_scaling", "--base-batch": "base_batch", "--optimizer": "optimizer"}
    pairs = dict(zip(flags[::2], flags[1::2]))
    return {names[flag]: int(value) if flag == "--base-batch" else value
            for flag, value in pairs.items()}


# -- the real CLI ------------------------------------------------------------------------------

COMMON = ("--model", "mlp", "--data", "digits", "--steps", "8", "--batch-size", "32",
          "--weight-decay", "0.01", "--warmup-steps", "2", "--seed", "5")
LR = {"lars": ("--lr", "1.0"), "lamb": ("--lr", "0.005", "--lr-scaling", "linear",
                                        "--base-batch", "16")}


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, object]]]:
    runs = {}
    for name in ("lars", "lamb"):
        out = tmp_path_factory.mktemp(f"single-{name}")
        runs[name] = (out, run_json("train", *COMMON, "--optimizer", name, *LR[name],
                                    "--nproc", "1", "--out", str(out)))
    return runs


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["lars", "lamb"])
def test_data_parallel_equals_one_process(name: str, single: dict[str, tuple[Path, dict]],
                                          tmp_path: Path) -> None:
    summary = run_json("train", *COMMON, "--optimizer", name, *LR[name], "--nproc", "2",
                       "--out", str(tmp_path))
    assert summary["world_size"] == 2 and summary["finished"]
    assert max_abs_diff(single[name][0] / "final.pt", tmp_path / "final.pt") <= 1e-5


@pytest.mark.multiprocess
def test_summary_reports_the_scaled_lr(single: dict[str, tuple[Path, dict]]) -> None:
    assert single["lamb"][1]["lr"] == pytest.approx(0.01)  # 0.005 * 32 / 16
    assert single["lars"][1]["lr"] == pytest.approx(1.0)


@pytest.mark.multiprocess
def test_parameter_servers_take_whole_parameter_norms(single: dict[str, tuple[Path, dict]],
                                                      tmp_path: Path) -> None:
    """Two servers each hold whole parameters, so LAMB's ratios and the scaled lr are the same
    as one process's."""
    summary = run_json("train", *COMMON, "--optimizer", "lamb", *LR["lamb"], "--strategy", "ps",
                       "--mode", "sync", "--servers", "2", "--nproc", "4", "--out", str(tmp_path))
    assert summary["lr"] == pytest.approx(0.01)
    assert max_abs_diff(single["lamb"][0] / "final.pt", tmp_path / "final.pt") <= 1e-5


@pytest.mark.multiprocess
def test_lamb_resumes_to_the_uninterrupted_result(single: dict[str, tuple[Path, dict]],
                                                  tmp_path: Path) -> None:
    args = ("train", *COMMON, "--optimizer", "lamb", *LR["lamb"], "--out", str(tmp_path))
    first = run_json(*args, "--stop-after", "4")
    assert first["steps"] == 4 and not first["finished"]
    second = run_json(*args, "--resume")
    assert second["steps"] == 8 and second["finished"]
    assert max_abs_diff(single["lamb"][0] / "final.pt", tmp_path / "final.pt") <= 1e-6


@pytest.mark.multiprocess
def test_pipeline_stages_resume_to_one_process(single: dict[str, tuple[Path, dict]],
                                               tmp_path: Path) -> None:
    """Each stage's optimizer over its whole parameters; its two groups reload by position."""
    args = ("train", *COMMON, "--optimizer", "lamb", *LR["lamb"], "--strategy", "pipeline",
            "--schedule", "1f1b", "--microbatches", "4", "--nproc", "2", "--out", str(tmp_path))
    assert run_json(*args, "--stop-after", "4")["steps"] == 4
    assert run_json(*args, "--resume")["finished"]
    assert max_abs_diff(single["lamb"][0] / "final.pt", tmp_path / "final.pt") <= 1e-5

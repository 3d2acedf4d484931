"""Tensor parallelism of a Hugging Face GPT-2 built from a config (:mod:`tests.hf_models`): its
``Conv1D`` layers (``nn.Linear``'s weight transposed) split by ``--tensor-layers``, its fused
query/key/value layer by heads, with the attention's ``num_heads``, ``embed_dim`` and
``split_size`` set to a worker's share.

Through the real command line: ``--tensor-parallel 2`` on 2 workers ends within 1e-5 of one
process (every parameter and buffer, the model's own names and shapes; sharding x tensor on 4
workers is in tests/test_sharded.py); stopped halfway, its checkpoint resumes on the same layout
and as plain dp (the query/key/value columns put back in the model's order). In this process:
the checks that refuse a plan in one line, and the reordering on resume.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from tandem.errors import UsageError
from tandem.models.tensor import head_shares, is_conv1d, split_size, tensor_plan
from tandem.runtime.natural_rows import NaturalRows
from tandem.runtime.tensor_parallel import heads_order, natural_order

from tests.conftest import SharedRun, max_abs_diff, run_json
from tests.hf_models import TENSOR_LAYERS, TRAIN, gpt2

pytest.importorskip("transformers")

TWO = ("--nproc", "2", "--tensor-parallel", "2", "--tensor-layers", TENSOR_LAYERS)
LAYERS = dict(pair.split("=") for pair in TENSOR_LAYERS.split(","))
SHARES = {f"transformer.h.{block}.attn.{name}": list(values) for block in range(2)
          for name, values in (("embed_dim", (32, 16)), ("num_heads", (2, 1)),
                               ("split_size", (32, 16)))}
"""What each worker sets in GPT-2's attention (n_embd 32, n_head 2) for 2 workers."""


@pytest.mark.multiprocess
def test_gpt2_split_by_its_conv1d_layers_equals_one_process(shared_run: SharedRun) -> None:
    single, _ = shared_run(*TRAIN, "--nproc", "1")
    out, summary = shared_run(*TRAIN, *TWO)
    assert summary["tensor_parallel"] == 2 and summary["head_shares"] == SHARES
    expected, got = torch.load(single / "final.pt"), torch.load(out / "final.pt")
    own = {name: tuple(value.shape) for name, value in gpt2().state_dict().items()}
    assert {name: tuple(value.shape) for name, value in got.items()} == own
    assert list(got) == list(expected) == list(own)  # parameters and buffers, in order
    assert max_abs_diff(single / "final.pt", out / "final.pt") <= 1e-5
    assert torch.equal(got["transformer.wte.weight"], got["lm_head.weight"])  # still tied
    memory = summary["tensor_memory"]  # a half of each split layer, the rest whole
    assert memory["worker_bytes"] <= memory["bound_bytes"] < 0.7 * memory["model_bytes"]


@pytest.mark.multiprocess
def test_a_stopped_gpt2_resumes_split_and_as_dp(shared_run: SharedRun, tmp_path: Path) -> None:
    """Stopped after 4 of 8 steps (the fused layers' weights, ``Conv1D``s, saved with their
    columns in the model's order, their biases by rows); resumed on the same layout, and as
    plain dp on 2 workers, the run ends within 1e-6 of the uninterrupted one."""
    whole, _ = shared_run(*TRAIN, *TWO)
    first = tmp_path / "first"
    run_json("train", *TRAIN, *TWO, "--stop-after", "4", "--out", str(first))
    saved = torch.load(first / "checkpoint.pt", weights_only=False)
    assert saved["tensor_degree"] == 2 and "row_orders" not in saved
    for name, layout in {"split": TWO, "dp": ("--nproc", "2")}.items():
        again = tmp_path / name
        shutil.copytree(first, again)
        summary = run_json("train", *TRAIN, *layout, "--resume", "--out", str(again))
        assert summary["finished"], name
        assert max_abs_diff(whole / "final.pt", again / "final.pt") <= 1e-6, name


@pytest.mark.pure
@pytest.mark.parametrize("degree", [1, 2, 3, 4])
@pytest.mark.parametrize("dim", [0, 1])
def test_natural_rows_shows_the_shares_order_as_the_models(degree: int, dim: int) -> None:
    """A ``heads`` tensor held in its shares' order (outputs along ``dim``: a ``Conv1D``'s
    weight has them as columns), shown as :class:`NaturalRows`: its chunks, each a view of the
    tensor, put at their offsets, make the tensor in the model's order, and one chunk per
    query, key and value block of each share (three per share)."""
    natural = torch.arange(36 * 5.0).reshape(36, 5)
    if dim:
        natural = natural.T.contiguous()
    held = natural.index_select(dim, heads_order(36, degree))  # a worker's whole shares
    rows = NaturalRows(held, degree, dim)
    assert rows.size() == natural.shape and len(rows.chunks) == (1 if degree == 1 else 3 * degree)
    rebuilt = torch.full_like(natural, -1.0)
    for offsets, view in rows.chunks.items():
        assert view.data_ptr() >= held.data_ptr()  # a view, not a copy
        index = tuple(slice(at, at + size) for at, size in zip(offsets, view.shape))
        rebuilt[index] = view
    assert torch.equal(rebuilt, natural)
    assert torch.equal(natural_order(held, degree, dim), natural)


@pytest.mark.pure
def test_gpt2s_layers_and_attention_are_read_as_their_shares() -> None:
    model = gpt2()
    attention = model.transformer.h[0].attn
    assert is_conv1d(attention.c_attn) and not is_conv1d(nn.Linear(2, 2))
    assert split_size("heads", attention.c_attn) == (32, "query (key, value) features")
    assert split_size("rowwise", model.transformer.h[0].mlp.c_proj) == (128, "input features")
    plan = tensor_plan(None, model, 2, LAYERS)
    assert {name: list(values) for name, values in head_shares(model, plan, 2).items()} == SHARES


REFUSED = {
    "a head split": (4, {"transformer.h.0.attn.c_attn": "heads",
                         "transformer.h.0.attn.c_proj": "rowwise"},
                     "--tensor-parallel 4 does not divide the 2 heads of tensor layer "
                     "'transformer.h.0.attn.c_attn' (transformer.h.0.attn.num_heads), so a "
                     "worker would hold part of a head; use --tensor-parallel 2, or leave "
                     "'transformer.h.0.attn.c_attn' and its rowwise layer whole"),
    "a norm": (2, {"transformer.h.0.ln_1": "colwise"},
               "tensor layer 'transformer.h.0.ln_1' is a LayerNorm, but style colwise splits "
               "an nn.Linear or a Conv1D; name an nn.Linear, Conv1D or nn.Conv2d inside it"),
    "a typo": (2, {"transformer.h.0.attn.c_atn": "heads"},
               "did you mean 'transformer.h.0.attn.c_attn'"),
    "a conv1d by channels": (2, {"transformer.h.0.mlp.c_fc": "channels"},
                             "is a Conv1D, but style channels splits an nn.Conv2d; use colwise "
                             "or rowwise or heads"),
    "an odd degree": (3, {"transformer.h.0.mlp.c_fc": "colwise",
                          "transformer.h.0.mlp.c_proj": "rowwise"},
                      "--tensor-parallel 3 does not divide the 128 output features of tensor "
                      "layer 'transformer.h.0.mlp.c_fc' (colwise); use --tensor-parallel 2 or 4 "
                      "or 8 or 16, or leave"),
}


@pytest.mark.pure
@pytest.mark.parametrize("case", list(REFUSED))
def test_a_plan_gpt2_cannot_run_is_one_line(case: str) -> None:
    degree, layers, message = REFUSED[case]
    with pytest.raises(UsageError) as raised:
        tensor_plan(None, gpt2(), degree, layers)
    assert message in str(raised.value) and "\n" not in str(raised.value), str(raised.value)

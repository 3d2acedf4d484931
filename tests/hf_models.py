"""A Hugging Face ``transformers`` GPT-2 built from a small config (random init, no download) and
token data for it, as ``--model``/``--data`` functions."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

VOCAB, SEQ = 64, 16

TRAIN = ("--model", "tests.hf_models:gpt2", "--data", "tests.hf_models:tokens", "--steps", "8",
         "--batch-size", "16", "--lr", "0.05", "--momentum", "0.9", "--seed", "4")
"""``tandem train`` options of the short GPT-2 runs compared with one process (SGD, momentum)."""
TENSOR_LAYERS = ",".join(f"transformer.h.{block}.{layer}={style}" for block in range(2)
                         for layer, style in (("attn.c_attn", "heads"), ("attn.c_proj", "rowwise"),
                                              ("mlp.c_fc", "colwise"), ("mlp.c_proj", "rowwise")))
"""``--tensor-layers`` for :func:`gpt2` (its ``Conv1D`` layers), Megatron's: attention by heads
and its output projection by rows, the MLP as a column-wise/row-wise pair; the embeddings (the
input one tied to the output layer), the norms and the output layer whole."""


def gpt2(layers: int = 2, dropout: float = 0.0) -> nn.Module:
    """``--model tests.hf_models:gpt2``: GPT2LMHeadModel, input embedding tied to the output
    layer; dropout off by default so that runs on different worker counts can be compared."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def _tokens(n: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    transition = torch.softmax(torch.randn(VOCAB, VOCAB, generator=generator) * 3, dim=-1)
    generator.manual_seed(seed)
    tokens = torch.empty(n, SEQ + 1, dtype=torch.int64)
    tokens[:, 0] = torch.randint(VOCAB, (n,), generator=generator)
    for t in range(SEQ):
        tokens[:, t + 1] = torch.multinomial(transition[tokens[:, t]], 1, generator=generator)[:, 0]
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def tokens(n: int = 256) -> tuple[TensorDataset, TensorDataset]:
    """``--data tests.hf_models:tokens``: next-token sequences of a fixed Markov chain."""
    return _tokens(n, seed=1), _tokens(64, seed=2)


def init_gpt2(module: nn.Module, name: str) -> None:
    """``--init-fn tests.hf_models:init_gpt2``: GPT-2's initialization, one module at a time
    (normal(0, 0.02) weights, zero biases, the residual projections scaled by 1/sqrt(2 x
    layers) for the 2 layers of :func:`gpt2`), so that the model builds in pieces."""
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, (Conv1D, nn.Linear, nn.Embedding)):
        std = 0.02 / (2 * 2) ** 0.5 if name.endswith("c_proj") else 0.02
        nn.init.normal_(module.weight, std=std)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    else:
        module.reset_parameters()

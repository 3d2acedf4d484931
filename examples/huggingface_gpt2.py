"""Train a Hugging Face ``transformers`` GPT-2, built from a small config (random weights, no
download), with tandem's Python API on 2 local workers.

The model returns a ``ModelOutput``, not a tensor; tandem's default loss finds its ``logits``.
Its input embedding and output layer share one weight; tandem keeps them tied (with
``--strategy pipeline`` too, where the model is traced, with its ``use_cache`` off, and split into
stages). The data is a plain ``TensorDataset`` of token sequences and their next tokens. Run it as
``python examples/huggingface_gpt2.py [--steps N] [--strategy S]``; it needs ``transformers``
(``pip install transformers``, or tandem's ``test`` extra).
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import TensorDataset

import tandem


def token_data(n: int, seq: int, vocab: int, seed: int) -> TensorDataset:
    """Sequences of a fixed random Markov chain (so there is something to learn)."""
    generator = torch.Generator().manual_seed(0)
    transition = torch.softmax(torch.randn(vocab, vocab, generator=generator) * 3, dim=-1)
    generator.manual_seed(seed)
    tokens = torch.empty(n, seq + 1, dtype=torch.int64)
    tokens[:, 0] = torch.randint(vocab, (n,), generator=generator)
    for t in range(seq):
        tokens[:, t + 1] = torch.multinomial(transition[tokens[:, t]], 1, generator=generator)[:, 0]
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def build_gpt2() -> torch.nn.Module:
    """A 2-layer GPT-2 from a config (called on each worker after seeding)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=64, n_positions=32,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--strategy", default="dp",
                        help="dp, ps, gossip, easgd, localsgd, or pipeline (one stage per worker)")
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    options = {"servers": 1} if args.strategy == "ps" else {}
    nproc = args.nproc + (1 if args.strategy == "ps" else 0)
    result = tandem.fit(build_gpt2, token_data(1024, 32, 64, seed=1),
                        token_data(256, 32, 64, seed=2), strategy=args.strategy, nproc=nproc,
                        steps=args.steps, batch_size=32, optimizer="adamw", lr=3e-3, **options)
    model, summary = result.model, result.summary
    tied = model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    print(f"{args.strategy}: next-token accuracy {summary['test_accuracy']:.3f}, test loss "
          f"{summary['test_loss']:.3f} after {summary['steps']} steps in {summary['wall_s']:.1f} s "
          f"(embedding and output layer tied: {tied})")


if __name__ == "__main__":
    main()

"""A short CPU demo: a tiny Megatron-Core GPT with megamoe layers learns a synthetic sequence
task for a few dozen steps and prints the loss and each MoE layer's load balance.

    python -m megamoe.demo [--steps 40]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

from megamoe.errors import MegaMoEError, run_cli  # noqa: E402

VOCAB, SEQ, BATCH = 128, 32, 8


def synthetic_batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences counting up from a random start (mod VOCAB): the next token is predictable."""
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=generator)
    tokens = (start + torch.arange(SEQ + 1)) % VOCAB
    return tokens[:, :-1], tokens[:, 1:]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="tiny MoE GPT demo on CPU")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    if args.steps < 1:
        raise MegaMoEError(f"--steps {args.steps} must be >= 1")
    from megamoe.balancing import step_balancing
    from megamoe.megatron.models import build_gpt, causal_attention_mask, tiny_transformer_config
    from megamoe.megatron.runtime import setup_megatron, teardown_megatron
    from megamoe.megatron.specs import gpt_decoder_block_spec

    setup_megatron(seed=1234)
    config = tiny_transformer_config(
        num_layers=4, hidden_size=64, num_attention_heads=4, num_moe_experts=8,
        moe_router_topk=2, moe_ffn_hidden_size=64, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True)
    spec = gpt_decoder_block_spec(config, first_k_dense=1)
    model = build_gpt(config, spec, vocab_size=VOCAB, seq_len=SEQ)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    mask, positions = causal_attention_mask(SEQ), torch.arange(SEQ).expand(BATCH, -1)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        tokens, labels = synthetic_batch(generator)
        loss = model(tokens, positions, mask, labels=labels).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        metrics = step_balancing(model)
        if step == 1 or step % 10 == 0 or step == args.steps:
            balance = "  ".join(
                f"L{key.split('/')[1][5:]} maxvio {value:.2f}"
                for key, value in metrics.items() if key.endswith("/maxvio_global"))
            print(f"step {step:4d}  loss {loss.item():.3f}  {balance}  "
                  f"({time.perf_counter() - start:.1f}s)", flush=True)
    teardown_megatron()
    return 0


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])

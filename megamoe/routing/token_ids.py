"""The token ids of the batch being routed, for routers that choose by token id (hash routing).

Megatron's layer interfaces pass hidden states only, so the ids reach the MoE layers beside the
forward call, not through it: whoever runs the model's forward sets them for its duration,
`with routing_token_ids(tokens_BS): model(...)`, or `capture_input_ids(model)` once, so that
every forward of a GPTModel sets the `input_ids` it is given. megamoe's trainer captures them on
every model chunk, where every pipeline stage reads the micro-batch's tokens. Under Megatron-LM's
`pretrain_gpt.py`, call `capture_input_ids(model)` on each chunk after the model is built; its
later pipeline stages are given no tokens, so hash layers belong on the first stage there. A layer reads its own rows, [S, B] flattened sequence first, and under sequence
parallelism the positions of its tensor-parallel rank.
Shape legend: B micro-batch, S sequence (this rank's share under sequence parallelism), T = S B.
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Iterator, Optional

import torch

from megamoe.errors import ConfigError, DataError
from megamoe.parallel.comm import Comm

_TOKEN_IDS: ContextVar[Optional[torch.Tensor]] = ContextVar("megamoe_token_ids", default=None)


@contextlib.contextmanager
def routing_token_ids(tokens_BS: torch.Tensor) -> Iterator[None]:
    """The batch's token ids [B, S] for the MoE layers of the forward run inside."""
    token = _TOKEN_IDS.set(tokens_BS)
    try:
        yield
    finally:
        _TOKEN_IDS.reset(token)


def capture_input_ids(model: torch.nn.Module) -> None:
    """Make every forward of `model` (a GPTModel: `input_ids` first, or by name) set the token
    ids for its MoE layers, until it returns; a forward given no ids sets none."""
    def before(module, args, kwargs):
        tokens_BS = kwargs.get("input_ids", args[0] if args else None)
        module._megamoe_token_ids = (_TOKEN_IDS.set(tokens_BS) if tokens_BS is not None
                                     else None)

    def after(module, args, kwargs, output):
        token = module.__dict__.pop("_megamoe_token_ids", None)
        if token is not None:
            _TOKEN_IDS.reset(token)

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, with_kwargs=True)


def layer_token_ids(seq_len: int, batch: int, token_comm: Comm,
                    tokens_BS: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The ids [S*B] of a layer's rows (its tensor-parallel rank's positions under sequence
    parallelism) from `tokens_BS` [B, S], by default those set for this forward; a one-line
    error when there are none or they do not fit."""
    tokens_BS = _TOKEN_IDS.get() if tokens_BS is None else tokens_BS
    if tokens_BS is None:
        raise ConfigError("router.kind=hash chooses experts by token id, but this forward was "
                          "given none: call megamoe.routing.token_ids.capture_input_ids(model) "
                          "once, run the forward inside routing_token_ids(tokens), or pass the "
                          "layer token_ids=")
    full = seq_len * token_comm.size
    if tokens_BS.dim() != 2 or tuple(tokens_BS.shape) != (batch, full):
        raise DataError(f"hash routing: token ids of shape {tuple(tokens_BS.shape)} for a layer "
                        f"input of {batch} sequences of {full} positions; set the ids of the "
                        "batch this forward runs")
    rows_SB = tokens_BS.t()[token_comm.rank * seq_len:(token_comm.rank + 1) * seq_len]
    return rows_SB.reshape(-1)

"""Time forward+backward of a megamoe layer and of Megatron-Core's own MoE layer (all-to-all
dispatcher; experts: SequentialMLP, or with --peer the grouped-GEMM GroupedMLP / TEGroupedMLP) at
the same sizes, in the same process; DeepSpeed's `deepspeed.moe.layer.MoE` (dropless,
Megatron-DeepSpeed's SwiGLU expert MLP) joins as a peer when deepspeed imports.

    python tools/bench_moe_layer.py                     # the issue's CPU bar (fp32)
    python tools/bench_moe_layer.py --dtype bf16 --tokens 16384 --peer te_grouped  # on a GPU

Prints one line per implementation (median ms per forward+backward) and the ratio
megamoe / Megatron-Core, and writes them as JSON to --json if given.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

from megamoe.errors import MegaMoEError, run_cli  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PEERS = ("sequential", "grouped", "te_grouped")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=1024, help="expert FFN size")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--json", help="also write the figures to this JSON file")
    parser.add_argument("--peer", choices=PEERS, default="sequential",
                        help="Megatron-Core's experts: SequentialMLP (a per-expert loop), "
                             "GroupedMLP (the grouped_gemm package) or TEGroupedMLP "
                             "(Transformer Engine); the grouped ones need CUDA")
    return parser.parse_args(argv)


def megatron_moe_layer(config, peer: str = "sequential"):
    """Megatron-Core's own MoE layer with `peer` experts (see --peer), from its MoE spec (a
    ModuleSpec in 0.16, a builder in 0.19, which has no legacy GroupedMLP)."""
    import dataclasses

    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from megamoe.megatron.compat import build_from_spec, legacy_grouped_gemm_kwargs

    grouped = peer != "sequential"
    spec = get_moe_module_spec(use_te=peer == "te_grouped", num_experts=config.num_moe_experts,
                               moe_grouped_gemm=grouped,
                               **legacy_grouped_gemm_kwargs(peer == "grouped"))
    return build_from_spec(spec, config=dataclasses.replace(config, moe_grouped_gemm=grouped))


class _DeepSpeedPeer(torch.nn.Module):
    """DeepSpeed's MoE layer returning (output, None) like Megatron's MLPs."""

    def __init__(self, args):
        super().__init__()
        from megamoe.interop.deepspeed_moe import deepspeed_moe_layer, init_deepspeed_comm

        init_deepspeed_comm()
        self.moe = deepspeed_moe_layer(args.hidden, args.ffn, args.experts, args.topk, "swiglu")

    def forward(self, x):
        return self.moe(x)[0], None


def deepspeed_peer(args):
    """The DeepSpeed peer, or None where deepspeed does not import."""
    try:
        import deepspeed  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not available here"
        return None
    return _DeepSpeedPeer(args)


def time_fwd_bwd(layers, x, warmup, iters):
    """Median wall time (ms) of forward + backward per layer, the layers taking turns each
    iteration so that background load affects all of them alike."""
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    grad = torch.randn_like(x)
    times = {name: [] for name in layers}
    for i in range(warmup + iters):
        for name, layer in layers.items():
            sync()
            start = time.perf_counter()
            out, _ = layer(x)
            out.backward(grad)
            sync()
            if i >= warmup:
                times[name].append((time.perf_counter() - start) * 1e3)
            layer.zero_grad(set_to_none=True)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None):
    args = parse_args(argv)
    if args.tokens % 4:
        raise MegaMoEError(f"--tokens {args.tokens} must be a multiple of 4 (batch of 4)")
    from megamoe.megatron.cpu import cpu_transformer_config
    from megamoe.megatron.moe_module import MegatronMoELayer
    from megamoe.megatron.runtime import setup_megatron, teardown_megatron

    setup_megatron()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = DTYPES[args.dtype]
    config = cpu_transformer_config(
        num_layers=2, hidden_size=args.hidden, num_attention_heads=8, ffn_hidden_size=args.ffn,
        num_moe_experts=args.experts, moe_ffn_hidden_size=args.ffn, moe_router_topk=args.topk,
        moe_token_dispatcher_type="alltoall", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, moe_aux_loss_coeff=1e-2,
        bf16=dtype == torch.bfloat16, params_dtype=dtype)
    torch.manual_seed(0)
    x = torch.randn(args.tokens // 4, 4, args.hidden, device=device, dtype=dtype,
                    requires_grad=True)
    layers = {"megamoe": MegatronMoELayer(config),
              "megatron-core": megatron_moe_layer(config, args.peer)}
    peer = deepspeed_peer(args)
    if peer is not None:
        layers["deepspeed"] = peer
    figures = {"device": torch.cuda.get_device_name() if device == "cuda" else
               f"cpu ({torch.get_num_threads()} threads)", "args": vars(args),
               "megatron_experts": type(layers["megatron-core"].experts).__name__}
    for layer in layers.values():
        layer.to(device=device, dtype=dtype).train()
    for name, ms in time_fwd_bwd(layers, x, args.warmup, args.iters).items():
        figures[name + "_ms"] = ms
        print(f"{name:14s} forward+backward: {ms:9.2f} ms "
              f"(median of {args.iters}, {args.tokens} tokens, {args.dtype}, {figures['device']}; "
              f"Megatron experts {figures['megatron_experts']})")
    figures["ratio"] = figures["megamoe_ms"] / figures["megatron-core_ms"]
    print(f"ratio megamoe / megatron-core: {figures['ratio']:.3f}")
    if "deepspeed_ms" in figures:
        figures["ratio_deepspeed"] = figures["megamoe_ms"] / figures["deepspeed_ms"]
        print(f"ratio megamoe / deepspeed: {figures['ratio_deepspeed']:.3f}")
    if args.json:
        from megamoe.atomic import atomic_write_text

        atomic_write_text(args.json, json.dumps(figures, indent=2))
    teardown_megatron()


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])

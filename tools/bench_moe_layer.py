"""Time forward+backward of a megamoe layer and of Megatron-Core's own MoE layer (all-to-all
dispatcher; experts: SequentialMLP, or with --peer the grouped-GEMM GroupedMLP / TEGroupedMLP) at
the same sizes, in the same process, at one or more expert configurations; DeepSpeed's
`deepspeed.moe.layer.MoE` (dropless, Megatron-DeepSpeed's SwiGLU expert MLP) joins with
--deepspeed.

    python tools/bench_moe_layer.py                     # the issue's CPU bar (fp32, both sizes)
    python tools/bench_moe_layer.py --dtype bf16 --tokens 16384 --peer te_grouped  # on a GPU

The sizes are the pairs of --experts, --topk and --ffn (default E16 top-2 F1024 and E256 top-8
F256: equal active FLOPs, experts 16 times finer). Per size it prints the median ms per
forward+backward of each layer and the ratio megamoe / Megatron-Core, and the achieved GFLOP/s of
megamoe's expert MLP alone (forward+backward on the rows its router sent; its GEMM FLOPs over its
whole time) against one plain dense GEMM of the same FLOPs, the device's practical limit. With two
or more sizes it prints the growth of megamoe's time per expert FLOP from the first to the last
size; a last `summary:` line holds it all in one line. Everything timed, all sizes together,
takes turns each iteration, so background load affects all of it alike. On CPU every layer runs
with freed memory kept for reuse (`reuse_freed_memory`; --system-allocator to not). --json writes
the figures.
"""
from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

from megamoe.errors import CliArgumentParser, MegaMoEError, int_at_least, run_cli  # noqa: E402
from megamoe.ownership import check_file_output  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PEERS = ("sequential", "grouped", "te_grouped")
BATCH = 4  # sequences per micro-batch; --tokens is split into BATCH sequences
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters


def parse_args(argv):
    parser = CliArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int_at_least(1), default=512)
    parser.add_argument("--experts", type=int_at_least(1), nargs="+", default=[16, 256])
    parser.add_argument("--topk", type=int_at_least(1), nargs="+", default=[2, 8])
    parser.add_argument("--ffn", type=int_at_least(1), nargs="+", default=[1024, 256],
                        help="expert FFN size, one per size")
    parser.add_argument("--tokens", type=int_at_least(BATCH), default=4096)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--warmup", type=int_at_least(0), default=3)
    parser.add_argument("--iters", type=int_at_least(1), default=10)
    parser.add_argument("--json", help="also write the figures to this JSON file")
    parser.add_argument("--peer", choices=PEERS, default="sequential",
                        help="Megatron-Core's experts: SequentialMLP (a per-expert loop), "
                             "GroupedMLP (the grouped_gemm package) or TEGroupedMLP "
                             "(Transformer Engine); the grouped ones need CUDA")
    parser.add_argument("--deepspeed", action="store_true",
                        help="also time DeepSpeed's MoE layer (needs deepspeed)")
    parser.add_argument("--system-allocator", action="store_true",
                        help="on CPU, keep glibc's default of returning large freed buffers to "
                             "the OS (see reuse_freed_memory)")
    args = parser.parse_args(argv)
    if not len(args.experts) == len(args.topk) == len(args.ffn):
        raise MegaMoEError(f"--experts {args.experts}, --topk {args.topk} and --ffn {args.ffn} "
                           "must list the same number of values (one per size)")
    if args.tokens % BATCH:
        raise MegaMoEError(f"--tokens {args.tokens} must be a multiple of {BATCH}")
    if args.json is not None:
        check_file_output(args.json, "--json")
    return args


def reuse_freed_memory() -> bool:
    """glibc: serve every allocation from the heap and keep freed memory there (mallopt
    M_MMAP_MAX=0, M_TRIM_THRESHOLD=2 GiB), so each step reuses the last step's buffers, as CUDA's
    caching allocator does on a GPU. By default glibc maps every buffer above 32 MiB afresh and
    the kernel zero-fills it page by page on first touch: on the 2-core CPU of the issue a fresh
    64 MiB product took 46 ms, one into reused memory 8 ms. Both layers run under it; True if
    applied."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def megatron_moe_layer(config, peer: str = "sequential"):
    """Megatron-Core's own MoE layer with `peer` experts (see --peer), from its MoE spec (a
    ModuleSpec in 0.16, a builder in 0.19, which has no legacy GroupedMLP)."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from megamoe.megatron.compat import build_from_spec, legacy_grouped_gemm_kwargs

    grouped = peer != "sequential"
    spec = get_moe_module_spec(use_te=peer == "te_grouped", num_experts=config.num_moe_experts,
                               moe_grouped_gemm=grouped,
                               **legacy_grouped_gemm_kwargs(peer == "grouped"))
    return build_from_spec(spec, config=dataclasses.replace(config, moe_grouped_gemm=grouped))


class _DeepSpeedPeer(torch.nn.Module):
    """DeepSpeed's MoE layer returning (output, None) like Megatron's MLPs."""

    def __init__(self, hidden, ffn, experts, topk):
        super().__init__()
        from megamoe.interop.deepspeed_moe import deepspeed_moe_layer, init_deepspeed_comm

        init_deepspeed_comm()
        self.moe = deepspeed_moe_layer(hidden, ffn, experts, topk, "swiglu")

    def forward(self, x):
        return self.moe(x)[0], None


def layer_step(layer, x, grad):
    """One forward+backward of `layer` on x."""
    def step():
        out, _ = layer(x)
        out.backward(grad)
        layer.zero_grad(set_to_none=True)
        x.grad = None
    return step


def expert_steps(layer, x_SBD):
    """Forward+backward of megamoe's expert MLP alone, on the rows its router sends, and one
    dense GEMM of the same FLOPs (into a reused output); with the expert GEMM FLOPs and the
    kernel used (`megamoe.experts.grouped`)."""
    from megamoe.experts.grouped import grouped_mm_fits

    experts = layer.experts
    with torch.no_grad():
        x_TD = x_SBD.reshape(-1, x_SBD.shape[-1])
        rows_ND, tokens_per_expert, _ = layer.dispatcher.dispatch(x_TD, layer.router(x_TD))
    rows_ND.requires_grad_()
    grad_ND = torch.randn_like(rows_ND)
    N, D = rows_ND.shape
    width = experts.fc1_weight.shape[1] + experts.fc2_weight.shape[2]  # F' + F
    flops = 3 * 2 * N * D * width  # forward, input gradient, weight gradient: 3 GEMM pairs

    def experts_step():
        experts(rows_ND, tokens_per_expert).backward(grad_ND)
        experts.zero_grad(set_to_none=True)
        rows_ND.grad = None

    dense_b = torch.randn(D, 3 * width, dtype=rows_ND.dtype, device=rows_ND.device)
    dense_out = rows_ND.new_empty((N, 3 * width))
    kernel = "grouped_mm" if grouped_mm_fits(rows_ND, experts.fc2_weight) else "loop"
    return experts_step, lambda: torch.mm(rows_ND.detach(), dense_b, out=dense_out), flops, kernel


def time_steps(steps, warmup, iters, sync):
    """Median wall time (ms) of each step, the steps taking turns each iteration so that
    background load affects all of them alike."""
    times = {name: [] for name in steps}
    for i in range(warmup + iters):
        for name, step in steps.items():
            sync()
            start = time.perf_counter()
            step()
            sync()
            if i >= warmup:
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def build_size(args, experts, topk, ffn, device, dtype):
    """The steps to time at one size, and the figures known before timing."""
    from megamoe.megatron.cpu import cpu_transformer_config
    from megamoe.megatron.moe_module import MegatronMoELayer

    config = cpu_transformer_config(
        num_layers=2, hidden_size=args.hidden, num_attention_heads=8, ffn_hidden_size=ffn,
        num_moe_experts=experts, moe_ffn_hidden_size=ffn, moe_router_topk=topk,
        moe_router_pre_softmax=topk == 1,  # Megatron-Core's rule for top-1 (Switch) routing
        moe_token_dispatcher_type="alltoall", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, moe_aux_loss_coeff=1e-2,
        bf16=dtype == torch.bfloat16, params_dtype=dtype)
    torch.manual_seed(0)
    x = torch.randn(args.tokens // BATCH, BATCH, args.hidden, device=device, dtype=dtype,
                    requires_grad=True)
    grad = torch.randn_like(x)
    layers = {"megamoe": MegatronMoELayer(config),
              "megatron-core": megatron_moe_layer(config, args.peer)}
    if args.deepspeed:
        layers["deepspeed"] = _DeepSpeedPeer(args.hidden, ffn, experts, topk)
    for layer in layers.values():
        layer.to(device=device, dtype=dtype).train()
    steps = {name: layer_step(layer, x, grad) for name, layer in layers.items()}
    steps["experts"], steps["dense"], flops, kernel = expert_steps(layers["megamoe"], x)
    figures = {"experts": experts, "topk": topk, "ffn": ffn, "kernel": kernel,
               "megatron_experts": type(layers["megatron-core"].experts).__name__,
               "expert_gflop": flops / 1e9}
    return steps, figures


def add_times(figures: dict, ms: dict) -> None:
    """The timed figures of one size (see the module docstring)."""
    flops = figures["expert_gflop"] * 1e9
    figures.update({f"{name}_ms": value for name, value in ms.items()})
    figures["ratio"] = ms["megamoe"] / ms["megatron-core"]
    if "deepspeed" in ms:
        figures["ratio_deepspeed"] = ms["megamoe"] / ms["deepspeed"]
    figures["experts_gflops"] = flops / ms["experts"] / 1e6
    figures["dense_gflops"] = flops / ms["dense"] / 1e6
    figures["experts_vs_dense"] = figures["experts_gflops"] / figures["dense_gflops"]


def size_name(f: dict) -> str:
    return f"E{f['experts']} top-{f['topk']} F{f['ffn']}"


def report(f: dict, args, device_name: str) -> None:
    print(f"{size_name(f)}: {args.tokens} tokens, hidden {args.hidden}, {args.dtype}, "
          f"{device_name}, median of {args.iters}")
    for name in ("megamoe", "megatron-core", "deepspeed"):
        if f"{name}_ms" in f:
            print(f"  {name:14s} forward+backward: {f[name + '_ms']:9.2f} ms")
    print(f"  ratio megamoe / megatron-core ({f['megatron_experts']}): {f['ratio']:.3f}")
    if "ratio_deepspeed" in f:
        print(f"  ratio megamoe / deepspeed: {f['ratio_deepspeed']:.3f}")
    print(f"  expert MLP ({f['kernel']}, {f['expert_gflop']:.1f} GFLOP): {f['experts_ms']:.2f} ms"
          f" = {f['experts_gflops']:.1f} GFLOP/s; dense GEMM of the same FLOPs: "
          f"{f['dense_ms']:.2f} ms = {f['dense_gflops']:.1f} GFLOP/s "
          f"(experts at {f['experts_vs_dense']:.2f} of it)")


def main(argv=None):
    args = parse_args(argv)
    from megamoe.megatron.runtime import setup_megatron, teardown_megatron

    setup_megatron()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    device_name = (torch.cuda.get_device_name() if device == "cuda" else
                   f"cpu ({torch.get_num_threads()} threads)")
    if device == "cpu" and not args.system_allocator and reuse_freed_memory():
        device_name += ", freed memory reused"
    built = [build_size(args, *size, device, DTYPES[args.dtype])
             for size in zip(args.experts, args.topk, args.ffn)]
    steps = {(i, name): step for i, (size_steps, _) in enumerate(built)
             for name, step in size_steps.items()}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    ms = time_steps(steps, args.warmup, args.iters, sync)
    sizes = [figures for _, figures in built]
    for i, figures in enumerate(sizes):
        add_times(figures, {name: value for (j, name), value in ms.items() if j == i})
        report(figures, args, device_name)
    result = {"device": device_name, "args": vars(args), "sizes": sizes,
              "max_ratio": max(f["ratio"] for f in sizes)}
    if len(sizes) > 1:
        first, last = sizes[0], sizes[-1]
        result["growth"] = ((last["megamoe_ms"] / last["expert_gflop"])
                            / (first["megamoe_ms"] / first["expert_gflop"]))
        print(f"growth of megamoe's time per expert FLOP, {size_name(first)} -> "
              f"{size_name(last)}: {result['growth']:.3f}")
    print("summary: " + "; ".join(
        f"{size_name(f)} ratio {f['ratio']:.3f} (megamoe {f['kernel']} {f['megamoe_ms']:.1f} ms, "
        f"{f['megatron_experts']} {f['megatron-core_ms']:.1f} ms), experts at "
        f"{f['experts_vs_dense']:.2f} of dense" for f in sizes)
        + (f"; growth {result['growth']:.3f}" if "growth" in result else ""))
    if args.json:
        from megamoe.atomic import atomic_write_text

        atomic_write_text(args.json, json.dumps(result, indent=2))
    teardown_megatron()


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])

"""Expert-parallel dispatch benchmark: per-step time of dispatch, experts and combine, and the
bytes each rank sends and receives against the analytic volume.

    torchrun --nproc-per-node 2 tools/bench_ep_dispatch.py --ep 2        # CPU, gloo
    torchrun --nproc-per-node 8 tools/bench_ep_dispatch.py --ep 8 --dtype bf16 --tokens 8192
    python tools/bench_ep_dispatch.py                                     # EP=1, one process
    torchrun --nproc-per-node 2 tools/bench_ep_dispatch.py --ep 2 --latent-size 128  # latent MoE

The expert-parallel group is the whole torchrun world (gloo on CPU, NCCL on CUDA). For each
dispatcher it times the forward phases of a megamoe layer (median over steps, slowest rank) and
one forward+backward step, counts the bytes every collective moves (to other ranks and in total,
self-copies included), and compares the dispatch volume with the analytic
tokens x experts-per-token x width x bytes per direction, the width being the hidden size, or
with `--latent-size` the latent width the layer dispatches in (latent MoE: the tokens are
projected down before the dispatch and up after the combine, outside the timed phases). The time spent inside the collectives
gives the achieved bandwidth (NCCL bandwidth on a GPU machine). Times are medians over steps
of the slowest rank. Rank 0 prints a table and appends one JSON line per dispatcher to --out.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import sys
import time
from collections import defaultdict

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megamoe.errors import CliArgumentParser, ConfigError, int_at_least, run_cli  # noqa: E402
from megamoe.ownership import check_file_output  # noqa: E402
from megamoe.registry import DISPATCHERS  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PHASES = ("dispatch", "experts", "combine")


def parse_args(argv):
    parser = CliArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ep", type=int_at_least(1),
                        default=int(os.environ.get("WORLD_SIZE", "1")),
                        help="expert-parallel size; must equal the number of processes")
    parser.add_argument("--tokens", type=int_at_least(1), default=4096,
                        help="tokens per rank per step")
    parser.add_argument("--hidden", type=int_at_least(1), default=512)
    parser.add_argument("--ffn", type=int_at_least(1), default=1024, help="expert FFN size")
    parser.add_argument("--latent-size", type=int_at_least(1), default=None,
                        help="latent MoE: the experts' width, below --hidden (default: none)")
    parser.add_argument("--experts", type=int_at_least(1), default=16)
    parser.add_argument("--topk", type=int_at_least(1), default=2)
    parser.add_argument("--dispatchers", default="alltoall,allgather")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--warmup", type=int_at_least(0), default=3)
    parser.add_argument("--steps", type=int_at_least(1), default=10)
    parser.add_argument("--timeout-s", type=float, default=300.0,
                        help="process-group timeout: a dead rank fails the others after this")
    parser.add_argument("--out", default="runs/bench_ep_dispatch.jsonl",
                        help="append one JSON line per dispatcher here (rank 0)")
    args = parser.parse_args(argv)
    if not 0 < args.timeout_s < math.inf:
        raise ConfigError(f"--timeout-s {args.timeout_s} must be a positive number of seconds")
    if args.latent_size is not None and args.latent_size >= args.hidden:
        raise ConfigError(f"--latent-size {args.latent_size} must be below --hidden "
                          f"{args.hidden}; leave it out for experts at full width")
    args.dispatchers = args.dispatchers.split(",")
    unknown = [name for name in args.dispatchers if name not in DISPATCHERS]
    if unknown:
        raise ConfigError(f"--dispatchers {unknown} not among {list(DISPATCHERS)}")
    check_file_output(args.out, "--out")
    return args


class CountingComm:
    """A Comm that forwards to another and records, per phase, the bytes each collective hands
    over (`sent`, `received`: all rows; `*_remote`: rows to/from other ranks) and the time spent
    in it. The ranks meet in a tiny all-reduce before each timed collective, so the time is the
    transfer's and not a wait for a slower peer."""

    def __init__(self, comm, sync):
        self.comm, self.rank, self.size, self.sync = comm, comm.rank, comm.size, sync
        self.phase = "other"
        self.stats = defaultdict(float)

    def _record(self, name: str, value: float) -> None:
        self.stats[f"{self.phase}/{name}"] += value

    def _timed(self, fn, x, *args):
        self.comm.all_reduce(x.new_zeros(1, dtype=torch.float32))
        self.sync()
        start = time.perf_counter()
        out = fn(x, *args)
        self.sync()
        self._record("comm_s", time.perf_counter() - start)
        return out

    def all_to_all(self, x, out_splits, in_splits):
        row = x.element_size() * (x[0].numel() if x.dim() > 1 else 1)
        self._record("sent", row * sum(in_splits))
        self._record("received", row * sum(out_splits))
        self._record("sent_remote", row * (sum(in_splits) - in_splits[self.rank]))
        self._record("received_remote", row * (sum(out_splits) - out_splits[self.rank]))
        return self._timed(self.comm.all_to_all, x, out_splits, in_splits)

    def all_gather(self, x):
        self._record("sent_remote", x.element_size() * x.numel() * (self.size - 1))
        self._record("received_remote", x.element_size() * x.numel() * (self.size - 1))
        return self._timed(self.comm.all_gather, x)

    def all_reduce(self, tensor, op="sum"):
        return self._timed(self.comm.all_reduce, tensor, op)


def init_group(args) -> tuple[object, torch.device]:
    """The expert-parallel Comm (the whole torchrun world) and the device."""
    from megamoe.parallel import SingleComm, TorchComm

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else \
        torch.device("cpu")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.ep != world:
        raise ConfigError(f"--ep {args.ep} differs from the {world} processes started; launch "
                          f"with torchrun --nproc-per-node {args.ep}")
    if world == 1:
        return SingleComm(), device
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo",
                            timeout=datetime.timedelta(seconds=args.timeout_s))
    return TorchComm(), device


def bench_dispatcher(args, name, comm, device) -> dict:
    """Median per-phase forward times and per-step byte counts of one dispatcher on this rank."""
    from megamoe import MoEConfig
    from megamoe.layer import MoELayer

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    counting = CountingComm(comm, sync)
    cfg = MoEConfig.from_dict({"hidden_size": args.hidden, "num_experts": args.experts,
                               "ffn_hidden_size": args.ffn, "topk": args.topk,
                               "balancing": {"methods": "none"}, "dispatcher": {"kind": name},
                               "experts": {"latent_size": args.latent_size}})
    torch.manual_seed(0)
    layer = MoELayer(cfg, ep_comm=counting).to(device=device, dtype=DTYPES[args.dtype])
    gen = torch.Generator().manual_seed(1 + comm.rank)
    x_TD = torch.randn(args.tokens, args.hidden, generator=gen).to(device, DTYPES[args.dtype])
    times = defaultdict(list)
    steps = range(args.warmup + args.steps)
    if comm.rank == 0:
        from tqdm import tqdm
        steps = tqdm(steps, desc=name, leave=False)
    for step in steps:
        if step == args.warmup:
            counting.stats.clear()
        x = x_TD.detach().requires_grad_()
        sync()
        start = time.perf_counter()
        routing = layer.router(x)
        rows_in = x if layer.fc1_latent_proj is None else layer.fc1_latent_proj(x)
        for phase in PHASES:
            counting.phase = phase
            comm_before = counting.stats[f"{phase}/comm_s"]
            sync()
            t0 = time.perf_counter()
            if phase == "dispatch":
                rows_ND, tokens_per_expert, state = layer.dispatcher.dispatch(rows_in, routing)
            elif phase == "experts":
                y_ND = layer.experts(rows_ND, tokens_per_expert)
            else:
                y_TD = layer.dispatcher.combine(y_ND, state)
            sync()
            if step >= args.warmup:
                times[phase].append(time.perf_counter() - t0)
                times[f"{phase}_comm"].append(counting.stats[f"{phase}/comm_s"] - comm_before)
        if layer.fc2_latent_proj is not None:
            y_TD = layer.fc2_latent_proj(y_TD)
        counting.phase = "backward"
        y_TD.float().square().mean().backward()
        sync()
        if step >= args.warmup:
            times["step"].append(time.perf_counter() - start)
    result = {f"{phase}_ms": 1e3 * statistics.median(values) for phase, values in times.items()}
    result.update({key: value / args.steps for key, value in counting.stats.items()
                   if not key.endswith("comm_s")})
    return result


def slowest_rank(comm, result: dict, device: torch.device) -> dict:
    """Every figure's maximum over ranks (times: the slowest rank; bytes: the busiest)."""
    keys = sorted(result)
    values = torch.tensor([float(result[k]) for k in keys], dtype=torch.float64, device=device)
    comm.all_reduce(values, op="max")
    return dict(zip(keys, values.tolist()))


def report(args, name, figures, device) -> dict:
    """Figures of one dispatcher with the analytic volume and achieved bandwidths."""
    element = torch.tensor([], dtype=DTYPES[args.dtype]).element_size()
    width = args.latent_size or args.hidden
    analytic = args.tokens * args.topk * width * element
    row = dict(dispatcher=name, ep=args.ep, tokens_per_rank=args.tokens, hidden=args.hidden,
               latent_size=args.latent_size,
               ffn=args.ffn, experts=args.experts, topk=args.topk, dtype=args.dtype,
               device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               backend=dist.get_backend() if dist.is_initialized() else "none",
               analytic_bytes_per_direction=analytic)
    row.update(figures)
    for phase in ("dispatch", "combine"):
        remote = figures.get(f"{phase}/sent_remote", 0.0)
        comm_s = figures[f"{phase}_comm_ms"] / 1e3
        row[f"{phase}_vs_analytic"] = figures.get(f"{phase}/sent", 0.0) / analytic
        row[f"{phase}_remote_GBps"] = remote / comm_s / 1e9 if comm_s > 0 else 0.0
    return row


def print_row(row: dict) -> None:
    print(f"{row['dispatcher']:>9} EP={row['ep']} {row['backend']} {row['device']}: "
          f"dispatch {row['dispatch_ms']:.2f} ms, experts {row['experts_ms']:.2f} ms, "
          f"combine {row['combine_ms']:.2f} ms, fwd+bwd step {row['step_ms']:.2f} ms")
    for phase in ("dispatch", "combine") if row["ep"] > 1 else ():
        mb = lambda key: row.get(f"{phase}/{key}", 0.0) / 2**20  # noqa: E731
        print(f"{'':>11}{phase}: sent {mb('sent'):.2f} MiB ({mb('sent_remote'):.2f} to other "
              f"ranks), received {mb('received'):.2f} MiB ({mb('received_remote'):.2f}); "
              f"analytic {row['analytic_bytes_per_direction'] / 2**20:.2f} MiB "
              f"(x{row[f'{phase}_vs_analytic']:.2f}); in collectives "
              f"{row[f'{phase}_comm_ms']:.2f} ms, "
              f"{row[f'{phase}_remote_GBps']:.3f} GB/s to other ranks")


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads() // args.ep))
    comm, device = init_group(args)
    rows = [report(args, name, slowest_rank(comm, bench_dispatcher(args, name, comm, device),
                                            device), device)
            for name in args.dispatchers]
    if comm.rank == 0:
        for row in rows:
            print_row(row)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "a") as out:
            for row in rows:
                out.write(json.dumps(row) + "\n")
        print(f"wrote {len(rows)} rows to {args.out}", file=sys.stderr)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    run_cli(main)

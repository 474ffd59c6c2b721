"""The command lines of the benchmarks (tools/bench_*.py), the soak test, the studies and the
Hugging Face export: a count below its minimum, a size that is not a whole number and a timeout
that is not a positive number are one-line errors before anything runs."""
from __future__ import annotations

import pytest

from megamoe.errors import ConfigError
from tool_modules import tool_module


@pytest.mark.parametrize("tool, argv, message", [
    ("bench_moe_layer", ["--tokens", "0"], "argument --tokens: 0 must be >= 4"),
    ("bench_moe_layer", ["--iters", "0"], "argument --iters: 0 must be >= 1"),
    ("bench_moe_layer", ["--warmup", "-1"], "argument --warmup: -1 must be >= 0"),
    ("bench_moe_layer", ["--topk", "2", "0"], "argument --topk: 0 must be >= 1"),
    ("bench_moe_layer", ["--hidden", "1e3"], "argument --hidden: '1e3' is not a whole number"),
    ("bench_ep_dispatch", ["--ep", "0"], "argument --ep: 0 must be >= 1"),
    ("bench_ep_dispatch", ["--steps", "0"], "argument --steps: 0 must be >= 1"),
    ("bench_ep_dispatch", ["--timeout-s", "nan"], "--timeout-s nan must be a positive number"),
    ("bench_ep_dispatch", ["--timeout-s", "0"], "--timeout-s 0.0 must be a positive number"),
    ("bench_upcycle", ["--workdir", "w", "--layers", "0"], "argument --layers: 0 must be >= 1"),
    ("bench_upcycle", ["--workdir", "w", "--granularity", "-2"],
     "argument --granularity: -2 must be >= 1"),
    ("soak", ["--out", "o", "--nproc", "0"], "argument --nproc: 0 must be >= 1"),
    ("soak", ["--out", "o", "--checkpoint-interval", "-1"],
     "argument --checkpoint-interval: -1 must be >= 0"),
    ("soak", ["--out", "o", "--steps", "50"], "--warmup=100 must be below --steps=50"),
])
def test_bad_counts_are_one_line_errors(tool, argv, message):
    with pytest.raises(ConfigError) as err:
        tool_module(tool).parse_args(argv)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_counts_at_their_minimum_are_accepted():
    args = tool_module("bench_moe_layer").parse_args(
        ["--tokens", "4", "--iters", "1", "--warmup", "0", "--experts", "1", "--topk", "1",
         "--ffn", "1", "--hidden", "1"])
    assert (args.tokens, args.iters, args.warmup, args.topk) == (4, 1, 0, [1])


@pytest.mark.parametrize("parse, message", [
    (lambda: tool_module("study_layout_seed").parse_args(["--steps", "0"]),
     "argument --steps: 0 must be >= 1"),
    (lambda: tool_module("export_hf").build_parser().parse_args(
        ["--load", "a", "--save", "b", "--max-shard-size-mb", "0"]),
     "argument --max-shard-size-mb: 0 must be >= 1"),
    (lambda: tool_module("study_routing").study_arguments("study_routing", {"bias": {}}, "",
                                                          ["--jobs", "0"]),
     "argument --jobs: 0 must be >= 1"),
    (lambda: tool_module("study_routing").study_arguments("study_routing", {"bias": {}}, "",
                                                          ["--variants", "nope"]),
     "--variants 'nope': unknown ['nope']"),
])
def test_the_studies_and_export_share_the_count_check(parse, message):
    with pytest.raises(ConfigError) as err:
        parse()
    assert message in str(err.value) and "\n" not in str(err.value)

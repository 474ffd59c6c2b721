"""The Hugging Face round trip of every architecture megamoe imports and exports, through the
real command lines, measured against transformers.

    python tests/bench_hf_round_trip.py [--archs mixtral,gpt_oss] [--keep DIR] [--json PATH]

For each case it builds a tiny random model with transformers' own classes (the builders of
tests/hf_models.py: `kimi_k2` is a Kimi-K2-shaped DeepSeek-V3, `+mtp` adds a multi-token-
prediction layer to the saved checkpoint as the releases store it, `+fp8` saves it with float8
e4m3 weights and 16 x 24 block scales, partial edge blocks included), runs
`tools/import_hf.py --load SRC --save CKPT` and `tools/export_hf.py --load CKPT --save OUT
--arch <the source's>`, loads SRC and OUT with transformers (fp32, CPU, eager attention) and
prints one row per case: the largest |logit difference| source vs exported model, the source's
tensors (an FP8 weight and its scales count as one), the exported ones, how many of these are
bit-identical to the source's (FP8: to this script's own dequantisation, W * scale_inv per block
in fp32) and the seconds the case took. The bar (issue 48): logits within 1e-4 and every
source tensor, MTP included, back bit-identical under its own name, nothing else; exit code 1
when a case misses it. Progress goes to stderr.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the tests' model builders
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402
from hf_models import KIMI_K2, add_mtp_tensors, save_tiny_hf_model, saved_tensors  # noqa: E402

from megamoe.errors import CliArgumentParser, ConfigError, run_cli  # noqa: E402

BAR = 1e-4
CASES = {"mixtral": ("mixtral", {}), "qwen2_moe": ("qwen2_moe", {}),
         "qwen3_moe": ("qwen3_moe", {}), "deepseek_v3": ("deepseek_v3", {}),
         "kimi_k2": ("deepseek_v3", KIMI_K2), "glm4_moe": ("glm4_moe", {}),
         "minimax_m2": ("minimax_m2", {}), "gpt_oss": ("gpt_oss", {}),
         "deepseek_v3+mtp": ("deepseek_v3", {}), "glm4_moe+mtp": ("glm4_moe", {}),
         "deepseek_v3+fp8": ("deepseek_v3", {})}
"""Case -> (transformers model_type, overrides of tests/hf_models.py's tiny config)."""
FP8_BLOCK = (16, 24)
FP8_LAYERS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj",
              "up_proj", "down_proj", "eh_proj")
"""The linear layers DeepSeek-V3's release stores in FP8 (not embeddings, heads, norms, router)."""


def _block_scale(scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """One scale per block, repeated over its FP8_BLOCK elements and cut to `shape`."""
    return scale.repeat_interleave(FP8_BLOCK[0], 0).repeat_interleave(FP8_BLOCK[1], 1)[
        :shape[0], :shape[1]]


def _save_fp8(plain: Path, src: Path) -> None:
    """Write `plain` to `src` in DeepSeek-V3's FP8 format (each block's largest magnitude at
    e4m3's 448, `weight_scale_inv` fp32, `quantization_config` in config.json), and rewrite
    `plain` with the dequantised weights: the unquantised model the import must reproduce."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(plain, src)
    index = json.loads((plain / "model.safetensors.index.json").read_text())
    for shard in sorted(set(index["weight_map"].values())):
        quantised, dequantised = {}, load_file(str(plain / shard))
        for name, weight in dequantised.items():
            quantised[name] = weight
            if name.split(".")[-2] in FP8_LAYERS:
                rows, cols = (-(-n // b) for n, b in zip(weight.shape, FP8_BLOCK))
                padded = torch.zeros(rows * FP8_BLOCK[0], cols * FP8_BLOCK[1])
                padded[:weight.shape[0], :weight.shape[1]] = weight.abs()
                scale = padded.view(rows, FP8_BLOCK[0], cols, FP8_BLOCK[1]).amax((1, 3)) / 448
                quantised[name] = (weight / _block_scale(scale, weight.shape)).to(
                    torch.float8_e4m3fn)
                quantised[name + "_scale_inv"] = scale
                index["weight_map"][name + "_scale_inv"] = shard
                dequantised[name] = quantised[name].float() * _block_scale(scale, weight.shape)
        save_file(quantised, str(src / shard), metadata={"format": "pt"})
        save_file(dequantised, str(plain / shard), metadata={"format": "pt"})
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((plain / "config.json").read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3",
                                     "quant_method": "fp8", "weight_block_size": list(FP8_BLOCK)}
    (src / "config.json").write_text(json.dumps(config))


@contextmanager
def _stdout_to_stderr():
    """File descriptor 1 sent to stderr: the tokenizers library's trainer (the tiny tokenizers)
    writes blank progress lines there, between the table's."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _tool(*args: str) -> None:
    done = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"{args[0]} exit {done.returncode}: {last}")


def run_case(case: str, work: Path) -> dict:
    """Build, import, export and compare one case; returns its table row."""
    from megamoe.upcycle.hf_logits import hf_logits, load_hf_model, sample_tokens

    model_type, overrides = CASES[case]
    start = time.perf_counter()
    work.mkdir(parents=True)
    with _stdout_to_stderr():
        src = reference = save_tiny_hf_model(model_type, work / "src", tokenizer=True,
                                             **overrides)
    if "+mtp" in case:
        add_mtp_tensors(src)
    if "+fp8" in case:
        reference, src = src, work / "src_fp8"
        _save_fp8(reference, src)
    _tool("tools/import_hf.py", "--load", str(src), "--save", str(work / "ckpt"),
          "--no-progress")
    _tool("tools/export_hf.py", "--load", str(work / "ckpt"), "--save", str(work / "out"),
          "--arch", model_type)
    tokens = sample_tokens(json.loads((src / "config.json").read_text())["vocab_size"])
    diff = float((hf_logits(load_hf_model(work / "out"), tokens) -
                  hf_logits(load_hf_model(reference), tokens)).abs().max())
    expected, back = saved_tensors(reference), saved_tensors(work / "out")
    same = sum(name in back and back[name].dtype == t.dtype and torch.equal(back[name], t)
               for name, t in expected.items())
    return {"arch": case, "max_logit_diff": diff, "source_tensors": len(expected),
            "exported_tensors": len(back), "bit_identical": same,
            "seconds": round(time.perf_counter() - start, 1),
            "ok": diff <= BAR and same == len(expected) == len(back), "error": None}


def main(argv: list[str] | None = None) -> int:
    p = CliArgumentParser(description=__doc__.split("\n\n")[0], prog="bench_hf_round_trip.py")
    p.add_argument("--archs", default=",".join(CASES),
                   help=f"comma-separated cases (default: all of {', '.join(CASES)})")
    p.add_argument("--keep", type=Path, help="keep each case's models under this folder")
    p.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    args = p.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # stderr: this script's progress lines only
    hf_logging.disable_progress_bar()
    cases = [c for c in args.archs.split(",") if c]
    unknown = [c for c in cases if c not in CASES] or ([] if cases else [args.archs])
    if unknown:
        raise ConfigError(f"--archs {unknown[0]!r} is not a case here; pick from {list(CASES)}")
    if args.keep and args.keep.exists():
        raise ConfigError(f"--keep {args.keep} exists; name a new folder")
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench_hf_round_trip_"))
    rows = []
    for case in cases:
        print(f"{case}: build, import, export, compare ...", file=sys.stderr, flush=True)
        try:
            rows.append(run_case(case, root / case.replace("+", "_")))
        except Exception as error:  # a failing case is a row of the report, not the end
            rows.append({"arch": case, "ok": False, "error": f"{type(error).__name__}: {error}"})
        print(f"{case}: {'ok' if rows[-1]['ok'] else 'FAILED'}", file=sys.stderr, flush=True)
    if not args.keep:
        shutil.rmtree(root)
    print(f"{'arch':<16} {'max|dlogit|':>11} {'source':>7} {'exported':>8} "
          f"{'identical':>9} {'seconds':>7}  bar {BAR:g}")
    for r in rows:
        print(f"{r['arch']:<16} " + (f"{r['max_logit_diff']:>11.2e} {r['source_tensors']:>7} "
                                     f"{r['exported_tensors']:>8} {r['bit_identical']:>9} "
                                     f"{r['seconds']:>7}  {'ok' if r['ok'] else 'MISSED'}"
                                     if r["error"] is None else f"FAILED  {r['error']}"))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    run_cli(main)

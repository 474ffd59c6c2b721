#!/usr/bin/env bash
# The GPU checks, in one call, for a machine with one CUDA GPU (megamoe and megatron-core
# importable; Transformer Engine or grouped_gemm for the grouped-GEMM peer):
#   1. the CUDA tests: the expert kernels (the same torch grouped_mm path, bf16 against fp32, that
#      the CPU tests run), the layer, shared-expert overlap, latent MoE against Megatron-Core's own
#      latent MoELayer (Transformer Engine), the Megatron GPT parity tests, and the
#      logit verifications of the converters (dense vs upcycled, transformers vs megamoe), which
#      run their models on the GPU where there is one;
#   2. the layer benchmark, megamoe vs Megatron-Core's grouped-GEMM experts (TEGroupedMLP when
#      Transformer Engine imports, else the legacy GroupedMLP when grouped_gemm imports; never
#      SequentialMLP, a per-expert loop);
#   3. single-process bf16 training through the one training path (Megatron-Core DDP with
#      gradient buffers + distributed optimizer + its schedule): 40 steps straight vs 20 + resume
#      + 20 (exact resume, optimizer state included).
#     bash tools/gpu_check.sh OUT_DIR            (about 8 minutes at most; every step is bounded)
# Ends with a SUMMARY block, one `PASS|FAIL|SKIP <check>: <figures>` line per check; exit code 0
# if nothing failed, 1 if a check failed, 77 (skipped) without a CUDA device, 2 if torch,
# megatron.core or megamoe does not import. Logs, JSON figures
# and the runs' metrics.jsonl land in OUT_DIR, which must be new, empty or an earlier
# gpu_check's (marked with .megamoe-owner, as megamoe/ownership.py marks a tool's folders):
# any other folder is refused in one line with exit code 2, untouched.
set -uo pipefail
out=${1:?usage: bash tools/gpu_check.sh OUT_DIR}
if [ -e "$out" ] && ! { [ -d "$out" ] && { [ -z "$(ls -A "$out")" ] \
        || [ "$(head -c 64 "$out/.megamoe-owner" 2>/dev/null)" = gpu_check ]; }; }; then
    echo "gpu_check: error: OUT_DIR $out is not a folder gpu_check wrote (no .megamoe-owner naming gpu_check); choose a new or empty folder" >&2
    exit 2
fi
mkdir -p "$out" && out=$(cd "$out" && pwd) || exit 2
echo gpu_check > "$out/.megamoe-owner"
cd "$(dirname "$0")/.." || exit 2
export PYTHONUNBUFFERED=1 TORCHDYNAMO_DISABLE=1 WANDB_MODE=offline
summary="$out/summary.txt"
: > "$summary"
record() { echo "$*" | tee -a "$summary"; }

if ! timeout 120 python3 -c "import torch, megatron.core, megamoe" 2> "$out/import.log"; then
    echo "gpu_check: FAIL: torch, megatron.core or megamoe does not import: $(tail -1 "$out/import.log")"
    exit 2
fi
if ! timeout 60 python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: SKIP: no CUDA device visible (torch.cuda.is_available() is False); nothing was run"
    exit 77
fi
timeout 120 python3 -c "import torch, megatron.core; print('torch', torch.__version__, '| megatron-core',
megatron.core.__version__, '|', torch.cuda.get_device_name(), '| CUDA', torch.version.cuda)" \
    | tee "$out/gpu.txt"

# 1. CUDA tests ---------------------------------------------------------------------------------
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/unit/test_experts.py \
    tests/unit/test_gpt_oss_moe.py \
    tests/unit/test_layer.py tests/distributed/test_shared_overlap_cuda.py \
    tests/unit/test_megatron_gpt.py tests/unit/test_upcycle_cli.py \
    tests/unit/test_interop_hf.py tests/unit/test_latent_moe.py \
    > "$out/tests.log" 2>&1
status=$?
counts=$(grep -E "passed|failed|error" "$out/tests.log" | tail -1)
if [ $status -eq 0 ]; then record "PASS cuda tests: $counts"
else record "FAIL cuda tests (exit $status): ${counts:-see $out/tests.log}"; fi

# 2. Layer benchmark vs Megatron-Core's grouped-GEMM experts -----------------------------------
peer=$(timeout 120 python3 - <<'PY'
try:
    import transformer_engine.pytorch  # noqa: F401
    print("te_grouped")
except Exception:
    try:
        import grouped_gemm  # noqa: F401
        print("grouped")
    except Exception:
        print("none")
PY
)
if [ "$peer" = "none" ]; then
    record "SKIP layer benchmark: neither transformer_engine nor grouped_gemm imports (no grouped-GEMM peer; SequentialMLP is not a fair one)"
else
    for args in "--tokens 16384" "--hidden 4096 --ffn 14336 --experts 8 --topk 2 --tokens 4096"; do
        tag=$(echo "$args" | tr -dc 'a-z0-9')
        if timeout 180 python3 tools/bench_moe_layer.py --dtype bf16 --peer "$peer" $args \
                --json "$out/layer_$tag.json" > "$out/layer_$tag.log" 2>&1; then
            record "PASS layer benchmark bf16 $args vs $peer: $(grep '^summary: ' "$out/layer_$tag.log" | cut -c10-)"
        else
            record "FAIL layer benchmark bf16 $args vs $peer: $(grep -v -i warn "$out/layer_$tag.log" | tail -1)"
        fi
    done
fi

# 3. bf16 training through Megatron DDP + distributed optimizer; exact resume -------------------
common=(--config configs/tiny_cpu.yaml parallel.expert=1 training.train_steps=40 logging.interval=10
        checkpoint.interval=0 logging.progress_bar=false logging.tensorboard=false
        training.precision=bf16)
rm -rf "$out/straight" "$out/resumed"
ok=1
timeout 240 python3 -m megamoe.train "${common[@]}" output_dir="$out/straight" > "$out/train_straight.log" 2>&1 || ok=0
for half in 1 2; do
    timeout 240 python3 -m megamoe.train "${common[@]}" output_dir="$out/resumed" training.exit_interval=20 \
        > "$out/train_resumed_$half.log" 2>&1 || ok=0
done
if [ $ok -eq 0 ]; then
    record "FAIL bf16 training: a run exited non-zero (see $out/train_*.log: $(tail -1 "$out/train_straight.log"))"
else
    python3 - "$out" <<'PY' | tee -a "$summary"
import json, sys
def steps(run):
    rows = [json.loads(line) for line in open(f"{sys.argv[1]}/{run}/metrics.jsonl")]
    return [r for r in rows if "loss" in r and "event" not in r]
a, b = steps("straight"), steps("resumed")
la, lb = [r["loss"] for r in a], [r["loss"] for r in b]
falls = len(la) == 40 and la[-1] < la[0] - 0.5
print(f"{'PASS' if falls else 'FAIL'} bf16 training (Megatron DDP + distributed optimizer): "
      f"{len(la)} steps, loss {la[0]:.3f} -> {la[-1]:.3f}, {a[-1]['tokens_per_s']:.0f} tokens/s")
diff = max(abs(x - y) for x, y in zip(la, lb)) if len(la) == len(lb) == 40 else float("inf")
print(f"{'PASS' if diff <= 1e-3 else 'FAIL'} exact resume (20 + 20 vs 40 steps, bf16): max |loss "
      f"difference| = {diff:.3g} over {len(lb)} steps (bitwise: {diff == 0})")
PY
fi

echo "== SUMMARY ($(head -1 "$out/gpu.txt"))"
cat "$summary"
if grep -q "^FAIL" "$summary"; then exit 1; fi
exit 0

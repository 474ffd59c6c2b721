#!/usr/bin/env bash
# The GPU checks, as one script for a machine with CUDA (megamoe and megatron-core importable):
# the CUDA tests, the layer and dispatch benchmarks in bf16, and a short bf16 training run with
# an exact-resume comparison (Megatron's DDP + distributed optimizer).
#     bash tools/gpu_check.sh OUT_DIR
# Figures land in OUT_DIR (*.log, *.json, metrics.jsonl of the runs).
set -uo pipefail
out=${1:?usage: bash tools/gpu_check.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TORCHDYNAMO_DISABLE=1
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
python3 -c "import torch, megatron.core; print(torch.__version__, megatron.core.__version__,
torch.cuda.get_device_name())" | tee "$out/gpu.txt"

echo "== CUDA tests" | tee "$out/tests.log"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/unit/test_layer.py \
    tests/distributed/test_shared_overlap_cuda.py tests/unit/test_megatron_gpt.py 2>&1 \
    | tail -15 | tee -a "$out/tests.log"

echo "== layer: megamoe vs Megatron-Core" | tee "$out/bench.log"
for args in "--dtype fp32" "--dtype bf16 --tokens 16384" \
            "--dtype bf16 --hidden 4096 --ffn 14336 --experts 8 --topk 2 --tokens 4096"; do
    timeout 150 python3 tools/bench_moe_layer.py $args --json "$out/layer_$(echo $args | tr -dc 'a-z0-9').json" \
        2>&1 | grep -v -i warn | tail -3 | tee -a "$out/bench.log"
done
echo "== dispatch at EP=$gpus" | tee -a "$out/bench.log"
timeout 150 torchrun --standalone --nproc-per-node "$gpus" tools/bench_ep_dispatch.py --ep "$gpus" \
    --dtype bf16 --out "$out/dispatch.jsonl" 2>&1 | grep -v -i "warn\|it/s" | tail -8 | tee -a "$out/bench.log"

echo "== bf16 training: 40 steps straight vs 20 + resume + 20" | tee "$out/train.log"
common=(--config configs/tiny_cpu.yaml parallel.expert=1 training.train_steps=40 logging.interval=10
        checkpoint.interval=0 logging.progress_bar=false)
timeout 240 python3 -m megamoe.train "${common[@]}" output_dir="$out/straight" 2>&1 | tail -4 | tee -a "$out/train.log"
for _ in 1 2; do
    timeout 240 python3 -m megamoe.train "${common[@]}" output_dir="$out/resumed" training.exit_interval=20 \
        2>&1 | tail -2 | tee -a "$out/train.log"
done
python3 - "$out" <<'PY' | tee -a "$out/train.log"
import json, sys
losses = {run: [json.loads(line)["loss"] for line in open(f"{sys.argv[1]}/{run}/metrics.jsonl")]
          for run in ("straight", "resumed")}
a, b = losses["straight"], losses["resumed"]
print(f"loss {a[0]:.3f} -> {a[-1]:.3f}; max |straight - resumed| = "
      f"{max(abs(x - y) for x, y in zip(a, b)):.3g} over {len(a)} steps")
PY

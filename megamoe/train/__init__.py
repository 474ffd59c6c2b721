"""Pretraining MoE GPT models on Megatron-Core: `python -m megamoe.train --config X.yaml`.

Modules: `config` (schema, YAML, overrides), `model` (GPTModel with megamoe layers), `inputs`
(batches from `data`/`corpus`), `engine` (Megatron-Core's DDP, distributed optimizer and pipeline
schedules, on CPU and GPU), `schedule` (learning rate), `checkpoint` and `progress` (distributed
checkpoints, the `latest` marker), `signals` (checkpoint-and-exit on SIGTERM/SIGUSR1), `metrics`
(console, JSONL, TensorBoard, wandb) and `loop` (the training loop).
"""

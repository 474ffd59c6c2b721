"""Test-wide settings: megatron's torch.compile-based jit fuser costs seconds per first call on CPU."""
import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

"""Megatron-Core integration: CPU overrides, runtime setup/teardown, small model builders."""

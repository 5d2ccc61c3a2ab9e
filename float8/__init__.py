"""float8 training with torchao: config -> Float8LinearConfig, module selection, validation, FSDP amax hook.

Nothing here imports torchao at import time (nor torch, for `float8.environment`), so config handling stays light.
"""

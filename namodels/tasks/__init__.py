"""Lightning modules per task and the train/eval runners (``configs/task/*.yaml`` plug them in)."""
from .run_names import register_resolver as _register_resolver

_register_resolver()  # ${ckpt_run_name:...} in the eval configs (configs/task/generate.yaml)

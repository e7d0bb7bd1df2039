"""Lightning modules per task and the train/eval runners (``configs/task/*.yaml`` plug them in)."""

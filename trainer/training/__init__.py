"""Run control: recipes and arguments, the HF Trainer subclass, checkpoints, preemption, liveness."""

"""Planning before GPUs are rented: a draft config for any target, and per-rank memory of a run."""

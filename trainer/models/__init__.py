"""The two models as objects: the frozen target, loading and warm-starting drafts, config bounds."""

"""The training objective: anchors and blocks, attention visibility, the fused LM-head loss, metrics."""

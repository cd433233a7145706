"""Training data: conversations and their loss masks, regenerated answers, offline target features."""

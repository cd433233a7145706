"""From a trained draft to the Hub: export in the public layout, the model card, the push."""

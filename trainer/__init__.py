"""Training, export and publishing of DFlash2 drafts on the Hugging Face stack."""

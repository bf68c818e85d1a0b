"""Drafters: propose a block of tokens for the trunk to verify (DFlash2, MTP)."""

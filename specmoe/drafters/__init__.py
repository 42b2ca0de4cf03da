"""Drafters for speculative decoding: the DFlash-format block-diffusion drafter model (`dflash_model`)."""

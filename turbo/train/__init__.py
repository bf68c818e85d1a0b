"""python -m turbo.train: a DFlash2 drafter or an MTP head for any install, trained on the user's text.

    python -m turbo.train INSTALL --kind dflash2|mtp --data FILE_OR_DIR... --out DIR

The training set is the install's own trunk run over the text (turbo.train.data): by default
its greedy continuations of prompts drawn from the text (self-distillation), or the text
itself (--targets text). The drafter trains with the published losses (turbo.train.dflash2,
turbo.train.mtp) in a loop that checkpoints, resumes and keeps to a time budget
(turbo.train.loop), is written in the layout `python -m turbo.repack --drafter` (DFlash2) or
`--mtp` (the MTP head) files into an install, and is measured on held-out prompts
(turbo.train.heldout).
"""

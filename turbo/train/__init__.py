"""python -m turbo.train: a DFlash2 drafter or an MTP head for any install, trained on the user's text.

    python -m turbo.train INSTALL --kind dflash2|mtp --data FILE_OR_DIR... --out DIR

The training set (turbo.train.data), the losses (turbo.train.dflash2, turbo.train.mtp), the loop
(turbo.train.loop) and the held-out evaluation (turbo.train.heldout); README, "Training a drafter".
"""

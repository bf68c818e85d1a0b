#!/bin/sh
# Turn the trained tiny checkpoints (scripts/train_tiny.py, scripts/train_mtp.py) into the
# install shipped in the package, through the real repack path; then refresh the goldens.
set -e
cd "$(dirname "$0")/.."
rm -rf turbo/installs/tiny
python -m turbo.repack build/tiny_hf_mtp turbo/installs/tiny --drafter build/tiny_dflash
python scripts/tiny_golden.py

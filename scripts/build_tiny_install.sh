#!/bin/sh
# Turn the trained tiny checkpoints (scripts/train_tiny.py: the trunk, then its DFlash2 drafter and
# MTP head through python -m turbo.train) into the install shipped in the package, through the real
# repack path; then refresh the golden (plain greedy decode: unchanged while the trunk is).
# The trunk's source: build/tiny_hf, or the first argument (an install, e.g. turbo/installs/tiny
# itself, to refile retrained drafters beside the same trunk).
set -e
cd "$(dirname "$0")/.."
src="${1:-build/tiny_hf}"
rm -rf build/tiny_install_new
python -m turbo.repack "$src" build/tiny_install_new --drafter build/tiny_dflash2 --mtp build/tiny_mtp
rm -rf turbo/installs/tiny
mv build/tiny_install_new turbo/installs/tiny
python scripts/tiny_golden.py

#!/bin/sh
# Turn the trained tiny checkpoints (scripts/train_tiny.py: the trunk, then its DFlash2 drafter and
# MTP head through python -m turbo.train) into the install shipped in the package, through the real
# repack path; then refresh the golden (plain greedy decode: unchanged while the trunk is).
# The trunk's source: build/tiny_hf, or the first argument (an install: turbo/installs/tiny itself,
# to refile retrained drafters beside the same trunk, or a `--kind trunk` run's OUT/install; its
# chat template, tokenizer and generation_config.json travel with it). The drafters: build/tiny_dflash2
# and build/tiny_mtp, or the directories in $DFLASH2 and $MTP.
set -e
cd "$(dirname "$0")/.."
src="${1:-build/tiny_hf}"
rm -rf build/tiny_install_new
python -m turbo.repack "$src" build/tiny_install_new --drafter "${DFLASH2:-build/tiny_dflash2}" \
    --mtp "${MTP:-build/tiny_mtp}"
rm -rf turbo/installs/tiny
mv build/tiny_install_new turbo/installs/tiny
du -sh turbo/installs/tiny
python -m scripts.tiny_golden

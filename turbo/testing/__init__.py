"""Helpers the tests and scripts/ share (as torch.testing is torch's): random checkpoints and
installs (checkpoints.py), a scripted drafter and parity checks (checks.py), the published
shapes for the real-scale benchmarks (shapes.py). The benchmarks' own plumbing is scripts/benchlib.py.
transformers and safetensors, which making checkpoints needs, are imported only when used."""

from turbo.testing.checkpoints import (MOE_BASE, hf_config, make_checkpoint, make_drafter, make_install,
                                       make_moe_checkpoint, make_moe_install, make_published_dflash,
                                       make_spec_install, published_dflash_config, randomize_, tiny_tokenizer)
from turbo.testing.checks import (ScriptedDrafter, assert_64_greedy_tokens_match, assert_lossless,
                                  assert_prefill_and_64_steps_match)

__all__ = ["MOE_BASE", "ScriptedDrafter", "assert_64_greedy_tokens_match", "assert_lossless",
           "assert_prefill_and_64_steps_match", "hf_config", "make_checkpoint", "make_drafter", "make_install",
           "make_moe_checkpoint", "make_moe_install", "make_published_dflash", "make_spec_install",
           "published_dflash_config", "randomize_", "tiny_tokenizer"]

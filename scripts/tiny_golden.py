"""Record the shipped install's golden continuation (tests/golden/tiny.json).

The golden is plain greedy decode; tests/test_tiny.py checks every policy, block and
drafter against it. Rerun only when the shipped weights change."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import turbo

PROMPT = "def parse_header(line):\n    \"\"\"Split a header line into name and value.\"\"\"\n"
TOKENS = 32


def main() -> None:
    torch.set_num_threads(1)
    rt = turbo.open("tiny", backend="cpu")
    out = rt.generate(PROMPT, max_new_tokens=TOKENS, policy="off", stop_at_eos=False)
    path = Path(__file__).resolve().parent.parent / "tests" / "golden" / "tiny.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({"prompt": PROMPT, "max_new_tokens": TOKENS, "tokens": out.tokens,
                                "text": out.text}, indent=2) + "\n")
    print(f"wrote {path}: {out.text!r}")


if __name__ == "__main__":
    # no options; --help must print this docstring, not run the script
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()

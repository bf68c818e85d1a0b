"""The DFlash2 drafter's mask token when --mask-token-id names none: a token no text encodes to.

The rule, first that applies: the tokenizer's `<|mask|>`; the first embedding row past the
tokenizer's tokens (the rows a checkpoint pads its vocabulary with: z-lab's DFlash drafters for
Qwen3 name 151669, the first past Qwen3's tokenizer; Qwen3.5's tokenizer ends at 248076 in a
vocabulary of 248320); the lowest reserved special token by name (`<|reserved_special_token_0|>`,
`<|extra_0|>`); else a refusal that says what to pass.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tokenizers import Tokenizer

from ..errors import TurboError

MASK = "<|mask|>"
RESERVED = re.compile(r"<\|?(reserved|extra)\w*?_?\d+\|?>")


@dataclass(frozen=True)
class MaskChoice:
    token: int
    why: str  # how the rule picked it, for the line said on stderr


def choose(tokenizer: Tokenizer, vocab: int) -> MaskChoice:
    """The mask token by the rule above, for a trunk whose embedding has `vocab` rows."""
    named = tokenizer.token_to_id(MASK)
    if named is not None and named < vocab:
        return MaskChoice(named, f"the tokenizer's {MASK}")
    past = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    if past < vocab:
        return MaskChoice(past, f"the first embedding row past the tokenizer's {past} tokens (no text encodes to it)")
    added = tokenizer.get_added_tokens_decoder()
    reserved = sorted(i for i, t in added.items() if i < vocab and t.special and RESERVED.fullmatch(t.content))
    if reserved:
        return MaskChoice(reserved[0], f"the reserved special token {added[reserved[0]].content}")
    raise TurboError(f"no mask token: the tokenizer has no {MASK}, no embedding row past its tokens (vocab {vocab}) "
                     f"and no reserved special token; give --mask-token-id ID, an id in 0..{vocab - 1} that your "
                     "text never holds")

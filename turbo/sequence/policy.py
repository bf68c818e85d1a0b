"""The one room where a generation's speculation is decided (`decide`): its policy (the caller's,
else the environment's default read when the runtime opened), block, drafter and window, from the
options and the install. The CLI, the API, sessions, the probe and the server all ask it; nobody
else turns one policy into another.

The rules are the Rust module's (docs/DESIGN.md 3, 6, 10), with one for a drafter that is not
there (`plan`): policy `auto` with drafter `auto` decodes plainly and says why and what would
speculate; a named drafter the install lacks, or `fixed` / `adaptive` with none, refuses in one
line naming what is missing and what works on this install. A block asked for under `auto` is
that block where the install speculates, and a plain decode (saying why) where it cannot."""

from __future__ import annotations

from dataclasses import dataclass

from ..drafters import Drafter, mtp
from ..drafters.dflash_config import DflashConfig
from ..errors import TurboError
from ..store.install import CODE_NAMES, Install
from ..vision.runtime import tower_refusal
from . import options
from .options import OWN_DRAFTERS

# DFlash2's trained block: the bound for a drafter that names none (the MTP head, ngram, a caller's own).
DFLASH_BLOCK = 8
# The widest block this port builds: the published DFlash drafters' trained block_size.
WIDEST_BLOCK = 16
# What `auto` serves: measured fastest on prose, code and math (the table in docs/DESIGN.md 10):
# a rejected round restores and replays recurrent state, and a block of B needs all B
# proposals to land, so the trained 8 is the wrong serving block.
DFLASH_SERVING_BLOCK = 2
# The default block of every other drafter (the MTP head, ngram, a caller's own): the MTP head
# measured the same answer from a second architecture.
DEFAULT_SPECULATION_BLOCK = 2
assert 0 < DFLASH_SERVING_BLOCK <= DFLASH_BLOCK <= WIDEST_BLOCK

VISION_SPECULATION_BLOCKER_MARKER = "speculation blocked [vision]"
MOE_SPECULATION_BLOCKER_MARKER = "speculation blocked [moe]"
POLICIES = ("auto", "off", "fixed", "adaptive")
DRAFTERS = OWN_DRAFTERS + ("ngram",)  # ngram: prompt lookup (no weights); auto never picks it


# The drafters that keep no DFlash context window, and what to say to window= with them
NO_WINDOW = {"object": "a drafter object keeps its own (drop window=)",
             "mtp": "the MTP head drafting here keeps none (drop window= or use drafter=dflash)",
             "ngram": "the n-gram drafter looks through the whole history (drop window= or use drafter=dflash)"}


@dataclass(frozen=True)
class DraftPolicy:
    name: str  # auto | off | fixed | adaptive
    block: int | None = None


def policy_from_env(drafter: str = "dflash") -> DraftPolicy:
    """The policy TURBO_DFLASH_DRAFT (TURBO_MTP_DRAFT for drafter mtp) names (options.policy_from_env)."""
    return DraftPolicy(*options.policy_from_env(drafter))


def speculation_blocker(install: Install, drafter: str | None, covered_dtypes: tuple[int, ...]) -> str | None:
    """Why speculation with `drafter` (dflash | mtp | ngram; None: a caller's own drafter object)
    cannot run on this install, or None. ngram and a drafter object need only the verify: they
    bring no weights, so no "this install carries no drafter" applies to them.

    Ordered: the first that applies wins. The vision arm (a tower its config does not describe:
    images cannot be read, and the install is not the checkpoint it claims) is first; a whole
    tower speculates, the rows after an image rotating at index + delta (turbo/vision). The MoE arm
    applies to an install that declares experts unless its trunk routes them and a drafter is
    at hand: one of its own (an MTP head, a DFlash drafter: then every drafter speculates), or
    one that needs no weights (ngram, a caller's object); then the routed verify checks it."""
    arch, index = install.arch, install.index
    why = tower_refusal(install) if install.has_vision else None
    if why is not None:
        return (f"{VISION_SPECULATION_BLOCKER_MARKER}: this install carries a vision tower that cannot run ({why}); "
                "repack with --text-only or use +policy=off")
    at_hand = install.has_mtp or install.has_dflash or drafter in ("ngram", None)
    if arch.num_experts != 0 and not (arch.moe_layers and at_hand):
        # the ported policy; an MoE install whose trunk routes (turbo/model/trunk.py's MoE block) and
        # that brings a drafter of its own speculates through the routed verify (README: MoE)
        return (f"{MOE_SPECULATION_BLOCKER_MARKER}: this install routes to {arch.num_experts} experts, and no "
                "published MoE checkpoint of this architecture ships a DFlash2 drafter (the published one targets "
                "the dense half); this is a checkpoint gap, not a missing kernel")
    full = arch.full_layers
    if not full:
        return "the batched verify needs a full-attention layer to probe and this install declares none"
    probe = f"trunk.layers.{full[0]}.self_attn.q_proj.weight"
    entry = index.get(probe)
    if entry is None:
        return f"cannot tell whether the verify can run: {probe} is missing"
    if entry.dtype not in covered_dtypes:
        names = ", ".join(f"{CODE_NAMES.get(c, c)} ({c})" for c in covered_dtypes)
        return (f"the batched verify covers {names}, and this install's {probe} is dtype {entry.dtype}")
    if drafter == "mtp":
        declared = mtp.declared_layers(install.config)
        if not install.has_mtp and declared:
            return mtp.missing_head(str(install.path / "config.json"), declared)
        if not install.has_mtp:
            return ("this install carries no MTP head (mtp.fc.weight is not in the resident index); repack from a "
                    "checkpoint that ships mtp.* tensors")
        return None
    if drafter == "dflash" and not install.has_dflash:
        return ("this install carries no DFlash2 drafter (dflash.fc.weight is not in the resident index); stream it "
                "beside the trunk: python -m turbo.repack SRC OUT --drafter DRAFTER_DIR")
    return None


@dataclass(frozen=True)
class Plan:
    """What a generation will do, decided once before it starts."""

    policy: str
    drafter: str | None  # dflash | mtp | ngram | a caller's drafter's kind | None (plain decode)
    block: int  # 0 when plain decode
    off_reason: str | None


def what_works(install: Install, covered_dtypes: tuple[int, ...], refusing: bool) -> str:
    """The drafters that speculate on this install (ngram: on every one the verify takes), as
    the tail of a refusal (with +policy=off) or of a plain fallback's reason."""
    here = [f"drafter={d}" for d in ("dflash", "mtp", "ngram") if speculation_blocker(install, d, covered_dtypes) is None]
    if not here:
        return "no drafter speculates on this install" + (": +policy=off decodes plainly" if refusing else "")
    return "what works on this install: " + ", ".join(here + (["+policy=off"] if refusing else []))


def missing_drafter(install: Install, kind: str | None) -> bool:
    """Whether `kind` is one of the install's own drafters and the install does not carry it."""
    return (kind == "dflash" and not install.has_dflash) or (kind == "mtp" and not install.has_mtp)


def choose_drafter(install: Install, drafter: str) -> str:
    if drafter not in DRAFTERS:
        raise TurboError(f"drafter {drafter!r} is not one of {', '.join(DRAFTERS)}", field="drafter")
    if drafter != "auto":
        return drafter
    # the install's DFlash drafter (it files at most one, of either architecture, under dflash/),
    # else its MTP head; with neither, dflash, whose blocker then says why speculation is off
    return "mtp" if install.has_mtp and not install.has_dflash else "dflash"


def check_block(block: int, trained: int) -> None:
    widest = min(trained, WIDEST_BLOCK)
    if not 1 <= block <= widest:
        raise TurboError(f"block {block} is outside 1..{widest}: the drafter's trained block is {trained} "
                         f"and this port builds at most {WIDEST_BLOCK}", field="block")


def check_policy(policy: object, block: int | None) -> None:
    """What a policy name and a block say on their own (the install is `plan`'s to judge)."""
    if policy not in POLICIES:
        raise TurboError(f"policy {policy!r} is not one of {', '.join(POLICIES)}", field="policy")
    if policy == "fixed" and block is None:
        raise TurboError("policy fixed needs a block: +policy=fixed block=N", field="policy")


def check_window(window: int, trained: int) -> None:
    """A DFlash drafter's context window against its trained sliding_window."""
    if not 1 <= window <= trained:
        raise TurboError(f"window {window} is outside 1..{trained} (the drafter's trained sliding_window)",
                         field="window")


def decide(install: Install, policy: str | None, block: int | None, drafter: str | Drafter, window: int | None,
           defaults: dict[str, DraftPolicy], covered_dtypes: tuple[int, ...], dflash: DflashConfig | None) -> Plan:
    """A generation's plan from its options and the install: `policy` None takes `defaults`
    (the environment's, read when the runtime opened: options.OpenOptions.draft_defaults) for
    the drafter it would use; `dflash` the install's DFlash drafter's parsed config (its trained
    block and window), None without one."""
    if policy is None:
        kind = choose_drafter(install, drafter) if isinstance(drafter, str) else "dflash"
        default = defaults.get(kind, DraftPolicy("auto"))
        policy, block = default.name, block if block is not None else default.block
    p = plan(install, policy, block, drafter, covered_dtypes, dflash.block_size if dflash is not None else None)
    if window is not None:
        no_window = p.drafter if isinstance(drafter, str) else "object"
        if no_window in NO_WINDOW:
            raise TurboError(f"window {window}: the window is the DFlash drafter's context, and "
                             f"{NO_WINDOW[no_window]}", field="window")
        if p.drafter == "dflash" and dflash is not None:
            check_window(window, dflash.window)
    return p


def plan(install: Install, policy: str, block: int | None, drafter: str | Drafter, covered_dtypes: tuple[int, ...],
         trained_block: int | None = None) -> Plan:
    """drafter: auto | dflash | mtp | ngram, or a caller's Drafter object (its kind names it in the plan)."""
    check_policy(policy, block)
    if policy == "off":
        return Plan("off", None, 0, "policy is off")
    kind = choose_drafter(install, drafter) if isinstance(drafter, str) else None
    reason = speculation_blocker(install, kind, covered_dtypes)
    if reason is not None:
        # a verify blocker: `fixed` refuses, the others decode plainly; a drafter that is not
        # there: only `auto` with the drafter `auto` picks decodes plainly
        named = isinstance(drafter, str) and drafter != "auto"
        if policy == "fixed" or (missing_drafter(install, kind) and (named or policy == "adaptive")):
            raise TurboError(f"{reason}; {what_works(install, covered_dtypes, refusing=True)}")
        return Plan(policy, None, 0, f"{reason}; {what_works(install, covered_dtypes, refusing=False)}")
    trained = trained_block if kind == "dflash" and trained_block else DFLASH_BLOCK
    if block is None:
        block = DFLASH_SERVING_BLOCK if kind == "dflash" else DEFAULT_SPECULATION_BLOCK
        if policy == "adaptive":
            block = min(trained, WIDEST_BLOCK)
    check_block(block, trained)
    return Plan(policy, kind or drafter.kind, block, None)

"""The MTP head as a drafter (docs/DESIGN.md 2.3): lossless speculation, refusals, repack, and the
head's forward against an independent hand-written one."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import turbo
from turbo.errors import TurboError
from turbo.repack import repack
from turbo.store.install import open_install
from turbo.testing import make_checkpoint


def mtp_tensors(cfg, seed: int = 0, scale: float = 0.08) -> dict[str, torch.Tensor]:
    """A random MTP head (HF names, `mtp.` prefix) shaped by the trunk's config."""
    g = torch.Generator().manual_seed(1000 + seed)
    h, hd, nh, nkv, inter = (cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads,
                             cfg.intermediate_size)

    def r(*shape, s=scale):
        return (torch.randn(shape, generator=g) * s).contiguous()

    p = "mtp.layers.0."
    return {"mtp.fc.weight": r(h, 2 * h, s=0.1), "mtp.pre_fc_norm_embedding.weight": r(h, s=0.2),
            "mtp.pre_fc_norm_hidden.weight": r(h, s=0.2), "mtp.norm.weight": r(h, s=0.2),
            p + "input_layernorm.weight": r(h, s=0.2), p + "post_attention_layernorm.weight": r(h, s=0.2),
            p + "self_attn.q_proj.weight": r(2 * nh * hd, h), p + "self_attn.k_proj.weight": r(nkv * hd, h),
            p + "self_attn.v_proj.weight": r(nkv * hd, h), p + "self_attn.o_proj.weight": r(h, nh * hd),
            p + "self_attn.q_norm.weight": r(hd, s=0.2), p + "self_attn.k_norm.weight": r(hd, s=0.2),
            p + "mlp.gate_proj.weight": r(inter, h), p + "mlp.up_proj.weight": r(inter, h),
            p + "mlp.down_proj.weight": r(h, inter)}


def add_mtp(directory, tensors: dict[str, torch.Tensor], shard: bool = False) -> None:
    """Write the head into an HF checkpoint (transformers would drop it on load): into its
    model.safetensors, or as a second shard with a model.safetensors.index.json."""
    main = directory / "model.safetensors"
    if not shard:
        save_file(load_file(str(main)) | tensors, str(main), metadata={"format": "pt"})
        return
    save_file(tensors, str(directory / "mtp.safetensors"), metadata={"format": "pt"})
    main.rename(directory / "model-00001.safetensors")
    weight_map = {n: "model-00001.safetensors" for n in load_file(str(directory / "model-00001.safetensors"))}
    weight_map |= {n: "mtp.safetensors" for n in tensors}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


PROMPTS = [[5, 17, 99, 3, 250, 41, 8], [7], [300, 2, 2, 2, 64]]


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    ids = list(ids)
    for _ in range(n):
        ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids


def fit_head(model, tensors: dict[str, torch.Tensor], seqs: list[list[int]], steps: int = 120) -> dict:
    """Teach the head the trunk's greedy continuations of the test prompts (step 1 of the
    chain, teacher-forced), so the lossless tests see accepted prefixes of every length as
    well as rejections, not only rejections."""
    cfg = model.config
    embed, lm_head = model.model.embed_tokens.weight.detach(), model.lm_head.weight.detach()
    params = {k: v.clone().requires_grad_(True) for k, v in tensors.items()}
    opt = torch.optim.Adam(params.values(), lr=3e-3)
    data = []
    for seq in seqs:
        with torch.no_grad():
            hidden = model.model(input_ids=torch.tensor([seq])).last_hidden_state[0]
        data.append((hidden[:-2], torch.tensor(seq[1:-1]), torch.tensor(seq[2:])))
    for _ in range(steps):
        loss = 0.0
        for hidden, nxt, tgt in data:
            _, logits = hand_mtp(params, cfg, embed, lm_head, hidden, nxt, torch.arange(len(nxt)), torch.float32)
            loss = loss + F.cross_entropy(logits, tgt)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().contiguous() for k, v in params.items()}


@pytest.fixture(scope="module")
def mtp_install(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mtp")
    src = tmp / "hf"
    model = make_checkpoint(src, 5)
    seqs = [hf_greedy(model, p, 26) for p in PROMPTS if len(p) > 1]
    tensors = fit_head(model, mtp_tensors(model.config, 5), seqs)
    add_mtp(src, tensors)
    return model, tensors, repack(src, tmp / "install", quiet=True)


@pytest.fixture(scope="module")
def rt(mtp_install):
    return turbo.open(mtp_install[2], backend="cpu")


@pytest.mark.parametrize("rollback", ["checkpoint", "replay"])
def test_lossless_every_block(rt, rollback):
    accepted = rollbacks = partial = 0
    for prompt in PROMPTS:
        ref = rt.generate(prompt, max_new_tokens=24, policy="off", stop_at_eos=False).tokens
        for block in range(1, 9):
            res = rt.generate(prompt, max_new_tokens=24, policy="fixed", block=block, drafter="mtp",
                              rollback=rollback, stop_at_eos=False)
            assert res.tokens == ref, (prompt, block)
            s = res.stats
            assert s.drafter == "mtp" and s.block == block and s.rounds > 0 and s.drafted > 0
            accepted, rollbacks = accepted + s.accepted, rollbacks + s.rollbacks
            partial += any(0 < p < 1 for p in s.per_position_acceptance)
    # the fitted head lands whole blocks, partial blocks and misses: every commit path ran
    assert accepted > 0 and rollbacks > 0 and partial > 0


@pytest.mark.parametrize("rollback", ["checkpoint", "replay"])
def test_lossless_adaptive(rt, rollback):
    """Adaptive plays plain rounds (commit without propose) between drafted ones."""
    for prompt in PROMPTS:
        ref = rt.generate(prompt, max_new_tokens=40, policy="off", stop_at_eos=False).tokens
        res = rt.generate(prompt, max_new_tokens=40, policy="adaptive", drafter="mtp", rollback=rollback,
                          stop_at_eos=False)
        assert res.tokens == ref, prompt


def test_auto_picks_the_head_at_the_default_block(rt):
    from turbo.sequence.policy import DEFAULT_SPECULATION_BLOCK

    res = rt.generate(PROMPTS[0], max_new_tokens=8, stop_at_eos=False)
    assert res.stats.drafter == "mtp" and res.stats.block == DEFAULT_SPECULATION_BLOCK
    assert res.stats.speculation_off_reason is None


def test_env_var_mirrors_dflash(mtp_install, monkeypatch):
    # the environment is read when the runtime opens (OpenOptions.from_env), not at every generation
    def opened():
        return turbo.open(mtp_install[2], backend="cpu")

    monkeypatch.setenv("TURBO_MTP_DRAFT", "3")
    monkeypatch.setenv("TURBO_DFLASH_DRAFT", "0")  # read only for the DFlash2 drafter
    rt = opened()
    res = rt.generate(PROMPTS[0], max_new_tokens=6, drafter="mtp", stop_at_eos=False)
    assert (res.stats.policy, res.stats.block) == ("fixed", 3)
    monkeypatch.setenv("TURBO_MTP_DRAFT", "0")
    assert rt.generate(PROMPTS[0], max_new_tokens=6, drafter="mtp", stop_at_eos=False).stats.policy == "fixed"
    assert opened().generate(PROMPTS[0], max_new_tokens=6, drafter="mtp", stop_at_eos=False).stats.policy == "off"
    monkeypatch.setenv("TURBO_MTP_DRAFT", "two")  # unparsable: auto
    assert opened().generate(PROMPTS[0], max_new_tokens=6, drafter="mtp", stop_at_eos=False).stats.policy == "auto"


def test_install_without_head_refuses_a_named_mtp_and_auto_falls_back(plain_install):
    """Issue #34's one rule: a drafter named but missing is refused under every policy (naming
    what works instead); drafter=auto falls back to plain decoding and says why."""
    runtime = turbo.open(plain_install[1], backend="cpu")
    for policy in ("fixed", "auto"):
        with pytest.raises(TurboError, match=r"no MTP head \(mtp\.fc\.weight.*drafter=ngram"):
            runtime.generate([1, 2, 3], max_new_tokens=4, policy=policy, block=2, drafter="mtp")
    res = runtime.generate([1, 2, 3], max_new_tokens=4, policy="auto", stop_at_eos=False)
    assert res.stats.drafter is None and "drafter=ngram" in res.stats.speculation_off_reason
    assert res.tokens == runtime.generate([1, 2, 3], max_new_tokens=4, policy="off", stop_at_eos=False).tokens


def test_repack_keeps_mtp_from_a_sharded_checkpoint(tmp_path):
    src = tmp_path / "hf"
    model = make_checkpoint(src, 2)
    tensors = mtp_tensors(model.config, 2)
    add_mtp(src, tensors, shard=True)
    inst = open_install(repack(src, tmp_path / "out", quiet=True))
    assert inst.has_mtp
    for name, t in tensors.items():
        assert torch.equal(inst.index.load(name), t), name
    assert "trunk.embed_tokens.weight" in inst.index and not inst.index.has_prefix("model.")


def test_bad_shape_is_refused_by_name(tmp_path):
    src = tmp_path / "hf"
    model = make_checkpoint(src, 4)
    tensors = mtp_tensors(model.config, 4)
    tensors["mtp.fc.weight"] = tensors["mtp.fc.weight"][:, :model.config.hidden_size].contiguous()
    add_mtp(src, tensors)
    runtime = turbo.open(repack(src, tmp_path / "out", quiet=True), backend="cpu")
    with pytest.raises(TurboError, match=r"^mtp\.fc\.weight has shape \[64, 64\], expected \[64, 128\]"):
        runtime.generate([1, 2, 3], max_new_tokens=2, policy="fixed", block=2, drafter="mtp")


# ---- the forward, written again from the definition (vLLM's convention) ------------------


def _norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def _rope(x, pos, rot, theta):
    inv = 1.0 / theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    f = (pos[:, None].double() * inv[None]).to(x.dtype)
    cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
    xr, xp = x[..., :rot], x[..., rot:]
    rotated = torch.cat([-xr[..., rot // 2:], xr[..., :rot // 2]], -1)
    return torch.cat([xr * cos + rotated * sin, xp], -1)


def hand_mtp(t, cfg, embed, lm_head, hidden, tokens, positions, dtype=torch.float64):
    """Rows (normed trunk hidden, next token) at `positions`, causal among themselves:
    returns (mtp.norm output, logits), in `dtype`."""
    t = {k: v.to(dtype) for k, v in t.items()}
    embed, lm_head, hidden = embed.to(dtype), lm_head.to(dtype), hidden.to(dtype)
    eps, nh, nkv, hd = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    rot = int(hd * cfg.rope_parameters.get("partial_rotary_factor", 0.25))
    theta = cfg.rope_parameters["rope_theta"]
    p = "mtp.layers.0."
    e = _norm(embed[tokens], t["mtp.pre_fc_norm_embedding.weight"], eps)
    x = torch.cat([e, _norm(hidden, t["mtp.pre_fc_norm_hidden.weight"], eps)], -1) @ t["mtp.fc.weight"].T
    n = x.shape[0]
    h = _norm(x, t[p + "input_layernorm.weight"], eps)
    qg = (h @ t[p + "self_attn.q_proj.weight"].T).view(n, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(n, -1)
    k = (h @ t[p + "self_attn.k_proj.weight"].T).view(n, nkv, hd)
    v = (h @ t[p + "self_attn.v_proj.weight"].T).view(n, nkv, hd)
    q = _rope(_norm(q, t[p + "self_attn.q_norm.weight"], eps), positions, rot, theta)
    k = _rope(_norm(k, t[p + "self_attn.k_norm.weight"], eps), positions, rot, theta)
    rep = nh // nkv
    att = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(rep, 0),
                                         v.transpose(0, 1).repeat_interleave(rep, 0), is_causal=True)
    x = x + (att.transpose(0, 1).reshape(n, -1) * torch.sigmoid(gate)) @ t[p + "self_attn.o_proj.weight"].T
    h = _norm(x, t[p + "post_attention_layernorm.weight"], eps)
    x = x + (F.silu(h @ t[p + "mlp.gate_proj.weight"].T) * (h @ t[p + "mlp.up_proj.weight"].T)) @ \
        t[p + "mlp.down_proj.weight"].T
    out = _norm(x, t["mtp.norm.weight"], eps)
    return out, out @ lm_head.T


def test_proposals_equal_a_hand_computed_forward(mtp_install):
    """Draft step 1 pairs the trunk's normed hidden at a-1 with embed(anchor) at RoPE
    position a-1; step 2 feeds step 1's normed output back with d_1 at position a.
    (fp32 products: the function itself, not a drafter-only approximation of it.)"""
    model, tensors, path = mtp_install
    rt = turbo.open(path, backend="cpu", draft_products="fp32")
    cfg = model.config
    ids = PROMPTS[0]
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([ids[:-1]])).last_hidden_state[0]  # after the final norm
    embed, lm_head = model.model.embed_tokens.weight.detach(), model.lm_head.weight.detach()
    n = len(ids) - 1  # rows 0..n-1 pair hidden p with token p+1; row n-1 is (h_{a-1}, anchor)
    out, logits = hand_mtp(tensors, cfg, embed, lm_head, hidden, torch.tensor(ids[1:]), torch.arange(n))
    d1 = int(logits[-1].argmax())
    out2, logits2 = hand_mtp(tensors, cfg, embed, lm_head, torch.cat([hidden, out[-1:].float()]),
                             torch.tensor(ids[1:] + [d1]), torch.arange(n + 1))
    d2 = int(logits2[-1].argmax())

    draft = rt.drafter("mtp", None)
    st = rt.trunk.new_state(64)
    draft.begin(rt.trunk.prefill(st, ids[:-1]), ids)
    assert draft.propose(ids[-1], st.pos, 2) == [d1, d2]
    # the step-1 logits themselves, not just their argmax
    ours = torch.log_softmax(draft.step_row(draft.last_x, st.pos - 1)[1][0].double(), -1)
    assert torch.allclose(ours, torch.log_softmax(logits[-1], -1), atol=1e-4)

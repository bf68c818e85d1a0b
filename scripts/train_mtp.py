#!/usr/bin/env python
"""Train the MTP head (docs/DESIGN.md 2.3) of the embedded tiny model and export it.

The head learns to predict the trunk's own greedy tokens, one and two positions ahead,
with the input convention the runtime uses (turbo/drafters/mtp.py, after vLLM's
qwen3_next_mtp.py + v1/spec_decode/eagle.py): row p reads the trunk's hidden state at p
AFTER the final norm and the embedding of token p+1 (fc input [embedding | hidden]),
rotates at position p, and predicts the trunk's greedy token at p+2.

* Data: the trunk's greedy continuations (`<work>/cont_<w>_train.pt` from
  `train_tiny.py --stage continuations` when present, else generated here from the
  training token streams) plus plain corpus windows. Targets are the trunk's own
  distributions (soft cross-entropy against softmax(lm_head(h))), read off the same
  forward, so every position of every sequence is a training row.
* Step 1 (teacher-forced, causal over the sequence) and step 2 of the chain (the head's
  own normed output fed back with the trunk's greedy token, attending to step-1 K/V
  at positions <= r and its own), the way a draft round chains it; step 2 only where the
  greedy token is the text's next token (always inside a continuation).
* Init: the layer is a copy of the trunk's last full-attention layer, `norm` of its final
  norm; fc = [small random | identity].
* Export: `<out>` = a copy of the trunk checkpoint with its weights as shard 1 and the
  head's `mtp.*` tensors (bf16) as shard 2, and a model.safetensors.index.json covering
  both, so `python -m turbo.repack <out> INSTALL [--drafter build/tiny_dflash]` keeps them.
* Measure: repack into a temporary install and run the turbo runtime (drafter=mtp) over
  the held-out workload prompts (conf/workload/*.yaml): accepted per round per block.

    nice -n 10 python scripts/train_mtp.py --minutes 15            # train + export + measure
    nice -n 10 python scripts/train_mtp.py --stage export          # from the checkpoint
    nice -n 10 python scripts/train_mtp.py --stage measure
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ("prose", "code", "math")


# ---- the head (HF / vLLM parameter names) ------------------------------------------------


class ZeroNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * (1 + w): the trunk's zero-centred RMSNorm."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)


def rope(x, cos, sin, rot):
    xr, xp = x[..., :rot], x[..., rot:]
    rotated = torch.cat([-xr[..., rot // 2:], xr[..., :rot // 2]], -1)
    return torch.cat([xr * cos + rotated * sin, xp], -1)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h, self.nh, self.nkv, self.hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(h, 2 * self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=False)
        self.q_norm = ZeroNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = ZeroNorm(self.hd, cfg.rms_norm_eps)

    def project(self, x, cos, sin, rot):
        """x [B, T, H] -> q [B, nh, T, d], k, v [B, nkv, T, d], gate [B, T, nh*d]."""
        b, t, _ = x.shape
        qg = self.q_proj(x).view(b, t, self.nh, 2 * self.hd)
        q, gate = qg[..., :self.hd], qg[..., self.hd:].reshape(b, t, -1)
        k = self.k_proj(x).view(b, t, self.nkv, self.hd)
        v = self.v_proj(x).view(b, t, self.nkv, self.hd)
        q = rope(self.q_norm(q), cos, sin, rot).transpose(1, 2)
        k = rope(self.k_norm(k), cos, sin, rot).transpose(1, 2)
        return q, k, v.transpose(1, 2), gate

    def attend(self, q, k, v, gate, mask=None, causal=False):
        rep = self.nh // self.nkv
        att = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                             attn_mask=mask, is_causal=causal)
        b, _, t, _ = att.shape
        return self.o_proj(att.transpose(1, 2).reshape(b, t, -1) * torch.sigmoid(gate))


class Mlp(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = ZeroNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.mlp = Mlp(cfg)


class MtpHead(nn.Module):
    def __init__(self, cfg, embed: torch.Tensor, lm_head: torch.Tensor):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.pre_fc_norm_embedding = ZeroNorm(h, eps)
        self.pre_fc_norm_hidden = ZeroNorm(h, eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([Layer(cfg)])
        self.norm = ZeroNorm(h, eps)
        self.register_buffer("embed", embed, persistent=False)
        self.register_buffer("lm_head", lm_head, persistent=False)
        rp = cfg.rope_parameters
        self.rot = int(cfg.head_dim * rp.get("partial_rotary_factor", 0.25))
        self.register_buffer("inv_freq", 1.0 / rp["rope_theta"] ** (torch.arange(0, self.rot, 2).float() / self.rot),
                             persistent=False)

    def cos_sin(self, positions):
        f = positions.float()[:, None] * self.inv_freq[None]
        e = torch.cat([f, f], -1)
        return e.cos()[:, None], e.sin()[:, None]  # [T, 1, rot]: broadcast over heads

    def fuse(self, hidden, tokens):
        return self.fc(torch.cat([self.pre_fc_norm_embedding(self.embed[tokens]), self.pre_fc_norm_hidden(hidden)], -1))

    def finish(self, x, y):
        layer = self.layers[0]
        x = x + y
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        out = self.norm(x)
        return out, out @ self.lm_head.T

    def forward(self, hidden, ids, greedy):
        """hidden [B, T, H] (the trunk's, after its final norm), ids [B, T], greedy [B, T]
        (the trunk's argmax at each position: its token for p+1). Returns step-1 logits
        [B, T-1, V] (row p predicts the greedy token at p+2) and step-2 logits [B, T-2, V]
        (row r at position r+1, fed step 1's output at r and greedy[r+1], predicts p+3)."""
        layer = self.layers[0]
        attn = layer.self_attn
        t = ids.shape[1]
        n1, n2 = t - 1, t - 2
        x1 = self.fuse(hidden[:, :n1], ids[:, 1:])
        cos, sin = self.cos_sin(torch.arange(n1))
        q1, k1, v1, g1 = attn.project(layer.input_layernorm(x1), cos, sin, self.rot)
        out1, logits1 = self.finish(x1, attn.attend(q1, k1, v1, g1, causal=True))
        x2 = self.fuse(out1[:, :n2], greedy[:, 1:n1])
        cos, sin = self.cos_sin(torch.arange(1, n2 + 1))
        q2, k2, v2, g2 = attn.project(layer.input_layernorm(x2), cos, sin, self.rot)
        mask = torch.cat([torch.ones(n2, n1, dtype=torch.bool).tril(), torch.eye(n2, dtype=torch.bool)], 1)
        _, logits2 = self.finish(x2, attn.attend(q2, torch.cat([k1, k2], 2), torch.cat([v1, v2], 2), g2, mask=mask))
        return logits1, logits2

    def init_from_trunk(self, model, layer_id: int) -> None:
        src = model.model.layers[layer_id]
        with torch.no_grad():
            self.layers[0].load_state_dict({k: v for k, v in src.state_dict().items()}, strict=True)
            self.norm.weight.copy_(model.model.norm.weight)
            h = self.fc.weight.shape[0]
            self.fc.weight.zero_()
            self.fc.weight[:, :h].normal_(0, 0.02)
            self.fc.weight[:, h:].copy_(torch.eye(h))


# ---- data ----------------------------------------------------------------------------


def load_trunk(path: Path):
    from transformers import Qwen3_5ForCausalLM

    model = Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


@torch.no_grad()
def greedy_continue(model, prefix: torch.Tensor, n: int) -> torch.Tensor:
    out = model(input_ids=prefix, use_cache=True)
    past, tok, toks = out.past_key_values, out.logits[:, -1].argmax(-1), []
    for i in range(n):
        toks.append(tok)
        if i + 1 < n:
            out = model(input_ids=tok[:, None], past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1].argmax(-1)
    return torch.cat([prefix, torch.stack(toks, 1)], 1)


@torch.no_grad()
def trunk_hidden(model, ids: torch.Tensor, bs: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """The trunk's last hidden state after its final norm (fp16 [N, T, H]) and its greedy
    token at every position (the argmax of lm_head(h): its token for p+1)."""
    hidden, greedy = [], []
    for i in range(0, len(ids), bs):
        h = model.model(input_ids=ids[i:i + bs]).last_hidden_state
        hidden.append(h.half())
        greedy.append(model.lm_head(h).argmax(-1))
    return torch.cat(hidden), torch.cat(greedy)


def trunk_id(model) -> str:
    return f"{float(model.lm_head.weight.double().sum()):.6e}"


def have_trunk(path: Path) -> str | None:
    t = path.with_suffix(".trunk")
    return t.read_text() if t.exists() else None


def sequences(model, work: Path, split: str, n_cont: int, n_corpus: int, seed: int, log) -> dict:
    """Per workload: greedy continuations (the shipped ones when present) and corpus windows."""
    g = torch.Generator().manual_seed(seed + (0 if split == "train" else 99))
    data = {}
    for w in WORKLOADS:
        seqs = []
        cont = work / f"cont_{w}_{split}.pt"
        if n_cont and cont.exists():
            ids = torch.load(cont)["ids"].long()
            seqs.append(ids[torch.randperm(len(ids), generator=g)[:n_cont]])
        elif n_cont:  # generated here (and kept: <work>/mtp_cont_<w>_<split>.pt, for this trunk only)
            mine = work / f"mtp_cont_{w}_{split}.pt"
            have = torch.load(mine) if mine.exists() else None
            if have is None or len(have) < n_cont or have_trunk(mine) != trunk_id(model):
                s = torch.load(work / f"tokens_{w}_{split}.pt").long()
                offs = torch.randint(0, len(s) - 65, (n_cont,), generator=g).tolist()
                t0 = time.time()
                have = torch.cat([greedy_continue(model, torch.stack([s[o:o + 64] for o in offs[i:i + 64]]), 96)
                                  for i in range(0, n_cont, 64)])
                torch.save(have, mine)
                mine.with_suffix(".trunk").write_text(trunk_id(model))
                log(f"generated {n_cont} greedy continuations for {w}/{split} in {time.time() - t0:.0f}s")
            seqs.append(have[:n_cont])
        if n_corpus:
            s = torch.load(work / f"tokens_{w}_{split}.pt").long()
            offs = torch.randint(0, len(s) - 161, (n_corpus,), generator=g).tolist()
            seqs.append(torch.stack([s[o:o + 160] for o in offs]))
        ids = torch.cat(seqs)
        t0 = time.time()
        hidden, greedy = trunk_hidden(model, ids)
        data[w] = {"ids": ids, "hidden": hidden, "greedy": greedy}
        log(f"{w}/{split}: {len(ids)} sequences of {ids.shape[1]} ({time.time() - t0:.0f}s of trunk forward)")
    return data


def losses(head: MtpHead, ids, hidden, greedy, step2_weight: float):
    """Cross-entropy against the trunk's greedy tokens: step-1 row p -> greedy[p+1] (its
    token for p+2); step-2 row r -> greedy[r+2], where the fed token greedy[r+1] is the
    text's own token r+2 (so the trunk's prediction there is the one a draft round meets)."""
    logits1, logits2 = head(hidden.float(), ids, greedy)
    t1 = greedy[:, 1:]
    l1 = F.cross_entropy(logits1.flatten(0, 1), t1.flatten())
    ok = ids[:, 2:] == greedy[:, 1:-1]
    ce2 = F.cross_entropy(logits2.flatten(0, 1), greedy[:, 2:].flatten(), reduction="none").view_as(ok)
    l2 = (ce2 * ok).sum() / ok.sum().clamp(min=1)
    hit1 = logits1.argmax(-1) == t1
    hit2 = logits2.argmax(-1) == greedy[:, 2:]
    # acceptance-style: P(step 2 right | step 1 right), over rows where the chain is the text's
    both = hit1[:, :-1] & ok
    acc2 = (hit2 & both).float().sum() / both.sum().clamp(min=1)
    return l1 + step2_weight * l2, {"l1": l1.item(), "l2": l2.item(), "acc1": hit1.float().mean().item(),
                                    "acc2": acc2.item()}


@torch.no_grad()
def evaluate(head: MtpHead, data: dict) -> dict:
    head.eval()
    res = {}
    for w, d in data.items():
        parts = [losses(head, d["ids"][i:i + 16], d["hidden"][i:i + 16], d["greedy"][i:i + 16], 0.5)[1]
                 for i in range(0, len(d["ids"]), 16)]
        res[w] = {k: round(sum(p[k] for p in parts) / len(parts), 4) for k in ("l1", "acc1", "acc2")}
    head.train()
    return res


# ---- stages ----------------------------------------------------------------------------


def train(args, log) -> None:
    torch.manual_seed(args.seed)
    model = load_trunk(args.trunk)
    cfg = model.config
    full = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
    embed = model.model.embed_tokens.weight.detach().clone()
    head = MtpHead(cfg, embed, model.lm_head.weight.detach().clone())
    head.init_from_trunk(model, full[-1])
    ckpt = args.work / "mtp_ckpt.pt"
    step, elapsed = 0, 0.0
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    if args.resume and ckpt.exists():
        ck = torch.load(ckpt, weights_only=False)
        head.load_state_dict(ck["head"])
        opt.load_state_dict(ck["opt"])
        step, elapsed = ck["step"], ck["elapsed"]
        log(f"resumed at step {step} ({elapsed / 60:.1f} min)")
    t_data = time.time()
    train_data = sequences(model, args.work, "train", args.cont, args.corpus, args.seed, log)
    eval_data = sequences(model, args.work, "eval", args.eval_cont, 0, args.seed, log)
    log(f"data ready in {time.time() - t_data:.0f}s")
    del model
    log(f"eval at init: {json.dumps(evaluate(head, eval_data))}")
    budget = args.minutes * 60
    start = time.time() - elapsed
    last_ckpt = last_eval = time.time()
    g = torch.Generator().manual_seed(args.seed + step)
    ema = None
    while time.time() - start < budget:
        progress = (time.time() - start) / budget
        warm = min(1.0, (step + 1) / 50)
        lr = args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for grp in opt.param_groups:
            grp["lr"] = lr
        d = train_data[WORKLOADS[step % len(WORKLOADS)]]
        idx = torch.randint(0, len(d["ids"]), (args.batch,), generator=g)
        loss, parts = losses(head, d["ids"][idx], d["hidden"][idx], d["greedy"][idx], args.step2_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        step += 1
        ema = parts if ema is None else {k: 0.97 * ema[k] + 0.03 * v for k, v in parts.items()}
        if step % 25 == 0:
            log(f"step {step} {(time.time() - start) / 60:.1f} min lr {lr:.2e} "
                + " ".join(f"{k} {v:.3f}" for k, v in ema.items()))
        if time.time() - last_eval > args.eval_minutes * 60:
            last_eval = time.time()
            log(f"eval step {step}: {json.dumps(evaluate(head, eval_data))}")
        if time.time() - last_ckpt > 120:
            last_ckpt = time.time()
            torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": step,
                        "elapsed": time.time() - start}, ckpt)
    torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": step, "elapsed": time.time() - start}, ckpt)
    log(f"final step {step}: eval {json.dumps(evaluate(head, eval_data))}")


def export(args, log) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, out = args.trunk, args.out
    ck = torch.load(args.work / "mtp_ckpt.pt", weights_only=False)
    tensors = {"mtp." + k: v.detach().to(torch.bfloat16).contiguous() for k, v in ck["head"].items()}
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    index = src / "model.safetensors.index.json"
    for f in src.iterdir():
        if f.is_file() and f.name != index.name:
            shutil.copyfile(f, tmp / f.name)
    if index.exists():  # already sharded: keep its shards, add one
        weight_map = json.loads(index.read_text())["weight_map"]
    else:
        (tmp / "model.safetensors").rename(tmp / "model-00001-of-00002.safetensors")
        with safe_open(str(tmp / "model-00001-of-00002.safetensors"), "pt") as f:
            weight_map = {n: "model-00001-of-00002.safetensors" for n in f.keys()}
    shard = "model-00002-of-00002.safetensors" if not index.exists() else "model-mtp.safetensors"
    save_file(tensors, str(tmp / shard), metadata={"format": "pt"})
    weight_map |= {n: shard for n in tensors}
    total = sum((tmp / f).stat().st_size for f in set(weight_map.values()))
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    tmp.chmod(0o755)
    (tmp / shard).chmod(0o644)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    log(f"exported {out}: {len(tensors)} mtp.* tensors, {sum(t.numel() for t in tensors.values())} parameters")


def workload_prompts(w: str) -> list[str]:
    from omegaconf import OmegaConf

    return list(OmegaConf.load(ROOT / "conf" / "workload" / f"{w}.yaml").prompts)


def measure(args, log) -> dict:
    """Repack the export and run the runtime's MTP drafter over the held-out prompts."""
    sys.path.insert(0, str(ROOT))
    import turbo
    from turbo.repack import repack

    with tempfile.TemporaryDirectory() as d:
        rt = turbo.open(repack(args.out, Path(d) / "install", quiet=True), backend="cpu")
        res = {}
        for w in WORKLOADS:
            prompts = workload_prompts(w)[:args.measure_prompts]
            ref = [rt.generate(p, max_new_tokens=args.measure_tokens, policy="off") for p in prompts]
            for block in args.measure_blocks:
                acc = rounds = drafted = 0
                for p, r in zip(prompts, ref):
                    g = rt.generate(p, max_new_tokens=args.measure_tokens, policy="fixed", block=block, drafter="mtp")
                    assert g.tokens == r.tokens, f"not lossless: {w} block {block}"
                    acc, rounds, drafted = acc + g.stats.accepted, rounds + g.stats.rounds, drafted + g.stats.drafted
                res[f"{w}/b{block}"] = {"accepted_per_round": round(acc / rounds, 3),
                                        "mean_acceptance_length": round(1 + acc / rounds, 3),
                                        "acceptance_rate": round(acc / drafted, 3)}
                log(f"measure {w} block {block}: {json.dumps(res[f'{w}/b{block}'])}")
    (args.work / "mtp_measure.json").write_text(json.dumps(res, indent=2) + "\n")
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stage", default="all", choices=("all", "train", "export", "measure"))
    ap.add_argument("--trunk", type=Path, default=ROOT / "build" / "tiny_hf")
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "tiny_work")
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "tiny_hf_mtp")
    ap.add_argument("--minutes", type=float, default=15.0)
    ap.add_argument("--cont", type=int, default=400, help="greedy continuations per workload (train)")
    ap.add_argument("--corpus", type=int, default=200, help="plain corpus windows per workload (train)")
    ap.add_argument("--eval-cont", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--step2-weight", type=float, default=0.5)
    ap.add_argument("--eval-minutes", type=float, default=5.0)
    ap.add_argument("--threads", type=int, default=1, help="1: extra threads only spin on a shared machine")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--measure-prompts", type=int, default=4)
    ap.add_argument("--measure-tokens", type=int, default=64)
    ap.add_argument("--measure-blocks", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    log_path = args.work / "mtp_train.log"

    def log(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S', time.gmtime())}] {msg}"
        print(line, flush=True)
        with log_path.open("a") as f:
            f.write(line + "\n")

    if not (args.trunk / "config.json").exists():
        sys.exit(f"error: {args.trunk}: no trunk checkpoint yet (train_tiny.py --stage trunk writes it)")
    if args.stage in ("all", "train"):
        train(args, log)
    if args.stage in ("all", "export"):
        export(args, log)
    if args.stage in ("all", "measure"):
        measure(args, log)


if __name__ == "__main__":
    main()

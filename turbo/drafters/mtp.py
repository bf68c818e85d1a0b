"""The MTP head as a drafter (DESIGN 2.3): Qwen3.5's own multi-token-prediction layer.

Tensors (prefix `mtp.`, shapes derived from the trunk's arch): `pre_fc_norm_embedding`,
`pre_fc_norm_hidden`, `norm` [H]; `fc` [H, 2H]; `layers.0.*`, one full-attention decoder
layer shaped like the trunk's (gated q_proj, q_norm/k_norm, partial RoPE, GQA, SwiGLU).
The embedding and lm_head are the trunk's.

The input convention is vLLM's (`vllm/model_executor/models/qwen3_next_mtp.py`, driven by
`vllm/v1/spec_decode/eagle.py`):
- one row at position p reads the trunk's hidden state at p AFTER the trunk's final norm
  (vLLM's `Qwen3NextModel.forward` returns `norm(hidden)`, and that is what the proposer
  hands the MTP) and the embedding of the token at p+1, and predicts the token at p+2;
- `x = fc(concat([pre_fc_norm_embedding(embed(tok_{p+1})), pre_fc_norm_hidden(h_p)]))`,
  embedding first; the layer rotates at p (the hidden's position, not the token's);
- `out = norm(layer(x))`, logits = trunk lm_head(out); a chained step feeds `out` back as
  the next row's hidden, one position further, with the token it just proposed.

In this engine the anchor (the last committed token, at position a) has not been through
the trunk when a round is drafted, so draft step 1 is the row at a-1: (trunk hidden at
a-1, embed(anchor)) -> d_1 at a+1. Every cached position is built from committed data: a
trunk step's kept rows at a..a+k-1 are paired with the trunk's own greedy tokens after
them (accepted proposals equal those, and the last is the bonus: the next anchor), so the
cache is exactly the prefix [0, a+k) after each commit, rollbacks included. Draft steps
2..B (rows a..a+B-2, from the head's own outputs) write scratch K/V past the prefix, which
the next commit overwrites before anything reads it.
"""

from __future__ import annotations

import ctypes

import torch

from .. import ops
from ..backends import native
from ..errors import TurboError
from ..install import Install
from . import DrafterBase
from ..trunk import AttnWeights, LayerWeights, Trunk, native_layer, pack_layer

MTP_PREFIX = "mtp."


def mtp_tensor_shapes(arch) -> dict[str, tuple[int, ...]]:
    """Every tensor the head needs, with the shape the trunk's arch implies."""
    h, hd, nh, nkv, inter = arch.hidden, arch.head_dim, arch.num_heads, arch.num_kv_heads, arch.intermediate
    layer = MTP_PREFIX + "layers.0."
    return {
        MTP_PREFIX + "fc.weight": (h, 2 * h),
        MTP_PREFIX + "pre_fc_norm_embedding.weight": (h,),
        MTP_PREFIX + "pre_fc_norm_hidden.weight": (h,),
        MTP_PREFIX + "norm.weight": (h,),
        layer + "input_layernorm.weight": (h,),
        layer + "post_attention_layernorm.weight": (h,),
        layer + "self_attn.q_proj.weight": (2 * nh * hd, h),
        layer + "self_attn.k_proj.weight": (nkv * hd, h),
        layer + "self_attn.v_proj.weight": (nkv * hd, h),
        layer + "self_attn.o_proj.weight": (h, nh * hd),
        layer + "self_attn.q_norm.weight": (hd,),
        layer + "self_attn.k_norm.weight": (hd,),
        layer + "mlp.gate_proj.weight": (inter, h),
        layer + "mlp.up_proj.weight": (inter, h),
        layer + "mlp.down_proj.weight": (h, inter),
    }


class MtpDrafter(DrafterBase):
    """Chained drafting with the MTP layer and its own KV cache (positions [start, filled)).
    `products`: the layer's matrix products on the native step (native.draft_layout; the
    lm_head is the trunk's own, fp32)."""

    kind = "mtp"
    aux_layers: tuple[int, ...] = ()  # reads only the last layer's output (StepOut.hidden)
    window = None

    def __init__(self, install: Install, trunk: Trunk, products: str = "auto"):
        if not install.has_mtp:
            raise TurboError(f"{install.path}: this install carries no MTP head (mtp.fc.weight is not in the "
                             "resident index)")
        index, arch = install.index, install.arch
        if MTP_PREFIX + "layers.1.input_layernorm.weight" in index:
            raise TurboError("mtp.layers.1.input_layernorm.weight: this head has more than one MTP layer, and this "
                             "port runs exactly one (num_nextn_predict_layers 1, as Qwen3.5 ships)")
        shapes = mtp_tensor_shapes(arch)
        for name, shape in shapes.items():
            dims = index.need(name).dims
            if tuple(dims) != shape:
                raise TurboError(f"{name} has shape {list(dims)}, expected {list(shape)} (from the trunk's config)")
        self.trunk, self.arch = trunk, arch
        self.eps = arch.rms_eps
        dtype = trunk.dtype
        self.device = dev = trunk.device  # the trunk's: weights moved once at load, the cache there too

        stored: set[str] = set()

        def w(name: str) -> torch.Tensor:
            stored.add(index.need(MTP_PREFIX + name).st_dtype)
            t = index.load(MTP_PREFIX + name, dtype)
            return t if dev.type == "cpu" else t.to(dev)

        def norm(name: str) -> torch.Tensor:
            t = 1.0 + index.load(MTP_PREFIX + name, torch.float32)  # computed on the host, as on the CPU
            return t if dev.type == "cpu" else t.to(dev)

        self.fc = w("fc.weight")
        self.norm_embedding = norm("pre_fc_norm_embedding.weight")
        self.norm_hidden = norm("pre_fc_norm_hidden.weight")
        self.final_norm = norm("norm.weight")
        p = "layers.0."
        a = p + "self_attn."
        self.layer = LayerWeights(
            linear=False,
            in_norm=norm(p + "input_layernorm.weight"),
            post_norm=norm(p + "post_attention_layernorm.weight"),
            mixer=AttnWeights(qkv=torch.cat([w(a + "q_proj.weight"), w(a + "k_proj.weight"), w(a + "v_proj.weight")]),
                              o=w(a + "o_proj.weight"), q_norm=norm(a + "q_norm.weight"),
                              k_norm=norm(a + "k_norm.weight")),
            gate_up=torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]),
            down=w(p + "mlp.down_proj.weight"),
        )
        # on the trunk's native step, so is the head's layer (native.c's attn_layer + head)
        self.native = None
        if trunk.native is not None:
            storage = native.storage_dtype(dtype, stored)  # as the trunk's
            layout = native.draft_layout(products)
            pack_layer(self.layer, storage, layout)
            self.fc = native.pack_as(self.fc, storage, layout)
            self.native = native_layer(arch, self.layer, trunk.inv_freq)
        elif products not in ("auto", "fp32"):
            why = native.why_not() or f"the trunk runs on {dev.type}"
            raise TurboError(f"draft_products {products}: the MTP head runs on the native CPU step, not in use "
                             f"({why}); expected auto or fp32")
        self.reset()

    # ---- state -------------------------------------------------------------------------

    def reset(self, capacity: int = 256) -> None:
        a = self.arch
        self.k = torch.zeros(a.num_kv_heads, capacity, a.head_dim, device=self.device)
        self.v = torch.zeros(a.num_kv_heads, capacity, a.head_dim, device=self.device)
        self.start = 0  # first cached position (later than 0 only when begin had no prompt tokens)
        self.filled = 0  # cached positions are [start, filled): every one from committed data
        self.last_x: torch.Tensor | None = None  # layer input of row filled-1 (the next draft's first step)
        self.last_token: int | None = None  # the token row filled-1 was paired with: the next anchor

    def _reserve(self, end: int) -> None:
        cap = self.k.shape[1]
        if end > cap:
            cap = max(end, 2 * cap)
            k, v = self.k.new_zeros(self.k.shape[0], cap, self.k.shape[2]), self.v.new_zeros(self.v.shape[0], cap,
                                                                                                   self.v.shape[2])
            old = self.k.shape[1]  # scratch rows past `filled` may be live within a propose: copy all
            k[:, :old], v[:, :old] = self.k, self.v
            self.k, self.v = k, v

    # ---- the math ----------------------------------------------------------------------

    def trunk_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """StepOut.hidden (before the final norm) -> what the head reads: after it."""
        return ops.rms_norm(hidden, self.trunk.final_norm, self.eps)

    def fuse(self, hidden: torch.Tensor, tokens: list[int]) -> torch.Tensor:
        """Rows' layer input: fc([norm_e(embed(token)) | norm_h(hidden)]); hidden [R, H] already normed."""
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        e = ops.rms_norm(self.trunk.embed[ids].float(), self.norm_embedding, self.eps)
        h = ops.rms_norm(hidden, self.norm_hidden, self.eps)
        return ops.linear(torch.cat([e, h], dim=-1), self.fc)

    def _layer_native(self, x: torch.Tensor, p0: int) -> torch.Tensor:
        """Rows x at p0.. through the layer in native.c (K/V written, attending from start)."""
        self._reserve(p0 + x.shape[0])
        y = x.float().contiguous().clone()
        native.threaded().attn_layer(ctypes.addressof(self.native), y.data_ptr(), y.shape[0], p0, self.start,
                                     self.k.data_ptr(), self.v.data_ptr(), self.k.shape[1])
        return y

    def _write_kv(self, x: torch.Tensor, p0: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's q and gate for rows at p0.., with their K/V written into the cache."""
        rows = x.shape[0]
        self._reserve(p0 + rows)
        h = ops.rms_norm(x, self.layer.in_norm, self.eps)
        q, k, v, gate = self.trunk._qkv(self.layer.mixer, h, torch.arange(p0, p0 + rows, device=self.device))
        self.k[:, p0:p0 + rows], self.v[:, p0:p0 + rows] = k.transpose(0, 1), v.transpose(0, 1)
        return q, gate

    def step_row(self, x: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One row through the layer at `pos`, attending to cached [start, pos] (its own K/V
        written at pos). Returns (out = norm(layer output) [1, H], logits [1, vocab])."""
        a = self.arch
        if self.native is not None:
            y = self._layer_native(x, pos)
            out, logits = torch.empty(1, a.hidden), torch.empty(1, a.vocab)
            lm = self.trunk.lm_head
            native.threaded().head(y.data_ptr(), 1, a.hidden, self.final_norm.data_ptr(), self.eps, native.ptr(lm),
                                   lm.wtype, a.vocab, logits.data_ptr(), out.data_ptr())
            return out, logits
        q, gate = self._write_kv(x, pos)
        groups = a.num_heads // a.num_kv_heads
        qr = q[0].reshape(a.num_kv_heads, groups, a.head_dim)
        keys, values = self.k[:, self.start:pos + 1], self.v[:, self.start:pos + 1]
        scores = torch.bmm(qr, keys.transpose(1, 2)) * a.head_dim ** -0.5
        att = torch.bmm(torch.softmax(scores, dim=-1), values).reshape(1, -1)
        x = x + ops.linear(att * ops.sigmoid(gate), self.layer.mixer.o)
        x = x + self.trunk._mlp(self.layer, ops.rms_norm(x, self.layer.post_norm, self.eps))
        out = ops.rms_norm(x, self.final_norm, self.eps)
        return out, ops.linear(out, self.trunk.lm_head)

    # ---- the engine's hooks ------------------------------------------------------------

    def _append(self, hidden: torch.Tensor, tokens: list[int]) -> None:
        """Committed positions filled.. : their trunk hidden (before the final norm) and the
        token after each. Their K/V go into the cache; the last row's input is kept for the
        next draft's first step."""
        x = self.fuse(self.trunk_hidden(hidden), tokens)
        if self.native is not None:
            self._layer_native(x, self.filled)
        else:
            self._write_kv(x, self.filled)
        self.filled += len(tokens)
        self.last_x, self.last_token = x[-1:], tokens[-1]

    def begin(self, prompt_out, tokens: list[int] | None = None) -> None:
        """prompt_out: the trunk's prefill over the prompt minus its last token (or None);
        tokens: the prompt ids (the token after position p is tokens[p+1]). Without them the
        prompt's positions cannot be paired, and the first round is a plain step."""
        n = 0 if prompt_out is None else prompt_out.hidden.shape[0]
        self.reset(capacity=n + 256)
        if n == 0:
            return
        if tokens is None or len(tokens) < n + 1:
            self.start = self.filled = n
            return
        self._append(prompt_out.hidden, list(tokens[1:n + 1]))

    def propose(self, anchor: int, anchor_pos: int, block: int) -> list[int]:
        if anchor_pos != self.filled:
            raise ValueError(f"MTP cache holds positions up to {self.filled}, the anchor sits at {anchor_pos}")
        if self.last_x is None:
            # No position before the anchor has been paired (a one-token prompt): there is no
            # hidden state to read, so this round is a plain step.
            return []
        if anchor != self.last_token:
            raise ValueError(f"the anchor {anchor} is not the token {self.last_token} the committed rows ended with")
        # Step 1 re-runs row a-1 (committed data: its K/V are rewritten unchanged) for its
        # output; steps 2.. are rows a.. built from the head's own outputs: scratch K/V that
        # the next commit overwrites before anything reads them.
        x, proposals = self.last_x, []
        for i in range(block):
            out, logits = self.step_row(x, anchor_pos - 1 + i)
            token = int(logits[0].argmax())
            proposals.append(token)
            if i + 1 < block:
                x = self.fuse(out, [token])
        return proposals

    def commit(self, out, kept: int) -> None:
        """out: a trunk step over rows [anchor, d_1..] at positions filled..; its first `kept`
        rows are committed. The token after kept row j is the trunk's greedy token t_j (an
        accepted proposal equals it, and t_{kept-1} is the bonus, the next anchor), so this
        needs nothing from `propose` and follows plain rounds as well."""
        tokens = out.logits[:kept].argmax(dim=-1).tolist()
        self._append(out.hidden[:kept], tokens)

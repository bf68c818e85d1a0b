"""The CUDA step's kernels (kernels_ptx/step.cu, bgemv.cu's int4 rows product) through their own
CUDA C on the simulated device (turbo/testing/host_cuda.py), against the CPU native step where its
chain is the kernel's (bit for bit) or a plain reference (to fp32 tolerance), and batch
invariance: a row's bits do not depend on how many rows share the launch (a verify row equals
the decode step it stands for). DEVICE-UNVERIFIED: no GPU has run these kernels yet."""

from __future__ import annotations

import math
import numpy as np

import pytest
import torch

from turbo.backends import native_lib
from turbo.backends.cuda_step import kernels as sk
from turbo.store import quant

torch.set_num_threads(1)


@pytest.fixture
def host(host_device):
    """The kernels' own C on the simulated device (tests/conftest.py)."""
    return host_device


def p(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


# ---- int4 rows product ------------------------------------------------------------------------


def int4_inputs(out, cols, group=64, seed=41):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out, cols), generator=gen)
    scales = (torch.rand(out, cols // group, generator=gen) * 0.05 + 1e-3).to(torch.bfloat16)
    biases = (-8 * scales.float()).to(torch.bfloat16)
    return quant.pack(q, 4), scales, biases


def int4_product(host, x, packed, scales, biases, group):
    y = torch.empty(x.shape[0], packed.shape[0])
    sk.rows_product(host, "int4", p(x), p(packed), p(y), x.shape[0], x.shape[1], packed.shape[0],
                    p(scales), p(biases), group)
    return y


@pytest.mark.parametrize("cols,group", [(320, 64), (96, 32), (112, 16)])  # vector + odd chunks; group 32; scalar
def test_int4_rows_product_is_the_dequantized_product_and_batch_invariant(host, cols, group):
    packed, scales, biases = int4_inputs(13, cols, group, seed=cols)  # 13 outputs: a partial block
    gen = torch.Generator().manual_seed(cols)
    x = torch.randn(17, cols, generator=gen) * torch.logspace(-2, 2, cols)  # cancellation: order shows
    w = quant.dequantize(packed, scales, biases, 4, group).float()
    alone = torch.cat([int4_product(host, x[r:r + 1], packed, scales, biases, group) for r in range(17)])
    torch.testing.assert_close(alone, (x.double() @ w.double().T).float(), rtol=1e-4, atol=1e-3)
    for rows in (3, 6, 16, 17):  # every pass size (r4, r8, r16, two r16 passes)
        assert torch.equal(int4_product(host, x[:rows], packed, scales, biases, group), alone[:rows]), rows
    assert host.launches[-1] == "int4_rows_gemv_r16_f32"


# ---- add + RMSNorm, SiLU-mul, embedding ---------------------------------------------------------


def native_or_skip():
    lib = native_lib.library()
    if lib is None:
        pytest.skip(f"native step unavailable: {native_lib.why_not()}")
    return lib


def chained_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """native.h rms_norm as the library computes it: the squares summed in one chain in element
    order, each product rounded before its add (its bits; fp32 scalars throughout)."""
    out = torch.empty_like(x)
    n, e = np.float32(x.shape[1]), np.float32(eps)
    for r in range(x.shape[0]):
        xs, ss = x[r].numpy(), np.float32(0)
        for v in xs:
            ss = np.float32(ss + np.float32(v * v))
        inv = np.float32(1) / np.float32(math.sqrt(np.float32(ss / n + e)))  # (a correctly rounded sqrtf)
        out[r] = torch.from_numpy(xs * inv * w.numpy())
    return out


def test_add_rms_norm_is_the_native_norm_bit_for_bit(host):
    """Bit for bit the native chain (and through it the native step: the GDN test below feeds
    these rows to the native product and gets the native step's states exactly)."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, 300, generator=gen), torch.randn(5, 300, generator=gen)
    w = 1 + 0.1 * torch.randn(300, generator=gen)
    want_x = x + y
    want = chained_rms_norm(want_x, w, 1e-6)
    h = torch.empty(5, 300)
    sk.add_rms_norm(host, p(x), p(y), p(w), p(h), 5, 300, 1e-6)
    assert torch.equal(x, want_x) and torch.equal(h, want)
    one = torch.empty(1, 300)
    sk.add_rms_norm(host, p(x[3:4]), 0, p(w), p(one), 1, 300, 1e-6)
    assert torch.equal(one, h[3:4])


def test_silu_mul_and_embedding_rows(host):
    gen = torch.Generator().manual_seed(2)
    gu = torch.randn(3, 2 * 70, generator=gen) * 4
    act = torch.empty(3, 70)
    sk.silu_mul(host, p(gu), p(act), 3, 70)
    torch.testing.assert_close(act, torch.nn.functional.silu(gu[:, :70]) * gu[:, 70:], rtol=1e-6, atol=1e-6)
    table = torch.randn(50, 40, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([7, 0, 49, 7], dtype=torch.int32)
    x = torch.empty(4, 40)
    sk.embed_rows(host, p(table), p(ids), p(x), 4, 40)
    assert torch.equal(x, table[ids.long()].float())


# ---- the fused Gated DeltaNet tail ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_trunk():
    from turbo.load.loader import load_trunk
    from turbo.sequence.options import OpenOptions
    from turbo.store.install import open_install

    native_or_skip()
    return load_trunk(open_install("tiny"), OpenOptions(), "cpu")


def gdn_launch(host, t, layer, proj, state, window, rows, checkpoints=True):
    """gdn_step on proj [rows, P] from (state, window): (state after, window after, ext, states, out)."""
    a, m = t.arch, t.layers[layer].mixer
    C = a.lin_conv_dim
    new_state, new_window = torch.empty_like(state), torch.empty_like(window)
    ext = torch.empty(a.conv_kernel - 1 + rows, C)
    states = torch.empty(max(rows - 1, 1), *state.shape) if checkpoints else None
    out = torch.empty(rows, a.lin_v_heads * a.lin_v_dim)
    sk.gdn_step(host, p(proj), p(window), p(new_window), p(ext), p(m.conv), p(m.neg_a), p(m.dt_bias), p(m.norm),
                p(state), p(new_state), p(states) if rows > 1 else 0, p(out), rows, a.lin_k_heads, a.lin_k_dim,
                a.lin_v_heads, a.lin_v_dim, a.conv_kernel, a.rms_eps)
    return new_state, new_window, ext, states, out


def layer0_proj(host, t, tokens):
    """Layer 0's in_proj rows for `tokens` (the embedding, the in_norm by add_rms_norm, the
    native product on the trunk's packed in_proj: the native step's own bits)."""
    a, lib = t.arch, native_lib.library()
    x = t.embed[torch.tensor(tokens)].float().contiguous()
    h = torch.empty_like(x)
    sk.add_rms_norm(host, p(x), 0, p(t.layers[0].in_norm), p(h), len(tokens), a.hidden, a.rms_eps)
    w = t.layers[0].mixer.in_proj
    proj = torch.empty(len(tokens), w.n)
    lib.linear_packed(p(h), len(tokens), a.hidden, p(w.data), w.wtype, w.n, p(proj))
    return proj


def test_gdn_step_is_the_native_layers_state_bit_for_bit(host, tiny_trunk):
    """Three rows from a prefilled state: the state after them, every row's checkpoint, the conv
    window and ext equal the native step's (its trace and state) bit for bit; the outputs equal
    the native recurrence's outputs through the gated norm (fp32 tolerance: the native step
    does not hand its normed outputs out)."""
    t = tiny_trunk
    st = t.new_state(64)
    t.prefill(st, [5, 17, 99, 3, 250])
    state0, window0 = (x.clone() for x in st.gdn[0])
    tokens = [42, 7, 1000]
    res = t.step(st, tokens, (), "checkpoint")
    trace = res.traces[0]
    proj = layer0_proj(host, t, tokens)
    new_state, new_window, ext, states, out = gdn_launch(host, t, 0, proj, state0, window0, 3)
    assert torch.equal(ext, trace.ext)
    assert torch.equal(new_window, st.gdn[0][1])
    assert torch.equal(new_state, st.gdn[0][0])
    assert torch.equal(states[0], trace.states[0]) and torch.equal(states[1], trace.states[1])
    # the outputs: the native recurrence replayed from its inputs, then the gated norm in torch
    st2 = t.new_state(64)
    t.prefill(st2, [5, 17, 99, 3, 250])
    replay = t.step(st2, tokens, (), "replay").traces[0]
    a = t.arch
    q, k, v, g, beta = replay.inputs
    o = torch.empty(3, a.lin_v_heads, a.lin_v_dim)
    after = torch.empty_like(state0)  # (held: p() keeps no reference)
    native_lib.library().gdn_recurrence(p(state0), p(after), 3, a.lin_v_heads, a.lin_k_dim,
                                        a.lin_v_dim, p(q), p(k), p(v), p(g), p(beta), p(o), 0)
    m = t.layers[0].mixer
    C, vd = a.lin_conv_dim, a.lin_v_heads * a.lin_v_dim
    z = proj[:, C:C + vd].view(3, a.lin_v_heads, a.lin_v_dim)
    want = m.norm * (o * torch.rsqrt((o * o).mean(-1, keepdim=True) + a.rms_eps)) * torch.nn.functional.silu(z)
    torch.testing.assert_close(out.view_as(want), want, rtol=1e-5, atol=1e-6)


def test_gdn_step_rows_equal_decode_steps(host, tiny_trunk):
    """R rows in one launch equal R one-row launches, each from the last's state and window."""
    t = tiny_trunk
    a = t.arch
    tokens = [11, 2000, 5, 77, 300, 9, 4000, 1, 23, 56, 88, 90, 12, 13, 14, 15, 16]  # 17: past MAX_ROWS in two
    proj = layer0_proj(host, t, tokens)
    gen = torch.Generator().manual_seed(3)
    state0 = torch.randn(a.lin_v_heads, a.lin_k_dim, a.lin_v_dim, generator=gen) * 0.1
    window0 = torch.randn(a.conv_kernel - 1, a.lin_conv_dim, generator=gen)
    s, w, outs, ckpt = state0, window0, [], []
    for r in range(16):
        s, w, _, _, o = gdn_launch(host, t, 0, proj[r:r + 1], s, w, 1, checkpoints=False)
        outs.append(o), ckpt.append(s)
    for rows in (2, 9, 16):
        ns, nw, _, states, out = gdn_launch(host, t, 0, proj[:rows].contiguous(), state0, window0, rows)
        assert torch.equal(out, torch.cat(outs[:rows])), rows
        assert torch.equal(ns, ckpt[rows - 1]), rows
        assert all(torch.equal(states[r], ckpt[r]) for r in range(rows - 1)), rows
    # in place (state_in is state_out: each element read and written by one thread)
    s, m = state0.clone(), t.layers[0].mixer
    w_out, o4 = torch.empty_like(window0), torch.empty(4, a.lin_v_heads * a.lin_v_dim)  # (held: the launch writes them)
    sk.gdn_step(host, p(proj), p(window0), p(w_out), 0, p(m.conv), p(m.neg_a), p(m.dt_bias), p(m.norm), p(s), p(s), 0,
                p(o4), 4, a.lin_k_heads, a.lin_k_dim, a.lin_v_heads, a.lin_v_dim, a.conv_kernel, a.rms_eps)
    assert torch.equal(s, ckpt[3])


# ---- gated attention rows -----------------------------------------------------------------------


def rope_table(inv_freq: torch.Tensor, cap: int) -> torch.Tensor:
    """[cap, rot/2, 2]: cos, sin of every position and frequency (fp32, as native_attn.c's rope)."""
    f = torch.arange(cap, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.stack([torch.cos(f), torch.sin(f)], -1).contiguous()


def attn_reference(proj, kc, vc, q_norm, k_norm, cs, p0, nh, nkv, hd, rot, eps):
    """A plain transcription of gated attention (float64) over the cache's positions < p0 and the rows."""
    R = proj.shape[0]
    pr = proj.double()

    def norm_rope(x, w, pos):
        y = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w.double()
        c, s = cs[pos, :, 0].double(), cs[pos, :, 1].double()
        half = rot // 2
        a, b = y[..., :half].clone(), y[..., half:rot].clone()
        y[..., :half], y[..., half:rot] = a * c - b * s, b * c + a * s
        return y

    qg = pr[:, :2 * nh * hd].view(R, nh, 2, hd)
    kr = pr[:, 2 * nh * hd:2 * nh * hd + nkv * hd].view(R, nkv, hd)
    vr = pr[:, 2 * nh * hd + nkv * hd:].view(R, nkv, hd)
    K = torch.cat([kc[:, :p0].double(), torch.stack([norm_rope(kr[r], k_norm, p0 + r) for r in range(R)], 1)], 1)
    V = torch.cat([vc[:, :p0].double(), vr.transpose(0, 1)], 1)
    out = torch.empty(R, nh, hd, dtype=torch.float64)
    for r in range(R):
        for h in range(nh):
            q = norm_rope(qg[r, h, 0], q_norm, p0 + r)
            j = h // (nh // nkv)
            s = (K[j, :p0 + r + 1] @ q) / hd ** 0.5
            out[r, h] = torch.softmax(s, 0) @ V[j, :p0 + r + 1] * torch.sigmoid(qg[r, h, 1])
    return out.view(R, nh * hd).float(), K.float()


def attn_launch(host, proj, kc, vc, qn, kn, cs, p0, nh, nkv, hd, rot, eps):
    R, cap = proj.shape[0], kc.shape[1]
    att, scores = torch.empty(R, nh * hd), torch.empty(R, nh, cap)  # (held: p() keeps no reference)
    sk.attn_rows(host, p(proj), p(kc), p(vc), p(qn), p(kn), p(cs), p(scores), p(att), R, p0,
                 cap, nh, nkv, hd, rot, eps)
    return att


@pytest.mark.parametrize("nh,nkv,hd,rot", [(4, 2, 64, 16), (6, 2, 256, 64)])
def test_attn_rows_is_gated_attention_and_rows_equal_decode_steps(host, nh, nkv, hd, rot):
    gen = torch.Generator().manual_seed(hd)
    cap, p0, R, eps = 40, 11, 5, 1e-6
    P = 2 * nh * hd + 2 * nkv * hd
    proj = torch.randn(R, P, generator=gen)
    qn, kn = 1 + 0.1 * torch.randn(hd, generator=gen), 1 + 0.1 * torch.randn(hd, generator=gen)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    cs = rope_table(inv_freq, cap)
    kc0, vc0 = torch.randn(nkv, cap, hd, generator=gen), torch.randn(nkv, cap, hd, generator=gen)
    kc, vc = kc0.clone(), vc0.clone()
    att = attn_launch(host, proj, kc, vc, qn, kn, cs, p0, nh, nkv, hd, rot, eps)
    want, K = attn_reference(proj, kc0, vc0, qn, kn, cs, p0, nh, nkv, hd, rot, eps)
    torch.testing.assert_close(att, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(kc[:, :p0 + R], K, rtol=1e-5, atol=1e-5)
    assert torch.equal(vc[:, p0:p0 + R], proj[:, 2 * nh * hd + nkv * hd:].view(R, nkv, hd).transpose(0, 1))
    # one row at a time, each after the last wrote its K / V: the same bits
    kc1, vc1 = kc0.clone(), vc0.clone()
    one = torch.cat([attn_launch(host, proj[r:r + 1].contiguous(), kc1, vc1, qn, kn, cs, p0 + r, nh, nkv, hd, rot,
                                 eps) for r in range(R)])
    assert torch.equal(one, att) and torch.equal(kc1, kc) and torch.equal(vc1, vc)

#!/usr/bin/env python3
"""Writes tests/fixtures/kimi/kimi_tiny.bin: a tiny random transformers KimiLinearForCausalLM
(transformers 5.17), its weights under mtrl's tensor names and its logits, for
tests/test_kimi_forms.c. That test checks mtrl's Kimi layer forms (docs/model-forms.md)
against the reference implementation.

Run once, by hand, with torch and transformers installed:
    python3 tools/make_kimi_forms_fixture.py tests/fixtures/kimi/kimi_tiny.bin
CI has no Python, so the output file is committed.

The reference runs in float64. The script loads a copy of modeling_kimi_linear.py in which
every float32 cast is a float64 cast. The comparison can then be exact (about 1e-13) rather
than limited by fp32 rounding (about 1e-4 on these logits). Changing only the dtype of the
casts leaves the math of the module as it is.

Layout (little endian): int32 n; n times {char name[64]; int64 numel; float64 data[numel]};
float64 qb_beta[L][E] (= -e_score_correction_bias; dense layers' rows 0); int32 T;
int32 tokens[T]; float64 logits[2][T][V] (norm_topk_prob = true, then false).
"""
import struct
import sys
import types

import torch
import transformers.models.kimi_linear.modeling_kimi_linear as mk
from transformers import KimiLinearConfig

src = open(mk.__file__).read().replace("torch.float32", "torch.float64").replace(".float()", ".double()")
mod = types.ModuleType("kimi_linear_f64")
mod.__package__ = mk.__package__
mod.__file__ = mk.__file__
sys.modules[mod.__name__] = mod
exec(compile(src, mk.__file__, "exec"), mod.__dict__)
torch.set_default_dtype(torch.float64)
torch.manual_seed(0)

L, D, V, E, I, HD = 4, 16, 32, 4, 12, 16  # HD = linear heads (2) x linear head dim (8)


def config(renorm):
    return KimiLinearConfig(
        vocab_size=V, hidden_size=D, intermediate_size=24, moe_intermediate_size=I, num_hidden_layers=L,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=8,
        v_head_dim=8, q_lora_rank=None, n_shared_experts=1, num_local_experts=E, num_experts_per_tok=2,
        routed_scaling_factor=2.446, norm_topk_prob=renorm, n_group=1, topk_group=1, linear_head_dim=8,
        linear_num_heads=2, linear_conv_kernel_dim=4, rms_norm_eps=1e-5,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense", "dense", "sparse", "sparse"], tie_word_embeddings=False, pad_token_id=0,
        bos_token_id=1, eos_token_id=2)


m = mod.KimiLinearForCausalLM(config(True)).eval()
m.set_experts_implementation("eager")  # grouped_mm takes no float64
with torch.no_grad():
    for n, p in m.named_parameters():
        p.copy_(torch.randn_like(p) * (0.4 if p.dim() > 1 else 0.3) + (1.0 if "norm" in n else 0.0))
    for layer in m.model.layers:
        a = layer.self_attn
        if hasattr(a, "forget_gate"):  # head 0 decays fast: log-decays far below -11
            a.forget_gate.A_log[0, 0, 0, 0] = 2.5
            a.forget_gate.dt_bias[:8] += 1.0
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(E) * 0.2)

sd = m.state_dict()
out = []


def put(name, t):
    out.append((name, t.detach().double().contiguous().reshape(-1)))


put("embed", sd["model.embed_tokens.weight"])
put("lm_head", sd["lm_head.weight"])
put("final_norm", sd["model.norm.weight"])
beta = torch.zeros(L, E)
cfg = m.config
for l in range(L):
    p, q = f"model.layers.{l}.", f"layers.{l}."
    put(q + "norm1", sd[p + "input_layernorm.weight"])
    put(q + "norm2", sd[p + "post_attention_layernorm.weight"])
    a = p + "self_attn."
    if cfg.layer_types[l] == "linear_attention":
        for x, y in [("q_proj", "wq"), ("k_proj", "wk"), ("v_proj", "wv"), ("forget_gate.f_a_proj", "wf1"),
                     ("forget_gate.f_b_proj", "wf2"), ("b_proj", "wbeta"), ("g_a_proj", "wz1"),
                     ("g_b_proj", "wz2"), ("o_proj", "wo")]:
            put(q + "kda." + y, sd[a + x + ".weight"])
        cw = sd[a + "conv1d.weight"][:, 0, :]  # [3 HD][W]: q, k, v channels
        put(q + "kda.conv_q", cw[0:HD])
        put(q + "kda.conv_k", cw[HD:2 * HD])
        put(q + "kda.conv_v", cw[2 * HD:])
        put(q + "kda.A_log", sd[a + "forget_gate.A_log"])
        put(q + "kda.dt_bias", sd[a + "forget_gate.dt_bias"])
        put(q + "kda.onorm", sd[a + "o_norm.weight"])
    else:
        put(q + "mla.wq", sd[a + "q_proj.weight"])
        put(q + "mla.wkva", sd[a + "kv_a_proj_with_mqa.weight"])
        put(q + "mla.kv_norm", sd[a + "kv_a_layernorm.weight"])
        put(q + "mla.wkvb", sd[a + "kv_b_proj.weight"])
        put(q + "mla.wo", sd[a + "o_proj.weight"])
    f = p + "mlp."
    if cfg.mlp_layer_types[l] == "dense":
        put(q + "ffn.w1", sd[f + "gate_proj.weight"])
        put(q + "ffn.w3", sd[f + "up_proj.weight"])
        put(q + "ffn.w2", sd[f + "down_proj.weight"])
    else:
        put(q + "moe.router", sd[f + "gate.weight"])
        gu = sd[f + "experts.gate_up_proj"]  # [E][2I][D]: gate rows, then up rows
        put(q + "moe.w1", gu[:, :I])
        put(q + "moe.w3", gu[:, I:])
        put(q + "moe.w2", sd[f + "experts.down_proj"])
        put(q + "moe.shared_w1", sd[f + "shared_experts.gate_proj.weight"])
        put(q + "moe.shared_w3", sd[f + "shared_experts.up_proj.weight"])
        put(q + "moe.shared_w2", sd[f + "shared_experts.down_proj.weight"])
        beta[l] = -sd[f + "gate.e_score_correction_bias"]

tok = torch.randint(0, V, (1, 45))
logits = []
with torch.no_grad():
    for renorm in (True, False):
        for layer in m.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.norm_topk_prob = renorm
        logits.append(m(tok).logits[0].double())
    g = m.model.layers[0].self_attn.forget_gate(m.model.layers[0].input_layernorm(m.model.embed_tokens(tok)))
print(f"layer 0: smallest log-decay {g.min().item():.3g}, {(g < -11).sum().item()} of {g.numel()} below -11")

with open(sys.argv[1], "wb") as fo:
    fo.write(struct.pack("<i", len(out)))
    for n, t in out:
        fo.write(n.encode().ljust(64, b"\0"))
        fo.write(struct.pack("<q", t.numel()))
        fo.write(t.numpy().astype("<f8").tobytes())
    fo.write(beta.numpy().astype("<f8").tobytes())
    fo.write(struct.pack("<i", tok.shape[1]))
    fo.write(tok[0].numpy().astype("<i4").tobytes())
    for lg in logits:
        fo.write(lg.numpy().astype("<f8").tobytes())
print(f"wrote {sys.argv[1]}: {len(out)} tensors, {tok.shape[1]} tokens")

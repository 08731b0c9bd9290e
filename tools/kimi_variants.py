#!/usr/bin/env python3
"""kimi_variants.py OUT_DIR: the Kimi-Linear fixture (tools/make_kimi_fixture.py) in variants that
each remove or change one of its parts, to find which part makes a GPU import differ from
transformers (docs/hf-import.md). Each variant is a folder OUT_DIR/NAME with the fixture's
tokenizer files and a checkpoint saved as the fixture's is (same seeds, same bf16 layout):

    full        the fixture's configuration
    norenorm    moe_renormalize (norm_topk_prob) off
    rho1        routed_scaling_factor 1
    k_dense     one KDA layer, dense MLP
    m_dense     one MLA layer, dense MLP
    kk_moe      KDA, KDA; dense then MoE
    mm_moe      MLA, MLA; dense then MoE
    k_moe       one KDA layer with an MoE MLP (no dense layer)

Run where transformers (kimi_linear), torch and tiktoken are installed (the GPU machine); then
`mtrl import OUT_DIR/NAME --device cpu|cuda --logits F` and tools/check_hf_export.py OUT_DIR/NAME F.
"""
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_kimi_fixture as fx  # noqa: E402

K, M = "linear_attention", "full_attention"
VARIANTS = {
    "full": {},
    "norenorm": dict(norm_topk_prob=False),
    "rho1": dict(routed_scaling_factor=1.0),
    "k_dense": dict(num_hidden_layers=1, layer_types=[K], mlp_layer_types=["dense"]),
    "m_dense": dict(num_hidden_layers=1, layer_types=[M], mlp_layer_types=["dense"]),
    "kk_moe": dict(num_hidden_layers=2, layer_types=[K, K], mlp_layer_types=["dense", "sparse"]),
    "mm_moe": dict(num_hidden_layers=2, layer_types=[M, M], mlp_layer_types=["dense", "sparse"]),
    "k_moe": dict(num_hidden_layers=1, layer_types=[K], mlp_layer_types=["sparse"]),
}


def main():
    out = sys.argv[1]
    names = sys.argv[2:] or list(VARIANTS)
    os.makedirs(out, exist_ok=True)
    tok_dir = os.path.join(out, "_tokenizer")
    if os.path.isdir(tok_dir):
        shutil.rmtree(tok_dir)
    os.makedirs(tok_dir)
    _, vocab = fx.make_tokenizer(tok_dir)
    for name in names:
        d = os.path.join(out, name)
        if os.path.isdir(d):
            shutil.rmtree(d)
        os.makedirs(d)
        for f in os.listdir(tok_dir):
            shutil.copy(os.path.join(tok_dir, f), d)
        fx.make_model(d, vocab, **VARIANTS[name])
        print("wrote", d)


if __name__ == "__main__":
    main()

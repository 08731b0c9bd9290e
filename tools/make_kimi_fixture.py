#!/usr/bin/env python3
"""make_kimi_fixture.py: writes tests/fixtures/kimi_linear_tiny/, the Hugging Face checkpoint the
C import is checked against (tests/test_hf_import.c). Run once, by hand, when the fixture must
change (transformers >= 5 with kimi_linear, torch, safetensors, tiktoken, regex):

    /work/pyenv/bin/python tools/make_kimi_fixture.py      # writes tests/fixtures/kimi_linear_tiny/

What it writes:
  config.json, model-0000N-of-0000M.safetensors, model.safetensors.index.json
        a tiny random KimiLinearForCausalLM (4 layers: KDA, KDA, MLA, KDA; layer 0 dense, the
        others MoE with 12 experts, top-2, one shared expert) saved by save_pretrained, in bf16
        (the hub's dtype) except A_log and dt_bias in fp32, sharded so that the index is used.
        Every tensor is random, norms and the correction bias included, so a tensor mapped to
        the wrong place shows in the logits.
  tiktoken.model, tokenizer_config.json
        a small byte-level BPE (256 bytes + 250 merges) trained by the same trainer as the BPE
        fixture (tools/make_bpe_fixture.py), in Kimi's layout: 256 special ids after the ranks,
        the named ones in tokenizer_config.json's added_tokens_decoder.
  expected_logits.safetensors
        fp32 logits of transformers (eager, fp32 upcast of the bf16 weights) on three random
        token sequences (4, 19 and 40 tokens: within one 16-token KDA chunk and across several):
        NAME.ids (I32 [T]) and NAME.logits (F32 [T][V]), NAME = short, chunk, long.
  expected_tokens.txt
        the tiktoken library's ids of a varied corpus (code, CJK, emoji, whitespace runs,
        specials), one record per case (text as hex so any byte survives; "-" when empty):
            tokens NAME MODE HEX      then "ids ..." (MODE: ordinary | special)
"""
import base64
import json
import os
import random
import shutil
import sys

import tiktoken

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_bpe_fixture as bpe  # noqa: E402


N_MERGES = 250


def make_tokenizer(out_dir):
    rng = random.Random(22)
    ranks = bpe.train_bpe(bpe.gen_corpus(rng), N_MERGES)
    n_base = len(ranks)
    specials = {}
    for i in range(bpe.N_RESERVED):
        name = bpe.NAMED_SPECIALS[i] if i < len(bpe.NAMED_SPECIALS) else "<|reserved_token_%d|>" % (n_base + i)
        specials[name] = n_base + i
    enc = tiktoken.Encoding("mtrl-kimi-tiny", pat_str=bpe.KIMI_PAT, mergeable_ranks=ranks, special_tokens=specials)
    with open(os.path.join(out_dir, "tiktoken.model"), "w") as f:
        for tok, r in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write("%s %d\n" % (base64.b64encode(tok).decode(), r))
    config = {"added_tokens_decoder": {str(n_base + i): {"content": name, "lstrip": False, "normalized": False,
                                                         "rstrip": False, "single_word": False, "special": True}
                                       for i, name in enumerate(bpe.NAMED_SPECIALS)},
              "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[EOS]", "unk_token": "[EOS]",
              "model_max_length": 1048576, "tokenizer_class": "TikTokenTokenizer"}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1, ensure_ascii=False)
        f.write("\n")
    return enc, n_base + bpe.N_RESERVED


def make_model(out_dir, vocab, **over):
    """The fixture's model; `over` replaces KimiLinearConfig arguments (tools/kimi_variants.py)."""
    import torch
    from transformers import KimiLinearConfig, KimiLinearForCausalLM
    torch.manual_seed(22)
    args = dict(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        linear_num_heads=2, linear_head_dim=16, linear_conv_kernel_dim=4,
        kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        num_local_experts=12, num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.446,
        n_group=1, topk_group=1, norm_topk_prob=True, rms_norm_eps=1e-5, tie_word_embeddings=False,
        pad_token_id=vocab - 1, bos_token_id=vocab - bpe.N_RESERVED, eos_token_id=vocab - bpe.N_RESERVED + 1)
    args.update(over)
    cfg = KimiLinearConfig(**args)
    cfg._attn_implementation = "eager"
    model = KimiLinearForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g) * 2.0)  # decay rates exp(A_log) in [1, e^2]
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) - 2.0)
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))
    # The hub's dtype: bf16, with the gate's A_log and dt_bias in fp32 as Kimi's checkpoints keep them.
    model = model.to(torch.bfloat16)
    for mod in model.modules():
        for pn in ("A_log", "dt_bias"):
            if hasattr(mod, pn) and isinstance(getattr(mod, pn), torch.nn.Parameter):
                getattr(mod, pn).data = getattr(mod, pn).data.float()
    model.save_pretrained(out_dir, max_shard_size="150KB")
    return model


def write_logits(model, vocab, path):
    import torch
    from safetensors.torch import save_file
    ref = model.to(torch.float32).eval()
    rng = random.Random(5)
    seqs = {"short": 4, "chunk": 19, "long": 40}
    tensors = {}
    with torch.no_grad():
        for name, n in seqs.items():
            ids = [rng.randrange(vocab) for _ in range(n)]
            tensors[name + ".ids"] = torch.tensor(ids, dtype=torch.int32)
            tensors[name + ".logits"] = ref(torch.tensor([ids]), use_cache=False).logits[0].float().contiguous()
    save_file(tensors, path, metadata={"made_by": "tools/make_kimi_fixture.py", "torch": torch.__version__})


def token_records(enc):
    out = []
    for name, data, mode in bpe.test_cases():
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue  # the tiktoken library takes only valid UTF-8
        if name == "reserved_special":
            continue
        ids = enc.encode(text, allowed_special="all") if mode == "special" else enc.encode_ordinary(text)
        assert enc.decode_bytes(ids) == data, name
        out.append("tokens %s %s %s\nids %s\n" % (name, mode, data.hex() or "-", " ".join(map(str, ids))))
    return out


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "..", "tests", "fixtures", "kimi_linear_tiny")
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    enc, vocab = make_tokenizer(out_dir)
    model = make_model(out_dir, vocab)
    recs = ["# made by tools/make_kimi_fixture.py (tiktoken %s); do not edit\n" % tiktoken.__version__]
    recs += token_records(enc)
    write_logits(model, vocab, os.path.join(out_dir, "expected_logits.safetensors"))
    with open(os.path.join(out_dir, "expected_tokens.txt"), "w") as f:
        f.writelines(recs)
    size = sum(os.path.getsize(os.path.join(out_dir, p)) for p in os.listdir(out_dir))
    print("wrote %s: vocab %d, %s, %d bytes" % (out_dir, vocab, sorted(os.listdir(out_dir)), size))


if __name__ == "__main__":
    main()

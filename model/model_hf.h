// model_hf.h: the backbone's parameters in the Hugging Face layout of KimiLinearForCausalLM,
// both directions (docs/hf-import.md).
//
// Names (l the layer, e the expert; what transformers' save_pretrained writes and the hub's
// checkpoints hold; transformers fuses the experts into gate_up_proj / down_proj in memory only):
//   model.embed_tokens.weight -> embed          lm_head.weight -> lm_head     model.norm.weight -> final_norm
//   model.layers.l.input_layernorm.weight -> norm1, post_attention_layernorm.weight -> norm2
//   KDA  model.layers.l.self_attn.{q,k,v}_proj.weight -> kda.w{q,k,v}
//        {q,k,v}_conv1d.weight [HD][1][W] -> kda.conv_{q,k,v}; f_a_proj, f_b_proj -> kda.wf1, wf2;
//        A_log [1][1][H][1] -> kda.A_log; dt_bias -> kda.dt_bias; b_proj -> kda.wbeta;
//        g_a_proj, g_b_proj -> kda.wz1, wz2; o_norm -> kda.onorm; o_proj -> kda.wo
//   MLA  self_attn.q_proj -> mla.wq; kv_a_proj_with_mqa -> mla.wkva; kv_a_layernorm -> mla.kv_norm;
//        kv_b_proj -> mla.wkvb; o_proj -> mla.wo
//   dense layers (l < dense_layers): mlp.{gate,up,down}_proj -> ffn.w1, w3, w2 (read also under
//        block_sparse_moe., the spelling transformers 5 writes)
//   MoE  block_sparse_moe.gate.weight -> moe.router; gate.e_score_correction_bias -> -beta (the
//        QB bias of the layer, m->qb_beta); experts.e.{w1,w3,w2}.weight -> row e of moe.w1, w3, w2;
//        shared_experts.{gate,up,down}_proj -> moe.shared_w1, w3, w2
//
// The model must have the Kimi forms (kda_gate = kimi, attnres = false, mla_gate = false,
// router_bias = score, sigmoid scores): an [model] section from config.json (hf_config.h) has
// them; another model is refused by name, in both directions.
#ifndef MTRL_MODEL_HF_H
#define MTRL_MODEL_HF_H

#include "model/model.h"

typedef struct mtrl_hf_load_stats {
    double seconds;      // open (map + headers) to the last tensor converted
    uint64_t bytes;      // data bytes read from the mappings
    int tensors;
    int files;
} mtrl_hf_load_stats;

// Loads the checkpoint in dir (model.safetensors or shards + index) into m's parameters and QB
// beta, converting bf16 / f16 / f32 to `real`, then uploads them to m's device. Before any value
// is written, every tensor the model needs is looked up and its shape and dtype checked, and
// every tensor of the checkpoint must have a place: a missing tensor (MTRL_ERR_NOTFOUND), a
// shape mismatch (MTRL_ERR_MISMATCH, both shapes), a dtype that does not convert or a tensor
// mtrl cannot place (MTRL_ERR_FORMAT) is an error naming the file and tensor, and m is left as
// it was. stats nullable.
mtrl_status mtrl_model_load_hf(mtrl_model *m, const char *dir, mtrl_hf_load_stats *stats, mtrl_error *err);

// Writes m (host mirror refreshed first) as a Hugging Face checkpoint into the folder out, which
// must not exist: config.json (from cfg, the resolved [model] section of m), the safetensors
// shards of at most max_shard bytes with their index (disk_dtype MTRL_DT_F32 or MTRL_DT_BF16),
// and, when src_dir is given, its tokenizer and generation files (tiktoken.model,
// tokenizer_config.json, tokenizer.json, special_tokens_map.json, generation_config.json,
// chat_template.jinja, tokenization_kimi.py, where present) and token ids. Everything is
// written into out.tmp-PID first and renamed to out at the end, so out is whole or absent.
mtrl_status mtrl_model_save_hf(mtrl_model *m, const mtrl_cfg_model *cfg, const char *src_dir, const char *out,
                               mtrl_dtype disk_dtype, size_t max_shard, uint64_t *bytes_out, mtrl_error *err);

#endif

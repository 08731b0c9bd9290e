// hf_config.h: a Hugging Face config.json of the Kimi-Linear layout (model_type kimi_linear) as
// mtrl [model] keys, and back (docs/hf-import.md has the table).
//
// Reading accepts both spellings a checkpoint may carry: transformers' own (layer_types,
// mlp_layer_types, linear_num_heads, num_experts, moe_renormalize, ...) and the hub's original
// remote-code one (linear_attn_config {kda_layers, full_attn_layers, num_heads, head_dim,
// short_conv_kernel_size}, first_k_dense_replace, n_shared_experts, norm_topk_prob, ...). Every
// field is either mapped onto a [model] key, checked against the one value mtrl implements
// (q_lora_rank null, n_group 1, tie_word_embeddings false, attention_bias false, hidden_act
// silu, ...), or listed as not changing the forward pass (initializer_range, use_cache, token
// ids, ...). Any other field, and a checked field with another value, is refused by name:
//     tests/fixtures/x/config.json: q_lora_rank = 1536: mtrl's MLA has no low-rank query
//     projection (q_a_proj / q_b_proj); only null is supported
// so a checkpoint mtrl would compute differently from transformers never loads silently.
#ifndef MTRL_HF_CONFIG_H
#define MTRL_HF_CONFIG_H

#include "common/config.h"
#include "common/status.h"

#define MTRL_HF_MAX_KEYS 48

// One [model] key the config.json sets, as the INI text of its value, and the config.json
// field it came from (for conflict messages).
typedef struct mtrl_hf_key {
    char key[32];
    char value[MTRL_CFG_STR_MAX];
    char field[64];
} mtrl_hf_key;

typedef struct mtrl_hf_config {
    char path[4096];         // the config.json read
    mtrl_hf_key keys[MTRL_HF_MAX_KEYS];
    int n_keys;
    long vocab, bos_id, eos_id, pad_id; // token ids: -1 when absent
} mtrl_hf_config;

// Reads DIR/config.json (dir may also name the file itself). MTRL_ERR_IO / MTRL_ERR_FORMAT
// (JSON syntax, with line and column) / MTRL_ERR_USAGE (an unsupported field or value, named).
mtrl_status mtrl_hf_config_read(mtrl_hf_config *h, const char *dir, mtrl_error *err);

// The value of a [model] key in h, or NULL.
const char *mtrl_hf_config_get(const mtrl_hf_config *h, const char *key);

// Writes a config.json that transformers' KimiLinearConfig reads back to the same model, from a
// resolved [model] section (the one the checkpoint was trained with). ids: bos, eos, pad token
// ids to record (-1: omitted). The file is written whole or not at all (a temp file renamed).
mtrl_status mtrl_hf_config_write(const char *path, const mtrl_cfg_model *m, long vocab, long bos_id, long eos_id,
                                 long pad_id, mtrl_error *err);

#endif

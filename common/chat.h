// chat.h: how an episode is framed in tokens and how the model's tool calls are read, per
// [model] chat_template (docs/hf-import.md, "Chat and tool calls").
//
//   bytes  the byte tokenizer's own specials (common/tokenizer.h): BOS prompt, TOOL_OPEN
//          call TOOL_CLOSE, RESULT_OPEN observation RESULT_CLOSE, EOS ends the answer.
//   kimi   Kimi's chat template (Kimi-Linear / Kimi-K2 tokenizer_config.json), the env's prompt
//          as the user message:
//            <|im_user|>user<|im_middle|>PROMPT<|im_end|><|im_assistant|>assistant<|im_middle|>
//          the model calls a tool as
//            <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
//            <|tool_call_argument_begin|>ARGS<|tool_call_end|>
//          and at <|tool_call_end|> the env gets the action NAME(ARGS), ARGS exactly as the
//          model wrote them (the env ABI's `name(args)` convention, env/mtrl_env.h); the result
//          comes back as the template renders a tool message, closing the section and turn:
//            <|tool_calls_section_end|><|im_end|><|im_system|>tool<|im_middle|>## Return of
//            functions.NAME:IDX\nRESULT<|im_end|><|im_assistant|>assistant<|im_middle|>
//          <|im_end|> (or [EOS]) ends the answer. A call that does not parse (no
//          functions.NAME:IDX, no argument token) reaches the env as the text the model wrote,
//          which the env answers as an unknown tool: the model's mistake, scored as such.
// Env text (prompts, results) is encoded with special tokens as plain text, so an env can
// never inject a control token. auto picks kimi for a tokenizer that has Kimi's specials.
#ifndef MTRL_CHAT_H
#define MTRL_CHAT_H

#include <stddef.h>
#include <stdint.h>

#include "common/config.h"
#include "common/status.h"
#include "common/tokenizer.h"

enum { MTRL_CHAT_BYTES = 0, MTRL_CHAT_KIMI = 1 };

// What a sampled token does.
enum { MTRL_CHAT_TEXT = 0, MTRL_CHAT_END, MTRL_CHAT_CALL_OPEN, MTRL_CHAT_CALL_CLOSE };

typedef struct mtrl_chat {
    mtrl_tokenizer *tok; // owned
    int kind;            // MTRL_CHAT_*
    uint32_t end, end2, call_open, call_close;        // the roles' ids (end2: a second end token, or end)
    uint32_t arg;                                     // kimi: <|tool_call_argument_begin|>
    uint32_t user, assistant, system, middle, im_end, section_end; // kimi framing
    uint32_t section_begin;                          // kimi: <|tool_calls_section_begin|>
} mtrl_chat;

// The bytes template with the byte tokenizer, needing no init (mtrl_rollout_run_one's default).
extern const mtrl_chat mtrl_chat_bytes;

// Opens [model] tokenizer and chat_template for a model of vocab ids. Errors name the key, the
// file and the missing special token (a kimi template needs all of Kimi's).
mtrl_status mtrl_chat_init(mtrl_chat *c, const mtrl_cfg_model *cfg, uint32_t vocab, mtrl_error *err);
void mtrl_chat_free(mtrl_chat *c);

// The ids an episode starts with, from the env's prompt (n bytes), into out (cap ids).
// Returns the count, or -1 when they do not fit in cap.
long mtrl_chat_prompt(const mtrl_chat *c, const char *prompt, size_t n, uint32_t *out, size_t cap);

int mtrl_chat_role(const mtrl_chat *c, uint32_t id);

// The env action of a call from the model's ids between its CALL_OPEN and CALL_CLOSE (both
// excluded), NUL-terminated into out; call_id (cap idcap) gets the id the result refers to
// (kimi: functions.NAME:IDX; "" when none). Returns the action's length.
size_t mtrl_chat_call(const mtrl_chat *c, const uint32_t *ids, size_t n, char *out, size_t cap, char *call_id,
                      size_t idcap);

// The ids fed after a call's CALL_CLOSE: the framed observation (n bytes). -1 when over cap.
long mtrl_chat_result(const mtrl_chat *c, const char *call_id, const char *obs, size_t n, uint32_t *out, size_t cap);

// What a model turn should be, for the supervised warm-up (the env's demo() actions in the
// template's tokens, so that an imported model can be warmed up too):
// the ids of a call of the env action `NAME(ARGS)` (n bytes; idx: the call's number in the
// episode), through its CALL_CLOSE; call_id (idcap) gets the id its result refers to, as
// mtrl_chat_call would read it back. Then mtrl_chat_result frames the observation.
long mtrl_chat_demo_call(const mtrl_chat *c, const char *action, size_t n, int idx, uint32_t *out, size_t cap,
                         char *call_id, size_t idcap);
// ... and of a final answer (n bytes) with its end token. Both: the count, or -1 over cap.
long mtrl_chat_demo_answer(const mtrl_chat *c, const char *answer, size_t n, uint32_t *out, size_t cap);

// The text of model ids (specials dropped): the answer an env scores.
size_t mtrl_chat_text(const mtrl_chat *c, const uint32_t *ids, size_t n, char *out, size_t cap);

#endif

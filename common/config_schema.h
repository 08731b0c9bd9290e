// config_schema.h: every key an experiment INI may hold, in one place.
//
// One X-macro list per section: X(section, key, type, default, min, max, choices, help).
// config.h turns the lists into the typed struct (cfg->learner.lr), the defaults, the parser
// with its range and choice checks, the INI printer and `mtrl check --keys`. Adding a key is
// one line here. Types: INT (long), FLOAT (double), BOOL (0/1; true/false/yes/no/on/off/1/0),
// STR (free text), ENUM (one of `choices`, '|'-separated). min/max bound INT and FLOAT (equal
// bounds = unbounded). A key whose default is "!" is required.
//
// [model] integer fields default to 0, meaning "take the preset's value" (presets in
// model/model_params.c); the resolved config prints the final values.
#ifndef MTRL_CONFIG_SCHEMA_H
#define MTRL_CONFIG_SCHEMA_H

#define MTRL_CFG_RUN(X)                                                                             \
    X(run, name, STR, "run", 0, 0, NULL, "a name for the run, shown in the run store")              \
    X(run, seed, INT, "1", 0, 4294967295.0, NULL, "seed of every random stream (init, tasks, sampling)") \
    X(run, steps, INT, "50", 1, 1e9, NULL, "optimizer steps of the RL stage (with [stage.N] sections: their sum instead)") \
    X(run, db, STR, "runs.db", 0, 0, NULL, "SQLite run store (created when missing)")               \
    X(run, out_dir, STR, "runs", 0, 0, NULL, "folder of the runs' files: each run writes its checkpoints and trajectory file into <store>-run<id>/ in it")         \
    X(run, keep_trajectories, STR, "all", 0, 0, NULL, "which episodes keep their trajectory file: all, failures or every_N") \
    X(run, keep_checkpoints, INT, "3", 0, 1e6, NULL, "checkpoints kept on disk (0 = all)")          \
    X(run, checkpoint_every, INT, "10", 0, 1e9, NULL, "steps between checkpoints (0 = only the last)") \
    X(run, max_minutes, FLOAT, "0", 0, 1e6, NULL, "stop the run after this many minutes (0 = no limit)") \
    X(run, stop_before_stage, INT, "0", 0, 16, NULL, "stop cleanly (checkpoint) when the run reaches stage N; --resume goes on into it (0 = never)")

#define MTRL_CFG_MODEL(X)                                                                           \
    X(model, preset, ENUM, "tiny", 0, 0, "tiny|small|custom", "size preset; explicit fields override it") \
    X(model, device, ENUM, "cpu", 0, 0, "cpu|cuda", "where the backbone runs")                      \
    X(model, from, STR, "", 0, 0, NULL, "a Hugging Face Kimi-Linear folder (config.json, safetensors, tokenizer files) to start from: its config.json sets the [model] keys it maps (a conflicting key in the INI is an error) and the learner loads its weights (docs/hf-import.md); relative to the experiment file's folder") \
    X(model, vocab, INT, "0", 0, 1 << 26, NULL, "vocabulary size of the embedding and head (0 = the tokenizer's: 264 for bytes)") \
    X(model, tokenizer, STR, "auto", 0, 0, NULL, "bytes, a tiktoken.model / tokenizer.json path (relative to the experiment file's folder), or auto: the from folder's tokenizer files when from is set, else bytes") \
    X(model, chat_template, ENUM, "auto", 0, 0, "auto|bytes|kimi", "prompt framing and tool-call tokens of the actor: bytes (BOS, TOOL_OPEN/CLOSE specials), kimi (<|im_user|>... and <|tool_calls_section_begin|>...), auto: kimi when the tokenizer has Kimi's special tokens, else bytes") \
    X(model, layers, INT, "0", 0, 512, NULL, "number of layers (0 = preset)")                      \
    X(model, d_model, INT, "0", 0, 65536, NULL, "hidden width (0 = preset)")                       \
    X(model, hybrid, STR, "default", 0, 0, NULL, "mixer per layer: K (KDA) or M (MLA), e.g. KKKM; default = MLA every 4th and last") \
    X(model, kda_heads, INT, "0", 0, 1024, NULL, "KDA heads (0 = preset)")                        \
    X(model, kda_head_dim, INT, "0", 0, 1024, NULL, "KDA d_k = d_v (0 = preset)")                  \
    X(model, mla_heads, INT, "0", 0, 1024, NULL, "MLA heads (0 = preset)")                        \
    X(model, mla_nope_dim, INT, "0", 0, 1024, NULL, "MLA d_n (0 = preset)")                       \
    X(model, mla_rope_dim, INT, "0", 0, 1024, NULL, "MLA d_r, not rotated: NoPE (0 = preset)")     \
    X(model, mla_v_dim, INT, "0", 0, 1024, NULL, "MLA d_v (0 = preset)")                          \
    X(model, mla_latent_dim, INT, "0", 0, 8192, NULL, "MLA d_c, the kv latent (0 = preset)")       \
    X(model, mla_gate, BOOL, "true", 0, 0, NULL, "sigmoid output gate on MLA")                     \
    X(model, mla_train, ENUM, "naive", 0, 0, "naive|absorbed", "MLA attention form of the learner's forward and backward: naive (keys and values expanded per head, Dk = d_n + d_r: 3.4x fewer attention FLOPs at small's widths) or absorbed (MQA over the latents, as decode)") \
    X(model, mla_prefill, ENUM, "naive", 0, 0, "naive|absorbed", "MLA attention form of prefill (prompts, documents, tool results): naive (keys and values expanded per head: fewer attention FLOPs; its scratch grows with the context, by the expanded keys of every token so far), or absorbed (attention over the latents, as decode)") \
    X(model, gemm, ENUM, "tf32", 0, 0, "tf32|fp32", "precision of the projection and expert GEMMs on a GPU (a CPU model computes in real): tf32 (TF32 tensor cores, 10-bit mantissa inputs, fp32 accumulation; docs/precision.md compares the formats) or fp32 (true fp32, what the GPU tests compare with the CPU); [kernels] gemm overrides it") \
    X(model, dense_inter, INT, "0", 0, 1 << 20, NULL, "intermediate width of the dense FFNs of the first dense_layers layers (0 = preset)") \
    X(model, dense_layers, INT, "0", 0, 512, NULL, "layers (the first) with a dense SwiGLU FFN instead of MoE, Kimi's first_k_dense_replace (0 = preset = 1)") \
    X(model, experts, INT, "0", 0, 4096, NULL, "routed experts per MoE layer (0 = preset)")       \
    X(model, top_k, INT, "0", 0, 64, NULL, "experts per token (0 = preset)")                      \
    X(model, shared_experts, INT, "-1", -1, 16, NULL, "shared experts (-1 = preset)")             \
    X(model, expert_inter, INT, "0", 0, 1 << 20, NULL, "expert intermediate width (0 = preset)")   \
    X(model, attnres_block, INT, "0", 0, 512, NULL, "layers per Block-AttnRes block (0 = preset)")  \
    X(model, g_min, FLOAT, "-5", -8, -0.01, NULL, "lower bound of the KDA log-decay (kda_gate = kimi: the floor a GPU clamps the decay to, docs/model-forms.md)") \
    X(model, kda_gate, ENUM, "bounded", 0, 0, "bounded|kimi", "KDA decay gate: bounded (g = g_min sigmoid(exp(A_log)(f + dt_bias))) or kimi (g = -exp(A_log) softplus(f + dt_bias), unbounded)") \
    X(model, conv_kernel, INT, "4", 1, 16, NULL, "KDA short-conv kernel width")                  \
    X(model, rho, FLOAT, "2.446", 0, 100, NULL, "routed scaling factor of the MoE weights")       \
    X(model, router_score, ENUM, "sigmoid", 0, 0, "sigmoid|softmax", "router score function")      \
    X(model, router_bias, ENUM, "logit", 0, 0, "logit|score", "what the QB bias beta shifts for the top-k: logit (z - beta) or score (s - beta, Kimi's e_score_correction_bias = -beta)") \
    X(model, router_renorm, BOOL, "true", 0, 0, NULL, "renormalise the top-k scores to sum 1 before rho (Kimi's moe_renormalize)") \
    X(model, attnres, BOOL, "true", 0, 0, NULL, "Block Attention Residuals (false: the plain pre-norm residual stream, as Kimi Linear; no attnres.* parameters, attnres_block ignored)") \
    X(model, norm_eps, FLOAT, "1e-5", 1e-12, 1, NULL, "RMSNorm epsilon")                          \
    X(model, mla_kv_norm_eps, FLOAT, "0", 0, 1, NULL, "epsilon of the MLA latent's RMSNorm (0 = norm_eps; Kimi Linear's kv_a_layernorm takes 1e-6 whatever rms_norm_eps is)") \
    X(model, init_std, FLOAT, "0.02", 0, 1, NULL, "std of the normal init of projections")       \
    X(model, image_patch, INT, "0", 0, 64, NULL, "side P of the square patches pictures are cut into: each P x P RGB patch is one token through a learned linear patch embedding (docs/multimodal.md); 0 = no pictures (an env's image aborts its episode)") \
    X(model, image_max_side, INT, "512", 1, 4096, NULL, "largest width or height of a picture in pixels; a larger one aborts its episode")

#define MTRL_CFG_ENV(X)                                                                             \
    X(env, name, STR, "!", 0, 0, NULL, "retrieval, calc, http, picture, corpus, or plugin (with plugin = path.so)")  \
    X(env, plugin, STR, "", 0, 0, NULL, "path of an env plug-in .so (env.name = plugin), relative to the experiment file's folder")           \
    X(env, args, STR, "", 0, 0, NULL, "extra key=value;... passed to the env's create()")          \
    X(env, isolate, ENUM, "auto", 0, 0, "auto|true|false", "run the env in a child process with rlimits and a watchdog; auto = plug-ins isolated, built-ins in-process") \
    X(env, step_timeout_ms, INT, "2000", 1, 3600000, NULL, "per-step watchdog of an isolated env") \
    X(env, digits, INT, "1", 1, 6, NULL, "calc: digits per operand")                             \
    X(env, ops, INT, "1", 1, 4, NULL, "calc: operations per problem")                           \
    X(env, doc_tokens, INT, "512", 16, 1 << 24, NULL, "retrieval: document length")               \
    X(env, inline_doc, BOOL, "false", 0, 0, NULL, "retrieval: put the whole document in the prompt") \
    X(env, demo_search, BOOL, "false", 0, 0, NULL, "retrieval: with inline_doc, demos search(key) before the answer") \
    X(env, key_digits, INT, "0", 0, 15, NULL, "retrieval: digits of every key (0 = the fewest that keep keys sparse at this length)") \
    X(env, task, ENUM, "mix", 0, 0, "mix|chain|sum|latest|trail", "corpus: the question: chain (follow next= hops times), sum (of a key's values over hops records), latest (the newest of hops contradicting updates), mix (one of those three per seed), or trail (open the file next= names until next=end; each file's first page ends with its code= and next=)") \
    X(env, hops, INT, "4", 1, 4096, NULL, "corpus: hops of a chain, records of a sum or latest")   \
    X(env, hops_min, INT, "0", 0, 4096, NULL, "corpus: with 1..hops, each episode's hops drawn uniformly in [hops_min, hops] (0 = always hops)") \
    X(env, files, INT, "64", 2, 65536, NULL, "corpus: files in the corpus")                        \
    X(env, file_tokens, INT, "4096", 256, 1 << 20, NULL, "corpus: bytes (tokens) per file")        \
    X(env, credit, FLOAT, "0", 0, 0.9, NULL, "corpus, retrieval: partial credit: the right answer earns 1, a wrong one credit x the fraction of the task done (corpus: of its facts that open() results showed; retrieval: of the value's six digits in place) (0 = the answer alone; success is still the right answer)") \
    X(env, max_tool_calls, INT, "4", 0, 1000, NULL, "tool calls allowed per episode (built-ins and plug-ins alike: the call past it ends the episode, reward 0)") \
    X(env, max_obs_bytes, INT, "256", 1, 1 << 24, NULL, "built-ins: cap on one tool observation (a plug-in's are capped at 64 MiB by the host, env/mtrl_env.h)") \
    X(env, base_url, STR, "", 0, 0, NULL, "http: base URL the get tool may reach")               \
    X(env, allow_loopback, BOOL, "false", 0, 0, NULL, "http: allow 127.0.0.0/8 and ::1")         \
    X(env, timeout_ms, INT, "2000", 1, 600000, NULL, "http: total timeout of one request")

#define MTRL_CFG_ACTOR(X)                                                                           \
    X(actor, count, INT, "2", 0, 1024, NULL, "actor processes that mtrl run starts locally")       \
    X(actor, gpus, STR, "", 0, 0, NULL, "CUDA devices of the local actors, e.g. 0,1: actor i (1-based) on the ((i-1) mod n)-th id, repeats allowed; weights reach an actor on another GPU than the learner's through CUDA IPC (peer access) or, where that cannot open, ZeroMQ (docs/multi-gpu.md); empty = [model] device") \
    X(actor, episodes_in_flight, INT, "8", 1, 65536, NULL, "episodes one actor generates at once (batched decode)") \
    X(actor, max_tokens, INT, "128", 1, 1 << 24, NULL, "token budget of an episode (prompt + generated + tool)") \
    X(actor, max_turn_tokens, INT, "32", 1, 1 << 24, NULL, "tokens one model turn may generate")    \
    X(actor, temperature, FLOAT, "1.0", 0, 10, NULL, "sampling temperature (0 = greedy)")           \
    X(actor, top_p, FLOAT, "1.0", 0.01, 1, NULL, "nucleus sampling mass")                          \
    X(actor, routing_replay, BOOL, "false", 0, 0, NULL, "record routing for the learner to replay (R3)") \
    X(actor, chunk_tokens, INT, "4096", 16, 1 << 24, NULL, "tokens per CHUNK message")             \
    X(actor, heartbeat_ms, INT, "1000", 50, 600000, NULL, "heartbeat interval")                    \
    X(actor, learner_patience_s, INT, "3600", 0, 1 << 30, NULL, "an actor whose learner was silent this long exits with status 4 (0 = never; keep it above the longest learner step)") \
    X(actor, snapshot_dir, STR, "", 0, 0, NULL, "folder for snapshots of long episodes in flight; a restarted actor resumes them (empty = off)") \
    X(actor, snapshot_tokens, INT, "65536", 16, 1 << 30, NULL, "snapshot an episode in flight each time it grows by this many tokens") \
    X(actor, prefill_rounds, INT, "1", 0, 1 << 20, NULL, "rounds of prefill (one segment of 8192 tokens of all pending tool results and prompts) per generation step, between decode steps; a longer feed goes on at the next step while the other episodes decode (0 = every pending feed before the next decode)") \
    X(actor, device_budget_mb, INT, "0", 0, 1 << 30, NULL, "MiB of device memory for the decode states of episodes in flight (KDA states, conv windows, MLA latents); a new episode waits rather than exceed it, idle ones move to host memory (0 = off: every slot's state allocated at start)") \
    X(actor, weights, ENUM, "fp32", 0, 0, "fp32|bf16", "the actor model's device weights: fp32 (an fp32 block, plus its bf16 copy under [kernels] gemm = bf16) or bf16 (GEMM matrices as bf16 only, the rest fp32: needs [model] device = cuda and [kernels] gemm = bf16; model/model_wsplit.h)") \
    X(actor, host_budget_mb, INT, "0", 0, 1 << 30, NULL, "MiB of host memory for decode states moved off the device (0 = none moved: an episode that cannot stay ends truncated)")

#define MTRL_CFG_LEARNER(X)                                                                         \
    X(learner, endpoint, STR, "tcp://127.0.0.1:*", 0, 0, NULL, "ROUTER endpoint; * = pick a free port") \
    X(learner, curve_key, STR, "", 0, 0, NULL, "the learner's CURVE key file (mtrl keygen STEM writes STEM.key); empty = no CURVE, plain text: keep the endpoint on loopback") \
    X(learner, curve_allow, STR, "", 0, 0, NULL, "actors allowed in with CURVE: a file of public keys (one a line) or a folder of .pub files; required with curve_key") \
    X(learner, batch_groups, INT, "4", 1, 1 << 20, NULL, "groups of episodes per optimizer step")  \
    X(learner, lr, FLOAT, "3e-3", 0, 10, NULL, "AdamW learning rate")                             \
    X(learner, beta1, FLOAT, "0.9", 0, 0.999999, NULL, "AdamW beta1")                            \
    X(learner, beta2, FLOAT, "0.95", 0, 0.999999, NULL, "AdamW beta2")                           \
    X(learner, eps, FLOAT, "1e-8", 0, 1, NULL, "AdamW epsilon")                                 \
    X(learner, weight_decay, FLOAT, "0", 0, 10, NULL, "decoupled weight decay")                  \
    X(learner, grad_clip, FLOAT, "1.0", 0, 1e9, NULL, "global gradient-norm clip (0 = off)")     \
    X(learner, max_staleness, INT, "4", 0, 1 << 20, NULL, "drop episodes whose oldest token is this many versions old") \
    X(learner, qb, BOOL, "true", 0, 0, NULL, "update the router bias by Quantile Balancing")       \
    X(learner, publish_every, INT, "1", 1, 1000000, NULL, "send the actors every N-th weight version (fewer loads; episodes get up to N-1 versions staler: raise max_staleness with it)") \
    X(learner, publish_dtype, ENUM, "fp32", 0, 0, "fp32|bf16", "weights sent to the actors: fp32, or bf16 matrices (half the bytes; the actors then sample from rounded weights, which the learner's importance correction sees as mismatch)") \
    X(learner, publish, ENUM, "auto", 0, 0, "auto|shm|zmq", "how the actors get the weights: auto (a same-host channel: shared memory, or CUDA IPC device to device when the model is on a GPU, for every actor that can open it, e.g. those mtrl run starts; the others, on other hosts, get ZeroMQ chunks), shm (the channel only: an actor that cannot open it stops with an error; the learner fails if it cannot create it) or zmq (safetensors chunks over ZeroMQ to every actor)") \
    X(learner, qb_actor_stats, BOOL, "false", 0, 0, NULL, "also fold the beta implied by the actors' decode-time routing into each QB update") \
    X(learner, heartbeat_timeout_ms, INT, "5000", 100, 3600000, NULL, "an actor silent this long is dead") \
    X(learner, stall_timeout_s, INT, "900", 0, 604800, NULL, "the run fails when no RL step was taken for this long (the message says why: no actor, or no episode finished); 0 = never") \
    X(learner, actor_start_timeout_ms, INT, "120000", 100, 3600000, NULL, "... or this long after its WELCOME, before its first message (it builds its model and envs)") \
    X(learner, credit_bytes, INT, "4194304", 4096, 1LL << 40, NULL, "bytes an actor may have in flight") \
    X(learner, segment, STR, "auto", 0, 0, NULL, "tokens per segment of the learner's forward and backward, and of replay's scoring: auto (the memory planner's choice for each batch from the device's free memory) or a count N") \
    X(learner, threads, INT, "0", 0, 1024, NULL, "OpenMP threads of the learner and of each local actor (0 = the cores shared evenly)") \
    X(learner, gpus, STR, "", 0, 0, NULL, "CUDA devices of the learner's ranks, e.g. 0,1,2,3: one data-parallel rank each, rank r on the r-th id, over NCCL (docs/multi-gpu.md); the first id must be [model] device's GPU (rank 0's, the actors'); empty = [model] device, or devices 0..ranks-1") \
    X(learner, ranks, INT, "0", 0, 64, NULL, "data-parallel learner ranks in the mtrl run process, each a thread with a model replica (docs/multi-gpu.md): with [model] device = cpu N threads on the CPU; with cuda one per GPU of [learner] gpus (ranks must equal their number). 0 = one per listed GPU, or 1") \
    X(learner, expert_parallel, BOOL, "false", 0, 0, NULL, "with ranks > 1 on a CPU model with MoE layers: the routed experts expert parallel over the ranks (each owns E/ranks experts, runs them for every rank's tokens and keeps their gradients and moments; the rest data parallel, the moments ZeRO-sharded); refused on a GPU (not built: docs/multi-gpu.md §3), for a dense model, or with more ranks than experts") \
    X(learner, rank_timeout_ms, INT, "600000", 100, 86400000, NULL, "how long a learner rank waits for the others in a collective before the run fails naming the rank (keep it above the longest imbalance of a step between ranks)")

#define MTRL_CFG_ALGO(X)                                                                            \
    X(algo, advantage, ENUM, "grpo", 0, 0, "grpo|dr_grpo|rloo", "group-relative advantage estimator") \
    X(algo, loss, ENUM, "ppo", 0, 0, "ppo|cispo|gspo", "policy loss")                              \
    X(algo, group_size, INT, "4", 1, 4096, NULL, "episodes per task (same prompt, different sampling)") \
    X(algo, eps_low, FLOAT, "0.2", 0, 10, NULL, "lower clip epsilon")                             \
    X(algo, eps_high, FLOAT, "0.28", 0, 10, NULL, "upper clip epsilon (clip-higher)")              \
    X(algo, dual_clip, FLOAT, "3.0", 0, 1e6, NULL, "dual-clip c for negative advantages (0 = off)") \
    X(algo, correction, ENUM, "tis", 0, 0, "none|tis|seq_mask", "importance correction against behaviour log-probs") \
    X(algo, tis_cap, FLOAT, "2.0", 1, 1e6, NULL, "TIS truncation C")                              \
    X(algo, seq_mask_low, FLOAT, "0.5", 0, 1, NULL, "seq_mask: lower bound of the geometric-mean ratio") \
    X(algo, seq_mask_high, FLOAT, "2.0", 1, 1e6, NULL, "seq_mask: upper bound of the geometric-mean ratio") \
    X(algo, token_mask, BOOL, "false", 0, 0, NULL, "IcePop-style per-token mask: a model token whose learner/actor probability ratio is outside [token_mask_low, token_mask_high], or that is over token_mask_stale versions old, carries no loss") \
    X(algo, token_mask_low, FLOAT, "0.5", 0, 1, NULL, "token_mask: lower bound of the per-token ratio") \
    X(algo, token_mask_high, FLOAT, "5.0", 1, 1e6, NULL, "token_mask: upper bound of the per-token ratio") \
    X(algo, token_mask_stale, INT, "0", 0, 1 << 20, NULL, "token_mask: tokens more than this many weight versions old are masked (0 = no age limit)") \
    X(algo, aggregation, ENUM, "token_mean", 0, 0, "token_mean|seq_mean_token_mean|constant", "loss aggregation") \
    X(algo, agg_constant, INT, "1024", 1, 1 << 30, NULL, "token count L of the constant aggregation (Dr.GRPO)") \
    X(algo, entropy_coef, FLOAT, "0", -10, 10, NULL, "entropy bonus coefficient")                 \
    X(algo, mask_truncated, BOOL, "false", 0, 0, NULL, "overlong filtering: truncated episodes carry no loss (they still count in their group's advantages)") \
    X(algo, routing_replay, BOOL, "false", 0, 0, NULL, "train with the actor's recorded routing (R3)")

#define MTRL_CFG_WARMUP(X)                                                                          \
    X(warmup, steps, INT, "0", 0, 1e9, NULL, "supervised steps on env demo() trajectories before RL") \
    X(warmup, lr, FLOAT, "3e-3", 0, 10, NULL, "learning rate of the warm-up")                     \
    X(warmup, batch, INT, "16", 1, 1 << 20, NULL, "demo episodes per warm-up step")                 \
    X(warmup, target_loss, FLOAT, "0", 0, 1e6, NULL, "end the warm-up early once the mean loss of its last 10 steps is below this (0 = run all its steps)")

#define MTRL_CFG_STAGE(X)                                                                           \
    X(stage, context, INT, "0", 0, 1 << 30, NULL, "episode token budget of this stage (0 = [actor] max_tokens)") \
    X(stage, steps, INT, "1", 1, 1e9, NULL, "optimizer steps in this stage")                      \
    X(stage, doc_tokens, INT, "0", 0, 1 << 30, NULL, "retrieval document length (0 = [env] doc_tokens)") \
    X(stage, hops, INT, "0", 0, 4096, NULL, "corpus hops (0 = [env] hops)")                        \
    X(stage, hops_min, INT, "0", 0, 4096, NULL, "corpus hops_min (0 = [env] hops_min)")            \
    X(stage, files, INT, "0", 0, 65536, NULL, "corpus files (0 = [env] files)")                     \
    X(stage, max_obs_bytes, INT, "0", 0, 1 << 24, NULL, "cap on one tool observation (0 = [env] max_obs_bytes)") \
    X(stage, max_tool_calls, INT, "0", 0, 1000, NULL, "tool calls per episode (0 = [env] max_tool_calls)") \
    X(stage, group_size, INT, "0", 0, 4096, NULL, "episodes per task (0 = [algo] group_size)")     \
    X(stage, batch_groups, INT, "0", 0, 1 << 20, NULL, "groups per step (0 = [learner] batch_groups)") \
    X(stage, episodes_in_flight, INT, "0", 0, 1 << 20, NULL, "episodes each actor runs at once (0 = [actor] episodes_in_flight)")

// [kernels]: which kernel runs each op on a GPU and the GPU's precisions (kernels/kernel_opts.h;
// a CPU model ignores the section). The defaults are the kernels docs/kernel-lab.md and
// docs/perf.md measured best; the other choices are each op's general fallback, the precisions,
// the work splits the planner chooses (pieces, lanes) and the one form a GPU test takes as the
// default's bit-for-bit reference (kda_tile_threads = 256). Variants that measured slower left
// the tree (docs/kernel-lab.md names the commit that last had each).
#define MTRL_CFG_KERNELS(X)                                                                         \
    X(kernels, attn, ENUM, "auto", 0, 0, "auto|simt|mma", "causal attention of MLA's training and prefill forms: auto (wgmma on an H100/H200 for the naive shapes, mma elsewhere), simt (the first kernel, any shape) or mma (never wgmma)") \
    X(kernels, decode, ENUM, "auto", 0, 0, "auto|simt", "one-token decode of KDA and MLA: auto (the tiled kernels where they take the shape) or simt (the first kernels, any shape)") \
    X(kernels, kda_fwd, ENUM, "auto", 0, 0, "auto|simt", "KDA chunked forward: auto (tensor cores, v3, at K = V = 128) or simt (v2, any shape)") \
    X(kernels, kda_bwd, ENUM, "auto", 0, 0, "auto|simt", "KDA chunked backward: auto (tensor cores, v3, at K = V = 128) or simt (v2, any shape)") \
    X(kernels, kda_bwd_tile, ENUM, "auto", 0, 0, "auto|simt", "per-tile pass of the KDA backward: auto (tensor cores) or simt") \
    X(kernels, kda_tile_threads, ENUM, "512", 0, 0, "512|256", "threads per block of the KDA backward's tensor-core per-tile pass") \
    X(kernels, kda_fwd_pieces, INT, "0", 0, 8, NULL, "pieces of the v3 KDA forward overlapped with its prep (0 = planned from the SM count)") \
    X(kernels, kda_bwd_pieces, INT, "0", 0, 8, NULL, "pieces of the v3 KDA backward's state-gradient pass overlapped with the per-tile pass (0 = planned from the SM count)") \
    X(kernels, kda_seq_pieces, INT, "0", 0, 64, NULL, "sequence pieces of the chunk-parallel KDA forward, whose pieces run side by side from each piece's incoming state (0 = chosen from the heads, the length and the SM count; 1 = the sequential forward; N = N pieces)") \
    X(kernels, kda_records, ENUM, "bf16x3", 0, 0, "bf16x3|bf16", "operands of the v3 KDA forward's records: bf16x3 (split bf16, ~16 bits) or plain bf16") \
    X(kernels, moe_lanes, INT, "0", 0, 8, NULL, "CUDA streams the MoE experts' GEMMs spread over (0 = all 8, 1 = one stream)") \
    X(kernels, moe, ENUM, "auto", 0, 0, "auto|mma|wgmma", "the grouped MoE experts' row GEMMs (forward, and the backward's dm and dX) on bf16 operands: auto (wgmma + TMA on an H100/H200 above 64 rows per expert on average, mma.sync below), mma (never wgmma) or wgmma (wherever the device runs it)") \
    X(kernels, gemm, ENUM, "model", 0, 0, "model|tf32|fp32|bf16", "precision of the projection and expert GEMMs: model ([model] gemm), tf32, fp32, or bf16 operands (fp32 accumulation, fp32 master weights)") \
    X(kernels, latent, ENUM, "bf16", 0, 0, "bf16|fp32", "element type of the MLA latent caches on a GPU") \
    X(kernels, attn_operands, ENUM, "bf16", 0, 0, "bf16|fp32", "operands of the causal attention on a GPU: bf16 (the tiled kernels) or fp32 (an untiled check kernel, for comparing with an fp32 reference; needs latent = fp32)") \
    X(kernels, decode_graph, ENUM, "off", 0, 0, "on|off", "decode steps on a GPU as CUDA graphs: on (each batch size and key-length bucket recorded once, then replayed: no launch per kernel; a step that cannot be recorded runs launched) or off (launched kernel by kernel)")

#define MTRL_CFG_MAX_STAGES 16

#endif

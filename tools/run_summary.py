#!/usr/bin/env python3
"""run_summary.py RUNS_DB: what a GPU run of an experiment did, from its run store (tools/gpu_run.sh).

Prints the run's status, episodes by status, the reward per step and per 5 steps, the learner's
and the actors' rates, and per step the numbers that say why a run does or does not learn: the
learner-vs-behaviour mismatch, clipping, gradient norm, entropy, staleness.
"""
import sqlite3
import sys

c = sqlite3.connect(sys.argv[1] if len(sys.argv) > 1 else "runs.db")
q = lambda s: c.execute(s).fetchall()
print("run:", q("select id, status, round(ended - started, 1) from runs"))
print("episodes by status:", q("select status, count(*) from episodes group by status"))
print("reward by 5 steps:", q("select step/5, round(avg(value),3) from metrics where name='reward' group by step/5"))
for m in ("learner_tokens_per_s", "tokens_per_s", "episodes_per_s", "step_seconds", "publish_seconds",
          "publish_serialise_seconds", "cycle_seconds"):
    print(m, q(f"select round(avg(value),1), round(max(value),1) from metrics where name='{m}'"))
print("reward per step:", [round(v, 3) for (v,) in q("select value from metrics where name='reward' order by step")])
# Why a run does or does not learn: the learner-vs-behaviour mismatch, clipping, gradient, entropy.
for m in ("mismatch_absdiff", "mismatch_k3", "clip_low", "clip_high", "ratio", "grad_norm", "entropy", "staleness_mean"):
    print(m, "per step:", [round(v, 4) for (v,) in q(f"select value from metrics where name='{m}' order by step")])
print("events (warnings):", q("select message from events where level in ('W','E','warn','error','WARN','ERROR') limit 12"))
print("warm-up loss first/last:", q("select value from metrics where name='warmup_loss' order by step limit 1"),
      q("select value from metrics where name='warmup_loss' order by step desc limit 1"))
e = q("select reward from episodes where status in ('complete','truncated') order by started")
n = len(e) // 5
if n: print("first 20%% of episodes %.3f, last 20%% %.3f (%d episodes)" % (sum(r for (r,) in e[:n]) / n, sum(r for (r,) in e[-n:]) / n, len(e)))
# Per stage (experiments with [stage.N]): steps, mean reward and success, episode length, the
# learner's seconds per step, and the longest episode.
st = q("select m.value, count(*), round(avg(r.value), 3), round(avg(s.value), 3), round(avg(l.value), 0), "
       "round(avg(t.value), 1) from metrics m join metrics r on r.run = m.run and r.step = m.step and r.name = 'reward' "
       "join metrics s on s.run = m.run and s.step = m.step and s.name = 'success' "
       "join metrics l on l.run = m.run and l.step = m.step and l.name = 'episode_len' "
       "join metrics t on t.run = m.run and t.step = m.step and t.name = 'step_seconds' "
       "where m.name = 'stage' group by m.value order by m.value")
for (stage, steps, rew, succ, eplen, secs) in st:
    print("stage %d: %d steps, reward %s, success %s, mean episode %s tokens, learner %s s a step" %
          (stage, steps, rew, succ, eplen, secs))
if st:
    print("longest episode:", q("select max(tokens) from episodes"))
# The time split (learner/perf.h: the seconds of each cycle, logged per step), summed over the run
# and per stage: where the learner's and the actors' wall time went.
split = ("learner_wall_seconds", "learner_train_seconds", "learner_wait_seconds", "learner_publish_seconds",
         "learner_checkpoint_seconds", "actor_wall_seconds", "actor_prefill_seconds", "actor_decode_seconds",
         "actor_tools_seconds", "actor_wait_seconds")
names = ",".join("'%s'" % s for s in split)
tot = dict(q(f"select name, round(sum(value), 1) from metrics where name in ({names}) group by name"))
if tot:
    print("time split (s):", ", ".join("%s %s" % (s.replace("_seconds", ""), tot.get(s, 0)) for s in split))
    for (stage,) in q("select distinct value from metrics where name = 'stage' order by value"):
        row = dict(q(f"select m.name, round(sum(m.value), 1) from metrics m join metrics s on s.run = m.run and "
                     f"s.step = m.step and s.name = 'stage' where m.name in ({names}) and s.value = {stage} group by m.name"))
        print("  stage %d:" % stage, ", ".join("%s %s" % (s.replace("_seconds", ""), row.get(s, 0)) for s in split))

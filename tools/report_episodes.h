// report_episodes.h: the sections of `mtrl report` (tools/cmd_report.c) read from a run's
// episodes and tool calls rather than its metrics.
//
// Example episodes: for each run, a few episodes to look at, each with the command that replays
// it (`mtrl replay --db DB --run R --episode ID`): the latest rewarded ones, the latest
// unrewarded complete or truncated ones, and the latest aborted or rejected ones with their
// reason. Rows carry data-episode, data-run and data-kind (rewarded, unrewarded, failed).
// Pictures: when an example episode saw pictures (env ABI 1.1, docs/multimodal.md), each is read
// from its trajectory file and written beside the page as dir/ep-RUN-EPISODE-I.png, shown under
// the table in a <figure data-episode=...> with its size; a trajectory that cannot be read is
// said in the figure's place.
//
// Tools: one row per tool name: calls, calls with an error (and their share), mean and largest
// latency, mean bytes in and out, for the REPORT_TOOLS_MAX most called names (a tool name is
// what the model wrote: a model still learning the format invents many), then one row of the
// others summed. Rows carry data-tool (escaped), data-calls and data-errors. Text that came from
// a model or an env is escaped as in the logs (common/log.h).
#ifndef MTRL_TOOLS_REPORT_EPISODES_H
#define MTRL_TOOLS_REPORT_EPISODES_H

#include <stdint.h>
#include <stdio.h>

#include "common/store.h"

#define REPORT_EXAMPLES_PER_KIND 3
#define REPORT_TOOLS_MAX 12

void report_write_examples(FILE *f, mtrl_store *s, const char *dbpath, const char *dir, int64_t run);
void report_write_tools(FILE *f, mtrl_store *s, int64_t run);

#endif

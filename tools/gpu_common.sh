# gpu_common.sh: sourced by the tools/gpu_issue*.sh scripts on the GPU machine. Sets repo (the
# checkout), out ($OUT, created), b (the carried mtrl binary), LD_LIBRARY_PATH (the carried
# shared libraries the machine lacks), t_end (DEADLINE_S seconds from now, default $1) and
# left() (seconds until t_end), so that each script's steps share one deadline rule.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo=$PWD
out=${OUT:-/tmp/out}
mkdir -p "$out"
export LD_LIBRARY_PATH=$repo/.carry/dev/lib:${LD_LIBRARY_PATH:-}
b=$repo/.carry/dev/mtrl
t_end=$(( $(date +%s) + ${DEADLINE_S:-$1} ))
left() { echo $(( t_end - $(date +%s) )); }

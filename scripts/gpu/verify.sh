#!/usr/bin/env bash
# The H200 verification as one detached pipeline that outlives a device call, so the JIT build,
# the conformance runs and the benchmark go on across 10-minute calls. From the repository root:
#
#     scripts/gpu/verify.sh OUT_DIR [WAIT_S]
#
# The first call snapshots the checkout into build/gpu-tree (so files that change in the
# checkout between calls cannot change a run half-way) and starts scripts/gpu/pipeline.sh from
# there in its own session (results under build/gpu-run/); every call then waits up to WAIT_S
# seconds (default 540) for it to finish,
# prints its progress and packs build/gpu-run into OUT_DIR/run.tgz. Call it again, on the same
# machine, until it prints "pipeline: finished". A finished pipeline is not started again; remove
# build/gpu-run to start over. PIPELINE=features runs scripts/gpu/features_pipeline.sh (the model
# features and whole models), PIPELINE=round scripts/gpu/round_pipeline.sh (the boundary,
# core and serving verification), PIPELINE=followup scripts/gpu/followup_pipeline.sh (what
# the round left undone) and PIPELINE=backends scripts/gpu/backends_pipeline.sh (torch-varlen,
# fa4 and attention sinks) instead of scripts/gpu/pipeline.sh.
set -u
out=${1:?usage: scripts/gpu/verify.sh OUT_DIR [WAIT_S]}
wait_s=${2:-540}
case ${PIPELINE:-full} in
    full) script=scripts/gpu/pipeline.sh ;;
    features) script=scripts/gpu/features_pipeline.sh ;;
    round) script=scripts/gpu/round_pipeline.sh ;;
    followup) script=scripts/gpu/followup_pipeline.sh ;;
    backends) script=scripts/gpu/backends_pipeline.sh ;;
    *)
        echo "verify.sh: PIPELINE must be full, features, round, followup or backends, not" \
            "'$PIPELINE'" >&2
        exit 2
        ;;
esac
run_dir=build/gpu-run
mkdir -p "$out" "$run_dir"
pack() { tar czf "$out/run.tgz" "$run_dir"; }
trap pack EXIT

if [ -f "$run_dir/finished" ]; then
    echo "pipeline: finished earlier"
elif [ -f "$run_dir/pid" ] && kill -0 "$(cat "$run_dir/pid")" 2>/dev/null; then
    echo "pipeline: running since $(stat -c %y "$run_dir/pid")"
else
    tree=build/gpu-tree
    rm -rf "$tree" && mkdir -p "$tree"
    tar --exclude=./build --exclude=./.git -cf - . | tar -xf - -C "$tree"
    abs_run=$(cd "$run_dir" && pwd)
    rm -f "$run_dir/pid"
    # The pipeline writes its own pid: under job control `setsid` forks, and `$!` would be
    # the pid of a process that has already exited (a later call would start a second run).
    (cd "$tree" && setsid nohup bash "$script" "$abs_run" \
        >"$abs_run/pipeline.log" 2>&1 </dev/null &)
    for _ in $(seq 50); do [ -s "$run_dir/pid" ] && break; sleep 0.1; done
    echo "pipeline: started (pid $(cat "$run_dir/pid" 2>/dev/null || echo unknown))"
fi

shown=0
while [ "$SECONDS" -lt "$wait_s" ] && [ ! -f "$run_dir/finished" ]; do
    kill -0 "$(cat "$run_dir/pid")" 2>/dev/null || { echo "pipeline: died"; break; }
    lines=$(wc -l <"$run_dir/pipeline.log")
    if [ "$lines" -gt "$shown" ]; then
        tail -n +"$((shown + 1))" "$run_dir/pipeline.log" | grep -E '^\[|s \[|rc=|PASS|FAIL' | tail -8
        shown=$lines
    fi
    sleep 5
done
[ -f "$run_dir/finished" ] && echo "pipeline: finished" || echo "pipeline: still running"
echo "--- pipeline.log"; tail -40 "$run_dir/pipeline.log"
[ -f "$run_dir/prebuild.log" ] && { echo "--- prebuild.log"; tail -4 "$run_dir/prebuild.log"; }
for times in "$run_dir"/conformance*/times.txt; do
    [ -f "$times" ] && { echo "--- $(dirname "$times")"; cat "$times"; }
done

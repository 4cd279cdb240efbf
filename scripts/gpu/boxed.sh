# Time-boxed steps for the GPU round scripts (serving_round.sh, fa4_round.sh). Source it with
# the output folder in $out: `step TEXT` appends "[seconds since sourcing] TEXT" to
# $out/steps.log, and `boxed SECONDS NAME COMMAND...` runs the command under `timeout`, its
# output in $out/NAME.log, and records its exit status as a step (124: cut by the box), so a
# call cut short keeps every earlier step's log.
export PYTHONUNBUFFERED=1
start=$(date +%s)
step() { echo "[$(($(date +%s) - start)) s] $*" | tee -a "$out/steps.log"; }
boxed() {
    local seconds=$1 name=$2
    shift 2
    timeout "$seconds" "$@" >"$out/$name.log" 2>&1
    step "$name rc=$?"
}

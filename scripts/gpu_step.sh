# Sourced by the GPU session scripts: `step NAME LIMIT_S COMMAND...` runs COMMAND under `timeout` with its log in
# $OUT/NAME.log and prints its tail; a step not named in $STEPS (when set) is skipped, and so is one that the
# call's $BUDGET_S no longer leaves 20 s for (a call cut by the device's limit loses its logs).
START_S=$(date +%s)
step() {  # step NAME LIMIT_S COMMAND...
    local name=$1 limit=$2 left
    shift 2
    if [ -n "${STEPS:-}" ] && [[ ",$STEPS," != *",$name,"* ]]; then return; fi
    left=$((BUDGET_S - ($(date +%s) - START_S)))
    if [ "$left" -lt 20 ]; then echo "SKIP $name: ${left}s left"; return; fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "[$(($(date +%s) - START_S))s] START $name (limit ${limit}s): $*"
    timeout --kill-after=5 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?  # before any other command substitution resets $?
    echo "[$(($(date +%s) - START_S))s] END $name rc=$rc"
    grep -v USDT "$OUT/$name.log" | tail -"${TAIL:-40}"
}

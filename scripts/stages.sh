# Stage timing for scripts/test.sh (sourced, not run).
#
#   stage NAME COMMAND...     runs COMMAND as stage NAME: its output goes to
#                             the terminal and to build/test-logs/<NAME>.log
#   stage_bg NAME COMMAND...  starts it in the background instead, its output
#                             to the log only
#   stage_wait                waits for the background stages, records them,
#                             prints the log of each that failed, and fails
#                             if one did
#
# When the script exits, passed or failed, a table of every stage's seconds,
# status and test count is printed, and written as JSON to $stages_json when
# that is set. A stage under way when the script exits is recorded as failed
# (a background one is stopped first).

stage_names=()
stage_seconds=()
stage_status=()
stage_counts=()
stage_current=""
stage_start=0
stage_bg_names=()
stage_bg_pids=()
stages_json=""
stages_begin=$(date +%s.%N)
stages_log_dir=build/test-logs

stage_log() { # the log file of stage $1
  echo "$stages_log_dir/$(echo "$1" | tr -c 'A-Za-z0-9_.\n-' '_').log"
}

# The tests a stage's log reports: ctest's "out of N", pytest's summary
# ("N passed, M skipped, ..."), libFuzzer's executions; empty otherwise.
stage_count() {
  local log=$1
  [ -f "$log" ] || return 0
  local line
  line=$(grep -Eo 'tests? failed out of [0-9]+' "$log" | tail -1 | grep -Eo '[0-9]+$') || true
  if [ -n "$line" ]; then echo "$line ctest tests"; return 0; fi
  line=$(grep -E '^[=]* ?[0-9]+ (passed|failed)' "$log" | tail -1 | sed -E 's/ in [0-9.]+s.*//; s/=//g; s/^ +//') || true
  if [ -n "$line" ]; then echo "$line"; return 0; fi
  line=$(grep -Eo 'clean: [0-9]+ executions' "$log" | tail -1 | sed 's/clean: //') || true
  echo "$line"
}

stage_record() { # stage_record STATUS: ends the current stage
  local now
  now=$(date +%s.%N)
  stage_names+=("$stage_current")
  stage_seconds+=("$(awk -v a="$stage_start" -v b="$now" 'BEGIN { printf "%.1f", b - a }')")
  stage_status+=("$1")
  stage_counts+=("$(stage_count "$(stage_log "$stage_current")")")
  stage_current=""
}

stage() {
  local name=$1
  shift
  mkdir -p "$stages_log_dir"
  echo "== $name"
  stage_current=$name
  stage_start=$(date +%s.%N)
  "$@" 2>&1 | tee "$(stage_log "$name")"
  stage_record passed
}

stage_bg() {
  local name=$1
  shift
  mkdir -p "$stages_log_dir"
  echo "== $name (in the background)"
  local log
  log=$(stage_log "$name")
  (
    begin=$(date +%s.%N)
    status=passed
    "$@" >"$log" 2>&1 || status=failed
    echo "$begin $(date +%s.%N) $status" >"$log.status"
  ) &
  stage_bg_names+=("$name")
  stage_bg_pids+=($!)
}

stage_wait() {
  local i name log begin end status failed=0
  for i in "${!stage_bg_names[@]}"; do
    name=${stage_bg_names[$i]}
    log=$(stage_log "$name")
    wait "${stage_bg_pids[$i]}" || true
    { read -r begin end status <"$log.status"; } 2>/dev/null || { begin=0 end=0 status=failed; }
    rm -f "$log.status"
    stage_names+=("$name")
    stage_seconds+=("$(awk -v a="$begin" -v b="$end" 'BEGIN { printf "%.1f", b - a }')")
    stage_status+=("$status")
    stage_counts+=("$(stage_count "$log")")
    echo "== $name: $status (${stage_seconds[-1]} s)"
    if [ "$status" != passed ]; then
      failed=1
      echo "-- the end of $log:"
      tail -n 40 "$log"
    fi
  done
  stage_bg_names=()
  stage_bg_pids=()
  return "$failed"
}

stages_kill_tree() { # stops process $1 and its descendants
  local child
  for child in $(pgrep -P "$1"); do stages_kill_tree "$child"; done
  kill "$1" 2>/dev/null || true
}

stages_machine() { # one line: CPU model, cores, the vector flags
  local model flags
  model=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)
  flags=$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' |
    grep -E '^(avx2|fma|avx512f|avx512_bf16|avx512_fp16|avx512_vnni|amx_tile|amx_bf16|amx_int8)$' |
    tr '\n' ' ' | sed 's/ $//')
  echo "$model, $(nproc) cores, flags: $flags"
}

stages_report() {
  local rc=$?
  if [ -n "$stage_current" ]; then stage_record failed; fi
  if ((${#stage_bg_pids[@]})); then
    for i in "${stage_bg_pids[@]}"; do stages_kill_tree "$i"; done
    stage_wait >/dev/null || true
  fi
  local total result machine i
  total=$(awk -v a="$stages_begin" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  result=passed
  if [ "$rc" -ne 0 ]; then result=failed; fi
  machine=$(stages_machine)
  echo
  echo "== stages ($result, ${total} s in all; $machine)"
  printf '%-28s %9s  %-7s %s\n' stage seconds status tests
  for i in "${!stage_names[@]}"; do
    printf '%-28s %9s  %-7s %s\n' "${stage_names[$i]}" "${stage_seconds[$i]}" \
      "${stage_status[$i]}" "${stage_counts[$i]}"
  done
  if [ -n "$stages_json" ]; then
    {
      printf '{"status":"%s","seconds":%s,"machine":"%s","ci":%s,"stages":[' \
        "$result" "$total" "$machine" "$([ -n "${CI:-}" ] && echo true || echo false)"
      for i in "${!stage_names[@]}"; do
        ((i == 0)) || printf ','
        printf '\n{"name":"%s","seconds":%s,"status":"%s","tests":"%s"}' "${stage_names[$i]}" \
          "${stage_seconds[$i]}" "${stage_status[$i]}" "${stage_counts[$i]}"
      done
      printf '\n]}\n'
    } >"$stages_json"
    echo "(written to $stages_json)"
  fi
  return "$rc"
}
trap stages_report EXIT

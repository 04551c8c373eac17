# Machine-load helpers shared by the benchmark scripts (source it). QUIET_WAIT (seconds) bounds wait_quiet;
# LOAD_WINDOW_S (default 1) is how long cpu_busy watches (quick mode: 0.1).
cpu_busy() {  # percent of all CPUs busy over LOAD_WINDOW_S seconds
  local a1 a2 a3 a4 a5 a6 a7 a8 b1 b2 b3 b4 b5 b6 b7 b8
  read -r _ a1 a2 a3 a4 a5 a6 a7 a8 _ </proc/stat
  sleep "${LOAD_WINDOW_S:-1}"
  read -r _ b1 b2 b3 b4 b5 b6 b7 b8 _ </proc/stat
  local busy=$(((b1 + b2 + b3 + b6 + b7 + b8) - (a1 + a2 + a3 + a6 + a7 + a8)))
  local idle=$(((b4 + b5) - (a4 + a5)))
  echo $((100 * busy / (busy + idle + 1)))
}
wait_quiet() {  # until the CPUs are < 15% busy, at most QUIET_WAIT s; prints the last reading
  local t=0 b
  b=$(cpu_busy)
  while ((b >= 15 && t < ${QUIET_WAIT:-60})); do
    sleep 2
    t=$((t + 3))
    b=$(cpu_busy)
  done
  echo "$b"
}
stat_busy() { awk '/^cpu /{print $2 + $3 + $4 + $7 + $8 + $9}' /proc/stat; }  # busy jiffies, all CPUs
HZ=$(getconf CLK_TCK)

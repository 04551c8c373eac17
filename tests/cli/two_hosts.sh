#!/usr/bin/env bash
# Two "hosts" on one machine: network namespaces A and B joined by a veth pair (10.231.0.1 in A,
# 10.231.0.2 in B). Rank 0 runs in A, rank 1 in B, started by hand over gloo with MASTER_ADDR=10.231.0.1
# (the other host, for rank 1) and a PIPETRAIN_RUN_TOKEN. Run by tests/cli/test_two_hosts.cpp.
#
#   two_hosts.sh PIPETRAIN_BIN same    the losses equal a single-host run's, bitwise; rank 0's rendezvous
#                                      store listens on 10.231.0.1 only (ss -ltn in A), not 0.0.0.0 or *;
#                                      a rank 0 without PIPETRAIN_RUN_TOKEN warns that its store takes anyone
#   two_hosts.sh PIPETRAIN_BIN netem   the same with 10 ms delay and 1% loss on the link (tc netem)
#   two_hosts.sh PIPETRAIN_BIN cut     the link goes down mid-training: both ranks exit non-zero within
#                                      20 s, each naming the other as the lost rank
#
# Exit 0: passed; 77: skipped (the reason on the last line: not root, no namespaces, no netem); other:
# failed (the ranks' output is printed). Only addresses inside the two namespaces it creates are used,
# and the namespaces (with the veth pair) are removed on every exit path.
set -u
BIN=${1:?usage: two_hosts.sh PIPETRAIN_BIN same|netem|cut}
MODE=${2:?usage: two_hosts.sh PIPETRAIN_BIN same|netem|cut}

skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; for f in "$WORK"/*.txt; do [[ -f $f ]] && { echo "--- $f"; cat "$f"; }; done; exit 1; }

[[ $(id -u) -eq 0 ]] || skip "network namespaces need root (ip netns); run as root to test two hosts"
command -v ip >/dev/null || skip "ip (iproute2) not found"
command -v ss >/dev/null || skip "ss (iproute2) not found"

TAG=pt$$
A=${TAG}a
B=${TAG}b
VA=${TAG}va
VB=${TAG}vb
ADDR_A=10.231.0.1
ADDR_B=10.231.0.2
PORT=29531
WORK=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null; done
  wait 2>/dev/null
  ip netns del "$A" 2>/dev/null
  ip netns del "$B" 2>/dev/null
  ip link del "$VA" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

ip netns add "$A" 2>"$WORK/err" || skip "cannot create a network namespace: $(cat "$WORK/err")"
ip netns add "$B" || skip "cannot create a second network namespace"
ip link add "$VA" type veth peer name "$VB" 2>"$WORK/err" || skip "cannot create a veth pair: $(cat "$WORK/err")"
ip link set "$VA" netns "$A" && ip link set "$VB" netns "$B" || fail "cannot move the veth ends"
ip -n "$A" addr add "$ADDR_A/24" dev "$VA" && ip -n "$B" addr add "$ADDR_B/24" dev "$VB" || fail "addresses"
for ns in "$A" "$B"; do ip -n "$ns" link set lo up; done
ip -n "$A" link set "$VA" up && ip -n "$B" link set "$VB" up || fail "links up"
ip netns exec "$A" ping -c 1 -W 2 "$ADDR_B" >/dev/null 2>&1 || sleep 1  # the veth may need a moment

if [[ $MODE == netem ]]; then
  ip netns exec "$A" tc qdisc add dev "$VA" root netem delay 10ms loss 1% 2>"$WORK/err" ||
    skip "tc netem is not available here ($(cat "$WORK/err" | head -1); the sch_netem kernel module is missing?)"
  ip netns exec "$B" tc qdisc add dev "$VB" root netem delay 10ms loss 1% || fail "netem on B"
fi

TRAIN=(train --model mlp --data synthetic --stages 2)
TOKEN=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
# rank NS RANK STEPS: starts one rank in the background.
rank() {
  ip netns exec "$1" env -u PIPETRAIN_LAUNCHER_STORE RANK="$2" WORLD_SIZE=2 MASTER_ADDR="$ADDR_A" MASTER_PORT=$PORT \
    PIPETRAIN_RUN_TOKEN="$TOKEN" PIPETRAIN_HEARTBEAT_TIMEOUT=5 PIPETRAIN_RENDEZVOUS_TIMEOUT=20 \
    timeout 50 "$BIN" "${TRAIN[@]}" --steps "$3" --log "$WORK/log$2.jsonl" >"$WORK/rank$2.txt" 2>&1 &
  PIDS+=($!)
}
losses() { grep -o '"loss":[^,}]*' "$1"; }

case $MODE in
  same | netem)
    STEPS=20
    timeout 50 "$BIN" "${TRAIN[@]}" --steps $STEPS --log "$WORK/ref.jsonl" >"$WORK/single-host.txt" 2>&1 ||
      fail "the single-host run failed"
    rank "$A" 0 $STEPS
    # Rank 1 starts late: rank 0's store is up, and its listening address can be checked meanwhile.
    listen=""
    for _ in $(seq 50); do
      listen=$(ip netns exec "$A" ss -ltnH "sport = :$PORT")
      [[ -n $listen ]] && break
      sleep 0.1
    done
    [[ -n $listen ]] || fail "rank 0 does not listen on port $PORT in namespace A"
    echo "$listen" | grep -q "$ADDR_A:$PORT" || fail "rank 0's store does not listen on $ADDR_A: $listen"
    echo "$listen" | grep -qE '(0\.0\.0\.0|\*|\[::\]):'"$PORT" && fail "rank 0's store listens on every interface: $listen"
    rank "$B" 1 $STEPS
    wait "${PIDS[0]}" || fail "rank 0 exited with $?"
    wait "${PIDS[1]}" || fail "rank 1 exited with $?"
    [[ $(losses "$WORK/log0.jsonl" | wc -l) -eq $STEPS ]] || fail "rank 0 logged $(losses "$WORK/log0.jsonl" | wc -l) of $STEPS steps"
    diff <(losses "$WORK/ref.jsonl") <(losses "$WORK/log0.jsonl") >"$WORK/diff.txt" ||
      fail "the two-host losses differ from the single-host run's"
    if [[ $MODE == same ]]; then
      # Without PIPETRAIN_RUN_TOKEN the store takes any client: rank 0 says so when it is off loopback.
      ip netns exec "$A" env -u PIPETRAIN_LAUNCHER_STORE -u PIPETRAIN_RUN_TOKEN RANK=0 WORLD_SIZE=2 \
        MASTER_ADDR="$ADDR_A" MASTER_PORT=$((PORT + 1)) PIPETRAIN_RENDEZVOUS_TIMEOUT=1 \
        timeout 30 "$BIN" "${TRAIN[@]}" --steps 1 >"$WORK/no-token.txt" 2>&1
      grep -q "warning: PIPETRAIN_RUN_TOKEN is not set, so the rendezvous store at $ADDR_A:$((PORT + 1)) accepts any" \
        "$WORK/no-token.txt" || fail "rank 0 without a token off loopback did not warn"
    fi
    echo "PASS ($MODE): $STEPS losses equal the single-host run's; the store listens on $ADDR_A:$PORT only"
    ;;
  cut)
    rank "$A" 0 1000000
    rank "$B" 1 1000000
    for _ in $(seq 300); do
      [[ -f $WORK/log0.jsonl && $(wc -l <"$WORK/log0.jsonl") -ge 3 ]] && break
      sleep 0.1
    done
    [[ $(wc -l <"$WORK/log0.jsonl" 2>/dev/null || echo 0) -ge 3 ]] || fail "training did not start within 30 s"
    ip -n "$A" link set "$VA" down
    cut_at=$(date +%s.%N)
    codes=()
    for i in 0 1; do
      wait "${PIDS[$i]}"
      codes+=($?)
    done
    took=$(echo "$(date +%s.%N) - $cut_at" | bc 2>/dev/null || python3 -c "print($(date +%s.%N) - $cut_at)")
    for i in 0 1; do
      [[ ${codes[$i]} -ne 0 ]] || fail "rank $i exited 0 after the link was cut"
      [[ ${codes[$i]} -ne 124 ]] || fail "rank $i hung: killed by timeout 50 s"
    done
    grep -q "rank 0: stopping: rank 1 failed" "$WORK/rank0.txt" || fail "rank 0 does not name rank 1 as lost"
    grep -q "rank 1: stopping: rank 0 failed" "$WORK/rank1.txt" || fail "rank 1 does not name rank 0 as lost"
    awk -v t="$took" 'BEGIN { exit !(t < 20) }' || fail "the ranks took $took s to stop after the cut (bound: 20 s)"
    echo "PASS (cut): both ranks exited non-zero ${took} s after the cut, naming each other"
    sed -n 's/^/  /; /stopping/p' "$WORK/rank0.txt" "$WORK/rank1.txt"
    ;;
  *) echo "unknown mode $MODE: use same, netem or cut"; exit 2 ;;
esac

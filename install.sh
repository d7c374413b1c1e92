#!/usr/bin/env bash
# Installs everything pp needs into ./.venv: clang (tinygrad compiles CPU kernels with it),
# the Python packages, and the Llama 3 tokenizer file the tests use. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")"
if ! command -v clang >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq clang
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q -r requirements-test.txt
# llama-models ships Meta's Llama 3 tokenizer file; its own dependencies are not needed for that.
.venv/bin/pip install -q --no-deps llama-models

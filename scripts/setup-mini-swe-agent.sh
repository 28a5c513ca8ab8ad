#!/usr/bin/env bash
# A virtualenv with mini-swe-agent, unmodified from PyPI, for the mini-swe-agent harness
# (configs/harness-mini-swe-agent.toml). Usage: scripts/setup-mini-swe-agent.sh [VENV]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-$here/.venv-mswea}
uv=${UV:-$here/.venv/bin/uv}
[ -x "$uv" ] || uv=uv
rm -rf "$venv"
"$uv" venv -q -p 3.11 "$venv"
"$uv" pip install -q --python "$venv/bin/python" "mini-swe-agent==2.4.6"

#!/usr/bin/env bash
# kiln command harness: one episode of mini-swe-agent (unmodified, from PyPI, in its own
# virtualenv) against this episode's OpenAI-compatible endpoint, its shell commands run
# in the episode's sandbox by kiln's environment class (services/rollout/.../ext/kiln_mswea.py).
# kiln sets OPENAI_BASE_URL, OPENAI_API_KEY, KILN_EXEC_URL and KILN_PROBLEM_STATEMENT.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=${KILN_MSWEA_VENV:-$here/.venv-mswea}
if [ ! -x "$venv/bin/mini" ]; then
  flock "$here/.venv-mswea.lock" bash -c "[ -x '$venv/bin/mini' ] || '$here/scripts/setup-mini-swe-agent.sh' '$venv'"
fi
cfg=$(mktemp -d)
trap 'rm -rf "$cfg"' EXIT
export PYTHONPATH="$here/services/rollout/src/kiln/rollout/harness/ext" MSWEA_CONFIGURED=true MSWEA_SILENT_STARTUP=1 \
  MSWEA_COST_TRACKING=ignore_errors LITELLM_LOCAL_MODEL_COST_MAP=True MSWEA_GLOBAL_CONFIG_DIR="$cfg"
"$venv/bin/mini" -c mini.yaml -c "$here/configs/mini-swe-agent.yaml" \
  -c "model.model_kwargs.api_base=$OPENAI_BASE_URL" -c "model.model_kwargs.api_key=$OPENAI_API_KEY" \
  -t "$KILN_PROBLEM_STATEMENT" -y --exit-immediately -o "$cfg/trajectory.json"
# mini exits 0 when its agent stopped (submitted or out of steps): its exit status is kept
python3 -c "import json,sys; print('mini-swe-agent exit status:', json.load(open(sys.argv[1]))['info']['exit_status'])" "$cfg/trajectory.json"

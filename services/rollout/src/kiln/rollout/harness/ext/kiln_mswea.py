"""mini-swe-agent's commands, run in kiln's sandbox: an environment class for an
unmodified mini-swe-agent (``--environment-class kiln_mswea.KilnEnvironment``).

Loaded by mini-swe-agent from its own virtualenv (this folder on ``PYTHONPATH``), so it
uses the standard library and mini-swe-agent only. Each ``execute`` is one call of the
episode's exec bridge (``KILN_EXEC_URL``, the episode's key in ``OPENAI_API_KEY``): the
command runs in the episode's env-pool sandbox, never on the harness's machine. Like
mini-swe-agent's own environments, output whose first line is
``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` (exit 0) ends the episode (``Submitted``).
"""

import json
import os
import platform
import urllib.error
import urllib.request

from minisweagent.exceptions import Submitted

SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


class KilnEnvironment:
    def __init__(self, *, timeout: int = 60, cwd: str = "", env: dict | None = None, **_ignored):
        self.timeout = timeout
        self.url = os.environ["KILN_EXEC_URL"]
        self.key = os.environ["OPENAI_API_KEY"]

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict:
        command = action.get("command", "") if isinstance(action, dict) else str(action)
        limit = float(timeout or self.timeout)
        body = json.dumps({"command": command, "timeout_s": limit}).encode()
        req = urllib.request.Request(
            f"{self.url}/exec",
            data=body,
            method="POST",
            headers={"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=limit + 30) as r:
                res = json.loads(r.read())
        except (urllib.error.URLError, OSError) as e:
            return {"output": "", "returncode": -1, "exception_info": f"the sandbox could not run the command: {e}"}
        output = {
            "output": res.get("stdout", "") + res.get("stderr", ""),
            "returncode": res.get("exit_code", -1),
            "exception_info": "the command timed out" if res.get("timed_out") else "",
        }
        lines = output["output"].lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT and output["returncode"] == 0:
            submission = "".join(lines[1:])
            raise Submitted(
                {"role": "exit", "content": submission, "extra": {"exit_status": "Submitted", "submission": submission}}
            )
        return output

    def get_template_vars(self, **kwargs) -> dict:
        return {"cwd": "/workspace", "timeout": self.timeout, **platform.uname()._asdict(), **kwargs}

    def serialize(self) -> dict:
        return {
            "info": {
                "config": {"environment": {"timeout": self.timeout}, "environment_type": "kiln_mswea.KilnEnvironment"}
            }
        }

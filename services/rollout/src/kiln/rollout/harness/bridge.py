"""``kiln-exec``: run a command in the episode's sandbox, from any harness process.

    kiln-exec [--timeout S] COMMAND...      (or the command on stdin with ``-``)

Reads ``KILN_EXEC_URL`` and ``OPENAI_API_KEY`` (the episode's key) as a command harness
gets them; prints the command's stdout to stdout and its stderr to stderr, and exits
with its exit code (124 when it timed out, 125 when the bridge itself failed). Standard
library only, so any Python (a harness's own virtualenv) runs it as a script.
"""

import json
import os
import sys
import urllib.error
import urllib.request


def run(command: str, timeout_s: float, url: str, key: str) -> dict:
    body = json.dumps({"command": command, "timeout_s": timeout_s}).encode()
    req = urllib.request.Request(
        f"{url}/exec",
        data=body,
        method="POST",
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout_s + 30) as r:
        return json.loads(r.read())


def main(argv=None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    timeout = 60.0
    if args[:1] == ["--timeout"]:
        timeout, args = float(args[1]), args[2:]
    command = sys.stdin.read() if args == ["-"] else " ".join(args)
    url, key = os.environ.get("KILN_EXEC_URL"), os.environ.get("KILN_EPISODE_KEY") or os.environ.get("OPENAI_API_KEY")
    if not command.strip() or not url or not key:
        print(
            "kiln-exec: needs a command, KILN_EXEC_URL and OPENAI_API_KEY (a kiln harness sets both)", file=sys.stderr
        )
        return 125
    try:
        r = run(command, timeout, url, key)
    except (urllib.error.URLError, OSError, ValueError) as e:
        detail = e.read().decode(errors="replace") if isinstance(e, urllib.error.HTTPError) else str(e)
        print(f"kiln-exec: the bridge failed: {detail}", file=sys.stderr)
        return 125
    sys.stdout.write(r.get("stdout", ""))
    sys.stderr.write(r.get("stderr", ""))
    return 124 if r.get("timed_out") else int(r.get("exit_code", 125)) & 0xFF


if __name__ == "__main__":
    sys.exit(main())

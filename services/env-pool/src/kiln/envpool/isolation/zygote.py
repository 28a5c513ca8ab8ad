"""The sandbox spawner's child side: a tiny process that forks sandbox commands.

Run as ``python -I -S zygote.py FD`` by ``spawner.py``: standard library only, so it
stays a few MB and a fork of it is cheap (a fork of env-pool, with its imports and
heap, cost several times more). For each request it forks; the child joins the
sandbox's cgroups, takes its rlimits, drops to its uid and gid, wires the given pipes
to stdin/stdout/stderr, opens the request's ``files`` at fds 3, 4, ... and execs the
command. The zygote reports the pid, then the exit status once it has reaped the
child. It exits when env-pool closes the socket.

Protocol (SOCK_SEQPACKET, one JSON object per packet):
  request  {"id", "argv", "env", "cwd", "cgroups": [procs files], "rlimits": [[res, n]],
            "uid", "gid", "files": [paths]} with three fds (stdin, stdout, stderr) attached
  replies  {"id", "pid"} | {"id", "error"}   then   {"id", "exit": status}
"""

import json
import os
import resource
import select
import signal
import socket
import sys


def child(req, fds):
    try:
        # Python ignores SIGPIPE and SIGXFSZ, and ignored signals survive exec: give the
        # command the defaults it expects (`yes | head` ends; a too-big file kills).
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        os.setsid()
        for procs in req["cgroups"]:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        for res, value in req["rlimits"]:
            resource.setrlimit(res, (value, value))
        if req["uid"] is not None:
            os.setgroups([])
            os.setgid(req["gid"])
            os.setuid(req["uid"])
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(3, 65536)
        for target, path in enumerate(req.get("files", ()), 3):  # the uid's own right to read them
            fd = os.open(path, os.O_RDONLY)
            if fd != target:
                os.dup2(fd, target)  # inheritable
                os.close(fd)
            else:
                os.set_inheritable(fd, True)  # Python opens close-on-exec
        if req["cwd"]:
            os.chdir(req["cwd"])
        os.execve(req["argv"][0], req["argv"], req["env"])
    except BaseException as e:  # report through stderr: the parent sees exit 127 and why
        try:
            os.write(2, f"sandbox spawner: {type(e).__name__}: {e}\n".encode())
        finally:
            os._exit(127)


def main():
    sock = socket.socket(fileno=int(sys.argv[1]))
    # Self-pipe: SIGCHLD writes a byte here, so select() wakes for every exit, even one
    # that happens just before select() starts.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    running = {}  # pid -> request id
    while True:
        try:
            ready, _, _ = select.select([sock, wake_r], [], [], 5.0)
        except InterruptedError:
            ready = []
        if wake_r in ready:
            try:
                while os.read(wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        if sock in ready:
            msg, fds, _flags, _addr = socket.recv_fds(sock, 1 << 20, 3)
            if not msg:
                return
            req = json.loads(msg)
            try:
                pid = os.fork()
            except OSError as e:
                for fd in fds:
                    os.close(fd)
                sock.send(json.dumps({"id": req["id"], "error": str(e)}).encode())
                continue
            if pid == 0:
                child(req, fds)
            for fd in fds:
                os.close(fd)
            running[pid] = req["id"]
            sock.send(json.dumps({"id": req["id"], "pid": pid}).encode())
        while running:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            rid = running.pop(pid, None)
            if rid is not None:
                sock.send(json.dumps({"id": rid, "exit": os.waitstatus_to_exitcode(status)}).encode())


if __name__ == "__main__":
    main()

"""A tiny init that runs inside the sandbox: it starts the agent, forwards signals to the
agent's process group, and reports the agent's real wait status.

Through bwrap a killed agent would only show as exit 137; this init writes
`{"exit": N}` or `{"signal": N}` to the status file descriptor instead. SIGTERM, SIGINT
and SIGHUP are forwarded as they are; SIGUSR1 means "SIGKILL the agent's group".
Standard library only: it runs on the sandbox's own /usr/bin/python3.

    python3 init.py --status-fd N [--oom-score-adj K] -- COMMAND ARGS...
"""

import contextlib
import json
import os
import signal
import subprocess
import sys


def main(argv):
    status_fd, oom, command = None, None, []
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg == "--status-fd":
            status_fd = int(args.pop(0))
        elif arg == "--oom-score-adj":
            oom = args.pop(0)
        elif arg == "--":
            command = args
            break
    if oom is not None:  # raised (never lowered): the OOM killer's preferred victims
        with open("/proc/self/oom_score_adj", "w") as handle:
            handle.write(oom)
    try:
        child = subprocess.Popen(command, process_group=0)
    except OSError as error:
        report(status_fd, {"spawn_error": str(error)})
        return 127

    def forward(signum, _frame):
        target = signal.SIGKILL if signum == signal.SIGUSR1 else signum
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, target)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(signum, forward)
    code = child.wait()
    report(status_fd, {"signal": -code} if code < 0 else {"exit": code})
    return 0


def report(fd, status):
    if fd is not None:
        os.write(fd, (json.dumps(status) + "\n").encode())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

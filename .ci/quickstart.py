"""Prove README's first command on a fresh clone, as a new user would run it.

    python3 .ci/quickstart.py [--rev REV] [--keep]

1. `git clone` this repository (at REV, default HEAD) into a temporary directory: a fresh clone
   with its own `.venv`, so nothing the test venv installs (pytest, triton, …) can hide a
   missing runtime dependency.
2. Run README's first ```bash block there verbatim, with ` --port N` appended (a free port), and
   a fresh empty PDSERVE_CACHE (a cold cache: the default model is converted from scratch).
3. Wait for the router's /ready, then run README's Python example (its port swapped for N) with
   the clone's own venv python: it must print an answer that mentions Paris.
4. SIGINT `pdserve up` (Ctrl-C) and require exit status 0 with every child stopped with 0.

Standard library only: it must run before anything is installed. Prints a stage log with times;
exits non-zero, with the stack's output, on any failure.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
INSTALL_TIMEOUT_S = 1200  # pip from the registries on a 2-core machine
READY_TIMEOUT_S = 600
ANSWER_TIMEOUT_S = 120
STOP_TIMEOUT_S = 90

T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[quickstart {time.monotonic() - T0:7.1f}s] {msg}", flush=True)


def readme_blocks(readme: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", readme, flags=re.S)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"FAIL: README's first command exited with {proc.returncode} before {url} was ready")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"FAIL: {url} not ready after {timeout_s:.0f}s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", default="HEAD", help="revision of this repository to clone (default HEAD)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary clone")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="pdserve-quickstart-"))
    clone = work / "pdserve"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    subprocess.run(["git", "-C", str(clone), "checkout", "-q", args.rev], check=True)
    say(f"fresh clone of {args.rev} in {clone}")

    readme = (clone / "README.md").read_text()
    first_command = readme_blocks(readme, "bash")[0].strip()
    example = next(b for b in readme_blocks(readme, "python") if "OpenAI(" in b)
    if not first_command.endswith("pdserve up"):
        raise SystemExit(f"FAIL: README's first command no longer ends with `pdserve up`:\n{first_command}")
    port = free_port()
    command = f"{first_command} --port {port}"
    say(f"README's first command: {command}")

    env = dict(os.environ, PDSERVE_CACHE=str(work / "cache"), PYTHONUNBUFFERED="1")
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)
    log = work / "up.log"
    out = open(log, "w")
    # Its own process group: the SIGINT below reaches `pdserve up` as Ctrl-C would, not pip.
    proc = subprocess.Popen(["bash", "-c", command], cwd=clone, env=env, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        t_start = time.monotonic()
        wait_ready(f"http://127.0.0.1:{port}/ready", proc, INSTALL_TIMEOUT_S + READY_TIMEOUT_S)
        say(f"router ready {time.monotonic() - t_start:.1f}s after the command started (install included)")

        script = example.replace("http://127.0.0.1:8000/v1", f"http://127.0.0.1:{port}/v1")
        if script == example:
            raise SystemExit("FAIL: README's Python example does not use http://127.0.0.1:8000/v1")
        answer = subprocess.run([str(clone / ".venv/bin/python"), "-c", script], cwd=work, env=env,
                                capture_output=True, text=True, timeout=ANSWER_TIMEOUT_S)
        if answer.returncode != 0:
            raise SystemExit(f"FAIL: README's Python example exited {answer.returncode}:\n{answer.stderr}")
        say(f"README's Python example printed: {answer.stdout.strip()!r}")
        if "Paris" not in answer.stdout:
            raise SystemExit("FAIL: the answer does not mention Paris")

        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(STOP_TIMEOUT_S)
        text = log.read_text()
        # The launcher's own lines: its banner (after /ready answers) and the stop summary.
        banner = re.search(r"pdserve up: ready in ([\d.]+)s", text)
        say(f"`pdserve up` reported ready in {banner.group(1) if banner else '?'}s on a cold model cache")
        stopped = re.search(r"stopped: (.*)", text)
        say(f"SIGINT: `pdserve up` exited {code}; {stopped.group(0) if stopped else 'no stop line'}")
        if code != 0:
            raise SystemExit(f"FAIL: `pdserve up` exited {code} on SIGINT")
        if not stopped or any(not part.endswith("=0") for part in stopped.group(1).split(", ")):
            raise SystemExit("FAIL: not every child exited 0 on SIGINT")
        say("OK")
        return 0
    except BaseException:
        print(f"---- output of README's first command ({log}) ----", flush=True)
        print(log.read_text()[-20000:], flush=True)
        raise
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.close()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

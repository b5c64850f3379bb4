"""Workers sharing a GPU: NVIDIA MPS, so their kernels run side by side instead of taking turns.

Without MPS the driver time-slices between processes: while one worker's kernels run, another's
wait for the next slice. Measured on an H100 (`tools/gpu/timeslice.py`, docs/kv-handoff.md): a
tiny kernel of process B took 2.4 ms instead of 0.013 ms while process A ran GEMMs, and a copy out
of A's memory (what a NIXL READ of the prefill's cache is) waited as long. A P/D stack with both
roles on one card paid that on every hand-off: the first gap after the first token was 44-111 ms
at 3000-8192 tokens (6.5 ms steady ITL). Under MPS the same stack's first gap was 8.6-12.9 ms.

So where `pdserve up` puts several workers on one GPU it starts an MPS control daemon of its own
(pipe and log folders in the stack's log folder, so it never touches a host-wide daemon) and
makes those workers its clients; the daemon quits with the stack. `--gpu-sharing timeslice` keeps
the driver's default; `mps` refuses to start without MPS; `auto` (the default) uses it where the
control binary is on PATH and says so when it is not. On Kubernetes the NVIDIA device plugin's
sharing settings decide it (docs/kubernetes.md): pods sharing a GPU by time-slicing take turns.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

MPS_CONTROL = "nvidia-cuda-mps-control"
GPU_SHARING = ("auto", "mps", "timeslice")
_TIMEOUT_S = 30.0


class MpsUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class MpsDaemon:
    control: str  # the control binary's path
    pipe_dir: Path
    log_dir: Path

    def env(self) -> dict[str, str]:
        """What makes a process this daemon's client (and its control commands reach it)."""
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}


def start_mps(run_dir: Path, which=shutil.which) -> MpsDaemon:
    """Start an MPS control daemon whose pipes live under `run_dir`; MpsUnavailable (with the
    reason) when there is no control binary or it would not start."""
    control = which(MPS_CONTROL)
    if control is None:
        raise MpsUnavailable(f"{MPS_CONTROL} is not on PATH")
    daemon = MpsDaemon(control, run_dir / "mps-pipe", run_dir / "mps-log")
    daemon.pipe_dir.mkdir(parents=True, exist_ok=True)
    daemon.log_dir.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run([control, "-d"], env={**os.environ, **daemon.env()}, stdin=subprocess.DEVNULL,
                              capture_output=True, timeout=_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise MpsUnavailable(f"{MPS_CONTROL} -d: {e}") from None
    if done.returncode != 0:
        said = (done.stderr or done.stdout).decode(errors="replace").strip()[:300]
        raise MpsUnavailable(f"{MPS_CONTROL} -d exited with {done.returncode}: {said or 'no output'}")
    return daemon


def stop_mps(daemon: MpsDaemon) -> str | None:
    """Ask the daemon to quit (its server ends once its clients have); the problem, or None."""
    try:
        done = subprocess.run([daemon.control], input=b"quit\n", env={**os.environ, **daemon.env()},
                              capture_output=True, timeout=_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    return None if done.returncode == 0 else f"quit exited with {done.returncode}"

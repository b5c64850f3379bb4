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
control binary is on PATH (and a client can use the daemon) and says so when it is not. A
`pdserve up` killed by SIGKILL cannot stop its daemon: `echo quit | CUDA_MPS_PIPE_DIRECTORY=<log
dir>/mps-pipe nvidia-cuda-mps-control` does. On Kubernetes the NVIDIA device plugin's
sharing settings decide it (docs/kubernetes.md): pods sharing a GPU by time-slicing take turns.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
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


# A client of the daemon, without torch: the driver API makes a context on the first shared GPU
# (MPS starts its server for it). A daemon whose server cannot start (no rights, a container
# without the pipes' IPC) fails here, before any worker would.
_PROBE = """
import ctypes, sys
cuda = ctypes.CDLL("libcuda.so.1")
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
for step, rc in (("cuInit", lambda: cuda.cuInit(0)), ("cuDeviceGet", lambda: cuda.cuDeviceGet(ctypes.byref(dev), 0)),
                 ("cuCtxCreate", lambda: cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev))):
    if (code := rc()) != 0:
        sys.exit(f"{step} returned CUDA error {code}")
cuda.cuCtxDestroy_v2(ctx)
"""


def probe_client(daemon: MpsDaemon, gpu: str) -> str | None:
    """Whether a process can be the daemon's client on `gpu`: None, or what went wrong."""
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE], env={**os.environ, **daemon.env(),
                              "CUDA_VISIBLE_DEVICES": gpu}, stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    return None if done.returncode == 0 else (done.stderr.decode(errors="replace").strip()[-300:] or
                                              f"exit {done.returncode}")


def start_mps(run_dir: Path, gpu: str, which=shutil.which, probe=None) -> MpsDaemon:
    """Start an MPS control daemon whose pipes live under `run_dir` and check that a client can
    use it on `gpu`; MpsUnavailable (with the reason) when there is no control binary, it would
    not start, or its client could not (the daemon is stopped again)."""
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
    if (problem := (probe or probe_client)(daemon, gpu)) is not None:
        stop_mps(daemon)
        raise MpsUnavailable(f"a client of the MPS daemon could not start: {problem}")
    return daemon


def stop_mps(daemon: MpsDaemon) -> str | None:
    """Ask the daemon to quit (its server ends once its clients have); the problem, or None."""
    try:
        done = subprocess.run([daemon.control], input=b"quit\n", env={**os.environ, **daemon.env()},
                              capture_output=True, timeout=_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    return None if done.returncode == 0 else f"quit exited with {done.returncode}"

"""What a killed server's own Ray leaves behind, reaped by the next server that starts one.

Ray ends its GCS, raylets and the job's actors with the driver that started them, but its
per-node agents (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``) may stay, orphaned. A
server that starts its own Ray notes the session dir in its run dir (``note_session``);
the next server that starts one (``reap_orphans``) kills, by pid, the processes of this
user that init adopted and that hold a file open in a dead server's session dir. Its run
dir goes afterwards with the usual stale-dir cleanup (``supervisor.clean_stale``).
"""
from __future__ import annotations

import glob
import logging
import os
import signal
import tempfile

logger = logging.getLogger("triptych.ray")
RAY_SESSION_FILE = "ray-session"  # in the run dir: the session of the Ray it started


def note_session(run_dir: str) -> None:
    """Write this process's Ray session dir (Ray names it after the starting pid) into
    ``run_dir``."""
    sessions = glob.glob(os.path.join(tempfile.gettempdir(), "ray",
                                      f"session_*_{os.getpid()}"))
    if sessions:
        with open(os.path.join(run_dir, RAY_SESSION_FILE), "w") as f:
            f.write(max(sessions, key=os.path.getmtime))


def reap_orphans(tmp: str | None = None) -> list[int]:
    """Kill the orphans of dead servers' Ray sessions; their pids."""
    from triptych.connector.segments import pid_alive
    from triptych.router.supervisor import RUN_DIR_PREFIX

    tmp = tmp or tempfile.gettempdir()
    sessions = []
    for marker in glob.glob(os.path.join(tmp, f"{RUN_DIR_PREFIX}*", RAY_SESSION_FILE)):
        pid = os.path.basename(os.path.dirname(marker)).split("-")[1]
        if pid.isdigit() and not pid_alive(int(pid)):
            with open(marker) as f:
                sessions.append(f.read().strip() + "/")
    killed = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()) if sessions else ():
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != 1 or os.stat(f"/proc/{pid}").st_uid != os.getuid():
                continue
            if any(os.readlink(f"/proc/{pid}/fd/{fd}").startswith(tuple(sessions))
                   for fd in os.listdir(f"/proc/{pid}/fd")):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not ours to read
    if killed:
        logger.warning("killed %d Ray processes a killed server's Ray left behind (pids %s)",
                       len(killed), killed)
    return killed

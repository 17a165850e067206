"""Test helper: a real one-host Slurm (Debian's slurm-wlm 22.05 + munge) for the launch tests.

`SlurmCluster.start()` writes a configuration on loopback in a fresh temporary directory (the node is this host,
addressed as 127.0.0.1; every daemon file lives in that directory), starts munged, slurmctld and slurmd, and waits
until the node is idle; `stop()` ends the three daemons by their PIDs and removes nothing of anyone else's. Facts
this rests on: ../shared/REFERENCE.md section "Slurm on one CPU host".

Configuration choices the tests depend on:
- `AuthInfo=cred_expire=5`: a requeued job becomes eligible `cred_expire + 1` seconds after the requeue (22.05
  holds it for the credential lifetime, 120 s by default) - the requeue tests would otherwise wait 2 minutes.
- `JobCompType=jobcomp/filetxt`: one line per job end, requeued starts included (22.05 has no file accounting for
  sacct); `MinJobAge=3600`: `scontrol show job` keeps finished jobs for the session.
- `CPUs=4` on a 2-core machine (`SlurmdParameters=config_overrides`): two 2-rank jobs of the tiny config run side
  by side; they are mostly waiting on each other's collectives, not on the CPU.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

SBIN = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")
MARK = "MG_TEST_SLURM_CLUSTER"
QUEUE_ALLOWANCE = 900  # seconds a wait may add for the time its job spends queued behind the other test jobs


def _which(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for d in SBIN:
        if os.access(f"{d}/{name}", os.X_OK):
            return f"{d}/{name}"
    return None


def missing_programs() -> list[str]:
    """The Slurm / munge programs that are not installed."""
    return [
        p for p in ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel") if _which(p) is None
    ]


def _port_pair() -> tuple[int, int]:
    # Two consecutive free ports for slurmctld and slurmd. The daemons bind them a moment later; the probe binds
    # both on all addresses, as the daemons do, so a port anything listens on is never picked.
    for base in range(16817, 17817, 2):
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("0.0.0.0", base))
                b.bind(("0.0.0.0", base + 1))
            return base, base + 1
        except OSError:
            continue
    raise RuntimeError("no two free consecutive ports in 16817..17817 for slurmctld / slurmd")


class SlurmError(RuntimeError):
    """A Slurm command or daemon failed; the message carries its output and the daemon logs' tails."""


class SlurmCluster:
    """One slurmctld + one slurmd on this host, with their own munged, all in `self.dir`."""

    def __init__(self, cpus: int = 4, memory_mb: int = 8000):
        self.dir = Path(tempfile.mkdtemp(prefix="mg-slurm-"))
        self.dir.chmod(0o755)
        self.cpus = cpus
        self.memory_mb = memory_mb
        self.node = socket.gethostname().split(".")[0]
        self.conf = self.dir / "slurm.conf"
        self.jobcomp = self.dir / "jobcomp.log"
        # Every process of this cluster carries MARK=<its directory> in its environment (daemons, slurmstepd and
        # jobs: sbatch exports the submitter's environment): a job of another cluster or session, numbered from 1
        # as well, is never taken for one of ours.
        self.env = dict(os.environ, SLURM_CONF=str(self.conf), **{MARK: str(self.dir)})
        self._daemons: dict[str, int] = {}

    # ---- set up and tear down ------------------------------------------------------------------------------------
    def _write_config(self) -> None:
        d = self.dir
        for sub in ("state", "spool", "munge"):
            (d / sub).mkdir(mode=0o700, exist_ok=True)
        key = d / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        ctld_port, slurmd_port = _port_pair()
        self.conf.write_text(
            f"""# one-host loopback Slurm for megatron-gspo's launch tests (tests/launch/slurm.py)
ClusterName=mgtest
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge/munge.socket,cred_expire=5
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
JobRequeue=1
ReturnToService=2
MailProg=/bin/true
MinJobAge=3600
JobCompType=jobcomp/filetxt
JobCompLoc={self.jobcomp}
JobAcctGatherType=jobacct_gather/none
SlurmdParameters=config_overrides
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=30
NodeName={self.node} NodeAddr=127.0.0.1 NodeHostname={self.node} CPUs={self.cpus} Sockets=1 CoresPerSocket={self.cpus} ThreadsPerCore=1 RealMemory={self.memory_mb} State=UNKNOWN
PartitionName=test Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
"""
        )

    def _start_daemon(self, name: str, argv: list[str], pidfile: Path) -> None:
        subprocess.run(argv, env=self.env, check=True, capture_output=True, text=True, timeout=60)
        deadline = time.time() + 30
        while not (pidfile.exists() and pidfile.read_text().strip()):
            if time.time() > deadline:
                raise SlurmError(f"{name} wrote no pid file {pidfile}\n{self.logs()}")
            time.sleep(0.1)
        self._daemons[name] = int(pidfile.read_text().strip())

    def start(self, timeout: float = 60) -> SlurmCluster:
        """Writes the configuration and starts munged, slurmctld and slurmd; returns once the node is idle."""
        self._write_config()
        d = self.dir
        try:
            self._start_daemon(
                "munged",
                [
                    _which("munged"),
                    f"--socket={d}/munge/munge.socket",
                    f"--key-file={d}/munge/munge.key",
                    f"--pid-file={d}/munge/munged.pid",
                    f"--log-file={d}/munge/munged.log",
                    f"--seed-file={d}/munge/munged.seed",
                    "--force",
                ],
                d / "munge" / "munged.pid",
            )
            self._start_daemon(
                "slurmctld", [_which("slurmctld"), "-f", str(self.conf), "-i"], d / "slurmctld.pid"
            )
            self._start_daemon(
                "slurmd", [_which("slurmd"), "-f", str(self.conf), "-N", self.node], d / "slurmd.pid"
            )
            deadline = time.time() + timeout
            while True:
                out = self.scontrol("show", "node", self.node, check=False)
                state = re.search(r"State=(\S+)", out)
                if state and state.group(1).startswith("IDLE"):
                    return self
                if time.time() > deadline:
                    raise SlurmError(f"node {self.node} not idle after {timeout}s: {out}\n{self.logs()}")
                time.sleep(0.3)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Cancels what is left of the jobs and waits for their processes to end (SIGKILL by PID after a minute),
        then ends slurmd, slurmctld and munged by their PIDs."""
        if "slurmctld" in self._daemons:
            subprocess.run(
                [_which("scancel"), "--full", "--user=root"], env=self.env, capture_output=True, timeout=30
            )
            self.wait_gone(timeout=60)
        for name in ("slurmd", "slurmctld", "munged"):
            pid = self._daemons.pop(name, None)
            if pid is None:
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.time() + 15
            while time.time() < deadline and _alive(pid):
                time.sleep(0.1)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)

    def processes(self, job_id: str | None = None) -> dict[int, str]:
        """pid -> command line of this cluster's live job processes (slurmstepd included; the daemons not), of one
        job when job_id is given (its SLURM_JOB_ID)."""
        daemons = set(self._daemons.values())
        found = {}
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) in daemons or int(proc.name) == os.getpid():
                continue
            env = _environ(proc)
            if env.get(MARK) != str(self.dir) or (job_id is not None and env.get("SLURM_JOB_ID") != job_id):
                continue
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue
            # (Without a job id: a job's processes and slurmstepd; not a client command such as scontrol.)
            if (
                job_id is None and "SLURM_JOB_ID" not in env and not cmd.startswith("slurmstepd")
            ) or not _alive(int(proc.name)):
                continue
            found[int(proc.name)] = cmd
        return found

    def wait_gone(self, job_ids: list[str] | None = None, timeout: float = 60) -> dict[int, str]:
        """Waits until the jobs (all of this cluster's when None) are in a final state and none of their processes
        is left; SIGKILLs by PID what still runs after `timeout`. Returns what had to be killed."""
        deadline = time.time() + timeout
        while True:
            busy = [
                j
                for j, state in self.states().items()
                if (job_ids is None or j in job_ids)
                and state in ("RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED")
            ]
            left = {}
            for job in job_ids or [None]:
                left.update(self.processes(job))
            if not busy and not left:
                return {}
            if time.time() > deadline:
                for pid in left:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                return left
            time.sleep(0.5)

    def states(self) -> dict[str, str]:
        """JobId -> JobState of every job slurmctld knows."""
        out = self.scontrol("show", "job", "--oneliner", check=False)
        rows = [dict(re.findall(r"(\w+)=(\S*)", line)) for line in out.splitlines()]
        return {r["JobId"]: r.get("JobState", "") for r in rows if "JobId" in r}

    def logs(self, lines: int = 30) -> str:
        """The daemons' log tails (for failure messages)."""
        parts = []
        for log in (self.dir / "slurmctld.log", self.dir / "slurmd.log", self.dir / "munge" / "munged.log"):
            if log.exists():
                parts.append(
                    f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
                )
        return "\n".join(parts)

    # ---- commands ------------------------------------------------------------------------------------------------
    def run(self, *argv: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
        """Runs a Slurm client command against this cluster."""
        res = subprocess.run(
            [_which(argv[0]) or argv[0], *argv[1:]],
            env=kw.pop("env", self.env),
            capture_output=True,
            text=True,
            timeout=kw.pop("timeout", 60),
            **kw,
        )
        if check and res.returncode != 0:
            raise SlurmError(f"{' '.join(argv)} exited {res.returncode}: {res.stdout}{res.stderr}")
        return res

    def scontrol(self, *args: str, check: bool = True) -> str:
        res = self.run("scontrol", *args, check=check)
        return res.stdout + res.stderr

    def sbatch(self, script: str | Path, *args: str, env: dict | None = None, cwd: Path | None = None) -> str:
        """Submits a batch script (`sbatch --parsable`); returns the job id."""
        res = self.run("sbatch", "--parsable", *args, str(script), env={**self.env, **(env or {})}, cwd=cwd)
        return res.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, Restarts, Reason, ...)."""
        out = self.scontrol("show", "job", "--oneliner", job_id)
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(
        self,
        job_id: str,
        states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"),
        timeout: float = 300,
        poll: float = 0.5,
    ) -> dict[str, str]:
        """Waits until the job is in one of `states`; returns its record. On timeout (`extend`) the job is cancelled."""
        deadline = time.time() + timeout
        hard = deadline + QUEUE_ALLOWANCE
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.time() > deadline:
                deadline = self.extend(job_id, timeout, hard)
                if deadline is None:
                    self.run("scancel", "--full", job_id, check=False)
                    raise SlurmError(f"job {job_id} not in {states} after {timeout}s: {info}\n{self.logs()}")
            time.sleep(poll)

    def extend(self, job_id: str, timeout: float, hard: float) -> float | None:
        """A new deadline for a wait of `timeout` seconds that ran out, or None when it is over: time the job spent
        queued (pending for the CPUs other test jobs hold, or held after a requeue) does not count, up to `hard`."""
        now = time.time()
        if now > hard:
            return None
        info = self.job(job_id)
        if info.get("JobState") == "PENDING":
            return now + 1
        ran = _seconds(info.get("RunTime", "0:0:0"))
        return now + (timeout - ran) if info.get("JobState") == "RUNNING" and ran < timeout else None

    def completions(self, job_id: str) -> list[dict[str, str]]:
        """The job-completion log's records of this job (one per end, requeued starts included)."""
        if not self.jobcomp.exists():
            return []
        rows = [dict(re.findall(r"(\w+)=(\S*)", line)) for line in self.jobcomp.read_text().splitlines()]
        return [r for r in rows if r.get("JobId") == job_id]


def _seconds(runtime: str) -> int:
    """Slurm's [D-]HH:MM:SS in seconds."""
    days, _, hms = runtime.rpartition("-")
    h, m, sec = (int(x) for x in hms.split(":"))
    return int(days or 0) * 86400 + h * 3600 + m * 60 + sec


def _environ(proc: Path) -> dict[str, str]:
    try:
        raw = (proc / "environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill -0; its state letter says it is gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False

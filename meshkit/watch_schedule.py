# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Where `meshkit watch` schedules its runs: a systemd timer, a launchd agent or a crontab line.

Each scheduler writes one thing named after the cluster and removes exactly that: the units
meshkit-watch-<cluster>.service/.timer (/etc/systemd/system as root, else ~/.config/systemd/user),
the agent org.meshkit.watch.<cluster>.plist (~/Library/LaunchAgents), or the crontab line that ends
``# meshkit-watch <cluster>``. Each run is ``<python> -m meshkit watch run --config <watch.json>``
from the directory `watch enable` ran in, with its output appended to <artifacts>/watch/watch.log.
"""

from __future__ import annotations

import os
import plistlib
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any


class ScheduleError(Exception):
    """This scheduler cannot be used here, or refused: says why and what to do."""


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "cluster"


def command(config: dict[str, Any], path: Path) -> list[str]:
    return [config["python"], "-m", "meshkit", "watch", "run", "--config", str(path)]


def log_file(path: Path) -> Path:
    return path.parent / "watch.log"


def _run(argv: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, input=stdin, capture_output=True, text=True, check=False, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ScheduleError(f"{shlex.join(argv)}: {exc}") from None


class Systemd:
    name = "systemd"

    @staticmethod
    def running() -> bool:
        return os.path.isdir("/run/systemd/system") and shutil.which("systemctl") is not None

    def __init__(self, unit_dir: str | None = None) -> None:
        self.user = os.geteuid() != 0
        default = Path.home() / ".config" / "systemd" / "user" if self.user else Path("/etc/systemd/system")
        self.unit_dir = Path(unit_dir or os.environ.get("MESHKIT_WATCH_UNIT_DIR") or default)

    def units(self, config: dict[str, Any], path: Path) -> dict[str, str]:
        base = f"meshkit-watch-{slug(config['cluster'])}"
        env = "".join(f"Environment={shlex.quote(f'{k}={v}')}\n" for k, v in sorted((config.get("env") or {}).items()))
        service = (
            "[Unit]\n"
            f"Description=meshkit watch: check the cluster {config['cluster']} (meshkit check, quick; full every "
            f"{config['full_every_s']} s)\n"
            "After=network-online.target\n\n"
            "[Service]\n"
            "Type=oneshot\n"
            f"WorkingDirectory={config['cwd']}\n"
            f"{env}"
            f"ExecStart={shlex.join(command(config, path))}\n"
            "Nice=10\n"
        )
        timer = (
            "[Unit]\n"
            f"Description=meshkit watch: every {config['every_s']} s for the cluster {config['cluster']}\n\n"
            "[Timer]\n"
            f"OnActiveSec=0\nOnUnitActiveSec={config['every_s']}s\nAccuracySec=1s\nUnit={base}.service\n\n"
            "[Install]\n"
            "WantedBy=timers.target\n"
        )
        return {f"{base}.service": service, f"{base}.timer": timer}

    def systemctl(self, *words: str) -> list[str]:
        return ["systemctl", *(["--user"] if self.user else []), *words]

    def check(self, config: dict[str, Any], path: Path) -> None:
        if not self.running():
            raise ScheduleError("systemd does not run on this machine (no /run/systemd/system): use --scheduler cron")

    def install(self, config: dict[str, Any], path: Path) -> str:
        self.unit_dir.mkdir(parents=True, exist_ok=True)
        units = self.units(config, path)
        for name, text in units.items():
            (self.unit_dir / name).write_text(text)
        timer = next(n for n in units if n.endswith(".timer"))
        for argv in (self.systemctl("daemon-reload"), self.systemctl("enable", "--now", timer)):
            done = _run(argv)
            if done.returncode != 0:
                raise ScheduleError(f"{shlex.join(argv)}: {done.stderr.strip()}")
        return f"timer {timer} in {self.unit_dir} (systemctl{' --user' if self.user else ''} list-timers)"

    def installed(self, config: dict[str, Any], path: Path) -> bool:
        units = self.units(config, path)
        same = all((self.unit_dir / n).is_file() and (self.unit_dir / n).read_text() == t for n, t in units.items())
        if not same or not self.running():
            return same
        timer = next(n for n in units if n.endswith(".timer"))
        return _run(self.systemctl("is-enabled", timer)).stdout.strip() == "enabled"

    def installed_any(self, config: dict[str, Any], path: Path) -> bool:
        units = self.units({"full_every_s": 0, "every_s": 0, "cwd": "/", "python": "", **config}, path)
        return any((self.unit_dir / n).exists() for n in units)

    def remove(self, config: dict[str, Any], path: Path) -> list[str]:
        units = self.units({"full_every_s": 0, "every_s": 0, "cwd": "/", "python": "", **config}, path)
        there = [n for n in units if (self.unit_dir / n).exists()]
        if not there:
            return []
        if self.running():
            timer = next(n for n in units if n.endswith(".timer"))
            _run(self.systemctl("disable", "--now", timer))
        for name in there:
            (self.unit_dir / name).unlink()
        if self.running():
            _run(self.systemctl("daemon-reload"))
        return [f"removed {', '.join(there)} from {self.unit_dir}"]


class Launchd:
    name = "launchd"

    @staticmethod
    def running() -> bool:
        return sys.platform == "darwin" and shutil.which("launchctl") is not None

    def __init__(self, agent_dir: str | None = None) -> None:
        default = Path.home() / "Library" / "LaunchAgents"
        self.agent_dir = Path(agent_dir or os.environ.get("MESHKIT_WATCH_AGENT_DIR") or default)

    @staticmethod
    def label(config: dict[str, Any]) -> str:
        return f"org.meshkit.watch.{slug(config['cluster'])}"

    def plist(self, config: dict[str, Any], path: Path) -> bytes:
        return plistlib.dumps(
            {
                "Label": self.label(config),
                "ProgramArguments": command(config, path),
                "StartInterval": int(config["every_s"]),
                "RunAtLoad": True,
                "WorkingDirectory": config["cwd"],
                "EnvironmentVariables": dict(config.get("env") or {}),
                "StandardOutPath": str(log_file(path)),
                "StandardErrorPath": str(log_file(path)),
                "ProcessType": "Background",
            }
        )

    def check(self, config: dict[str, Any], path: Path) -> None:
        if not self.running():
            raise ScheduleError("launchd is macOS's: use --scheduler systemd or cron here")

    def install(self, config: dict[str, Any], path: Path) -> str:
        self.agent_dir.mkdir(parents=True, exist_ok=True)
        target = self.agent_dir / f"{self.label(config)}.plist"
        target.write_bytes(self.plist(config, path))
        domain = f"gui/{os.getuid()}"
        _run(["launchctl", "bootout", domain, str(target)])  # an older one of the same name
        done = _run(["launchctl", "bootstrap", domain, str(target)])
        if done.returncode != 0:
            raise ScheduleError(f"launchctl bootstrap {domain} {target}: {done.stderr.strip()}")
        return f"agent {target} (launchctl print {domain}/{self.label(config)})"

    def installed(self, config: dict[str, Any], path: Path) -> bool:
        target = self.agent_dir / f"{self.label(config)}.plist"
        return target.is_file() and target.read_bytes() == self.plist(config, path)

    def installed_any(self, config: dict[str, Any], path: Path) -> bool:
        return (self.agent_dir / f"{self.label(config)}.plist").exists()

    def remove(self, config: dict[str, Any], path: Path) -> list[str]:
        target = self.agent_dir / f"{self.label(config)}.plist"
        if not target.exists():
            return []
        if self.running():
            _run(["launchctl", "bootout", f"gui/{os.getuid()}", str(target)])
        target.unlink()
        return [f"removed {target}"]


class Cron:
    name = "cron"

    def __init__(self, user: str | None = None) -> None:
        self.crontab = ["crontab", *(["-u", user] if user else [])]  # another user's: root only

    @staticmethod
    def running() -> bool:
        return shutil.which("crontab") is not None

    @staticmethod
    def marker(config: dict[str, Any]) -> str:
        return f"# meshkit-watch {slug(config['cluster'])}"

    @staticmethod
    def when(seconds: int) -> str:
        """The crontab schedule of an interval: whole minutes that divide an hour, or whole hours that divide a day."""
        minutes, hours = divmod(seconds, 60), divmod(seconds, 3600)
        if minutes[1] == 0 and seconds < 3600 and 60 % minutes[0] == 0:
            return "* * * * *" if seconds == 60 else f"*/{minutes[0]} * * * *"
        if hours[1] == 0 and seconds <= 86400 and 24 % hours[0] == 0:
            return {1: "0 * * * *", 24: "0 0 * * *"}.get(hours[0], f"0 */{hours[0]} * * *")
        raise ScheduleError(
            f"--every {seconds} s: cron runs whole minutes that divide an hour (1m, 2m, 5m, 10m, 15m, 30m) or whole "
            "hours that divide a day (1h, 2h, 3h, 4h, 6h, 8h, 12h, 24h)"
        )

    def line(self, config: dict[str, Any], path: Path) -> str:
        run = f"cd {shlex.quote(config['cwd'])} && {shlex.join(command(config, path))}"
        log = shlex.quote(str(log_file(path)))
        return f"{self.when(int(config['every_s']))} {run} >> {log} 2>&1 {self.marker(config)}"

    def current(self) -> list[str]:
        done = _run([*self.crontab, "-l"])
        if done.returncode != 0:
            if "no crontab" in done.stderr.lower():
                return []
            raise ScheduleError(f"crontab -l: {done.stderr.strip()}")
        return done.stdout.splitlines()

    def store(self, lines: list[str]) -> None:
        """The crontab made of these lines; none: no crontab at all (as before the first install)."""
        if not lines:
            done = _run([*self.crontab, "-r"])
            if done.returncode != 0 and "no crontab" not in done.stderr.lower():
                raise ScheduleError(f"crontab -r: {done.stderr.strip()}")
            return
        done = _run([*self.crontab, "-"], stdin="\n".join(lines) + "\n")
        if done.returncode != 0:
            raise ScheduleError(f"crontab -: {done.stderr.strip()}")

    def check(self, config: dict[str, Any], path: Path) -> None:
        if not self.running():
            raise ScheduleError("no crontab here (apt install cron): use --scheduler systemd or launchd")
        self.when(int(config["every_s"]))

    def install(self, config: dict[str, Any], path: Path) -> str:
        ours = self.marker(config)
        lines = [line for line in self.current() if not line.endswith(ours)]
        self.store([*lines, self.line(config, path)])
        return "a line of this user's crontab (crontab -l)"

    def installed(self, config: dict[str, Any], path: Path) -> bool:
        return self.running() and self.line(config, path) in self.current()

    def installed_any(self, config: dict[str, Any], path: Path) -> bool:
        return self.running() and any(line.endswith(self.marker(config)) for line in self.current())

    def remove(self, config: dict[str, Any], path: Path) -> list[str]:
        if not self.running():
            return []
        ours = self.marker(config)
        lines = self.current()
        kept = [line for line in lines if not line.endswith(ours)]
        if len(kept) == len(lines):
            return []
        self.store(kept)
        return [f"removed {len(lines) - len(kept)} line(s) from this user's crontab"]


SCHEDULERS: dict[str, Any] = {"systemd": Systemd, "launchd": Launchd, "cron": Cron}


def choose(name: str) -> Any:
    """The scheduler asked for, or (auto) the first that runs here: systemd, launchd, cron."""
    if name != "auto":
        return SCHEDULERS[name]()
    for kind in SCHEDULERS.values():
        if kind.running():
            return kind()
    raise ScheduleError("no scheduler here: neither systemd, launchd nor crontab (apt install cron)")

# Copyright: meshkit contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""meshccl's builds: what an install is made from, what each host is, and who builds for whom.

- The build id: a hash of meshccl's sources and the pinned extra requirements. It does not depend on
  any platform: every host of a cluster records the same id (in its virtual environment's
  meshkit-meshccl.json) whatever machine built its wheel, so `meshkit launch` tells a current
  install from a stale one by the id alone.
- A host record (the meshccl_host_facts module): OS, architecture, the version of the Python that
  makes meshccl's environment, libc (glibc's version on Linux; macOS's version on a Mac), and the
  build tools there (C++ compiler, CMake, Python and OpenSSL headers).
- Groups: hosts whose builds are interchangeable (OS, architecture, Python X.Y, libc). Each group is
  built once: on the controller where the controller's own platform serves it, otherwise on the
  group's first host that can build, from meshccl's source distribution. The inventory option
  meshkit_meshccl_build_on (controller | group | host) chooses.

Standard library only, and Python 3.9 compatible: the host facts module runs this on every host."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys

SKIP_DIRS = {"build", "__pycache__", ".pytest_cache", "dist"}
BARE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
BUILD_ON = ("controller", "group", "host")
# meshccl's pyproject: requires-python >= 3.9, cmake.version >= 3.18.
MIN_PYTHON = (3, 9)
MIN_CMAKE = (3, 18)
CONTROLLER = "controller"
# Where CMake lives when it is not on the PATH a module runs with (sshd gives a Mac /usr/bin:/bin:/usr/sbin:/sbin).
EXTRA_BIN = ("/opt/homebrew/bin", "/usr/local/bin", "/opt/local/bin")


def source_files(source: str) -> list[str]:
    out = []
    for root, dirs, files in os.walk(source):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
        out.extend(os.path.join(root, f) for f in sorted(files) if not f.endswith((".pyc", ".so")))
    return out


def pinned(requirements: list[str]) -> list[str]:
    out = []
    for req in requirements:
        version = None
        if BARE.match(req):
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                version = importlib.metadata.version(req)
        out.append(f"{req}=={version}" if version else req)
    return out


def build_id(source: str, requirements: list[str]) -> str:
    """16 hex digits over the sources and the (pinned) requirements; the same for every platform."""
    h = hashlib.sha256()
    h.update(b"meshccl-build 2\n")
    h.update(("\n".join(requirements) + "\n").encode())
    for path in source_files(source):
        h.update(os.path.relpath(path, source).encode() + b"\0")
        with open(path, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# What a host is (run on the host; the controller runs the same on itself)

# Run by the Python that will make meshccl's environment; prints one JSON line. Old-Python safe
# (3.6+), so that a too old interpreter is reported by its version instead of a traceback.
PROBE = r"""
import json, os, platform, sys, sysconfig
paths = sysconfig.get_paths()
include = paths.get("include") or ""
scripts = [paths.get("scripts") or ""]
try:
    import site
    scripts.append(os.path.join(site.getuserbase(), "bin"))
except Exception:
    pass
print(json.dumps({
    "version": "%d.%d.%d" % sys.version_info[:3],
    "implementation": platform.python_implementation(),
    "executable": sys.executable,
    "python_h": os.path.isfile(os.path.join(include, "Python.h")),
    "include": include,
    "libc": list(platform.libc_ver()),
    "mac_ver": platform.mac_ver()[0],
    "scripts": [s for s in scripts if s],
    "base_executable": getattr(sys, "_base_executable", None) or sys.executable,
}))
"""

OPENSSL_HEADERS = ("/usr/include/openssl/hmac.h", "/usr/local/include/openssl/hmac.h")


def _run(argv: list[str], env: dict[str, str] | None = None) -> tuple[int, str, str]:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=60, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 127, "", str(exc)
    return proc.returncode, proc.stdout, proc.stderr


def parse_cmake_version(text: str) -> str | None:
    """'cmake version 3.25.1' (first line of `cmake --version`) -> '3.25.1'."""
    m = re.search(r"cmake version (\d+(?:\.\d+)+)", text or "")
    return m.group(1) if m else None


def version_tuple(text: str | None) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text or ""))


def pkg_mgr() -> str:
    """The system package manager, named as Ansible's ansible_pkg_mgr fact names it."""
    if sys.platform == "darwin":
        return "homebrew" if any(os.access(os.path.join(d, "brew"), os.X_OK) for d in EXTRA_BIN[:2]) else ""
    for name in ("apt", "dnf", "yum", "zypper", "apk", "pacman"):
        if shutil.which(name):
            return name
    return ""


def find_tool(names: tuple[str, ...], extra: list[str] | tuple[str, ...] = ()) -> str | None:
    path = os.pathsep.join([os.environ.get("PATH", "/usr/bin:/bin"), *extra, *EXTRA_BIN])
    for name in names:
        found = shutil.which(name, path=path)
        if found:
            return found
    return None


def gather(python: str, venv: str | None = None) -> dict:
    """This machine's record, with ``python`` as the Python that makes meshccl's environment."""
    system = os.uname().sysname
    record: dict = {
        "system": system,
        "machine": os.uname().machine,
        "os_version": "",
        "libc": None,
        "pkg_mgr": pkg_mgr(),
        "python": {"path": python, "version": None, "implementation": None, "python_h": False, "error": None},
        "tools": {},
        "installed": None,
        "venv_python": None,
    }
    exe = python if os.sep in python else (shutil.which(python) or python)
    scripts: list[str] = []
    if not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
        record["python"]["error"] = f"{python} not found"
    else:
        rc, out, err = _run([exe, "-c", PROBE])
        try:
            probe = json.loads(out.strip().splitlines()[-1]) if rc == 0 else None
        except (ValueError, IndexError):
            probe = None
        if not probe:
            text = (err or out).strip().splitlines()
            record["python"]["error"] = f"{exe} did not run: {text[-1] if text else f'exit {rc}'}"
        else:
            record["python"].update(
                path=exe,
                version=probe["version"],
                implementation=probe["implementation"],
                python_h=bool(probe["python_h"]),
                include=probe["include"],
                base_executable=probe.get("base_executable"),
            )
            scripts = probe.get("scripts") or []
            if probe.get("libc") and probe["libc"][0]:
                record["libc"] = {"name": probe["libc"][0], "version": probe["libc"][1]}
            if probe.get("mac_ver"):
                record["os_version"] = probe["mac_ver"]
    if system == "Linux" and not record["libc"]:
        record["libc"] = linux_libc()
    if system == "Darwin" and not record["os_version"]:
        rc, out, _err = _run(["/usr/bin/sw_vers", "-productVersion"])
        record["os_version"] = out.strip() if rc == 0 else ""
    record["tools"] = build_tools(system, scripts)
    if venv:
        record["installed"], record["venv_python"] = installed_build(venv)
    return record


def linux_libc() -> dict | None:
    """glibc's version from confstr, else musl (no version) when its loader is there."""
    with contextlib.suppress(ValueError, OSError, AttributeError):
        text = os.confstr("CS_GNU_LIBC_VERSION") or ""
        m = re.match(r"glibc (\S+)", text)
        if m:
            return {"name": "glibc", "version": m.group(1)}
    if any(name.startswith("ld-musl-") for name in _listdir("/lib")):
        return {"name": "musl", "version": ""}
    return None


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def build_tools(system: str, scripts: list[str]) -> dict:
    tools: dict = {"cxx": None, "cmake": None, "cmake_version": None, "openssl": None, "developer_dir": None}
    if system == "Darwin":
        # /usr/bin/c++ and clang++ exist on every Mac, as shims that only work once the Xcode
        # Command Line Tools (or Xcode) are installed; xcode-select -p says whether they are.
        rc, out, _err = _run(["/usr/bin/xcode-select", "-p"])
        if rc == 0 and out.strip() and os.path.isdir(out.strip()):
            tools["developer_dir"] = out.strip()
            tools["cxx"] = find_tool(("c++", "clang++"))
        tools["openssl"] = True  # CommonCrypto, part of macOS
    else:
        tools["cxx"] = find_tool(("c++", "g++", "clang++"))
        tools["openssl"] = any(os.path.isfile(p) for p in OPENSSL_HEADERS)
    cmake = find_tool(("cmake",), scripts)
    if cmake:
        rc, out, _err = _run([cmake, "--version"])
        tools["cmake_version"] = parse_cmake_version(out) if rc == 0 else None
        tools["cmake"] = cmake if tools["cmake_version"] else None
    return tools


MARK = "meshkit-meshccl.json"


def installed_build(venv: str) -> tuple[str | None, str | None]:
    """(build recorded in the environment, its Python's X.Y), the build only if meshccl imports there."""
    python = os.path.join(venv, "bin", "python")
    if not os.access(python, os.X_OK):
        return None, None
    probe = (
        "import json, pathlib, sys\n"
        "v = '%d.%d' % sys.version_info[:2]\n"
        "try:\n"
        "    import meshccl\n"
        f"    b = json.loads(pathlib.Path(sys.prefix, {MARK!r}).read_text())['build']\n"
        "except Exception:\n"
        "    b = None\n"
        "print(json.dumps([b, v]))\n"
    )
    rc, out, _err = _run([python, "-c", probe])
    if rc != 0:
        return None, None
    try:
        build, version = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None, None
    return build, version


# ---------------------------------------------------------------------------------------------
# Who builds for whom (on the controller)


def python_xy(record: dict) -> str:
    parts = version_tuple((record.get("python") or {}).get("version"))
    return f"{parts[0]}.{parts[1]}" if len(parts) >= 2 else "?"


def python_tag(record: dict) -> str:
    impl = {"CPython": "cp", "PyPy": "pp"}.get((record.get("python") or {}).get("implementation") or "", "py")
    return impl + python_xy(record).replace(".", "")


def libc_label(record: dict) -> str:
    if record.get("system") == "Darwin":
        parts = version_tuple(record.get("os_version"))
        # macOS 11 and later are compatible within a major version; 10.x within a minor one.
        if not parts:
            return "macos"
        return f"macos{parts[0]}" if parts[0] >= 11 else f"macos{parts[0]}.{parts[1] if len(parts) > 1 else 0}"
    libc = record.get("libc") or {}
    return f"{libc.get('name') or 'libc'}{libc.get('version') or ''}"


def platform_label(record: dict) -> str:
    """e.g. linux-x86_64-cp311-glibc2.36, darwin-arm64-cp39-macos14: what a wheel built there is for."""
    return "-".join(
        [
            str(record.get("system") or "?").lower(),
            str(record.get("machine") or "?"),
            python_tag(record),
            libc_label(record),
        ]
    )


def serves(controller: dict, record: dict) -> bool:
    """Whether a wheel built on the controller runs on this host: same OS, architecture and Python X.Y;
    on Linux the same libc, the host's no older than the controller's; on a Mac the same or a later macOS."""
    same = all(controller.get(k) == record.get(k) for k in ("system", "machine")) and python_tag(
        controller
    ) == python_tag(record)
    if not same:
        return False
    if record.get("system") == "Darwin":
        return version_tuple(record.get("os_version"))[:1] >= version_tuple(controller.get("os_version"))[:1]
    mine, theirs = controller.get("libc") or {}, record.get("libc") or {}
    if mine.get("name") != theirs.get("name"):
        return False
    return version_tuple(theirs.get("version")) >= version_tuple(mine.get("version"))


def missing_tools(record: dict) -> list[str]:
    """What this host lacks to build meshccl ([] when it can)."""
    tools = record.get("tools") or {}
    py = record.get("python") or {}
    out = []
    if not tools.get("cxx"):
        out.append("a C++ compiler" + (" (the Xcode Command Line Tools)" if record.get("system") == "Darwin" else ""))
    if not tools.get("cmake"):
        out.append("CMake")
    elif version_tuple(tools.get("cmake_version")) < MIN_CMAKE:
        out.append(f"CMake {'.'.join(map(str, MIN_CMAKE))} or later (it has {tools.get('cmake_version')})")
    if py.get("version") and not py.get("python_h"):
        out.append(f"the headers of Python {python_xy(record)} (Python.h)")
    if tools.get("openssl") is False:
        out.append("OpenSSL's headers")
    return out


def install_command(record: dict, missing: list[str]) -> str:
    """The command that installs what ``missing`` names on this kind of host."""
    text = " ".join(missing)
    compiler = "compiler" in text
    cmake = "CMake" in text
    headers = "Python.h" in text
    ssl = "OpenSSL" in text
    xy = python_xy(record)
    if record.get("system") == "Darwin":
        steps = []
        if compiler:
            steps.append("xcode-select --install")
        if cmake:
            steps.append(
                "brew install cmake" if record.get("pkg_mgr") == "homebrew" else "python3 -m pip install --user cmake"
            )
        if headers:
            steps.append(f"install a Python {xy} with its headers (python.org or Homebrew)")
        return " && ".join(steps) or "xcode-select --install"
    manager = record.get("pkg_mgr") or ""
    names = {
        "apt": ("g++", "cmake", f"python{xy}-dev", "libssl-dev", "sudo apt-get install"),
        "dnf": ("gcc-c++", "cmake", "python3-devel", "openssl-devel", "sudo dnf install"),
        "yum": ("gcc-c++", "cmake3", "python3-devel", "openssl-devel", "sudo yum install"),
        "zypper": ("gcc-c++", "cmake", "python3-devel", "libopenssl-devel", "sudo zypper install"),
        "apk": ("g++", "cmake", "python3-dev", "openssl-dev", "sudo apk add"),
        "pacman": ("gcc", "cmake", "python", "openssl", "sudo pacman -S"),
    }.get(manager)
    if not names:
        return "install a C++17 compiler, CMake 3.18+, OpenSSL's and Python's headers with the system's package manager"
    gxx, cm, dev, ssl_dev, cmd = names
    pkgs = [p for p, want in ((gxx, compiler), (cm, cmake), (dev, headers), (ssl_dev, ssl)) if want]
    return f"{cmd} {' '.join(pkgs)}"


def python_problem(record: dict) -> str | None:
    py = record.get("python") or {}
    if py.get("error"):
        return f"{py['error']}: set meshkit_meshccl_python to a Python 3.9 or later there"
    if version_tuple(py.get("version"))[:2] < MIN_PYTHON:
        return (
            f"its {py.get('path')} is Python {py.get('version')}; meshccl needs 3.9 or later: install one and set "
            "meshkit_meshccl_python to it"
        )
    if py.get("implementation") != "CPython":
        return f"its {py.get('path')} is {py.get('implementation')}; meshccl's extension needs CPython"
    return None


def current(record: dict, build: str) -> bool:
    """The host's environment holds ``build``, made by the same Python X.Y as its meshccl_python."""
    return record.get("installed") == build and record.get("venv_python") == python_xy(record)


def plan(
    records: dict[str, dict], build_on: dict[str, str], controller: dict, build: str
) -> tuple[list[dict], list[str]]:
    """(groups, problems). ``records`` in play order. A group: name, platform, hosts, where
    (controller | group | host), builder (``controller`` or a host), needs (hosts not current).
    Problems name the host and what to do: a Python too old or missing, a builder that cannot build."""
    groups: dict[tuple[str, ...], dict] = {}
    problems: list[str] = []
    for host, record in records.items():
        mode = build_on.get(host) or CONTROLLER
        label = platform_label(record)
        if mode == CONTROLLER and serves(controller, record):
            key: tuple[str, ...] = (CONTROLLER,)
            name, where = f"controller-{platform_label(controller)}", CONTROLLER
        elif mode == "host":
            key, name, where = (label, host), f"{label}-{host}", "host"
        else:
            key, name, where = (label,), label, "group"
        group = groups.setdefault(
            key, {"name": name, "platform": label, "where": where, "hosts": [], "needs": [], "builder": None}
        )
        group["hosts"].append(host)
        if not current(record, build):
            group["needs"].append(host)
            why = python_problem(record)
            if why:
                problems.append(f"{host}: {why}")
    for group in groups.values():
        if group["where"] == CONTROLLER:
            group["builder"] = CONTROLLER
            continue
        able = [h for h in group["hosts"] if not missing_tools(records[h]) and not python_problem(records[h])]
        group["builder"] = able[0] if able else None
    return list(groups.values()), problems


def builder_problems(group: dict, records: dict[str, dict], controller: dict) -> list[str]:
    """Why ``group`` cannot be built (only asked for a group that must be built now)."""
    if group["builder"] == CONTROLLER:
        lack = missing_tools(controller)
        if not lack:
            return []
        return [
            f"the controller cannot build meshccl for {', '.join(group['hosts'])}: it has no {', '.join(lack)}; "
            f"install: {install_command(controller, lack)} (or set meshkit_meshccl_build_on: group on those hosts)"
        ]
    if group["builder"]:
        return []
    out = []
    for host in group["hosts"]:
        record = records[host]
        if python_problem(record):
            continue  # already named
        lack = missing_tools(record)
        others = [h for h in group["hosts"] if h != host]
        why = f"{host} must build meshccl ({group['platform']}"
        why += f", for {', '.join(others)} too)" if others else ")"
        out.append(f"{why} but has no {', '.join(lack)}; install: {install_command(record, lack)}")
    return out


# ---------------------------------------------------------------------------------------------
# Wheels for another platform (the controller downloads them for a group built elsewhere)


def pip_platforms(record: dict) -> list[str]:
    """pip download --platform tags for a host: its own and every older one its wheels may carry."""
    machine = record.get("machine") or ""
    if record.get("system") == "Darwin":
        parts = version_tuple(record.get("os_version")) or (11, 0)
        major, minor = parts[0], parts[1] if len(parts) > 1 and parts[0] < 11 else 0
        arch = "arm64" if machine in ("arm64", "aarch64") else machine
        return [f"macosx_{major}_{minor}_{arch}"]
    libc = record.get("libc") or {}
    version = version_tuple(libc.get("version"))
    if libc.get("name") == "glibc" and len(version) >= 2 and version[0] == 2:
        # pip widens macOS tags itself, not manylinux ones: every glibc from the host's down to 2.17.
        tags = [f"manylinux_2_{minor}_{machine}" for minor in range(version[1], 16, -1)]
        legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
        return tags + [f"{name}_{machine}" for minor, name in legacy.items() if minor <= version[1]]
    return []


def marker_environment(record: dict) -> dict[str, str]:
    """PEP 508 marker values for a host, to resolve dependencies for it from elsewhere."""
    version = (record.get("python") or {}).get("version") or "3.9.0"
    system = record.get("system") or "Linux"
    return {
        "implementation_name": "cpython",
        "implementation_version": version,
        "os_name": "posix",
        "platform_machine": record.get("machine") or "",
        "platform_python_implementation": "CPython",
        "platform_system": system,
        "python_full_version": version,
        "python_version": python_xy(record),
        "sys_platform": "darwin" if system == "Darwin" else "linux",
    }

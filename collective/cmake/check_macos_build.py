"""Checks meshccl's macOS build made on Linux by scripts/meshccl-macos (zig-macos.cmake): reads the
Mach-O files themselves (no Apple tools here) and fails unless each artifact is what a macOS build
must give.

    check_macos_build.py ARCH TARGET BUILD_DIR GTEST_PREFIX PY_MM

ARCH is aarch64 or x86_64, TARGET zig's target (aarch64-macos.11.0), PY_MM CPython's X.Y without the
dot (311). Checked:
  - libmeshccl_core.a: a BSD archive with a symbol index, every member a Mach-O object for the CPU;
  - libmeshccl.dylib: a dylib for the CPU and minimum macOS, loading only libSystem, install name
    @rpath/libmeshccl.dylib, exporting every function of the C ABI (meshccl.h) and none of meshccl's
    C++ internals, its crypto (CommonCrypto) resolved in libSystem, nothing left to the loader;
  - meshccl_tests: an executable for the CPU (GoogleTest built for the target linked in), nothing left
    to the loader;
  - _meshccl.cpython-PY_MM-darwin.so: the Python module, PyInit__meshccl exported, and the only symbols
    left to the loader (-undefined dynamic_lookup) CPython's: the names in nanobind's own list of them.
Exit status 1 on any failure, each one printed."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

CPU = {"aarch64": (0x0100000C, "arm64"), "x86_64": (0x01000007, "x86_64")}
MH_MAGIC_64 = 0xFEEDFACF
MH_OBJECT, MH_EXECUTE, MH_DYLIB, MH_BUNDLE = 1, 2, 6, 8
KIND = {MH_OBJECT: "object", MH_EXECUTE: "executable", MH_DYLIB: "dylib", MH_BUNDLE: "bundle"}
LC_SYMTAB, LC_LOAD_DYLIB, LC_ID_DYLIB, LC_BUILD_VERSION = 0x2, 0xC, 0xD, 0x32
LC_LOAD_WEAK_DYLIB, LC_REEXPORT_DYLIB = 0x80000018, 0x8000001F
LIBSYSTEM = "/usr/lib/libSystem.B.dylib"
COLLECTIVE = Path(__file__).resolve().parents[1]


@dataclass
class Image:
    """What a Mach-O image says about itself."""

    cpu: int
    filetype: int
    minos: str | None = None
    install_name: str | None = None
    dylibs: list[str] = field(default_factory=list)
    exports: set[str] = field(default_factory=set)
    from_dylibs: set[str] = field(default_factory=set)  # undefined, bound to one of `dylibs`
    loose: set[str] = field(default_factory=set)  # undefined, left to the loader's flat lookup


def read_image(data: bytes, name: str) -> Image:
    magic, cputype, _sub, filetype, ncmds, _size, _flags, _res = struct.unpack_from("<8I", data, 0)
    if magic != MH_MAGIC_64:
        raise ValueError(f"{name}: not a 64-bit Mach-O image (magic {magic:#x})")
    image = Image(cputype, filetype)
    symbols: list[tuple[str, int, int]] = []
    off = 32
    for _cmd in range(ncmds):
        cmd, size = struct.unpack_from("<2I", data, off)
        if cmd in (LC_LOAD_DYLIB, LC_LOAD_WEAK_DYLIB, LC_REEXPORT_DYLIB, LC_ID_DYLIB):
            (str_off,) = struct.unpack_from("<I", data, off + 8)
            path = data[off + str_off : off + size].split(b"\0", 1)[0].decode()
            if cmd == LC_ID_DYLIB:
                image.install_name = path
            else:
                image.dylibs.append(path)
        elif cmd == LC_BUILD_VERSION:
            (version,) = struct.unpack_from("<I", data, off + 12)
            image.minos = f"{version >> 16}.{(version >> 8) & 0xFF}"
        elif cmd == LC_SYMTAB:
            symoff, nsyms, stroff, _strsize = struct.unpack_from("<4I", data, off + 8)
            for i in range(nsyms):
                strx, ntype, _sect, desc, _value = struct.unpack_from("<IBBHQ", data, symoff + 16 * i)
                if ntype & 0xE0 or not ntype & 0x01:  # debugging entries; local symbols
                    continue
                name_ = data[stroff + strx :].split(b"\0", 1)[0].decode()
                symbols.append((name_, ntype & 0x0E, (desc >> 8) & 0xFF))
        off += size
    for sym, kind, ordinal in symbols:
        if kind != 0:  # defined here
            image.exports.add(sym)
        elif 1 <= ordinal <= len(image.dylibs):
            image.from_dylibs.add(sym)
        else:
            image.loose.add(sym)
    return image


def archive_members(data: bytes) -> list[tuple[str, bytes]]:
    """(name, body) of each member of an ar archive (BSD long names resolved)."""
    if not data.startswith(b"!<arch>\n"):
        raise ValueError("not an ar archive")
    members, off = [], 8
    while off + 60 <= len(data):
        header = data[off : off + 60]
        size = int(header[48:58].decode().strip())
        body = data[off + 60 : off + 60 + size]
        name = header[:16].decode().strip()
        if name.startswith("#1/"):  # BSD long name: stored at the start of the body
            n = int(name[3:])
            name, body = body[:n].split(b"\0", 1)[0].decode(), body[n:]
        members.append((name, body))
        off += 60 + size + (size & 1)
    return members


def file_says(path: Path) -> str:
    """`file`'s first words about path, if `file` is installed (shown next to the own reading)."""
    if not shutil.which("file"):
        return ""
    out = subprocess.run(["file", "-b", str(path)], capture_output=True, text=True, check=False).stdout
    return f"  [file: {out.strip().split(',')[0]}]"


def c_abi() -> list[str]:
    header = (COLLECTIVE / "include" / "meshccl" / "meshccl.h").read_text()
    return sorted(set(re.findall(r"MESHCCL_API\b[^;(]*?\b(meshccl_\w+)\s*\(", header)))


def cpython_symbols() -> set[str]:
    """CPython's C API as nanobind lists it for macOS linkers (darwin-ld-cpython.sym: `-U _Name`)."""
    import nanobind  # found through the PYTHONPATH scripts/meshccl-macos sets

    text = (Path(nanobind.cmake_dir()) / "darwin-ld-cpython.sym").read_text()
    return {line.split()[1] for line in text.splitlines() if line.startswith("-U ")}


class Checker:
    def __init__(self, arch: str, target: str) -> None:
        self.cpu, self.cpu_name = CPU[arch]
        self.target = target
        self.min_macos = target.split(".", 1)[1]
        self.failures: list[str] = []

    def fail(self, message: str) -> None:
        self.failures.append(message)
        print(f"  FAIL {message}")

    def image(self, path: Path, filetype: int) -> Image:
        image = read_image(path.read_bytes(), path.name)
        cpu = self.cpu_name if image.cpu == self.cpu else hex(image.cpu)
        print(
            f"  {path.name}: Mach-O {KIND.get(image.filetype, image.filetype)} for {cpu}, macOS >= {image.minos}, "
            f"loads {', '.join(image.dylibs) or 'nothing'}"
            + (f", install name {image.install_name}" if image.install_name else "")
            + file_says(path)
        )
        if image.cpu != self.cpu or image.filetype != filetype or image.minos != self.min_macos:
            self.fail(
                f"{path.name}: wanted a Mach-O {KIND[filetype]} for {self.cpu_name} declaring macOS >= {self.min_macos}"
            )
        if image.dylibs != [LIBSYSTEM]:
            self.fail(f"{path.name}: loads {image.dylibs}, wanted only {LIBSYSTEM}")
        return image

    def core(self, path: Path) -> None:
        members = archive_members(path.read_bytes())
        index = any(name.startswith("__.SYMDEF") for name, _body in members)
        objects = [(name, body) for name, body in members if not name.startswith("__.SYMDEF")]
        for name, body in objects:
            try:
                obj = read_image(body, name)
            except ValueError as e:
                self.fail(f"{path.name}({name}): {e}")
                continue
            if obj.cpu != self.cpu or obj.filetype != MH_OBJECT:
                self.fail(f"{path.name}({name}): not a Mach-O object for {self.cpu_name}")
        print(
            f"  {path.name}: BSD archive, {len(objects)} Mach-O objects for {self.cpu_name}, "
            f"symbol index {'present' if index else 'MISSING'}"
        )
        if not index or not objects:
            self.fail(f"{path.name}: no objects or no symbol index")

    def c_library(self, path: Path) -> None:
        lib = self.image(path, MH_DYLIB)
        if lib.install_name != "@rpath/libmeshccl.dylib":
            self.fail(f"{path.name}: install name {lib.install_name}, wanted @rpath/libmeshccl.dylib")
        api = c_abi()
        missing = [fn for fn in api if f"_{fn}" not in lib.exports]
        print(
            f"  {path.name} exports {len(api) - len(missing)} of the {len(api)} C ABI functions in meshccl.h"
            + (f"; MISSING: {', '.join(missing)}" if missing else "")
        )
        if not api or missing:
            self.fail(f"{path.name}: the C ABI is not exported whole")
        internals = sorted(s for s in lib.exports if "7meshccl" in s)  # C++ names in namespace meshccl
        if internals:
            self.fail(f"{path.name} exports meshccl's C++ internals: {internals[:5]}")
        if lib.loose:
            self.fail(f"{path.name} leaves symbols to the loader: {sorted(lib.loose)[:10]}")
        crypto = sorted(s for s in lib.from_dylibs if re.match(r"_(CC|Sec|arc4random|getentropy)", s))
        print(f"  {path.name} crypto resolved in libSystem: {', '.join(crypto) or 'NONE'}")
        if not any(s.startswith("_CC") for s in crypto):
            self.fail(f"{path.name}: no CommonCrypto symbol resolved in libSystem")

    def tests(self, path: Path, gtest_prefix: Path) -> None:
        tests = self.image(path, MH_EXECUTE)
        if tests.loose:
            self.fail(f"{path.name} leaves symbols to the loader: {sorted(tests.loose)[:10]}")
        for lib in sorted(gtest_prefix.glob("lib/libgtest*.a")):
            members = archive_members(lib.read_bytes())
            cpus = {read_image(body, name).cpu for name, body in members if not name.startswith("__.SYMDEF")}
            print(f"  {lib.name}: GoogleTest built for {self.target}{file_says(lib)}")
            if cpus != {self.cpu}:
                self.fail(f"{lib}: objects for CPUs {sorted(hex(c) for c in cpus)}, wanted {self.cpu_name}")

    def module(self, path: Path) -> None:
        # An MH_DYLIB (zig cannot write MH_BUNDLE; Python's dlopen loads both).
        mod = self.image(path, MH_DYLIB)
        if "_PyInit__meshccl" not in mod.exports:
            self.fail(f"{path.name}: PyInit__meshccl is not exported")
        foreign = sorted(mod.loose - cpython_symbols())
        if foreign:
            self.fail(f"{path.name}: symbols left to the loader that CPython does not provide: {foreign[:10]}")
        else:
            print(f"  {path.name}: {len(mod.loose)} symbols left to the interpreter (dynamic_lookup), all CPython's")


def main(argv: list[str]) -> int:
    if len(argv) != 5 or argv[0] not in CPU:
        print(__doc__, file=sys.stderr)
        return 2
    arch, target, build_dir, gtest_prefix, py_mm = argv
    build = Path(build_dir)
    check = Checker(arch, target)
    check.core(build / "libmeshccl_core.a")
    check.c_library(build / "libmeshccl.dylib")
    check.tests(build / "meshccl_tests", Path(gtest_prefix))
    module = build / f"_meshccl.cpython-{py_mm}-darwin.so"
    if module.exists():
        check.module(module)
    else:
        check.fail(f"no {module.name} in {build}")
    return 1 if check.failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

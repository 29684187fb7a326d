"""Lets a CUDA build of torch from PyPI import and run on the CPU without its
NVIDIA libraries (``make compat``, see tools/compat.sh).

PyPI's Linux x86_64 torch wheels are CUDA builds: ``libtorch_cuda.so`` and
``libtorch_python.so`` link ``libcudnn``, ``libcublas``, ``libnccl``, ... at
load time, which come in about 2.5 GB of ``nvidia-*`` wheels (3 GB of
downloads and 5.3 GB on disk for torch 2.15.0, against 0.54 GB and 1.3 GB for
the torch wheel alone). CPU wheels are on download.pytorch.org only, which
this machine cannot reach. The CPU code of a CUDA build is the same
``libtorch_cpu.so`` a CPU build has; the CUDA libraries are only *called*
when a CUDA device is used, or asked for.

So, after ``pip install --no-deps torch==X`` (and its pure-Python
dependencies), this script builds one tiny stub per NVIDIA library that
torch's import needs and that is missing, into ``torch/lib`` (on the RPATH of
every torch library as ``$ORIGIN``):

- which libraries: the ``NEEDED`` closure of ``torch/_C*.so`` and
  ``libtorch_global_deps.so`` (what ``import torch`` loads), minus what is
  present in ``torch/lib`` or the system's library directories. Libraries that torch
  opens lazily (``libcuda.so.1``, ``libtorch_cuda_linalg.so``'s cuSOLVER) are
  left missing, so torch's own "not available" paths handle them;
- which symbols: every undefined dynamic symbol of those libraries that the
  missing library provides: versioned references by their version (NVIDIA's
  libraries name their version after the soname), unversioned ones (NCCL,
  cuSPARSELt) when no present library defines them, in each missing library
  that the referencing library needs. A stub with versioned references gets
  that version node;
- what a stub function does: it returns 100 (``cudaErrorNoDevice``; every
  CUDA-family status that is not 0 is an error), so
  ``torch.cuda.is_available()`` is ``False`` and ``device_count()`` 0, as on
  a machine without a GPU; functions that return an error *string* return
  one that names the stub.

Run: ``python tools/cuda_stubs.py <site-packages>``. Prints what it built;
a no-op when nothing is missing (a CPU build). Needs binutils (``readelf``,
``nm``) and ``gcc``.
"""
import glob
import os
import re
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional, Set, Tuple

#: Functions whose result is a ``const char *``: they get a string, not 100.
STRING_RESULT = re.compile(r"(?i)(error(string|name)|getstring|lasterror.*string)")
#: What every other stub function returns: cudaErrorNoDevice.
ERROR_STATUS = 100


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def needed(path: str) -> List[str]:
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", _run("readelf", "-d", "-W", path))


def undefined(path: str) -> List[Tuple[str, Optional[str]]]:
    """(symbol, version or None) of the strong undefined dynamic symbols."""
    out = []
    for line in _run("nm", "-D", "--undefined-only", path).splitlines():
        parts = line.split()
        if len(parts) != 2 or parts[0] != "U":
            continue  # weak ('w') references may stay undefined
        name, _, version = parts[1].partition("@")
        out.append((name, version.lstrip("@") or None))
    return out


def version_files(path: str) -> Dict[str, str]:
    """version name -> the file that must define it (the ``.gnu.version_r``
    section: NVIDIA names most versions after the soname, NVSHMEM ``NVSHMEM``)."""
    files: Dict[str, str] = {}
    current = None
    for line in _run("readelf", "-V", "-W", path).splitlines():
        m = re.search(r"File: (\S+)", line)
        if m:
            current = m.group(1)
            continue
        m = re.search(r"Name: (\S+)", line)
        if m and current is not None:
            files[m.group(1)] = current
    return files


def defined(path: str) -> Set[str]:
    names = set()
    for line in _run("nm", "-D", "--defined-only", path).splitlines():
        parts = line.split()
        if len(parts) == 3:
            names.add(parts[2].split("@")[0])
    return names


def system_libraries() -> Dict[str, str]:
    """The linker cache's libraries in the system's own directories: a CUDA
    toolkit under /usr/local (this machine has CUDA 13.0's runtime there) is
    not used, so a venv is the same on a machine without one (the stubs in
    torch/lib come first on the RPATH)."""
    libs = {}
    for line in _run("ldconfig", "-p").splitlines():
        m = re.match(r"\s+(\S+) \(libc6,x86-64[^)]*\) => (/(?:usr/)?lib(?:64)?/\S+)", line)
        if m:
            libs.setdefault(m.group(1), m.group(2))
    return libs


def plan(site: str) -> Dict[str, Dict[str, Optional[str]]]:
    """missing soname -> {symbol its stub defines: its version node or None}."""
    torch_dir = os.path.join(site, "torch")
    lib_dir = os.path.join(torch_dir, "lib")
    present = {os.path.basename(p): p for p in glob.glob(os.path.join(lib_dir, "*.so*"))}
    system = system_libraries()
    roots = glob.glob(os.path.join(torch_dir, "_C*.so")) + [
        p for p in [os.path.join(lib_dir, "libtorch_global_deps.so")] if os.path.exists(p)]
    closure: Dict[str, str] = {}   # loaded library -> path
    missing: Set[str] = set()
    todo = list(roots)
    while todo:
        path = todo.pop()
        if path in closure.values():
            continue
        closure[os.path.basename(path)] = path
        for so in needed(path):
            if so in closure:
                continue
            where = present.get(so) or system.get(so)
            if where is None:
                missing.add(so)
            else:
                todo.append(where)
    if not missing:
        return {}
    provided: Set[str] = set()
    for path in closure.values():
        provided |= defined(path)
    stubs: Dict[str, Dict[str, Optional[str]]] = {so: {} for so in missing}
    for path in closure.values():
        libs_needed = [so for so in needed(path) if so in missing]
        if not libs_needed:
            continue
        files = version_files(path)
        for name, version in undefined(path):
            if version is not None:
                if files.get(version) in missing:
                    stubs[files[version]][name] = version
            elif name not in provided:
                for so in libs_needed:
                    stubs[so].setdefault(name, None)
    return stubs


def build(so: str, symbols: Dict[str, Optional[str]], out_dir: str) -> None:
    asm = [f'.section .rodata\n.Lmsg: .asciz "{so} is a CPU-only stub (tools/cuda_stubs.py)"\n.text']
    for name in sorted(symbols):
        body = "lea .Lmsg(%rip), %rax" if STRING_RESULT.search(name) else f"mov ${ERROR_STATUS}, %eax"
        asm.append(f".globl {name}\n.type {name},@function\n{name}:\n    {body}\n    ret")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "stub.s")
        with open(src, "w") as f:
            f.write("\n".join(asm) + "\n.section .note.GNU-stack,\"\",@progbits\n")
        cmd = ["gcc", "-shared", "-nostdlib", "-o", os.path.join(out_dir, so), src, f"-Wl,-soname,{so}"]
        versions = sorted({v for v in symbols.values() if v is not None})
        if versions:
            # Each version node lists its symbols; the unversioned ones go to
            # the first node (an unversioned reference binds to any version).
            nodes = []
            for i, v in enumerate(versions):
                names = [n for n, nv in symbols.items() if nv == v or (i == 0 and nv is None)]
                nodes.append(f"{v} {{ global: {' '.join(n + ';' for n in sorted(names))} }};")
            nodes[0] = nodes[0][:-2] + " local: *; };"
            script = os.path.join(tmp, "version.map")
            with open(script, "w") as f:
                f.write("\n".join(nodes) + "\n")
            cmd.append(f"-Wl,--version-script={script}")
        subprocess.run(cmd, check=True)


def main(argv: List[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[0], "\nusage: cuda_stubs.py SITE_PACKAGES", file=sys.stderr)
        return 2
    site = argv[1]
    stubs = plan(site)
    lib_dir = os.path.join(site, "torch", "lib")
    for so, symbols in sorted(stubs.items()):
        build(so, symbols, lib_dir)
        versions = sorted({v for v in symbols.values() if v is not None})
        print(f"cuda_stubs: {so}: {len(symbols)} symbols"
              + (f" (versions {', '.join(versions)})" if versions else ""))
    if not stubs:
        print("cuda_stubs: nothing missing (a CPU build?)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

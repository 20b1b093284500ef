"""The native kernels compile for the other kinds of host fastgen runs on, not only this one
(with the compiler torch's extension build takes, as the kernels' own build does).

The build takes ``-march=native``, so a test run sees only the code paths of its own CPU: for two
days of AMX-host sessions the kernels did not compile on hosts without AMX (a constant defined
inside the AMX block), and those hosts fell back to PyTorch ops. Here every source is compiled
(to object code at -O0: an intrinsic inlined where its instructions are not enabled fails only at
code generation, which a syntax-only pass missed on 12-06: the fp32 chunk attention's bf16 branch
on hosts without AVX512-BF16) for an AVX2 host (Zen 3 / Haswell class),
an AVX-512 + VNNI host without AVX512-BF16 or AMX (Ice Lake server), one with AVX512-BF16 but
no AMX (Cooper Lake, as Zen 4), and one with AMX (Sapphire Rapids: 12-07 moved the packed prompt
chunks out of the AVX-512 block, around the tiles' code). ``FASTGEN_KERNEL_MARCH`` builds and runs those kernels on a host
whose CPU has the instructions (docs/architecture.md, Kernels)."""
from __future__ import annotations

import os
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor

import fastgen.kernels as kernels

ARCHES = ("haswell", "icelake-server", "cooperlake", "sapphirerapids")


def _compile(arch: str, source: str) -> subprocess.CompletedProcess:
    from torch.utils.cpp_extension import get_cxx_compiler, include_paths

    flags = [f if not f.startswith("-march=") else f"-march={arch}" for f in kernels.CFLAGS]
    cmd = [get_cxx_compiler(), "-std=c++17", *flags, "-O0", "-c", "-o", os.devnull,
           *(f"-I{p}" for p in include_paths()), f"-I{sysconfig.get_paths()['include']}", source]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def test_the_kernels_compile_for_hosts_without_this_ones_instructions():
    jobs = [(arch, str(src)) for arch in ARCHES for src in kernels.SOURCES]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda job: _compile(*job), jobs))
    failed = [f"-march={arch} {src.rsplit('/', 1)[-1]}:\n{r.stderr[-2000:]}"
              for (arch, src), r in zip(jobs, results) if r.returncode != 0]
    assert not failed, "\n".join(failed)


def test_the_target_isa_is_part_of_the_build_key(monkeypatch):
    """Kernels built for another -march live under another name, never mixed with this host's."""
    native = kernels.build_name()
    monkeypatch.setattr(kernels, "CFLAGS", [f if not f.startswith("-march=") else "-march=icelake-server"
                                            for f in kernels.CFLAGS])
    assert kernels.build_name() != native

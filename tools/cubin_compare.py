#!/usr/bin/env python3
"""cubin_compare.py REV FILE.cu [FILE.cu ...]: is every kernel's machine code the same at REV and in the
working tree? No GPU needed: each file is compiled to an sm_90 (or sm_90a for kernels/cuda/attn/sm90a/) cubin
twice, once from a clean worktree of REV and once from this tree, and each kernel's .text section is
compared byte for byte (the anonymous-namespace names, which carry a hash of the path, are normalised).

For: refactors of CUDA code that should not change what runs (helpers shared between kernels, moved
code). SAME for every kernel means the GPU runs the same instructions, so its results and speed are
those measured before; DIFF gives both instruction counts (16 bytes each on Hopper), and such a
change needs a GPU run for results and time. Needs nvcc (CUDA 13) and python3; writes only under
$TMPDIR.

    tools/cubin_compare.py HEAD kernels/cuda/kda/chunk_mma.cu kernels/cuda/kda/chunk_mma_bwd.cu

A file that moved is named OLD:NEW, its path at REV then in the working tree
(kernels/cuda/kda_tc_cuda.cu:kernels/cuda/kda/chunk_mma.cu); the anonymous namespace's name, which
carries the file's path and its length, is normalised whole, so a moved kernel compares SAME.
"""
import os
import re
import struct
import subprocess
import sys
import tempfile

NVCC = os.environ.get("NVCC", "/usr/local/cuda/bin/nvcc")


def text_sections(path):
    """.text.<kernel> -> bytes of a cubin (ELF64, parsed by hand: no pyelftools on the build machines)."""
    b = open(path, "rb").read()
    shoff, = struct.unpack_from("<Q", b, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", b, 0x3A)
    hdr = lambda i: struct.unpack_from("<IIQQQQIIQQ", b, shoff + i * shentsize)
    names_at = hdr(shstrndx)[4]
    out = {}
    for i in range(shnum):
        name_off, _, _, _, off, size, *_ = hdr(i)
        name = b[names_at + name_off:b.index(b"\0", names_at + name_off)].decode()
        if name.startswith(".text."):
            out[anon(name)] = b[off:off + size]
    return out


def anon(name):
    """name with each anonymous namespace (<length>_GLOBAL__N__<hash>_<path>_cu_<hash>, the length in
    decimal as the mangling writes it) replaced by ANON, so the name does not depend on the file's path."""
    out, i = [], 0
    for m in re.finditer(r"(\d+)_GLOBAL__N__", name):
        if m.start() < i:
            continue
        n = int(m.group(1))
        out.append(name[i:m.start()] + "ANON")
        i = m.end(1) + n
    return "".join(out) + name[i:]


def cubin(root, rel, out):
    arch = "sm_90a" if "/sm90a/" in rel else "sm_90"
    cmd = [NVCC, "-DMTRL_HAVE_CUDA=1", "-DMTRL_HAVE_NCCL=1", "-D_GNU_SOURCE", "-I" + root, "-O2", "-DNDEBUG",
           "-arch=" + arch, "--expt-relaxed-constexpr", "-Xptxas=--suppress-async-bulk-multicast-advisory-warning",
           "-cubin", "-o", out, os.path.join(root, rel)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        sys.exit("cubin_compare: nvcc failed on %s (%s):\n%s" % (rel, root, r.stderr[-2000:]))


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    rev, files = sys.argv[1], sys.argv[2:]
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True).stdout.strip()
    tmp = tempfile.mkdtemp(prefix="cubin_compare_")
    wt = os.path.join(tmp, "rev")
    subprocess.run(["git", "-C", top, "worktree", "add", "-f", "--detach", wt, rev], capture_output=True, check=True)
    same = diff = 0
    try:
        for arg in files:
            old, _, new = arg.partition(":")
            rel = new or old
            a_path, b_path = os.path.join(tmp, "a.cubin"), os.path.join(tmp, "b.cubin")
            cubin(wt, old, a_path)
            cubin(top, rel, b_path)
            a, b = text_sections(a_path), text_sections(b_path)
            for k in sorted(set(a) | set(b)):
                name = k[len(".text."):]
                if a.get(k) == b.get(k):
                    same += 1
                    print("SAME %s %s (%d instructions)" % (rel, name[:110], len(a[k]) // 16))
                else:
                    diff += 1
                    na = len(a[k]) // 16 if k in a else 0
                    nb = len(b[k]) // 16 if k in b else 0
                    print("DIFF %s %s (%d -> %d instructions)" % (rel, name[:110], na, nb))
    finally:
        subprocess.run(["git", "-C", top, "worktree", "remove", "--force", wt], capture_output=True)
    print("%d kernels the same, %d different (against %s)" % (same, diff, rev))
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())

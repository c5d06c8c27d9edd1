"""Zero, in place, the GPU code of a shared library's `.nv_fatbin` that a device of one architecture never loads, and
its symbol table (`.symtab`, `.strtab`: read by debuggers, never by the loader), so that the library compresses to a
fraction of its size. The file's layout is unchanged (same sections, offsets and sizes; every fat-binary entry keeps
its header), so the dynamic loader and the CUDA runtime read it as before; they pick the kept cubin for that device.

    python scripts/prune_fatbin.py mlx/lib/libmlx.so --keep-sm 90      # H100, H200

MLX's CUDA wheel carries cubins for sm_75 ... sm_121 and PTX (~67 MB of 145 MB); keeping sm_90 alone brings the
xz'd backend from ~72 MB to ~20 MB, one transfer to a machine without a network (scripts/gpu_run.sh --fetch).
"""
from __future__ import annotations

import argparse
import struct
import sys

FATBIN_MAGIC = 0xBA55ED50
ELF_CUBIN = 2                   # a fat-binary entry's kind: 1 PTX, 2 ELF (a cubin)


def sections(elf: bytes) -> dict[str, tuple[int, int]]:
    """name -> (file offset, size) of an ELF64 little-endian file's sections."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise SystemExit("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    heads = [struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names = heads[shstrndx][4]
    return {elf[names + h[0]:elf.index(b"\0", names + h[0])].decode(): (h[4], h[5]) for h in heads}


def entries(elf: bytes, off: int, size: int):
    """(payload offset, payload size, kind, sm) of every entry of every fat binary in [off, off + size)."""
    p = off
    while p < off + size:
        magic, _, header, fat = struct.unpack_from("<IHHQ", elf, p)
        if magic != FATBIN_MAGIC:       # (fat binaries are 8-byte aligned, padding between them)
            p += 8
            continue
        q = p + header
        while q < p + header + fat:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", elf, q)
            sm, = struct.unpack_from("<I", elf, q + 28)
            yield q + entry_header, payload, kind, sm
            q += entry_header + payload
        p += header + fat


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("library")
    ap.add_argument("--keep-sm", type=int, required=True, help="the one architecture whose cubins stay (90: sm_90)")
    args = ap.parse_args()
    elf = bytearray(open(args.library, "rb").read())
    secs = sections(bytes(elf))
    if ".nv_fatbin" not in secs:
        raise SystemExit(f"{args.library}: no .nv_fatbin section")
    kept = zeroed = 0
    for at, n, kind, sm in list(entries(bytes(elf), *secs[".nv_fatbin"])):
        if kind == ELF_CUBIN and sm == args.keep_sm:
            kept += n
        else:
            elf[at:at + n] = bytes(n)
            zeroed += n
    if not kept:
        raise SystemExit(f"{args.library}: no cubin for sm_{args.keep_sm}; nothing changed")
    for name in (".symtab", ".strtab"):
        if name in secs:
            o, n = secs[name]
            elf[o:o + n] = bytes(n)
    with open(args.library, "wb") as f:
        f.write(elf)
    print(f"{args.library}: kept {kept / 1e6:.1f} MB of sm_{args.keep_sm} cubins, zeroed {zeroed / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())

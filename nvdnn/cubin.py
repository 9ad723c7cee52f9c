"""What a cubin's ELF says about itself: the SM it was built for and the kernel entries it holds.

Read with bounds checks only (no loader, no tools), so a plan blob can be checked against its
machine code on a machine without a GPU. Anything malformed raises ValueError saying what.

e_flags layouts (LLVM's ELF.h names), told apart by e_ident[EI_ABIVERSION]:

    ABI version < 8 (CUDA 12 and before): SM number in bits 0-7, EF_CUDA_ACCELERATORS_V1 (0x800)
    ABI version 8 (CUDA 13):              SM number in bits 8-15, EF_CUDA_ACCELERATORS (0x8)

The accelerator bit marks an arch-specific target (sm_90a). NVRTC 13.0 leaves it clear even
for sm_90a (measured: sm_90 and sm_90a cubins carry the same e_flags, 0x06005a04), so a clear
bit does not mean a portable target; a set bit does mean an arch-specific one.
"""
from __future__ import annotations

import struct
from typing import NamedTuple

EM_CUDA = 190
_IDENT = b"\x7fELF\x02\x01"       # ELF, 64-bit, little-endian
_EHDR = struct.Struct("<HHIQQQIHHHHHH")  # e_type .. e_shstrndx, from offset 16
_SHDR = struct.Struct("<IIQQQQIIQQ")
_SYM = struct.Struct("<IBBHQQ")
SHT_SYMTAB, STT_FUNC, STB_GLOBAL = 2, 2, 1
STO_CUDA_ENTRY = 0x10             # st_other of a __global__ function
# ABI version -> (shift of the SM number, accelerator bit)
_LAYOUTS = {False: (0, 0x800), True: (8, 0x8)}


class Target(NamedTuple):
    sm: int            # 90 for sm_90 and sm_90a
    specific: bool     # the accelerator bit: an arch-specific ('a') target


def _header(image: bytes):
    if len(image) < 64 or not image.startswith(_IDENT):
        raise ValueError("not a 64-bit little-endian ELF image")
    header = _EHDR.unpack_from(image, 16)
    if header[1] != EM_CUDA:
        raise ValueError(f"ELF machine {header[1]}, not CUDA ({EM_CUDA})")
    return header


def target(image: bytes) -> Target:
    """The SM number and arch-specific flag of a cubin's e_flags."""
    flags = _header(image)[6]
    shift, accelerators = _LAYOUTS[image[8] >= 8]
    return Target((flags >> shift) & 0xFF, bool(flags & accelerators))


def _sections(image: bytes, header) -> list[tuple]:
    shoff, shentsize, shnum = header[5], header[10], header[11]
    if shentsize != _SHDR.size or shoff + shnum * shentsize > len(image):
        raise ValueError("section header table out of bounds")
    sections = [_SHDR.unpack_from(image, shoff + i * shentsize) for i in range(shnum)]
    for s in sections:
        if s[1] != 8 and s[4] + s[5] > len(image):  # SHT_NOBITS occupies no file space
            raise ValueError("a section lies past the end of the image")
    return sections


def entries(image: bytes) -> frozenset[str]:
    """The names of the kernel entry points (global __global__ functions) in the symbol table."""
    sections = _sections(image, _header(image))
    names = set()
    for symtab in (s for s in sections if s[1] == SHT_SYMTAB):
        if symtab[6] >= len(sections):
            raise ValueError("the symbol table links to no string table")
        strtab = sections[symtab[6]]
        strings = image[strtab[4]:strtab[4] + strtab[5]]
        for offset in range(symtab[4], symtab[4] + symtab[5] - _SYM.size + 1, _SYM.size):
            name, info, other = _SYM.unpack_from(image, offset)[:3]
            if info & 0xF == STT_FUNC and info >> 4 == STB_GLOBAL and other & STO_CUDA_ENTRY:
                end = strings.find(b"\0", name)
                if end < 0:
                    raise ValueError("a symbol name runs past its string table")
                names.add(strings[name:end].decode("ascii", "replace"))
    return frozenset(names)

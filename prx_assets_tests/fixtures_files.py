"""Small files several test modules build: a sparse tar (huge members at no disk cost) and
a solid-colour JPEG tile per index."""

from __future__ import annotations

import random
import tarfile
from pathlib import Path

from prx_assets.demo.jpegs import solid_jpeg


def sparse_tar(path: Path, members: list[tuple[str, int | bytes]]) -> None:
    """A tar whose member data are holes unless given: headers written at their offsets.

    A member given as an int is that many bytes of zeros (a hole on disk: a 3 x 400 MB
    archive costs a few KB, and reading it reads zeros); bytes are written as they are."""
    with open(path, "wb") as fh:
        offset = 0
        for name, content in members:
            info = tarfile.TarInfo(name)
            info.size = content if isinstance(content, int) else len(content)
            header = info.tobuf(format=tarfile.PAX_FORMAT)
            fh.seek(offset)
            fh.write(header)
            if isinstance(content, bytes):
                fh.write(content)
            offset += len(header) + -(-info.size // 512) * 512
        fh.truncate(offset + 2 * 512)  # the two zero blocks that end an archive


def tile_jpeg(i: int, size: tuple[int, int] = (24, 16)) -> bytes:
    """A JPEG of one colour chosen by ``i`` (deterministic)."""
    rng = random.Random(i)
    r, g, b = (rng.randrange(256) for _ in range(3))
    return solid_jpeg(size, (r, g, b), quality=90)

"""Read and write bandwidth of the disk tier's I/O paths on one filesystem (#50).

The disk tier keeps fixed-size slab records (a 4 MiB block record on the 27B shape; a 75-150 MiB
recurrent-state image spread over such slabs) and reads them into page-aligned pinned host
memory with several reads in flight, while background writes drain host-tier evictions. This
writes a test file in a fresh folder under ``--dir``, drops it from the page cache (fsync, then
``posix_fadvise(DONTNEED)``: no root needed; ``mincore`` says what stayed resident) and
measures, for each record size, order (random, sequential) and number in flight:

- ``baseline``: one pass over the whole file in 8 MiB O_DIRECT reads, and ``dd iflag=direct``,
  before the cases and after them (a shared disk drifts);
- ``buffered``: ``os.preadv`` / ``os.pwritev`` through the page cache from a thread pool;
- ``direct``: the same with O_DIRECT (``preadv`` releases the GIL, so threads overlap);
- ``io_uring``: O_DIRECT reads or writes kept in flight on one ring from one thread, where the
  optional ``uring_api`` package imports.

Writes end with ``fdatasync``, inside the timing. Buffers are anonymous mmaps (page-aligned,
as pinned host memory is). The page-aligned buffers and the O_DIRECT probe are the disk tier's
own (`vllm_hpc/glue/worker/disk_store.py`, which imports no torch); the rest is the standard
library, so any Python 3.11+ runs it from a checkout:

    python benchmarks/disk_io.py --file-gib 2 --record-kib 16 256 4096 --in-flight 1 4 16 \\
        --seconds 3 --json disk_io.json
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import json
import mmap
import os
import platform
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from importlib import metadata
from itertools import product
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_hpc.glue.worker.disk_store import ALIGN, aligned_buffer, direct_refusal

MIB = 1 << 20
GIB = 1 << 30
SEQ_CHUNK = 8 * MIB
ORDERS = ("random", "sequential")
PATHS = ("buffered", "direct", "io_uring")


@dataclass
class FsInfo:
    """Where the test file lives: its mount and the block device queue under it."""

    directory: str
    mount: str
    fstype: str
    source: str
    options: str
    free_gib: float
    block_device: str | None
    logical_block: int | None
    rotational: str | None
    scheduler: str | None


@dataclass
class Result:
    """One measured case."""

    op: str
    path: str
    order: str
    record_kib: int
    in_flight: int
    ops: int
    seconds: float
    mib_s: float
    p50_ms: float
    p99_ms: float
    cpu_s_per_gib: float
    resident_before: float | None


def read_text(path: Path) -> str | None:
    """A sysfs attribute, or None where it is absent."""
    try:
        return path.read_text().strip()
    except OSError:
        return None


def fs_info(directory: Path) -> FsInfo:
    """The mount (longest prefix in /proc/mounts), its type and its block device's queue."""
    real = os.path.realpath(directory)
    mount, fstype, source, options = "/", "?", "?", ""
    with open("/proc/mounts") as mounts:
        for line in mounts:
            src, mnt, kind, opts = line.split()[:4]
            mnt = mnt.replace("\\040", " ")
            inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
            if inside and len(mnt) >= len(mount):
                mount, fstype, source, options = mnt, kind, src, opts
    st = os.stat(real)
    device = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    disk: Path | None = None
    if device.exists():
        disk = device.resolve()
        if not (disk / "queue").exists():
            disk = disk.parent

    def queue(name: str) -> str | None:
        return read_text(disk / "queue" / name) if disk else None

    logical = queue("logical_block_size")
    vfs = os.statvfs(real)
    return FsInfo(
        directory=real,
        mount=mount,
        fstype=fstype,
        source=source,
        options=options,
        free_gib=vfs.f_bavail * vfs.f_frsize / GIB,
        block_device=disk.name if disk else None,
        logical_block=int(logical) if logical else None,
        rotational=queue("rotational"),
        scheduler=queue("scheduler"),
    )


def page_buffer(size: int, fill: bool) -> mmap.mmap:
    """Page-aligned anonymous memory, random bytes if ``fill`` (so writes carry no zeros)."""
    buf = aligned_buffer(size)
    if fill:
        buf.write(os.urandom(size))
    return buf


def load_uring() -> tuple[Any, str]:
    """The ``uring_api`` module, or None, and a note on what io_uring path is available."""
    try:
        import uring_api
    except ImportError as exc:
        return None, f"not measured: uring_api does not import ({exc})"
    try:
        uring_api.Ring(entries=8).close()
    except Exception as exc:  # what a kernel without io_uring raises is the binding's choice
        return None, f"not measured: io_uring_setup failed ({exc})"
    version = metadata.version("uring-api")
    return uring_api, f"uring_api {version} (liburing {uring_api.__liburing_version__})"


def fill_file(path: Path, size: int, direct: bool) -> float:
    """Write ``size`` bytes in 8 MiB chunks (O_DIRECT if ``direct``) and fsync; MiB/s."""
    chunk = page_buffer(SEQ_CHUNK, fill=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0))
    start = time.perf_counter()
    try:
        for offset in range(0, size, SEQ_CHUNK):
            struct.pack_into("<Q", chunk, 0, offset)
            os.pwritev(fd, [chunk], offset)
        os.fsync(fd)
    finally:
        os.close(fd)
    return size / MIB / (time.perf_counter() - start)


def drop_cache(fd: int) -> None:
    """Flush the file and ask the kernel to drop its clean pages from the page cache."""
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def resident_fraction(path: Path) -> float | None:
    """Fraction of the file's pages in the page cache (``mincore``), None if it can't be read."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        view = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    pages = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    anchor = ctypes.c_char.from_buffer(view)
    rc = libc.mincore(ctypes.addressof(anchor), size, vec)
    del anchor
    view.close()
    if rc != 0:
        return None
    return 1 - bytes(vec).count(0) / pages


def threaded(
    fd: int, op: str, buffers: list[mmap.mmap], offsets: list[int], seconds: float
) -> list[float]:
    """Latencies of blocking ``preadv`` / ``pwritev``, one thread per buffer.

    Thread ``i`` takes ``offsets[i::n]`` until the offsets or ``seconds`` run out.
    """
    call = os.preadv if op == "read" else os.pwritev
    lanes = len(buffers)
    deadline = time.perf_counter() + seconds

    def lane(i: int) -> list[float]:
        latencies = []
        for offset in offsets[i::lanes]:
            start = time.perf_counter()
            if start >= deadline:
                break
            if call(fd, [buffers[i]], offset) != len(buffers[i]):
                raise OSError(errno.EIO, f"short {op} at {offset}")
            latencies.append(time.perf_counter() - start)
        return latencies

    with ThreadPoolExecutor(lanes) as pool:
        return [t for lat in pool.map(lane, range(lanes)) for t in lat]


def ring_loop(
    ring_api: Any, fd: int, op: str, buffers: list[mmap.mmap], offsets: list[int], seconds: float
) -> list[float]:
    """Latencies of reads or writes kept ``len(buffers)`` deep on one io_uring, one thread."""
    todo = iter(offsets)
    deadline = time.perf_counter() + seconds
    latencies: list[float] = []
    with ring_api.Ring(entries=max(8, len(buffers))) as ring:
        prepare = ring.prepare_read if op == "read" else ring.prepare_write

        def issue(slot: int) -> int:
            offset, now = next(todo, None), time.perf_counter()
            if offset is None or now >= deadline:
                return 0
            prepare(fd, buffers[slot], offset, (slot, offset, now))
            return 1

        pending = sum(issue(slot) for slot in range(len(buffers)))
        while pending:
            for done in ring.wait() or ():
                slot, offset, start = done.user_data
                if done.res != len(buffers[slot]):
                    raise OSError(-done.res if done.res < 0 else errno.EIO, f"{op} at {offset}")
                latencies.append(time.perf_counter() - start)
                pending += issue(slot) - 1
    return latencies


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of an ascending sequence (nearest rank)."""
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


@dataclass
class Target:
    """The test file and its descriptors: buffered, and O_DIRECT (None where refused)."""

    path: Path
    size: int
    buffered_fd: int
    direct_fd: int | None
    refused: str | None
    """Why O_DIRECT was refused (the probe's reason), None where it is used."""
    fill_mib_s: float
    """The rate the file was written at (8 MiB chunks, then fsync)."""


@contextmanager
def cold_file(directory: Path, size: int) -> Iterator[Target]:
    """A ``size``-byte test file of random bytes in a fresh folder under ``directory``, written
    (O_DIRECT where allowed), fsynced and dropped from the page cache; removed afterwards.
    `gpu_disk_tier.py` takes its baseline pass on one too."""
    workdir = Path(tempfile.mkdtemp(prefix="disk_io.", dir=directory))
    path = workdir / "slabs.bin"
    fds: list[int] = []
    try:
        refused = direct_refusal(path, SEQ_CHUNK)
        fill_mib_s = fill_file(path, size, refused is None)
        fds.append(os.open(path, os.O_RDWR))
        if refused is None:
            fds.append(os.open(path, os.O_RDWR | os.O_DIRECT))
        target = Target(
            path, size, fds[0], fds[1] if refused is None else None, refused, fill_mib_s
        )
        drop_cache(target.buffered_fd)
        yield target
    finally:
        for fd in fds:
            os.close(fd)
        shutil.rmtree(workdir)


def baseline(target: Target) -> dict[str, float | None]:
    """MiB/s of one pass over the file in 8 MiB reads, and of ``dd iflag=direct``, cache dropped.

    The pass is O_DIRECT where allowed; ``dd_mib_s`` is None without O_DIRECT or dd.
    """
    drop_cache(target.buffered_fd)
    buf = page_buffer(SEQ_CHUNK, fill=False)
    fd = target.buffered_fd if target.direct_fd is None else target.direct_fd
    start = time.perf_counter()
    for offset in range(0, target.size, SEQ_CHUNK):
        os.preadv(fd, [buf], offset)
    sequential = target.size / MIB / (time.perf_counter() - start)
    dd = shutil.which("dd")
    if dd is None or target.direct_fd is None:
        return {"sequential_mib_s": sequential, "dd_mib_s": None}
    start = time.perf_counter()
    command = [dd, f"if={target.path}", "of=/dev/null", f"bs={SEQ_CHUNK}", "iflag=direct"]
    subprocess.run(command, check=True, capture_output=True)
    return {
        "sequential_mib_s": sequential,
        "dd_mib_s": target.size / MIB / (time.perf_counter() - start),
    }


def print_baseline(when: str, rates: dict[str, float | None], direct: bool) -> None:
    """One line for a baseline pass."""
    dd = rates["dd_mib_s"]
    print(
        f"{when}: sequential 8 MiB {'O_DIRECT' if direct else 'buffered'} pass "
        f"{rates['sequential_mib_s']:.0f} MiB/s, dd iflag=direct "
        f"{'not run' if dd is None else f'{dd:.0f} MiB/s'}",
        flush=True,
    )


def run_case(
    target: Target,
    ring_api: Any,
    op: str,
    kind: str,
    order: str,
    record: int,
    n: int,
    seconds: float,
) -> Result:
    """One case from a dropped page cache: ``n`` records of ``record`` bytes in flight."""
    offsets = list(range(0, target.size - record + 1, record))
    if order == "random":
        random.Random(record).shuffle(offsets)
    buffers = [page_buffer(record, fill=op == "write") for _ in range(n)]
    fd = target.buffered_fd if kind == "buffered" else target.direct_fd
    assert fd is not None
    drop_cache(target.buffered_fd)
    before = resident_fraction(target.path)
    cpu, wall = time.process_time(), time.perf_counter()
    if kind == "io_uring":
        latencies = ring_loop(ring_api, fd, op, buffers, offsets, seconds)
    else:
        latencies = threaded(fd, op, buffers, offsets, seconds)
    if op == "write":
        os.fdatasync(fd)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    latencies.sort()
    moved = len(latencies) * record
    return Result(
        op=op,
        path=kind,
        order=order,
        record_kib=record // 1024,
        in_flight=n,
        ops=len(latencies),
        seconds=wall,
        mib_s=moved / MIB / wall,
        p50_ms=1e3 * percentile(latencies, 0.5),
        p99_ms=1e3 * percentile(latencies, 0.99),
        cpu_s_per_gib=cpu / (moved / GIB),
        resident_before=before,
    )


def parse_args() -> argparse.Namespace:
    """Command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path.cwd(), help="where the test file goes")
    parser.add_argument("--file-gib", type=float, default=2.0)
    parser.add_argument("--record-kib", type=int, nargs="+", default=[16, 256, 4096])
    parser.add_argument("--in-flight", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--orders", nargs="+", choices=ORDERS, default=list(ORDERS))
    parser.add_argument("--ops", nargs="+", choices=("read", "write"), default=["read", "write"])
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--seconds", type=float, default=3.0, help="per case")
    parser.add_argument("--json", type=Path, help="write the results here")
    return parser.parse_args()


def save(report: dict[str, Any], path: Path | None) -> None:
    """Write the report so far (after every case: a run cut short keeps what it measured)."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1) + "\n")


def main() -> None:
    """Fill the test file, run every case, print a table and write the JSON."""
    args = parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    info = fs_info(args.dir)
    align = max(ALIGN, info.logical_block or ALIGN)
    if any(kib * 1024 % align for kib in args.record_kib):
        sys.exit(f"record sizes must be multiples of {align} bytes (O_DIRECT alignment)")
    size = int(args.file_gib * GIB) // SEQ_CHUNK * SEQ_CHUNK
    if size + GIB > info.free_gib * GIB:
        sys.exit(f"{info.free_gib:.1f} GiB free under {info.directory}: too little for the file")
    ring_api, ring_note = load_uring()
    print(f"{info.directory}: {info.fstype} on {info.source} ({info.options}), mount {info.mount}")
    print(
        f"block device {info.block_device}: logical block {info.logical_block}, "
        f"rotational {info.rotational}, scheduler {info.scheduler}; io_uring: {ring_note}"
    )
    cpuinfo = (read_text(Path("/proc/cpuinfo")) or "").splitlines()
    cpu_model = next((x.split(":", 1)[1].strip() for x in cpuinfo if "model name" in x), "?")
    report: dict[str, Any] = {
        "argv": sys.argv,
        "machine": {
            "kernel": platform.release(),
            "cpu": cpu_model,
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "filesystem": asdict(info),
        "io_uring": ring_note,
        "file_gib": size / GIB,
        "baseline": {},
        "cases": [],
    }
    with cold_file(args.dir, size) as target:
        refused = target.refused
        resident = resident_fraction(target.path)
        print(
            f"test file {size / GIB:.2f} GiB written at {target.fill_mib_s:.0f} MiB/s; O_DIRECT "
            f"{'used' if refused is None else 'refused: ' + refused + ', buffered only'}; "
            f"after fsync + DONTNEED {100 * (resident or 0):.1f}% of it in the page cache"
        )
        if resident is None or resident > 0.01:
            print("the page cache kept the file (or mincore failed): reads may not reach the disk")
        report |= {"o_direct_refused": refused, "fill_mib_s": target.fill_mib_s}
        report["resident_after_drop"] = resident
        report["baseline"]["start"] = baseline(target)
        print_baseline("start", report["baseline"]["start"], refused is None)
        save(report, args.json)
        available = {"buffered", *(() if refused else ("direct",))}
        available |= {"io_uring"} if refused is None and ring_api is not None else set()
        kinds = [kind for kind in args.paths if kind in available]
        print("op     path      order      rec_KiB  N    MiB/s   p50_ms   p99_ms  cpu_s/GiB  res")
        cases = product(args.ops, kinds, args.orders, args.record_kib, args.in_flight)
        for op, kind, order, kib, n in cases:
            r = run_case(target, ring_api, op, kind, order, kib * 1024, n, args.seconds)
            report["cases"].append(asdict(r))
            save(report, args.json)
            print(
                f"{op:6} {kind:9} {order:10} {kib:7} {n:2} {r.mib_s:8.0f} {r.p50_ms:8.2f} "
                f"{r.p99_ms:8.2f} {r.cpu_s_per_gib:10.3f} {100 * (r.resident_before or 0):4.0f}%",
                flush=True,
            )
        report["baseline"]["end"] = baseline(target)
        print_baseline("end", report["baseline"]["end"], refused is None)
        save(report, args.json)


if __name__ == "__main__":
    main()

"""The disk KV cache (`--disk-kv DIR`): arena rows kept as snapshot files that outlive
the process, found again by longest common prefix (after a restart, or after another
conversation overwrote the arena). docs/disk-kv.md has the file format and the safety
argument; in short:

- save (engine thread, after a request): the ids whose KV is valid are matched against the
  snapshots; only the rows past the longest common prefix with the best one are copied out
  of the arena (a delta naming that snapshot as its parent, at most MAX_CHAIN deep), and the
  writer thread writes them: temp file, fsync, rename, fsync of DIR. The copy is what lets
  the next request overwrite the arena at once; the engine never waits for the disk.
- restore (engine thread, before the prefill): the snapshot with the longest common prefix
  with the prompt, if it reaches prefix_min and beats what memory kept, is checked (header,
  fingerprint of model + KV layout, ids compared, crc32 of the payload) and its rows are
  copied from a memory map into the arena.
- DIR is held under an exclusive flock; only names we generate (`kv-<32 hex>.kv`) are
  read, opened relative to DIR with O_NOFOLLOW; the least recently used files are evicted
  so that DIR stays under max_bytes. A bad file is skipped with a warning, never trusted.

Thread-safety: `restore`, `save` and `close` run on the engine thread; the writer thread
writes and evicts; `stats` may be called from any thread. `_lock` guards the index and the
counters and is never held during file I/O.
"""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import logging
import mmap
import os
import queue
import re
import secrets
import stat
import struct
import sys
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .. import __version__
from ..errors import StartupError
from .kvcache import KVCache, KVLayout, RowBlock
from .prefix import common_prefix_len
from .snapshots import (MAX_CHAIN, Snapshot, SnapshotIndex, check_layout, restore_keep,
                        segments)

log = logging.getLogger("kestreld.diskkv")

FORMAT_VERSION = 1
MAGIC = b"KSTRLKV\x00"
HEADER_SIZE = 128                # fixed header, zero-padded; then ids, then the payload
PAYLOAD_ALIGN = 64
ID_BYTES = 8                     # int64 ids: token ids, or the negative image keys of Qwen3-VL
# magic, version, header_size, fingerprint, n_tokens, base, parent, n_layers, n_kv_heads,
# head_dim, payload_bytes, ids_crc, payload_crc; then the crc32 of these bytes
_FIELDS = struct.Struct("<8sII32sII16sIIIQII")
_CRC = struct.Struct("<I")
NAME = re.compile(r"kv-[0-9a-f]{32}\.kv")
TEMP = re.compile(r"kv-[0-9a-f]{32}\.tmp")
WRITE_QUEUE = 4                  # snapshots waiting for the writer; beyond, new ones are dropped
MODEL_HEAD_BYTES = 4 << 20       # hashed from the model file: the GGUF header and metadata
MODEL_TAIL_BYTES = 64 << 10
CLOSE_WAIT_S = 10.0              # at shutdown: for the writer's queue (within TimeoutStopSec=30)


# ---------------------------------------------------------------- identity of the KV

def model_identity(path: str) -> bytes:
    """Size, mtime and a hash of the head and tail of the model file (of every file of a
    model directory): cheap at each start, never a hash of gigabytes of weights."""
    h = hashlib.blake2b(digest_size=32)
    files = ([(os.path.join(path, n), n) for n in sorted(os.listdir(path))]
             if os.path.isdir(path) else [(path, "")])
    for p, name in files:
        st = os.stat(p)
        if not stat.S_ISREG(st.st_mode):
            continue
        h.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        with open(p, "rb") as f:
            h.update(f.read(MODEL_HEAD_BYTES))
            if st.st_size > MODEL_HEAD_BYTES:
                f.seek(max(MODEL_HEAD_BYTES, st.st_size - MODEL_TAIL_BYTES))
                h.update(f.read())
    return h.digest()


def kv_fingerprint(model, max_seq: int) -> bytes:
    """What a snapshot is valid for: this model file (and its mmproj, whose encoder made the
    KV of image tokens), its hyperparameters (layers, KV heads, head_dim, RoPE theta and
    style, ...), the arena's layout and dtypes, the format and the Kestrel version that
    computed the KV, and the byte order."""
    c = model.config
    key = repr((FORMAT_VERSION, __version__, sys.byteorder, "k,v int8 + f32 scale per head",
                sorted(dataclasses.asdict(c).items()),
                KVLayout.of(c, max_seq)))
    files = model_identity(model.path) + (model_identity(model.mmproj) if model.mmproj else b"")
    return hashlib.blake2b(key.encode() + files, digest_size=32).digest()


# ---------------------------------------------------------------- the file format

def _payload_sizes(layout: KVLayout, rows: int) -> tuple[int, int]:
    """(bytes of k_q, bytes of k_s) for `rows` tokens; the payload is k_q v_q k_s v_s, in
    the arena's layout (KVLayout.rows_shapes)."""
    q_shape, _, s_shape, _ = layout.rows_shapes(rows)
    return int(np.prod(q_shape)), int(np.prod(s_shape)) * 4


def _payload_offset(n_tokens: int) -> int:
    end = HEADER_SIZE + ID_BYTES * n_tokens
    return -(-end // PAYLOAD_ALIGN) * PAYLOAD_ALIGN


def file_size(layout: KVLayout, n_tokens: int, base: int) -> int:
    """Size of a snapshot file of ids [0, n_tokens) holding rows [base, n_tokens)."""
    q, s = _payload_sizes(layout, n_tokens - base)
    return _payload_offset(n_tokens) + 2 * q + 2 * s


@dataclass(frozen=True)
class Header:
    fingerprint: bytes
    n_tokens: int                # ids in the file: rows [0, n_tokens) of the chain
    base: int                    # rows [0, base) are the parent's, [base, n_tokens) this file's
    parent: Optional[str]        # the parent's file name
    layout: tuple                # (n_layers, n_kv_heads, head_dim)
    payload_bytes: int
    ids_crc: int
    payload_crc: int

    def pack(self) -> bytes:
        parent = bytes.fromhex(self.parent[3:35]) if self.parent else bytes(16)
        body = _FIELDS.pack(MAGIC, FORMAT_VERSION, HEADER_SIZE, self.fingerprint, self.n_tokens,
                            self.base, parent, *self.layout, self.payload_bytes, self.ids_crc,
                            self.payload_crc)
        return (body + _CRC.pack(zlib.crc32(body))).ljust(HEADER_SIZE, b"\0")

    @classmethod
    def parse(cls, raw: bytes) -> "Header":
        """The header of a snapshot file; ValueError saying what is wrong."""
        if len(raw) < HEADER_SIZE:
            raise ValueError(f"header of {len(raw)} bytes, want {HEADER_SIZE}")
        body = raw[:_FIELDS.size]
        (magic, version, header_size, fp, n, base, parent, n_layers, n_kv, hd, payload_bytes,
         ids_crc, payload_crc) = _FIELDS.unpack(body)
        if magic != MAGIC:
            raise ValueError("not a Kestrel KV snapshot (bad magic)")
        if version != FORMAT_VERSION or header_size != HEADER_SIZE:
            raise ValueError(f"format version {version}, this Kestrel reads {FORMAT_VERSION}")
        if _CRC.unpack_from(raw, _FIELDS.size)[0] != zlib.crc32(body):
            raise ValueError("header checksum mismatch")
        if base > n or (base == 0) != (parent == bytes(16)):
            raise ValueError(f"inconsistent header: base {base}, {n} tokens")
        return cls(fp, n, base, f"kv-{parent.hex()}.kv" if base else None, (n_layers, n_kv, hd),
                   payload_bytes, ids_crc, payload_crc)


# ---------------------------------------------------------------- the store

class DiskKV:
    """Snapshots of arena rows in one directory; see the module docstring."""

    def __init__(self, directory: str, max_bytes: int, fingerprint: bytes, layout: KVLayout,
                 prefix_min: int = 16):
        self.directory = os.path.abspath(directory)
        self.max_bytes = max_bytes
        self.fingerprint = fingerprint
        self.layout = layout
        self.prefix_min = prefix_min
        self._lock = threading.Lock()
        self._index = SnapshotIndex()
        self._counts = dict(hits=0, misses=0, bytes_read=0, bytes_written=0, writes=0,
                            evictions=0, rejected=0, dropped=0)
        self._dir_fd = self._open_dir()
        self._closed = False
        try:
            self._scan()
        except OSError as e:
            os.close(self._dir_fd)
            raise StartupError(f"--disk-kv {self.directory}: cannot use it: {e}") from None
        self._queue: queue.Queue = queue.Queue(WRITE_QUEUE)
        self._writer = threading.Thread(target=self._write_loop, name="kestrel-disk-kv", daemon=True)
        self._writer.start()
        s = self.stats()
        log.info("disk KV cache %s: %d snapshots, %.1f MB of max %.1f MB", self.directory,
                 s["files"], s["bytes"] / 1e6, max_bytes / 1e6)

    @classmethod
    def for_model(cls, directory: str, max_bytes: int, model, max_seq: int,
                  prefix_min: int = 16) -> "DiskKV":
        """The store for this model's arena of `max_seq` tokens."""
        c = model.config
        return cls(directory, max_bytes, kv_fingerprint(model, max_seq),
                   KVLayout.of(c, max_seq), prefix_min)

    # ------------------------------------------------------------ engine thread

    def restore(self, keys, kv: KVCache) -> bool:
        """Copy into the KV cache, after its valid rows, the rows of the snapshot with the
        longest common prefix with the prompt's `keys`; True if it did, False if the disk
        holds nothing better than the memory (kv.cache_len) or nothing verified."""
        check_layout(self.layout, kv)
        have = kv.cache_len
        prompt = np.asarray(keys, dtype=np.int64)
        with self._lock:
            best, lcp = self._index.best(prompt, lambda s: s.ours and s.written)
            chain = self._index.chain(best) if best is not None else []
        keep = restore_keep(lcp, len(prompt), have, self.prefix_min)
        if keep is None:
            if have == 0:
                self._count(misses=1)
                log.info("[KV-DISK] miss lcp=%d", lcp)
            return False
        t0 = time.perf_counter()
        rows = self._load(chain, prompt, have, keep)
        if rows is None:
            self._count(misses=1)
            return False
        block, nread = rows
        kv.restore(have, prompt[:keep].tolist(), block)
        self._touch(chain)
        self._count(hits=1, bytes_read=nread)
        log.info("[KV-DISK] hit keep=%d prompt=%d prefill=%d file=%s (+%d parents) "
                 "read=%.1f MB in %.0f ms", keep, len(prompt), len(prompt) - keep, best.name,
                 len(chain) - 1, nread / 1e6, (time.perf_counter() - t0) * 1e3)
        return True

    def save(self, kv: KVCache) -> None:
        """After a request: hand the writer the rows of the KV cache that no snapshot holds
        yet. They are copied out of the arena here, so the next request may overwrite it at
        once; this never waits for the disk."""
        check_layout(self.layout, kv)
        new = np.asarray(kv.keys, dtype=np.int64)
        n = len(new)
        if n < self.prefix_min:
            return
        with self._lock:
            parent, base = self._index.place(new, self.prefix_min, lambda s: s.ours)
            chain = self._index.chain(parent) if parent is not None else []
            if base == n:                            # all on disk already: just keep it fresh
                entry = None
            else:
                entry = Snapshot(f"kv-{secrets.token_hex(16)}.kv", new, base,
                                 parent.name if parent else None, file_size(self.layout, n, base),
                                 time.time_ns(), ours=True, written=False)
                if entry.nbytes > self.max_bytes:
                    log.info("[KV-DISK] %d tokens not saved: %d bytes exceed the cap of %d",
                             n, entry.nbytes, self.max_bytes)
                    self._counts["dropped"] += 1
                    entry = None
                else:   # from now on its parents are not evicted
                    self._index.entries[entry.name] = entry
        self._touch(chain)
        if entry is None:
            return
        rows = kv.copy_rows(entry.base, n)
        try:
            self._queue.put_nowait((entry, rows))
        except queue.Full:
            log.warning("[KV-DISK] writer behind (%d snapshots queued): %d tokens not saved",
                        WRITE_QUEUE, n)
            with self._lock:
                self._index.entries.pop(entry.name, None)
                self._counts["dropped"] += 1

    def close(self, timeout: float = CLOSE_WAIT_S) -> None:
        """Write what is queued (waiting at most `timeout` s), stop the writer, release DIR.
        Once; later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._writer.join(timeout)
        if self._writer.is_alive():
            log.warning("[KV-DISK] writer still busy after %.0f s; its snapshot is lost", timeout)
            return
        os.close(self._dir_fd)

    # ------------------------------------------------------------ any thread

    def stats(self) -> dict:
        """Files and bytes in DIR, hits, misses, bytes read and written, and the rest."""
        with self._lock:
            entries = self._index.entries
            written = [s for s in entries.values() if s.written]
            return {"enabled": True, "dir": self.directory,
                    "files": sum(s.ours for s in written),
                    "foreign_files": sum(not s.ours for s in written),
                    "bytes": sum(s.nbytes for s in written), "max_bytes": self.max_bytes,
                    "queued": len(entries) - len(written), **self._counts}

    # ------------------------------------------------------------ files

    def _open_dir(self) -> int:
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise StartupError(f"--disk-kv {self.directory}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise StartupError(f"--disk-kv {self.directory} is in use by another kestreld") from None
        return fd

    def _open(self, name: str) -> int:
        """Open one of our files read-only inside DIR: never through a symlink, never a FIFO
        or device (OSError)."""
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=self._dir_fd)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.EINVAL, "not a regular file")
        return fd

    def _scan(self) -> None:
        """Rebuild the index from DIR: remove temp files of interrupted writes, read each
        snapshot's header and ids, drop the corrupt and those whose parent is gone."""
        for name in sorted(os.listdir(self._dir_fd)):
            if TEMP.fullmatch(name):
                log.info("[KV-DISK] removing %s, left by an interrupted write", name)
                self._unlink(name)
            elif NAME.fullmatch(name):
                try:
                    self._index.entries[name] = self._read_entry(name)
                except OSError as e:
                    log.warning("[KV-DISK] %s skipped: %s", name,
                                "a symlink, not followed" if e.errno == errno.ELOOP else e.strerror)
                except ValueError as e:
                    log.warning("[KV-DISK] %s is corrupt (%s): not used, removed", name, e)
                    self._counts["rejected"] += 1
                    self._unlink(name)
        broken = [s.name for s in self._index.entries.values()
                  if s.ours and not self._chain_ok(s)]
        for name in self._index.drop(broken):
            log.warning("[KV-DISK] %s: a parent is gone, differs or loops: removed", name)
            self._unlink(name)

    def _chain_ok(self, s: Snapshot) -> bool:
        """Every parent present, of ours, holding the ids the child relies on; no loop."""
        seen = set()
        while s.parent is not None:
            p = self._index.entries.get(s.parent)
            if (p is None or not p.ours or p.name in seen or len(seen) > MAX_CHAIN
                    or common_prefix_len(p.ids, s.ids) < s.base):
                return False
            seen.add(p.name)
            s = p
        return True

    def _read_entry(self, name: str) -> Snapshot:
        """The index entry of a file: its header and ids checked, payload not read."""
        fd = self._open(name)
        try:
            st = os.fstat(fd)
            h = Header.parse(os.pread(fd, HEADER_SIZE, 0))
            layout = KVLayout(*h.layout, self.layout.max_seq)
            if st.st_size != file_size(layout, h.n_tokens, h.base):   # before reading n ids
                raise ValueError(f"{st.st_size} bytes, the header says "
                                 f"{file_size(layout, h.n_tokens, h.base)}")
            ids = os.pread(fd, ID_BYTES * h.n_tokens, HEADER_SIZE)
        finally:
            os.close(fd)
        if len(ids) != ID_BYTES * h.n_tokens or zlib.crc32(ids) != h.ids_crc:
            raise ValueError("ids checksum mismatch")
        ours = (h.fingerprint == self.fingerprint and layout == self.layout
                and h.n_tokens < self.layout.max_seq)
        return Snapshot(name, np.frombuffer(ids, dtype="<i8").astype(np.int64), h.base, h.parent,
                        st.st_size, st.st_mtime_ns, ours)

    def _load(self, chain: list, prompt: np.ndarray, lo: int, hi: int) -> Optional[tuple]:
        """Rows [lo, hi) of the chain, each file verified first: (RowBlock, bytes read), or
        None if a file is missing or bad (it and its children are then removed)."""
        block = RowBlock.empty(self.layout, hi - lo)
        nread = 0
        for s, a, b in segments(chain, lo, hi):
            try:
                nread += self._copy_rows(s, prompt, a, b, block, lo)
            except (OSError, ValueError) as e:
                log.warning("[KV-DISK] %s not used (%s): removed", s.name,
                            getattr(e, "strerror", None) or e)
                with self._lock:
                    self._counts["rejected"] += 1
                    gone = self._index.drop([s.name])
                for name in gone:
                    self._unlink(name)
                return None
        return block, nread

    def _copy_rows(self, s: Snapshot, prompt: np.ndarray, a: int, b: int, block: RowBlock,
                   lo: int) -> int:
        """Verify one file against its index entry and the prompt, then copy its rows [a, b)
        into `block` (rows from `lo` on) from a read-only memory map. Returns the file's size."""
        fd = self._open(s.name)
        try:
            size = os.fstat(fd).st_size
            if size != s.nbytes:
                raise ValueError(f"{size} bytes, indexed with {s.nbytes}")
            mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        h = Header.parse(mm[:HEADER_SIZE])
        if (h.fingerprint, h.n_tokens, h.base, h.parent) != (self.fingerprint, len(s.ids), s.base, s.parent):
            raise ValueError("header differs from the one indexed")
        ids = np.frombuffer(mm, dtype="<i8", count=h.n_tokens, offset=HEADER_SIZE)
        if zlib.crc32(ids) != h.ids_crc or not np.array_equal(ids[:b], prompt[:b]):
            raise ValueError("token ids differ from the prompt's")
        off = _payload_offset(h.n_tokens)
        if zlib.crc32(memoryview(mm)[off:off + h.payload_bytes]) != h.payload_crc:
            raise ValueError("payload checksum mismatch")
        m = h.n_tokens - h.base
        shapes = self.layout.rows_shapes(m)
        q, sc = _payload_sizes(self.layout, m)
        offsets = (off, off + q, off + 2 * q, off + 2 * q + sc)
        src = RowBlock(*(np.frombuffer(mm, dtype, int(np.prod(shape)), o).reshape(shape)
                         for shape, dtype, o in zip(shapes, (np.int8, np.int8, np.float32,
                                                             np.float32), offsets)))
        for dst, rows in zip(block, src.slice(a - h.base, b - h.base)):
            dst[:, :, a - lo:b - lo] = rows
        return size          # the map goes with its last view (no close: views may outlive it)

    def _touch(self, chain: list) -> None:
        """Mark snapshots used now: in the index and as the files' mtime (LRU after a restart)."""
        now = time.time_ns()
        with self._lock:
            self._index.touch(chain, now)
        for s in chain:
            if s.written:
                try:
                    os.utime(s.name, ns=(now, now), dir_fd=self._dir_fd, follow_symlinks=False)
                except OSError:
                    pass              # gone meanwhile: the next lookup will notice

    def _unlink(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self._dir_fd)
        except FileNotFoundError:
            pass

    # ------------------------------------------------------------ writer thread

    def _write_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            entry, rows = job
            try:
                self._write(entry, rows)
            except Exception as e:     # a full disk, or a bug: the daemon goes on without it
                if isinstance(e, OSError):
                    log.warning("[KV-DISK] cannot write %s: %s", entry.name, e.strerror or e)
                else:
                    log.exception("[KV-DISK] cannot write %s", entry.name)
                with self._lock:
                    self._index.drop([entry.name])
                    self._counts["dropped"] += 1

    def _write(self, entry: Snapshot, rows: list) -> None:
        """Evict for room, then write one snapshot atomically: a temp file in DIR, fsync,
        rename over nothing, fsync DIR. A crash leaves a temp file (removed at the next
        start) or the whole snapshot, never a torn one under its final name."""
        with self._lock:
            parent = self._index.entries.get(entry.parent) if entry.parent else None
            parent_ok = entry.parent is None or (parent is not None and parent.written)
            victims = (self._index.victims(entry.nbytes, self.max_bytes, set()) if parent_ok
                       else None)
            if victims is None:
                self._index.drop([entry.name])
                self._counts["dropped"] += 1
            else:
                self._counts["evictions"] += len(victims)
        if victims is None:
            log.warning("[KV-DISK] %s not written: %s", entry.name,
                        f"does not fit in {self.max_bytes} bytes" if parent_ok
                        else "its parent was not written")
            return
        for name in victims:
            log.info("[KV-DISK] evict file=%s (least recently used)", name)
            self._unlink(name)
        t0 = time.perf_counter()
        payload_crc = 0
        for a in rows:
            payload_crc = zlib.crc32(a, payload_crc)
        ids = entry.ids.astype("<i8").tobytes()
        header = Header(self.fingerprint, len(entry.ids), entry.base, entry.parent,
                        (self.layout.n_layers, self.layout.n_kv_heads, self.layout.head_dim),
                        sum(a.nbytes for a in rows), zlib.crc32(ids), payload_crc).pack()
        tmp = entry.name[:-3] + ".tmp"
        try:
            with open(tmp, "xb", opener=self._create) as f:
                f.write(header)
                f.write(ids)
                f.write(bytes(_payload_offset(len(entry.ids)) - HEADER_SIZE - len(ids)))
                for a in rows:
                    f.write(a)
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, entry.name, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
        except BaseException:
            self._unlink(tmp)
            raise
        os.fsync(self._dir_fd)
        mtime = os.stat(entry.name, dir_fd=self._dir_fd, follow_symlinks=False).st_mtime_ns
        with self._lock:
            entry.written = True
            entry.last_used = max(entry.last_used, mtime)
            self._counts["writes"] += 1
            self._counts["bytes_written"] += entry.nbytes
        log.info("[KV-DISK] wrote file=%s tokens=%d rows=%d..%d parent=%s %.1f MB in %.0f ms",
                 entry.name, len(entry.ids), entry.base, len(entry.ids), entry.parent,
                 entry.nbytes / 1e6, (time.perf_counter() - t0) * 1e3)

    def _create(self, name: str, flags: int) -> int:
        """open()'s opener: a new file in DIR, mode 0600, never through a symlink."""
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self._dir_fd)

    # ------------------------------------------------------------ small helpers

    def _count(self, **deltas) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._counts[k] += v

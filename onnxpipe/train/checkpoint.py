"""Checkpoints: per stage an .npz (weights, optimizer state) with its sha256 in a small JSON, plus
`checkpoint.json` (step, data cursor, settings) written last, all in a temp directory that then
replaces the previous checkpoint directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from onnxpipe.errors import OnnxpipeError
from onnxpipe.fileio import atomic_path, fresh_dir_beside, swap_in
from onnxpipe.safepath import inside

__all__ = ["StageState", "ensure_checkpoint_dir", "hold_checkpoint_dir", "save_checkpoint", "load_checkpoint"]

#: (parameters, optimizer state) of one stage.
StageState = tuple[dict[str, np.ndarray], dict[str, np.ndarray]]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_atomic(path: Path, write: Any) -> None:
    """Write through a temp file, synced to disk before the rename: a checkpoint must survive a crash."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def ensure_checkpoint_dir(directory: str | os.PathLike) -> None:
    """Fail before training starts, not at the first checkpoint, when `directory` cannot take checkpoints:
    another run holds it, it holds other files, or it cannot be written. An interrupted directory swap
    left beside it is recovered on the way (`hold_checkpoint_dir`)."""
    with hold_checkpoint_dir(directory):
        _ensure_usable(Path(directory))


def _ensure_usable(root: Path) -> None:
    if root.exists() and (not root.is_dir() or any(not _CHECKPOINT_FILE.match(p.name) for p in root.iterdir())):
        raise OnnxpipeError(f"{root}: holds files other than a checkpoint; give --checkpoint-dir a directory of its own")
    _fresh_beside(root).rmdir()


@contextlib.contextmanager
def hold_checkpoint_dir(directory: str | os.PathLike) -> Iterator[Path]:
    """Hold `directory` for one run: an exclusive lock on `.NAME.lock` beside it (the kernel releases it
    when its holder dies, SIGKILL included; removed on release), then recover what an interrupted swap
    of it left (`_recover_swap`), and again on release. A second run gets one line naming the holder's PID."""
    root = Path(directory)
    parent = root.absolute().parent
    lock_path = parent / f".{root.name}.lock"
    try:
        parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise OnnxpipeError(f"{root}: another run (pid {holder}) is using this checkpoint directory; "
                                    "wait for it to end or choose another --checkpoint-dir") from None
            try:  # the file we locked may have been released and removed meanwhile: lock the one in place
                if os.stat(lock_path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
    except OSError as exc:
        raise OnnxpipeError(f"{root}: cannot write a checkpoint there ({exc.strerror}); choose a writable --checkpoint-dir") from exc
    try:
        _recover_swap(root)
        yield root
    finally:
        with contextlib.suppress(OSError):
            _recover_swap(root)  # what this run's writes could not remove themselves (a replaced checkpoint's rmtree that failed part-way)
        with contextlib.suppress(OSError):
            lock_path.unlink()
        os.close(fd)


def _recover_swap(root: Path) -> None:
    """Directories a killed writer left beside `root` (`.NAME.old<pid>` of a swap, `.NAME.*.tmp` being
    written): when `root` has no checkpoint, the newest complete one among them takes its place; the
    rest are removed. Call with the directory held."""
    parent = root.absolute().parent
    left = [p for p in (*parent.glob(f".{root.name}.old*"), *parent.glob(f".{root.name}.*.tmp")) if p.is_dir() and not p.is_symlink()]
    if not left:
        return
    if not (root / "checkpoint.json").is_file() and (not root.exists() or (root.is_dir() and not any(root.iterdir()))):
        complete = []
        for candidate in left:
            with contextlib.suppress(OnnxpipeError, OSError, ValueError):
                complete.append((load_checkpoint(candidate)[0], candidate))
        if complete:
            if root.exists():
                root.rmdir()
            os.replace(max(complete, key=lambda c: c[0])[1], root)
    for candidate in left:
        shutil.rmtree(candidate, ignore_errors=True)


def _fresh_beside(root: Path) -> Path:
    """A new empty directory beside `root` (its parents made as needed)."""
    try:
        return fresh_dir_beside(root)
    except OSError as exc:
        raise OnnxpipeError(f"{root}: cannot write a checkpoint there ({exc.strerror}); choose a writable --checkpoint-dir") from exc


def save_checkpoint(directory: str | os.PathLike, step: int, states: Sequence[StageState], meta: Mapping[str, Any]) -> None:
    """Write a checkpoint after `step` completed steps (the next step trains on batch `step`).

    All or nothing: the files go to a fresh directory beside `directory`, which then takes its place;
    an interrupted or failed write leaves the previous checkpoint as it was."""
    root = Path(directory)
    _ensure_usable(root)
    tmp: Path | None = None
    try:
        tmp = _fresh_beside(root)
        entries = []
        for i, (params, opt) in enumerate(states):
            npz = tmp / f"stage_{i}.npz"
            arrays = {f"param:{k}": v for k, v in params.items()} | {f"opt:{k}": v for k, v in opt.items()}
            _write_atomic(npz, lambda f, a=arrays: np.savez(f, **a))
            info = {"file": npz.name, "sha256": _sha256(npz), "step": step}
            _write_atomic(tmp / f"stage_{i}.json", lambda f, d=info: f.write(json.dumps(d, indent=2).encode()))
            entries.append(info)
        top = {"format": "onnxpipe.checkpoint/1", "step": step, "stages": entries, "meta": dict(meta)}
        _write_atomic(tmp / "checkpoint.json", lambda f: f.write(json.dumps(top, indent=2).encode()))
        swap_in(tmp, root)
    except OSError as exc:
        raise OnnxpipeError(f"{root}: cannot write the checkpoint ({exc.strerror or exc}); free space or choose another --checkpoint-dir") from exc
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


#: Names a checkpoint directory holds (temp files of an interrupted write included).
_CHECKPOINT_FILE = re.compile(r"^(checkpoint\.json|stage_\d+\.(npz|json))$|^\..*\.tmp\d+$")


def load_checkpoint(directory: str | os.PathLike) -> tuple[int, list[StageState], dict[str, Any]]:
    """Read and verify a checkpoint: every stage file's checksum and step must match."""
    root = Path(directory)
    top_path = root / "checkpoint.json"
    if not top_path.is_file():
        raise OnnxpipeError(f"{root}: no checkpoint.json, nothing to resume; pass a directory written by --checkpoint-dir or Pipeline.save, "
                            "or start without --resume")
    try:
        top = json.loads(top_path.read_text())
        step, entries = int(top["step"]), list(top["stages"])
        if not all(isinstance(e, dict) and isinstance(e["sha256"], str) and isinstance(e["step"], int) for e in entries):
            raise TypeError("each stage entry needs file, sha256 and step")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as exc:
        raise OnnxpipeError(f"{top_path}: unreadable checkpoint index ({exc}); restart without --resume") from exc
    states: list[StageState] = []
    for entry in entries:
        npz = inside(root, entry.get("file"), f"{top_path}: stage file",
                     "a checkpoint names only files inside its directory; restart without --resume")
        if not npz.is_file() or _sha256(npz) != entry["sha256"]:
            raise OnnxpipeError(f"{npz}: checkpoint file is missing or corrupted (sha256 mismatch); delete the checkpoint directory or restore it")
        if entry["step"] != step:
            raise OnnxpipeError(f"{npz}: holds step {entry['step']}, the checkpoint step {step}; the checkpoint was interrupted, restart without --resume")
        with np.load(npz) as data:
            params = {k[len("param:"):]: data[k] for k in data.files if k.startswith("param:")}
            opt = {k[len("opt:"):]: data[k] for k in data.files if k.startswith("opt:")}
        states.append((params, opt))
    return step, states, dict(top.get("meta", {}))

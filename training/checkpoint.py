"""Checkpoints and resume, as one object the training loop calls by name: ``Checkpoints``
resumes once (resume), saves after a step when a checkpoint is due (save_if_due: every
--checkpoint-every steps, or now, when the run stops for a requeue) and takes the epoch's own
(end_epoch).

How each strategy saves stays in its script (``save_checkpoint(path, state, meta)``): DDP and
DataParallel write one file from rank 0, FSDP a sharded DCP folder from every rank. The
one-file formats load with ``load_one_file`` here; FSDP's folder with its script's
``load_checkpoint``. What this module adds is the same for all three: names
that sort in training order, atomic writes, pruning to --keep-checkpoints, the newest usable
checkpoint on resume, the random state of every rank, and the steps a resumed epoch already
ran with their figures (so that its line covers the whole epoch). The stop for a requeue is
stopping.py's, the NaN guard before each checkpoint lossguard.py's.
"""

from __future__ import annotations

import os
import random
import re
import shlex
import shutil
import tempfile
import time
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from training import hangs
from training.distributed import every_rank, on_rank0, print0, raise_if_any_rank, rank_and_world
from training.faults import UsageError, disk_full, lock_checkpoint_dir, make_folder
from training.schedule import place_schedule
from training.stopping import holding_ctrl_c

# --------------------------------------------------------------------------------------------
# Checkpoint files: names, atomic writes, pruning
# --------------------------------------------------------------------------------------------


CHECKPOINT_RE = r"^ckpt-e(\d+)-s(\d+)(\.pt)?$"

#: Why a whole checkpoint may not load, where the load's own exception says it in its terms.
OTHER_RUN = ("a checkpoint of another script (fsdp_train.py writes folders, ddp_train.py and "
             "dp_train.py files) or of another --model or --dataset (another number of classes) "
             "loads only with those")


def checkpoint_name(epoch: int, step: int) -> str:
    """Name of the checkpoint taken after ``step`` steps of epoch index ``epoch`` (0-based);
    the end of epoch e is (e + 1, 0). Zero-padded, so names sort in training order."""
    return f"ckpt-e{epoch:04d}-s{step:07d}"


def entries(directory) -> list:
    """What a checkpoint folder holds, sorted; one sentence where this user may not list it
    (a folder that can be written but not read: chmod 300)."""
    try:
        return sorted(Path(directory).iterdir())
    except PermissionError:
        raise UsageError(f"--checkpoint-dir {directory} cannot be read (permission denied), so "
                         f"its checkpoints cannot be found: make it readable (chmod u+rwx "
                         f"{shlex.quote(str(directory))}) or choose another folder") from None


def list_checkpoints(directory) -> list:
    """Complete checkpoints in ``directory``, newest first. Temporary files and folders of an
    interrupted save never match (they are renamed into place only once complete)."""
    if not directory or not Path(directory).is_dir():
        return []
    found = [p for p in entries(directory) if re.match(CHECKPOINT_RE, p.name)]
    return sorted(found, key=training_order, reverse=True)


def training_order(path: Path) -> tuple:
    """(epoch, step) of a checkpoint's name: its place in training order, within one run's
    steps per epoch."""
    m = re.match(CHECKPOINT_RE, path.name)
    return int(m.group(1)), int(m.group(2))


def _remove(path: Path) -> None:
    """Delete a checkpoint file or DCP folder; nothing when it is not there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)


def prune_checkpoints(directory, keep: int) -> None:
    for old in list_checkpoints(directory)[keep:]:
        _remove(old)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_checkpoint(tmp: Path, path: Path) -> None:
    """Move a complete checkpoint, file or DCP folder, from ``tmp`` to ``path``, replacing
    whatever is there. A file renamed over a file replaces it at once. A folder cannot be
    renamed over a non-empty folder (nor a file over a folder, or a folder over a file), so
    there the old one is first renamed aside to ``.old-<name>``, the new one renamed in, then
    the old one deleted: a crash at any point leaves the old or the new checkpoint, and
    ``tidy_checkpoint_dir`` renames a lone ``.old-<name>`` back at the next start."""
    aside = None
    if (path.is_dir() and not path.is_symlink()) or (tmp.is_dir() and (path.exists()
                                                                        or path.is_symlink())):
        aside = path.with_name(f".old-{path.name}")
        _remove(aside)
        os.replace(path, aside)
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    if aside is not None:
        _remove(aside)


def tidy_checkpoint_dir(directory) -> None:
    """At start, before anything is listed: finish a replacement a crash interrupted (a lone
    ``.old-<name>`` becomes ``<name>`` again) and delete what interrupted saves left behind
    (``.tmp-*`` files and folders, a superseded ``.old-*``). Only the run holding the
    directory's lock calls this, so no live save is touched."""
    if not directory or not Path(directory).is_dir():
        return
    for p in entries(directory):
        if p.name.startswith(".old-"):
            original = p.with_name(p.name[len(".old-"):])
            if original.exists():
                _remove(p)
            else:
                os.replace(p, original)
        elif p.name.startswith(".tmp-"):
            _remove(p)


def claim_checkpoint_dir(directory, fresh: bool = False) -> None:
    """Every rank, before resuming: rank 0 takes the lock and tidies what a crash left; for a
    fresh start (--resume never) it also moves the checkpoints already there aside."""
    def claim():
        lock_checkpoint_dir(directory)
        tidy_checkpoint_dir(directory)
        if fresh:
            set_aside_checkpoints(directory, list_checkpoints(directory), "--resume never")

    if directory:
        on_rank0(claim)


def set_aside_checkpoints(directory, old: list, why: str) -> None:
    """Move the checkpoints ``old`` into ``superseded-<time>-*/`` inside ``directory``: a run's
    own would otherwise be pruned first whenever an older run's sort newer (a later epoch, or
    a later step at more steps per epoch), and --resume auto would later continue the older
    run. Nothing is deleted."""
    if not old:
        return
    aside = Path(tempfile.mkdtemp(prefix=f"superseded-{time.strftime('%Y%m%d-%H%M%S')}-",
                                  dir=directory))
    for path in old:
        os.replace(path, aside / path.name)
    print0(f"note: {why}: moved the {len(old)} checkpoint(s) already in {directory} to "
           f"{aside} (delete it when you no longer need them)")


def atomic_save(obj, path) -> None:
    """torch.save to a temporary file, fsync, rename: a crash leaves the old file or the new
    one, never half a file under the final name. A full disk is a UsageError, with the
    temporary file removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # within a file name's 255 bytes: a name that fits must not fail for its temporary's
    prefix = os.fsencode(f".tmp-{path.name}")[:240].decode(errors="ignore")
    tmp = path.with_name(f"{prefix}-{os.getpid()}")
    with holding_ctrl_c():  # a Ctrl-C inside torch.save broke its zip writer: after it
        try:
            with open(tmp, "wb") as f:
                torch.save(obj, f)
                f.flush()
                os.fsync(f.fileno())
        except BaseException as exc:
            tmp.unlink(missing_ok=True)
            if disk_full(exc):
                raise disk_full_error(path) from None
            if isinstance(exc.__context__, KeyboardInterrupt):  # a second Ctrl-C, at once:
                raise KeyboardInterrupt from None  # not the zip writer's error on its way up
            raise
        replace_checkpoint(tmp, path)


def _size(path: Path) -> int:
    """Bytes of a checkpoint file or DCP folder."""
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size


def disk_full_error(path: Path) -> UsageError:
    """The sentence for a save to ``path`` that found no space: how much is free; for a
    checkpoint also how much the save needs (the size of the newest complete checkpoint
    beside it, when there is one), and what the ``superseded-*`` folders beside it hold
    (set_aside_checkpoints deletes nothing, so earlier runs' checkpoints can be what filled
    the disk), and to resume once there is room."""
    folder = path.parent
    free = shutil.disk_usage(folder).free / 2**20
    if not re.match(CHECKPOINT_RE, path.name):  # --save-model's, export_model.py's file
        return UsageError(f"no space left on the file system of {folder} to write {path.name} "
                          f"({free:.0f} MiB free): free space there or choose another folder")
    newest = list_checkpoints(folder)
    need = f", a checkpoint needs about {_size(newest[0]) / 2**20:.0f} MiB" if newest else ""
    kept = f"; the last complete one, {newest[0].name}, is intact" if newest else ""
    aside = sorted(p for p in folder.glob("superseded-*") if p.is_dir())
    held = sum(_size(p) for p in aside) / 2**20
    where = (f" (the {len(aside)} superseded-* folder(s) there, earlier runs' checkpoints set "
             f"aside, hold {held:.0f} MiB)" if aside else "")
    return UsageError(f"no space left on the file system of {folder} to write {path.name} "
                      f"({free:.0f} MiB free{need}): free space there{where} or choose "
                      f"another folder, then resume{kept}")


def save_model(state_dict: dict, path) -> None:
    """--save-model: the model's weights as CPU tensors, written atomically. A state_dict of a
    model on the GPU holds CUDA tensors, and torch.load(path, weights_only=True) of those fails
    on a machine without a GPU; every strategy's file loads anywhere so."""
    atomic_save({name: value.detach().cpu() if isinstance(value, torch.Tensor) else value
                 for name, value in state_dict.items()}, path)


def check_writable(path) -> None:
    """Fail before training, not after it, when --save-model cannot be written."""
    if path is None:
        return
    if Path(path).is_dir():  # saving would replace the folder and all that is in it
        raise UsageError(f"--save-model {path} is a folder: give a file name, e.g. "
                         f"--save-model {Path(path) / 'model.pt'}")
    probe = Path(path).resolve().parent
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise UsageError(f"cannot write --save-model {path}: {probe} is a file, not a folder; "
                         f"choose another path")
    if not os.access(probe, os.W_OK):
        raise UsageError(f"cannot write --save-model {path}: {probe} is not writable; choose "
                         f"another path")
    if shutil.disk_usage(probe).free < 50 * 2**20:
        raise UsageError(f"less than 50 MiB free under {probe} for --save-model: free space "
                         f"or choose another path")


def check_checkpoint_dir(directory, model) -> None:
    """Preflight: the checkpoint dir is writable and has room for a few checkpoints."""
    if directory is None:
        return
    path = Path(directory)
    make_folder(path, "--checkpoint-dir")
    # weights and momentum (2x the parameters) with a margin; room for 3: the default 2 kept
    # (--keep-checkpoints) and the one being written
    per_ckpt = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
    need = per_ckpt * 3
    free = shutil.disk_usage(path).free
    if free < need:
        raise UsageError(f"--checkpoint-dir {path} has {free / 2**20:.0f} MiB free but "
                         f"checkpoints need about {need / 2**20:.0f} MiB: free space or choose "
                         f"another folder")


# --------------------------------------------------------------------------------------------
# Resume: the newest checkpoint that loads, the random state
# --------------------------------------------------------------------------------------------


def resume_candidates(resume: str, folder) -> list:
    """Checkpoints to try, newest first: [] for a fresh start. ``resume``: --resume (auto,
    never or a path); ``folder``: --checkpoint-dir."""
    if resume == "never":
        return []
    if resume != "auto":
        if list_checkpoints(resume):  # a folder of checkpoints, not one checkpoint
            raise UsageError(f"--resume {resume} is a folder of checkpoints: pass it as "
                             f"--checkpoint-dir {resume} (the newest is resumed), or "
                             f"--resume with one checkpoint in it")
        return [Path(resume)]
    return list_checkpoints(folder)


def load_newest(candidates: list, load_one, explicit: bool = False):
    """Return ``load_one(path)`` for the newest candidate that loads on every rank, warning
    about each one that does not. Checkpoints exist but none loads: a UsageError, never a
    silent fresh start. ``explicit``: the one candidate is --resume PATH, and the sentence is
    about that flag.

    Collective (every rank): the ranks first compare what they found (same_candidates), then
    vote on each load, so that they all resume from the same checkpoint or none. A rank left
    to itself could fall back to an older checkpoint alone (a read error, a shared folder that
    lags on one node): its DDP replica would then diverge silently (DDP copies rank 0's weights
    only when it is built), or its collectives no longer match and the job hangs."""
    candidates = same_candidates(candidates)
    others = False  # a real checkpoint that failed to load (another script or --model)
    for i, path in enumerate(candidates):
        result, failure, fatal = None, None, None
        try:
            result = load_one(path)
        except UsageError as exc:
            fatal = str(exc)
        except (KeyboardInterrupt, SystemExit):
            raise
        # BaseException: DCP's CheckpointException (a truncated shard) derives from it
        except BaseException as exc:  # truncated zip, bad pickle, missing DCP shard, ...
            failure = exc
        what = None
        if failure is not None:
            # Damaged: found by the load itself, which read the bytes once already
            what = str(failure) if isinstance(failure, Damaged) else not_a_checkpoint(path)
            if explicit:
                what = _resume_path_error(path, what, failure)
            else:
                others = others or what is None
                what = what or _first_line(failure)
        votes = every_rank((fatal, what))  # the vote: what each rank could not do
        fatal = next((f for f, _ in votes if f), None)
        if fatal:  # a rank's sentence stops them all
            raise UsageError(fatal)
        failed = [(rank, why) for rank, (_, why) in enumerate(votes) if why]
        if not failed:
            return result
        if explicit:
            raise UsageError(failed[0][1])
        ranks = ", ".join(str(rank) for rank, _ in failed)
        # a checkpoint the run may not read is whole: it resumes from it once it may
        denied = any("Permission denied" in why for _, why in failed)
        print0(f"warning: checkpoint {path} is unusable (rank {ranks}: {failed[0][1]})"
               + ("; trying the previous one" if i + 1 < len(candidates) else "")
               + (f" (to resume from it instead, stop the run, make it readable: chmod -R "
                  f"u+rX {shlex.quote(str(path))}, and start it again)" if denied else ""))
    if candidates:
        which = (f"checkpoint {candidates[0]} could not" if len(candidates) == 1 else
                 f"none of the {len(candidates)} checkpoints in {candidates[0].parent} could")
        hint = f": {OTHER_RUN}" if others else ""
        raise UsageError(f"{which} be loaded (why is above){hint}; to start fresh, give "
                         f"another --checkpoint-dir, or pass --resume never (it sets them "
                         f"aside)")
    return None


def same_candidates(candidates: list) -> list:
    """``candidates`` when every rank found the same checkpoints (the same paths, newest first);
    otherwise one sentence on every rank, before anything is loaded: the ranks would resume
    from different points. Collective."""
    everyone = every_rank([str(path) for path in candidates])
    if all(found == everyone[0] for found in everyone):
        return candidates
    differ = next(rank for rank, found in enumerate(everyone) if found != everyone[0])

    def names(found):
        return ", ".join(Path(name).name for name in found[:3]) or "none"

    def shown(found):  # the names, and where they are when the names alone are the same
        same = names(everyone[0]) == names(everyone[differ])
        return names(found) + (f" in {Path(found[0]).parent}" if same and found else "")
    raise UsageError(f"the ranks found different checkpoints (rank 0: {shown(everyone[0])}; "
                     f"rank {differ}: {shown(everyone[differ])}) and would resume from "
                     f"different points: give every node the same, shared --checkpoint-dir (a "
                     f"node-local folder cannot resume a multi-node run; on a shared file "
                     f"system that is still catching up, start again in a minute)")


def _first_line(exc: BaseException) -> str:
    """The exception's class and first line; a first line that ends in ":" with the line after
    it (load_state_dict's "Error(s) in loading state_dict for ResNet:" says why only there,
    e.g. a size mismatch of the classifier: another dataset's classes)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [""]
    first = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]
    return f"{exc.__class__.__name__}: {first[:240]}"


#: The first bytes of every file torch.save writes (a zip archive's first entry).
_TORCH_SAVE_MAGIC = b"PK\x03\x04"


def saved_by_torch(path) -> bool:
    """Whether the file starts as torch.save's zip archive does (OSError when unreadable)."""
    with open(path, "rb") as f:
        return f.read(len(_TORCH_SAVE_MAGIC)) == _TORCH_SAVE_MAGIC


def not_a_checkpoint(path) -> str | None:
    """What a file that failed to load as a checkpoint is instead, in a few words, or None
    when it looks like a checkpoint (of another script or --model: its own error says why).
    Called only after a load failed, so a run that resumes never reads its file twice."""
    path = Path(path)
    if path.is_dir():
        if (path / "meta.pt").exists() or (path / ".metadata").exists():
            wrong = incomplete_shards(path)
            if wrong:
                return f"truncated or damaged: {wrong}"
            try:  # the run's records (epoch, step, flags): torch.load's own error spoke of
                # weights_only, as if the file were fine and the loading too strict
                torch.load(path / "meta.pt", map_location="cpu", weights_only=True)
            except Exception:  # noqa: BLE001 (any of several, for a damaged pickle)
                return "damaged: its meta.pt, the run's records, does not load"
            return None
        return "not a checkpoint: a folder without the meta.pt of fsdp_train.py's checkpoints"
    try:
        written = saved_by_torch(path)
    except OSError as exc:
        return f"unreadable: {exc.strerror}"
    if not written:
        return "not a checkpoint: not a file that torch.save wrote"
    if not zipfile.is_zipfile(path):
        return "truncated or damaged: its end is missing"
    if (bad := damaged_member(path)) is not None:
        return _changed_words([bad])
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 (the load's own error is the one to report)
        return None
    if isinstance(saved, dict) and "model" not in saved and saved and all(
            isinstance(v, torch.Tensor) for v in saved.values()):
        return ("a model file from --save-model, not a checkpoint: it holds the weights only, "
                "without the optimizer, epoch and random state a run resumes from")
    if not (isinstance(saved, dict) and "model" in saved):
        return "not a checkpoint: a file torch.save wrote, but not one of this toolkit's"
    return None


def shard_files(path: Path) -> list:
    """The names of the shard files that the .metadata of fsdp_train.py's checkpoint folder
    records, sorted."""
    from torch.distributed.checkpoint import FileSystemReader

    index = FileSystemReader(path).read_metadata()
    return sorted({where.relative_path for where in index.storage_data.values()})


def incomplete_shards(path: Path, prefix: str = "") -> str | None:
    """What fsdp_train.py's checkpoint folder lacks, in a few words, or None: its .metadata
    (the index of the shards), and each shard file as long as .metadata records (only the
    files that hold entries whose names start with ``prefix``: "model." for the weights)."""
    from torch.distributed.checkpoint import FileSystemReader

    if not (path / ".metadata").is_file():
        return ("no .metadata file, the index of fsdp_train.py's shards (copying with cp "
                "DIR/* or scp DIR/* leaves it out, as * skips names that start with a dot)")
    try:
        index = FileSystemReader(path).read_metadata()
    except Exception as exc:  # noqa: BLE001 (a cut-short pickle raises any of several)
        return f"a .metadata, the index of its shards, that does not load ({type(exc).__name__})"
    length, needed = {}, {}  # each shard file's length, and where the entries read end in it
    for key, where in index.storage_data.items():
        name, end = where.relative_path, where.offset + where.length
        length[name] = max(length.get(name, 0), end)
        if key.fqn.startswith(prefix):
            needed[name] = max(needed.get(name, 0), end)
    short = [f"{name}: missing" if not (path / name).is_file() else
             f"{name}: {(path / name).stat().st_size:,} of its {length[name]:,} bytes"
             for name, end in sorted(needed.items())
             if not (path / name).is_file() or (path / name).stat().st_size < end]
    if short:
        return (f"incomplete shard files ({'; '.join(short)}, as its .metadata records "
                f"them)")
    return None


class Damaged(ValueError):
    """A checkpoint whose bytes are not those its run wrote, found before they were loaded;
    str() says what it is, in a few words, as not_a_checkpoint does (load_newest prints it)."""


def _changed_words(names: list) -> str:
    listed = " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
    return (f"damaged: the bytes of its {listed} fail their checksum (changed on the disk or in "
            f"a copy)")


def crc32_of(path: Path) -> int:
    """The CRC-32 of a file, read in 16 MiB pieces: the checksum a zip archive keeps of each
    of its entries (torch.save's file, which damaged_member checks), here kept of each file of
    fsdp_train.py's checkpoint, whose DCP shards keep none (changed bytes loaded as weights)."""
    crc = 0
    with open(path, "rb") as f:
        while piece := f.read(16 << 20):
            crc = zlib.crc32(piece, crc)
    return crc


def gather_checksums(folder: Path, names: list) -> dict:
    """{name: CRC-32} of the files ``names`` in ``folder``, the checkpoint that fsdp_train.py
    is writing. Collective: each rank reads every world-th file (rank 0 the first, the
    .metadata it wrote itself), so no rank reads the whole checkpoint, and every rank gets
    every sum. A file some rank cannot read back raises, on every rank, the UsageError that
    names it: the ranks do not share the --checkpoint-dir, and no checkpoint could load."""
    rank, world = rank_and_world()
    mine, unread = {}, None
    for name in names[rank::world]:
        try:
            mine[name] = crc32_of(folder / name)
        except OSError as exc:  # never raised here: the other ranks wait in the gather
            unread = unread or (f"rank {rank} cannot read back {name} "
                                f"({exc.strerror or type(exc).__name__})")
    votes = every_rank((mine, unread))
    unread = next((u for _, u in votes if u), None)
    if unread:
        raise UsageError(f"{unread} of the checkpoint being written in {folder.parent}: "
                         f"every node must see the same --checkpoint-dir, a folder on a file "
                         f"system they share")
    return {name: crc for part, _ in votes for name, crc in part.items()}


def changed_files(folder: Path, recorded: dict, names) -> list:
    """[(name, why)] for each of ``names`` (shard files, .metadata) in ``folder`` whose bytes
    differ from the CRC-32 ``recorded`` at save: ``why`` is None for changed bytes, the OS's
    reason for a file that cannot be read (never raised: a collective caller must not lose a
    rank to it)."""
    changed = []
    for name in names:
        try:
            if crc32_of(folder / name) != recorded[name]:
                changed.append((name, None))
        except OSError as exc:
            changed.append((name, exc.strerror or type(exc).__name__))
    return changed


def shards_damage(folder: Path, changed: list) -> str:
    """In a few words, what the ``changed`` files of changed_files make of the checkpoint: a
    changed .metadata first (the index that incomplete_shards would read), then the files it
    lacks or that are cut short (their lengths say more than a checksum), the files that
    cannot be read, and those with changed bytes."""
    if (".metadata", None) in changed:
        return _changed_words([".metadata (the index of its shards)"])
    wrong = incomplete_shards(folder)
    if wrong:
        return f"truncated or damaged: {wrong}"
    unread = [f"{name} ({why})" for name, why in changed if why]
    if unread:
        return f"unreadable: its {', '.join(unread)}"
    return _changed_words([name for name, _ in changed])


#: checked_meta's word for a checkpoint that is a file, where fsdp_train.py's are folders
A_FILE = "a file, and fsdp_train.py's checkpoints are folders"


def checked_meta(folder: Path) -> dict:
    """The meta.pt of fsdp_train.py's checkpoint ``folder`` (the run's records), once every
    file of the checkpoint has matched the CRC-32 that meta.pt records of it (a checkpoint
    saved before they were kept: unchecked). Collective: each rank reads meta.pt and every
    world-th file, whatever world size wrote them, and all ranks raise Damaged together, or
    none does: they must all load the checkpoint (DCP's load is a collective) or none."""
    rank, world = rank_and_world()
    meta, problem, mine = None, None, []
    try:
        # weights_only: the records hold only tensors and plain values, so loading them
        # cannot run code
        meta = torch.load(folder / "meta.pt", map_location="cpu", weights_only=True)
        recorded = meta.get("checksums") or {}
        # which rank could not read a file: an I/O error may be one node's alone
        mine = [(name, why and f"{why}, on rank {rank}") for name, why in
                changed_files(folder, recorded, sorted(recorded)[rank::world])]
    except NotADirectoryError:  # a file: ddp_train.py's or dp_train.py's checkpoint, not
        problem = A_FILE        # damaged, and not to be made readable
    except OSError as exc:  # never raised before the vote: a rank alone would miss it
        why = exc.strerror or type(exc).__name__
        problem = f"unreadable: its meta.pt ({why}, on rank {rank})"
    except Exception:  # noqa: BLE001 (a damaged pickle raises any of several)
        problem = "damaged: its meta.pt, the run's records, does not load"
    votes = every_rank((problem, mine))
    problem = next((p for p, _ in votes if p), None)
    changed = sorted(item for _, part in votes for item in part)
    if problem == A_FILE:  # load_newest names the script that writes files
        raise NotADirectoryError(A_FILE)
    if problem or changed:
        raise Damaged(problem or shards_damage(folder, changed))
    return meta


def _resume_path_error(path, what: str | None, exc: BaseException) -> str:
    """The sentence for --resume PATH that does not load: what the file is, and what to give."""
    fix = ("give --resume a checkpoint that a run with --checkpoint-dir wrote there "
           "(ckpt-eNNNN-sNNNNNNN), or leave --resume out to start fresh")
    if what is not None and what.startswith("a model file from --save-model"):
        return (f"--resume {path} is {what}; use it with model.load_state_dict(torch.load(PATH, "
                f"weights_only=True)) to evaluate or fine-tune it, and to resume a run {fix}")
    if what is not None and what.startswith("unreadable"):
        return (f"--resume {path} is {what}; make it readable (chmod -R u+rX "
                f"{shlex.quote(str(path))}) or resume as the user who owns it, or leave "
                f"--resume out to start fresh")
    if what is not None and what.startswith(("damaged", "truncated or damaged")):
        # a checkpoint whose bytes changed: another copy of it, or an earlier one, will do
        return (f"--resume {path} is {what}; copy it again, whole, from where the run wrote "
                f"it, or give --resume the checkpoint before it, or leave --resume out to start "
                f"fresh")
    if what is not None:
        return f"--resume {path} is {what}; {fix}"
    return f"--resume {path} could not be loaded ({_first_line(exc)}): {OTHER_RUN}; {fix}"


def damaged_member(path) -> str | None:
    """The first entry of a torch.save file (a zip archive) whose bytes fail the CRC-32 that
    the zip keeps of them, or None. torch.load does not check it: bytes changed on the disk or
    in a copy loaded as weights (NaN among them), without a word."""
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.testzip()
    except (zipfile.BadZipFile, OSError):  # torch.load says what is wrong with those
        return None


def load_one_file(path, state: dict) -> dict:
    """Load a one-file checkpoint (ddp_train.py's and dp_train.py's: rank 0 wrote every
    object's state_dict into one file) into ``state``; returns what the file holds. A file
    whose bytes fail their checksum raises Damaged, which says so."""
    if not saved_by_torch(path):  # torch.load reads it as an old-style pickle, and warns of
        raise ValueError("not a file that torch.save wrote")  # its "protocol" on stderr
    if (bad := damaged_member(path)) is not None:
        raise Damaged(_changed_words([bad]))
    # weights_only: a checkpoint holds only tensors and plain values, so loading it cannot
    # run code.
    saved = torch.load(path, map_location="cpu", weights_only=True)
    for name, obj in state.items():
        # A run without fp16 saved its disabled GradScaler as an empty dict: keep the new one.
        if saved[name]:
            obj.load_state_dict(saved[name])
    return saved


def rng_state() -> dict:
    """This process's random state (torch CPU and current CUDA device, Python)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# --------------------------------------------------------------------------------------------
# Checkpoints: resume, save, prune
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """What Checkpoints uses of the flags: ``folder`` (--checkpoint-dir; None: no
    checkpoints), ``resume`` (--resume: auto, never or a path), ``every`` (--checkpoint-every
    steps; 0: at the epochs' ends only), ``keep`` (--keep-checkpoints), and ``flags``, all of
    them as plain values, written into every checkpoint (a resumed run compares their --amp
    with its own)."""
    folder: str | None
    resume: str
    every: int
    keep: int
    flags: dict

    @classmethod
    def of(cls, args) -> "Settings":
        """The section of the resolved flags that checkpoints use."""
        return cls(args.checkpoint_dir, args.resume, args.checkpoint_every or 0,
                   args.keep_checkpoints, dict(vars(args)))


class Checkpoints:
    """The run's checkpoints in ``settings.folder`` (--checkpoint-dir): resume() from the
    newest usable one, save_if_due() after a step, end_epoch() at each epoch's end, pruned to
    ``settings.keep``. Without a folder it is disabled (``enabled`` False) and resume() starts
    afresh.

    ``save(path, state, meta)`` and ``load(path, state) -> meta`` are the strategy's own:
    ``state`` holds the model, optimizer, scheduler and scaler (each has a state_dict),
    ``meta`` the plain values (epoch, step, metrics, the RNG state of every rank, flags)."""

    def __init__(self, settings: Settings, state: dict, save, load):
        self.dir = Path(settings.folder) if settings.folder else None
        self.resume_from, self.every, self.keep = settings.resume, settings.every, settings.keep
        self.flags = settings.flags
        self.state, self._save, self._load = state, save, load
        self.metrics = {}  # the last finished epoch's (from the checkpoint, after a resume)
        self.steps = 0  # this run's steps per epoch, set by resume()
        # a checkpoint inside an epoch: the figures of that epoch's steps before it
        # (measure.epoch_so_far), for the resumed epoch's line; None at an epoch's start
        self.earlier = None
        # and the learning rate that epoch started at by this run's schedule, for its line
        self.epoch_lr = None

    def resume(self, steps: int) -> tuple:
        """(epoch, step) to start from, on every rank: (0, 0) for a fresh start. ``steps``:
        this run's steps per epoch, which may differ from the saved run's (another world
        size, dp_train.py resuming a DDP checkpoint): the step and the learning rate are
        placed at the same point of training, the same epoch and fraction of it."""
        self.steps = steps
        optimizer, scheduler = self.state["optimizer"], self.state["scheduler"]
        claim_checkpoint_dir(self.dir, fresh=self.resume_from == "never")  # lock it, tidy it
        # This run's hyperparameters (its flags, its peak learning rate): loading the
        # optimizer's and the scheduler's state would bring back the saved run's.
        fresh = [{k: v for k, v in group.items() if k != "params"}
                 for group in optimizer.param_groups]
        peak = list(scheduler.base_lrs)
        meta = load_newest(resume_candidates(self.resume_from, self.dir),
                           lambda path: dict(self._load(path, self.state), path=path),
                           explicit=self.resume_from not in ("auto", "never"))
        if not meta:
            return 0, 0
        rank, _ = rank_and_world()
        if rank < len(meta["rng"]):  # a rank the saved run did not have keeps its own seed
            set_rng_state(meta["rng"][rank])
        self.metrics = meta["metrics"]
        self.earlier = meta.get("earlier") if meta["step"] else None
        saved_steps = meta.get("steps", steps)  # (checkpoints before it was saved: the same)
        # a mid-epoch checkpoint has steps left, and so must the resumed epoch
        step = min(round(meta["step"] * steps / saved_steps), steps - 1) if meta["step"] else 0
        for group, values in zip(optimizer.param_groups, fresh):
            group.update(values)
        place_schedule(optimizer, scheduler, peak, meta["epoch"] * steps + step)
        if step:  # what an uninterrupted run of this layout and --lr began the epoch at
            self.epoch_lr = peak[0] * scheduler.lr_lambdas[0](meta["epoch"] * steps)
        print0(f"Resumed from epoch {meta['epoch'] + 1}, step {meta['step']} ({meta['path']})"
               + (f"; at this run's {steps} steps per epoch (the checkpoint's: {saved_steps}), "
                  f"step {step}, learning rate {optimizer.param_groups[0]['lr']:.6f}"
                  if saved_steps != steps else ""))
        amp = self.flags.get("amp")
        saved_amp = meta["args"].get("amp", amp)
        if saved_amp != amp:  # e.g. requeued from an A100 (default bf16) onto a V100 (fp16)
            print0(f"warning: the checkpoint was trained with --amp {saved_amp}; this run goes on "
                   f"with --amp {amp} (another GPU type?)" + (
                       ", its loss scale starting afresh" if amp == "fp16" else ""))
        return meta["epoch"], step

    @property
    def enabled(self) -> bool:
        """A --checkpoint-dir was given."""
        return self.dir is not None

    def save_if_due(self, epoch: int, done: int, stopping: bool = False,
                    so_far=lambda: None) -> bool:
        """After step ``done`` (1-based) of ``epoch``: save a checkpoint if one is due, every
        ``every`` steps (the epoch's end has its own, end_epoch), and at once when the run is
        ``stopping`` for a requeue; never without a folder. ``so_far()`` is called only then,
        before the save: the epoch's figures so far (measure.epoch_so_far), which the loop
        gives after its own checks. Returns whether it saved. Collective when it saves."""
        due = stopping or (bool(self.every) and done % self.every == 0 and done < self.steps)
        if not (self.enabled and due):
            return False
        self.save(epoch, done, so_far())
        return True

    def end_epoch(self, epoch: int, metrics: dict) -> None:
        """Every rank, after ``epoch``'s losses were checked and its metrics reduced: the
        epoch-end checkpoint (which resumes at the next epoch's start)."""
        self.metrics = metrics
        if self.enabled:
            self.save(epoch + 1, 0)

    def save(self, epoch: int, step: int, earlier: dict | None = None) -> None:
        """Collective: every rank takes part (their RNG states are gathered into the file).
        The caller has just checked the losses (lossguard.LossWatch.check): no NaN reaches a
        file.
        ``earlier``: inside an epoch, its figures so far (measure.epoch_so_far)."""
        hangs.set_phase("checkpoint")
        path = self.dir / checkpoint_name(epoch, step)
        if rank_and_world()[0] == 0:  # before the gather below, which the other ranks wait in
            self._set_aside_from(path)
        rngs = every_rank(rng_state())
        meta = dict(epoch=epoch, step=step, steps=self.steps, metrics=self.metrics, rng=rngs,
                    args=self.flags, world_size=len(rngs), earlier=earlier)
        error = None
        try:
            with holding_ctrl_c():  # a Ctrl-C now stops the run once the checkpoint is whole
                self._save(path, self.state, meta)
        except UsageError as exc:  # a full disk, which only the ranks that write see
            error = str(exc)
        # every rank waits here until the checkpoint is complete, and learns whether it is
        raise_if_any_rank(error)
        if rank_and_world()[0] == 0:
            with holding_ctrl_c():  # a folder half deleted would read as a damaged checkpoint
                prune_checkpoints(self.dir, self.keep)

    def _set_aside_from(self, path: Path) -> None:
        """Rank 0, before ``path`` is written: the checkpoints already there that sort at or
        after it go aside. They are not this run's way forward: another run's (--resume PATH
        into a folder in use), or states this run went back from (it resumed at fewer steps
        per epoch, or past a damaged checkpoint). Left there, the one of the same name would
        be overwritten, and pruning would keep them and delete this run's newest."""
        later = [p for p in list_checkpoints(self.dir)
                 if training_order(p) >= training_order(path)]
        set_aside_checkpoints(self.dir, later, f"this run writes {path.name} next")

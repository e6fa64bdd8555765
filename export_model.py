"""Turn a checkpoint of any of the three training scripts into one file of the model's weights
that loads anywhere, without this toolkit, a process group or the GPU it was trained on:

    python export_model.py runs/ck/ckpt-e0003-s0000000 model.pt    # one checkpoint
    python export_model.py runs/ck model.pt                       # the newest in a --checkpoint-dir
    python export_model.py full.pt model.pt --model resnet50       # a --save-model file

The checkpoint: a file from ddp_train.py or dp_train.py, a sharded DCP folder from
fsdp_train.py (read in this one process, at any world size it was written by), or a
--save-model file. The output: a ``torch.save`` of the model's state_dict alone, CPU tensors
in the default memory format, with plain names (no ``module.`` of DDP or DataParallel, no
``_orig_mod.`` of torch.compile, no FSDP wrappers), the optimizer and the run's state left
out. It is checked by loading it into the bare model, and the lines printed say how to do the
same elsewhere:

    model = torchvision.models.get_model("resnet50", num_classes=200)
    model.load_state_dict(torch.load("model.pt", weights_only=True))

Exit status: 0 written; 2 a path that is not a checkpoint, a checkpoint that does not load, or
an output that cannot be written (one sentence naming the fix).
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import shlex
import sys
from pathlib import Path

from training import ctrl_c  # first: a Ctrl-C while torch loads ends the script quietly

ctrl_c.quiet_while_loading(__name__)

import torch

from training import checkpoint, models
from training.faults import UsageError

#: Path components that wrappers add to parameter names: torch.compile's module, FSDP1's and
#: activation checkpointing's wrappers. None is ever a name a model gives its own layers.
WRAPPER_PARTS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Write the model's weights from a checkpoint of "
                                            "ddp_train.py, dp_train.py or fsdp_train.py as one "
                                            "plain torch.save file that loads anywhere.")
    p.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="a checkpoint (ddp_train.py's or dp_train.py's file, fsdp_train.py's "
                        "folder), a --checkpoint-dir (its newest checkpoint), or a --save-model "
                        "file")
    p.add_argument("out", metavar="OUT.pt", help="the file to write (replaced if it exists)")
    p.add_argument("--model", default=None,
                   help="the --model the run trained; needed only for a --save-model file, "
                        "which does not record it (a checkpoint does), or a file that holds a "
                        "checkpoint's \"model\" entry alone")
    return p


def check_readable(path: Path) -> None:
    """A checkpoint this user may not read is said so, not taken for a damaged one: ``path``,
    its listing where it is a folder, and the files of a checkpoint folder (those of a
    --checkpoint-dir are other checkpoints: only the one exported is opened)."""
    try:
        listed = sorted(path.iterdir()) if path.is_dir() else []
        files = [path] + (listed if (path / ".metadata").exists() else [])
        for item in files:
            if item.is_file():
                with open(item, "rb"):
                    pass
    except PermissionError as e:
        raise UsageError(f"cannot read {e.filename}: permission denied; make it readable "
                         f"(chmod -R u+rX {shlex.quote(str(path))}) or export it as the user "
                         f"who owns it") from None


def find_checkpoint(path: Path) -> Path:
    """The checkpoint ``path`` names: itself, or the newest in a --checkpoint-dir."""
    if not path.exists():
        if path.is_symlink():  # a link to nothing, or to itself through others
            try:
                os.stat(path)
            except OSError as e:
                end = ("that leads back to itself" if e.errno == errno.ELOOP
                       else f"to {os.readlink(path)}, which does not exist")
                raise UsageError(f"{path} is a symbolic link {end}: give the checkpoint's own "
                                 f"path") from None
        raise UsageError(f"{path} does not exist: give a checkpoint (ckpt-eNNNN-sNNNNNNN) or "
                         f"the --checkpoint-dir that holds them")
    check_readable(path)
    if path.is_dir() and not (path / ".metadata").exists():
        found = checkpoint.list_checkpoints(path)
        if found:
            print(f"newest of the {len(found)} checkpoint(s) in {path}: {found[0].name}")
            check_readable(found[0])
            return found[0]
        set_aside = [(aside, held) for aside in sorted(path.glob("superseded-*"), reverse=True)
                     if (held := checkpoint.list_checkpoints(aside))]
        if set_aside:  # "not a checkpoint" would hide them
            aside, older = set_aside[0]
            raise UsageError(f"{path} holds no checkpoint of its own, but {len(set_aside)} "
                             f"superseded-* folder(s) hold those that --resume never set aside "
                             f"(the newest folder: {aside.name}, with {len(older)}): give one of "
                             f"them, e.g. {older[0]}")
        if not (path / "meta.pt").exists():  # before OUT is checked against it (OUT inside
            raise UsageError(no_checkpoint_in(path))  # a run directory is no overwrite)
    if not (path.is_dir() or path.is_file()):  # a pipe (/dev/stdin) would wait, or not seek
        raise UsageError(f"{path} is not a file or folder (a pipe or a device?): give the "
                         f"checkpoint's own path, not a stream of it")
    return path


def no_checkpoint_in(folder: Path) -> str:
    """The sentence for a folder that is no checkpoint and holds none; for a launcher's run
    directory, whose checkpoints are in its checkpoints/ folder, that folder is named."""
    held = folder / "checkpoints"
    if checkpoint.list_checkpoints(held):
        return (f"{folder} holds no checkpoint itself, but {held} does (a run directory keeps "
                f"its checkpoints there): give that folder, python export_model.py "
                f"{shlex.quote(str(held))} OUT")
    return (f"{folder} is a folder with no checkpoint in it (no ckpt-eNNNN-sNNNNNNN, and not a "
            f"checkpoint of fsdp_train.py, which holds a meta.pt): give a checkpoint, the "
            f"--checkpoint-dir that holds them, or a --save-model file")


def not_loadable(path: Path, exc: BaseException | None = None) -> UsageError:
    """The sentence for a path that holds no weights this script can read."""
    what = checkpoint.not_a_checkpoint(path)
    if what is None:
        first = str(exc).strip().splitlines()[0][:160] if exc and str(exc).strip() else ""
        what = f"a checkpoint that does not load ({type(exc).__name__}: {first})"
    return UsageError(f"{path} is {what}: give a checkpoint of ddp_train.py, dp_train.py or "
                      f"fsdp_train.py (a ckpt-eNNNN-sNNNNNNN file or folder, or the "
                      f"--checkpoint-dir that holds them) or a --save-model file")


COPY_AGAIN = ("copy the checkpoint folder again, whole (cp -r, scp -r), from where the run wrote "
              "it, or export an earlier checkpoint")


def check_shards(path: Path) -> None:
    """Before DCP reads fsdp_train.py's folder: its index and the shard files that hold the
    model's entries are whole (DCP's own errors for these name no file, and before them it
    logs tracebacks)."""
    wrong = checkpoint.incomplete_shards(path, "model.")
    if wrong:
        raise UsageError(f"{path} has {wrong}: {COPY_AGAIN}")


def read_dcp_model(path: Path, recorded: dict | None) -> dict:
    """The "model" entry of fsdp_train.py's sharded DCP folder as full, plain tensors, read in
    this one process without a process group. This is what torch's own
    format_utils.dcp_to_torch_save does, with the optimizer's state left unread. ``recorded``:
    the CRC-32 of each file, from its meta.pt (None: a checkpoint saved before they were)."""
    from torch.distributed.checkpoint import CheckpointException, FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    check_shards(path)
    changed = checkpoint.changed_files(path, recorded or {}, sorted(recorded or {}))
    if changed:  # bytes changed on the disk or in a copy would be exported as weights
        raise UsageError(f"{path} is {checkpoint.shards_damage(path, changed)}: {COPY_AGAIN}")
    state = {}
    try:
        _load_state_dict(state, storage_reader=FileSystemReader(path),
                         planner=_EmptyStateDictLoadPlanner(keys={"model"}), no_dist=True)
    except CheckpointException as exc:
        # Shards of the right length that do not load are damaged inside. DCP's message names
        # only the ranks; each rank's own error (this process is rank 0) is in .failures.
        cause = next(iter(exc.failures.values()))[0] if exc.failures else exc
        shards = ", ".join(sorted(p.name for p in path.glob("*.distcp")))
        raise UsageError(f"one of the shard files of {path} ({shards}) is damaged inside "
                         f"({type(cause).__name__}): copy them again from the folder the run "
                         f"wrote, or export an earlier checkpoint") from None
    return state["model"]


def read_weights(path: Path) -> tuple:
    """(the model's state_dict, the run's meta or None for a --save-model file, what it is)."""
    try:
        if path.is_dir():
            meta = torch.load(path / "meta.pt", map_location="cpu", weights_only=True)
            return (read_dcp_model(path, meta.get("checksums")), meta,
                    "a sharded checkpoint of fsdp_train.py")
        # mmap: of a checkpoint's optimizer state nothing is read, only the model's tensors
        saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        if checkpoint.damaged_member(path) is not None:  # loaded, but with changed bytes
            raise not_loadable(path)
    except (KeyboardInterrupt, SystemExit, UsageError):  # UsageError: a shard's own sentence
        raise
    # BaseException: DCP's CheckpointException derives from it
    except BaseException as exc:
        raise not_loadable(path, exc) from None
    if isinstance(saved, dict) and "model" in saved:
        if not (isinstance(saved["model"], dict) and any(isinstance(v, torch.Tensor)
                                                         for v in saved["model"].values())):
            raise UsageError(f"{path} has a \"model\" entry without a model's tensors: give a "
                             f"checkpoint of ddp_train.py, dp_train.py or fsdp_train.py, or a "
                             f"--save-model file")
        # a "model" entry alone (saved by hand, or by another toolkit) still holds the weights
        kind = ("a checkpoint of ddp_train.py or dp_train.py" if isinstance(saved.get("args"), dict)
                else "a \"model\" entry without a run's flags (not saved by ddp_train.py or "
                     "dp_train.py)")
        return saved["model"], saved, kind
    if isinstance(saved, dict) and saved and all(isinstance(v, torch.Tensor)
                                                 for v in saved.values()):
        return saved, None, "a --save-model file"
    raise not_loadable(path)


def recorded(saved) -> dict:
    """What the export reads of a checkpoint's own records: the run's --model, epoch, step and
    world size, each None where the file does not record it (a dict saved by hand with only
    the "model" entry, or by another toolkit). The weights are all the export needs; only the
    report, and the check that they load, use these."""
    saved = saved if isinstance(saved, dict) else {}
    args = saved.get("args") if isinstance(saved.get("args"), dict) else {}

    def of(value, kind):
        return value if isinstance(value, kind) and not isinstance(value, bool) else None
    return dict(model=of(args.get("model"), str), epoch=of(saved.get("epoch"), int),
                step=of(saved.get("step"), int), world_size=of(saved.get("world_size"), int))


def plain_name(name: str) -> str:
    """A parameter's name without the wrappers' parts: DDP's and DataParallel's leading
    ``module.``, torch.compile's ``_orig_mod.``, FSDP1's and activation checkpointing's."""
    parts = [part for part in name.split(".") if part not in WRAPPER_PARTS]
    while len(parts) > 1 and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def plain_weights(state_dict: dict) -> dict:
    """Plain names, CPU tensors in the default memory format (a CUDA run's channels_last
    convolutions are contiguous again), nothing but the model's own entries."""
    plain, source = {}, {}
    for name, value in state_dict.items():
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().contiguous()
        short = plain_name(name)
        if short in plain:  # one of the two would be exported in silence
            raise UsageError(f"the weights hold both {source[short]} and {name}, which are "
                             f"the same parameter, {short}, once the wrappers' parts are "
                             f"removed: they come from two models saved into one file; save "
                             f"one model's state_dict alone and export that")
        plain[short], source[short] = value, name
    return plain


def num_classes(weights: dict) -> int:
    """The number of classes: the rows of the last weight matrix or convolution, which is the
    classifier's in every model models.py builds (CifarCNN, MnistNet, torchvision's)."""
    last = [v for k, v in weights.items()
            if k.endswith("weight") and isinstance(v, torch.Tensor) and v.dim() >= 2]
    if not last:
        raise UsageError("the file holds no weight matrix, so no classifier: give a checkpoint "
                         "or --save-model file of a classification model")
    return last[-1].shape[0]


def bare_model(name: str, classes: int) -> tuple:
    """(the model as models.py builds it, without its checks and initialisation, and the
    Python that builds it elsewhere)."""
    if name == "cnn":
        return models.CifarCNN(classes), (f"from training.models import CifarCNN  # this "
                                          f"repository's\nmodel = CifarCNN({classes})")
    if name == "mnist_net":
        return models.MnistNet(classes), (f"from training.models import MnistNet  # this "
                                          f"repository's\nmodel = MnistNet({classes})")
    import torchvision
    if name not in torchvision.models.list_models(module=torchvision.models):
        raise UsageError(f"unknown --model {name!r}: give the --model the run trained (cnn, "
                         f"mnist_net or a torchvision classifier such as resnet50)")
    options = models.loading_options(name)  # GoogLeNet's: without its auxiliary heads
    return (torchvision.models.get_model(name, weights=None, num_classes=classes, **options),
            f"import torchvision\nmodel = torchvision.models.get_model({name!r}, "
            f"num_classes={classes}{''.join(f', {k}={v!r}' for k, v in options.items())})")


def describe_progress(meta: dict) -> str:
    """Where in training the checkpoint was taken, as the epoch line counts (from 1), and by how
    many ranks; what the checkpoint does not record is said so."""
    epoch, step, ranks = meta["epoch"], meta["step"], meta["world_size"]
    said = []
    if epoch is not None and step == 0:
        said.append(f"after epoch {epoch}")
    elif epoch is not None and step is not None:
        said.append(f"epoch {epoch + 1}, step {step}")
    elif epoch is not None:  # without the step, the epoch index alone: where it began
        said.append(f"in or after epoch {epoch}")
    if ranks is not None:
        said.append(f"{ranks} rank(s)")
    missing = [what for what, value in (("epoch", epoch), ("step", step), ("world size", ranks))
               if value is None]
    if missing:
        listed = ", ".join(missing[:-1]) + " or " + missing[-1] if missing[:-1] else missing[0]
        said.append(f"no {listed} recorded")
    return ", ".join(said)


def export(source: Path, out: Path, model_name: str | None) -> dict:
    """Write ``source``'s weights to ``out``; return what the file holds, for the report."""
    if model_name is not None and not model_name.strip():
        raise UsageError("--model is empty: give the --model the run trained, or leave --model "
                         "out for a checkpoint, which records it")
    path = find_checkpoint(source)
    # The file is written beside OUT and renamed over it: a link would be replaced by a file,
    # so the file it points to is written; and a device or a pipe (/dev/null, as root) would
    # be replaced, so it is refused.
    out = Path(os.path.realpath(out)) if out.is_symlink() else out
    if out.is_dir():
        raise UsageError(f"{out} is a folder: give a file name, e.g. {out / 'model.pt'}")
    if out.exists() and not out.is_file():
        raise UsageError(f"{out} is not a regular file (a device, a pipe or a socket): give "
                         f"the name of a file to write, e.g. model.pt")
    if any(folder.exists() and not folder.is_dir() for folder in out.parents):
        raise UsageError(f"cannot write {out}: a folder of its path is a file; give a path "
                         f"in a folder")
    if out.resolve() == path.resolve() or path.resolve() in out.resolve().parents:
        raise UsageError(f"{out} is the checkpoint itself (or inside it): give another file, "
                         f"the checkpoint is kept")
    if re.match(checkpoint.CHECKPOINT_RE, out.name):
        raise UsageError(f"{out.name} is named like a checkpoint, and --resume auto would take "
                         f"it for one in a --checkpoint-dir: give it another name, e.g. model.pt")
    try:
        weights, saved, kind = read_weights(path)
    except UsageError as err:  # the newest of a --checkpoint-dir: the one before it may do
        older = checkpoint.list_checkpoints(source)[1:2] if path != source else []
        if not older:
            raise
        again = ["python", "export_model.py", str(older[0]), str(out)]
        raise UsageError(f"{err}; or export the checkpoint before it: {shlex.join(again)}"
                         + (f" --model {shlex.quote(model_name)}" if model_name else "")) from None
    weights = plain_weights(weights)
    meta = recorded(saved) if saved is not None else None
    saved_name = meta["model"] if meta else None
    if model_name and saved_name and model_name != saved_name:
        raise UsageError(f"--model {model_name}, but {path.name} was trained with --model "
                         f"{saved_name}: leave --model out")
    name = model_name or saved_name
    info = dict(path=path, kind=kind, meta=meta, name=name, tensors=len(weights),
                params=sum(v.numel() for v in weights.values()
                           if isinstance(v, torch.Tensor) and v.is_floating_point()),
                code=None)
    if name:
        # The printed way to load it must work: load it so here first.
        model, info["code"] = bare_model(name, num_classes(weights))
        try:
            model.load_state_dict(weights)
        except RuntimeError as exc:
            # torch's first line only names the model: the next one says what does not fit
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            why = lines[1] if len(lines) > 1 else lines[0] if lines else ""
            why = why if len(why) <= 160 else why[:160].rsplit(", ", 1)[0] + ", ..."
            raise UsageError(f"the weights in {path} do not fit --model {name} ({why}): give "
                             f"the --model the run trained") from None
        info["class"] = f"{type(model).__module__}.{type(model).__name__}"
    try:
        checkpoint.atomic_save(weights, out)
    except OSError as exc:
        raise UsageError(f"cannot write {out} ({exc.strerror or exc}): choose a writable "
                         f"folder") from None
    info["bytes"] = out.stat().st_size
    return info


def report(info: dict, out: Path) -> None:
    meta = info["meta"]
    print(f"read {info['path']}: {info['kind']}" + (f", {describe_progress(meta)}" if meta else ""))
    unnamed = (f"{info['path'].name} records no --model" if meta else
               "a --save-model file records no --model")
    model = (f"--model {info['name']} ({info['class']}), " if info["name"] else
             f"model not named ({unnamed}; pass --model NAME to check it loads), ")
    print(f"wrote {out}: {model}{info['tensors']} tensors, {info['params']:,} values, "
          f"{info['bytes'] / 2**20:.1f} MiB")
    if info["code"]:
        print("load it with:\n    import torch\n    "
              + info["code"].replace("\n", "\n    ")
              + f"\n    model.load_state_dict(torch.load({str(out)!r}, weights_only=True))")


def main(argv=None) -> int:
    ctrl_c.raises()  # KeyboardInterrupt, caught below
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    try:
        if args.out.endswith(os.sep):  # Path drops the slash: "new/" was written as a file "new"
            raise UsageError(f"{args.out} names a folder: give a file name, e.g. "
                             f"{out / 'model.pt'}")
        info = export(Path(args.checkpoint), out, args.model)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the file is written beside OUT and renamed: never half of it
        print(f"error: interrupted (Ctrl-C); {out} was not written, the checkpoint is "
              f"untouched: run the command again", file=sys.stderr)
        return 130
    report(info, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

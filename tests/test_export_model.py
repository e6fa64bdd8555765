"""export_model.py: a checkpoint of each script (FSDP's sharded DCP folder of 2 ranks included)
becomes one plain file that loads into the bare model and gives the trained model's outputs."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
import torchvision

import export_model
from training import checkpoint
from training.models import CifarCNN
from conftest import REPO, env_for_tests

TINY = ["--synthetic-size", "32", "--batch-size", "4", "--epochs", "1", "--max-steps-per-epoch",
        "2", "--num-workers", "0", "--amp", "off", "--device", "cpu"]

# One run per script: its checkpoint dir and, as the reference, the weights the script itself
# writes with --save-model (FSDP's gathered from the live shards, not read from the checkpoint).
# resnet18 under DDP: a torchvision model with BatchNorm buffers (which DDP keeps equal on
# every rank); FSDP on 2 ranks writes one shard file per rank.
RUNS = {"ddp": ("ddp_train.py", "resnet18", None), "dp": ("dp_train.py", "cnn", None),
        "fsdp": ("fsdp_train.py", "cnn", 2)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The three runs at once (their start-up is most of their time), each run's folder."""
    root = tmp_path_factory.mktemp("export")
    procs = {}
    for name, (script, model, nproc) in RUNS.items():
        launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={nproc}"] if nproc else [sys.executable])
        cmd = [*launch, str(REPO / script), "--model", model, *TINY, "--checkpoint-dir",
               str(root / name / "ck"), "--save-model", str(root / name / "ref.pt")]
        procs[name] = subprocess.Popen(cmd, env=env_for_tests(), cwd=REPO, text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{out[-3000:]}"
    return root


def bare(model: str) -> torch.nn.Module:
    if model == "cnn":
        return CifarCNN(10)
    return torchvision.models.get_model(model, num_classes=200)


@pytest.mark.parametrize("name", list(RUNS))
def test_export_loads_into_the_bare_model_with_the_same_outputs(runs, tmp_path, capsys, name):
    _, model, nproc = RUNS[name]
    (ckpt,) = checkpoint.list_checkpoints(runs / name / "ck")
    if name == "fsdp":
        assert len(list(ckpt.glob("*.distcp"))) == nproc  # really sharded
    out = tmp_path / "model.pt"
    # the --checkpoint-dir for one of them: its newest checkpoint is exported
    source = runs / name / "ck" if name == "ddp" else ckpt
    assert export_model.main([str(source), str(out)]) == 0
    printed = capsys.readouterr().out
    weights = torch.load(out, weights_only=True)
    assert all(isinstance(v, torch.Tensor) and v.device.type == "cpu" for v in weights.values())
    assert f"wrote {out}: --model {model} (" in printed and f"{len(weights)} tensors" in printed
    assert f"model.load_state_dict(torch.load({str(out)!r}, weights_only=True))" in printed

    exported, trained = bare(model).eval(), bare(model).eval()
    exported.load_state_dict(weights)  # strict: the same names, nothing more, nothing less
    trained.load_state_dict(torch.load(runs / name / "ref.pt", weights_only=True))
    shape = (3, 32, 32) if model == "cnn" else (3, 64, 64)
    x = torch.randn(4, *shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported(x), trained(x), rtol=0, atol=0)


@pytest.mark.parametrize("damage,words", [
    ("no .metadata", "has no .metadata file, the index of fsdp_train.py's shards (copying with "
                     "cp DIR/*"),
    ("truncated shard", "has incomplete shard files (__0_0.distcp: 1,000 of its "),
    # the CRC-32 kept in meta.pt at save; a checkpoint saved before that had none, and DCP
    # itself finds only bytes that no longer unpickle
    ("zeros in a shard", "is damaged: the bytes of its __0_0.distcp fail their checksum "
                         "(changed on the disk or in a copy): copy the checkpoint folder again"),
    ("zeros in a shard, no checksums", "(__0_0.distcp, __1_0.distcp) is damaged inside"),
    # it said "Weights only load failed. In PyTorch 2.6, we changed the default ..."
    ("garbage meta.pt", "is damaged: its meta.pt, the run's records, does not load"),
])
def test_a_damaged_sharded_checkpoint_names_the_file(runs, tmp_path, capsys, caplog, damage,
                                                      words):
    """FSDP's folder copied with cp DIR/* (which leaves out the dotfile .metadata), or with a
    shard cut short or overwritten: one sentence naming the file, and none of the tracebacks
    torch logs when it looks for a missing .metadata."""
    (ckpt,) = checkpoint.list_checkpoints(runs / "fsdp" / "ck")
    copy = tmp_path / ckpt.name
    shutil.copytree(ckpt, copy)
    if damage == "no .metadata":
        (copy / ".metadata").unlink()
    elif damage == "truncated shard":
        os.truncate(copy / "__0_0.distcp", 1000)
    elif damage == "garbage meta.pt":
        (copy / "meta.pt").write_bytes(b"damaged " * 100)
    else:
        if damage.endswith("no checksums"):
            meta = torch.load(copy / "meta.pt", weights_only=True)
            torch.save({k: v for k, v in meta.items() if k != "checksums"}, copy / "meta.pt")
        with open(copy / "__0_0.distcp", "r+b") as f:
            f.seek(100)
            f.write(bytes(3000))
    out = tmp_path / "model.pt"
    assert export_model.main([str(copy), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err and len(err.strip().splitlines()) == 1
    # DCP logs those tracebacks as warnings on the root logger
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not out.exists()


def flip_bytes_inside_a_tensor(shard: Path) -> None:
    """64 bytes of a shard's largest stretch of tensor data changed, its length the same: the
    damage a bad disk or copy does, which DCP loads as weights."""
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    shard.write_bytes(bytes(data))


def test_changed_bytes_in_a_shard_are_caught_by_the_checksums_of_meta_pt(runs, tmp_path, capsys):
    """The probe's worst finding: 64 bytes flipped inside a .distcp shard exported (and would
    have resumed) with wrong weights, values of about -11,310 in the classifier, and exit 0."""
    (ckpt,) = checkpoint.list_checkpoints(runs / "fsdp" / "ck")
    copy = tmp_path / ckpt.name
    shutil.copytree(ckpt, copy)
    meta = torch.load(copy / "meta.pt", weights_only=True)
    assert sorted(meta["checksums"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert checkpoint.checked_meta(copy)["epoch"] == meta["epoch"]  # whole: its records
    flip_bytes_inside_a_tensor(copy / "__1_0.distcp")
    assert checkpoint.incomplete_shards(copy) is None  # as long as before

    out = tmp_path / "model.pt"
    assert export_model.main([str(copy), str(out)]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {copy} is damaged: the bytes of its __1_0.distcp fail their "
                   f"checksum (changed on the disk or in a copy): copy the checkpoint folder "
                   f"again, whole (cp -r, scp -r), from where the run wrote it, or export an "
                   f"earlier checkpoint\n"), err
    assert not out.exists()
    # the resume's check, in one process: the same words, for load_newest to print
    with pytest.raises(checkpoint.Damaged, match=r"^damaged: the bytes of its __1_0.distcp "):
        checkpoint.checked_meta(copy)


def test_resume_of_an_unreadable_checkpoint_names_the_chmod():
    said = checkpoint._resume_path_error(Path("/ck/ckpt-e0001-s0000000"),
                                         "unreadable: its __1_0.distcp (Permission denied, on "
                                         "rank 1)", PermissionError())
    assert said == ("--resume /ck/ckpt-e0001-s0000000 is unreadable: its __1_0.distcp "
                    "(Permission denied, on rank 1); make it readable (chmod -R u+rX "
                    "/ck/ckpt-e0001-s0000000) or resume as the user who owns it, or leave "
                    "--resume out to start fresh")


def damaged_copies(ckpt: Path, root: Path) -> dict:
    """Copies of an FSDP checkpoint, each damaged one way: {name: folder}."""
    copies = {}
    for damage in ("cut shard", "changed index", "garbage meta.pt", "no checksums"):
        copy = copies[damage] = root / damage.replace(" ", "-") / ckpt.name
        shutil.copytree(ckpt, copy)
        if damage == "cut shard":
            os.truncate(copy / "__0_0.distcp", 1000)
        elif damage == "changed index":
            flip_bytes_inside_a_tensor(copy / ".metadata")
        elif damage == "garbage meta.pt":
            (copy / "meta.pt").write_bytes(b"damaged " * 100)
        else:  # saved before checksums were kept: loads unchecked
            meta = torch.load(copy / "meta.pt", weights_only=True)
            torch.save({k: v for k, v in meta.items() if k != "checksums"}, copy / "meta.pt")
            flip_bytes_inside_a_tensor(copy / "__0_0.distcp")
    return copies


def test_the_resume_check_says_what_is_wrong_first(runs, tmp_path):
    """A shard cut short: its lengths, not its checksum; a changed .metadata: itself, not the
    shard whose length it now records wrongly; a meta.pt that does not load: one sentence."""
    (ckpt,) = checkpoint.list_checkpoints(runs / "fsdp" / "ck")
    copies = damaged_copies(ckpt, tmp_path)
    with pytest.raises(checkpoint.Damaged, match=r"^truncated or damaged: incomplete shard "
                                                 r"files \(__0_0.distcp: 1,000 of its "):
        checkpoint.checked_meta(copies["cut shard"])
    with pytest.raises(checkpoint.Damaged, match=r"^damaged: the bytes of its \.metadata \(the "
                                                 r"index of its shards\) fail their checksum"):
        checkpoint.checked_meta(copies["changed index"])
    with pytest.raises(checkpoint.Damaged, match=r"^damaged: its meta.pt, the run's records, "
                                                 r"does not load$"):
        checkpoint.checked_meta(copies["garbage meta.pt"])
    assert "checksums" not in checkpoint.checked_meta(copies["no checksums"])


def test_a_shard_that_cannot_be_read_back_at_save_is_one_sentence(tmp_path):
    (tmp_path / "__0_0.distcp").write_bytes(b"x")
    assert checkpoint.gather_checksums(tmp_path, ["__0_0.distcp"]) == {
        "__0_0.distcp": zlib.crc32(b"x")}
    with pytest.raises(checkpoint.UsageError) as refused:
        checkpoint.gather_checksums(tmp_path, ["__0_0.distcp", "__1_0.distcp"])
    assert str(refused.value) == (
        f"rank 0 cannot read back __1_0.distcp (No such file or directory) of the checkpoint "
        f"being written in {tmp_path.parent}: every node must see the same --checkpoint-dir, a "
        f"folder on a file system they share")


def test_wrapper_names_are_removed(tmp_path, capsys):
    """A state_dict taken from the wrappers (torch.compile around DataParallel) loads into
    the bare model after the export."""
    model = CifarCNN(10)
    # DataParallel's own names; torch.compile's _orig_mod. put in front by hand (compiling
    # would import dynamo, seconds for a name)
    wrapped = {f"_orig_mod.{k}": v for k, v in torch.nn.DataParallel(model).state_dict().items()}
    assert next(iter(wrapped)).startswith("_orig_mod.module.features.")
    ck = tmp_path / "ckpt-e0001-s0000000"
    torch.save({"model": wrapped, "epoch": 1, "step": 0, "world_size": 1,
                "args": {"model": "cnn"}}, ck)
    assert export_model.main([str(ck), str(tmp_path / "m.pt")]) == 0
    weights = torch.load(tmp_path / "m.pt", weights_only=True)
    assert list(weights) == list(model.state_dict())
    CifarCNN(10).load_state_dict(weights)
    assert "after epoch 1, 1 rank(s)" in capsys.readouterr().out


def test_a_model_built_without_its_auxiliary_heads_exports_and_loads(tmp_path, capsys):
    """GoogLeNet trains without its auxiliary heads (models.build_model); the export built it
    with them, and refused every GoogLeNet checkpoint as not fitting --model googlenet."""
    from training import models
    trained = models.build_model("googlenet", 10, (3, 64, 64)).eval()
    ck = tmp_path / "ckpt-e0001-s0000000"
    torch.save({"model": trained.state_dict(), "epoch": 1, "step": 0, "world_size": 1,
                "args": {"model": "googlenet"}}, ck)
    assert export_model.main([str(ck), str(tmp_path / "m.pt")]) == 0
    printed = capsys.readouterr().out
    code = printed.split("load it with:\n")[1]
    assert ("model = torchvision.models.get_model('googlenet', num_classes=10, "
            "aux_logits=False, init_weights=False)") in code
    scope = {}
    exec(code.replace("\n    ", "\n").strip(), scope)  # what a user pastes elsewhere
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(scope["model"].eval()(x), trained(x), rtol=0, atol=0)


def test_save_model_file_needs_model_to_name_it(tmp_path, capsys):
    ref = tmp_path / "full.pt"
    torch.save(CifarCNN(10).state_dict(), ref)
    assert export_model.main([str(ref), str(tmp_path / "a.pt")]) == 0
    assert "a --save-model file records no --model" in capsys.readouterr().out
    assert export_model.main([str(ref), str(tmp_path / "b.pt"), "--model", "resnet18"]) == 2
    # what does not fit, not only torch's first line ("Error(s) in loading state_dict for")
    assert ("do not fit --model resnet18 (Missing key(s) in state_dict: \"conv1.weight\""
            in capsys.readouterr().err)
    assert export_model.main([str(ref), str(tmp_path / "c.pt"), "--model", "cnn"]) == 0
    assert "CifarCNN(10)" in capsys.readouterr().out


@pytest.mark.parametrize("records", [{}, {"args": None}, {"args": {}, "epoch": 1}])
def test_a_checkpoint_without_its_records_still_gives_its_weights(tmp_path, capsys, records):
    """The "model" entry with some or none of what a run records beside it (a dict saved by
    hand, a trimmed checkpoint): the weights are all the export needs; what is missing is said
    so, and --model names the model to check them against."""
    ck = tmp_path / "trimmed.pt"
    torch.save({"model": CifarCNN(10).state_dict(), **records}, ck)
    out = tmp_path / "model.pt"
    assert export_model.main([str(ck), str(out)]) == 0
    read, wrote = capsys.readouterr().out.splitlines()[:2]
    assert read.endswith(" recorded")
    assert "trimmed.pt records no --model; pass --model NAME" in wrote
    out.unlink()
    assert export_model.main([str(ck), str(out), "--model", "cnn"]) == 0
    assert "CifarCNN(10)" in capsys.readouterr().out
    CifarCNN(10).load_state_dict(torch.load(out, weights_only=True))


@pytest.mark.parametrize("thing,words", [
    ("missing", "does not exist"),
    ("empty folder", "is a folder with no checkpoint in it (no ckpt-eNNNN-sNNNNNNN, and not a "
                     "checkpoint of fsdp_train.py, which holds a meta.pt)"),
    ("text", "not a checkpoint: not a file that torch.save"),
    ("list", "not one of this toolkit's"),
    ("model entry", "has a \"model\" entry without a model's tensors"),
    # a pipe waited for a writer for ever; /dev/stdin fed by cat was "truncated or damaged"
    ("pipe", "is not a file or folder (a pipe or a device?): give the checkpoint's own path"),
    # a link loop, or a link to a checkpoint deleted since, read as "does not exist", which
    # the user's `ls` contradicts
    ("link loop", "thing is a symbolic link that leads back to itself: give the checkpoint's own"
                  " path"),
    ("dangling link", "which does not exist: give the checkpoint's own path"),
])
def test_not_a_checkpoint_is_one_sentence(tmp_path, capsys, thing, words):
    path = tmp_path / "thing"
    if thing == "pipe":
        os.mkfifo(path)
    elif thing == "empty folder":
        path.mkdir()
    elif thing == "text":
        path.write_text("hello\n")
    elif thing == "list":
        torch.save([1, 2], path)
    elif thing == "model entry":
        torch.save({"model": "weights", "epoch": 1}, path)
    elif thing == "link loop":
        (tmp_path / "other").symlink_to(path)
        path.symlink_to(tmp_path / "other")
    elif thing == "dangling link":
        path.symlink_to(tmp_path / "ckpt-e0003-s0000300")
    out = tmp_path / "model.pt"
    assert export_model.main([str(path), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_a_damaged_newest_checkpoint_names_the_one_before_it(tmp_path, capsys):
    """A --checkpoint-dir whose newest checkpoint was cut short (the job killed while it was
    copied): the sentence names the one before it, which holds the run's weights too."""
    for epoch in (1, 2):
        torch.save({"model": CifarCNN(10).state_dict(), "epoch": epoch, "step": 0,
                    "world_size": 1, "args": {"model": "cnn"}},
                   tmp_path / f"ckpt-e{epoch:04d}-s0000000")
    newest = tmp_path / "ckpt-e0002-s0000000"
    newest.write_bytes(newest.read_bytes()[:1000])
    out = tmp_path / "out" / "model.pt"
    assert export_model.main([str(tmp_path), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {newest} is ") and err.endswith(
        f"; or export the checkpoint before it: python export_model.py "
        f"{tmp_path / 'ckpt-e0001-s0000000'} {out}\n"), err
    assert export_model.main([str(tmp_path / "ckpt-e0001-s0000000"), str(out)]) == 0


def test_output_that_would_lose_or_confuse_a_checkpoint_is_refused(tmp_path, capsys):
    ck = tmp_path / "ckpt-e0001-s0000000"
    torch.save({"model": CifarCNN(10).state_dict(), "epoch": 1, "step": 0, "world_size": 1,
                "args": {"model": "cnn"}}, ck)
    before = ck.read_bytes()
    assert export_model.main([str(ck), str(ck)]) == 2
    assert "is the checkpoint itself" in capsys.readouterr().err
    assert export_model.main([str(ck), str(tmp_path / "ckpt-e0002-s0000000.pt")]) == 2
    assert "named like a checkpoint" in capsys.readouterr().err
    # under a file: "(File exists)" before, which named no culprit
    (tmp_path / "train.log").write_text("")
    out = tmp_path / "train.log" / "model.pt"
    assert export_model.main([str(ck), str(out)]) == 2
    assert capsys.readouterr().err == (f"error: cannot write {out}: a folder of its path is a "
                                       f"file; give a path in a folder\n")
    assert ck.read_bytes() == before


def test_a_pipe_is_refused_and_a_link_is_written_through(tmp_path, capsys):
    """The file is written beside OUT and renamed over it: a FIFO (or, as root, /dev/null) was
    replaced by a regular file, and a symbolic link by a file of its own."""
    ck = tmp_path / "ckpt-e0001-s0000000"
    torch.save({"model": CifarCNN(10).state_dict(), "epoch": 1, "step": 0, "world_size": 1,
                "args": {"model": "cnn"}}, ck)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert export_model.main([str(ck), str(fifo)]) == 2
    assert capsys.readouterr().err == (f"error: {fifo} is not a regular file (a device, a pipe "
                                       f"or a socket): give the name of a file to write, e.g. "
                                       f"model.pt\n")
    assert fifo.is_fifo()
    link, target = tmp_path / "model.pt", tmp_path / "shared" / "v3.pt"
    target.parent.mkdir()
    link.symlink_to(target)
    assert export_model.main([str(ck), str(link)]) == 0
    assert link.is_symlink() and target.is_file()
    CifarCNN(10).load_state_dict(torch.load(link, weights_only=True))
    assert export_model.main([str(ck), str(tmp_path / "m.pt"), "--model", ""]) == 2
    assert "error: --model is empty" in capsys.readouterr().err


def test_changed_bytes_inside_a_checkpoint_are_caught_by_its_checksum(tmp_path, capsys):
    """torch.load does not check the zip's CRC-32: bytes changed inside a tensor loaded as
    weights (NaN among them), and the export wrote them, exit 0. The resume skips such a
    checkpoint as it skips a truncated one."""
    ck = tmp_path / "ckpt-e0001-s0000000"
    torch.save({"model": CifarCNN(10).state_dict(), "epoch": 1, "step": 0, "world_size": 1,
                "args": {"model": "cnn"}}, ck)
    data = bytearray(ck.read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = b"\xff" * 64  # inside the largest weight
    ck.write_bytes(bytes(data))
    torch.load(ck, weights_only=True)  # loads, as before
    assert export_model.main([str(ck), str(tmp_path / "m.pt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {ck} is damaged: the bytes of its ") and \
        "fail their checksum (changed on the disk or in a copy)" in err, err
    assert not (tmp_path / "m.pt").exists()
    with pytest.raises(checkpoint.Damaged, match="^damaged: the bytes of its .* fail their "
                                                 "checksum"):
        checkpoint.load_one_file(ck, {})
    assert checkpoint.not_a_checkpoint(ck).startswith("damaged: the bytes of its ")
    # --resume of it: it is a checkpoint of a run, whose bytes changed; not "give --resume a
    # checkpoint that a run with --checkpoint-dir wrote"
    with pytest.raises(checkpoint.UsageError) as refused:
        checkpoint.load_newest([ck], lambda p: checkpoint.load_one_file(p, {}), explicit=True)
    assert str(refused.value).startswith(f"--resume {ck} is damaged: the bytes of its ")
    assert str(refused.value).endswith(
        "fail their checksum (changed on the disk or in a copy); copy it again, whole, from "
        "where the run wrote it, or give --resume the checkpoint before it, or leave --resume "
        "out to start fresh")


def test_a_checkpoint_dir_whose_checkpoints_were_set_aside_names_them(tmp_path, capsys):
    """After --resume never moved a run's checkpoints into superseded-*/, exporting the
    --checkpoint-dir said 'not a checkpoint: a folder without the meta.pt' and named none."""
    ck = tmp_path / "ck"
    for aside, epochs in (("superseded-20261130-090000-ab12", (1,)),
                          ("superseded-20261201-101500-cd34", (1, 2))):
        (ck / aside).mkdir(parents=True)
        for epoch in epochs:
            torch.save({"model": CifarCNN(10).state_dict(), "epoch": epoch, "step": 0,
                        "world_size": 1, "args": {"model": "cnn"}},
                       ck / aside / f"ckpt-e{epoch:04d}-s0000000")
    assert export_model.main([str(ck), str(tmp_path / "m.pt")]) == 2
    newest = ck / "superseded-20261201-101500-cd34" / "ckpt-e0002-s0000000"
    assert capsys.readouterr().err == (
        f"error: {ck} holds no checkpoint of its own, but 2 superseded-* folder(s) hold those "
        f"that --resume never set aside (the newest folder: superseded-20261201-101500-cd34, "
        f"with 2): give one of them, e.g. {newest}\n")
    assert export_model.main([str(newest), str(tmp_path / "m.pt")]) == 0


@pytest.mark.parametrize("out_inside", [True, False])
def test_a_run_directory_names_its_checkpoints_folder(tmp_path, capsys, out_inside):
    """A launcher's run directory given as the checkpoint, OUT written into it: the sentence
    was 'OUT is the checkpoint itself (or inside it)', and with OUT elsewhere 'not a
    checkpoint', and neither named RUN_DIR/checkpoints, which exports."""
    run_dir = tmp_path / "runs" / "local-20261207-164353-5745"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "train.log").write_text("Epoch [1/1] ...\n")
    torch.save({"model": CifarCNN(10).state_dict(), "epoch": 1, "step": 0, "world_size": 1,
                "args": {"model": "cnn"}}, run_dir / "checkpoints" / "ckpt-e0001-s0000000")
    out = (run_dir if out_inside else tmp_path) / "model.pt"
    assert export_model.main([str(run_dir), str(out)]) == 2
    assert capsys.readouterr().err == (
        f"error: {run_dir} holds no checkpoint itself, but {run_dir / 'checkpoints'} does (a run "
        f"directory keeps its checkpoints there): give that folder, python export_model.py "
        f"{run_dir / 'checkpoints'} OUT\n")
    assert not out.exists()
    assert export_model.main([str(run_dir / "checkpoints"), str(out)]) == 0


def test_two_names_of_one_parameter_are_refused_not_one_dropped(tmp_path, capsys):
    """A file holding both module.x and x (two models' state_dicts saved together) exported
    one of them, whichever came last, without a word."""
    weights = CifarCNN(10).state_dict()
    both = weights | {f"module.{k}": torch.zeros_like(v) for k, v in weights.items()}
    torch.save(both, tmp_path / "both.pt")
    assert export_model.main([str(tmp_path / "both.pt"), str(tmp_path / "m.pt"),
                              "--model", "cnn"]) == 2
    first = next(iter(weights))
    assert capsys.readouterr().err == (
        f"error: the weights hold both {first} and module.{first}, which are the same "
        f"parameter, {first}, once the wrappers' parts are removed: they come from two models "
        f"saved into one file; save one model's state_dict alone and export that\n")
    assert not (tmp_path / "m.pt").exists()


def test_an_out_name_of_255_bytes_is_written(tmp_path, capsys):
    """A name of 244 to 255 bytes fits the file system, but its temporary name (.tmp-NAME-PID)
    did not: 'cannot write OUT (File name too long): choose a writable folder'."""
    ck = tmp_path / "ckpt-e0001-s0000000"
    torch.save({"model": CifarCNN(10).state_dict(), "epoch": 1, "step": 0, "world_size": 1,
                "args": {"model": "cnn"}}, ck)
    out = tmp_path / ("m" * 252 + ".pt")
    assert export_model.main([str(ck), str(out)]) == 0, capsys.readouterr().err
    CifarCNN(10).load_state_dict(torch.load(out, weights_only=True))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([ck.name, out.name])


def test_ctrl_c_is_one_line(tmp_path, monkeypatch, capsys):
    def interrupted(*_):
        raise KeyboardInterrupt
    monkeypatch.setattr(export_model.checkpoint, "atomic_save", interrupted)
    ck = tmp_path / "ckpt-e0001-s0000000"
    torch.save({"model": CifarCNN(10).state_dict(), "epoch": 1, "step": 0, "world_size": 1,
                "args": {"model": "cnn"}}, ck)
    assert export_model.main([str(ck), str(tmp_path / "m.pt")]) == 130
    assert capsys.readouterr().err == (f"error: interrupted (Ctrl-C); {tmp_path / 'm.pt'} was "
                                       f"not written, the checkpoint is untouched: run the "
                                       f"command again\n")


# As root, the run drops to 'nobody' once its imports are done, as a user would be who may not
# read another user's checkpoint (root reads every file, whatever its mode).
_AS_NOBODY = """
import os, sys
sys.path.insert(0, sys.argv[1])
import export_model
if os.geteuid() == 0:
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
sys.exit(export_model.main(sys.argv[2:]))
"""


@pytest.mark.parametrize("denied", ["the folder", "a shard", "meta.pt"])
def test_a_checkpoint_this_user_may_not_read_is_said_so(runs, denied):
    """A folder that cannot be listed was a PermissionError traceback, and an unreadable shard
    or meta.pt was called damaged ("copy them again"): each is now 'cannot read X: permission
    denied' with the chmod that fixes it, exit 2."""
    import stat
    import tempfile
    top = Path(tempfile.mkdtemp(prefix="unreadable-"))  # not under pytest's root-only tmp dir
    try:
        ck = top / "ck"
        shutil.copytree(runs / "fsdp" / "ck", ck)
        for p in [top, *top.rglob("*")]:  # everyone may read and write, then one thing not
            p.chmod(p.stat().st_mode | stat.S_IROTH | stat.S_IWOTH
                    | (stat.S_IXOTH if p.is_dir() else 0))
        (newest,) = checkpoint.list_checkpoints(ck)
        target = {"the folder": ck, "a shard": newest / "__0_0.distcp",
                  "meta.pt": newest / "meta.pt"}[denied]
        target.chmod(0o333 if target.is_dir() else 0)  # write and enter, not read
        proc = subprocess.run([sys.executable, "-c", _AS_NOBODY, str(REPO), str(ck),
                               str(top / "model.pt")], capture_output=True, text=True,
                              timeout=120, env=env_for_tests())
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert f"error: cannot read {target}: permission denied; make it readable (chmod -R " \
               f"u+rX " in proc.stderr, proc.stderr
        assert not (top / "model.pt").exists()
    finally:
        for p in [top, *top.rglob("*")]:
            p.chmod(0o755)
        shutil.rmtree(top)


def test_an_out_that_ends_in_a_slash_is_a_folder(runs, tmp_path, capsys):
    """OUT "new/" (a folder that does not exist yet) was written as a file named "new": Path
    drops the slash. It is refused as an existing folder is, and nothing is written."""
    out = f"{tmp_path / 'new'}/"
    assert export_model.main([str(runs / "dp" / "ck"), out]) == 2
    assert f"error: {out} names a folder: give a file name, e.g. {tmp_path / 'new' / 'model.pt'}" \
        in capsys.readouterr().err
    assert not (tmp_path / "new").exists()

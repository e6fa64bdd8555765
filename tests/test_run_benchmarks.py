"""launch/run_benchmarks.py: the exact sbatch commands of a matrix, the study manifest, --resume,
and a real local study (ddp and fsdp at world sizes 1 and 2 on CPU) collected into tables and
plots by collect_results.py.

No Slurm is needed: the submission tests put a fake `sbatch` and `squeue` first on PATH (small
Python scripts that record their arguments and hand out job ids), so they check exactly what
would be submitted without a cluster, and never reach a real one.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import REPO, TESTS, TINY, env_for_tests

import collect_results
from reporting import plots, scaling
from training import flags

SCRIPT = REPO / "launch" / "run_benchmarks.py"
FIXTURE_STUDY = TESTS / "fixtures" / "study"
SLURM = REPO / "launch"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

FAKE_SBATCH = """#!{python}
# Records its arguments and RUN_DIR (which must not leak into the jobs), prints a job id.
import json, os, sys
from pathlib import Path
here = Path(__file__).parent
calls = here / "sbatch_calls.jsonl"
n = sum(1 for _ in open(calls)) if calls.exists() else 0
if os.environ.get("SBATCH_FAIL_AT") == str(n + 1):
    print("sbatch: error: Batch job submission failed: Invalid partition name specified",
          file=sys.stderr)
    sys.exit(1)
with open(calls, "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "RUN_DIR": os.environ.get("RUN_DIR"),
                        "NPROC_PER_NODE": os.environ.get("NPROC_PER_NODE")}}) + "\\n")
print(7001 + n)
"""
FAKE_SQUEUE = """#!{python}
# The job ids in squeue_ids.txt are "still in the queue".
from pathlib import Path
ids = Path(__file__).parent / "squeue_ids.txt"
print(ids.read_text() if ids.exists() else "", end="")
"""


@pytest.fixture
def fakebin(tmp_path):
    """A directory with fake sbatch and squeue, to put first on PATH."""
    d = tmp_path / "fakebin"
    d.mkdir()
    for name, text in (("sbatch", FAKE_SBATCH), ("squeue", FAKE_SQUEUE)):
        (d / name).write_text(text.format(python=sys.executable))
        (d / name).chmod(0o755)
    return d


def sbatch_calls(fakebin: Path) -> list:
    f = fakebin / "sbatch_calls.jsonl"
    return [json.loads(ln) for ln in f.read_text().splitlines()] if f.exists() else []


def rb(*args, fakebin: Path | None = None, env: dict | None = None, timeout=600,
       no_torch=False):
    """python launch/run_benchmarks.py ARGS, with the fake Slurm commands first on PATH (and,
    no_torch, as if torch were not installed: tests/no_torch.py)."""
    extra = dict(env or {})
    if fakebin is not None:
        extra["PATH"] = f"{fakebin}{os.pathsep}{os.environ['PATH']}"
    blocker = [str(TESTS / "no_torch.py")] if no_torch else []
    return subprocess.run([sys.executable, *blocker, str(SCRIPT), *map(str, args)],
                          capture_output=True, text=True, env=env_for_tests(extra), cwd=REPO,
                          timeout=timeout)


def commands(stdout: str) -> list:
    return [ln for ln in stdout.splitlines()
            if ln and not ln.startswith(("#", "mkdir -p "))]


def sbatch(name, strategy, nodes, gpus, study, script, batch, train, extra=()) -> str:
    """The sbatch line run_benchmarks.py must print, spelled out."""
    return shlex.join([
        "sbatch", "--parsable", f"--job-name={name}", f"--nodes={nodes}",
        f"--gpus-per-node={gpus}", f"--cpus-per-task={4 * gpus}", f"--output={study}/%x-%j.out",
        *extra, f"--export=ALL,STRATEGY={strategy},RUNS_DIR={study}", str(SLURM / script),
        "--batch-size", str(batch), *train])


# --------------------------------------------------------------------------------------------
# The commands
# --------------------------------------------------------------------------------------------

def run_benchmarks_module():
    """launch/run_benchmarks.py, imported."""
    spec = importlib.util.spec_from_file_location("run_benchmarks", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["run_benchmarks"] = mod  # dataclasses look their module up while defining
    spec.loader.exec_module(mod)
    return mod


def test_default_batch_is_the_training_scripts():
    mod = run_benchmarks_module()
    parser = flags.add_common_args(argparse.ArgumentParser())
    assert mod.DEFAULT_BATCH_SIZE == parser.get_default("batch_size")  # imported: one definition
    assert mod.MANIFEST is collect_results.MANIFEST  # imported: one definition
    assert mod.STRATEGIES is scaling.STRATEGIES


def test_dry_run_prints_the_multi_node_matrix(tmp_path):
    study = tmp_path / "study"
    proc = rb("--dry-run", "--study-dir", study, "--strategies", "dp", "ddp", "--gpus", "1", "4",
              "--nodes", "1", "2", "--sbatch-args", "--partition=gpu --time=00:30:00",
              "--", "--epochs", "3", "--data-dir", "/data/tiny-imagenet-200")
    assert proc.returncode == 0, proc.stderr
    train = ["--epochs", "3", "--data-dir", "/data/tiny-imagenet-200"]
    extra = ["--partition=gpu", "--time=00:30:00"]
    assert commands(proc.stdout) == [
        sbatch("dp-1n1g", "dp", 1, 1, study, "baseline.slurm", 64, train, extra),
        sbatch("dp-1n4g", "dp", 1, 4, study, "multi_gpu.slurm", 64, train, extra),
        sbatch("ddp-1n1g", "ddp", 1, 1, study, "baseline.slurm", 64, train, extra),
        sbatch("ddp-1n4g", "ddp", 1, 4, study, "multi_gpu.slurm", 64, train, extra),
        sbatch("ddp-2n1g", "ddp", 2, 1, study, "multi_node.slurm", 64, train, extra),
        sbatch("ddp-2n4g", "ddp", 2, 4, study, "multi_node.slurm", 64, train, extra),
    ]
    # The literal text, once, so a quoting change cannot hide behind the helper:
    assert (f"sbatch --parsable --job-name=ddp-2n4g --nodes=2 --gpus-per-node=4 "
            f"--cpus-per-task=16 --output={study}/%x-%j.out --partition=gpu --time=00:30:00 "
            f"--export=ALL,STRATEGY=ddp,RUNS_DIR={study} {REPO}/launch/multi_node.slurm "
            f"--batch-size 64 --epochs 3 --data-dir /data/tiny-imagenet-200\n") in proc.stdout
    assert "# skip dp-2n1g: DataParallel (dp) is one process on one node" in proc.stdout
    assert "# skip dp-2n4g: DataParallel (dp) is one process on one node" in proc.stdout
    assert "8 configurations, 2 skipped, 6 to run" in proc.stdout
    assert not study.exists()  # a dry run writes nothing
    # a script to run as it is: sbatch's --output needs the study folder (exit 0:53 without)
    assert proc.stdout.splitlines()[1] == f"mkdir -p {study}"


def test_the_workshops_two_tables_and_strong_scaling(tmp_path):
    study = tmp_path / "s"
    proc = rb("--dry-run", "--study-dir", study, "--strategies", "fsdp", "--gpus", "1", "2",
              "4", "8", "--nodes", "1", "2", "4", "--multi-node-gpus", "4", "--scaling",
              "strong", "--global-batch", "256")
    assert proc.returncode == 0, proc.stderr
    # 1-8 GPUs on one node, then 2 and 4 nodes x 4 GPUs; per-GPU batch = 256 / GPUs.
    assert commands(proc.stdout) == [
        sbatch("fsdp-1n1g", "fsdp", 1, 1, study, "baseline.slurm", 256, []),
        sbatch("fsdp-1n2g", "fsdp", 1, 2, study, "multi_gpu.slurm", 128, []),
        sbatch("fsdp-1n4g", "fsdp", 1, 4, study, "multi_gpu.slurm", 64, []),
        sbatch("fsdp-1n8g", "fsdp", 1, 8, study, "multi_gpu.slurm", 32, []),
        sbatch("fsdp-2n4g", "fsdp", 2, 4, study, "multi_node.slurm", 32, []),
        sbatch("fsdp-4n4g", "fsdp", 4, 4, study, "multi_node.slurm", 16, []),
    ]
    proc = rb("--dry-run", "--study-dir", study, "--strategies", "ddp", "--gpus", "1", "3",
              "--scaling", "strong", "--global-batch", "64")
    assert "# skip ddp-1n3g: strong scaling: global batch 64 does not divide by 3 GPUs" in (
        proc.stdout)
    assert commands(proc.stdout) == [sbatch("ddp-1n1g", "ddp", 1, 1, study, "baseline.slurm",
                                            64, [])]


def test_lr_scaling_reaches_every_run(tmp_path):
    study = tmp_path / "s"
    proc = rb("--dry-run", "--study-dir", study, "--strategies", "ddp", "fsdp", "--gpus", "1",
              "2", "--lr-scaling", "linear", "--", "--warmup-epochs", "0.5")
    assert proc.returncode == 0, proc.stderr
    extra = ["--warmup-epochs", "0.5", "--lr-scaling", "linear"]
    assert commands(proc.stdout) == [
        sbatch("ddp-1n1g", "ddp", 1, 1, study, "baseline.slurm", 64, extra),
        sbatch("ddp-1n2g", "ddp", 1, 2, study, "multi_gpu.slurm", 64, extra),
        sbatch("fsdp-1n1g", "fsdp", 1, 1, study, "baseline.slurm", 64, extra),
        sbatch("fsdp-1n2g", "fsdp", 1, 2, study, "multi_gpu.slurm", 64, extra),
    ]


def test_training_arguments_unchecked_where_the_scripts_cannot_be_imported(tmp_path):
    """Where PYTHON cannot import the training scripts (a login node without torch), the study
    goes ahead with a note instead of refusing good arguments."""
    proc = rb("--dry-run", "--strategies", "ddp", "--gpus", "1", "--study-dir", tmp_path / "s",
              "--", "--epochs", "1", env={"PYTHON": f"{sys.executable} -c 'raise "
                                                   f"ImportError(\"no torch here\")'"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == ("note: the training arguments after -- were not checked "
                                   "(ImportError: no torch here); a wrong one fails every run")


@pytest.mark.parametrize("args,says", [
    (["--", "--batch-size", "32"], "use --per-gpu-batch N"),
    (["--", "--batch=32"], "use --per-gpu-batch N"),
    (["--", "--bat", "8"], "use --per-gpu-batch N"),  # argparse's abbreviation: the batch 8
    (["--", "--gp", "2"], "the study sets the GPUs of every run"),
    (["--", "--checkpoint-d=/tmp/ck"], "share one checkpoint folder"),
    (["--", "--checkpoint-dir", "/tmp/ck"], "share one checkpoint folder"),
    # every run wrote the same file, the last to end replacing the others'
    (["--", "--save-model", "/tmp/model.pt"], "every run would write that one file"),
    (["--", "--sa=model.pt"], "every run would write that one file"),
    (["--scaling", "strong"], "needs --global-batch"),
    (["--scaling", "strong", "--global-batch", "64", "--per-gpu-batch", "8"],
     "--per-gpu-batch is for weak scaling"),
    (["--global-batch", "64"], "--global-batch is for --scaling strong"),
    (["--gpus", "0"], "--gpus 0: counts must be at least 1"),
    (["--per-gpu-batch", "0"], "--per-gpu-batch 0: must be at least 1"),
    (["--cpus-per-gpu", "0"], "--cpus-per-gpu 0: must be at least 1"),
    (["--resume"], "--resume needs --study-dir"),
    (["--resume", "--study-dir", "{tmp}"], "no study.json in"),
    (["--study-dir", "{tmp}/a,b"], "contains a comma"),
    (["--sbatch-args", "'--partition=gpu"], "quote it as one string"),
    # what the study sets itself, which sbatch would take from --sbatch-args (the last one)
    (["--sbatch-args", "-N 4 --partition=gpu"], "--sbatch-args -N: the study sets --nodes"),
    (["--sbatch-args=--output=/tmp/x.out"], "the study sets --output for every job itself"),
    (["--sbatch-args", "--gpus-per-node=8"], "the study sets --gpus-per-node"),
    (["--sbatch-args", "--out=/tmp/x.out"], "the study sets --output"),  # sbatch's abbreviation
    (["--lr-scaling", "linear", "--", "--lr-scaling", "sqrt"], "keep the one before it"),
    (["--", "--nonsense"], "are refused (dp_train.py: error: unrecognized arguments: "
                           "--nonsense); fix them (python dp_train.py --help lists its flags)"),
    (["--strategies", "ddp", "fsdp", "--", "--sharding", "hybrid"],
     "(ddp_train.py: error: unrecognized arguments: --sharding hybrid)"),
    (["--", "--model", "nosuch"], "are refused (dp_train.py: error: unknown --model 'nosuch'"),
    # a flag DataParallel refuses: not "--help lists its flags", which hides it
    (["--", "--share-gpus"], "use ddp_train.py or fsdp_train.py --share-gpus); leave "
                             "DataParallel out of the study: --strategies ddp fsdp"),
])
def test_bad_flags_are_one_clear_sentence(tmp_path, args, says):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    proc = rb("--dry-run", *args)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], proc.stderr


def test_sbatch_args_of_one_option_is_taken_as_its_value(tmp_path):
    """`--sbatch-args --partition=gpu` (one option, so no space inside the quotes) was argparse's
    "expected one argument": it took the value for an option of its own."""
    proc = rb("--dry-run", "--study-dir", tmp_path / "s", "--strategies", "ddp", "--gpus", "1",
              "--sbatch-args", "--partition=gpu", "--", "--epochs", "1")
    assert proc.returncode == 0, proc.stderr
    assert " --partition=gpu --export=ALL,STRATEGY=ddp," in proc.stdout, proc.stdout
    # a forgotten value: the study's own flag after it is not taken for one (--dry-run was,
    # and the study ran sbatch)
    proc = rb("--study-dir", tmp_path / "t", "--strategies", "ddp", "--gpus", "1",
              "--sbatch-args", "--dry-run")
    assert proc.returncode == 2 and proc.stderr.strip().endswith(
        "error: argument --sbatch-args: expected one argument"), proc.stderr
    assert not (tmp_path / "t").exists()


def test_a_study_dir_that_cannot_be_made_or_a_study_of_skips_is_one_sentence(tmp_path):
    """Under a file (or where this user may not write): a NotADirectoryError traceback before.
    A study whose every configuration is skipped said '0 of 0 runs ok' and exit 0; a dry run
    of it still lists the plan."""
    (tmp_path / "file").write_text("")
    proc = rb("--local", "--study-dir", tmp_path / "file" / "study", "--strategies", "ddp",
              "--gpus", "1", "--", "--model", "cnn", "--epochs", "1", no_torch=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: cannot create --study-dir {tmp_path / 'file' / 'study'} (Not a directory): "
        f"name a directory you may write to"), proc.stderr
    skips = ["--local", "--study-dir", tmp_path / "skips", "--strategies", "ddp", "--scaling",
             "strong", "--global-batch", "7", "--gpus", "2"]
    proc = rb(*skips, no_torch=True)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        "error: nothing to run: all 1 configuration(s) are skipped: strong scaling: global "
        "batch 7 does not divide by 2 GPUs; pick a global batch that all GPU counts divide")
    assert not (tmp_path / "skips").exists()
    proc = rb("--dry-run", *skips, no_torch=True)
    assert proc.returncode == 0 and "1 skipped, 0 to run" in proc.stdout, proc.stderr


def test_the_study_knows_the_shortest_abbreviation_of_each_flag_it_sets():
    """STUDY_SETS' abbreviations are the shortest that argparse takes for those flags from each
    training script: one character less fits another flag too (or none), so argparse refuses
    it itself. A new flag that changes that fails here, not in a study's figures."""
    study_sets = run_benchmarks_module().STUDY_SETS
    for script in ("dp_train", "ddp_train", "fsdp_train"):
        names = [o for a in importlib.import_module(script).build_parser()._actions
                 for o in a.option_strings if o.startswith("--")]
        for flag, shortest in study_sets.items():
            if flag not in names:  # dp_train.py has no --checkpoint-dir of DDP's kind
                continue
            assert [n for n in names if n.startswith(shortest)] == [flag], (script, shortest)
            assert [n for n in names if n.startswith(shortest[:-1])] != [flag], (script, shortest)
        # --tensorboard is its own shortest: --tensorb fits --tensorboard-every too
        for flag, shortest in run_benchmarks_module().FOLDER_FLAGS.items():
            fits = [n for n in names if n.startswith(shortest)]
            assert fits == [flag] or shortest == flag in fits, (script, shortest)
            assert [n for n in names if n.startswith(shortest[:-1])] != [flag], (script, shortest)


@pytest.mark.parametrize("given, named", [
    (["--tensorboard", "/scratch/tb"], "--tensorboard /scratch/tb"),
    (["--tensorboard=tb"], "--tensorboard=tb"), (["--p", "out"], "--p out"),
    (["--epochs", "1", "--profile=/tmp/prof"], "--profile=/tmp/prof")])
def test_a_folder_for_profiles_or_curves_after_the_double_dash_is_refused(tmp_path, given,
                                                                          named):
    """--tensorboard DIR or --profile DIR after --: every run of the study wrote its curves or
    trace into that one folder, mixed (the traces of one rank 0 replacing another's). Given
    bare, or --tensorboard off, each run writes in its own run directory."""
    base = ["--dry-run", "--strategies", "ddp", "--gpus", "1", "--"]
    proc = rb("--study-dir", tmp_path / "s", *base, *given, no_torch=True)
    flag = "--profile" if named.startswith("--p") else "--tensorboard"
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"error: {named} after --: every run would write into that one folder, their files "
        f"mixed; give {flag} without a folder (each run writes in its own run directory)"), \
        proc.stderr
    # given bare, or --tensorboard off, each run writes in its own run directory
    for fine in (["--profile", "--tensorboard"], ["--tensorboard", "off"], ["--tensorboard"],
                 ["--tensorboard", "--epochs", "1"], ["--tensorboard-every", "2"]):
        assert run_benchmarks_module().run_folder_flag(fine) is None, fine


@pytest.mark.parametrize("edit", ["gpus", "strategies", "scaling", "nodes"])
def test_resume_of_a_study_json_with_edited_settings_is_one_sentence(tmp_path, edit):
    """study.json edited by hand (gpus ["2"], strategies gone, an unknown scaling) ended in a
    TypeError or KeyError where the settings were used; now it is the manifest's sentence. Nodes
    [0] was blamed on a --nodes 0 the user never typed."""
    manifest = json.loads((FIXTURE_STUDY / "study.json").read_text())
    if edit == "strategies":
        del manifest["settings"]["strategies"]
    elif edit == "nodes":
        manifest["settings"]["nodes"] = [0]
    else:
        manifest["settings"][edit] = ["2"] if edit == "gpus" else "diagonal"
    (tmp_path / "study.json").write_text(json.dumps(manifest))
    proc = rb("--dry-run", "--resume", "--study-dir", tmp_path, env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == (f"error: {tmp_path / 'study.json'}: not a study manifest "
                                   f"(its settings are not those launch/run_benchmarks.py "
                                   f"writes); restore it, or start a new study with another "
                                   f"--study-dir"), proc.stderr


def test_a_study_json_without_its_record_of_invocations_resumes_and_one_with_text_is_refused(
        tmp_path):
    """--resume of a study.json whose "invocations" was deleted or made text: a KeyError or an
    AttributeError traceback when the resume recorded itself (after --dry-run had said all was
    well)."""
    module = run_benchmarks_module()
    manifest = json.loads((FIXTURE_STUDY / "study.json").read_text())
    del manifest["invocations"]
    module.record_plan(tmp_path, manifest, dict(manifest["settings"]), [], True, ["--resume"])
    assert [i["command"] for i in manifest["invocations"]] == [
        "python launch/run_benchmarks.py --resume"]
    manifest["invocations"] = "x"
    (tmp_path / "study.json").write_text(json.dumps(manifest))
    proc = rb("--dry-run", "--resume", "--study-dir", tmp_path, env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().startswith(f"error: {tmp_path / 'study.json'}: not a study "
                                          f"manifest (ValueError: runs or invocations is not a "
                                          f"list)"), proc.stderr

# --------------------------------------------------------------------------------------------
# Submitting, with a fake sbatch
# --------------------------------------------------------------------------------------------

def test_submission_and_manifest(tmp_path, fakebin):
    study = tmp_path / "study"
    proc = rb("--study-dir", study, "--strategies", "dp", "ddp", "--gpus", "1", "2", "--nodes",
              "1", "2", "--per-gpu-batch", "32", "--", "--epochs", "1", fakebin=fakebin,
              env={"RUN_DIR": "/somewhere/else", "NPROC_PER_NODE": "3", "LOG_INTERVAL": "2"})
    assert proc.returncode == 0, proc.stderr
    calls = sbatch_calls(fakebin)
    printed = rb("--dry-run", "--study-dir", study / "x", "--strategies", "dp", "ddp",
                 "--gpus", "1", "2", "--nodes", "1", "2", "--per-gpu-batch", "32", "--",
                 "--epochs", "1")
    expected = [shlex.split(c.replace(str(study / "x"), str(study)))
                for c in commands(printed.stdout)]
    assert [["sbatch", *c["argv"]] for c in calls] == expected  # what ran = what dry-run prints
    # An exported RUN_DIR or NPROC_PER_NODE would put every job in one directory or change
    # its processes: they are not passed on.
    assert all(c["RUN_DIR"] is None and c["NPROC_PER_NODE"] is None for c in calls)
    manifest = json.loads((study / "study.json").read_text())
    assert manifest["mode"] == "slurm"
    assert manifest["settings"]["scaling"] == "weak"
    assert manifest["settings"]["per_gpu_batch"] == 32
    assert manifest["settings"]["train_args"] == ["--epochs", "1"]
    assert manifest["invocations"][0]["env"]["LOG_INTERVAL"] == "2"
    runs = {r["name"]: r for r in manifest["runs"]}
    assert list(runs) == ["dp-1n1g", "dp-1n2g", "dp-2n1g", "dp-2n2g",
                          "ddp-1n1g", "ddp-1n2g", "ddp-2n1g", "ddp-2n2g"]
    assert runs["dp-2n2g"]["skipped"] and runs["dp-2n2g"]["attempts"] == []
    assert [a["job_id"] for r in runs.values() for a in r["attempts"]] == [
        "7001", "7002", "7003", "7004", "7005", "7006"]
    assert runs["ddp-2n2g"]["attempts"][0]["run_dir"] == str(study / "ddp-2n2g-7006")
    assert runs["ddp-2n2g"]["global_batch"] == 128 and runs["ddp-2n2g"]["per_gpu_batch"] == 32
    assert runs["ddp-2n2g"]["command"] == shlex.join(["sbatch", *calls[-1]["argv"]])
    assert "submitted ddp-2n2g: job 7006" in proc.stdout
    # A second study in the same directory is refused; --resume is the way.
    again = rb("--study-dir", study, "--strategies", "ddp", fakebin=fakebin)
    assert again.returncode == 2 and "add --resume" in again.stderr


def test_failed_submission_then_resume(tmp_path, fakebin):
    """The commands printed to paste quote the study's path: with a space in it, they named
    another folder."""
    study = tmp_path / "my study"
    args = ["--study-dir", study, "--strategies", "ddp", "--gpus", "1", "2", "4"]
    proc = rb(*args, fakebin=fakebin, env={"SBATCH_FAIL_AT": "2"})
    assert proc.returncode == 1
    assert "Invalid partition name" in proc.stderr
    pasted = shlex.split(proc.stderr.rsplit("submit the rest with: ", 1)[1])
    assert pasted == ["python", "launch/run_benchmarks.py", "--resume", "--study-dir",
                      str(study)]
    assert [c["argv"][1] for c in sbatch_calls(fakebin)] == ["--job-name=ddp-1n1g"]
    runs = {r["name"]: r for r in json.loads((study / "study.json").read_text())["runs"]}
    assert runs["ddp-1n1g"]["attempts"][0]["job_id"] == "7001"
    assert "Invalid partition name" in runs["ddp-1n2g"]["attempts"][0]["error"]
    assert runs["ddp-1n4g"]["attempts"] == []

    # Job 7001 is still queued (no run directory yet): --resume leaves it alone.
    (fakebin / "squeue_ids.txt").write_text("7001\n")
    proc = rb("--resume", "--study-dir", study, fakebin=fakebin)
    assert proc.returncode == 0, proc.stderr
    assert [c["argv"][1] for c in sbatch_calls(fakebin)] == [
        "--job-name=ddp-1n1g", "--job-name=ddp-1n2g", "--job-name=ddp-1n4g"]
    assert "# ddp-1n1g: job 7001 is still in squeue; not run again" in proc.stdout
    done = next(ln for ln in proc.stdout.splitlines() if ln.startswith("when done: "))
    assert shlex.split(done)[2:] == ["python", "collect_results.py", str(study), "--plot"]


def test_resume_runs_only_what_is_missing_or_failed(tmp_path, fakebin):
    """The fixture study: ok runs stay, a queued job stays, the rest is submitted again."""
    study = tmp_path / "study"
    shutil.copytree(FIXTURE_STUDY, study)
    (fakebin / "squeue_ids.txt").write_text("4977\n5006\n")  # ddp-8n4g is still pending
    proc = rb("--resume", "--dry-run", "--study-dir", study, fakebin=fakebin)
    assert proc.returncode == 0, proc.stderr
    train = ["--data-dir", "/data/tiny-imagenet-200", "--epochs", "3"]
    extra = ["--partition=gpu", "--time=01:00:00"]
    expected = [
        sbatch("ddp-4n4g", "ddp", 4, 4, study, "multi_node.slurm", 64, train, extra),   # partial
        sbatch("fsdp-1n1g", "fsdp", 1, 1, study, "baseline.slurm", 64, train, extra),   # failed
        sbatch("fsdp-1n4g", "fsdp", 1, 4, study, "multi_gpu.slurm", 64, train, extra),  # exit 75
        sbatch("fsdp-2n4g", "fsdp", 2, 4, study, "multi_node.slurm", 64, train, extra),  # no dir
        sbatch("fsdp-4n4g", "fsdp", 4, 4, study, "multi_node.slurm", 64, train, extra),  # never
        sbatch("fsdp-8n4g", "fsdp", 8, 4, study, "multi_node.slurm", 64, train, extra),  # never
    ]
    assert commands(proc.stdout) == expected
    out = proc.stdout
    assert "# ddp-1n4g: done (ddp-1n4g-5010); not run again" in out
    assert "# ddp-8n4g: job 5006 is still in squeue; not run again" in out
    assert "# ddp-4n4g: partial: 2/3 epochs done" in out
    assert "# skip dp-2n4g: DataParallel (dp) is one process on one node" in out
    assert sbatch_calls(fakebin) == []  # a dry run submits nothing

    proc = rb("--resume", "--study-dir", study, fakebin=fakebin)
    assert proc.returncode == 0, proc.stderr
    assert [shlex.join(["sbatch", *c["argv"]]) for c in sbatch_calls(fakebin)] == expected
    runs = {r["name"]: r for r in json.loads((study / "study.json").read_text())["runs"]}
    assert [a["job_id"] for a in runs["fsdp-1n1g"]["attempts"]] == ["5101", "7002"]
    assert [a["job_id"] for a in runs["ddp-1n1g"]["attempts"]] == ["5001"]


def test_resume_needs_no_torch(tmp_path, fakebin):
    """--resume reads study.json and the runs' statuses through collect_results.py, which
    imports no torch: it works on a login node without the training's environment."""
    study = tmp_path / "study"
    shutil.copytree(FIXTURE_STUDY, study)
    proc = rb("--resume", "--dry-run", "--study-dir", study, fakebin=fakebin, no_torch=True)
    assert proc.returncode == 0, proc.stderr
    assert "# ddp-1n4g: done (ddp-1n4g-5010); not run again" in proc.stdout
    assert "# ddp-4n4g: partial: 2/3 epochs done" in proc.stdout


def test_resume_keeps_the_studys_settings(tmp_path, fakebin):
    study = tmp_path / "study"
    shutil.copytree(FIXTURE_STUDY, study)
    proc = rb("--resume", "--dry-run", "--study-dir", study, "--", "--epochs", "5",
              fakebin=fakebin)
    assert proc.returncode == 2
    assert ("this study was made with the training arguments after -- --data-dir "
            "/data/tiny-imagenet-200 --epochs 3, not --epochs 5") in proc.stderr
    proc = rb("--resume", "--dry-run", "--local", "--study-dir", study, fakebin=fakebin)
    assert proc.returncode == 2 and "is a slurm study; resume it without --local" in proc.stderr


# --------------------------------------------------------------------------------------------
# A real local study on this machine (CPU: gloo processes), collected into tables and plots
# --------------------------------------------------------------------------------------------

def test_local_study_runs_every_configuration(local_study):
    study, proc = local_study
    assert "4 of 4 runs ok" in proc.stdout
    manifest = json.loads((study / "study.json").read_text())
    assert manifest["mode"] == "local"
    runs = {r["name"]: r for r in manifest["runs"]}
    assert list(runs) == ["ddp-1n1g", "ddp-1n2g", "fsdp-1n1g", "fsdp-1n2g"]
    for name, entry in runs.items():
        (attempt,) = entry["attempts"]
        assert attempt["exit_code"] == 0, name
        run_dir = Path(attempt["run_dir"])
        assert run_dir.parent == study and run_dir.name.startswith(name + "-")
        assert (run_dir / "train.log").is_file() and (run_dir / "job.env").is_file()
        assert Path(attempt["output"]).is_file()  # the console output, like Slurm's .out
    assert runs["fsdp-1n2g"]["command"].startswith(
        f"STRATEGY=fsdp RUNS_DIR={study} JOB_NAME=fsdp-1n2g PYTHON=")
    assert runs["fsdp-1n2g"]["command"].endswith(
        f"launch/local.sh --nproc-per-node 2 -- --batch-size 16 {shlex.join(TINY)}")


def test_local_study_collected(local_study, tmp_path):
    study, _ = local_study
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, str(REPO / "collect_results.py"), str(study),
                           "--plot", "--out", str(out)], capture_output=True, text=True,
                          env=env_for_tests(), cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr
    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4  # a row per run
    by = {(r["strategy"], int(r["world_size"])): r for r in rows}
    assert set(by) == {("ddp", 1), ("ddp", 2), ("fsdp", 1), ("fsdp", 2)}
    for (strategy, world), r in by.items():
        assert r["status"] == "ok" and r["scaling"] == "weak"
        assert (r["device"], r["per_gpu_batch"], r["global_batch"]) == (
            "cpu", "16", str(16 * world))
        assert (r["epoch"], r["epochs"], r["bad_metric_lines"]) == ("2", "2", "0")
        assert r["gpu0"] == "n/a (no GPU log)" and float(r["cpu_peak_rss_mib"]) > 0
        base = by[(strategy, 1)]
        scaling = float(r["throughput_img_s"]) / float(base["throughput_img_s"])
        assert float(r["throughput_scaling"]) == pytest.approx(scaling, abs=5e-5)
        assert float(r["parallel_efficiency"]) == pytest.approx(scaling / world, abs=5e-5)
        assert r["baseline"] == base["run"]
    md = (out / "results.md").read_text()
    for title in ("## DistributedDataParallel (ddp): weak scaling, 16 images per GPU per step",
                  "## FSDP (fsdp): weak scaling, 16 images per GPU per step"):
        assert title in md
    assert md.count("### Multi-GPU Scaling (1 Node)") == 2
    assert md.count("| 2 GPUs, 1 Node | ") == 2
    assert md.count("No multi-node runs in this study.") == 2
    for name in plots.PLOTS:
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 15_000, name
    timelines = sorted(f"timeline-{r['run']}.png" for r in rows)  # one per run, memory over time
    for name in timelines:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC, name
    assert sorted(p.name for p in out.glob("*.png")) == sorted([*plots.PLOTS, *timelines])


def test_a_study_on_a_file_system_without_locks_goes_on_without_one(tmp_path, monkeypatch,
                                                                    capsys):
    """Lustre mounted without flock (ENOSYS), NFS without its lock daemon (ENOLCK): every
    flock error read as 'in use by another run_benchmarks.py', refusing every study there."""
    import errno
    import fcntl
    spec = importlib.util.spec_from_file_location("run_benchmarks_lock", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # (its dataclasses look it up)
    spec.loader.exec_module(module)

    def no_locks(*_):
        raise OSError(errno.ENOSYS, "Function not implemented")
    monkeypatch.setattr(fcntl, "flock", no_locks)
    assert module.hold_study(tmp_path) is None
    assert capsys.readouterr().out == (f"note: no lock on {tmp_path / module.LOCK} (Function not "
                                       f"implemented): nothing stops a second run_benchmarks.py "
                                       f"on this study while this one runs\n")
    assert module.hold_study(tmp_path, dry_run=True) is None and capsys.readouterr().out == ""


def test_local_resume_reruns_only_the_failed_run(local_study, tmp_path):
    study = tmp_path / "study"
    shutil.copytree(local_study[0], study, symlinks=True)
    manifest = json.loads((study / "study.json").read_text())
    failed = Path(manifest["runs"][1]["attempts"][0]["run_dir"]).name  # ddp-1n2g's run
    env_file = study / failed / "job.env"
    env_file.write_text(env_file.read_text().replace("EXIT_CODE=0", "EXIT_CODE=1"))
    extra = {"LOG_INTERVAL": "0.5", "CUDA_VISIBLE_DEVICES": ""}

    dry = rb("--resume", "--local", "--dry-run", "--study-dir", study, env=extra)
    assert dry.returncode == 0, dry.stderr
    (command,) = commands(dry.stdout)
    assert "JOB_NAME=ddp-1n2g" in command and "--nproc-per-node 2" in command
    assert "# ddp-1n2g: failed: exit code 1" in dry.stdout
    assert "# ddp-1n1g: done" in dry.stdout and "# fsdp-1n2g: done" in dry.stdout

    # While the resumed study runs, a second --resume would read its run as killed and start
    # it again beside it: the study is refused as in use.
    running = subprocess.Popen([sys.executable, str(SCRIPT), "--resume", "--local",
                                "--study-dir", str(study)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env_for_tests(extra),
                               cwd=REPO)
    try:
        lock, deadline = study / ".run_benchmarks.lock", time.monotonic() + 120
        while f"pid {running.pid} " not in lock.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)  # until it holds the study
        again = rb("--resume", "--local", "--study-dir", study, env=extra)
        look = rb("--resume", "--local", "--dry-run", "--study-dir", study, env=extra)
        out, err = running.communicate(timeout=600)
    finally:
        running.kill()
    assert again.returncode == 2 and again.stdout == "", again.stdout
    assert again.stderr.startswith(f"error: {study} is in use by launch/run_benchmarks.py "
                                   f"(pid {running.pid} on ")
    assert again.stderr.endswith("which is still running it; wait for it to end, or stop it "
                                 "(Ctrl-C in its terminal), then --resume\n")
    # a dry run only prints: it says so, and takes no lock
    assert look.returncode == 0 and look.stdout.startswith(
        f"note: {study} is in use by launch/run_benchmarks.py (pid {running.pid} on "), look
    assert running.returncode == 0, out[-2000:] + err[-2000:]
    assert "1 of 1 runs ok" in out
    entry = json.loads((study / "study.json").read_text())["runs"][1]
    assert len(entry["attempts"]) == 2 and entry["attempts"][1]["exit_code"] == 0
    rows = {r["run"]: r for r in collect_results.read_study(study)}
    scaling.scale(list(rows.values()))
    assert rows[failed]["status"] == "failed" and not rows[failed]["used_in_tables"]
    assert rows[Path(entry["attempts"][1]["run_dir"]).name]["used_in_tables"]


def test_check_args_is_argparse_of_every_script_named():
    """launch/check_args.py, which job.sh (one script) and a study (each strategy's) run before
    anything starts: 0 when every script takes the arguments, 2 with argparse's sentence naming
    the script that refuses them, 1 with one sentence for a script that is not there or is
    not a training script (analyze_memory.py was an AttributeError traceback). A script's name
    alone is found in this repository from any folder."""
    def check(argv, cwd=REPO):
        return subprocess.run([sys.executable, str(SLURM / "check_args.py"), *argv], cwd=cwd,
                              capture_output=True, text=True, timeout=300)
    with ThreadPoolExecutor(2) as pool:  # eight checks, each mostly torch's import: two at once
        ok, refused, impossible, unnamed, named, missing, elsewhere, other = pool.map(check, [
            ["ddp_train,fsdp_train.py", "--epochs", "3", "--lr-scaling", "linear"],
            ["ddp_train.py,fsdp_train", "--sharding", "full"],  # fsdp's flag, not ddp's
            ["ddp_train.py,fsdp_train", "--epochs", "0"],  # a value, not a typo
            ["ddp_train.py", "--data-cache"],
            ["ddp_train.py", "--dataset", "cifar10", "--data-cache"],
            [str(REPO / "no_such_train"), "--epochs", "3"],
            ["dp_train.py", "--epochs", "0"], ["analyze_memory.py", "x"]],
            [REPO] * 6 + [REPO / "launch", REPO])
    assert ok.returncode == 0 and ok.stderr == ""
    assert refused.returncode == 2
    assert refused.stderr.splitlines()[-1] == ("ddp_train.py: error: unrecognized arguments: "
                                               "--sharding full")
    assert impossible.returncode == 2
    assert impossible.stderr.splitlines()[-1] == ("ddp_train.py: error: --epochs must be at "
                                                  "least 1, got 0")
    # what depends on the dataset waits for the job when nothing names it here ($DATA_DIR may
    # come from the job's site.sh), and is checked when something does
    assert unnamed.returncode == 0
    assert named.returncode == 2 and "--data-cache works with TinyImageNet only" in named.stderr
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
    assert missing.stderr.splitlines() == [f"error: no training script {REPO}/no_such_train.py: "
                                           f"name one of dp_train.py, ddp_train.py, "
                                           f"fsdp_train.py, or its path"]
    assert elsewhere.returncode == 2, elsewhere.stderr  # found from launch/, and checked
    assert elsewhere.stderr.splitlines()[-1] == ("dp_train.py: error: --epochs must be at "
                                                 "least 1, got 0")
    assert other.returncode == 1 and other.stderr.splitlines() == [
        f"error: {REPO}/analyze_memory.py is not a training script (one with build_parser() and "
        f"train(), such as dp_train.py, ddp_train.py, fsdp_train.py)"]

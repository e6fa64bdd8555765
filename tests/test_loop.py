"""training/loop.py and the checkpointer it calls: the cadence is Checkpoints' own decision
(save_if_due), the checkpointer and the run's other parts are handed their section of the
flags, not the namespace, and the loop's batches end where the epoch does. In one process, no script run: a second or less."""

from __future__ import annotations

import argparse

import pytest
import torch

from training import checkpoint, flags, loop


def _checkpoints(tmp_path, every: int, folder=True) -> tuple:
    """A Checkpoints over a tiny SGD whose saves are recorded, not written: (ckpt, saves)."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    settings = checkpoint.Settings(folder=str(tmp_path) if folder else None, resume="never",
                                   every=every, keep=2, flags={"amp": "off"})
    saves = []
    ckpt = checkpoint.Checkpoints(settings, dict(optimizer=optimizer, scheduler=scheduler),
                                  lambda path, state, meta: saves.append(
                                      (path.name, meta["earlier"])),
                                  None)
    assert ckpt.resume(5) == (0, 0)
    return ckpt, saves


def test_save_if_due_saves_every_n_steps_but_the_epochs_last(tmp_path):
    """--checkpoint-every 2 over 5 steps: after steps 2 and 4; step 5 is the epoch's end,
    which end_epoch saves. The figures so far are asked for only when a save is due."""
    ckpt, saves = _checkpoints(tmp_path, every=2)
    asked = []

    def so_far():
        asked.append(True)
        return {"train_sums": [0.0, 0.0, 0.0]}
    saved = [ckpt.save_if_due(0, done, stopping=False, so_far=so_far) for done in range(1, 6)]
    assert saved == [False, True, False, True, False]
    assert [name for name, _ in saves] == ["ckpt-e0000-s0000002", "ckpt-e0000-s0000004"]
    assert len(asked) == 2 and saves[0][1] == {"train_sums": [0.0, 0.0, 0.0]}


def test_save_if_due_saves_at_once_before_a_stop_and_never_without_a_folder(tmp_path):
    ckpt, saves = _checkpoints(tmp_path, every=0)
    assert not ckpt.save_if_due(0, 3)  # no --checkpoint-every: the epochs' ends only
    assert ckpt.save_if_due(0, 3, stopping=True)
    assert [name for name, _ in saves] == ["ckpt-e0000-s0000003"]
    ckpt, saves = _checkpoints(tmp_path, every=1, folder=False)

    def never():
        raise AssertionError("a run without --checkpoint-dir computed the figures of a save")
    assert not ckpt.save_if_due(0, 1, stopping=True, so_far=never)
    assert saves == [] and not ckpt.enabled


def test_the_checkpointer_gets_its_section_not_the_flags_namespace():
    """Settings.of takes what checkpoints use, as plain values: a change to the namespace
    afterwards does not reach the flags written into a checkpoint."""
    args = argparse.Namespace(checkpoint_dir="ck", resume="auto", checkpoint_every=None,
                              keep_checkpoints=3, amp="bf16")
    settings = checkpoint.Settings.of(args)
    assert (settings.folder, settings.resume, settings.every, settings.keep) == \
        ("ck", "auto", 0, 3)
    args.amp = "fp16"
    assert settings.flags["amp"] == "bf16"
    with pytest.raises(AttributeError):  # frozen: no part of the run changes it
        settings.every = 5


def _bare_run(steps: int, start_step: int, compiled_graphs: bool = False) -> loop.Run:
    """A Run with only the bookkeeping's parts that batches() uses, without a process group."""
    run = loop.Run.__new__(loop.Run)
    run.device, run.devices, run.steps, run.epoch, run.start_step = \
        torch.device("cpu"), [torch.device("cpu")], steps, 0, start_step
    run.compiled_graphs, run.epochs_begun = compiled_graphs, 0
    run.rank_clock = type("Clock", (), {"start_epoch": lambda self: None})()
    run.meter = type("Meter", (), {"epoch": lambda self, b, epoch, start: b})()
    run.profiler = type("Profiler", (), {"epoch": lambda self, b, start: b})()
    return run


def test_the_loops_batches_run_from_the_resumed_step_to_the_epochs_end():
    """run.batches yields the steps start_step .. steps-1 (a resumed epoch's rest, cut at
    --max-steps-per-epoch), numbered as the epoch counts them."""
    run = _bare_run(steps=4, start_step=1)
    batches = [(torch.zeros(1), torch.tensor([i])) for i in range(6)]
    steps = [(step, int(labels)) for step, (_, labels) in run.batches(batches)]
    assert steps == [(1, 0), (2, 1), (3, 2)]


def test_the_loader_is_not_asked_for_a_batch_past_the_last_step():
    """--max-steps-per-epoch 2 read three batches (with --num-workers 0, a whole batch's read
    and decode on the epoch's clock, in its data wait and throughput): the loop asked for the
    next batch before seeing that the epoch was over. The real StepMeter counts the wait."""
    from training import measure
    run = _bare_run(steps=2, start_step=0)
    run.meter = measure.StepMeter(every=0, epochs=1, steps=2, images_per_step=1)
    read = []

    def loader():
        for i in range(5):
            read.append(i)
            yield torch.zeros(1), torch.tensor([i])
    assert [step for step, _ in run.batches(loader())] == [0, 1]
    assert read == [0, 1]


def test_a_compiled_runs_peak_keeps_the_recorded_epochs_not_the_set_ups(monkeypatch):
    """--compile with CUDA graphs: from the second epoch a process runs on, the peak keeps the
    epoch before as its floor; the first epoch's reset keeps nothing (what the set-up held
    before training, such as an FSDP model whole on the GPU before fully_shard)."""
    from training import measure
    kept = []
    monkeypatch.setattr(measure, "reset_peak_memory", lambda *d, replays: kept.append(replays))
    run = _bare_run(steps=2, start_step=0, compiled_graphs=True)
    for _ in range(3):
        list(run.batches([(torch.zeros(1), torch.tensor([0]))] * 2))
    assert kept == [False, True, True]


def test_the_runs_parts_get_their_values_not_the_flags_namespace():
    """loop.Settings.of takes what the run's parts use once, as plain values (a later change
    to the namespace reaches none of them), and no part is handed the namespace itself."""
    import inspect
    from training import board, measure, profiling, stragglers
    args = argparse.Namespace(log_every=30.0, profile=None, cuda_graph=False, epochs=2,
                              tensorboard="off", tensorboard_every=5.0, checkpoint_dir="ck",
                              compile=None)
    settings = loop.Settings.of(args)  # dp_train.py's and fsdp_train.py's: no --broadcast-buffers
    assert (settings.log_every, settings.profile, settings.cuda_graph,
            settings.broadcast_buffers) == (30.0, None, False, False)
    assert settings.tensorboard == board.Settings("off", 5.0, None, "ck", vars(args))
    args.log_every, args.broadcast_buffers = 0.0, True
    assert settings.log_every == 30.0 and settings.tensorboard.flags["log_every"] == 30.0
    assert loop.Settings.of(args).broadcast_buffers  # ddp_train.py's flag, when it has one
    # the --compile modes whose steps replay CUDA graphs, and only those
    graphs = {mode: loop.Settings.of(argparse.Namespace(**{**vars(args), "compile": mode}))
              .compiled_graphs for mode in (None,) + flags.COMPILE_MODES}
    assert graphs == {None: False, "default": False, "reduce-overhead": True,
                      "max-autotune-no-cudagraphs": False, "max-autotune": True}
    with pytest.raises(AttributeError):  # frozen: no part of the run changes it
        settings.tensorboard.every = 0.0
    for part in (loop.Run, measure.StepMeter, profiling.StepProfiler, board.Board,
                 stragglers.watch, stragglers.watch_ddp, board.log_dir):
        assert "args" not in inspect.signature(part).parameters, part

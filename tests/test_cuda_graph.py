"""--cuda-graph (training/cudagraph.py): where it refuses, what its wrapper does around the
capture (checked on the CPU with a stand-in for the CUDA graph), and on a GPU that a graph run
ends with the eager run's weights. Also the two other host costs of the GPU step: the fused
SGD step with fp16, and DDP's buffer broadcast at world size 1."""

from __future__ import annotations

import contextlib

import pytest
import torch

from conftest import ON_CUDA, check_ok, run_script, runs_two_at_a_time
from training import cudagraph, schedule
from training.faults import UsageError
from test_gpu_path import run_patched
from test_strategies import EQUIV

CPU = ["--model", "cnn", "--synthetic-size", "64", "--batch-size", "16", "--epochs", "1",
       "--num-workers", "0", "--amp", "off"]


# ---- refusals: one sentence, exit 2, before any training
@pytest.fixture(scope="module")
def refusals(request):
    return runs_two_at_a_time(request, "test_cuda_graph_refuses_what_it_cannot_capture",
                              lambda case: run_script(case["script"], CPU + ["--cuda-graph"] +
                                                      case["extra"], timeout=120))


@pytest.mark.parametrize("script, extra, message", [
    ("ddp_train.py", ["--device", "cpu"], "--cuda-graph captures GPU kernels, and --device cpu "
                                          "was given: drop --cuda-graph to train on the CPU"),
    ("dp_train.py", ["--device", "cpu"], "drop --cuda-graph to train on the CPU"),
    ("fsdp_train.py", [], "--cuda-graph cannot capture FSDP's step"),
    ("ddp_train.py", ["--zero1"], "drop one of --cuda-graph and --zero1"),
    ("ddp_train.py", ["--compile"], "--cuda-graph and --compile each replace the eager step"),
])
def test_cuda_graph_refuses_what_it_cannot_capture(script, extra, message, refusals, request):
    if ON_CUDA:
        pytest.skip("the CPU's refusals")
    proc = refusals[request.node.callspec.id].result()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert "[METRIC]" not in proc.stdout


# ---- the wrapper's logic, with a stand-in for the CUDA graph
class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph: the step called inside the capture context registers
    itself (its body is not run, as on a GPU), and replay() runs it into the same tensors."""
    capturing = None

    def __init__(self):
        self.replay_fn = None

    def replay(self):
        self.replay_fn()


@contextlib.contextmanager
def fake_capture(graph, stream=None, capture_error_mode="global"):
    FakeGraph.capturing = graph
    try:
        yield
    finally:
        FakeGraph.capturing = None


class FakeStream:
    def wait_stream(self, other):
        pass


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", fake_capture)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 123 * 2**20)
    monkeypatch.setattr(cudagraph, "captured_peak_mib", {})


def _model_and_step(calls: list):
    """A linear model and its step, which records each real run: (lr it used, first input)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = schedule.start_momentum(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9,
                                                     fused=True))
    out = {}

    def run(images, labels):
        optimizer.zero_grad(set_to_none=True)
        outputs = model(images)
        loss = torch.nn.functional.cross_entropy(outputs, labels)
        loss.backward()
        optimizer.step()
        lr = optimizer.param_groups[0]["lr"]
        calls.append((float(lr), float(images[0, 0]), isinstance(lr, torch.Tensor)))
        return outputs.detach(), loss.detach()

    def step(images, labels):
        graph = FakeGraph.capturing
        if graph is None:
            return run(images, labels)
        # captured: the graph's output tensors; each replay writes into them
        out["outputs"], out["loss"] = torch.zeros(len(labels), 2), torch.zeros(())

        rates = [group["lr"] for group in optimizer.param_groups]  # what the kernels read

        def replay():
            floats = [group["lr"] for group in optimizer.param_groups]
            for group, rate in zip(optimizer.param_groups, rates):
                group["lr"] = rate
            outputs, loss = run(images, labels)
            for group, rate in zip(optimizer.param_groups, floats):
                group["lr"] = rate
            out["outputs"].copy_(outputs)
            out["loss"].copy_(loss)
        graph.replay_fn = replay
        return out["outputs"], out["loss"]
    return model, optimizer, step


def test_the_captured_step_warms_up_then_replays_each_batch_at_the_schedules_rate(fake_cuda):
    calls = []
    model, optimizer, step = _model_and_step(calls)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (s + 1))
    captured = cudagraph.StepCapture(True, warmup=2).wrap(step, optimizer)
    results = []
    for i in range(5):
        images, labels = torch.full((3, 4), float(i)), torch.tensor([0, 1, 0])
        results.append(captured(images, labels))
        scheduler.step()
    # two eager steps, then the capture (nothing run) and a replay per step from step 3 on
    assert [round(lr, 6) for lr, _, _ in calls] == [0.5, 0.25, round(0.5 / 3, 6), 0.125, 0.1]
    assert [x for _, x, _ in calls] == [0.0, 1.0, 2.0, 3.0, 4.0]  # each replay saw its batch
    assert [tensor_lr for _, _, tensor_lr in calls] == [False, False, True, True, True]
    assert isinstance(optimizer.param_groups[0]["lr"], float)  # the scheduler's float again
    assert results[2][1] is results[4][1]  # the graph's own loss tensor, rewritten each replay
    # a batch the loader cut short (unreadable images) is filled with repeats of its own
    outputs, loss = captured(torch.full((2, 4), 7.0), torch.tensor([0, 1]))
    assert outputs.shape == (2, 2) and calls[-1][1] == 7.0
    assert cudagraph.captured_peak_mib == {None: 123.0}  # the captured step's peak is kept
    with pytest.raises(RuntimeError, match=r"captured for batches of 3 x \(4,\), got \(4, 4\)"):
        captured(torch.zeros(4, 4), torch.tensor([0, 1, 0, 1]))


def test_a_capture_that_fails_is_one_sentence(fake_cuda):
    model, optimizer, _ = _model_and_step([])

    def step(images, labels):
        if FakeGraph.capturing is not None:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        return images, images.sum()
    captured = cudagraph.StepCapture(True, warmup=1).wrap(step, optimizer)
    captured(torch.zeros(2, 4), torch.tensor([0, 1]))
    with pytest.raises(UsageError, match=r"^--cuda-graph: capturing the training step failed "
                                         r"\(CUDA error: operation not permitted .*\); drop "
                                         r"--cuda-graph to train eagerly$"):
        captured(torch.zeros(2, 4), torch.tensor([0, 1]))
    assert isinstance(optimizer.param_groups[0]["lr"], float)


def test_without_cuda_graph_the_step_is_untouched():
    def step(images, labels):
        return images, labels
    assert cudagraph.StepCapture(False).wrap(step, None) is step


# ---- on a GPU: a graph run ends with the eager run's weights
def _weights(script, args, path):
    check_ok(run_script(script, args + ["--save-model", str(path)]))
    return torch.load(path, weights_only=True)


@pytest.mark.cuda_ok
@pytest.mark.parametrize("script, extra, steps", [
    # DataParallel on one GPU: 3 eager steps, the capture, then 3 replayed steps
    ("dp_train.py", ["--gpus", "1"], cudagraph.WARMUP_STEPS + 3),
    # DDP needs 11 eager steps first; 14 steps of cuDNN's per-process kernel choices differ by
    # more than the 3-step runs of the other tests, hence the looser bound below
    ("ddp_train.py", [], cudagraph.DDP_WARMUP_STEPS + 3),
])
def test_a_cuda_graph_run_ends_with_the_eager_runs_weights(script, extra, steps, tmp_path):
    if not ON_CUDA:
        pytest.skip("needs a GPU: run by bench/gpu_check.py with DPT_TEST_DEVICE=cuda")
    args = EQUIV + extra + ["--epochs", "1", "--max-steps-per-epoch", str(steps)]
    eager = _weights(script, args, tmp_path / "eager.pt")
    graph = _weights(script, args + ["--cuda-graph"], tmp_path / "graph.pt")
    atol = 1e-4 if steps <= 6 else 1e-3
    for k in eager:
        torch.testing.assert_close(graph[k], eager[k], rtol=1e-3, atol=atol, msg=k)


# ---- fp16 with the fused SGD step: an overflow on step 1 leaves the momentum finite
def test_the_scripts_make_the_momentum_before_the_first_step():
    import ddp_train
    args = ddp_train.build_parser().parse_args([])
    model = torch.nn.Linear(4, 2)
    optimizer = ddp_train.build_optimizer(model, 0.1, args, torch.device("cpu"))
    buffers = [optimizer.state[p]["momentum_buffer"] for p in model.parameters()]
    assert all(torch.equal(b, torch.zeros_like(b)) for b in buffers)
    assert schedule.fused_sgd(torch.device("cuda")) and not schedule.fused_sgd(torch.device("cpu"))


def test_an_overflow_on_step_1_leaves_fused_sgds_momentum_finite_and_its_weights_foreachs():
    """Fused SGD with a GradScaler: the scaler hands the kernel the inf flag, which skips the
    overflowing step on the device (no host sync). With the momentum made as zeros before step
    1 the skipped step leaves it finite, and the next steps equal the foreach path's, whose
    scaler skips the overflowing step whole."""
    def train(fused: bool):
        torch.manual_seed(0)
        weights = torch.nn.Parameter(torch.randn(1000))
        sgd = torch.optim.SGD([weights], lr=0.1, momentum=0.9, weight_decay=5e-4, fused=fused)
        optimizer = schedule.start_momentum(sgd) if fused else sgd
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
        for i in range(4):
            optimizer.zero_grad()
            scale = float("inf") if i == 0 else 1.0 + i  # step 1 overflows
            scaler.scale((weights * weights * scale).sum()).backward()
            scaler.step(optimizer)
            scaler.update()
        return weights.detach(), optimizer.state[weights]["momentum_buffer"], scaler.get_scale()
    fused_w, fused_m, fused_scale = train(True)
    foreach_w, foreach_m, foreach_scale = train(False)
    assert torch.isfinite(fused_m).all()
    assert fused_scale == foreach_scale == 2.0**15  # one overflow halved the scale in both
    torch.testing.assert_close(fused_w, foreach_w)
    torch.testing.assert_close(fused_m, foreach_m)


# ---- DDP at world size 1: no buffer broadcast before every forward
def test_ddp_broadcasts_buffers_only_when_there_is_another_rank(tmp_path):
    for nproc in (1, 2):
        out = tmp_path / str(nproc)
        out.mkdir()
        check_ok(run_patched("record_buffer_sync", out, "ddp_train.py",
                             ["--model", "resnet18", "--synthetic-size", "32", "--batch-size",
                              "8", "--epochs", "1", "--max-steps-per-epoch", "1",
                              "--num-workers", "0", "--amp", "off"],
                             nproc=nproc))
        said = {p.read_text() for p in out.glob("buffer-sync-rank*.txt")}
        assert said == {"False" if nproc == 1 else "True"}, (nproc, said)


# ---- --gradient-as-bucket-view keeps its promise
def test_gradients_stay_bucket_views_across_steps(tmp_path):
    """With --gradient-as-bucket-view (the default) backward adds into DDP's buckets: from the
    second step on, the gradient it accumulates into is the bucket view the optimizer reads.
    Set to None by zero_grad, each backward made a new gradient that DDP then copied into its
    bucket. (On the 2-core CPU the copy saved no measurable time: 1.005x wall over 6 pairs.)"""
    check_ok(run_patched("record_grad_storage", tmp_path, "ddp_train.py",
                         CPU + ["--max-steps-per-epoch", "3"], nproc=1))
    events = [line.split() for line in (tmp_path / "grad-storage-rank0.txt").read_text()
              .splitlines()]
    steps = [(events[i][1], events[i + 1][1]) for i in range(0, len(events), 2)]
    assert [e[0] for e in events] == ["accumulated", "stepped"] * 3, events
    # DDP rebuilds its buckets after the first step; from then on backward adds into the
    # bucket view the optimizer reads (before: a new gradient each step, copied into it)
    assert [accumulated == stepped for accumulated, stepped in steps[1:]] == [True, True], steps
    assert steps[2][0] == steps[1][1], steps  # the same bucket, step after step

"""bench/kernel_time.py: a --profile trace's GPU work by kind of kernel, per step."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import pytest

from conftest import REPO

from bench import kernel_time

# names as an H200's traces of ResNet-50 hold them (eager, then --compile), shortened
NAMES = {
    "void at::native::batch_norm_collect_statistics_channels_last_kernel<at::native::Var>":
        "batch norm",
    "sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64":
        "convolution",
    "void cutlass__5x_cudnn::Kernel<cutlass_tensorop_bf16_s16816fprop_optimized_bf16>":
        "convolution",
    "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT": "matrix multiply",
    "triton_poi_fused__native_batch_norm_legit_functional_convolution_backward_12":
        "fused by torch.compile (Triton)",
    "void at::native::vectorized_elementwise_kernel<8, at::native::launch_clamp_scalar>": "ReLU",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedSgdMathFunctor>":
        "optimizer",
    "void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<BFloat16>>":
        "elementwise and copies",
    "void at::native::max_pool_backward_nhwc<c10::BFloat16, float>": "pooling",
    "cudnn::bn_fw_tr_1C11_kernel_NCHW<float, float, 1>": "batch norm",  # fp16, fp32 inputs
    "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)":
        kernel_time.COMMUNICATION,
    "some_kernel_of_another_library": "other",
}


def test_each_kernel_gets_its_kind_by_name():
    assert {name: kernel_time.kind_of(name) for name in NAMES} == NAMES


def _trace(path, events):
    path.write_text(json.dumps({"traceEvents": events}))
    return str(path)


def _kernel(name, dur, cat="kernel"):  # a complete event of the GPU
    return {"ph": "X", "cat": cat, "name": name, "ts": 0, "dur": dur}


def test_the_gpu_work_is_summed_per_kind_and_per_step(tmp_path, capsys):
    """Only the GPU's own events count (kernels, copies, sets), divided by --steps; the
    host's ops and launches do not."""
    events = [_kernel("batch_norm_transform_input", 3000), _kernel("batch_norm_backward", 3000),
              _kernel("sm90_xmma_dgrad_implicit_gemm", 2000), _kernel("Memcpy DtoD", 1000,
                                                                      "gpu_memcpy"),
              {"ph": "X", "cat": "cpu_op", "name": "aten::batch_norm", "ts": 0, "dur": 9000},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0,
               "dur": 9000}]
    path = _trace(tmp_path / "t.json", events)
    assert kernel_time.main([path, "--steps", "2", "--top", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{path}: 4.5 ms of GPU work a step over 2 step(s) (2 kernels, copies and " \
                     "sets a step)"
    assert out[2].split() == ["batch", "norm", "3.00", "66.7%"]
    assert out[3].split() == ["convolution", "1.00", "22.2%"]
    assert out[4].split() == ["memory", "copies", "0.50", "11.1%"]
    assert out[6].split()[:2] == ["1.50", "[batch"] and len(out) == 8  # --top 2
    # a gzipped trace reads the same, whatever its name says
    for name in ("t.json.gz", "gzipped.json"):
        with gzip.open(tmp_path / name, "wt") as f:
            json.dump({"traceEvents": events}, f)
        assert kernel_time.main([str(tmp_path / name), "--steps", "2"]) == 0
        assert capsys.readouterr().out.splitlines()[0].endswith(
            "4.5 ms of GPU work a step over 2 step(s) (2 kernels, copies and sets a step)")


def test_communication_is_shown_beside_the_step_not_in_it(tmp_path, capsys):
    """NCCL's kernels run on their own stream, beside the compute: listed, without a share,
    and left out of the step's GPU work; events without a usable name or duration are left
    out."""
    events = [_kernel("sm90_xmma_fprop_implicit_gemm", 3000),
              _kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 2000),
              _kernel(None, 500), _kernel("conv", float("nan")), _kernel("conv", True),
              _kernel("conv", "5")]
    assert kernel_time.main([_trace(tmp_path / "t.json", events), "--steps", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "3.0 ms of GPU work a step over 1 step(s) (2 kernels" in out[0]
    assert out[2].split() == ["convolution", "3.00", "100.0%"]
    assert out[3].split() == ["communication", "(NCCL;", "overlaps", "the", "rest)", "2.00"]


@pytest.mark.parametrize("content, why", [
    (None, "does not exist: give the profile_trace_rank0.json"),
    ("{not json", "is not a readable trace"),
    ('{"a": 1}', "is JSON but no Chrome trace (no list of traceEvents)"),
    ('{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 5}]}',
     "holds no GPU kernel with a duration: a trace taken on the CPU has none"),
    ('{"traceEvents": null}', "is JSON but no Chrome trace (no list of traceEvents)"),
    ('{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "a", "dur": 0}]}',
     "GPU kernels take no time"),
    (gzip.compress(b'{"traceEvents": []}')[:-8], "is not a readable trace (EOFError"),
    (gzip.compress(b'{"traceEvents": []}')[:12] + b"garbage" * 4, "is not a readable trace"),
])
def test_a_wrong_file_is_one_sentence_and_a_nonzero_exit(tmp_path, content, why):
    path = tmp_path / "trace.json"
    if content is not None:
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "kernel_time.py"), str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and proc.stdout == "", proc
    assert len(proc.stderr.splitlines()) == 1 and why in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr

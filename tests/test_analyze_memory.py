"""analyze_memory.py on hand-written logs shaped like real nvidia-smi and psrecord output.

Every expected number below is worked out by hand from the fixture files in
tests/fixtures/memory/, so a wrong mean, a wrong tie-break or a skipped-line bug changes it.
"""

import csv
import io
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import analyze_memory as am  # noqa: E402
from reporting import timeline  # noqa: E402
from training import contract  # noqa: E402

SCRIPT = ROOT / "analyze_memory.py"
FIX = ROOT / "tests" / "fixtures" / "memory"
RUN = FIX / "run"
N1_GPU = RUN / "gpu_memory" / "n1.csv"
N2_GPU = RUN / "gpu_memory" / "n2.csv"
N1_CPU = RUN / "cpu_memory" / "n1.txt"
N2_CPU = RUN / "cpu_memory" / "n2.txt"

# gpu_memory/n1.csv, GPU 0: 0, 15872, 15872, 17920, 17920, 18944;
# the [N/A] sample is skipped. Sum 86528 / 6 = 14421.333...; 15872 and 17920 both occur twice,
# the tie goes to the larger: 17920 (not the peak 18944, not the first-seen 15872).
# GPU 1: 0, 15360 x3, 19456 = 65536 / 5 = 13107.2; the truncated last line "..., 194" is skipped.
# gpu_memory/n2.csv, GPU 0: 513, 20480, 20480, 21504 = 62977 / 4;
# the three [Unknown Error] samples are skipped. GPU 1: 513, 20992, 21504, 21504, 20992, 22016 =
# 107521 / 6 = 17920.1666...; tie 20992/21504 -> 21504; the sample glued to a repeated header
# (logger killed and restarted with >>) is skipped.
EXPECTED_RUN_GPU_LINES = [
    "[n1 - GPU 0] Peak = 18944 MiB, Avg = 14421.33 MiB, Mode = 17920 MiB",
    "[n1 - GPU 1] Peak = 19456 MiB, Avg = 13107.20 MiB, Mode = 15360 MiB",
    "[n2 - GPU 0] Peak = 21504 MiB, Avg = 15744.25 MiB, Mode = 20480 MiB",
    "[n2 - GPU 1] Peak = 22016 MiB, Avg = 17920.17 MiB, Mode = 21504 MiB",
]
# cpu_memory/n1.txt (psrecord plain): RSS 7.871, 62.582, 1843.250, 2411.004, 2398.512 -> sum
# 6723.219 / 5 = 1344.6438; CPU 0, 19.9, 103.7, 398.2, 396.1 -> 917.9 / 5 = 183.58; the
# truncated last line is skipped.
# cpu_memory/n2.txt: RSS 7.871, 62.582, 2048.5, 2560.75 -> 4679.703 / 4 = 1169.92575; CPU 0,
# 19.9, 212.4, 396.1 -> 628.4 / 4 = 157.1.
EXPECTED_RUN_CPU_LINES = [
    "[n1 - CPU] Peak RSS = 2411.00 MiB, Avg RSS = 1344.64 MiB, Peak CPU = 398.2%, Avg CPU = 183.6%",
    "[n2 - CPU] Peak RSS = 2560.75 MiB, Avg RSS = 1169.93 MiB, Peak CPU = 396.1%, Avg CPU = 157.1%",
]


def records_and_skips(path):
    """(records, skips) of one log file: its GPU records or its CPU record, and its Counter of
    skipped lines by reason."""
    gpu, cpu, problems = am.summarize_paths([path])
    assert problems == []
    _kind, _samples, skips = am.summarize_file(path, [])
    return gpu or cpu, skips


def run_cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=60)


# --------------------------------------------------------------------------------------------
# Parsers, through the function API
# --------------------------------------------------------------------------------------------

def test_gpu_log_with_ugly_lines_exact_numbers():
    records, skips = records_and_skips(N1_GPU)
    assert [tuple(r) for r in records] == [am.GPU_KEYS] * 2
    g0, g1 = records
    assert (g0["node"], g0["gpu"], g0["name"]) == ("n1", 0, "NVIDIA H100 80GB HBM3")
    assert (g0["samples"], g0["peak_mib"], g0["avg_mib"], g0["mode_mib"]) == (6, 18944, 14421.33,
                                                                               17920)
    assert (g1["samples"], g1["peak_mib"], g1["avg_mib"], g1["mode_mib"]) == (5, 19456, 13107.2,
                                                                               15360)
    assert g0["total_mib"] == g1["total_mib"] == 81559
    assert skips == {am.SKIP_UNAVAILABLE: 1, am.SKIP_INCOMPLETE: 1}
    assert g0["skipped_lines"] == g1["skipped_lines"] == 2


def test_gpu_log_with_unavailable_values_and_glued_header():
    (g0, g1), skips = records_and_skips(N2_GPU)
    assert (g0["samples"], g0["peak_mib"], g0["avg_mib"], g0["mode_mib"]) == (4, 21504, 15744.25,
                                                                               20480)
    assert (g1["samples"], g1["peak_mib"], g1["avg_mib"], g1["mode_mib"]) == (6, 22016, 17920.17,
                                                                               21504)
    assert g0["total_mib"] == 81559
    assert skips == {am.SKIP_UNAVAILABLE: 3, am.SKIP_MALFORMED: 1}


@pytest.mark.parametrize("header, row", [
    # a query without the name, and one with name and index swapped: refused as "not an
    # nvidia-smi log" though they are one
    ("timestamp, index, memory.used [MiB], memory.total [MiB]", "{t}, {i}, {used}, 81559"),
    ("timestamp, name, index, memory.used [MiB], memory.total [MiB], utilization.gpu [%]",
     "{t}, NVIDIA H100, {i}, {used}, 81559, 50"),
    ("memory.used [MiB], index, timestamp", "{used}, {i}, {t}"),
])
def test_an_nvidia_smi_log_of_another_query_is_read_by_its_column_names(tmp_path, header, row):
    log = tmp_path / "n1.csv"
    samples = [(0, 1000), (1, 3000), (0, 2000), (1, 3000)]
    log.write_text(header + "\n" + "".join(
        row.format(t=f"2026/12/07 10:00:{5 * k:02d}.000", i=i, used=used) + "\n"
        for k, (i, used) in enumerate(samples)))
    (g0, g1), skips = records_and_skips(log)
    assert (g0["gpu"], g0["samples"], g0["peak_mib"], g0["avg_mib"]) == (0, 2, 2000, 1500.0)
    assert (g1["gpu"], g1["samples"], g1["peak_mib"], g1["avg_mib"]) == (1, 2, 3000, 3000.0)
    assert g0["total_mib"] == (81559 if "total" in header else None) and not skips
    assert g0["name"] == ("NVIDIA H100" if "name" in header else "")


def test_an_nvidia_smi_log_without_memory_used_names_the_columns_and_the_query(tmp_path):
    log = tmp_path / "n1.csv"
    log.write_text("timestamp, name, memory.total [MiB]\n2026/12/07 10:00:00.000, H100, 81559\n")
    p = run_cli(log)
    assert (p.returncode, p.stdout) == (2, "")
    assert p.stderr == (
        f"error: {log}: an nvidia-smi --format=csv log without the column(s) index, memory.used "
        f"(its header: timestamp, name, memory.total [MiB]): log as launch/node.sh does, "
        f"nvidia-smi --query-gpu=timestamp,index,name,memory.used,memory.total "
        f"--format=csv,nounits -l 5 (the columns in any order, and more may follow)\n")


def test_mode_tie_goes_to_the_larger_value():
    from collections import Counter
    assert am._mode(Counter({500: 2, 700: 2, 900: 1})) == 700
    assert am._mode(Counter({700: 2, 500: 3})) == 500


def test_psrecord_exact_numbers():
    (r1,), skips1 = records_and_skips(N1_CPU)
    assert tuple(r1) == am.CPU_KEYS
    assert (r1["node"], r1["samples"], r1["duration_s"]) == ("n1", 5, 2.0)
    assert (r1["peak_rss_mib"], r1["avg_rss_mib"]) == (2411.0, 1344.64)
    assert (r1["peak_cpu_pct"], r1["avg_cpu_pct"]) == (398.2, 183.6)
    assert skips1 == {am.SKIP_INCOMPLETE: 1}

    (r2,), skips2 = records_and_skips(N2_CPU)
    assert (r2["node"], r2["samples"], r2["duration_s"]) == ("n2", 4, 1.5)
    assert (r2["peak_rss_mib"], r2["avg_rss_mib"]) == (2560.75, 1169.93)
    assert (r2["peak_cpu_pct"], r2["avg_cpu_pct"]) == (396.1, 157.1)
    assert not skips2


def test_psrecord_logs_with_io_counts_or_as_csv_read_as_the_plain_log(tmp_path):
    """psrecord --include-io adds four I/O counts after the plain log's four columns, and
    --log-format csv writes a header of its own with the process count second: both were
    refused as "not ones its logger writes" / "not a psrecord log"."""
    (plain,), _ = records_and_skips(N1_CPU)
    rows = [line.split() for line in N1_CPU.read_text().splitlines()
            if line.strip() and not line.startswith("#") and len(line.split()) == 4]
    with_io, as_csv = tmp_path / "io" / "n1.txt", tmp_path / "csv" / "n1.csv"
    for path in (with_io, as_csv):
        path.parent.mkdir()
    with_io.write_text("# Elapsed time   CPU (%)     Real (MB)   Virtual (MB)   Read count  "
                       "Write count  Read bytes  Write bytes\n"
                       + "".join(" ".join(row) + " 1 2 4096 8192\n" for row in rows))
    as_csv.write_text("elapsed_time,nproc,cpu,mem_real,mem_virtual,read_count,write_count,"
                      "read_bytes,write_bytes\n"
                      + "".join(f"{row[0]},3,{','.join(row[1:])},1,2,4096,8192\n" for row in rows))
    for path in (with_io, as_csv):
        (record,), skips = records_and_skips(path)
        assert not skips
    # the layout is the header's: a csv line that lost its start (4 fields) is no sample, nor
    # a plain line with commas
    as_csv.write_text(as_csv.read_text() + "1.0,50.0,2000.0,9000.0\n")
    with_io.write_text(with_io.read_text() + "1.0,3,50.0,2000.0,9000.0\n")
    for path in (with_io, as_csv):
        (record,), skips = records_and_skips(path)
        assert skips == {am.SKIP_MALFORMED: 1}, path
        assert ({k: record[k] for k in ("samples", "peak_rss_mib", "avg_rss_mib", "peak_cpu_pct")}
                == {k: plain[k] for k in ("samples", "peak_rss_mib", "avg_rss_mib",
                                          "peak_cpu_pct")}), path


def test_nvidia_smi_lines_without_their_header_or_in_another_unit_name_the_query(tmp_path):
    no_header, in_gib = tmp_path / "n1.csv", tmp_path / "n2.csv"
    no_header.write_text("2026/12/07 10:00:00.000, 0, NVIDIA H100, 1000, 81559\n")
    in_gib.write_text("timestamp, index, name, memory.used [GiB], memory.total [GiB]\n"
                      "2026/12/07 10:00:00.000, 0, NVIDIA H100, 1, 80\n")
    query = ("nvidia-smi --query-gpu=timestamp,index,name,memory.used,memory.total "
             "--format=csv,nounits -l 5")
    p = run_cli(no_header)
    assert (p.returncode, p.stderr) == (2, f"error: {no_header}: nvidia-smi lines without their "
                                           f"header line (written with --format=csv,noheader?): "
                                           f"log with the header, as launch/node.sh does: {query}\n")
    p = run_cli(in_gib)
    assert (p.returncode, p.stderr) == (2, f"error: {in_gib}: its memory.used [GiB] is not in "
                                           f"MiB, the unit nvidia-smi writes and this tool reads: "
                                           f"log as launch/node.sh does, {query}\n")


def test_kind_is_detected_by_content_not_extension(tmp_path):
    gpu_as_txt = tmp_path / "whatever.txt"
    shutil.copy(N1_GPU, gpu_as_txt)
    cpu_as_csv = tmp_path / "psrecord.log"
    shutil.copy(N1_CPU, cpu_as_csv)
    assert am.read_log(gpu_as_txt)[0] == am.KIND_GPU
    assert am.read_log(cpu_as_csv)[0] == am.KIND_CPU
    assert am.read_log(N2_CPU)[0] == am.KIND_CPU
    with pytest.raises(am.LogError, match="not an nvidia-smi"):
        am.read_log(RUN / "slurm-4242.out")
    with pytest.raises(am.LogError, match="empty"):
        am.read_log(FIX / "bad" / "empty.csv")


@pytest.mark.parametrize("start", ["timestamp, index, na", "timestamp, index, name, "
                                   "memory.used [MiB], memory.total [MiB], utilization.g",
                                   "# Elapsed ti"])
def test_a_log_cut_inside_its_header_says_so(tmp_path, start):
    """A job cancelled as it started leaves a log cut inside its header line: it was called
    "not an nvidia-smi --format=csv log or a psrecord log", as if the file were another's."""
    log = tmp_path / "n1.csv"
    log.write_text(start)
    with pytest.raises(am.LogError, match=r"^cut off inside its header line, before any "
                                          r"sample: the logger was stopped as it started"):
        am.read_log(log)
    log.write_text("timestamp, index, nickname")  # not a header: another file, as before
    with pytest.raises(am.LogError, match="not an nvidia-smi"):
        am.read_log(log)


def test_summarize_paths_walks_a_run_directory_in_sorted_order():
    gpu, cpu, problems = am.summarize_paths([RUN])
    assert problems == []
    assert [am.format_gpu_line(r) for r in gpu] == EXPECTED_RUN_GPU_LINES
    assert [am.format_cpu_line(r) for r in cpu] == EXPECTED_RUN_CPU_LINES
    # The same file twice (directly and through its directory) is summarised once.
    gpu2, _, _ = am.summarize_paths([N1_GPU, RUN / "gpu_memory"])
    assert [(r["node"], r["gpu"]) for r in gpu2] == [("n1", 0), ("n1", 1), ("n2", 0), ("n2", 1)]


def test_summarize_paths_reports_bad_inputs_without_raising(tmp_path):
    notes = []
    gpu, cpu, problems = am.summarize_paths(
        [N1_GPU, tmp_path / "missing.csv", FIX / "bad" / "header_only.csv"], notes)
    assert len(gpu) == 2 and cpu == []
    assert len(problems) == 2
    assert [p["kind"] for p in problems] == [am.BAD_INPUT, am.BAD_INPUT]
    assert problems[0]["path"] == str(tmp_path / "missing.csv")
    assert "missing.csv" in problems[0]["message"] and "no such file" in problems[0]["message"]
    assert "header_only.csv" in problems[1]["message"]
    assert "no usable samples" in problems[1]["message"]
    assert len(notes) == 1 and "n1.csv" in notes[0] and "skipped 2 line(s)" in notes[0]


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

def test_cli_prints_the_workshop_line_exactly():
    # gpu_memory_log.csv, GPU 0: 0, 521, 2213, 26000, then 26532 x 15 -> sum 426714 / 19 =
    # 22458.6316 -> the line from the workshop README, character for character.
    p = run_cli(FIX / "gpu_memory_log.csv")
    assert p.returncode == 0, p.stderr
    assert p.stdout == ("[gpu_memory_log - GPU 0] Peak = 26532 MiB, Avg = 22458.63 MiB, "
                        "Mode = 26532 MiB\n")
    assert p.stderr == ""


def test_cli_run_directory_text_output():
    p = run_cli(RUN)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == EXPECTED_RUN_GPU_LINES + EXPECTED_RUN_CPU_LINES
    # One note per file with skipped lines, on stderr, naming the file and the count.
    notes = p.stderr.splitlines()
    assert len(notes) == 3 and all(n.startswith("note: ") for n in notes)
    assert any("n2.csv: skipped 4 line(s)" in n for n in notes)


def test_cli_study_prints_each_runs_lines_under_its_directory(tmp_path):
    """Two runs on the same node (a study): each run's lines come under a line naming its run
    directory, or the two n1 lines could not be told apart. One run gets no such line."""
    for run, mib in (("ddp-1n1g-1", 1000), ("fsdp-1n1g-2", 2000)):
        _gpu_log(tmp_path / run / "gpu_memory" / "n1.csv", [mib, mib])
        _cpu_log(tmp_path / run / "cpu_memory" / "n1.txt", [(0.0, 50.0, 100.0)])
    p = run_cli(tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == [
        f"== {tmp_path / 'ddp-1n1g-1'} ==",
        "[n1 - GPU 0] Peak = 1000 MiB, Avg = 1000.00 MiB, Mode = 1000 MiB",
        "[n1 - CPU] Peak RSS = 100.00 MiB, Avg RSS = 100.00 MiB, Peak CPU = 50.0%, Avg CPU = 50.0%",
        f"== {tmp_path / 'fsdp-1n1g-2'} ==",
        "[n1 - GPU 0] Peak = 2000 MiB, Avg = 2000.00 MiB, Mode = 2000 MiB",
        "[n1 - CPU] Peak RSS = 100.00 MiB, Avg RSS = 100.00 MiB, Peak CPU = 50.0%, Avg CPU = 50.0%"]
    assert not run_cli(tmp_path / "ddp-1n1g-1").stdout.startswith("==")


def test_cli_json():
    p = run_cli("--json", RUN)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert set(out) == {"gpu", "cpu", "problems"} and out["problems"] == []
    assert [tuple(r) for r in out["gpu"]] == [am.GPU_KEYS] * 4
    assert [tuple(r) for r in out["cpu"]] == [am.CPU_KEYS] * 2
    n2g1 = out["gpu"][3]
    assert (n2g1["node"], n2g1["gpu"], n2g1["samples"], n2g1["peak_mib"], n2g1["avg_mib"],
            n2g1["mode_mib"], n2g1["total_mib"]) == ("n2", 1, 6, 22016, 17920.17, 21504, 81559)
    assert out["cpu"][1]["avg_rss_mib"] == 1169.93


def test_cli_csv():
    p = run_cli("--csv", RUN)
    assert p.returncode == 0, p.stderr
    rows = list(csv.DictReader(io.StringIO(p.stdout)))
    assert tuple(rows[0]) == am.CSV_KEYS
    assert [r["kind"] for r in rows] == ["gpu"] * 4 + ["cpu"] * 2
    n1g0 = rows[0]
    assert (n1g0["node"], n1g0["gpu"], n1g0["peak_mib"], n1g0["avg_mib"], n1g0["mode_mib"]) == (
        "n1", "0", "18944", "14421.33", "17920")
    assert n1g0["peak_rss_mib"] == ""
    assert (rows[4]["node"], rows[4]["avg_rss_mib"], rows[4]["total_mib"]) == ("n1", "1344.64", "")


def test_cli_missing_path_exit_2_one_line():
    p = run_cli("runs/does-not-exist-123/")
    assert p.returncode == 2
    assert p.stdout == ""
    assert "Traceback" not in p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and "does-not-exist-123" in lines[0] and "no such file" in lines[0]


def test_cli_empty_file_names_it():
    p = run_cli(FIX / "bad" / "empty.csv")
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and "empty.csv" in lines[0] and "empty" in lines[0].split(":", 2)[2]


def test_cli_unrecognised_file_and_header_only_file():
    p = run_cli(FIX / "bad" / "notes.txt")
    assert p.returncode == 2 and "notes.txt" in p.stderr and "not an nvidia-smi" in p.stderr
    p = run_cli(FIX / "bad" / "header_only.csv")
    assert p.returncode == 2 and "header_only.csv" in p.stderr and "no usable samples" in p.stderr
    assert "Traceback" not in p.stderr


def test_cli_partial_failure_prints_good_files_and_exits_1(tmp_path):
    # A run where node 3's logger died before writing anything.
    (tmp_path / "gpu_memory").mkdir()
    shutil.copy(N1_GPU, tmp_path / "gpu_memory" / "n1.csv")
    (tmp_path / "gpu_memory" / "n3.csv").write_text("")
    p = run_cli(tmp_path)
    assert p.returncode == 1
    assert p.stdout.splitlines() == EXPECTED_RUN_GPU_LINES[:2]
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "n3.csv" in errors[0] and "empty" in errors[0]


def test_cli_directory_without_logs_is_an_error(tmp_path):
    (tmp_path / "slurm-1.out").write_text("hello\n")
    p = run_cli(tmp_path)
    assert p.returncode == 2 and p.stdout == ""
    assert "no nvidia-smi or psrecord logs found" in p.stderr and "Traceback" not in p.stderr


def test_cli_help_documents_the_statistics():
    p = run_cli("--help")
    assert p.returncode == 0
    assert "on a tie, the larger value" in p.stdout
    assert "--json" in p.stdout and "--csv" in p.stdout and "Exit status" in p.stdout


def test_import_has_no_side_effects():
    p = subprocess.run([sys.executable, "-c", "import analyze_memory"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout == "" and p.stderr == ""


def test_main_callable_in_process(capsys):
    assert am.main([str(FIX / "gpu_memory_log.csv"), "--json"]) == 0
    (rec,) = json.loads(capsys.readouterr().out)["gpu"]
    assert (rec["peak_mib"], rec["avg_mib"], rec["mode_mib"], rec["samples"]) == (26532, 22458.63,
                                                                                  26532, 19)


@pytest.mark.parametrize("argv", [[], ["--json", "--csv", "x"]])
def test_bad_command_line_exits_2(argv):
    with pytest.raises(SystemExit) as e:
        am.main(argv)
    assert e.value.code == 2


# --------------------------------------------------------------------------------------------
# Damaged files: what a node crash or a bad disk leaves behind
# --------------------------------------------------------------------------------------------

# A crash while logging: the file's size reached the disk, its last data did not, so it ends in
# zeros (NUL bytes), here after a sample cut off mid-line.
CUT_SAMPLE = b"2025/01/01 12:00:09.308, 1, NVIDIA H100 80GB HBM3, 22"
NUL_TAIL = b"\0" * 4096


def _nul_note(path, where="at the end of the file", n=4096):
    return (f"note: {path}: ignored {n} unreadable bytes (NUL) {where} (the node probably "
            f"crashed while logging)")


def _run_with_crashed_n2(tmp_path):
    (tmp_path / "gpu_memory").mkdir()
    shutil.copy(N1_GPU, tmp_path / "gpu_memory" / "n1.csv")
    n2 = tmp_path / "gpu_memory" / "n2.csv"
    n2.write_bytes(N2_GPU.read_bytes() + CUT_SAMPLE + NUL_TAIL)
    return n2


def test_cli_run_directory_node_with_nul_tail_is_summarised_with_a_note(tmp_path):
    n2 = _run_with_crashed_n2(tmp_path)
    p = run_cli(tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == EXPECTED_RUN_GPU_LINES     # n2 is not dropped
    assert "Traceback" not in p.stderr
    lines = p.stderr.splitlines()
    assert _nul_note(n2) in lines
    # The sample cut off by the crash is skipped and counted with n2's other skipped lines.
    assert any(f"{n2}: skipped 5 line(s)" in ln and "incomplete last line: 1" in ln
               for ln in lines)
    assert not [ln for ln in lines if ln.startswith("error: ")]


def test_cli_file_with_nul_tail_named_directly(tmp_path):
    n2 = _run_with_crashed_n2(tmp_path)
    p = run_cli(n2)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == EXPECTED_RUN_GPU_LINES[2:]
    assert _nul_note(n2) in p.stderr.splitlines()
    # The same figures through the function API, and the JSON output.
    (_, g1), skips = records_and_skips(n2)
    assert (g1["samples"], g1["avg_mib"]) == (6, 17920.17)
    assert skips[am.SKIP_INCOMPLETE] == 1
    assert json.loads(run_cli("--json", n2).stdout)["problems"] == []


def test_psrecord_log_with_nul_tail(tmp_path):
    (tmp_path / "cpu_memory").mkdir()
    log = tmp_path / "cpu_memory" / "n1.txt"
    log.write_bytes(N1_CPU.read_bytes() + NUL_TAIL)    # n1.txt already ends mid-line
    notes = []
    gpu, cpu, problems = am.summarize_paths([tmp_path], notes)
    assert problems == [] and gpu == []
    assert [am.format_cpu_line(r) for r in cpu] == EXPECTED_RUN_CPU_LINES[:1]
    assert f"{log}: ignored 4096 unreadable bytes (NUL) at the end of the file" in "\n".join(notes)
    p = run_cli(log)
    assert p.returncode == 0 and p.stdout.splitlines() == EXPECTED_RUN_CPU_LINES[:1]
    assert _nul_note(log) in p.stderr.splitlines()


def test_nul_bytes_inside_a_log(tmp_path):
    # A crash left 512 zeros after a cut-off sample, then the logger was restarted with >>.
    log = tmp_path / "n5.csv"
    header = b"timestamp, index, name, memory.used [MiB], memory.total [MiB]\n"
    log.write_bytes(header + b"t, 0, H100, 100, 81559\n" + b"t, 0, H100, 30" + b"\0" * 512
                    + header + b"t, 0, H100, 300, 81559\n")
    p = run_cli(log)
    assert p.returncode == 0, p.stderr
    assert p.stdout == "[n5 - GPU 0] Peak = 300 MiB, Avg = 200.00 MiB, Mode = 300 MiB\n"
    assert _nul_note(log, "inside the file", 512) in p.stderr.splitlines()
    assert "incomplete last line: 1" in p.stderr


def test_undecodable_bytes_are_noted_never_a_traceback(tmp_path):
    # Two bytes that are not UTF-8 spoil one sample (skipped as malformed); one in a GPU name
    # does not spoil its sample.
    log = tmp_path / "n6.csv"
    log.write_bytes(b"timestamp, index, name, memory.used [MiB], memory.total [MiB]\n"
                    b"t, 0, H100\xe9, 100, 81559\n"
                    b"t, 0, H100, 3\xff\xfe0, 81559\n"
                    b"t, 0, H100, 300, 81559\n")
    for args in ([log], ["--csv", log], ["--json", log]):
        p = run_cli(*args)
        assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    p = run_cli(log)
    assert p.stdout == "[n6 - GPU 0] Peak = 300 MiB, Avg = 200.00 MiB, Mode = 300 MiB\n"
    notes = p.stderr.splitlines()
    assert any(f"{log}: ignored 3 undecodable bytes (not UTF-8 text)" in n for n in notes)
    assert any(f"{log}: skipped 1 line(s) (malformed: 1)" in n for n in notes)


def test_a_byte_order_mark_before_the_header_is_read_past(tmp_path):
    """A log saved again by an editor that writes a UTF-8 BOM was "not an nvidia-smi log"."""
    for source, name in ((N1_GPU, "n1.csv"), (N1_CPU, "n1.txt")):
        marked = tmp_path / name
        marked.write_bytes(b"\xef\xbb\xbf" + source.read_bytes())
        kind, lines, skips, bad = am.read_log(marked)
        assert (kind, lines, skips, bad) == am.read_log(source)
        assert run_cli(marked).stdout == run_cli(source).stdout != ""  # both named n1


def test_log_folders_never_drop_a_file_silently(tmp_path):
    # gpu_memory/ and cpu_memory/ hold only logs: a file there without a recognised header (one
    # holding nothing but the zeros of a crash, one holding something else) is an error.
    shutil.copytree(RUN, tmp_path / "run")
    zeros = tmp_path / "run" / "gpu_memory" / "n3.csv"
    zeros.write_bytes(NUL_TAIL)
    garbage = tmp_path / "run" / "cpu_memory" / "n3.txt"
    garbage.write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR\xff\xfe")
    p = run_cli(tmp_path / "run")
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert p.stdout.splitlines() == EXPECTED_RUN_GPU_LINES + EXPECTED_RUN_CPU_LINES
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 2     # in walk order: cpu_memory/ before gpu_memory/
    assert f"{garbage}: " in errors[0] and "not an nvidia-smi" in errors[0]
    assert f"{zeros}: " in errors[1] and "only zero bytes (NUL)" in errors[1]
    # Named directly, the zero-filled file gets the same message (not "not an nvidia-smi log").
    p = run_cli(zeros)
    assert p.returncode == 2 and p.stderr.splitlines() == [errors[1]]


# --------------------------------------------------------------------------------------------
# A requeued job: <node>.restart<N> is another attempt of the same node
# --------------------------------------------------------------------------------------------

def _gpu_log(path, used):
    """An nvidia-smi log of GPU 0 with these memory.used samples."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("timestamp, index, name, memory.used [MiB], memory.total [MiB]\n" + "".join(
        f"2025/01/01 12:00:{i:02d}.000, 0, NVIDIA H100 80GB HBM3, {mib}, 81559\n"
        for i, mib in enumerate(used)))


def _cpu_log(path, samples):
    """A psrecord --log file with these (elapsed s, CPU %, RSS MiB) samples."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# Elapsed time   CPU (%)     Real (MB)   Virtual (MB)\n" + "".join(
        f"{t:12.3f} {c:12.3f} {r:12.3f} {2 * r:12.3f}\n" for t, c, r in samples))


def _requeued_run(run):
    # GPU 0, first attempt: 1000, 2000, 2000, 3000, 3000, 3000 (alone: Peak 3000, Avg 2333.33,
    # Mode 3000); restart 1: 2000, 2000, 4000, 4000, 4000 (alone: Peak 4000, Avg 3200, Mode
    # 4000). Together: 11 samples, sum 30000 -> Avg 2727.27 (not the mean of the two means,
    # 2766.67); 2000 x4, 3000 x3, 4000 x3 -> Mode 2000, neither attempt's own; Peak 4000.
    _gpu_log(run / "gpu_memory" / "n1.csv", [1000, 2000, 2000, 3000, 3000, 3000])
    _gpu_log(run / "gpu_memory" / "n1.restart1.csv", [2000, 2000, 4000, 4000, 4000])
    _gpu_log(run / "gpu_memory" / "n10.csv", [500])     # another node, named like n1's start
    # CPU, first attempt over 5 s: RSS 100, 300, CPU 50, 150; restart over 10 s: RSS 200, 600,
    # 400, CPU 100, 200, 300. Together: RSS Peak 600, Avg 1600 / 5 = 320 (not (200 + 400) / 2);
    # CPU Peak 300, Avg 800 / 5 = 160; 15 s.
    _cpu_log(run / "cpu_memory" / "n1.txt", [(0, 50, 100), (5, 150, 300)])
    _cpu_log(run / "cpu_memory" / "n1.restart1.txt",
             [(0, 100, 200), (5, 200, 600), (10, 300, 400)])


def test_a_copy_or_backup_in_a_log_folder_is_no_node(tmp_path):
    # A user's copy of n1's log, an editor's backup and a compressed one, beside the logs the
    # loggers wrote: read, the copy counted as a node of its own and the backup as n1 twice.
    run = tmp_path / "run"
    _gpu_log(run / "gpu_memory" / "n1.csv", [1000, 3000])
    _gpu_log(run / "gpu_memory" / "gn02.cluster.local.restart1.csv", [700])  # a full host name
    _gpu_log(run / "gpu_memory" / "_gpu-Ä+[3].csv", [900])  # Slurm's node names are free-form
    for copy in ("n1 (copy).csv", "n1.csv~", "n1.csv.bak"):
        shutil.copy(run / "gpu_memory" / "n1.csv", run / "gpu_memory" / copy)
    notes = []
    gpu, cpu, problems = am.summarize_paths([run], notes)
    assert problems == [] and cpu == []
    assert [(r["node"], r["samples"], r["peak_mib"]) for r in gpu] == [
        ("_gpu-Ä+[3]", 1, 900), ("gn02.cluster.local", 1, 700), ("n1", 2, 3000)]
    left_out = [n for n in notes if "left out, as a node's log is named <host>.csv" in n]
    assert [n.split(":")[0] for n in left_out] == [
        str(run / "gpu_memory" / name) for name in ("n1 (copy).csv", "n1.csv.bak", "n1.csv~")]
    # Named on the command line, a file is read whatever its name
    gpu, _, problems = am.summarize_paths([run / "gpu_memory" / "n1 (copy).csv"], [])
    assert problems == [] and [r["node"] for r in gpu] == ["n1 (copy)"]


def test_restarts_fold_into_their_node(tmp_path):
    run = tmp_path / "run"
    _requeued_run(run)
    notes = []
    gpu, cpu, problems = am.summarize_paths([run], notes)
    assert problems == []
    assert [am.format_gpu_line(r) for r in gpu] == [
        "[n1 - GPU 0] Peak = 4000 MiB, Avg = 2727.27 MiB, Mode = 2000 MiB",
        "[n10 - GPU 0] Peak = 500 MiB, Avg = 500.00 MiB, Mode = 500 MiB",
    ]
    gpu_dir = run / "gpu_memory"
    assert (gpu[0]["samples"], gpu[0]["attempts"], gpu[0]["file"]) == (
        11, 2, f"{gpu_dir / 'n1.csv'};{gpu_dir / 'n1.restart1.csv'}")
    assert (gpu[1]["samples"], gpu[1]["attempts"]) == (1, 1)
    assert [am.format_cpu_line(r) for r in cpu] == [
        "[n1 - CPU] Peak RSS = 600.00 MiB, Avg RSS = 320.00 MiB, Peak CPU = 300.0%, "
        "Avg CPU = 160.0%"]
    assert (cpu[0]["samples"], cpu[0]["attempts"], cpu[0]["duration_s"]) == (5, 2, 15.0)
    # One note per folded node, in walk order (cpu_memory/ before gpu_memory/).
    assert notes == [
        f"{run / 'cpu_memory' / 'n1'}: folded 2 attempts of a requeued job (n1.txt, "
        f"n1.restart1.txt) into one summary",
        f"{gpu_dir / 'n1'}: folded 2 attempts of a requeued job (n1.csv, n1.restart1.csv) "
        f"into one summary",
    ]


def test_cli_folds_restarts_in_attempt_order(tmp_path):
    run = tmp_path / "run"
    _gpu_log(run / "gpu_memory" / "n1.restart10.csv", [100])
    _gpu_log(run / "gpu_memory" / "n1.restart2.csv", [300, 300])
    _gpu_log(run / "gpu_memory" / "n1.csv", [200])
    p = run_cli(run)
    assert p.returncode == 0, p.stderr
    assert p.stdout == "[n1 - GPU 0] Peak = 300 MiB, Avg = 225.00 MiB, Mode = 300 MiB\n"
    assert p.stderr == (f"note: {run / 'gpu_memory' / 'n1'}: folded 3 attempts of a requeued "
                        f"job (n1.csv, n1.restart2.csv, n1.restart10.csv) into one summary\n")


def test_two_runs_with_the_same_node_name_are_not_folded(tmp_path):
    _gpu_log(tmp_path / "a" / "gpu_memory" / "n1.csv", [100])
    _gpu_log(tmp_path / "b" / "gpu_memory" / "n1.restart1.csv", [300])
    notes = []
    gpu, _, _ = am.summarize_paths([tmp_path / "a", tmp_path / "b"], notes)
    assert [(r["node"], r["peak_mib"], r["attempts"]) for r in gpu] == [("n1", 100, 1),
                                                                         ("n1", 300, 1)]
    assert notes == []


# --------------------------------------------------------------------------------------------
# "No logs" is data: a kind to branch on, not a sentence to match
# --------------------------------------------------------------------------------------------

def test_no_logs_is_a_problem_kind_not_a_sentence(tmp_path):
    (tmp_path / "slurm-1.out").write_text("hello\n")     # not in a log folder: not read
    (tmp_path / "gpu_memory").mkdir()                    # the loggers never wrote anything
    gpu, cpu, problems = am.summarize_paths([tmp_path])
    assert (gpu, cpu) == ([], [])
    assert [(p["kind"], p["path"]) for p in problems] == [(am.NO_LOGS, str(tmp_path))]
    assert problems[0]["message"].startswith(f"{tmp_path}: no nvidia-smi or psrecord logs")
    p = run_cli("--json", tmp_path)
    assert p.returncode == 2
    assert [q["kind"] for q in json.loads(p.stdout)["problems"]] == ["no_logs"]
    # A log that is there but bad is the other kind.
    (tmp_path / "gpu_memory" / "n1.csv").write_text("")
    _, _, problems = am.summarize_paths([tmp_path])
    assert [(p["kind"], p["path"]) for p in problems] == [
        (am.BAD_INPUT, str(tmp_path / "gpu_memory" / "n1.csv"))]


# --------------------------------------------------------------------------------------------
# Utilisation and the timeline (issue 18): tests/fixtures/memory/timeline_run/
# --------------------------------------------------------------------------------------------

TIMELINE_RUN = FIX / "timeline_run"
# n1.csv, n1.restart1.csv: node.sh's newer 8 columns (utilization.gpu, power.draw, clocks.sm
# after the memory columns); n2.csv: the older 5 columns. All times 2026/11/24 06:30:00 + s,
# read as UTC (the fixture `utc`): 06:30:00 UTC = 1795501800.
# n1 GPU 0: used 0, 20480, 26532, 26532, 26532 | restart: 0, 26532, 26532 -> 153140 / 8 =
# 19142.5; util 0, 97, [N/A], 12, 88 | 0, 99, 90 -> the 7 readable: 386 / 7 = 55.14 -> 55.1.
# n1 GPU 1: used 0, 20992 (power [Not Supported]: the sample counts), 26532, ([N/A] memory:
# line skipped, its util 11 too), cut-off last line skipped | 0, 26532, 26532 -> 100588 / 6 =
# 16764.67; util 0, 95, 91 | 0, 98, 92 -> 376 / 6 = 62.67 -> 62.7.
# n2 GPU 0 (no utilisation column): 0, 18000, 18000, 19000 -> 13750.00, the line of old.
EXPECTED_TIMELINE_GPU_LINES = [
    "[n1 - GPU 0] Peak = 26532 MiB, Avg = 19142.50 MiB, Mode = 26532 MiB, Util avg = 55.1%, "
    "SM clock (busy) = 1980 MHz",
    "[n1 - GPU 1] Peak = 26532 MiB, Avg = 16764.67 MiB, Mode = 26532 MiB, Util avg = 62.7%, "
    "SM clock (busy) = 1980 MHz",
    "[n2 - GPU 0] Peak = 19000 MiB, Avg = 13750.00 MiB, Mode = 18000 MiB",
]
RUN_START = 1795501800.101      # the first sample: n1.csv, GPU 0, 06:30:00.101


@pytest.fixture
def utc(monkeypatch):
    """Read nvidia-smi's local times as UTC in this process."""
    import time
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def _timeline_copy(tmp_path):
    """A writable copy of the timeline fixture run."""
    run = tmp_path / "timeline_run"
    shutil.copytree(TIMELINE_RUN, run)
    return run


def _data(ax, gid):
    """(x, y) of the one line of ax with this gid, as lists."""
    (line,) = [ln for ln in ax.get_lines() if ln.get_gid() == gid]
    return list(line.get_xdata()), list(line.get_ydata())


def _secs(*clock_times):
    """x values of 06:30:00 + these seconds, relative to the run's first sample."""
    return pytest.approx([1795501800 + t - RUN_START for t in clock_times], abs=1e-6)


def test_utilisation_average_in_the_summary_line():
    notes = []
    gpu, _cpu, problems = am.summarize_paths([TIMELINE_RUN], notes)
    assert problems == []
    assert [am.format_gpu_line(r) for r in gpu] == EXPECTED_TIMELINE_GPU_LINES
    assert [r["avg_util_pct"] for r in gpu] == [55.1, 62.7, None]
    assert [tuple(r) for r in gpu] == [am.GPU_KEYS] * 3
    assert any("n1.csv: skipped 2 line(s) ([N/A]-like value: 1, incomplete last line: 1)" in n
               for n in notes)


def test_clock_and_temperature_name_a_throttling_gpu(tmp_path):
    """node.sh's newest query adds temperature.gpu: the GPU line gives each GPU's median SM
    clock while busy (idle samples, utilisation 0, left out) and its highest temperature."""
    log = tmp_path / "n1.csv"
    header = ("timestamp, index, name, memory.used [MiB], memory.total [MiB], "
              "utilization.gpu [%], power.draw [W], clocks.current.sm [MHz], temperature.gpu\n")
    rows = ["2026/11/24 06:30:00.1, 0, H100, 0, 81559, 0, 70, 345, 35",
            "2026/11/24 06:30:00.2, 1, H100, 0, 81559, 0, 70, 345, 36",
            "2026/11/24 06:30:05.1, 0, H100, 9000, 81559, 98, 650, 1980, 62",
            "2026/11/24 06:30:05.2, 1, H100, 9000, 81559, 99, 700, 1410, 87",
            "2026/11/24 06:30:10.1, 0, H100, 9000, 81559, 97, 640, 1980, 64",
            "2026/11/24 06:30:10.2, 1, H100, 9000, 81559, 99, 700, 1395, 88"]
    log.write_text(header + "\n".join(rows) + "\n")
    gpu, _cpu, problems = am.summarize_paths([log])
    assert problems == []
    assert [(r["busy_sm_mhz"], r["max_temp_c"]) for r in gpu] == [(1980, 64), (1402.5, 88)]
    assert am.format_gpu_line(gpu[1]).endswith(
        "Util avg = 66.0%, SM clock (busy) = 1402 MHz, Temp max = 88 C")


def test_old_logs_keep_exactly_the_old_line():
    gpu, _, _ = am.summarize_paths([RUN])
    assert [r["avg_util_pct"] for r in gpu] == [None] * 4
    assert [am.format_gpu_line(r) for r in gpu] == EXPECTED_RUN_GPU_LINES


def test_unavailable_power_does_not_skip_the_memory_sample():
    kind, lines, skips, _bad = am.read_log(TIMELINE_RUN / "gpu_memory" / "n1.csv")
    assert kind == am.KIND_GPU
    gpus = am.parse_gpu_lines(lines, skips)
    assert gpus[1]["used"] == [0, 20992, 26532]
    assert gpus[1]["power_w"] == [None, None, 633.1]     # [N/A], [Not Supported]
    assert gpus[0]["util"] == [0, 97, None, 12, 88]
    assert gpus[0]["sm_mhz"] == [345, 1980, 1980, 1755, 1980]
    assert gpus[0]["stamp"][0] == "2026/11/24 06:30:00.101"
    assert skips == {am.SKIP_UNAVAILABLE: 1, am.SKIP_INCOMPLETE: 1}


def test_cli_json_and_csv_carry_the_utilisation():
    out = json.loads(run_cli("--json", TIMELINE_RUN).stdout)
    assert [r["avg_util_pct"] for r in out["gpu"]] == [55.1, 62.7, None]
    rows = list(csv.DictReader(io.StringIO(run_cli("--csv", TIMELINE_RUN).stdout)))
    assert [r["avg_util_pct"] for r in rows] == ["55.1", "62.7", "", "", ""]


def test_metric_lines_are_parsed_generically_and_each_epoch_once():
    assert contract.fields("rank0: [METRIC] epoch=2 a=b junk lr=0.1", "[METRIC]") == (
        {"epoch": "2", "a": "b", "lr": "0.1"}, ["junk"])
    assert contract.fields("Epoch [1/3] LR: 0.1", "[METRIC]") is None
    logs = timeline.find_training_logs(TIMELINE_RUN, [])
    assert logs == [TIMELINE_RUN / "train.log"]
    phases = timeline.read_phases(logs, [])       # the final line repeats epoch 3: once
    assert [(p["epoch"], p["train_start"], p["eval_start"], p["eval_end"]) for p in phases] == [
        ("1", 1795501803.0, 1795501812.0, 1795501814.0),
        ("2", 1795501814.0, 1795501819.5, 1795501820.5),
        ("3", 1795501862.0, 1795501868.0, 1795501869.5)]


def test_every_metric_reader_keeps_and_drops_the_same_lines(tmp_path):
    """contract.read_metric_line's rules, for the timeline, results.csv and the benchmarks
    alike: a line with another process's text glued in, a value of a number key that is not a
    number, and a last line cut off without its newline are not read."""
    values = dict.fromkeys(contract.METRIC_KEYS, 1.0)
    values.update(strategy="ddp", model="cnn", dataset="synthetic", device="cpu", amp="off",
                  lr_scaling="linear", peak_mem_per_gpu_mib="-", train_start_unix=1795501803.0)
    good = contract.format_metric_line(values)
    log = tmp_path / "train.log"
    log.write_text("\n".join([good, good.replace("epoch=1 ", "epoch=2 10:12:41.902 "),
                              good.replace("epoch=1 ", "epoch=x "),
                              good.replace("epoch=1 ", "epoch=4 ")]), encoding="utf-8")
    with open(log, encoding="utf-8") as f:
        read = [(n, problem is None) for n, _, _, problem in contract.metric_lines(f)]
    assert read == [(1, True), (2, False), (3, False), (4, False)]
    assert [p["epoch"] for p in timeline.read_phases([log], [])] == ["1"]
    parsed = [contract.parse_metric_line(line) for line in log.read_text().splitlines()]
    assert [m is not None for m in parsed] == [True, False, False, True]  # no file: no cut


def test_a_line_without_a_key_the_line_before_had_is_cut():
    """A line cut in a value and followed by a newline (a killed job's output, then the
    launcher's own line) was read as complete; it lacks the keys the line before it had, and
    is not read. A newer line after an older one (a run resumed with newer code) adds keys and
    is read; the lines are read generically, so an older log's line alone is complete."""
    values = dict.fromkeys(contract.METRIC_KEYS, 1.0)
    values.update(strategy="ddp", model="cnn", dataset="synthetic", device="cpu", amp="off",
                  lr_scaling="linear", peak_mem_per_gpu_mib="-")
    full = contract.format_metric_line(values)
    old = " ".join(field for field in full.split() if not field.startswith("data_wait_frac="))
    cut = full[:full.index("data_wait_frac=") + 16]
    read = [(n, problem) for n, _, _, problem in contract.metric_lines(
        line + "\n" for line in [old, full, cut, full, old])]
    assert read == [(1, None), (2, None), (3, "no train_start_unix=, which the line before "
                                                "had, nor what follows it (a line cut short?)"),
                    (4, None), (5, "no data_wait_frac=, which the line before had, nor what "
                                   "follows it (a line cut short?)")]


def test_plot_timeline_panels_and_line_data(tmp_path, utc):
    run = _timeline_copy(tmp_path)
    notes = []
    fig = am.plot_timeline(run, run / "timeline.png", notes)
    assert (run / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert fig._suptitle.get_text() == f"{run}: memory and utilisation over time"
    n1, n2 = fig.subfigs                    # one panel per node, restarts folded in
    assert [t.get_text() for t in n1.texts] == ["node n1"]
    mem, util, cpu = n1.axes
    assert [ax.get_ylabel() for ax in n1.axes] == ["GPU memory\nused (MiB)",
                                                   "GPU\nutilisation (%)", "CPU memory,\nRSS (MiB)"]
    assert cpu.get_xlabel() == ("seconds since the run's first sample "
                                "(2026-11-24 06:30:00 local time)")
    # Each attempt is its own line: nothing joins the two across the requeue's gap.
    x, y = _data(mem, "GPU 0, attempt 0")
    assert x == _secs(0.101, 5.103, 10.105, 15.107, 20.109)
    assert y == [0, 20480, 26532, 26532, 26532]
    x, y = _data(mem, "GPU 0, attempt 1")
    assert x == _secs(60.201, 65.203, 70.205) and y == [0, 26532, 26532]
    x, y = _data(util, "GPU 0, attempt 0")
    assert y == pytest.approx([0, 97, math.nan, 12, 88], nan_ok=True)    # [N/A]: a gap
    x, y = _data(util, "GPU 1, attempt 1")
    assert x == _secs(60.202, 65.204, 70.206) and y == [0, 98, 92]
    assert [ln.get_label() for ln in mem.get_lines() if ln.get_label().startswith("GPU")] == [
        "GPU 0", "GPU 1"]
    # psrecord's elapsed seconds start at the same attempt's first nvidia-smi sample.
    x, y = _data(cpu, "CPU, attempt 0")
    assert x == _secs(0.101, 5.105, 10.109, 15.113, 20.117)
    assert y == [7.871, 2411.004, 2398.512, 2402.25, 2415.75]
    x, _ = _data(cpu, "CPU, attempt 1")
    assert x == _secs(60.201, 65.205, 70.209)
    # Epoch starts (epoch 3 once, though the final [METRIC] line repeats it) and evaluations.
    starts = [ln.get_xdata()[0] for ln in mem.get_lines() if ln.get_gid() == "epoch start"]
    assert starts == _secs(3.0, 14.0, 62.0)
    spans = [(p.get_x(), p.get_x() + p.get_width()) for p in mem.patches
             if p.get_gid() == "evaluation"]
    assert [a for span in spans for a in span] == _secs(12.0, 14.0, 19.5, 20.5, 68.0, 69.5)
    # Node n2's log has no utilisation column: no empty axis, a note in its title instead.
    assert [ax.get_ylabel() for ax in n2.axes] == ["GPU memory\nused (MiB)",
                                                   "CPU memory,\nRSS (MiB)"]
    assert "no utilisation in the GPU logs" in n2.texts[0].get_text()
    x, y = _data(n2.axes[0], "GPU 0, attempt 0")
    assert x == _secs(1.301, 6.302, 11.303, 16.304) and y == [0, 18000, 18000, 19000]
    x, _ = _data(n2.axes[1], "CPU, attempt 0")
    assert x == _secs(1.301, 6.801, 11.301)
    assert not [n for n in notes if "align" in n or "time zone" in n]


def test_plot_of_one_log_still_draws_the_whole_runs_timeline(tmp_path, utc, capsys):
    """--plot RUN/gpu_memory/n1.csv replaced the run's timeline.png (both nodes) with one of
    n1's GPU log alone; it now draws what --plot RUN draws, and says so."""
    run = _timeline_copy(tmp_path)
    assert am.main(["--plot", str(run)]) == 0
    whole = (run / "timeline.png").read_bytes()
    (run / "timeline.png").unlink()
    capsys.readouterr()
    assert am.main(["--plot", str(run / "gpu_memory" / "n1.csv")]) == 0
    assert (run / "timeline.png").read_bytes() == whole
    out, err = capsys.readouterr()
    # the statistics stay those of the log named
    assert [line.split(" - ")[0] for line in out.splitlines()] == ["[n1", "[n1",
                                                                    f"timeline: {run}/timeline.png"]
    assert (f"note: {run / 'timeline.png'} shows all of the run's logs, not only those named"
            in err.splitlines())
    assert len(err.splitlines()) == len(set(err.splitlines()))  # no note said twice
    # the whole run named, one of its logs unreadable: read once, its error said once
    (run / "gpu_memory" / "n3.csv").write_bytes(b"\0\0\0\0")
    assert am.main(["--plot", str(run)]) == 1
    err = capsys.readouterr().err
    assert "shows all of the run's logs" not in err and err.count("only zero bytes") == 1, err


def test_plot_of_damaged_logs_keeps_the_readable_samples(tmp_path, utc):
    run = _timeline_copy(tmp_path)
    restart = run / "gpu_memory" / "n1.restart1.csv"
    restart.write_bytes(restart.read_bytes() + b"2026/11/24 06:31:15.207, 0, NVIDIA H1"
                        + NUL_TAIL)
    notes = []
    mem = am.plot_timeline(run, None, notes).subfigs[0].axes[0]
    assert _data(mem, "GPU 0, attempt 1") == (_secs(60.201, 65.203, 70.205), [0, 26532, 26532])
    assert any(f"{restart}: ignored 4096 unreadable bytes (NUL)" in n for n in notes)


def test_plot_eight_gpus_one_colour_and_legend_entry_each(tmp_path, utc):
    log = tmp_path / "run" / "gpu_memory" / "n1.csv"
    log.parent.mkdir(parents=True)
    log.write_text(
        "timestamp, index, name, memory.used [MiB], memory.total [MiB], utilization.gpu [%], "
        "power.draw [W], clocks.current.sm [MHz]\n" + "".join(
            f"2026/11/24 06:30:{5 * t:02d}.000, {g}, NVIDIA H100 80GB HBM3, {1000 * g + t}, "
            f"81559, {10 * g}, [N/A], 1980\n" for t in range(3) for g in range(8)))
    fig = am.plot_timeline(tmp_path / "run")
    (panel,) = fig.subfigs
    mem, util = panel.axes
    legend = [t.get_text() for t in mem.get_legend().get_texts()]
    assert legend == [f"GPU {g}" for g in range(8)]
    colours = {tuple(ln.get_color()) for ln in mem.get_lines()}
    assert len(colours) == 8
    assert _data(util, "GPU 7, attempt 0") == (pytest.approx([0, 5, 10]), [70, 70, 70])
    assert "no CPU log" in panel.texts[0].get_text()


def test_plot_cpu_only_run_gets_a_note_not_an_empty_gpu_axis(tmp_path):
    run = tmp_path / "cpu_run"
    log = run / "cpu_memory" / "n1.txt"
    _cpu_log(log, [(0, 50, 100), (5, 150, 300), (10, 90, 350)])
    # psrecord started 3 s before the first epoch (1795501803.0 in the fixture's train.log):
    # its last sample, at 10 s, is when the file last changed
    os.utime(log, (1795501803.0 - 3 + 10, 1795501803.0 - 3 + 10))
    shutil.copy(TIMELINE_RUN / "train.log", run / "slurm-77.out")     # no train.log: searched
    notes = []
    fig = am.plot_timeline(run, None, notes)
    (panel,) = fig.subfigs
    assert "no GPU logs (CPU run)" in panel.texts[0].get_text()
    # no utilisation anywhere: the title does not promise it
    assert fig._suptitle.get_text() == f"{run}: memory over time"
    (cpu,) = panel.axes
    assert cpu.get_ylabel() == "CPU memory,\nRSS (MiB)"
    assert _data(cpu, "CPU, attempt 0") == (pytest.approx([0, 5, 10]), [100, 300, 350])
    assert [ln.get_xdata()[0] for ln in cpu.get_lines() if ln.get_gid() == "epoch start"] == \
        pytest.approx([3, 14, 62])
    assert any("n1.txt: no GPU log to align it to; its start is the file's last change" in n
               for n in notes)
    # a copy (scp -r) that did not keep the file's time: a lone line months after the epochs,
    # and collect_results said nothing; now placed by the epochs, with a note either way
    os.utime(log, (1795501803.0 + 9e6, 1795501803.0 + 9e6))
    for notes, collected in (([], False), ([], True)):
        fig = am.plot_timeline(run, None, notes, alignment_notes=not collected)
        (cpu,) = fig.subfigs[0].axes
        epochs = [ln.get_xdata()[0] for ln in cpu.get_lines() if ln.get_gid() == "epoch start"]
        times = _data(cpu, "CPU, attempt 0")[0]
        assert times[0] <= epochs[-1] <= times[-1] + 600, (times, epochs)
        assert any("n1.txt: the file's last change" in n and "is far from the training log's "
                   "epochs (copied without its file times?)" in n for n in notes), notes
    # No training log either: the same samples, no phases
    (run / "slurm-77.out").unlink()
    (cpu,) = am.plot_timeline(run, None, []).subfigs[0].axes
    assert cpu.get_xlabel().startswith("seconds since the run's first sample")
    assert not [ln for ln in cpu.get_lines() if ln.get_gid() == "epoch start"]
    assert _data(cpu, "CPU, attempt 0") == ([0, 5, 10], [100, 300, 350])


def test_a_copy_of_the_script_alone_names_what_to_copy(tmp_path):
    shutil.copy(SCRIPT, tmp_path)
    proc = subprocess.run([sys.executable, str(tmp_path / SCRIPT.name), str(RUN)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [
        "error: analyze_memory.py needs reporting/plots.py beside it: copy the folders "
        "reporting/ and training/ from the repository too, or run the repository's copy"]


def test_a_reader_that_leaves_early_still_gets_the_errors(tmp_path):
    """`analyze_memory.py ... | head`: no traceback, and the notes, errors and exit status of a
    run whose output was read."""
    args = [sys.executable, str(SCRIPT), str(tmp_path / "missing"), str(RUN)]
    whole = subprocess.run(args, capture_output=True, text=True, timeout=60)
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()     # as `| head -0` does, before the first line is written
    _, err = proc.communicate(timeout=60)
    assert "Traceback" not in err and "no such file" in err
    assert proc.returncode == whole.returncode == 1 and err == whole.stderr


def test_cli_plot_writes_one_png_per_run_and_prints_its_path(tmp_path):
    run = _timeline_copy(tmp_path)
    p = subprocess.run([sys.executable, str(SCRIPT), "--plot", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, env={**os.environ,
                                                                         "TZ": "UTC"})
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[:3] == EXPECTED_TIMELINE_GPU_LINES
    assert lines[-1] == f"timeline: {run / 'timeline.png'}"
    assert (run / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Traceback" not in p.stderr and "time zone" not in p.stderr


def test_a_path_spelled_dot_is_the_folder_it_names(tmp_path):
    """Run inside gpu_memory/: "." is that folder (Path(".").name is "", which found no log),
    and the run directory of "n2.csv" is "..", where --plot draws (not into gpu_memory/, where
    timeline.png then broke every later summary of the run)."""
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    p = run_cli(".", cwd=run / "gpu_memory")
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == EXPECTED_RUN_GPU_LINES
    p = run_cli("--plot", "n2.csv", cwd=run / "gpu_memory")
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[-1] == f"timeline: {Path('..') / 'timeline.png'}"
    assert (run / "timeline.png").is_file()
    assert sorted(os.listdir(run / "gpu_memory")) == ["n1.csv", "n2.csv"]


def test_a_run_folder_name_that_is_not_utf8_is_printed_and_drawn(tmp_path):
    """A folder named with a Latin-1 byte (caf\\xe9): the timeline's title (matplotlib refused
    its surrogate escape) and the printed path (a strict stdout refused it) ended in a
    traceback."""
    run = tmp_path / os.fsdecode(b"caf\xe9")
    shutil.copytree(TIMELINE_RUN, run)
    p = subprocess.run([sys.executable, str(SCRIPT), "--plot", str(run)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "TZ": "UTC", "PYTHONIOENCODING": "utf-8:strict"})
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[-1] == f"timeline: {tmp_path}/caf\\udce9/timeline.png"
    assert (run / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_gpu_that_never_reported_its_memory_is_named(tmp_path):
    """A unified-memory GPU (GB10) logs memory.used as [N/A] on every line: it was blamed on a
    logger that stopped at once. A GPU whose every line reads [GPU requires reset] vanished
    from a log whose other GPU has samples, without a word."""
    header = "timestamp, index, name, memory.used [MiB], memory.total [MiB]\n"
    gb10, h100 = tmp_path / "gb10.csv", tmp_path / "h100.csv"
    gb10.write_text(header + "2025/01/01 12:00:00.000, 0, NVIDIA GB10, [N/A], [N/A]\n" * 2)
    h100.write_text(header + "".join(
        f"2025/01/01 12:00:0{s}.000, 0, NVIDIA H100, {mib}, 81559\n"
        f"2025/01/01 12:00:0{s}.000, 1, NVIDIA H100, [GPU requires reset], [GPU requires reset]\n"
        for s, mib in ((0, 100), (5, 200))))
    notes = []
    gpu, _cpu, problems = am.summarize_paths([gb10, h100], notes)
    assert [(r["node"], r["gpu"]) for r in gpu] == [("h100", 0)]
    assert [p["message"] for p in problems] == [
        f"{gb10}: no usable samples: GPU 0 (NVIDIA GB10) never reported its memory: nvidia-smi "
        f"gives [N/A] for memory.used on this GPU (its memory is the CPU's: a unified-memory "
        f"GPU, such as GB10 or Jetson)"]
    assert (f"{h100}: GPU 1 (NVIDIA H100) never reported its memory: nvidia-smi wrote [GPU "
            f"requires reset] in its place; check the GPU on its node (nvidia-smi -q); it is "
            f"left out of the summary") in notes
    # [N/A] from a GPU that reports its total is no unified-memory GPU
    h100.write_text(header + "2025/01/01 12:00:00.000, 0, NVIDIA H100, [N/A], 81559\n")
    notes = []
    _gpu, _cpu, problems = am.summarize_paths([h100], notes)
    assert [p["message"] for p in problems] == [
        f"{h100}: no usable samples: GPU 0 (NVIDIA H100) never reported its memory: nvidia-smi "
        f"wrote [N/A] in its place; check the GPU on its node (nvidia-smi -q)"]


def test_cli_plot_notes_a_time_zone_mismatch(tmp_path):
    run = _timeline_copy(tmp_path)
    p = subprocess.run([sys.executable, str(SCRIPT), "--json", "--plot", str(run)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, env={**os.environ,
                                                                         "TZ": "JST-9"})
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["problems"] == []      # --json keeps stdout to itself
    assert f"timeline: {run / 'timeline.png'}" in p.stderr.splitlines()
    assert "rerun with TZ set to the cluster's" in p.stderr


def test_cli_plot_bad_inputs_one_sentence_no_traceback(tmp_path):
    p = run_cli("--plot", "runs/does-not-exist-123/")
    assert p.returncode == 2 and p.stdout == "" and "Traceback" not in p.stderr
    (line,) = p.stderr.splitlines()
    assert "does-not-exist-123" in line and "check the path" in line
    # A log file outside a run directory: summarised, but no timeline, and why; exit 2 like
    # every other bad command line (was 1)
    p = run_cli("--plot", FIX / "gpu_memory_log.csv")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stdout.startswith("[gpu_memory_log - GPU 0]")
    (line,) = p.stderr.splitlines()
    assert "no timeline; for --plot pass the run directory" in line
    # A run directory where the picture cannot be written.
    run = _timeline_copy(tmp_path)
    (run / "timeline.png").mkdir()
    p = run_cli("--plot", run)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "cannot write the timeline" in errors[0]
    # (a folder in its place: "make the run directory writable" was the wrong fix)
    assert errors[0].endswith(f"it is a folder: move it away (mv {run / 'timeline.png'} ...)")
    (run / "timeline.png").rmdir()
    run.chmod(0o500)
    try:
        p = run_cli("--plot", run)
    finally:
        run.chmod(0o700)
    if os.geteuid() != 0:  # root writes anyway
        assert p.returncode == 1 and "make the run directory writable" in p.stderr


def test_summary_without_plot_does_not_import_matplotlib():
    code = ("import sys, analyze_memory as am; am.main([sys.argv[1]]); "
            "assert 'matplotlib' not in sys.modules")
    p = subprocess.run([sys.executable, "-c", code, str(TIMELINE_RUN)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr


def test_impossible_samples_are_skipped_and_named(tmp_path):
    """Util 500% and 999,999,999 MiB used of a 40,960 MiB GPU were averaged in without a note;
    they are damaged lines that still parse, and count as skipped."""
    log = tmp_path / "n1.csv"
    log.write_text(
        "timestamp, index, name, memory.used [MiB], memory.total [MiB], utilization.gpu [%]\n"
        "2026/11/24 06:30:00.101, 0, NVIDIA A100-PCIE-40GB, 1000, 40960, 50\n"
        "2026/11/24 06:30:01.101, 0, NVIDIA A100-PCIE-40GB, 2000, 40960, 500\n"
        "2026/11/24 06:30:02.101, 0, NVIDIA A100-PCIE-40GB, 999999999, 40960, 60\n"
        "2026/11/24 06:30:03.101, 0, NVIDIA A100-PCIE-40GB, 3000, 40960, 70\n")
    (g0,), skips = records_and_skips(log)
    assert skips == {am.SKIP_IMPOSSIBLE: 2}
    assert (g0["samples"], g0["peak_mib"], g0["avg_util_pct"]) == (2, 3000, 60.0)
    notes = []
    am.summarize_file(log, notes)
    assert notes == [f"{log}: skipped 2 line(s) (impossible value: 2); the statistics use the "
                     f"remaining samples"]


def _strict_json(text):
    """text as JSON, refusing NaN and Infinity (Python's json reads them; JSON has none)."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_nan_infinite_and_negative_values_are_impossible(tmp_path):
    """psrecord lines with nan, inf, 1e400 or a negative number were averaged in ("Peak RSS =
    inf MB, Avg RSS = nan MB", and --json wrote NaN and Infinity, which is not JSON); they are
    damaged lines, skipped and counted. On the nvidia-smi side a nan or inf optional value is
    unavailable, and a negative one impossible like a negative utilization."""
    header = "# Elapsed time   CPU (%)     Real (MB)   Virtual (MB)\n"
    damaged = tmp_path / "nan.txt"
    damaged.write_text(header + "0.0 nan 100.0 200.0\n5.0 50.0 nan 200.0\n10.0 inf 1e400 200\n")
    log = tmp_path / "n1.txt"
    log.write_text(header + "0.0 10.0 100.0 200.0\n5.0 30.0 300.0 200.0\n-10.0 -20.0 -2 -5\n")
    (cpu,), skips = records_and_skips(log)
    assert skips == {am.SKIP_IMPOSSIBLE: 1}
    assert (cpu["samples"], cpu["peak_rss_mib"], cpu["avg_rss_mib"], cpu["avg_cpu_pct"]) == (
        2, 300.0, 200.0, 20.0)
    p = run_cli("--json", damaged, log)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    out = _strict_json(p.stdout)
    assert [r["file"] for r in out["cpu"]] == [str(log)]
    (problem,) = out["problems"]
    assert problem["message"] == (  # no "the logger probably stopped": it wrote 3 lines
        f"{damaged}: no usable samples (skipped 3 line(s) (impossible value: 3)): the log holds "
        f"lines, but not ones its logger writes; check that the file is that logger's own, whole")
    gpu_log = tmp_path / "n1.csv"
    gpu_log.write_text(
        "timestamp, index, name, memory.used [MiB], memory.total [MiB], utilization.gpu [%], "
        "power.draw [W], clocks.current.sm [MHz], temperature.gpu\n"
        "2026/11/24 06:30:00.1, 0, H100, 100, 81559, nan, inf, 1e400, nan\n"
        "2026/11/24 06:30:05.1, 0, H100, 300, 81559, 90, 400, 1980, 60\n"
        "2026/11/24 06:30:10.1, 0, H100, 200, 81559, 80, 400, -1980, -60\n"
        "2026/11/24 06:30:15.1, 0, H100, nan, 81559, 80, 400, 1980, 60\n")
    (gpu,), skips = records_and_skips(gpu_log)
    assert skips == {am.SKIP_IMPOSSIBLE: 1, am.SKIP_MALFORMED: 1}
    assert (gpu["samples"], gpu["avg_util_pct"], gpu["busy_sm_mhz"], gpu["max_temp_c"]) == (
        2, 90.0, 1980, 60)
    _strict_json(run_cli("--json", gpu_log).stdout)


def test_memory_no_machine_has_is_impossible_not_an_overflow(tmp_path):
    """Two psrecord lines of 1e308 MB made the average overflow (OverflowError traceback), and
    one was printed as a 309-digit RSS; a 400-digit memory.used made the GPU average a float
    division that overflowed. More than a pebibyte is a damaged line: skipped and counted."""
    header = "# Elapsed time   CPU (%)     Real (MB)   Virtual (MB)\n"
    log = tmp_path / "n1.txt"
    log.write_text(header + "0.0 10.0 100.0 200.0\n1.0 10.0 1e308 1\n2.0 10.0 1e308 1\n"
                   "3.0 30.0 300.0 200.0\n4.0 1e308 100 1\n5.0 1e308 100 1\n")
    (cpu,), skips = records_and_skips(log)
    assert skips == {am.SKIP_IMPOSSIBLE: 4}  # the CPU % column overflowed the same way
    assert (cpu["peak_rss_mib"], cpu["avg_rss_mib"]) == (300.0, 200.0)
    huge = "9" * 400
    gpu_log = tmp_path / "n1.csv"
    gpu_log.write_text(
        "timestamp, index, name, memory.used [MiB], memory.total [MiB]\n"
        "2026/11/24 06:30:00.1, 0, H100, 100, 81559\n"
        f"2026/11/24 06:30:05.1, 0, H100, {huge}, {huge}\n"
        "2026/11/24 06:30:10.1, 0, H100, 300, 81559\n")
    (gpu,), skips = records_and_skips(gpu_log)
    assert skips == {am.SKIP_IMPOSSIBLE: 1}
    assert (gpu["samples"], gpu["peak_mib"], gpu["total_mib"]) == (2, 300, 81559)
    p = run_cli(log, gpu_log)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr


def test_values_with_units_read_like_nounits(tmp_path):
    """nvidia-smi --format=csv without nounits writes the same header but "100 MiB", "50 %",
    "70.00 W": every line was skipped as malformed and the file refused with "no usable samples
    ... the logger probably stopped right after it started"."""
    header = ("timestamp, index, name, memory.used [MiB], memory.total [MiB], "
              "utilization.gpu [%], power.draw [W], clocks.current.sm [MHz], temperature.gpu\n")
    rows = ["2026/11/24 06:30:00.101, 0, NVIDIA A100, 100{MiB}, 1000{MiB}, 50{%}, 70.00{W}, "
            "1410{MHz}, 40",
            "2026/11/24 06:30:05.101, 0, NVIDIA A100, 300{MiB}, 1000{MiB}, [N/A], [N/A], "
            "1410{MHz}, 45",
            "2026/11/24 06:30:10.101, 0, NVIDIA A100, 300{MiB}, 1000{MiB}, 70{%}, [N/A], "
            "1380{MHz}, 44"]
    units = {"MiB": " MiB", "%": " %", "W": " W", "MHz": " MHz"}
    with_units, nounits = tmp_path / "units.csv", tmp_path / "nounits.csv"
    with_units.write_text(header + "".join(r.format_map(units) + "\n" for r in rows))
    nounits.write_text(header + "".join(r.format_map(dict.fromkeys(units, "")) + "\n"
                                        for r in rows))
    (g0,), skips = records_and_skips(with_units)
    assert skips == {}
    assert (g0["samples"], g0["peak_mib"], g0["total_mib"], g0["avg_util_pct"],
            g0["busy_sm_mhz"], g0["max_temp_c"]) == (3, 300, 1000, 60.0, 1410, 45)
    (same,), _ = records_and_skips(nounits)
    assert {**g0, "node": "", "file": ""} == {**same, "node": "", "file": ""}
    p = run_cli(with_units)
    assert p.returncode == 0 and p.stderr == ""
    assert p.stdout.startswith("[units - GPU 0] Peak = 300 MiB, Avg = 233.33 MiB")


def _day_first(path):
    """Rewrite a GPU log's timestamps as 24-11-2026 06:30:01.301, which nvidia-smi never
    writes (its own: 2026/11/24 06:30:01.301)."""
    text = path.read_text()
    path.write_text(text.replace("2026/11/24", "24-11-2026"))


def test_plot_leaves_out_gpu_logs_without_readable_timestamps(tmp_path, utc):
    """A GPU log whose timestamps do not read crashed --plot with "Number of rows must be a
    positive integer, not 0" (a node with nothing to draw), even when only one node of several
    was like that. The other nodes are drawn, a note names each file left out, and a run with
    nothing to draw is one error after its summary, exit 1 as for a timeline not written."""
    run = _timeline_copy(tmp_path)
    _day_first(run / "gpu_memory" / "n2.csv")          # n2 keeps its CPU log
    n3 = run / "gpu_memory" / "n3.csv"                  # a node with only a GPU log
    shutil.copy(run / "gpu_memory" / "n2.csv", n3)
    restart = run / "gpu_memory" / "n1.restart1.csv"    # one sample of six
    restart.write_text(restart.read_text().replace("2026/11/24 06:31:10.206", "06:31:10.206"))
    notes = []
    fig = am.plot_timeline(run, None, notes)
    n1, n2 = fig.subfigs
    assert [t.get_text() for t in n2.texts] == [
        "node n2; no GPU sample with a readable timestamp"]
    assert [ax.get_ylabel() for ax in n2.axes] == ["CPU memory,\nRSS (MiB)"]
    assert _data(n1.axes[0], "GPU 1, attempt 1")[1] == [0, 26532]
    for log, which in ((run / "gpu_memory" / "n2.csv", "all 4"), (n3, "all 4"),
                       (restart, "1 of 6")):
        assert f"{log}: {which} samples left out of the timeline: their timestamps do not read " \
               f"like nvidia-smi's 2026/11/24 06:30:01.123 (the first: " in "\n".join(notes)
    # Nothing to draw: the summary, a note, one error naming the run, exit 1
    run2 = tmp_path / "run2"
    (run2 / "gpu_memory").mkdir(parents=True)
    shutil.copy(n3, run2 / "gpu_memory" / "n1.csv")
    p = run_cli("--plot", run2)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert p.stdout.startswith("[n1 - GPU 0] Peak = 19000 MiB")
    note, error = p.stderr.splitlines()
    assert note.startswith(f"note: {run2 / 'gpu_memory' / 'n1.csv'}: all 4 samples left out")
    assert error.startswith(f"error: {run2}: no timeline drawn: no timestamp of its nvidia-smi "
                            f"logs reads like nvidia-smi's own (2026/11/24 06:30:01.123)")
    assert not (run2 / "timeline.png").exists()

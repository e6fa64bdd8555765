"""The GPU acceptance run's report (bench/gpu_check.py): one markdown table of its rows, the
notes each row left, and the targets met or missed with their figures; and the console line
of each row as it ends."""

from __future__ import annotations

from bench.gpu_plan import CEILING, FSDP, GRAPH, RAW_GRAPH, WINDOW, compiled_label, row_key
from training import flags


def targets(results: list) -> list:
    """Issue 39's and 48's targets where their rows ran: (what, met, the figures); met is
    None where a target's row is in the results without a figure (failed, not started)."""
    def rows(label, batch, image=64):
        return [r for r in results if r.get("label") == label and r.get("batch") == batch
                and r.get("image") == image]

    def rate(label, batch, image=64):
        found = [r["img_s"] for r in rows(label, batch, image) if "img_s" in r]
        return found[0] if found else None

    checks = []
    graph_256, eager_1024 = rate(GRAPH, 256), rate(CEILING, 1024)
    best_1024 = max(filter(None, (eager_1024, rate(GRAPH, 1024))), default=None)
    if graph_256:
        checks.append(("64 px, batch 256, --cuda-graph >= 35,000 img/s", graph_256 >= 35000,
                       f"{graph_256:,.0f}"))
    raw_graph = rate(RAW_GRAPH, 256)
    if graph_256 and raw_graph:
        checks.append(("64 px, batch 256, --cuda-graph >= 0.97x the raw whole-step graph",
                       graph_256 >= 0.97 * raw_graph,
                       f"{graph_256 / raw_graph:.2f}x: {graph_256:,.0f} against "
                       f"{raw_graph:,.0f} img/s"))
    elif rows(GRAPH, 256) or rows(RAW_GRAPH, 256):  # planned, and one of them has no figure
        missing = [label for label, figure in ((GRAPH, graph_256), (RAW_GRAPH, raw_graph))
                   if not figure]
        checks.append(("64 px, batch 256, --cuda-graph >= 0.97x the raw whole-step graph",
                       None, f"no figure from: {'; '.join(missing)}"))
    if graph_256 and best_1024:
        checks.append(("64 px, batch 256, --cuda-graph >= 0.75x the best batch-1024 rate",
                       graph_256 >= 0.75 * best_1024, f"{graph_256 / best_1024:.2f}x"))
    # the throughput targets: the fastest way the toolkit trains that size, named
    ways = [CEILING, GRAPH] + [compiled_label(mode) for mode in flags.COMPILE_MODES]
    for what, batch, image, floor in (("64 px, batch 1024 >= 50,000 img/s", 1024, 64, 50000),
                                      ("224 px, batch 256 >= 4,800 img/s (H200)", 256, 224,
                                       4800)):
        measured = {way: rate(way, batch, image) for way in ways if rate(way, batch, image)}
        if measured:
            fastest = max(measured, key=measured.get)
            checks.append((what, measured[fastest] >= floor,
                           f"{measured[fastest]:,.0f} with {way_name(fastest)}"))
    fp16, bf16 = rate("ddp fp16 (fused SGD), synthetic on device", 256), rate(CEILING, 256)
    if fp16 and bf16:
        checks.append(("fp16 >= 0.95x bf16 (batch 256)", fp16 >= 0.95 * bf16,
                       f"{fp16 / bf16:.2f}x"))
    fsdp, ddp = rate(FSDP, 256, 224), rate(CEILING, 256, 224)
    if fsdp and ddp:
        checks.append(("FSDP full at 224 px >= 0.85x DDP", fsdp >= 0.85 * ddp,
                       f"{fsdp / ddp:.2f}x"))
    at_224 = {way: rate(way, 256, 224) for way in ways if rate(way, 256, 224)}
    if set(at_224) - {CEILING, GRAPH}:  # --rows compile ran
        fastest = max(at_224, key=at_224.get)
        checks.append(("224 px, batch 256: eager, --cuda-graph and every --compile mode "
                       "measured", len(at_224) == len(ways),
                       f"{len(at_224)} of {len(ways)}; the fastest: {way_name(fastest)}, "
                       f"{at_224[fastest]:,.0f} img/s"))
    return checks


def way_name(label: str) -> str:
    """How a row trains, as its flags say it: eager, --cuda-graph, --compile MODE."""
    if label == CEILING:
        return "eager"
    return label.removeprefix("ddp ").removesuffix(", synthetic on device")


def _figure(value) -> str:
    return "n/a" if value is None else f"{value:,.1f}"


def report(results: list, head: list, gpu: bool, steps: int, tail: list) -> str:
    ceiling = {(r["batch"], r["image"]): r["img_s"] for r in results
               if r["label"] == CEILING and "img_s" in r}
    lines = head + ["", "| configuration | image | batch | amp | img/s | ms/step | launches/step "
                        "| peak memory (MiB) | predicted (MiB) | error | vs ceiling "
                        "| warm-up (s) |",
                    "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    notes = []
    for r in results:
        shows_image = r["kind"] in ("train", "raw", "held", "profile")
        where = f"| {r['label']} | {r['image'] if shows_image else ''} | {r['batch'] or ''} |"
        if "img_s" in r:
            key = (r["batch"], r["image"])
            ratio = f"{r['img_s'] / ceiling[key]:.2f}x" if key in ceiling else "n/a"
            predicted, error = "n/a", "n/a"
            if r["predicted"]:
                predicted = f"{r['predicted']:,.0f}"
                error = f"{(r['predicted'] - r['peak']) / r['peak']:+.0%}" if gpu else "n/a"
            warmup = "" if r.get("warmup_s") is None else f"{r['warmup_s']:.1f}"
            lines.append(f"{where} {r['amp']} | {r['img_s']:,.0f} | {r['step_ms']:.1f} | | "
                         f"{r['peak']:,.0f} | {predicted} | {error} | {ratio} | {warmup} |")
            if r.get("beside") and r.get("timed"):
                notes.append(f"{row_key(r['label'], r['image'], r['batch'])}: timed beside "
                             f"{len(r['beside'])} untimed row(s): {'; '.join(r['beside'])}")
        elif "profile" in r:  # --profile: the launches and the step's parts, no timing
            p = r["profile"]
            launches = "" if r["launches"] is None else f"{r['launches']:,.0f}"
            lines.append(f"{where} {r['amp']} | | {_figure(p['step_ms'])} | {launches} "
                         f"| | | | | |")
            notes.append(f"{r['label']}, {r['image']} px, batch {r['batch']}: a traced step "
                         f"of {_figure(p['step_ms'])} ms: compute "
                         f"{_figure(p['compute_ms'])}, exposed communication "
                         f"{_figure(p['exposed_comm_ms'])}, data wait "
                         f"{_figure(p['data_wait_ms'])}, other {_figure(p['other_ms'])} "
                         f"(communication in all {_figure(p['comm_ms'])}; {p['steps']:.0f} "
                         f"steps traced)")
        elif "states" in r:  # --simulate-world-size: memory only
            error = (f"{(r['predicted'] - r['peak']) / r['peak']:+.0%}"
                     if gpu and r["peak"] and r["predicted"] else "n/a")
            peak = f"{r['peak']:,.0f}" if r["peak"] else "n/a"  # on a CPU: none measured
            lines.append(f"{where} {r['amp']} | | | | {peak} | {r['predicted'] or 0:,.0f} | "
                         f"{error} | | |")
            notes.append(f"{r['label']}, {r['image']} px: held params + grads + optimizer + "
                         f"host {r['states']} MiB, predicted {r['predicted_states']}; FSDP "
                         f"units gathered at once: {r['units_in_flight']}")
        elif "skipped" in r:
            lines.append(f"{where} | {r['skipped']} | | | | | | | |")
        elif "error" in r:
            lines.append(f"{where} | FAILED: {r['error']} | | | | | | | |")
        else:
            lines.append(f"{where} | {'passed' if r.get('passed') else 'see below'} "
                         f"| | | | | | | |")
        if "text" in r:
            notes.append(f"{r['label']}: {r['text']}")
        if r.get("fatal"):  # a crashed rank's stack (PYTHONFAULTHANDLER), its first lines
            notes += [f"{r['label']}: where it crashed:"] + [f"    {line}" for line in r["fatal"]]
        if r.get("stack"):  # a row's processes at its timeout (hangs.STACKS_SIGNAL)
            notes += [f"{r['label']}: where it was at the timeout:"] + [
                f"    {line}" for line in r["stack"]]
        if r.get("recompiles_timed") is not None:
            notes.append(f"{r['label']}, {r['image']} px, batch {r['batch']}: "
                         f"{r['recompiles_timed']} recompilation(s) inside the timed epoch "
                         f"(TORCH_LOGS=recompiles)")
        if "summary" in r:
            notes += [f"{r['label']}: timeline.png {'drawn' if r['timeline'] else 'MISSING'}"]
            notes += [f"    {line}" for line in r["summary"]]
    lines += ["", f"each training row: 2 epochs, the second timed (device synchronised at both "
                  f"ends): {steps} steps an epoch where the figure is a target's, "
                  f"{min(steps, WINDOW)} elsewhere; one process" +
              (", one GPU" if gpu else " on the CPU"),
              "launches/step: the host's kernel, copy and graph launches per step, counted by "
              "--profile's trace in a row of its own (5 steps after the warm-up, and after the "
              "capture with --cuda-graph); warm-up: how much longer the first epoch took than "
              "the second (--compile: the compilation)",
              "timed rows run one after another, untimed rows (tests, profiles, memory) in "
              "other lanes beside them; each timed row's note names what ran beside it "
              "(--lanes 1: nothing)"]
    if any(r["kind"] == "raw" for r in results):
        lines.append("raw step: bench/raw_step.py, the plain PyTorch step of the same model "
                     "(no DDP, no loader, no metrics, one static batch on the device): its warm-up "
                     "steps (10 on a GPU), then the timed steps, one process")
    lines += (["error: (predicted - measured) / measured peak, measured as "
               "torch.cuda.max_memory_allocated over the second epoch"] if gpu else
              ["peak memory on the CPU is the process's peak RSS: no prediction to compare "
               "it with (error: n/a)"])
    checks = targets(results) if gpu else []
    if checks:
        verdict = {True: "met", False: "MISSED", None: "not measured"}
        lines += ["", "targets:"] + [f"- {verdict[ok]}: {what} ({figure})"
                                     for what, ok, figure in checks]
        crowded = sum(1 for r in results if r.get("timed") and r.get("beside"))
        if crowded:  # the other lanes share the GPU: a speed figure may be low for that
            lines.append(f"- judged on {crowded} timed row(s) that ran beside other rows on "
                         f"the same GPU (each row's note names them): --lanes 1 times each "
                         f"row alone")
    return "\n".join(lines + [""] + notes + tail) + "\n"


def in_one_line(result: dict) -> str:
    """What the console shows of a row as it ends: its figure, its failure or its note."""
    if "img_s" in result:
        return f"{result['img_s']:,.0f} img/s, {result['step_ms']:.1f} ms/step"
    if "states" in result:
        return (f"held {result['states']} MiB (params + grads + optimizer + host), predicted "
                f"{result['predicted_states']}")
    if "profile" in result:
        return f"{result['launches']} launches per step"
    return result.get("error") or result.get("text") or result.get("skipped") or "done"

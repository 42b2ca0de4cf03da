"""The tables of scripts/bench_spec_engine.py: each speculative configuration's row from the rounds measured so
far (`summary_table`: tau, copies, ms per committed token with and without copies, the ratios to every AR
configuration over rounds and over requests, with and without a drafting time per block), the per-request details
its json keeps (`saved_details`) and the markdown report (`markdown`)."""

from __future__ import annotations

import math

import numpy as np
from bench_common import ratio_ci

from specmoe.stats import unit_ratio

TIMELINE_PARTS = ("draft", "selection", "copy_issue", "copy_checks", "copy_wait", "idle_other", "compute", "step")


def sd_keys(source: str, per_selector: dict, budgets: list[int], paths=("device",)):
    """(selector, prefetch budget, block path, row key) of every speculative row of a source: "source/selector",
    with "+prefetchN" when several budgets are measured and "+host_blocks" for the host path's row beside the
    device path's (`EngineConfig.block_device`)."""
    for name in per_selector:
        for budget in budgets:
            key = f"{source}/{name}" + (f"+prefetch{budget}" if len(budgets) > 1 else "")
            for path in paths:
                yield name, budget, path, key + ("+host_blocks" if path == "host" and len(paths) > 1 else "")


def request_ratio(sd: dict, ar: dict, draft_ms: float = 0.0) -> dict | None:
    """SD / AR ms per token with a 95% bootstrap interval over the requests (`specmoe.stats.unit_ratio`, paired by
    request: each request's times are means over the rounds), SD's time with draft_ms of drafting per verification
    block (each request's measured blocks, `request_blocks`); None with fewer than two requests."""
    sd_ms, ar_ms = np.mean(sd["request_ms"], axis=0), np.mean(ar["request_ms"], axis=0)
    if len(sd_ms) < 2 or len(sd_ms) != len(ar_ms):
        return None
    if draft_ms:
        sd_ms = sd_ms + draft_ms * np.asarray(sd["request_blocks"], dtype=float)
    r = unit_ratio(sd_ms, sd["request_tokens"], ar_ms, ar["request_tokens"])
    return {"ratio": r.estimate, "low": r.low, "high": r.high, "units": len(sd_ms), "unit": "request"}


def drafting_per_token(sd: dict, draft_ms: float) -> float:
    """Drafting ms per committed token of draft_ms per verification block: the measured blocks / committed tokens
    (not 1 / tau)."""
    return draft_ms * sd["blocks"] / sd["committed"]


def sd_over_ar(sd_rounds: list, sd: dict, ar_rounds: list, ar: dict, draft_ms: float = 0.0) -> dict:
    """SD / AR ms per token at draft_ms of drafting per verification block (0: verification only), over rounds
    (`ratio_ci`, paired t, each round's SD ms per token plus the drafting per token) and over requests
    (`request_ratio`, a paired bootstrap; None with one request). sd and ar: a configuration's details."""
    extra = drafting_per_token(sd, draft_ms)
    return {"rounds": ratio_ci([x + extra for x in sd_rounds], ar_rounds),
            "requests": request_ratio(sd, ar, draft_ms)}


def saved_details(details: dict) -> dict:
    """Per SD and AR configuration what a later analysis needs to recompute any ratio: the per-request times of
    every measured round (`request_ms`, [round][request]), the per-request tokens and, for SD, the per-request
    verification blocks (`request_blocks`) with the totals; not the per-block times (their p50 / p99 are in the
    table)."""
    keep = ("request_ms", "request_tokens", "request_blocks", "blocks", "committed", "tau")
    return {key: {x: d[x] for x in keep if x in d} for key, d in details.items()}


def summary_table(sources: dict, rounds: dict, details: dict, ar_keys, args, equal_c: dict | None = None) -> list[dict]:
    """The report's rows from the rounds measured so far: per speculative configuration its tau, copies, ms per
    committed token (with and without copies), the host-blocks ratio, and every AR configuration's ms with the
    paired ratios (over rounds and over requests). equal_c: per source the AR capacity at the speculative engine's
    peak slot memory (C = P + U_max), recorded in each row as "equal_memory_c". Built after every round, so a run
    cut short keeps its table."""
    table = []
    drafting = {"sd0": 0.0, "sd_drafting": args.draft_ms} if args.draft_ms else {"sd0": 0.0}
    for source, (k, per_selector, _) in sources.items():
        for name, budget, path, key in sd_keys(source, per_selector, args.prefetch, args.block_paths):
            acceptance = per_selector[name][1]
            if key not in rounds:
                continue
            d, s = details[key], details.get(key + "/skip", {})
            ms, skip_ms = float(np.mean(rounds[key])), float(np.mean(rounds.get(key + "/skip", [math.nan])))
            block_ms = np.concatenate(d["block_ms"])
            row = {"source": source, "selector": name, "acceptance": acceptance, "k": k, "tau": d["tau"], "blocks": d["blocks"],
                   "copies_per_token": d["copies_per_token"], "moves_per_token": d["moves_per_token"],
                   "ms_per_token": ms, "compute_ms_per_token": skip_ms, "exposed_copy_ms_per_token": ms - skip_ms,
                   "block_ms_p50": float(np.percentile(block_ms, 50)), "block_ms_p99": float(np.percentile(block_ms, 99)),
                   "union_used": d["union_used"], "skip_copies_per_token": s.get("copies_per_token"),
                   "demand_per_token": d["demand_per_token"], "prefetch_per_token": d["prefetch_per_token"],
                   "prefetch_unused_per_token": d["prefetch_unused_per_token"], "prefetch": budget,
                   "key": key, "verify": d["verify"], "host_blocks_why": d["host_blocks_why"],
                   "equal_memory_c": (equal_c or {}).get(source)}
            if args.draft_ms:
                row["draft_ms_per_block"] = args.draft_ms
                row["ms_per_token_with_drafting"] = ms + drafting_per_token(d, args.draft_ms)
            target = rounds.get("target_step")
            if s.get("block_ms") and target and len(s["block_ms"]) == len(target):  # compute in target steps
                per_round = [float(np.mean(b)) for b in s["block_ms"]]
                row["compute_ms_per_block"] = float(np.mean(per_round))
                row["block_compute_over_target_step"] = ratio_ci(per_round, target)
            host_key = key + "+host_blocks"
            if path == "device" and rounds.get(host_key) and len(rounds[host_key]) == len(rounds[key]):
                row["ratio_host_blocks_over_device"] = ratio_ci(rounds[host_key], rounds[key])
            fastest = None
            for (policy, c) in ar_keys:
                ar = rounds.get(f"{source}/ar_{policy}_C{c}")
                if not ar or len(ar) != len(rounds[key]):
                    continue
                ar_ms = float(np.mean(ar))
                label = f"{policy}_C{c}"
                row[f"ar_{label}_ms_per_token"] = ar_ms
                row[f"ar_{label}_compute_ms_per_token"] = float(np.mean(rounds.get(f"{source}/ar_{label}/skip",
                                                                                  [math.nan])))
                row[f"ar_{label}_copies_per_token"] = details[f"{source}/ar_{label}"]["copies_per_token"]
                row[f"ar_{label}_routing"] = details[f"{source}/ar_{label}"].get("routing", "?")
                row[f"ar_{label}_schedule_floor_ms"] = details[f"{source}/ar_{label}"].get("schedule_floor_ms")
                for tag, draft_ms in drafting.items():  # SD at zero drafting cost, and with --draft-ms
                    both = sd_over_ar(rounds[key], d, ar, details[f"{source}/ar_{label}"], draft_ms)
                    row[f"ratio_{tag}_over_ar_{label}"] = both["rounds"]
                    row[f"ratio_{tag}_over_ar_{label}_over_requests"] = both["requests"]
                # break-even drafting ms per block: tau * AR ms/token - verification ms per block
                row[f"break_even_draft_ms_{label}"] = d["tau"] * ar_ms - ms * d["tau"]
                if fastest is None or ar_ms < row[f"ar_{fastest}_ms_per_token"]:
                    fastest = label
            row["fastest_ar"] = fastest
            table.append(row)
    return table


def ratio_cell(row: dict, tag: str, label: str) -> str:
    """A row's SD / AR ratio cell ("sd0": zero drafting, "sd_drafting": with --draft-ms): over requests where
    there are several, else over rounds."""
    units, rounds = row.get(f"ratio_{tag}_over_ar_{label}_over_requests"), row[f"ratio_{tag}_over_ar_{label}"]
    return (f"{units['ratio']:.3f} ({units['low']:.3f}-{units['high']:.3f}, {units['units']} requests)" if units
            else f"{rounds['ratio']:.3f} ({rounds['lo']:.3f}-{rounds['hi']:.3f}, rounds)")


def per_trace(value, show) -> str:
    """A header value of the report (`union_max`, `capacities`): shown as is with one trace, with several (a dict
    per trace label) each trace's followed by its label."""
    if isinstance(value, dict):
        return "; ".join(f"{show(v)} ({label})" for label, v in value.items())
    return show(value)


def markdown(report: dict) -> str:
    draft_ms = report["args"].get("draft_ms") or 0.0
    drafting = (f" With drafting: SD's time plus {draft_ms:g} ms (--draft-ms) per verification block measured, "
                "the same ratio and interval." if draft_ms else "")
    lines = [f"# Speculative engine vs AR ({report['date']})", "",
             f"{report['machine']['gpu']}; torch {report['machine']['torch']}. Command: `{report['command']}`. "
             f"Rounds measured: {report.get('rounds_done', 0)} of {report['args']['rounds']}. "
             f"Pool P = {report['args']['pool']}, U_max = {per_trace(report['union_max'], str)} union slots used at "
             f"most; AR at C = {per_trace(report['capacities'], lambda c: ', '.join(map(str, c)))} "
             f"({', '.join(report['args']['ar_policies'])}). Expert "
             f"copy {report['copy']['stream_ms']:.3f} ms in a stream. Ratios: SD at zero drafting cost / AR with a 95% "
             "interval, a paired bootstrap over the requests (`specmoe.stats.unit_ratio`; each request's times are "
             "means over the interleaved rounds), or a paired t over rounds where there is one request (unit: round); "
             f"an interval that holds 1 is within noise.{drafting} Acceptance: closed-loop, the selector's own run's "
             "accepted lengths; open-loop (exact's), exact verification's (optimistic for a lossy selector).", "",
             "| source | selector | acceptance | k | tau | copies/token | ms/token (SD, zero drafting) | compute-only | exposed copies | "
             "block ms p50 / p99 | fastest AR: config, ms/token (copies) | SD / fastest AR | break-even draft ms/block |"
             + (f" ms/token with drafting ({draft_ms:g} ms/block) | SD with drafting / fastest AR |" if draft_ms else ""),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if draft_ms else "")]
    for row in report["table"]:
        selector = row["selector"] + (f" (prefetch {row['prefetch']})" if row.get("prefetch") else "") + \
            (" (host blocks)" if row.get("verify") == "host" else "")
        cells = [row["source"], selector, row["acceptance"], str(row["k"]), f"{row['tau']:.2f}",
                 f"{row['copies_per_token']:.2f}",
                 f"{row['ms_per_token']:.3f}", f"{row['compute_ms_per_token']:.3f}",
                 f"{row['exposed_copy_ms_per_token']:.3f}", f"{row['block_ms_p50']:.2f} / {row['block_ms_p99']:.2f}"]
        best = row.get("fastest_ar")
        if best:
            cells += [f"{best}, {row[f'ar_{best}_ms_per_token']:.3f} ({row[f'ar_{best}_copies_per_token']:.2f})",
                      ratio_cell(row, "sd0", best), f"{row[f'break_even_draft_ms_{best}']:.2f}"]
        else:
            cells += ["-", "-", "-"]
        if draft_ms:
            cells += [f"{row['ms_per_token_with_drafting']:.3f}", ratio_cell(row, "sd_drafting", best) if best else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    equal = [(row, f"{policy}_C{row['equal_memory_c']}") for row in report["table"] if row.get("equal_memory_c")
             for policy in report["args"]["ar_policies"]
             if f"ratio_sd0_over_ar_{policy}_C{row['equal_memory_c']}" in row]
    if equal:  # the paper's comparison: AR given the slot memory the speculative engine used at its peak
        lines += ["", "SD against each AR policy at the speculative engine's peak slot memory (C = P + U_max, U_max the "
                  "most union slots a block's layer used), the same intervals:", "",
                  "| source | selector | k | AR config | AR ms/token (copies) | SD / AR (zero drafting) |"
                  + (" SD with drafting / AR |" if draft_ms else ""),
                  "|---|---|---|---|---|---|" + ("---|" if draft_ms else "")]
        for row, label in equal:
            cells = [row["source"], row["selector"], str(row["k"]), label,
                     f"{row[f'ar_{label}_ms_per_token']:.3f} ({row[f'ar_{label}_copies_per_token']:.2f})",
                     ratio_cell(row, "sd0", label)] + ([ratio_cell(row, "sd_drafting", label)] if draft_ms else [])
            lines.append("| " + " | ".join(cells) + " |")
    ar = {}
    for row in report["table"]:
        for label in report["ar_configs"]:
            if f"ar_{label}_ms_per_token" in row:
                ar.setdefault((row["source"], label), (row[f"ar_{label}_ms_per_token"],
                                                       row[f"ar_{label}_compute_ms_per_token"],
                                                       row[f"ar_{label}_copies_per_token"],
                                                       row.get(f"ar_{label}_routing", "?"),
                                                       row.get(f"ar_{label}_schedule_floor_ms")))
    if ar:
        lines += ["", "AR rows as the engine builds them by default; path: where their policy ran (device_policy: the "
                  "logical cache on the device, one graph per token; host: a round trip per layer; "
                  "EngineConfig.policy_device):", "",
                  "| source | AR config | path | ms/token | compute-only ms/token | copies/token | schedule floor ms "
                  "(ms / floor) |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {source} | {label} | {path} | {ms:.3f} | {skip:.3f} | {copies:.2f} | "
                  + ("-" if floor is None else f"{floor:.3f} ({ms / floor:.2f})") + " |"
                  for (source, label), (ms, skip, copies, path, floor) in ar.items()]
    paths = [row for row in report["table"] if "ratio_host_blocks_over_device" in row]
    if paths:
        lines += ["", "Verification blocks on the host / on the device (ms per committed token, same rounds):", "",
                  "| source | selector | k | device ms/token | host / device |", "|---|---|---|---|---|"]
        lines += [f"| {row['source']} | {row['selector']} | {row['k']} | {row['ms_per_token']:.3f} | "
                  f"{row['ratio_host_blocks_over_device']['ratio']:.3f} ({row['ratio_host_blocks_over_device']['lo']:.3f}"
                  f"-{row['ratio_host_blocks_over_device']['hi']:.3f}) |" for row in paths]
    steps = [row for row in report["table"] if "block_compute_over_target_step" in row]
    if steps:
        target = float(np.mean(report["rounds_ms"]["target_step"]))
        lines += ["", f"Verification blocks' compute (copies skipped) in target steps (the target's all-resident decode "
                  f"step, {report.get('target_routing', '?')} routing: {target:.3f} ms; 95% interval over rounds):", "",
                  "| configuration | k | compute ms per block | block / target step |", "|---|---|---|---|"]
        lines += [f"| {row['key']} | {row['k']} | {row['compute_ms_per_block']:.3f} | "
                  f"{row['block_compute_over_target_step']['ratio']:.2f} ({row['block_compute_over_target_step']['lo']:.2f}"
                  f"-{row['block_compute_over_target_step']['hi']:.2f}) |" for row in steps]
    if report.get("timeline"):
        lines += ["", "Per-block timeline (--timeline, after the rounds; ms per verification block, drafting at "
                  "--draft-ms). Host path: one instrumented pass; idle other is the GPU's idle time between a layer's "
                  "two graphs less the copy wait and the host parts, compute the block less that idle time. Device "
                  "path: the block's wall time from a plain pass, its kernels from a profiled one, by class: "
                  "selection and compute their kernels' time, copy wait the time copies run with no other kernel, "
                  "idle other the rest of the wall time; copies hidden is the copies' time beside other kernels, "
                  "not in the step:", "",
                  "| configuration | path | " + " | ".join(TIMELINE_PARTS) + " | copies hidden | step ms per committed "
                  "token |", "|---|---|" + "---|" * (len(TIMELINE_PARTS) + 2)]
        lines += [f"| {key} | {line['verify']} | " + " | ".join(f"{line[part]:.3f}" for part in TIMELINE_PARTS)
                  + (f" | {line['copies_hidden']:.3f}" if "copies_hidden" in line else " | -")
                  + f" | {line['per_token']['step']:.3f} |" for key, line in report["timeline"].items()]
    if report.get("warnings"):
        lines += ["", "Notes:"] + [f"- {w}" for w in report["warnings"]]
    if report["errors"]:
        lines += ["", "Errors:"] + [f"- {e.splitlines()[0]}" for e in report["errors"]]
    return "\n".join(lines) + "\n"

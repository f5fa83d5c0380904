#!/usr/bin/env python
"""Fuzz a running server over its own OpenAPI document (schemathesis), and count what must never happen:
responses with status 500 or above, and requests that hang (no answer within --request-timeout).

Schemathesis reads GET /openapi.json and, for every operation in it, sends valid requests and requests
that break the schema in one place each (boundary values, wrong types, missing fields), from a fixed
seed and example budget, so two runs with the same flags send the same requests. Valid generation
requests are capped to a few output tokens and choices (benchmarks/fuzz_hooks.py). Prints a table per
operation and writes JSON.

    python benchmarks/fuzz_openapi.py --base-url http://127.0.0.1:8000 --api-key KEY \
        --max-examples 200 --seed 0 --output results/fuzz.json

Exits 0 when no response was a server error and none hung, 1 otherwise (2 when schemathesis itself failed).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HOOKS = Path(__file__).resolve().with_name("fuzz_hooks.py")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    parser.add_argument("--max-examples", type=int, default=25, help="test cases per operation and phase")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--phases", default="coverage,fuzzing", help="schemathesis phases to run")
    parser.add_argument("--request-timeout", type=float, default=30.0,
                        help="seconds a request may take before it counts as hung")
    parser.add_argument("--workers", type=int, default=1, help="requests in flight at once")
    parser.add_argument("--output", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.max_examples < 1 or args.request_timeout <= 0 or args.workers < 1:
        parser.error("--max-examples and --workers must be at least 1, --request-timeout positive")
    result = fuzz(args)
    print(table(result))
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=2) + "\n")
    if result["status"] != "complete":
        return 2
    return 0 if result["server_errors"] == 0 and result["hangs"] == 0 else 1


def fuzz(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="flare-fuzz-") as reports:
        command = [sys.executable, "-m", "schemathesis.cli", "run", args.base_url.rstrip("/") + "/openapi.json",
                   "--checks", "not_a_server_error", "--max-examples", str(args.max_examples),
                   "--seed", str(args.seed), "--phases", args.phases, "--workers", str(args.workers),
                   "--request-timeout", str(args.request_timeout), "--generation-database", "none",
                   "--no-shrink", "--no-color",
                   "--report", "ndjson,json", "--report-dir", reports]
        if args.api_key:
            command += ["--header", f"Authorization: Bearer {args.api_key}"]
        environment = dict(os.environ, SCHEMATHESIS_HOOKS=str(HOOKS))
        # run inside the temporary folder: schemathesis keeps a crash cache (.schemathesis/) where it runs
        done = subprocess.run(command, env=environment, capture_output=True, text=True, cwd=reports)
        summaries = glob.glob(os.path.join(reports, "*.json"))
        events = glob.glob(os.path.join(reports, "*.ndjson"))
        if not summaries or not events:
            return {"status": "failed", "exit_code": done.returncode, "output": done.stdout[-4000:] + done.stderr[-4000:]}
        summary = json.loads(Path(summaries[0]).read_text())
        operations = _per_operation(Path(events[0]))
    return {
        "status": "complete" if summary.get("complete") else "incomplete",
        "seed": args.seed, "max_examples": args.max_examples, "phases": args.phases,
        "request_timeout_s": args.request_timeout, "running_time_s": summary.get("running_time"),
        "test_cases": summary.get("test_cases", {}).get("generated", 0),
        "server_errors": sum(entry["server_errors"] for entry in operations.values()),
        "hangs": sum(entry["hangs"] for entry in operations.values()),
        "failures": summary.get("failures", []), "errors": summary.get("errors", []),
        "operations": operations,
    }


def _per_operation(events: Path) -> dict[str, dict]:
    """Per operation, from the event stream: cases; responses by status class; server errors; hangs (requests
    that got no response within the timeout); and the network errors schemathesis reported."""
    operations: dict[str, dict] = {}

    def entry(label: str) -> dict:
        return operations.setdefault(label, {"cases": 0, "2xx": 0, "4xx": 0, "server_errors": 0, "hangs": 0,
                                             "network_errors": []})

    for line in events.read_text().splitlines():
        event = json.loads(line)
        if "NonFatalError" in event:
            error = event["NonFatalError"]
            entry(error.get("label", "?"))["network_errors"].append(error["value"])
        finished = event.get("ScenarioFinished")
        if finished is None:
            continue
        recorder = finished["recorder"]
        counts = entry(recorder["label"])
        counts["cases"] += len(recorder.get("cases", {}))
        for interaction in recorder.get("interactions", {}).values():
            status = (interaction.get("response") or {}).get("status_code")
            if status is None:
                counts["hangs"] += 1
            elif status >= 500:
                counts["server_errors"] += 1
            elif status >= 400:
                counts["4xx"] += 1
            else:
                counts["2xx"] += 1
    return operations


def table(result: dict) -> str:
    if result["status"] == "failed":
        return f"schemathesis failed (exit code {result['exit_code']}):\n{result['output']}"
    lines = [f"{'operation':<32} {'cases':>6} {'2xx':>6} {'4xx':>6} {'>=500':>6} {'hangs':>6}"]
    for name, entry in sorted(result["operations"].items()):
        lines.append(f"{name:<32} {entry['cases']:>6} {entry['2xx']:>6} {entry['4xx']:>6} "
                     f"{entry['server_errors']:>6} {entry['hangs']:>6}")
    lines.append(f"{result['test_cases']} test cases (seed {result['seed']}, {result['max_examples']} examples per "
                 f"operation and phase) in {result['running_time_s'] or 0:.0f} s: {result['server_errors']} responses "
                 f">= 500, {result['hangs']} hangs, {len(result['errors'])} other errors")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

"""Speculation in packages: an export records its speculative catalog (B/D/W/P) in the plan, and
`flare inspect` shows it; --no-mtp records none."""

from __future__ import annotations

import json

from flare.cli.flare import main as flare_main
from flare.speculation_plan import PreparationFlags as Flags


def test_an_export_records_the_plan_and_inspect_shows_the_catalog(export, capsys):
    entry = export(max_concurrency=4, speculation=Flags(draft_tokens=3, token_capacity=8))
    assert flare_main(["inspect", str(entry), "--json", "--graphs"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["speculation"] == {"draft_tokens": 3, "adaptive": True, "token_capacity": 8,
                                     "history_drafts": True, "draft_model": None}
    programs = report["graphs"][0]["speculative_programs"]["programs"]
    assert [(p["batch"], p["drafts"], p["width"], p["rows"]) for p in programs] == [
        (1, 1, 2, 2), (1, 2, 3, 3), (1, 3, 4, 4), (2, 1, 2, 4), (2, 2, 3, 6), (2, 3, 4, 8), (4, 1, 2, 8)]
    assert flare_main(["inspect", str(entry), "--graphs"]) == 0
    assert "B/D/W/P 1/1/2/2" in capsys.readouterr().out
    assert export(speculation=Flags(no_mtp=True)) is not None
    assert flare_main(["inspect", str(export(speculation=Flags(no_mtp=True))), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["speculation"] is None
